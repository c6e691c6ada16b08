"""The FFT product (``ToeplitzKernelProduct``) runs in passes over groups of heads: the same
outputs and gradients (of q, k, v and the table, one table row per head or one for all) whatever
the grouping, and only the outputs and gradients span every head: the feature-major copies and
FFT buffers are one pass's, so the memory beyond them stays bounded as heads x N grows."""

from __future__ import annotations

import pytest
import torch

from tests.reference import WholeHeadAllocations

from hf_kernattn.modeling import kernels_fft
from hf_kernattn.modeling.kernels_fft import ToeplitzKernelProduct, head_chunks, toeplitz_kernel_product_reference

B, H, M, D1 = 2, 4, 3, 5


def _inputs(spatial, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in spatial:
        n *= s
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, D1, generator=g, dtype=torch.float64)
    c = torch.rand(rows, *(2 * s - 1 for s in spatial), generator=g, dtype=torch.float64)
    return [x.requires_grad_(True) for x in (q, k, v, c)]


def _run(fn, xs, seed=1):
    out = fn(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return out, torch.autograd.grad((out * w).sum(), xs)


def test_head_chunks():
    assert head_chunks(1, 12, 1024, 65, 4, budget=64 << 20) == [(0, 12)]
    assert head_chunks(1, 12, 65536, 65, 8, budget=64 << 20) == [(h, h + 1) for h in range(12)]
    assert head_chunks(2, 5, 10, 3, 8, budget=2 * 2 * 10 * 3 * 8) == [(0, 2), (2, 4), (4, 5)]
    assert head_chunks(4, 3, 10, 3, 8, budget=1) == [(0, 1), (1, 2), (2, 3)]  # at least one head


@pytest.mark.parametrize("spatial", [(13,), (3, 4)])
@pytest.mark.parametrize("rows", [H, 1])
@pytest.mark.parametrize("budget", [1, B * 2 * 13 * D1 * 8])  # one head per pass, or two
def test_passes_match_one_pass_and_the_reference(monkeypatch, spatial, rows, budget):
    xs = _inputs(spatial, rows)
    whole, whole_grads = _run(lambda *a: ToeplitzKernelProduct.apply(*a, spatial), xs)
    ref, ref_grads = _run(lambda q, k, v, c: toeplitz_kernel_product_reference(q, k, v, c.expand(H, *c.shape[1:]), spatial), xs)
    monkeypatch.setattr(kernels_fft, "FFT_HEAD_CHUNK_BYTES", budget)
    assert len(head_chunks(B, H, xs[0].shape[2], D1, 8)) > 1
    out, grads = _run(lambda *a: ToeplitzKernelProduct.apply(*a, spatial), xs)
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-13)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, w, r in zip(grads, whole_grads, ref_grads):
        assert g.shape == r.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)


def _CountWholeHeads(n):
    """Counts new tensors spanning every head with at least ``N x min(M, D1)`` values per head and
    batch row: the outputs and gradients, and any whole copy."""
    return WholeHeadAllocations(H, B * H * n * min(M, D1))


@pytest.mark.parametrize("spatial", [(64,), (8, 8)])
def test_only_outputs_and_gradients_span_every_head(monkeypatch, spatial):
    """One head per pass: the forward allocates one whole-heads tensor (Y), the backward three
    (dq, dk, dv); in one pass over every head there are also the feature-major copies of q, k, v
    (and dY) and the FFT buffers."""
    xs = _inputs(spatial, H)
    n = xs[0].shape[2]
    monkeypatch.setattr(kernels_fft, "FFT_HEAD_CHUNK_BYTES", 1)
    fwd, bwd = _CountWholeHeads(n), _CountWholeHeads(n)
    with fwd:
        out = ToeplitzKernelProduct.apply(*xs, spatial)
    dy = torch.ones_like(out)
    with bwd:
        out.backward(dy)
    assert (fwd.count, bwd.count) == (1, 3)
    monkeypatch.setattr(kernels_fft, "FFT_HEAD_CHUNK_BYTES", 1 << 40)  # every head in one pass
    fwd, bwd = _CountWholeHeads(n), _CountWholeHeads(n)
    with fwd:
        out = ToeplitzKernelProduct.apply(*xs, spatial)
    with bwd:
        out.backward(dy)
    assert fwd.count > 1 and bwd.count > 3
