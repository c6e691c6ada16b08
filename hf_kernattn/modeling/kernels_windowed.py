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

from .kernels_common import chunk_tokens, full_precision, shifted_bias, with_ones_column


def band_blocks(n: int, c: int, s: int, causal: bool):
    """The blocks of the band: for each chunk of ``c`` queries ``[a0, a1)``, its keys ``[lo, hi)``
    (chunks ``a-s .. a+s``, or ``a-s .. a`` when causal, cut to ``[0, n)``) and the columns
    ``[c0, c1)`` of the ``(C, W)`` weight block that those keys use."""
    for a0 in range(0, n, c):
        a1 = min(a0 + c, n)
        start = a0 - s * c
        lo, hi = max(0, start), min(n, a0 + c if causal else a0 + (s + 1) * c)
        yield a0, a1, lo, hi, lo - start, hi - start


class BandedKernelProduct(torch.autograd.Function):
    """The work of :func:`windowed_attention`: ``Y_i = sum_j w[i, j] (q_i . k_j) [v_j, 1]`` over
    the keys of the band around query i's chunk a, plus ``q_i F_a`` for the far keys summarised
    in the chunk's matrix ``F_a``; the output is ``Y_i[:D] / (Y_i[D] + eps)``. Hand-written
    backward.

    Shapes: ``q, k (B, H, N, M)``, ``v (B, H, N, D+1)`` (values with a ones column),
    ``weight (H, C, W)`` with ``W = (2s+1) C`` (``(s+1) C`` causal): row t, column u weighs
    query ``aC + t`` against key ``aC - sC + u``; ``far (B, H, ceil(N / C), M, D+1)`` or None;
    ``eps`` a float or a per-head ``(H,)`` tensor (see ``kernels_common.shifted_eps``).
    Returns ``(B, H, N, D)``, stored heads-last (a ``(B, N, H, D)`` tensor seen through a
    permutation) so the caller's head merge needs no copy.

    The band is walked one chunk of queries at a time, so the ``(C, W)`` score block stays in
    cache and no ``N x W`` tensor (nor shifted copies of k and v) ever exists. Only the inputs,
    the output and the denominators are saved; the backward recomputes each score block once and
    produces every gradient from it.
    """

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v, weight, far, c, s, causal, eps):  # type: ignore[override]
        b, h, n, m = q.shape
        e = v.shape[-1]
        q3, k3, v3 = (x.reshape(b * h, n, x.shape[-1]) for x in (q, k, v))
        w3 = weight.repeat(b, 1, 1)  # (B*H, C, W), batch index b*H + h like q3
        far3 = None if far is None else far.reshape(b * h, -1, m, e)
        if isinstance(eps, torch.Tensor):  # per head (H,) -> per batch row b*H + h
            eps = eps.to(q3.dtype).repeat(b)[:, None, None]
        # heads-last storage: merging the heads afterwards (B, N, H*D) is a view, not a copy
        out = q3.new_empty(b, n, h, e - 1).permute(0, 2, 1, 3)
        den = q3.new_empty(b * h, n, 1)
        for a0, a1, lo, hi, c0, c1 in band_blocks(n, c, s, causal):
            qa = q3[:, a0:a1]
            scores = torch.bmm(qa, k3[:, lo:hi].transpose(1, 2)).mul_(w3[:, : a1 - a0, c0:c1])
            if far3 is None:
                ya = torch.bmm(scores, v3[:, lo:hi])
            else:
                ya = torch.baddbmm(torch.bmm(qa, far3[:, a0 // c]), scores, v3[:, lo:hi])
            den[:, a0:a1] = ya[..., -1:] + eps
            out[:, :, a0:a1] = (ya[..., :-1] / den[:, a0:a1]).view(b, h, a1 - a0, e - 1)
        ctx.save_for_backward(q3, k3, v3, w3, far3, out, den)
        ctx.geometry = (b, c, s, causal)
        return out

    @staticmethod
    @full_precision
    def backward(ctx, dout):  # type: ignore[override]
        q3, k3, v3, w3, far3, out, den = ctx.saved_tensors
        b, c, s, causal = ctx.geometry
        bh, n, _ = q3.shape
        need_q, need_k, need_v, need_w, need_far = ctx.needs_input_grad[:5]
        dq = torch.empty_like(q3) if need_q else None  # every block of dq and dfar is written once
        dk = torch.zeros_like(k3) if need_k else None
        dv = torch.zeros_like(v3) if need_v else None
        dw = torch.zeros_like(w3) if need_w else None
        dfar = torch.empty_like(far3) if need_far and far3 is not None else None
        for a0, a1, lo, hi, c0, c1 in band_blocks(n, c, s, causal):
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
                    dq[:, a0:a1] = torch.baddbmm(torch.bmm(dya, far3[:, a0 // c].transpose(1, 2)), ds, kw)
            if need_k:
                dk[:, lo:hi] += torch.bmm(ds.transpose(1, 2), qa)
            if dfar is not None:
                dfar[:, a0 // c] = torch.bmm(qa.transpose(1, 2), dya)
        grads = [None if x is None else x.view(b, -1, *x.shape[1:]) for x in (dq, dk, dv, dw, dfar)]
        if grads[3] is not None:
            grads[3] = grads[3].sum(0)  # the weight is shared across the batch
        return (*grads, None, None, None, None)



def banded_kernel_product_reference(q, k, v, weight, far, c, s, causal, eps):
    """What :class:`BandedKernelProduct` computes, plainly, with ordinary autograd: for each
    chunk of queries, ``Y = (w * (q k_band^T)) v_band + q F_a``, then ``Y[:D] / (Y[D] + eps)``.
    Same arguments; returns a contiguous ``(B, H, N, D)``."""
    if isinstance(eps, torch.Tensor):
        eps = eps[None, :, None, None]
    rows = []
    for a0, a1, lo, hi, c0, c1 in band_blocks(q.shape[2], c, s, causal):
        qa = q[:, :, a0:a1]
        ya = (qa @ k[:, :, lo:hi].transpose(-1, -2) * weight[:, : a1 - a0, c0:c1]) @ v[:, :, lo:hi]
        if far is not None:
            ya = ya + qa @ far[:, :, a0 // c]
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
) -> torch.Tensor:
    """Exact attention for a 1D bias that is constant beyond ``|r| > rpe_clip`` (a clipped table).

    With ``K = rpe_clip`` every key further than K positions to the left of query i carries the
    same weight ``c_{-K}`` (to the right ``c_K``). Cut the sequence into chunks of ``C`` tokens
    with ``s C >= K`` (:func:`window_geometry`). For a query in chunk a, keys in chunks
    ``a-s .. a+s`` get their exact weights from the bias (one ``C x (2s+1)C`` block per chunk),
    every key in chunks ``<= a-s-1`` (all at offsets ``< -K``) enters through the prefix sum of
    chunk states ``sum k^T [v, 1]`` times ``c_{-K}``, every key in chunks ``>= a+s+1`` through
    the suffix sum times ``c_K`` (:func:`_far_states`); :class:`BandedKernelProduct` does both.
    Time O(N (2K + C) (M + D) + N M D), memory O(N (M + D) + (N / C) M D): linear in N.

    Gradients of the far region land on the bias entries ``+-K`` (what clipping a table does:
    the table's own gradient is then identical to the dense one).

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` and ``rpe_bias (H, 2N-1)`` of one dtype, padded keys
    and values already zero. Returns ``(B, H, N, D)``.
    """
    n, dt = q.shape[2], q.dtype
    clip = max(0, min(int(rpe_clip), n - 1))
    c, s = window_geometry(clip, chunk_size)
    bias, eps_h = shifted_bias(rpe_bias, n, causal, eps)  # eps_h: (H,)
    v1 = with_ones_column(v)
    # weight[t, u] = exp(b_r) for query t of a chunk and key u of its band, r = u - s C - t
    t = torch.arange(c, device=q.device)
    u = torch.arange((s + 1 if causal else 2 * s + 1) * c, device=q.device)
    offsets = (u[None, :] - s * c - t[:, None]).clamp(-(n - 1), n - 1)  # (C, W)
    weight = torch.exp(bias[:, offsets + n - 1])  # (H, C, W)
    if causal:
        weight = weight * (offsets <= 0).to(dt)
    far = None
    if -(-n // c) > s + 1:  # some chunks lie beyond the band: the far region, through chunk states
        c_left = torch.exp(bias[:, n - 1 - clip])
        c_right = None if causal else torch.exp(bias[:, n - 1 + clip])
        args = (k, v1, c_left, c_right, c, s)
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args[:4]):
            # recomputed in the backward pass: only k and v1 are kept, not the O((N / C) M E) sums
            far = torch.utils.checkpoint.checkpoint(_far_states, *args, use_reentrant=False)
        else:
            far = _far_states(*args)
    return BandedKernelProduct.apply(q.contiguous(), k.contiguous(), v1, weight, far, c, s, causal, eps_h)
