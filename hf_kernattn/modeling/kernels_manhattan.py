"""Attention with a 2D bias of the clipped Manhattan distance (Horn et al. 2021), in O(N K^2).

Formula, on a row-major ``(Hg, Wg)`` token grid with ``d_ij = min(|dy| + |dx|, K)`` for the
offsets ``dy = y_j - y_i``, ``dx = x_j - x_i`` and ``c_d = exp(b_d)``::

    out_i = sum_j c_{d_ij} (q_i . k_j) v_j / (sum_j c_{d_ij} (q_i . k_j) + eps)

Every key at distance ``>= K`` carries ``c_K``, so the sums split into a far term over all keys
and a near sum over the ``2K^2 - 2K + 1`` offsets closer than K::

    Y_i = c_K q_i [S, z] + sum_{|dy|+|dx| < K} (c_d - c_K) (q_i . k_{i+delta}) [v_{i+delta}, 1]

with ``[S, z] = sum_j k_j^T [v_j, 1]``; ``out_i = Y_i[:D] / (Y_i[D] + eps)``. Keys outside the
grid are zeros (they add nothing), so each offset is one shifted view of a zero-padded copy.

Cost: time O(N K^2 (M + D) + N M D), memory O(N (M + D)) (one offset at a time), against
O(N^2 M) for the dense form. :func:`manhattan_table` turns a per-distance table into the 2D bias
``(H, 2Hg-1, 2Wg-1)`` the other backends take; :func:`manhattan_distances` reads the per-distance
values back from such a bias (the backend's input).
"""

from __future__ import annotations

import torch

from .kernels_common import full_precision, shifted_bias, with_ones_column


def manhattan_index(grid_h: int, grid_w: int, clip: int, device=None) -> torch.Tensor:
    """``(2Hg-1, 2Wg-1)`` long tensor: ``min(|dy| + |dx|, K)`` for every 2D offset."""
    dy = torch.arange(-(grid_h - 1), grid_h, device=device).abs()
    dx = torch.arange(-(grid_w - 1), grid_w, device=device).abs()
    return (dy[:, None] + dx[None, :]).clamp(max=clip)


def manhattan_table(distance_bias: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Per-distance bias ``(H, K+1)`` (entry d holds ``b_d``, the last one every distance >= K)
    -> the 2D bias ``(H, 2Hg-1, 2Wg-1)`` of the clipped Manhattan distance."""
    clip = distance_bias.shape[-1] - 1
    return distance_bias[:, manhattan_index(grid_h, grid_w, clip, distance_bias.device)]


def manhattan_distances(rpe_bias: torch.Tensor, grid_h: int, grid_w: int, clip: int) -> torch.Tensor:
    """The per-distance values ``(H, K+1)`` of a 2D bias of the clipped Manhattan distance, each
    read at one offset of that distance (``dy = min(d, Hg-1)``, ``dx = d - dy``); distances no
    pair of the grid reaches get the farthest reachable one's (no key uses them)."""
    reach = (grid_h - 1) + (grid_w - 1)
    d = torch.arange(clip + 1, device=rpe_bias.device).clamp(max=reach)
    dy = d.clamp(max=grid_h - 1)
    return rpe_bias[:, grid_h - 1 + dy, grid_w - 1 + (d - dy)]


@full_precision
def manhattan_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: torch.Tensor,
    grid: tuple[int, int],
    rpe_clip: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Non-causal attention on a ``grid = (Hg, Wg)`` with a 2D bias ``(H, 2Hg-1, 2Wg-1)`` that
    depends only on ``min(|dy| + |dx|, K)``, ``K = rpe_clip`` (see the module docstring), or
    with that bias as its per-distance table ``(H, K+1)`` (entry d holds ``b_d``).

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype (``N = Hg Wg``), padded keys and values
    already zero. Returns ``(B, H, N, D)``. Gradients of the bias land on the entries
    :func:`manhattan_distances` reads (one per distance: the gradient of a per-distance table
    the bias was built from is the same as with the dense form).
    """
    b, h, n, m = q.shape
    d = v.shape[-1]
    hg, wg = grid
    clip = int(rpe_clip)
    if rpe_bias.dim() == 2:  # the per-distance table; distances no pair reaches take the farthest reachable one's
        dist = rpe_bias[:, torch.arange(clip + 1, device=rpe_bias.device).clamp(max=hg - 1 + wg - 1)]
    else:
        dist = manhattan_distances(rpe_bias, hg, wg, clip)  # (H, K+1)
    dist, eps_h = shifted_bias(dist, clip + 1, False, eps)  # every coefficient <= 1; the shift cancels
    c = torch.exp(dist)
    eps_h = eps_h[None, :, None]  # (1, H, 1)
    v1 = with_ones_column(v)  # (B, H, N, D+1)
    # far term: every key with c_K
    y = c[None, :, clip, None, None] * (q @ (k.transpose(-1, -2) @ v1))  # (B, H, N, D+1)
    if clip > 0:
        qg = q.reshape(b, h, hg, wg, m)
        kp = torch.nn.functional.pad(k.reshape(b, h, hg, wg, m), (0, 0, clip, clip, clip, clip))
        vp = torch.nn.functional.pad(v1.reshape(b, h, hg, wg, d + 1), (0, 0, clip, clip, clip, clip))
        near = torch.zeros(b, h, hg, wg, d + 1, dtype=q.dtype, device=q.device)
        for dy in range(-(clip - 1), clip):
            for dx in range(-(clip - 1 - abs(dy)), clip - abs(dy)):
                w = (c[:, abs(dy) + abs(dx)] - c[:, clip])[None, :, None, None, None]  # (1, H, 1, 1, 1)
                ks = kp[:, :, clip + dy : clip + dy + hg, clip + dx : clip + dx + wg]
                vs = vp[:, :, clip + dy : clip + dy + hg, clip + dx : clip + dx + wg]
                near = near + w * (qg * ks).sum(-1, keepdim=True) * vs
        y = y + near.reshape(b, h, n, d + 1)
    return y[..., :d] / (y[..., d:] + eps_h[..., None])
