"""Windowed attention: exact for a 1D relative-position bias clipped at ``K``, in O(N K).

Formula (``r = j - i``, ``c_r = exp(b_r)``, with ``b_r = b_{-K}`` for ``r < -K`` and ``b_r = b_K``
for ``r > K``)::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal). Keys within the band ``|r| <= K`` (rounded up
to whole chunks) get their exact weights; all keys beyond it share ``c_{-K}`` (left) or ``c_K``
(right) and enter through prefix / suffix sums of chunk states ``sum_j k_j^T [v_j, 1]``.

Cost: time O(N (2K + C) (M + D) + N M D), memory O(N (M + D) + (N / C) M D) for chunks of
``C`` tokens: linear in N.

:class:`BandedKernelProduct` is the op with its hand-written backward;
:func:`banded_kernel_product_reference` is the same product written plainly with ordinary
autograd, the reference its tests compare with.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint

from .kernels_common import chunk_tokens, clipped_table, full_precision, shifted_bias, with_ones_column
from .state import AttentionState, fold_into_state


def band_blocks(n: int, c: int, s: int, causal: bool, start: int = 0):
    """The blocks of the band over ``n`` keys: for each chunk of ``c`` queries at key positions
    ``[a0, a1)`` (from ``start``, a multiple of ``c``: the keys before it are earlier context
    without queries), its rows ``[r0, r1) = [a0 - start, a1 - start)`` of the query tensor, its
    keys ``[lo, hi)`` (chunks ``a-s .. a+s``, or ``a-s .. a`` when causal, cut to ``[0, n)``),
    the columns ``[c0, c1)`` of the ``(C, W)`` weight block that those keys use, and the index
    ``f`` of its far state."""
    for a0 in range(start, n, c):
        a1 = min(a0 + c, n)
        first = a0 - s * c
        lo, hi = max(0, first), min(n, a0 + c if causal else a0 + (s + 1) * c)
        yield a0 - start, a1 - start, lo, hi, lo - first, hi - first, (a0 - start) // c


class BandedKernelProduct(torch.autograd.Function):
    """The work of :func:`windowed_attention`: ``Y_i = sum_j w[i, j] (q_i . k_j) [v_j, 1]`` over
    the keys of the band around query i's chunk a, plus ``q_i F_a`` for the far keys summarised
    in the chunk's matrix ``F_a``; the output is ``Y_i[:D] / (Y_i[D] + eps)``. Hand-written
    backward.

    Shapes: ``q (B, H, N, M)``, ``k (B, H, P + N, M)``, ``v (B, H, P + N, D+1)`` (values with a
    ones column): query i sits at key position ``P + i`` (``P = start``, a multiple of C: keys
    of earlier context); ``weight (H, C, W)`` with ``W = (2s+1) C`` (``(s+1) C`` causal): row t,
    column u weighs the query at key position ``aC + t`` against key ``aC - sC + u``;
    ``far (B, H, ceil(N / C), M, D+1)`` or None; ``eps`` a float or a per-head ``(H,)`` tensor
    (see ``kernels_common.shifted_eps``). Returns ``(B, H, N, D)``, stored heads-last (a
    ``(B, N, H, D)`` tensor seen through a permutation) so the caller's head merge needs no copy.

    The band is walked one chunk of queries at a time, so the ``(C, W)`` score block stays in
    cache and no ``N x W`` tensor (nor shifted copies of k and v) ever exists. Only the inputs,
    the output and the denominators are saved; the backward recomputes each score block once and
    produces every gradient from it.
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
    """What :class:`BandedKernelProduct` computes, plainly, with ordinary autograd: for each
    chunk of queries, ``Y = (w * (q k_band^T)) v_band + q F_a``, then ``Y[:D] / (Y[D] + eps)``.
    Same arguments; returns a contiguous ``(B, H, N, D)``."""
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
    """``F_a = c_left sum_{chunks <= a-s-1} k^T v1 + c_right sum_{chunks >= a+s+1} k^T v1`` for
    every chunk a of ``c`` tokens: ``k (B, H, N, M)``, ``v1 (B, H, N, E)``, ``c_left``/``c_right``
    ``(H,)`` (``c_right`` None when causal) -> ``(B, H, ceil(N / c), M, E)``."""
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
    """Chunk length C and band half-width s (in chunks) for a bias clipped at ``clip``: the
    smallest ``s`` with ``C = ceil(clip / s) <= chunk_size`` (so ``s C >= clip``: the band covers
    every offset up to the clip, and its width ``(2s+1) C`` is about ``2 clip + C``). A short clip
    still gets chunks of ``min(min_chunk, chunk_size)`` tokens: the band is walked one chunk per
    Python step, so chunks of a few tokens would cost more in overhead than the wider band."""
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
    """Exact attention for a 1D bias that is constant beyond ``|r| > K = rpe_clip``.

    ``rpe_bias`` is the clipped table ``(H, 2K+1)`` (entry ``r + K`` holds ``b_r``; farther
    offsets take the end entries) or the full ``(H, 2N-1)`` one. Every key further than K positions to the left of query i
    carries the same weight ``c_{-K}`` (to the right ``c_K``). Cut the sequence into chunks of
    ``C`` tokens with ``s C >= K`` (:func:`window_geometry`). For a query in chunk a, keys in
    chunks ``a-s .. a+s`` get their exact weights from the bias (one ``C x (2s+1)C`` block per
    chunk), every key in chunks ``<= a-s-1`` (all at offsets ``< -K``) enters through the prefix
    sum of chunk states ``sum k^T [v, 1]`` times ``c_{-K}``, every key in chunks ``>= a+s+1``
    through the suffix sum times ``c_K`` (:func:`_far_states`); :class:`BandedKernelProduct`
    does both. Time O(N (2K + C) (M + D) + N M D), memory O(N (M + D) + (N / C) M D).

    Causal calls continue from a state (``initial_state``: the window of the last ``K - 1`` keys
    goes before the new tokens, rounded up to whole chunks with zero keys, and its ``(S, z)``
    joins every chunk's far sum) and return one (``output_final_state``): many new tokens at
    once in the same O((N + K) K) as a stateless call.

    Gradients of the far region land on the bias entries ``+-K`` (what clipping a table does:
    the table's own gradient is then identical to the dense one).

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` and ``rpe_bias`` of one dtype, padded keys and
    values already zero. Returns ``(B, H, N, D)``; with ``output_final_state``
    ``(out, AttentionState)``.
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
