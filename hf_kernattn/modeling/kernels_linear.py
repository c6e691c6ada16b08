"""Linear attention without a position-dependent weight: non-causal, causal chunked, recurrent.

Formula (``c_r = 1`` for every offset ``r = j - i``, unless a 1D bias is given to the recurrent
form)::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

With ``c = 1`` the sums factor through the state ``S = sum_j k_j^T v_j (M x D)`` and
``z = sum_j k_j (M)``: ``out_i = q_i S / (q_i . z + eps)``, over all keys (non-causal) or the
keys ``j <= i`` (causal: ``S`` and ``z`` become running sums).

* :func:`linear_attention`: non-causal, ``q (k^T v) / (q . sum_j k_j + eps)``. Time O(N M D),
  memory O(N (M + D) + M D).
* :func:`causal_linear_sums` / :func:`causal_chunked_attention`: causal; exact ``C x C`` blocks
  inside chunks of ``C`` tokens plus the state of the earlier chunks. Time
  O(N C (M + D) + N M D), memory O(N (M + D) + (N / C) M D): never quadratic in N.
* :func:`recurrent_step` / :func:`recurrent_attention`: causal, one token at a time on the state
  ``(S, z)``: O(M D) time and memory per token (the decoding form). With a 1D bias the weights
  differ per query and each step re-reads the past: O(t (M + D)) at step t, O(N^2 (M + D)) in all.

Inputs as described in ``kernels_common``: one dtype, padded keys and values already zero.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels_common import chunk_tokens, full_precision, shifted_bias, with_ones_column


@full_precision
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Non-causal linear attention without RPE: ``q (k^T v) / (q . sum_j k_j + eps)``.
    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` -> ``(B, H, N, D)``."""
    kv = k.transpose(-1, -2) @ v  # (B, H, M, D)
    z = k.sum(dim=-2)  # (B, H, M)
    num = q @ kv
    den = (q * z[:, :, None, :]).sum(dim=-1, keepdim=True)
    return num / (den + eps)


@full_precision
def causal_linear_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Unnormalised causal sums ``Y_i = sum_{j <= i} (q_i . k_j) v_j`` in chunked O(N) form.

    The sequence is cut into chunks of ``C``. Inside a chunk the (C x C) causal matrix is exact;
    across chunks each chunk reads ``S = sum_{earlier chunks} k_j^T v_j`` (an exclusive prefix
    sum over chunk states). Time O(N C (M + D) + N M D), memory O(N (M + D) + (N / C) M D).

    Args:
        q, k: ``(B, H, N, M)``; v: ``(B, H, N, D)`` (one dtype).
    Returns:
        ``(B, H, N, D)``.
    """
    n, d = q.shape[2], v.shape[-1]
    c = max(1, min(chunk_size, n))
    qc, kc, vc = chunk_tokens(q, c), chunk_tokens(k, c), chunk_tokens(v, c)
    chunk_states = kc.transpose(-1, -2) @ vc  # (B, H, nc, M, D)
    prefix = torch.cumsum(chunk_states, dim=2) - chunk_states  # states of strictly earlier chunks
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(tri, qc @ kc.transpose(-1, -2), torch.zeros((), dtype=q.dtype, device=q.device))
    y = qc @ prefix + scores @ vc  # (B, H, nc, C, D)
    return y.reshape(q.shape[0], q.shape[1], -1, d)[:, :, :n]


@full_precision
def causal_chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float = 1e-6, chunk_size: int = 64
) -> torch.Tensor:
    """Causal linear attention in chunked form (:func:`causal_linear_sums` over ``[v, 1]``):
    never quadratic in N. ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` -> ``(B, H, N, D)``."""
    d = v.shape[-1]
    y = causal_linear_sums(q, k, with_ones_column(v), chunk_size)
    return y[..., :d] / (y[..., d:] + eps)


@full_precision
def recurrent_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: torch.Tensor,
    normalizer: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One RNN step of causal linear attention.

    Args:
        q_t, k_t: ``(B, H, M)`` features of the new token (k already masked if it is padding).
        v_t: ``(B, H, D)``.
        state: S ``(B, H, M, D)``; normalizer: z ``(B, H, M)`` (float32 at least).
    Returns:
        ``(out_t (B, H, D), S + k_t v_t^T, z + k_t)``.
    """
    state = state + k_t[..., :, None] * v_t[..., None, :]
    normalizer = normalizer + k_t
    num = (q_t[..., None, :] @ state)[..., 0, :]
    den = (q_t * normalizer).sum(dim=-1, keepdim=True)
    return num / (den + eps), state, normalizer


@full_precision
def recurrent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Causal attention as an RNN, one token at a time.

    Without RPE it carries only ``(S, z)`` (constant memory per step). With a 1D bias
    ``(H, 2N-1)`` the weights ``c_{j-i}`` differ for every query, so each step re-reads the past
    keys and values: exact, with a per-step cost that grows with the context.
    """
    b, h, n, m = q.shape
    d = v.shape[-1]
    outs = []
    if rpe_bias is None:
        state = q.new_zeros(b, h, m, d)
        norm = q.new_zeros(b, h, m)
        for t in range(n):
            o, state, norm = recurrent_step(q[:, :, t], k[:, :, t], v[:, :, t], state, norm, eps)
            outs.append(o)
        return torch.stack(outs, dim=2)
    bias, eps_h = shifted_bias(rpe_bias, n, True, eps)
    c = torch.exp(bias)  # (H, 2N-1), every used coefficient <= 1
    eps_h = eps_h[None, :, None]  # (1, H, 1)
    for t in range(n):
        w = c[:, n - 1 - t : n][None]  # offsets -t..0 for keys 0..t: (1, H, t+1)
        s = (k[:, :, : t + 1] @ q[:, :, t, :, None])[..., 0] * w  # (B, H, t+1)
        outs.append((s[..., None] * v[:, :, : t + 1]).sum(dim=2) / (s.sum(-1, keepdim=True) + eps_h))
    return torch.stack(outs, dim=2)
