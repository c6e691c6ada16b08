"""The ``fft`` backend's attention (``fft_attention``) makes no whole copies around its Toeplitz
product: the ones column of ``[v, 1]`` exists only in each pass's feature-major copy of ``v``, the
division by the row mass reads the passes' results directly, and the backward keeps only its
inputs, its output and the denominators (no ``[v, 1]``, no numerator with its denominator), from
which it forms the gradient of the product pass by pass. Outputs and gradients stay those of the
float64 reference, and rows without any allowed key stay exactly 0 with zero gradients."""

from __future__ import annotations

import pytest
import torch

from hf_kernattn.modeling import kernels_fft
from hf_kernattn.modeling.kernels_fft import fft_attention
from tests.reference import WholeHeadAllocations, literal_reference

B, H, M, D = 2, 3, 4, 5


def _CountWholeHeads(n):
    """Counts new tensors spanning every head with at least ``N x min(M, D)`` values per head and
    batch row: the outputs and gradients, and any whole copy."""
    return WholeHeadAllocations(H, B * H * n * min(M, D))


def _inputs(n, bias_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    bias = 0.5 * torch.randn(H, *bias_shape, generator=g, dtype=torch.float64)
    return [x.requires_grad_(True) for x in (q, k, v, bias)]


CASES = [(False, None), (True, None), (False, (4, 6))]  # (causal, grid): 1D, causal 1D, 2D


def _call(xs, causal, grid):
    return fft_attention(*xs[:3], rpe_bias=xs[3], causal=causal, grid=grid)


@pytest.mark.parametrize("causal,grid", CASES)
def test_only_the_output_and_gradients_span_every_head(monkeypatch, causal, grid):
    """One head per pass: the forward allocates two whole-heads tensors (the output and the
    ``|q|`` of the check for rows without keys, freed before the product), the backward three
    (dq, dk, dv)."""
    n = 24
    xs = _inputs(n, (2 * n - 1,) if grid is None else tuple(2 * s - 1 for s in grid))
    monkeypatch.setattr(kernels_fft, "FFT_HEAD_CHUNK_BYTES", 1)
    fwd, bwd = _CountWholeHeads(n), _CountWholeHeads(n)
    with fwd:
        out = _call(xs, causal, grid)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    with bwd:
        out.backward(dy)
    assert (fwd.count, bwd.count) == (2, 3)


@pytest.mark.parametrize("causal,grid", CASES)
def test_saves_no_copy_of_the_values_or_the_numerator(causal, grid):
    """Beyond the storages of q, k, v and the output, the tensors kept for the backward hold the
    coefficients (of the bias' size) and one denominator per row: at most ``B H N`` values besides the
    coefficients (before: ``[v, 1]`` and the numerator with its denominator, 2 ``B H N (D+1)``)."""
    n = 24
    xs = _inputs(n, (2 * n - 1,) if grid is None else tuple(2 * s - 1 for s in grid))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _call(xs, causal, grid)
    own = {x.untyped_storage().data_ptr() for x in (*xs[:3], out)}
    extra = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
             if t.untyped_storage().data_ptr() not in own}
    coefficients = 3 * xs[3].numel() * 8  # exp(b - shift), and when causal its mask and the masked coefficients
    assert sum(extra.values()) <= B * H * n * 8 + coefficients


@pytest.mark.parametrize("causal,grid", CASES)
def test_matches_the_reference_with_gradients_and_keeps_dead_rows_zero(causal, grid):
    """float64 against the literal formula (outputs and gradients of q, k, v and the bias); a
    batch row whose first keys are zero (padding) has causal rows that see no key: exactly 0,
    and they pass no gradient."""
    n = 24 if grid is None else grid[0] * grid[1]
    xs = _inputs(n, (2 * n - 1,) if grid is None else tuple(2 * s - 1 for s in grid))
    with torch.no_grad():
        xs[1][1, :, :5] = 0  # keys 0..4 of batch row 1: no products (with causal, rows 0..4 see nothing)
        xs[2][1, :, :5] = 0
    dy = torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = _call(xs, causal, grid)
    grads = torch.autograd.grad(out, xs, dy)
    ref = literal_reference(*xs[:3], bias=xs[3], causal=causal, grid=grid)
    ref_grads = torch.autograd.grad(ref, xs, dy)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)
    if causal:
        assert torch.equal(out[1, :, :5], torch.zeros_like(out[1, :, :5]))
        assert torch.equal(grads[0][1, :, :5], torch.zeros_like(grads[0][1, :, :5]))
