"""Windowed attention: exact for a 1D relative-position bias clipped at ``K``, in O(N K).

With ``r = j - i``, ``c_r = exp(b_r)`` and ``b_r = b_{-K}`` for ``r < -K``, ``b_K`` for ``r > K``::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal). With chunks of ``C`` tokens and ``s C >= K``
(:func:`window_geometry`), a query in chunk a weighs the keys of chunks ``a-s .. a+s`` exactly
(one ``C x (2s+1)C`` block); all keys of chunks ``<= a-s-1`` share ``c_{-K}`` and those of
chunks ``>= a+s+1`` share ``c_K``, entering through prefix / suffix sums of chunk states
``sum_j k_j^T [v_j, 1]`` (:func:`_far_states`). Gradients of the far region land on entries
``+-K``.

Cost: time O(N (2K + C) (M + D) + N M D), memory O(N (M + D) + (N / C) M D): linear in N.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint

from .kernels_common import chunk_tokens, clipped_table, full_precision, shifted_bias, with_ones_column
from .state import AttentionState, fold_into_state


def band_blocks(n: int, c: int, s: int, causal: bool, start: int = 0):
    """Per chunk of ``c`` queries at key positions ``[a0, a1)`` (from ``start``; earlier keys are
    context): query rows ``[r0, r1)``, keys ``[lo, hi)`` (chunks ``a-s .. a+s``, causal ``.. a``),
    their columns ``[c0, c1)`` of the weight block, and the far state's index."""
    for a0 in range(start, n, c):
        a1 = min(a0 + c, n)
        first = a0 - s * c
        lo, hi = max(0, first), min(n, a0 + c if causal else a0 + (s + 1) * c)
        yield a0 - start, a1 - start, lo, hi, lo - first, hi - first, (a0 - start) // c


class BandedKernelProduct(torch.autograd.Function):
    """``Y_i = sum_j w[i, j] (q_i . k_j) [v_j, 1] + q_i F_a`` over the band of query i's chunk a
    (``F_a`` its far sums); returns ``Y_i[:D] / (Y_i[D] + eps)``, with a hand-written backward.

    ``q (B, H, N, M)``, ``k (B, H, P + N, M)``, ``v (B, H, P + N, D+1)``: query i at key position
    ``P + i`` (``P = start``, a multiple of C); ``weight (H, C, W)``, ``W = (2s+1) C`` (causal
    ``(s+1) C``), row t, column u: key position ``aC + t`` against key ``aC - sC + u``; ``far (B, H,
    ceil(N / C), M, D+1)`` or None; ``eps`` a float or ``(H,)``. Returns ``(B, H, N, D)`` stored
    heads-last (merging heads needs no copy). One chunk at a time: no ``N x W`` tensor; the backward
    recomputes each block once.
    """

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v, weight, far, c, s, causal, eps, start=0):  # type: ignore[override]
        b, h, n, m = q.shape
        e, nk = v.shape[-1], k.shape[2]
        q3 = q.reshape(b * h, n, m)
        k3, v3 = (x.reshape(b * h, nk, x.shape[-1]) for x in (k, v))
        w3 = weight.repeat(b, 1, 1)  # (B*H, C, W), batch index b*H + h like q3
        far3 = None if far is None else far.reshape(b * h, -1, m, e)
        if isinstance(eps, torch.Tensor):  # per head (H,) -> per batch row b*H + h
            eps = eps.to(q3.dtype).repeat(b)[:, None, None]
        # heads-last storage: merging the heads afterwards (B, N, H*D) is a view, not a copy
        out = q3.new_empty(b, n, h, e - 1).permute(0, 2, 1, 3)
        den = q3.new_empty(b * h, n, 1)
        for a0, a1, lo, hi, c0, c1, f in band_blocks(nk, c, s, causal, start):
            qa = q3[:, a0:a1]
            scores = torch.bmm(qa, k3[:, lo:hi].transpose(1, 2)).mul_(w3[:, : a1 - a0, c0:c1])
            if far3 is None:
                ya = torch.bmm(scores, v3[:, lo:hi])
            else:
                ya = torch.baddbmm(torch.bmm(qa, far3[:, f]), scores, v3[:, lo:hi])
            den[:, a0:a1] = ya[..., -1:] + eps
            out[:, :, a0:a1] = (ya[..., :-1] / den[:, a0:a1]).view(b, h, a1 - a0, e - 1)
        ctx.save_for_backward(q3, k3, v3, w3, far3, out, den)
        ctx.geometry = (b, c, s, causal, start)
        return out

    @staticmethod
    @full_precision
    def backward(ctx, dout):  # type: ignore[override]
        q3, k3, v3, w3, far3, out, den = ctx.saved_tensors
        b, c, s, causal, start = ctx.geometry
        bh, nk = k3.shape[:2]
        need_q, need_k, need_v, need_w, need_far = ctx.needs_input_grad[:5]
        dq = torch.empty_like(q3) if need_q else None  # every block of dq and dfar is written once
        dk = torch.zeros_like(k3) if need_k else None
        dv = torch.zeros_like(v3) if need_v else None
        dw = torch.zeros_like(w3) if need_w else None
        dfar = torch.empty_like(far3) if need_far and far3 is not None else None
        for a0, a1, lo, hi, c0, c1, f in band_blocks(nk, c, s, causal, start):
            qa, kw, vw = q3[:, a0:a1], k3[:, lo:hi], v3[:, lo:hi]
            # out = num / den: d num = d out / den, d den = -(d out . out) / den
            do_a = dout[:, :, a0:a1].reshape(bh, a1 - a0, -1)
            den_a = den[:, a0:a1]
            dya = torch.cat([do_a, -(do_a * out[:, :, a0:a1].reshape(bh, a1 - a0, -1)).sum(-1, keepdim=True)], dim=-1)
            dya /= den_a
            w = w3[:, : a1 - a0, c0:c1]
            scores = torch.bmm(qa, kw.transpose(1, 2))
            dp = torch.bmm(dya, vw.transpose(1, 2))  # gradient of the weighted scores
            if need_w:
                dw[:, : a1 - a0, c0:c1].addcmul_(dp, scores)
            if need_v:
                dv[:, lo:hi] += torch.bmm(scores.mul_(w).transpose(1, 2), dya)
            ds = dp.mul_(w)
            if need_q:
                if far3 is None:
                    dq[:, a0:a1] = torch.bmm(ds, kw)
                else:
                    dq[:, a0:a1] = torch.baddbmm(torch.bmm(dya, far3[:, f].transpose(1, 2)), ds, kw)
            if need_k:
                dk[:, lo:hi] += torch.bmm(ds.transpose(1, 2), qa)
            if dfar is not None:
                dfar[:, f] = torch.bmm(qa.transpose(1, 2), dya)
        grads = [None if x is None else x.view(b, -1, *x.shape[1:]) for x in (dq, dk, dv, dw, dfar)]
        if grads[3] is not None:
            grads[3] = grads[3].sum(0)  # the weight is shared across the batch
        return (*grads, None, None, None, None, None)



def banded_kernel_product_reference(q, k, v, weight, far, c, s, causal, eps, start=0):
    """:class:`BandedKernelProduct` plainly, with ordinary autograd: per chunk
    ``Y = (w * (q k_band^T)) v_band + q F_a``, then ``Y[:D] / (Y[D] + eps)``. Same arguments;
    contiguous ``(B, H, N, D)``."""
    if isinstance(eps, torch.Tensor):
        eps = eps[None, :, None, None]
    rows = []
    for a0, a1, lo, hi, c0, c1, f in band_blocks(k.shape[2], c, s, causal, start):
        qa = q[:, :, a0:a1]
        ya = (qa @ k[:, :, lo:hi].transpose(-1, -2) * weight[:, : a1 - a0, c0:c1]) @ v[:, :, lo:hi]
        if far is not None:
            ya = ya + qa @ far[:, :, f]
        rows.append(ya)
    y = torch.cat(rows, dim=2)
    return y[..., :-1] / (y[..., -1:] + eps)


def _far_states(
    k: torch.Tensor, v1: torch.Tensor, c_left: torch.Tensor, c_right: Optional[torch.Tensor], c: int, s: int
) -> torch.Tensor:
    """``F_a = c_left sum_{chunks <= a-s-1} k^T v1 + c_right sum_{chunks >= a+s+1} k^T v1`` per
    chunk of ``c`` tokens: ``k (B, H, N, M)``, ``v1 (B, H, N, E)``, ``c_left``, ``c_right (H,)``
    (``c_right`` None when causal) -> ``(B, H, ceil(N / c), M, E)``."""
    states = chunk_tokens(k, c).transpose(-1, -2) @ chunk_tokens(v1, c)  # (B, H, nc, M, E)
    nc = states.shape[2]
    zero = torch.zeros_like(states[:, :, : s + 1])
    prefix = torch.cumsum(states, dim=2)
    far = c_left[None, :, None, None, None] * torch.cat([zero, prefix[:, :, : nc - s - 1]], dim=2)
    if c_right is not None:
        suffix = torch.flip(torch.cumsum(torch.flip(states, dims=[2]), dim=2), dims=[2])
        far = far + c_right[None, :, None, None, None] * torch.cat([suffix[:, :, s + 1 :], zero], dim=2)
    return far


def window_geometry(clip: int, chunk_size: int, min_chunk: int = 32) -> tuple[int, int]:
    """``(C, s)`` for a bias clipped at ``clip``: the smallest ``s`` with ``C = ceil(clip / s) <=
    chunk_size``, so ``s C >= clip`` and the band is about ``2 clip + C`` wide. A short clip still
    gets ``min(min_chunk, chunk_size)`` tokens: each chunk is one Python step."""
    if clip <= chunk_size:
        return max(clip, min(min_chunk, chunk_size), 1), 1
    s = -(-clip // chunk_size)
    return -(-clip // s), s


@full_precision
def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: torch.Tensor,
    rpe_clip: int,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 128,
    initial_state: Optional[AttentionState] = None,
    output_final_state: bool = False,
):
    """Exact attention for a 1D bias constant beyond ``|r| > K = rpe_clip`` (see the module docstring).

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` and ``rpe_bias`` of one dtype, padded keys and values
    zero; ``rpe_bias`` the clipped table ``(H, 2K+1)`` (entry ``r + K``) or the full ``(H, 2N-1)``.
    Returns ``(B, H, N, D)``; with ``output_final_state`` ``(out, AttentionState)``.

    Causal calls continue from ``initial_state``: its window of the last ``K - 1`` keys goes
    before the new tokens (padded to whole chunks) and its ``(S, z)`` joins every chunk's far sum,
    so many new tokens cost O((N + K) K), as a stateless call does.
    """
    if not causal and (initial_state is not None or output_final_state):
        raise ValueError("initial_state / output_final_state need causal=True: only causal attention has a state to carry")
    n, dt = q.shape[2], q.dtype
    big_k = int(rpe_clip)
    window = max(big_k - 1, 0)
    context = window if initial_state is not None else 0  # keys before the first query
    c, s = window_geometry(max(0, min(big_k, context + n - 1)), chunk_size)
    rpe_bias = clipped_table(rpe_bias, q.shape[2], big_k, continuing=initial_state is not None)
    bias, eps_h = shifted_bias(rpe_bias, big_k + 1, causal, eps)  # eps_h: (H,)
    v1 = with_ones_column(v)
    keys, vals1, start = k, v1, 0
    if initial_state is not None:  # the window's keys, rounded up to whole chunks, go first
        start = -(-window // c) * c
        pad = (0, 0, start - window, 0)
        keys = torch.cat([torch.nn.functional.pad(initial_state.window_k, pad), k], dim=2)
        vals1 = torch.cat([torch.nn.functional.pad(with_ones_column(initial_state.window_v), pad), v1], dim=2)
    nk = keys.shape[2]
    # weight[t, u] = exp(b_r) for query t of a chunk and key u of its band, r = u - s C - t
    t = torch.arange(min(c, n), device=q.device)
    u = torch.arange((s + 1 if causal else 2 * s + 1) * c, device=q.device)
    offsets = u[None, :] - s * c - t[:, None]  # (C, W)
    weight = torch.exp(bias[:, offsets.clamp(-big_k, big_k) + big_k])  # (H, C, W)
    if causal:
        weight = weight * (offsets <= 0).to(dt)
    far = None
    c_left = torch.exp(bias[:, 0])
    if -(-nk // c) > s + 1:  # some chunks lie beyond the band: the far region, through chunk states
        c_right = None if causal else torch.exp(bias[:, 2 * big_k])
        args = (keys, vals1, c_left, c_right, c, s)
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args[:4]):
            # recomputed in the backward pass: only k and v1 are kept, not the O((N / C) M E) sums
            far = torch.utils.checkpoint.checkpoint(_far_states, *args, use_reentrant=False)
        else:
            far = _far_states(*args)
        far = far[:, :, start // c :]
    if initial_state is not None:  # keys before the window: c_{-K} for every new query
        old = c_left[None, :, None, None] * torch.cat([initial_state.kv, initial_state.z[..., None]], dim=-1)
        far = old[:, :, None] if far is None else far + old[:, :, None]
        far = far.expand(-1, -1, -(-n // c), -1, -1)
    out = BandedKernelProduct.apply(q.contiguous(), keys.contiguous(), vals1.contiguous(), weight, far, c, s, causal, eps_h, start)
    if not output_final_state:
        return out
    return out, fold_into_state(initial_state, k, v, k, window)
