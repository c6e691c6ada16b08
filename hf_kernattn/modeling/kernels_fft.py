"""Kernelized attention with a Toeplitz relative-position bias, by FFT (1D and 2D).

With ``r = j - i`` (2D: ``(dy, dx)`` on a row-major grid) and ``c_r = exp(b_r)`` (zero for
``r > 0`` when causal)::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

Numerator and denominator are one (block-)Toeplitz product over ``[v, 1]``::

    Y_i = sum_j c_{j-i} (q_i . k_j) v_j = sum_m q_im sum_j c_{j-i} k_jm v_j

for each feature m, ``C[i, j] = c_{j-i}`` applied to ``k_m v`` as a circulant of a fast length
``L >= 2S - 1`` by ``rfftn`` (Luo et al. 2021, Alg. 1). The bias is shifted by its maximum so no
coefficient exceeds 1.

Cost: time O(N M D log N) (``M (D+1)`` forward and inverse FFTs), memory O(N (M + D)) plus one
block of FFT buffers; the backward recomputes the transforms. Accuracy: :func:`fft_error_bound`.
Under ``torch.compile`` forward and backward run as custom operators (one graph node at any N,
symbolic too); ``torch.export(strict=False)`` traces the eager form with static sizes.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .kernels_common import autocast_disabled, compute_dtype_for, dense_bias_matrix, full_precision, shifted_bias

# The M (D + 1) FFTs are unavoidable; around them, blocks reuse three preallocated buffers (padded
# input, spectrum, output: fresh large temporaries are page-faulted on every allocation), write the
# outer products straight into the padded buffer and work in place. Block size: measured fastest here.

FFT_BLOCK_BYTES = 20 << 20  # padded real input per block
# heads per pass: as many as keep one (B, heads, N, max(M, D1)) tensor within this, so a pass's
# feature-major copies and buffers stay bounded as heads x N grows
FFT_HEAD_CHUNK_BYTES = 64 << 20


def spatial_shape(n: int, grid: Optional[Sequence[int]]) -> tuple[int, ...]:
    """``(N,)`` for a sequence, ``(Hg, Wg)`` for a grid."""
    return (n,) if grid is None else tuple(s if isinstance(s, torch.SymInt) else int(s) for s in grid[:2])


def _fast_length(n: int) -> int:
    """Smallest ``2^a 3^b 5^c >= n`` (the sizes FFT libraries run fastest)."""
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
    """Padded FFT length per axis: a fast size ``>= 2S - 1`` (no wrap-around)."""
    return tuple(_fast_length(2 * int(s) - 1) for s in spatial)


def toeplitz_kernel_spectrum(
    c: torch.Tensor, spatial: tuple[int, ...], lengths: Optional[tuple[int, ...]] = None
) -> torch.Tensor:
    """Spectrum of the circulant embedding of ``C[i, j] = c_{j-i}``: ``c (H, 2S-1)`` or
    ``(H, 2Sy-1, 2Sx-1)`` (offset ``r`` at ``r + S - 1``), ``spatial`` ``(S,)`` or ``(Sy, Sx)``,
    ``lengths`` each ``>= 2S - 1``. Returns ``rfftn(h)``, ``h[(-r) mod L] = c_r``; then
    ``C X = irfftn(spectrum * rfftn(X, s=L))`` cropped to ``S``."""
    lengths = _fft_lengths(spatial) if lengths is None else tuple(lengths)
    h = c.new_zeros((c.shape[0],) + lengths)
    idx = [((-torch.arange(-(s - 1), s, device=c.device)) % L) for s, L in zip(spatial, lengths)]
    if len(spatial) == 1:
        h[:, idx[0]] = c
    else:
        h[:, idx[0][:, None], idx[1][None, :]] = c
    dims = tuple(range(1, 1 + len(spatial)))
    return torch.fft.rfftn(h, s=lengths, dim=dims)


def _backward_spectra(c: torch.Tensor, spatial: tuple[int, ...]):
    """``(lengths, spectrum of C, spectrum of C^T)`` (the conjugate, resolved)."""
    lengths = _fft_lengths(spatial)
    spec = toeplitz_kernel_spectrum(c, spatial, lengths)
    return lengths, spec, spec.conj().resolve_conj()


def _block_size(
    b: int, h: int, m: int, d1: int, spatial: tuple[int, ...], itemsize: int = 4, target_bytes: Optional[int] = None
) -> tuple[int, int]:
    """Block ``(features, value columns)`` transformed at once: padded real input about
    ``target_bytes``; several whole features when ``d1`` is small, else one feature's columns split
    evenly."""
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
    """Reusable buffers applying ``C`` (or ``C^T``) to blocks of products ``a_m (x) b_d``
    (``a (B, H, M, *S)``, ``b (B, H, D1, *S)``). The padded input's tail is zeroed once and only its
    ``*S`` corner is written: no padding copy per block."""

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
        """Spectrum of ``a[:, :, i] * bv[:, :, d]``: ``(B, H, w, dw, *freq)``; ``a (B, H, w, *S)``,
        ``bv (B, H, dw, *S)``."""
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


def _feature_major(x: torch.Tensor, spatial: tuple[int, ...], ones: bool = False) -> torch.Tensor:
    """``(B, H, N, F)`` -> contiguous ``(B, H, F, *spatial)``; ``ones``: a row of ones appended,
    ``(B, H, F + 1, *spatial)``."""
    if not ones:
        return x.transpose(-1, -2).contiguous().reshape(x.shape[:2] + (x.shape[-1],) + spatial)
    b, h, n, f = x.shape
    out = x.new_empty(b, h, f + 1, n)
    out[:, :, :f].copy_(x.transpose(-1, -2))
    out[:, :, f].fill_(1)
    return out.reshape((b, h, f + 1) + spatial)


def head_chunks(b: int, h: int, n: int, width: int, itemsize: int, budget: Optional[int] = None):
    """``(h0, h1)`` head ranges: as many heads per pass as keep ``b * heads * n * width`` values
    within ``budget`` bytes (:data:`FFT_HEAD_CHUNK_BYTES`), at least one."""
    budget = FFT_HEAD_CHUNK_BYTES if budget is None else budget
    per = max(1, min(h, budget // max(b * n * width * itemsize, 1)))
    return [(h0, min(h, h0 + per)) for h0 in range(0, h, per)]


def _heads(spec: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """A spectrum's (or table's) rows for heads ``[h0, h1)``; a single shared row as is."""
    return spec if spec.shape[0] == 1 else spec[h0:h1]


def _product_pass(q, k, v, spec, spatial, lengths, ones: bool = False) -> torch.Tensor:
    """:class:`ToeplitzKernelProduct`'s forward for some heads: ``(B, h, D1, *S)``; ``ones``: of
    ``[v, 1]``."""
    b, h, _, m = q.shape
    qs, ks, vs = _feature_major(q, spatial), _feature_major(k, spatial), _feature_major(v, spatial, ones)
    d1 = vs.shape[2]
    y = q.new_zeros((b, h, d1) + spatial)
    mb, dc = _block_size(b, h, m, d1, spatial, q.element_size())
    ws = _ToeplitzWorkspace(b, h, mb, dc, spatial, lengths, q.dtype, q.device)
    for ms, ds in _blocks(m, d1, mb, dc):
        tu = ws.inverse(ws.transform(ks[:, :, ms], vs[:, :, ds]), spec)  # (B, H, w, dw, *S)
        yd = y[:, :, ds]
        for i in range(tu.shape[2]):
            yd.addcmul_(qs[:, :, ms.start + i, None], tu[:, :, i])
    return y


def _backward_pass(q, k, v, dy, spec, spec_t, spatial, lengths, needs, ones: bool = False):
    """:class:`ToeplitzKernelProduct`'s backward for some heads: ``dq, dk, dv`` feature-major
    ``(B, h, F, *S)`` and the spectrum of the table's gradient ``(h, *freq)`` (None where not
    needed). ``ones``: the product of ``[v, 1]`` (``dv`` has an unused last row), ``dy`` given
    feature-major ``(B, h, D + 1, *S)``."""
    b, h, _, m = q.shape
    need_q, need_k, need_v, need_c = needs
    qs, ks, vs = _feature_major(q, spatial), _feature_major(k, spatial), _feature_major(v, spatial, ones)
    d1 = vs.shape[2]
    dys = dy if ones else _feature_major(dy.to(q.dtype), spatial)  # (B, H, D1, *S)
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
    return dq, dk, dv, (corr.sum(dim=(0, 2, 3)) if need_c else None)


class ToeplitzKernelProduct(torch.autograd.Function):
    """``Y_i = sum_m q_im sum_j c_{j-i} k_jm v_j`` by FFT, with a recomputing backward.

    Shapes: q, k ``(B, H, N, M)``; v ``(B, H, N, D1)``; c ``(H or 1, 2S-1[, 2Sx-1])``; Y ``(B, H, N, D1)``.
    Backward (``C^T``: the conjugate spectrum)::

        dq_im = dY_i . (C [k_m v])_i
        P_m   = C^T [q_m dY]           dk_jm = P_mj . v_j       dv_j = sum_m k_jm P_mj
        dc_r  = sum_m sum_i (q_im dY_i) . (k_m v)_{i+r}  (a cross-correlation, also by FFT)
    """

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v, c, spatial):  # type: ignore[override]
        spatial = tuple(int(s) for s in spatial)
        b, h, n, m = q.shape
        d1 = v.shape[-1]
        lengths = _fft_lengths(spatial)
        spec = toeplitz_kernel_spectrum(c, spatial, lengths)
        out = q.new_empty(b, h, n, d1)
        for h0, h1 in head_chunks(b, h, n, max(m, d1), q.element_size()):
            y = _product_pass(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], _heads(spec, h0, h1), spatial, lengths)
            out[:, h0:h1] = y.reshape(b, h1 - h0, d1, n).transpose(-1, -2)
            del y
        ctx.save_for_backward(q, k, v, c)
        ctx.spatial = spatial
        return out

    @staticmethod
    @full_precision
    def backward(ctx, dy):  # type: ignore[override]
        q, k, v, c = ctx.saved_tensors
        spatial = ctx.spatial
        b, h, n, m = q.shape
        d1 = v.shape[-1]
        lengths, spec, spec_t = _backward_spectra(c, spatial)
        need_q, need_k, need_v, need_c = ctx.needs_input_grad[:4]
        dq = q.new_empty(q.shape) if need_q else None
        dk = k.new_empty(k.shape) if need_k else None
        dv = v.new_empty(v.shape) if need_v else None
        total = None  # the table's gradient spectrum (rows of c, *freq)
        for h0, h1 in head_chunks(b, h, n, max(m, d1), q.element_size()):
            parts = _backward_pass(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], dy[:, h0:h1], _heads(spec, h0, h1),
                                   _heads(spec_t, h0, h1), spatial, lengths, (need_q, need_k, need_v, need_c))
            for full, part in zip((dq, dk, dv), parts[:3]):
                if full is not None:
                    full[:, h0:h1] = part.reshape(part.shape[:3] + (n,)).transpose(-1, -2)
            if need_c:
                total = _add_table_rows(total, parts[3], c.shape[0], h0, h1)
            del parts
        dc_grad = _table_gradient(total, c, spatial, lengths) if need_c else None
        return dq, dk, dv, dc_grad, None


def _add_table_rows(total: Optional[torch.Tensor], part: torch.Tensor, rows: int, h0: int, h1: int) -> torch.Tensor:
    """Add heads ``h0:h1``'s part of the table's gradient spectrum to ``total (rows, *freq)``
    (made on the first pass); summed into one row when the table is shared."""
    part = part if rows > 1 else part.sum(0, keepdim=True)
    if total is None:
        total = part.new_zeros((rows,) + part.shape[1:])
    total[slice(h0, h1) if rows > 1 else slice(0, 1)] += part
    return total


def _table_gradient(total: torch.Tensor, c: torch.Tensor, spatial: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The gradient of ``c`` from the spectrum of the cross-correlation."""
    nd = len(spatial)
    r_time = torch.fft.irfftn(total, s=lengths, dim=tuple(range(1, 1 + nd)))
    idx = [(torch.arange(-(x - 1), x, device=c.device) % L) for x, L in zip(spatial, lengths)]
    dc_grad = r_time[:, idx[0]] if nd == 1 else r_time[:, idx[0][:, None], idx[1][None, :]]
    return dc_grad.to(c.dtype)


def _attention_forward(q, k, v, c, eps, dead, spatial):
    """:class:`FFTAttention`'s forward: ``(out (B, H, N, D), den (B, H, N))``, ``den = +inf`` on
    ``dead`` rows."""
    b, h, n, m = q.shape
    d = v.shape[-1]
    lengths = _fft_lengths(spatial)
    spec = toeplitz_kernel_spectrum(c, spatial, lengths)
    out = den = None
    for h0, h1 in head_chunks(b, h, n, max(m, d + 1), q.element_size()):
        y = _product_pass(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], _heads(spec, h0, h1), spatial, lengths, ones=True)
        y = y.reshape(b, h1 - h0, d + 1, n)
        if out is None:  # made after the first pass, whose buffers are gone by then
            out, den = q.new_empty(b, h, n, d), q.new_empty(b, h, n)
        part = den[:, h0:h1]
        torch.add(y[:, :, d], eps if not isinstance(eps, torch.Tensor) else eps[None, h0:h1, None], out=part)
        if dead is not None:
            part.masked_fill_(dead[:, h0:h1], math.inf)
        torch.div(y[:, :, :d], part[:, :, None], out=out[:, h0:h1].transpose(-1, -2))
        del y
    if out is None:  # no heads
        out, den = q.new_empty(b, h, n, d), q.new_empty(b, h, n)
    return out, den


def _attention_backward(g, q, k, v, c, out, den, spatial, needs):
    """:class:`FFTAttention`'s backward: ``[dq, dk, dv, dc]``, None where ``needs`` is False."""
    b, h, n, m = q.shape
    d = v.shape[-1]
    lengths, spec, spec_t = _backward_spectra(c, spatial)
    need_q, need_k, need_v, need_c = needs
    grads = [None, None, None]
    total = None  # the table's gradient spectrum (rows of c, *freq)
    g = g.to(q.dtype)
    for h0, h1 in head_chunks(b, h, n, max(m, d + 1), q.element_size()):
        gp = g[:, h0:h1]
        # the gradient of Y = [num, den]: [g / den, -(g . out) / den], feature-major
        dys = q.new_empty(b, h1 - h0, d + 1, n)
        torch.div(gp.transpose(-1, -2), den[:, h0:h1, None], out=dys[:, :, :d])
        torch.linalg.vecdot(gp, out[:, h0:h1], out=dys[:, :, d])
        dys[:, :, d].div_(den[:, h0:h1]).neg_()
        parts = _backward_pass(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], dys.reshape((b, h1 - h0, d + 1) + spatial),
                               _heads(spec, h0, h1), _heads(spec_t, h0, h1), spatial, lengths,
                               (need_q, need_k, need_v, need_c), ones=True)
        del dys
        for i, (like, part) in enumerate(zip((q, k, v), parts[:3])):
            if part is not None:
                if grads[i] is None:  # made after the first pass, whose buffers are gone by then
                    grads[i] = like.new_empty(like.shape)
                grads[i][:, h0:h1] = part[:, :, : like.shape[-1]].reshape(b, h1 - h0, like.shape[-1], n).transpose(-1, -2)
        if need_c:
            total = _add_table_rows(total, parts[3], c.shape[0], h0, h1)
        del parts
    grads = [x.new_zeros(x.shape) if need and grad is None else grad for x, need, grad in zip((q, k, v), needs, grads)]
    dc_grad = (_table_gradient(total, c, spatial, lengths) if total is not None else torch.zeros_like(c)) if need_c else None
    return grads + [dc_grad]


class FFTAttention(torch.autograd.Function):
    """``out_i = Y_i[:D] / (Y_i[D] + eps)``, ``Y`` the :class:`ToeplitzKernelProduct` of ``[v, 1]``,
    0 on ``dead`` rows, in one op: ``[v, 1]`` exists only in each pass's feature-major copy, and
    the backward keeps inputs, output and denominators ``(B, H, N)`` (``+inf`` on dead rows).
    ``eps``: a float or ``(H,)``; ``dead (B, H, N)`` bool or None."""

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v, c, eps, dead, spatial):  # type: ignore[override]
        spatial = tuple(int(s) for s in spatial)
        out, den = _attention_forward(q, k, v, c, eps, dead, spatial)
        ctx.save_for_backward(q, k, v, c, out, den)
        ctx.spatial = spatial
        return out

    @staticmethod
    @full_precision
    def backward(ctx, g):  # type: ignore[override]
        q, k, v, c, out, den = ctx.saved_tensors
        grads = _attention_backward(g, q, k, v, c, out, den, ctx.spatial, ctx.needs_input_grad[:4])
        return (*grads, None, None, None)


# ----------------------------------------------------------------------------- under torch.compile

# The eager forward and backward as one custom operator each for TorchDynamo: single graph nodes
# whose loops are sized for the actual N at run time (any N, symbolic too). A namespace per module:
# a checkpoint's copy of this folder registers its own operators beside the installed package's.
_OP_NAMESPACE = "".join(ch if ch.isalnum() else "_" for ch in __name__)


@torch.library.custom_op(f"{_OP_NAMESPACE}::fft_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, eps_heads: Optional[torch.Tensor],
                  eps: float, dead: Optional[torch.Tensor], spatial: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_attention_forward` (``eps_heads``: the per-head eps, else the float ``eps``)."""
    with autocast_disabled(q.device.type):
        return _attention_forward(q, k, v, c, eps if eps_heads is None else eps_heads, dead, tuple(spatial))


@_attention_op.register_fake
def _(q, k, v, c, eps_heads, eps, dead, spatial):
    b, h, n, _ = q.shape
    return q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n)


@torch.library.custom_op(f"{_OP_NAMESPACE}::fft_attention_backward", mutates_args=())
def _attention_backward_op(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor,
                           out: torch.Tensor, den: torch.Tensor, spatial: list[int],
                           needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_attention_backward`; an unneeded gradient is an empty tensor."""
    with autocast_disabled(q.device.type):
        grads = _attention_backward(g, q, k, v, c, out, den, tuple(spatial), tuple(needs))
    return tuple(x.new_empty(0) if grad is None else grad for x, grad in zip((q, k, v, c), grads))


@_attention_backward_op.register_fake
def _(g, q, k, v, c, out, den, spatial, needs):
    return tuple(x.new_empty(x.shape if need else (0,)) for x, need in zip((q, k, v, c), needs))


def _attention_op_setup(ctx, inputs, output):
    q, k, v, c, _, _, _, spatial = inputs
    ctx.save_for_backward(q, k, v, c, *output)
    ctx.spatial = spatial


def _attention_op_backward(ctx, g, _g_den):
    q, k, v, c, out, den = ctx.saved_tensors
    needs = [bool(x) for x in ctx.needs_input_grad[:4]]
    grads = _attention_backward_op(g, q, k, v, c, out, den, ctx.spatial, needs)
    return tuple(grad if need else None for grad, need in zip(grads, needs)) + (None, None, None, None)


_attention_op.register_autograd(_attention_op_backward, setup_context=_attention_op_setup)


def _compiled_attention(q, k, v, c, eps, dead, spatial) -> torch.Tensor:
    """:class:`FFTAttention` through the custom operators (what TorchDynamo traces)."""
    heads = eps if isinstance(eps, torch.Tensor) else None
    return _attention_op(q, k, v, c, heads, 0.0 if heads is not None else float(eps), dead, list(spatial))[0]


def toeplitz_kernel_product_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, spatial: Sequence[int]
) -> torch.Tensor:
    """:class:`ToeplitzKernelProduct` plainly: ``Y = (C * (q k^T)) v`` with ``C`` materialised;
    O(N^2), ordinary autograd."""
    n = q.shape[2]
    cmat = dense_bias_matrix(c, n, None if len(spatial) == 1 else tuple(spatial))  # (H, N, N)
    return ((q @ k.transpose(-1, -2)) * cmat) @ v


# ----------------------------------------------------------------------------- attention

def toeplitz_coefficients(
    rpe_bias: Optional[torch.Tensor],
    n: int,
    heads: int,
    causal: bool,
    grid: Optional[Sequence[int]],
    dtype: torch.dtype,
    device,
) -> torch.Tensor:
    """``c = exp(b)`` (ones without a bias), zero for ``r > 0`` when causal. Pass a shifted bias
    (``kernels_common.bias_shift``) so no coefficient exceeds 1."""
    spatial = spatial_shape(n, grid)
    if rpe_bias is None:
        c = torch.ones((heads,) + tuple(2 * s - 1 for s in spatial), dtype=dtype, device=device)
    else:
        c = torch.exp(rpe_bias.to(dtype))
    if causal:  # 1D only (validated upstream): keep offsets r = j - i <= 0
        keep = torch.arange(-(n - 1), n, device=device) <= 0
        c = c * keep.to(dtype)
    return c


FFT_ERROR_KAPPA = 1.0  # the constant of :func:`fft_error_bound`; measured errors stayed below 0.12 of it


# float64 values :func:`fft_error_bound` reduces at a time (8 MB)
FFT_BOUND_CHUNK = 1 << 20


def _worst_mass_ratio(q: torch.Tensor, k: torch.Tensor, key_mask: Optional[torch.Tensor]) -> float:
    """``R = max_i (q_i . K) / (q_i . P_i)`` over rows with ``q_i . P_i > 0`` (else 1.0),
    ``P_i = sum_{j <= i} k_j`` over unpadded keys, ``K = P_{N-1}``; in float64, read in slices of
    about :data:`FFT_BOUND_CHUNK` values (prefix sums carried across slices)."""
    b, h, n, m = q.shape
    rows = max(1, FFT_BOUND_CHUNK // max(1, b * h * m))
    keep = None if key_mask is None else key_mask[:, None, :, None]

    def keys(s: int, e: int) -> torch.Tensor:
        kc = k[:, :, s:e].to(torch.float64, copy=True)  # a copy, also of float64 keys: written in place below
        return kc if keep is None else kc.mul_(keep[:, :, s:e])

    total = sum(keys(s, min(s + rows, n)).sum(dim=2) for s in range(0, n, rows))  # K: (B, H, M)
    carry = torch.zeros_like(total)[:, :, None]  # the keys before the slice, summed
    worst = None
    for s in range(0, n, rows):
        e = min(s + rows, n)
        prefix = keys(s, e).cumsum_(dim=2).add_(carry)  # P_i of the slice's rows
        carry = prefix[:, :, -1:].clone()
        qc = q[:, :, s:e].double()
        whole = (qc @ total[..., None])[..., 0]  # q_i . K
        seen = prefix.mul_(qc).sum(-1)  # q_i . P_i
        live = seen > 0
        if bool(live.any()):
            top = (whole[live] / seen[live]).max()
            worst = top if worst is None else torch.maximum(worst, top)
    return 1.0 if worst is None else float(worst)


def fft_error_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False,
    key_mask: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> float:
    """Bound on :func:`fft_attention`'s error in ``dtype`` (default: its compute dtype), relative to
    the values: ``max_i |out_i - exact_i|_inf / max |v|``.

    ``bound = FFT_ERROR_KAPPA * eps_dtype * exp(S) * R``, ``S = max b - min b`` over the offsets in
    use (``r <= 0`` when causal), ``R = max_i (q_i . K) / (q_i . P_i)``: the whole sequence's key
    mass ``K`` against what row ``i`` sees, ``P_i`` (1 non-causal; about ``N / (i + 1)`` causal).

    Why: the transform computes ``T_m(l) = sum_j c_{j-l} k_jm v_j`` with absolute error about
    ``eps`` times the largest ``|T_m| <= exp(max b) K_m max|v|``, while row ``i``'s denominator is
    at least ``exp(min b) q_i . P_i``. Signed features (trf) can cancel: ``inf``; also ``inf``
    while tracing.
    """
    dt = dtype if dtype is not None else compute_dtype_for(q)
    if torch.compiler.is_compiling():  # no data to read
        return math.inf
    with torch.no_grad():
        q, k = q.detach(), k.detach()
        # signs read in the input dtype (exact, no copy); a NaN is not negative
        if any(x.numel() and bool(x.amin() < 0) for x in (q, k)):
            return math.inf
        span = 0.0
        if rpe_bias is not None:
            n = q.shape[2]
            b = rpe_bias.detach().double()
            used = b[:, :n] if causal else b.reshape(b.shape[0], -1)
            span = float((used.amax(-1) - used.amin(-1)).max())
            if not math.isfinite(span):
                return math.inf
        ratio = _worst_mass_ratio(q, k, key_mask) if causal else 1.0
    if span > 700:
        return math.inf
    return FFT_ERROR_KAPPA * torch.finfo(dt).eps * math.exp(span) * ratio


@full_precision
def fft_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False, grid: Optional[Sequence[int]] = None, eps: float = 1e-6,
) -> torch.Tensor:
    """Kernelized attention with a Toeplitz RPE by FFT, O(N M D log N). Returns ``(B, H, N, D)``.

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)``, ``rpe_bias`` ``(H, 2N-1)`` or, with
    ``grid = (Hg, Wg)``, ``(H, 2Hg-1, 2Wg-1)``, in the compute dtype, padded keys and values zero.
    The transform mixes all positions, so its rounding error follows the sequence's largest entries
    (:func:`fft_error_bound`); rows without any allowed key return exactly 0.
    """
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        attached = q.sum() + k.sum() + (0 if rpe_bias is None else rpe_bias.sum().to(v.dtype))
        return v * 0 + attached * 0
    n = q.shape[-2]
    if rpe_bias is not None:
        rpe_bias, eps = shifted_bias(rpe_bias, n, causal, eps)
    c = toeplitz_coefficients(rpe_bias, n, q.shape[1], causal, grid, q.dtype, q.device)
    # a row with no nonzero product q_im k_jm has numerator and denominator exactly 0 but would read the
    # other rows' rounding noise over eps: it gets 0, as the formula gives
    args = (q, k, v, c, eps, _dead_rows(q.detach(), k.detach(), causal), spatial_shape(n, grid))
    if torch.compiler.is_dynamo_compiling():
        return _compiled_attention(*args)
    return FFTAttention.apply(*args)


def _dead_rows(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(B, H, N)`` bool: rows whose every product ``q_im k_jm`` over allowed keys is zero."""
    if causal:
        seen = k.abs().cumsum_(dim=2).mul_(q).abs_().sum(-1)  # |q_im| P_im = |q_im P_im| (P >= 0)
    else:
        total = torch.linalg.vector_norm(k, ord=1, dim=2)  # (B, H, M): sum_j |k_jm|
        seen = (q.abs() @ total[..., None])[..., 0]
    return ~(seen > 0)
