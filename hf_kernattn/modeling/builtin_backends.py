"""The built-in backends every family can run, registered with their declared capabilities
(``manhattan`` and ``hybrid`` register in their own files, imported by the families that use them).
"""

from __future__ import annotations

from .kernels_dense import dense_attention
from .kernels_fft import fft_attention, fft_error_bound
from .kernels_linear import causal_chunked_attention, linear_attention, recurrent_attention
from .kernels_windowed import windowed_attention
from .registry import register_backend

STATE_ARGUMENTS = ("initial_state", "output_final_state")
# propagates_non_finite (linear, causal_chunked): a NaN/inf in a real key or value makes a row of
# S = sum_j k_j^T v_j non-finite (0 * inf = NaN too), and every query reads every row of S
# (causal_chunked: at least the query at that position, through the chunk's diagonal); a NaN/inf
# query makes its own q_i S non-finite. Dividing keeps it so (an inf numerator over an inf or NaN
# denominator is NaN). Not covered: q_den, k_den (finite / inf = 0), which the entry point sums.
SPLIT_ARGUMENTS = ("q_den", "k_den")
register_backend(
    "dense", dense_attention, takes=("rpe_bias", "causal", "grid", "eps") + SPLIT_ARGUMENTS, causal=True, noncausal=True,
    rpe_1d=True, rpe_2d=True, split_denominator=True, symbolic_n=True, keeps_inputs=True,
    complexity="O(N^2 M)", description="exact quadratic form in blocks of queries (keeps no N x N matrix)",
)
register_backend(
    "linear", linear_attention, takes=("eps",) + SPLIT_ARGUMENTS, causal=False, noncausal=True, split_denominator=True,
    symbolic_n=True, propagates_non_finite=True, complexity="O(N M D)", description="non-causal linear attention q (k^T v)",
)
register_backend(
    "causal_chunked", causal_chunked_attention, takes=("eps",) + SPLIT_ARGUMENTS + STATE_ARGUMENTS, causal=True,
    noncausal=False, split_denominator=True, state=True, propagates_non_finite=True,
    complexity="O(N C (M + D) + N M D)", description="causal linear attention, exact chunks plus running state",
)
register_backend(
    "fft", fft_attention, takes=("rpe_bias", "causal", "grid", "eps"), causal=True, noncausal=True, rpe_1d=True, rpe_2d=True,
    error_bound=fft_error_bound, complexity="O(N M D log N)", description="Toeplitz / block-Toeplitz RPE by FFT (Luo et al. 2021), 1D and 2D",
)
register_backend(
    "windowed", windowed_attention, takes=("rpe_bias", "rpe_clip", "causal", "eps") + STATE_ARGUMENTS,
    causal=True, noncausal=True, rpe_1d=True, needs_rpe_clip=True, state=True,
    complexity="O(N K (M + D) + N M D)",
    description="exact for a bias clipped at K (rpe_clip): dense near the diagonal, running sums beyond",
)
register_backend(
    "recurrent", recurrent_attention, takes=("rpe_bias", "rpe_clip", "eps") + SPLIT_ARGUMENTS + STATE_ARGUMENTS,
    causal=True, noncausal=False, rpe_1d=True, decoding=True, state=True, split_denominator=True,
    complexity="O(M D) per token, O(K (M + D)) clipped at K",
    description="RNN form, one token at a time (decoding)",
)
