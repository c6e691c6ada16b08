"""The built-in attention backends every family can run, registered with their declared capabilities
(``manhattan`` and ``hybrid`` register themselves in their own files, imported by the families
that run them). The kernels are the ``kernels_*.py`` files (one per algorithm); the registry, the declared
capabilities and the ``auto`` rule are ``registry.py``; the entry point that checks a call and
runs a backend is ``dispatch.kernelized_attention``.
"""

from __future__ import annotations

from .kernels_dense import dense_attention
from .kernels_fft import fft_attention, fft_error_bound
from .kernels_linear import causal_chunked_attention, linear_attention, recurrent_attention
from .kernels_windowed import windowed_attention
from .registry import register_backend

STATE_ARGUMENTS = ("initial_state", "output_final_state")
# propagates_non_finite (linear, causal_chunked): a NaN/inf entry of a real key or value makes a
# row of S = sum_j k_j^T v_j non-finite (k_jm * x and x * v_jd are NaN/inf for every x, 0 * inf
# = NaN included), every query reads every row of S (q_i S: a sum holding a NaN/inf term is
# NaN/inf), and a NaN/inf query entry makes its own numerator q_i S non-finite; causal_chunked
# reads its own key and value exactly (the diagonal of the chunk's block), so the row of the
# query at that position is non-finite. The quotient by a finite denominator keeps it so, and
# without separate denominator features an inf numerator meets an inf or NaN denominator (NaN).
# Not covered: q_den, k_den (an inf there gives finite / inf = 0), which the entry point sums.
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
