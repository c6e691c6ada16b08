"""The FFT backend under ``torch.compile``: TorchDynamo traces it whole (``fullgraph=True``),
forward and backward, 1D and 2D, causal and not, with static sizes and with dynamic ones (one
graph for every length: the eager kernel's loops run inside custom operators the graph calls);
``auto`` traces whole with dynamic shapes too.

The backends used here need no C++ compiler: ``aot_eager`` (AOTAutograd's forward and backward
graphs, run as they are), ``eager``, or a backend that records Dynamo's graph and runs it.

Tolerances: float64 inputs against the float64 literal reference (tests.reference) and against eager mode:
the FFT's error in float64 is ``eps_64 exp(S) R`` (kernels_fft.fft_error_bound; eps_64 = 2.2e-16,
bias span S < 3 here, R <= N = 40 for the first causal rows), far inside 1e-10 for O(1) values and
their gradients; compiled and eager mode run the same kernel on the same inputs (only the few
operations around it, the bias shift and its exponential, go through AOTAutograd).
"""

from __future__ import annotations

import pytest
import torch

import hf_kernattn
from tests.reference import literal_reference

TOL64 = dict(rtol=1e-10, atol=1e-10)


def _inputs(n, grid=None, seed=0, dtype=torch.float64, b=2, h=2, m=4, d=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, m, generator=g, dtype=dtype)
    k = torch.rand(b, h, n, m, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    shape = (h, 2 * grid[0] - 1, 2 * grid[1] - 1) if grid else (h, 2 * n - 1)
    bias = 0.3 * torch.randn(*shape, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, bias)]


def _grads(out, xs):
    return torch.autograd.grad(out.square().sum(), xs)


def _recording():
    """A TorchDynamo backend that keeps the graphs it is given and runs them as they are."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return record, graphs


CASES = [(None, False), (None, True), ((4, 5), False)]


@pytest.mark.parametrize("grid, causal", CASES)
def test_fft_traces_whole_under_compile_and_matches_eager_and_the_reference(grid, causal):
    """``torch.compile(fullgraph=True)`` of the FFT backend (it wrote into preallocated buffers
    through strided ``out=`` views, which TorchDynamo refuses): outputs and gradients of q, k, v
    and the bias equal eager mode's and the float64 reference."""
    n = grid[0] * grid[1] if grid else 20

    def attend(q, k, v, bias):
        return hf_kernattn.kernelized_attention(q, k, v, bias, causal, grid=grid, backend="fft")

    torch._dynamo.reset()
    try:
        xs = _inputs(n, grid)
        out = torch.compile(attend, fullgraph=True, backend="aot_eager")(*xs)
    finally:
        torch._dynamo.reset()
    grads = _grads(out, xs)
    eager = attend(*xs)
    want = literal_reference(*xs, causal=causal, grid=grid)
    for reference in (eager, want):
        torch.testing.assert_close(out, reference, **TOL64)
        for got, exp in zip(grads, _grads(reference, xs)):
            torch.testing.assert_close(got, exp, **TOL64)


@pytest.mark.parametrize("causal", [False, True])
def test_fft_compiles_one_graph_for_every_length_with_dynamic_shapes(causal):
    """With ``dynamic=True`` the FFT backend traces with a symbolic N (its fast FFT lengths and
    blocks are chosen at run time, inside the operator): one graph serves N = 12, 20 and 33,
    with the reference's outputs and gradients at each."""
    record, graphs = _recording()

    def attend(q, k, v, bias):
        return hf_kernattn.kernelized_attention(q, k, v, bias, causal, backend="fft")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=record)
        for n in (12, 20, 33):
            xs = _inputs(n, seed=n)
            out = compiled(*xs)
            want = literal_reference(*xs, causal=causal)
            torch.testing.assert_close(out, want, **TOL64)
            for got, exp in zip(_grads(out, xs), _grads(want, xs)):
                torch.testing.assert_close(got, exp, **TOL64)
        assert len(graphs) == 1
    finally:
        torch._dynamo.reset()


def test_fft_on_a_dynamic_grid_compiles_one_graph():
    """A grid whose sides are symbolic (taken from the bias's shape, as a model takes them from
    the image) traces too: one graph for 3 x 4, 5 x 6 and 4 x 7."""
    record, graphs = _recording()

    def attend(q, k, v, bias):
        grid = ((bias.shape[1] + 1) // 2, (bias.shape[2] + 1) // 2)
        return hf_kernattn.kernelized_attention(q, k, v, bias, grid=grid, backend="fft")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=record)
        for grid in ((3, 4), (5, 6), (4, 7)):
            xs = _inputs(grid[0] * grid[1], grid, seed=grid[1], d=2)
            torch.testing.assert_close(compiled(*xs), literal_reference(*xs, grid=grid), **TOL64)
        assert len(graphs) == 1
    finally:
        torch._dynamo.reset()


def test_auto_chooses_inside_a_graph_with_dynamic_shapes():
    """``auto`` chooses inside the graph: with dynamic shapes the head count is symbolic, and the
    choice of the table entry measured nearest it (and of the nearest clipping K) traces without
    a graph break (``min`` with a ``key`` did not), giving eager mode's choice."""
    from hf_kernattn.modeling import registry

    def ask(q, clip):
        return registry.auto_candidates(n=q.shape[2], heads=q.shape[1], causal=False, rpe="1d", rpe_clip=clip,
                                        key_mask=False, device="cpu", backward=True)

    for clip in (None, 3, 100):
        chosen = []

        def attend(q):
            chosen.append(ask(q, clip))
            return q * 2

        q = torch.rand(1, 5, 40, 4)
        torch._dynamo.reset()
        try:
            torch.compile(attend, fullgraph=True, dynamic=True, backend="eager")(q)
        finally:
            torch._dynamo.reset()
        assert chosen == [ask(q, clip)]
