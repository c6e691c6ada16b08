"""The math of kernelized attention, one function per algorithm.

Every function computes, for feature-mapped queries ``q (B, H, N, M)``, keys ``k (B, H, N, M)``
and values ``v (B, H, N, D)``::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal; ``key_mask[b, j]`` true), where
``c_r = exp(b_r)`` comes from the relative-position bias (all ones without one). A 1D bias has
shape ``(H, 2N-1)`` (entry ``r + N - 1`` holds ``b_r``); a 2D bias for a row-major
``(Hg, Wg)`` grid has shape ``(H, 2Hg-1, 2Wg-1)``.

* :func:`dense_attention` builds the ``N x N`` matrix: the exact, quadratic reference.
* :func:`linear_attention` is the O(N) non-causal form ``q (k^T v) / q (k^T 1)``.
* :func:`causal_chunked_attention` is the O(N) causal form: exact attention inside chunks of
  ``chunk_size`` tokens plus the running state ``S = sum k^T v`` of earlier chunks.
* :func:`fft_attention` evaluates the Toeplitz (1D) or Toeplitz-block-Toeplitz (2D) product
  ``sum_j c_{j-i} k_j (x) v_j`` for every feature by FFT in O(N log N) (Luo et al. 2021,
  Algorithm 1), with a hand-written backward that recomputes instead of storing the
  ``N x M x D`` outer products, so memory stays O(N (M + D)) plus one block of features.
* :func:`recurrent_step` is one decoding step on the state ``(S, z)``; :func:`recurrent_attention`
  runs it over a sequence (the RNN view of causal linear attention).

Inputs are assumed validated (see ``backends.kernelized_attention``). Computation happens in
float32 at least: half-precision inputs are upcast, float64 stays float64. Mixed precision:
inside ``torch.autocast`` the attention core (feature maps, every backend, the hand-written
autograd ops' forward and backward) runs with autocast switched off (:func:`autocast_disabled`),
so its products stay in float32 and the custom backwards see the dtypes their forwards saved;
layers around it (the q/k/v/output projections) still autocast.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional, Sequence

import torch
import torch.utils.checkpoint

# ----------------------------------------------------------------------------- helpers


def autocast_disabled(device_type: str):
    """A context that switches ``torch.autocast`` off for ``device_type`` while it is on (a null
    context otherwise, and for device types without autocast)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def full_precision(fn):
    """Run ``fn`` with autocast off for the device of its first tensor argument: the kernels
    upcast half-precision inputs themselves and must not be cast back down op by op (autocast
    would run their matmuls in bf16/fp16 and hand custom backwards gradients of another dtype)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tensor is None:
            return fn(*args, **kwargs)
        with autocast_disabled(tensor.device.type):
            return fn(*args, **kwargs)

    return wrapper


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mask_keys(
    k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero padded keys (after the feature map) and their values.

    Args:
        k: ``(B, H, N, M)``; v: ``(B, H, N, D)``; key_mask: ``(B, N)`` bool, True = keep.
    """
    if key_mask is None:
        return k, v
    keep = key_mask[:, None, :, None]
    # where, not multiply: whatever a padded slot holds (even inf/NaN) must not leak in.
    return torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device)), torch.where(
        keep, v, torch.zeros((), dtype=v.dtype, device=v.device)
    )


def isolate_non_finite(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor], causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep a non-finite input from reaching any row that does not see it.

    A position whose key or value holds NaN/inf (per batch row and head) is replaced by zeros,
    as padding is, and a non-finite query by zeros; then no algorithm (FFT, chunk sums, running
    states, matrix products with masked weights) can spread it, in the forward or backward pass
    (``where`` passes no gradient to the replaced entries). The rows that do see such an input
    (the query itself, or an allowed key: at or before it when causal, any real key otherwise)
    are *poisoned*: the caller sets them to NaN. Costs a few elementwise passes, no host sync.

    Returns ``(q, k, v, poisoned)`` with ``poisoned (B, H, N)`` bool.
    """
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    good = torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1)  # (B, H, N)
    good_q = torch.isfinite(q).all(dim=-1)
    bad = ~good if key_mask is None else ~good & key_mask[:, None, :]
    seen = bad.cumsum(dim=-1) > 0 if causal else bad.any(dim=-1, keepdim=True).expand_as(bad)
    k = torch.where(good[..., None], k, zero)
    v = torch.where(good[..., None], v, zero.to(v.dtype))
    q = torch.where(good_q[..., None], q, zero.to(q.dtype))
    return q, k, v, seen | ~good_q


def relative_offsets(n: int, grid: Optional[Sequence[int]], device) -> tuple[torch.Tensor, ...]:
    """Index tensors into the bias for every (query i, key j) pair.

    Returns ``(idx,)`` of shape ``(N, N)`` for 1D (``j - i + N - 1``) or ``(iy, ix)`` for 2D.
    """
    if grid is None:
        pos = torch.arange(n, device=device)
        return (pos[None, :] - pos[:, None] + n - 1,)
    hg, wg = grid
    pos = torch.arange(n, device=device)
    y, x = pos // wg, pos % wg
    return (y[None, :] - y[:, None] + hg - 1, x[None, :] - x[:, None] + wg - 1)


def dense_bias_matrix(rpe_bias: torch.Tensor, n: int, grid: Optional[Sequence[int]]) -> torch.Tensor:
    """Materialise ``B[h, i, j] = b_{j-i}``: ``(H, N, N)``."""
    idx = relative_offsets(n, grid, rpe_bias.device)
    if grid is None:
        return rpe_bias[:, idx[0]]
    return rpe_bias[:, idx[0], idx[1]]


def bias_shift(rpe_bias: torch.Tensor, n: int, causal: bool) -> torch.Tensor:
    """Per-head maximum of the bias over the offsets a call uses (``r <= 0`` when causal):
    ``(H,)``, detached, 0 where it is not finite.

    Kernels exponentiate ``b - shift`` (every coefficient <= 1, so ``exp`` cannot overflow: a
    constant bias of 90 is fine) and divide by ``den + eps * exp(-shift)``: the shift cancels
    between numerator and denominator and the result is the formula with ``c = exp(b)``
    exactly (so the gradient needs no term for the shift).
    """
    b = rpe_bias.detach()
    used = b[:, :n] if causal else b.reshape(b.shape[0], -1)
    m = used.amax(dim=-1)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def shifted_eps(eps: float, shift: torch.Tensor) -> torch.Tensor:
    """``eps * exp(-shift)`` per head, kept inside the normal range of the dtype (a positive
    eps never becomes 0, so a row without keys still gives 0, not 0 / 0)."""
    if eps == 0:
        return torch.zeros_like(shift)
    info = torch.finfo(shift.dtype)
    return (eps * torch.exp(-shift)).clamp(min=info.tiny, max=info.max)


def _per_head(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``(H,)`` -> ``(H, 1, ...)`` with ``ndim`` dimensions in all."""
    return x.reshape((x.shape[0],) + (1,) * (ndim - 1))


# ----------------------------------------------------------------------------- dense reference


@full_precision
def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False,
    key_mask: Optional[torch.Tensor] = None,
    grid: Optional[Sequence[int]] = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Exact quadratic reference. Shapes as in the module docstring; returns ``(B, H, N, D)``."""
    dt = compute_dtype_for(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    # padded keys and values are replaced before the product (not only their scores masked):
    # otherwise a NaN there reaches the query gradients as 0 * NaN
    k, v = mask_keys(k, v, key_mask)
    n = q.shape[-2]
    a = q @ k.transpose(-1, -2)  # (B, H, N, N)
    if rpe_bias is not None:
        bias = rpe_bias.to(dt)
        shift = bias_shift(bias, n, causal)
        a = a * torch.exp(dense_bias_matrix(bias - _per_head(shift, bias.dim()), n, grid))[None]
        eps = shifted_eps(eps, shift)[None, :, None, None]
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].bool()
    a = torch.where(allowed, a, torch.zeros((), dtype=dt, device=a.device))
    return (a @ v) / (a.sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- linear, O(N)


@full_precision
def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    **_: object,
) -> torch.Tensor:
    """Non-causal linear attention without RPE: ``q (k^T v) / (q . sum_j k_j + eps)``."""
    dt = compute_dtype_for(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    k, v = mask_keys(k, v, key_mask)
    kv = k.transpose(-1, -2) @ v  # (B, H, M, D)
    z = k.sum(dim=-2)  # (B, H, M)
    num = q @ kv
    den = (q * z[:, :, None, :]).sum(dim=-1, keepdim=True)
    return num / (den + eps)


# ----------------------------------------------------------------------------- causal chunked


def _chunk(x: torch.Tensor, c: int) -> torch.Tensor:
    """Zero-pad ``x (B, H, N, F)`` along N to a multiple of ``c``: ``(B, H, N / c, c, F)``."""
    b, h, n, f = x.shape
    pad = (-n) % c
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(b, h, (n + pad) // c, c, f)


def with_ones_column(v: torch.Tensor) -> torch.Tensor:
    """``[v, 1]``: ``(B, H, N, D) -> (B, H, N, D + 1)``. Summing it with the attention weights
    gives numerator and denominator in one pass (a masked key has k = 0, so it adds nothing)."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


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
    qc, kc, vc = _chunk(q, c), _chunk(k, c), _chunk(v, c)
    chunk_states = kc.transpose(-1, -2) @ vc  # (B, H, nc, M, D)
    prefix = torch.cumsum(chunk_states, dim=2) - chunk_states  # states of strictly earlier chunks
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(tri, qc @ kc.transpose(-1, -2), torch.zeros((), dtype=q.dtype, device=q.device))
    y = qc @ prefix + scores @ vc  # (B, H, nc, C, D)
    return y.reshape(q.shape[0], q.shape[1], -1, d)[:, :, :n]


@full_precision
def causal_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    **_: object,
) -> torch.Tensor:
    """Causal linear attention in chunked form (:func:`causal_linear_sums` over ``[v, 1]``):
    never quadratic in N."""
    dt = compute_dtype_for(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    k, v = mask_keys(k, v, key_mask)
    d = v.shape[-1]
    y = causal_linear_sums(q, k, with_ones_column(v), chunk_size)
    return y[..., :d] / (y[..., d:] + eps)


# ----------------------------------------------------------------------------- FFT Toeplitz
#
# Cost model (CPU). The product needs M * (D + 1) real FFTs and as many inverse FFTs of the
# padded length; nothing cheaper exists for an arbitrary Toeplitz C. What is left to optimise
# is everything around them: large temporaries are freshly mmap-ed (and page-faulted) on every
# allocation, so the blocks below reuse three preallocated buffers (zero-padded input, spectrum,
# output), write the outer products straight into the padded buffer, multiply the spectrum in
# place and contract with q by in-place ``addcmul_``. Blocks are sized by bytes
# (:data:`FFT_BLOCK_BYTES`) so one block's buffers stay cache-friendly. Measured on a 2-core
# CPU (M = 32, D = 64, one head), forward: N = 16384 0.42 s -> 0.16 s, N = 32768 1.03 s -> 0.38 s
# (the same run: 8 / 16 / 20 / 32 MiB blocks gave 0.22 / 0.17 / 0.16 / 0.20 s at N = 16384 and
# 0.50 / 0.43 / 0.38 / 0.40 s at N = 32768).

FFT_BLOCK_BYTES = 20 << 20  # padded real input per block


def _spatial_shape(n: int, grid: Optional[Sequence[int]]) -> tuple[int, ...]:
    return (n,) if grid is None else (int(grid[0]), int(grid[1]))


def _fast_length(n: int) -> int:
    """Smallest ``2^a 3^b 5^c >= n``: an FFT size the CPU/GPU FFT libraries handle fastest."""
    best = 1
    while best < n:
        best *= 2
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            p = p35
            while p < n:
                p *= 2
            best = min(best, p)
            p35 *= 3
        p5 *= 5
    return best


def _fft_lengths(spatial: Sequence[int]) -> tuple[int, ...]:
    """Padded FFT length per spatial axis: a fast size ``>= 2S - 1`` (no wrap-around for any offset)."""
    return tuple(_fast_length(2 * int(s) - 1) for s in spatial)


def toeplitz_kernel_spectrum(
    c: torch.Tensor, spatial: tuple[int, ...], lengths: Optional[tuple[int, ...]] = None
) -> torch.Tensor:
    """Spectrum of the circulant embedding of the (block-)Toeplitz matrix ``C[i, j] = c_{j-i}``.

    Args:
        c: ``(H, 2S-1)`` or ``(H, 2Sy-1, 2Sx-1)`` coefficients, offset ``r`` at index ``r + S - 1``.
        spatial: ``(S,)`` or ``(Sy, Sx)``.
        lengths: padded FFT lengths, each ``>= 2S - 1`` (default :func:`_fft_lengths`).
    Returns:
        ``rfftn`` of ``h`` with ``h[(-r) mod L] = c_r``, shape ``(H, L // 2 + 1)`` (1D) or
        ``(H, Ly, Lx // 2 + 1)`` (2D). Then ``C X = irfftn(spectrum * rfftn(X, s=L))`` cropped to ``S``.
    """
    lengths = _fft_lengths(spatial) if lengths is None else tuple(lengths)
    h = c.new_zeros((c.shape[0],) + lengths)
    idx = [((-torch.arange(-(s - 1), s, device=c.device)) % L) for s, L in zip(spatial, lengths)]
    if len(spatial) == 1:
        h[:, idx[0]] = c
    else:
        h[:, idx[0][:, None], idx[1][None, :]] = c
    dims = tuple(range(1, 1 + len(spatial)))
    return torch.fft.rfftn(h, s=lengths, dim=dims)


def _block_size(
    b: int, h: int, m: int, d1: int, spatial: tuple[int, ...], itemsize: int = 4, target_bytes: Optional[int] = None
) -> tuple[int, int]:
    """Block shape ``(features, value columns)`` pushed through the FFT at once.

    A block holds ``b * h * features * columns`` padded signals; it is sized so that its padded
    real input is about ``target_bytes``: several whole features when a feature's ``d1``
    columns are small, otherwise one feature and an even split of its columns.
    """
    target_bytes = FFT_BLOCK_BYTES if target_bytes is None else target_bytes
    padded = 1
    for L in _fft_lengths(spatial):
        padded *= L
    rows = max(1, target_bytes // max(b * h * padded * itemsize, 1))
    if rows >= d1:
        return max(1, min(m, rows // d1)), d1
    nblocks = -(-d1 // rows)
    return 1, -(-d1 // nblocks)


class _ToeplitzWorkspace:
    """Reusable buffers that apply ``C`` (or ``C^T``) to blocks of products ``a_m (x) b_d``.

    ``a``: ``(B, H, M, *S)``, ``b``: ``(B, H, D1, *S)``, both contiguous in spatial form. A block
    is ``mb`` features times ``dc`` columns; the padded input buffer's tail is zero once and only
    its leading ``*S`` corner is ever written, so no padding copy is made per block.
    """

    def __init__(self, b: int, h: int, mb: int, dc: int, spatial: tuple[int, ...], lengths: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.nd = len(spatial)
        self.spatial, self.lengths = spatial, lengths
        self.dims = tuple(range(4, 4 + self.nd))
        freq = lengths[:-1] + (lengths[-1] // 2 + 1,)
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        self.padded = torch.zeros((b, h, mb, dc) + lengths, dtype=dtype, device=device)
        self.freq = torch.empty((b, h, mb, dc) + freq, dtype=cdtype, device=device)
        self.result = torch.empty((b, h, mb, dc) + lengths, dtype=dtype, device=device)
        self.crop = (...,) + tuple(slice(0, s) for s in spatial)

    def transform(self, a: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
        """Spectrum of ``a[:, :, i] * bv[:, :, d]`` for the block: ``(B, H, w, dw, *freq)``.

        Args: ``a (B, H, w, *S)``, ``bv (B, H, dw, *S)``.
        """
        w, dw = a.shape[2], bv.shape[2]
        pad = self.padded[:, :, :w, :dw]
        torch.mul(a[:, :, :, None], bv[:, :, None], out=pad[self.crop])
        xf = self.freq[:, :, :w, :dw]
        torch.fft.rfftn(pad, dim=self.dims, out=xf)
        return xf

    def inverse(self, xf: torch.Tensor, spec: torch.Tensor) -> torch.Tensor:
        """``irfftn(xf * spec)`` cropped to ``*S``: ``(B, H, w, dw, *S)``. Overwrites ``xf``."""
        xf.mul_(spec.reshape((1, spec.shape[0], 1, 1) + tuple(spec.shape[1:])))
        out = self.result[:, :, : xf.shape[2], : xf.shape[3]]
        torch.fft.irfftn(xf, s=self.lengths, dim=self.dims, out=out)
        return out[self.crop]


def _blocks(m: int, d1: int, mb: int, dc: int):
    for s in range(0, m, mb):
        for d0 in range(0, d1, dc):
            yield slice(s, min(m, s + mb)), slice(d0, min(d1, d0 + dc))


def _feature_major(x: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
    """``(B, H, N, F)`` -> contiguous ``(B, H, F, *spatial)``."""
    return x.transpose(-1, -2).contiguous().reshape(x.shape[:2] + (x.shape[-1],) + spatial)


class ToeplitzKernelProduct(torch.autograd.Function):
    """``Y_i = sum_m q_im sum_j c_{j-i} k_jm v_j`` for all i, by FFT, with a recomputing backward.

    Shapes: q, k ``(B, H, N, M)``; v ``(B, H, N, D1)``; c ``(H, 2S-1[, 2Sx-1])``; Y ``(B, H, N, D1)``.
    Backward (C^T is the same Toeplitz product with ``c_{-r}``, i.e. the conjugate spectrum):
        dq_im = dY_i . (C [k_m v])_i
        P_m   = C^T [q_m dY]           dk_jm = P_mj . v_j       dv_j = sum_m k_jm P_mj
        dc_r  = sum_m sum_i (q_im dY_i) . (k_m v)_{i+r}  (a cross-correlation, also by FFT)
    Memory: O(N (M + D1)) for inputs and outputs plus the block buffers (:data:`FFT_BLOCK_BYTES`).
    """

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v, c, spatial):  # type: ignore[override]
        spatial = tuple(int(s) for s in spatial)
        b, h, n, m = q.shape
        d1 = v.shape[-1]
        lengths = _fft_lengths(spatial)
        spec = toeplitz_kernel_spectrum(c, spatial, lengths)
        qs, ks, vs = (_feature_major(x, spatial) for x in (q, k, v))
        y = q.new_zeros((b, h, d1) + spatial)
        mb, dc = _block_size(b, h, m, d1, spatial, q.element_size())
        ws = _ToeplitzWorkspace(b, h, mb, dc, spatial, lengths, q.dtype, q.device)
        for ms, ds in _blocks(m, d1, mb, dc):
            tu = ws.inverse(ws.transform(ks[:, :, ms], vs[:, :, ds]), spec)  # (B, H, w, dw, *S)
            yd = y[:, :, ds]
            for i in range(tu.shape[2]):
                yd.addcmul_(qs[:, :, ms.start + i, None], tu[:, :, i])
        ctx.save_for_backward(q, k, v, c)
        ctx.spatial = spatial
        return y.reshape(b, h, d1, n).transpose(-1, -2).contiguous()

    @staticmethod
    @full_precision
    def backward(ctx, dy):  # type: ignore[override]
        q, k, v, c = ctx.saved_tensors
        spatial = ctx.spatial
        nd = len(spatial)
        b, h, n, m = q.shape
        d1 = v.shape[-1]
        lengths = _fft_lengths(spatial)
        spec = toeplitz_kernel_spectrum(c, spatial, lengths)
        spec_t = spec.conj().resolve_conj()
        qs, ks, vs = (_feature_major(x, spatial) for x in (q, k, v))
        dys = _feature_major(dy.to(q.dtype), spatial)  # (B, H, D1, *S)
        need_q, need_k, need_v, need_c = ctx.needs_input_grad[:4]
        dq = torch.zeros_like(qs) if need_q else None
        dk = torch.zeros_like(ks) if need_k else None
        dv = torch.zeros_like(vs) if need_v else None
        mb, dc = _block_size(b, h, m, d1, spatial, q.element_size())
        ws_u = _ToeplitzWorkspace(b, h, mb, dc, spatial, lengths, q.dtype, q.device) if (need_q or need_c) else None
        ws_g = _ToeplitzWorkspace(b, h, mb, dc, spatial, lengths, q.dtype, q.device) if (need_k or need_v or need_c) else None
        corr = torch.zeros_like(ws_u.freq) if need_c else None
        for ms, ds in _blocks(m, d1, mb, dc):
            w, dw = ms.stop - ms.start, ds.stop - ds.start
            uf = ws_u.transform(ks[:, :, ms], vs[:, :, ds]) if ws_u is not None else None
            gf = ws_g.transform(qs[:, :, ms], dys[:, :, ds]) if ws_g is not None else None
            if need_c:  # before the in-place spectrum products below
                corr[:, :, :w, :dw].addcmul_(gf.conj(), uf)
            if need_q:
                tu = ws_u.inverse(uf, spec)  # (B, H, w, dw, *S)
                dq[:, :, ms] += (tu * dys[:, :, None, ds]).sum(dim=3)
            if need_k or need_v:
                p = ws_g.inverse(gf, spec_t)  # (B, H, w, dw, *S)
                if need_k:
                    dk[:, :, ms] += (p * vs[:, :, None, ds]).sum(dim=3)
                if need_v:
                    dvd = dv[:, :, ds]
                    for i in range(w):
                        dvd.addcmul_(ks[:, :, ms.start + i, None], p[:, :, i])
        dc_grad = None
        if need_c:
            total = corr.sum(dim=(0, 2, 3))  # (H, *freq)
            r_time = torch.fft.irfftn(total, s=lengths, dim=tuple(range(1, 1 + nd)))
            idx = [(torch.arange(-(x - 1), x, device=c.device) % L) for x, L in zip(spatial, lengths)]
            dc_grad = r_time[:, idx[0]] if nd == 1 else r_time[:, idx[0][:, None], idx[1][None, :]]
            dc_grad = dc_grad.to(c.dtype)

        def back(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if x is None else x.reshape(x.shape[:3] + (n,)).transpose(-1, -2)

        return back(dq), back(dk), back(dv), dc_grad, None


def toeplitz_coefficients(
    rpe_bias: Optional[torch.Tensor],
    n: int,
    heads: int,
    causal: bool,
    grid: Optional[Sequence[int]],
    dtype: torch.dtype,
    device,
) -> torch.Tensor:
    """``c = exp(b)`` (ones without a bias), zeroed for future offsets ``r > 0`` when causal.
    Pass a shifted bias (:func:`bias_shift`) so that no coefficient exceeds 1."""
    spatial = _spatial_shape(n, grid)
    if rpe_bias is None:
        c = torch.ones((heads,) + tuple(2 * s - 1 for s in spatial), dtype=dtype, device=device)
    else:
        c = torch.exp(rpe_bias.to(dtype))
    if causal:  # 1D only (validated upstream): keep offsets r = j - i <= 0
        keep = torch.arange(-(n - 1), n, device=device) <= 0
        c = c * keep.to(dtype)
    return c


FFT_ERROR_KAPPA = 1.0  # the constant of :func:`fft_error_bound`; measured: at most 0.12


def _row_key_mass(q: torch.Tensor, k: torch.Tensor, causal: bool, absolute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_i . P_i, q_i . K)`` per row ``(B, H, N)``: ``P_i`` the sum of the keys row i may see
    (a prefix sum when causal, all keys otherwise), ``K`` the sum of all keys. With
    ``absolute``, of ``|q|`` and ``|k|``: zero exactly when no product ``q_im k_jm`` is nonzero."""
    if absolute:
        q, k = q.abs(), k.abs()
    total = k.sum(dim=2, keepdim=True)
    prefix = k.cumsum(dim=2) if causal else total
    return (q * prefix).sum(-1), (q * total).sum(-1)


def fft_error_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False,
    key_mask: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> float:
    """A bound on the error of :func:`fft_attention` computed in ``dtype`` (default: the dtype
    it would use for these inputs), relative to the values: ``max_i |out_i - exact_i|_inf / max |v|``.

    ``bound = kappa * eps_dtype * exp(S) * R``, where

    * ``S = max b - min b`` is the span of the bias over the offsets in use (``r <= 0`` when
      causal; 0 without a bias);
    * ``R = max_i (q_i . K) / (q_i . P_i)`` compares the key mass of the whole sequence ``K``
      with the mass row ``i`` sees, ``P_i`` (``R = 1`` without causality; about ``N / (i + 1)``
      for keys of similar size when causal: the first rows are the hardest);
    * ``kappa = FFT_ERROR_KAPPA = 1``.

    Why: the transform computes every ``T_m(l) = sum_j c_{j-l} k_jm v_j`` with an absolute error of
    about ``eps`` times the largest ``|T_m|``, at most ``exp(max b) K_m max|v|``, while row ``i``'s
    denominator is at least ``exp(min b) q_i . P_i``. It holds for non-negative features (elu,
    relu, prf); with features of both signs (trf) denominators can cancel and no bound exists
    (``inf`` is returned). Measured against a float64 evaluation (float32, positive features,
    N = 1k..131k, spans 0..20, uniform / decaying / spiked / constant biases, causal and not)
    the error stayed below 0.12 of this bound. Examples in float32: non-causal without a bias
    ~1e-9 (bound 1.2e-7); causal without a bias 1.2e-5 at N = 1k, 9e-4 at 32k, 3e-3 at 131k
    (first rows; bound ~N eps); a bias spanning 20 (+-10) costs up to ``e^20``.

    While ``torch.compile`` / ``torch.export`` trace, the data cannot be read: ``inf``.
    """
    dt = dtype if dtype is not None else compute_dtype_for(q)
    if torch.compiler.is_compiling():  # the bound reads the data, which a trace cannot: none known
        return math.inf
    with torch.no_grad():
        q64, k64 = q.detach().double(), k.detach().double()
        if bool((q64 < 0).any()) or bool((k64 < 0).any()):
            return math.inf
        if key_mask is not None:
            k64 = k64 * key_mask[:, None, :, None].to(k64.dtype)
        span = 0.0
        if rpe_bias is not None:
            n = q.shape[2]
            b = rpe_bias.detach().double()
            used = b[:, :n] if causal else b.reshape(b.shape[0], -1)
            span = float((used.amax(-1) - used.amin(-1)).max())
            if not math.isfinite(span):
                return math.inf
        ratio = 1.0
        if causal:
            seen, total = _row_key_mass(q64, k64, causal=True)
            live = seen > 0
            if bool(live.any()):
                ratio = float((total[live] / seen[live]).max())
    if span > 700:
        return math.inf
    return FFT_ERROR_KAPPA * torch.finfo(dt).eps * math.exp(span) * ratio


@full_precision
def fft_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False,
    key_mask: Optional[torch.Tensor] = None,
    grid: Optional[Sequence[int]] = None,
    eps: float = 1e-6,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Kernelized attention with a Toeplitz RPE by FFT, O(N M D log N). Returns ``(B, H, N, D)``.

    Accuracy. The transform mixes all positions, so its rounding error is set by the largest
    entries of the sequence, not by each row's own: in float32 the error relative to the values
    is bounded by :func:`fft_error_bound`, ``eps * exp(S) * R`` (S the span of the bias, R the
    ratio of the whole sequence's key mass to the mass a row sees; about N for the first rows of
    a causal call). Non-causal float32 calls with a moderate bias stay near 1e-7; causal ones grow
    like ``N eps`` (1.2e-5 at N = 1k, 3e-3 at 131k) and a bias span of S multiplies by up to
    ``e^S``. The coefficients are shifted by their maximum (:func:`bias_shift`), so a large
    bias never overflows. ``compute_dtype=torch.float64`` runs the whole product in float64
    (error ~1e-16 of the same factors); ``backend="auto"`` does that, or picks an exact backend,
    where float32 cannot meet ``1e-4``. Rows without any allowed key return exactly 0.
    """
    dt = compute_dtype if compute_dtype is not None else compute_dtype_for(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    k, v = mask_keys(k, v, key_mask)
    n, d = q.shape[-2], v.shape[-1]
    if rpe_bias is not None:
        rpe_bias = rpe_bias.to(dt)
        shift = bias_shift(rpe_bias, n, causal)
        rpe_bias = rpe_bias - _per_head(shift, rpe_bias.dim())
        eps = shifted_eps(eps, shift)[None, :, None, None]
    c = toeplitz_coefficients(rpe_bias, n, q.shape[1], causal, grid, dt, q.device)
    v1 = with_ones_column(v)
    y = ToeplitzKernelProduct.apply(q, k, v1, c, _spatial_shape(n, grid))
    out = y[..., :d] / (y[..., d:] + eps)
    # The transform mixes every position: a row for which every product q_im k_jm over its
    # allowed keys is zero (all of them padding, or features with disjoint support) has exact
    # numerator and denominator 0, but would read rounding noise of the other rows divided by
    # eps. It gets exactly 0, as the formula (and every other backend) gives.
    seen, _ = _row_key_mass(q.detach(), k.detach(), causal, absolute=True)
    return torch.where((seen > 0)[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))


# ----------------------------------------------------------------------------- clipped RPE, O(N K)


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
    ``eps`` a float or a per-head ``(H,)`` tensor (see :func:`shifted_eps`).
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


def _far_states(
    k: torch.Tensor, v1: torch.Tensor, c_left: torch.Tensor, c_right: Optional[torch.Tensor], c: int, s: int
) -> torch.Tensor:
    """``F_a = c_left sum_{chunks <= a-s-1} k^T v1 + c_right sum_{chunks >= a+s+1} k^T v1`` for
    every chunk a of ``c`` tokens: ``k (B, H, N, M)``, ``v1 (B, H, N, E)``, ``c_left``/``c_right``
    ``(H,)`` (``c_right`` None when causal) -> ``(B, H, ceil(N / c), M, E)``."""
    states = _chunk(k, c).transpose(-1, -2) @ _chunk(v1, c)  # (B, H, nc, M, E)
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
    key_mask: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    chunk_size: int = 128,
    **_: object,
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
    """
    dt = compute_dtype_for(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    k, v = mask_keys(k, v, key_mask)
    n = q.shape[2]
    clip = max(0, min(int(rpe_clip), n - 1))
    c, s = window_geometry(clip, chunk_size)
    bias = rpe_bias.to(dt)
    shift = bias_shift(bias, n, causal)
    bias = bias - shift[:, None]
    eps_h = shifted_eps(eps, shift)  # (H,)
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


# ----------------------------------------------------------------------------- recurrent


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
    key_mask: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    **_: object,
) -> torch.Tensor:
    """Causal attention as an RNN, one token at a time.

    Without RPE it carries only ``(S, z)`` (constant memory per step). With a 1D bias the
    weights ``c_{j-i}`` differ for every query, so each step re-reads the past keys and values:
    exact, with a per-step cost that grows with the context.
    """
    dt = compute_dtype_for(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    k, v = mask_keys(k, v, key_mask)
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
    bias = rpe_bias.to(dt)
    shift = bias_shift(bias, n, causal=True)
    c = torch.exp(bias - shift[:, None])  # (H, 2N-1), every used coefficient <= 1
    eps_h = shifted_eps(eps, shift)[None, :, None]  # (1, H, 1)
    for t in range(n):
        w = c[:, n - 1 - t : n][None]  # offsets -t..0 for keys 0..t: (1, H, t+1)
        s = (k[:, :, : t + 1] @ q[:, :, t, :, None])[..., 0] * w  # (B, H, t+1)
        outs.append((s[..., None] * v[:, :, : t + 1]).sum(dim=2) / (s.sum(-1, keepdim=True) + eps_h))
    return torch.stack(outs, dim=2)
