"""Kernelized attention with a Toeplitz relative-position bias, by FFT (1D and 2D).

Formula (``r = j - i``, ``c_r = exp(b_r)``; a 2D bias on a row-major ``(Hg, Wg)`` grid uses the
offsets ``(dy, dx)``)::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal: the coefficients of ``r > 0`` are zeroed).
Numerator and denominator are one Toeplitz (or Toeplitz-block-Toeplitz) product over ``[v, 1]``
(``kernels_toeplitz.ToeplitzKernelProduct``), after shifting the bias by its maximum so that no
coefficient exceeds 1.

Cost: time O(N M D log N), memory O(N (M + D)) plus one block of FFT buffers. Accuracy: see
:func:`fft_attention` and :func:`fft_error_bound`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .kernels_common import compute_dtype_for, full_precision, shifted_bias, with_ones_column
from .kernels_toeplitz import ToeplitzKernelProduct, spatial_shape


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
    Pass a shifted bias (``kernels_common.bias_shift``) so that no coefficient exceeds 1."""
    spatial = spatial_shape(n, grid)
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False, grid: Optional[Sequence[int]] = None, eps: float = 1e-6,
) -> torch.Tensor:
    """Kernelized attention with a Toeplitz RPE by FFT, O(N M D log N). Returns ``(B, H, N, D)``.

    Accuracy. The transform mixes all positions, so its rounding error is set by the largest
    entries of the sequence, not by each row's own: in float32 the error relative to the values
    is bounded by :func:`fft_error_bound`, ``eps * exp(S) * R`` (S the span of the bias, R the
    ratio of the whole sequence's key mass to the mass a row sees; about N for the first rows of
    a causal call). Non-causal float32 calls with a moderate bias stay near 1e-7; causal ones grow
    like ``N eps`` (1.2e-5 at N = 1k, 3e-3 at 131k) and a bias span of S multiplies by up to
    ``e^S``. The coefficients are shifted by their maximum (``kernels_common.bias_shift``), so a large
    bias never overflows. Inputs in float64 run the whole product in float64 (error ~1e-16 of
    the same factors); ``backend="auto"`` computes in float64, or picks an exact backend, where
    float32 cannot meet ``1e-4``. Rows without any allowed key return exactly 0.

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` and ``rpe_bias`` (``(H, 2N-1)``, or with
    ``grid = (Hg, Wg)`` ``(H, 2Hg-1, 2Wg-1)``) in the dtype to compute in, padded keys and
    values already zero.
    """
    n, d = q.shape[-2], v.shape[-1]
    if rpe_bias is not None:
        rpe_bias, eps_h = shifted_bias(rpe_bias, n, causal, eps)
        eps = eps_h[None, :, None, None]
    c = toeplitz_coefficients(rpe_bias, n, q.shape[1], causal, grid, q.dtype, q.device)
    v1 = with_ones_column(v)
    y = ToeplitzKernelProduct.apply(q, k, v1, c, spatial_shape(n, grid))
    out = y[..., :d] / (y[..., d:] + eps)
    # The transform mixes every position: a row for which every product q_im k_jm over its
    # allowed keys is zero (all of them padding, or features with disjoint support) has exact
    # numerator and denominator 0, but would read rounding noise of the other rows divided by
    # eps. It gets exactly 0, as the formula (and every other backend) gives.
    seen, _ = _row_key_mass(q.detach(), k.detach(), causal, absolute=True)
    return torch.where((seen > 0)[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
