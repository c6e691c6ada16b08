"""Dense kernelized attention: the exact, quadratic reference.

Formula (``r = j - i``, ``c_r = exp(b_r)``, all ones without a bias)::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal), 1D or 2D bias. It builds the ``N x N`` matrix
``A[i, j] = c_{j-i} (q_i . k_j)`` and returns ``A v / (A 1 + eps)``; with separate denominator
features ``A v / (A' 1 + eps)``, ``A'[i, j] = q_den_i . k_den_j`` (no bias).

Cost: time O(N^2 (M + D)), memory O(N^2) per head (the matrix and its bias).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .kernels_common import dense_bias_matrix, full_precision, shifted_bias, with_ones_column


@full_precision
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False, grid: Optional[Sequence[int]] = None, eps: float = 1e-6,
    q_den: Optional[torch.Tensor] = None, k_den: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact quadratic reference: ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype, padded
    keys and values already zero (``kernels_common.mask_keys``); ``rpe_bias`` ``(H, 2N-1)`` or,
    with ``grid = (Hg, Wg)``, ``(H, 2Hg-1, 2Wg-1)``; ``q_den, k_den`` ``(B, H, N, M')`` or None.
    Returns ``(B, H, N, D)``."""
    n = q.shape[-2]
    a = q @ k.transpose(-1, -2)  # (B, H, N, N)
    a_den = None if q_den is None else q_den @ k_den.transpose(-1, -2)
    if rpe_bias is not None:
        bias, eps_h = shifted_bias(rpe_bias, n, causal, eps)
        # exp on the (H, 2N-1) / (H, 2Hg-1, 2Wg-1) table, then spread to (H, N, N): one
        # exponential per offset instead of one per (query, key) pair, same values
        a = a * dense_bias_matrix(torch.exp(bias), n, grid)[None]
        eps = eps_h[None, :, None, None]
    if causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        a = torch.where(allowed, a, zero)
        a_den = None if a_den is None else torch.where(allowed, a_den, zero)
    if a_den is not None:
        return (a @ v) / (a_den.sum(dim=-1, keepdim=True) + eps)
    # numerator and denominator in one product: no separate pass over the (N, N) matrix for its
    # row sums, forward or backward
    y = a @ with_ones_column(v)
    return y[..., :-1] / (y[..., -1:] + eps)
