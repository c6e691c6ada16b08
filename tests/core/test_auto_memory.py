"""Memory safety of ``backend="auto"`` and of the backends it runs: ``auto`` passes over the dense
backend where that would hold a ``(B, H, N, N)`` matrix above ``AUTO_MAX_NN_BYTES`` (its
unblocked form, which runs at any N while torch.compile / torch.export trace), dense's small-call
unblocked form has a cap on batch x heads x N^2, and ``fft_attention`` returns empty results for
empty inputs.

Tolerances: float64 inputs against the float64 literal reference; every backend computes the same
formula, sums of a few dozen O(1) terms, so they agree to ~1e-13 (1e-10 allowed)."""

from __future__ import annotations

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling import dispatch, kernels_dense, kernels_fft, registry
from hf_kernattn.modeling.kernels_fft import fft_attention
from tests.reference import WholeHeadAllocations, literal_reference

TOL = dict(rtol=1e-10, atol=1e-10)


def _inputs(b, h, n, m=4, d=5, seed=0, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, m, generator=g, dtype=dtype)
    k = torch.rand(b, h, n, m, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    bias = 0.3 * torch.randn(h, 2 * n - 1, generator=g, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v, bias)]


def _compiled_nn(fn, n, *args):
    """``(fn compiled and run on args, whether a tensor of its captured graphs ends in (n, n))``:
    a TorchDynamo backend that records the FX graphs and runs them as they are (no code
    generation: seconds, not minutes); operations outside the graphs run eagerly, as they do
    under torch.compile."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=record)(*args)
    finally:
        torch._dynamo.reset()
    vals = [node.meta.get("example_value") for gm in graphs for node in gm.graph.nodes]
    square = any(isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[-2:]) == (n, n) for x in vals)
    assert graphs
    return out, square


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_dense_runs_blocked_outside_the_graph_above_a_size(monkeypatch, causal):
    """Under torch.compile dense traces its unblocked form (the whole (B, H, N, N) matrix) only up
    to ``DENSE_COMPILED_SCORES`` scores; above, its blocked form runs eagerly outside the graph (a
    graph break), so ``auto`` keeps the table's choice (dense, no FFT) with memory linear in N;
    both match the float64 reference."""
    b, h, n = 1, 2, 40
    q, k, v, bias = _inputs(b, h, n)
    plans = []
    real = kernels_dense.DensePlan.__init__
    monkeypatch.setattr(kernels_dense.DensePlan, "__init__",
                        lambda self, *a, **kw: plans.append(1) or real(self, *a, **kw))

    def attend(q, k, v, bias):
        return hf_kernattn.kernelized_attention(q, k, v, bias, causal)

    want = literal_reference(q, k, v, bias, causal=causal)
    monkeypatch.setattr(kernels_dense, "DENSE_COMPILED_SCORES", b * h * n * n)  # the matrix just fits
    out, square = _compiled_nn(attend, n, q, k, v, bias)
    assert square and not plans  # unblocked, in the graph
    torch.testing.assert_close(out, want, **TOL)
    monkeypatch.setattr(kernels_dense, "DENSE_COMPILED_SCORES", b * h * n * n - 1)  # one score too many
    fft = []
    monkeypatch.setattr(kernels_fft.FFTAttention, "apply", lambda *a: fft.append(1))
    monkeypatch.setattr(kernels_fft, "_compiled_attention", lambda *a: fft.append(1))  # its form under compile
    out, square = _compiled_nn(attend, n, q, k, v, bias)
    assert not square and plans and not fft  # dense, blocked, outside the graph
    torch.testing.assert_close(out, want, **TOL)


def test_exported_auto_skips_dense_above_the_bound_and_keeps_it_below(monkeypatch):
    """Under torch.export (one graph, no eager part) dense can only run unblocked: ``auto`` takes
    it while its (B, H, N, N) matrix is at most ``AUTO_MAX_NN_BYTES``, the next candidate of the
    table above (here ``linear``, without a bias); both match the float64 reference."""
    b, h, n = 1, 2, 40
    q, k, v, _ = _inputs(b, h, n, seed=5)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return hf_kernattn.kernelized_attention(q, k, v)

    def exported():
        program = torch.export.export(Attend(), (q, k, v))
        vals = [node.meta.get("val") for node in program.graph.nodes]
        square = any(isinstance(x, torch.Tensor) and tuple(x.shape[-2:]) == (n, n) for x in vals)
        return program.module()(q, k, v), square

    want = literal_reference(q, k, v)
    monkeypatch.setattr(dispatch, "AUTO_MAX_NN_BYTES", b * h * n * n * 8)  # the matrix just fits
    out, square = exported()
    assert square  # dense, unblocked
    torch.testing.assert_close(out, want, **TOL)
    monkeypatch.setattr(dispatch, "AUTO_MAX_NN_BYTES", b * h * n * n * 8 - 1)
    out, square = exported()
    assert not square  # linear
    torch.testing.assert_close(out, want, **TOL)


def test_compiled_auto_counts_batch_heads_and_dtype_and_the_shipped_bound_holds(monkeypatch):
    """The bound counts B x H x N^2 entries of the compute dtype: a small call keeps dense under
    the shipped bound (256 MiB), while a 12-head 2D call at 128 x 128 tokens (12.9 GB per matrix in
    float32) would not, nor would batch 64 x 12 heads at 1,024 tokens (3.2 GB)."""
    assert registry.AUTO_MAX_NN_BYTES == dispatch.AUTO_MAX_NN_BYTES == 1 << 28
    # torch.compile with static sizes keeps dense's matrices in its graph only up to the bound (float64 too)
    assert kernels_dense.DENSE_COMPILED_SCORES * 8 <= registry.AUTO_MAX_NN_BYTES
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    meta = torch.empty(1, 12, 128 * 128, 64, device="meta")
    assert dispatch._dense_too_large(meta, torch.float32, True, True)
    assert not dispatch._dense_too_large(torch.empty(1, 12, 64, 64, device="meta"), torch.float32, True, True)
    assert dispatch._dense_too_large(torch.empty(64, 12, 1024, 64, device="meta"), torch.float32, False, True)
    assert not dispatch._dense_too_large(torch.empty(1, 1, 8192, 64, device="meta"), torch.float32, False, False)
    assert dispatch._dense_too_large(torch.empty(1, 1, 8192, 64, device="meta"), torch.float64, False, False)
    monkeypatch.undo()
    # eager mode: blocked from there on, nothing too large; a small forward+backward call runs unblocked
    assert kernels_dense.materialized_scores(1, 12, 128 * 128, table=True, backward=True) == 0
    assert kernels_dense.materialized_scores(1, 12, 100, table=True, backward=True) == 12 * 100 * 100


def test_compiled_auto_runs_dense_when_no_other_candidate_can(monkeypatch):
    """When the table ranks nothing else that can run the call, dense still runs above the bound
    (the result is right; outside TorchDynamo's graphs a warning names the bound)."""
    from hf_kernattn import load_auto_table

    q, k, v, bias = _inputs(1, 2, 24, seed=3)
    monkeypatch.setattr(dispatch, "AUTO_MAX_NN_BYTES", 0)
    table = {"format": 1, "source": {"note": "test"}, "entries": [
        {"mode": "fwd", "bias": "1d", "causal": False, "clip": None, "dtype": "float32", "heads": 1,
         "ranking": [[None, ["dense"]]]}]}
    load_auto_table(table, replace=True)
    try:
        out, square = _compiled_nn(lambda *x: hf_kernattn.kernelized_attention(*x), 24, q, k, v, bias)
        assert square
        torch.testing.assert_close(out, literal_reference(q, k, v, bias), **TOL)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: False)  # as torch.export's tracing
        logged = []
        monkeypatch.setattr(dispatch.logger, "warning", lambda msg, *a: logged.append(msg))
        name, _ = dispatch._auto_precision([("dense", None)], q, k, lambda: bias, False, None, table=True)
        assert name == "dense" and "AUTO_MAX_NN_BYTES" in logged[0]
    finally:
        load_auto_table(None)


@pytest.mark.parametrize("grid", [None, (14, 14)])
def test_dense_small_calls_run_unblocked_only_up_to_a_total_size(grid):
    """Dense's small forward+backward calls with a table (a bias) run unblocked (one (B, H, N, N)
    matrix, kept by autograd) only while B x H x N^2 is at most DENSE_UNBLOCKED_TABLE_SCORES:
    a batch beyond it runs in blocks (no new tensor of N^2 values per head), with the same result."""
    n, h = 196, 2
    cap = kernels_dense.DENSE_UNBLOCKED_TABLE_SCORES
    small = max(1, cap // (h * n * n))  # the largest batch under the cap
    large = small + 1
    assert kernels_dense.runs_unblocked(small, h, n, True) and not kernels_dense.runs_unblocked(large, h, n, True)
    for b, unblocked in ((small, True), (large, False)):
        q, k, v, _ = _inputs(b, h, n, grad=True)
        g = torch.Generator().manual_seed(7)
        side = grid[0] if grid else None
        bias = (0.3 * torch.randn(h, *((2 * side - 1,) * 2 if grid else (2 * n - 1,)), generator=g,
                                  dtype=torch.float64)).requires_grad_()
        with WholeHeadAllocations(h, b * h * n * n) as counter:
            out = kernels_dense.dense_attention(q, k, v, rpe_bias=bias, grid=grid)
            out.sum().backward()
        assert (counter.count > 0) == unblocked
        if not unblocked:  # the blocked result is the formula's (one check: the reference builds N^2 for every pair)
            torch.testing.assert_close(out, literal_reference(q, k, v, bias, grid=grid), **TOL)


@pytest.mark.parametrize("shape", [(0, 3, 5, 4, 6), (2, 0, 5, 4, 6), (2, 3, 0, 4, 6), (2, 3, 5, 0, 6), (2, 3, 5, 4, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_fft_attention_with_an_empty_dimension_returns_the_empty_or_zero_result(shape, causal):
    """``fft_attention`` called directly with 0 sequences, heads, tokens, features or value columns
    gives the formula's result (empty, or zeros for M = 0) attached to every input, not an FFT
    library error."""
    b, h, n, m, d = shape
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(b, h, n, m, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(b, h, n, d, generator=g).requires_grad_()
    bias = torch.randn(h, 2 * n - 1, generator=g).requires_grad_() if n else None
    out = fft_attention(q, k, v, rpe_bias=bias, causal=causal)
    assert out.shape == (b, h, n, d) and out.dtype == v.dtype
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for x in (q, k, v) + ((bias,) if bias is not None else ()):
        assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))


def test_calibrate_max_nn_mb_skips_dense_only_where_it_holds_the_matrix():
    """``bench calibrate --max-nn-mb`` skips a backend where the N x N matrix it holds exceeds the
    limit: the blocked dense backend holds none (forward; forward+backward beyond its small-call
    rule), so it is timed there whatever the limit; its small forward+backward calls with a bias
    run unblocked and count; a backend declared O(N^2) without saying more always counts."""
    from hf_kernattn.bench import calibrate

    h, n = 2, 16
    nn = h * n * n * 4 / 2 ** 20
    assert calibrate._nn_mb("dense", n, h, True, False) == 0.0  # forward: blocked
    assert calibrate._nn_mb("dense", n, h, True, True) == nn  # a small forward+backward call: unblocked
    assert calibrate._nn_mb("dense", 12 * 1024, 12, True, True) == 0.0  # beyond the small-call rule: blocked
    assert calibrate._nn_mb("fft", n, h, True, True) == calibrate._nn_mb("linear", n, h, False, True) == 0.0
    hf_kernattn.register_backend("test_quadratic", lambda q, k, v, **kw: kernels_dense.dense_attention(q, k, v, **kw),
                                 complexity="O(N^2 M)")
    try:
        assert calibrate._nn_mb("test_quadratic", n, h, False, False) == nn
    finally:
        hf_kernattn.unregister_backend("test_quadratic")
    spec = dict(bias="1d", causal=False, clip=None, mode="fwd", ns=[n], sides=[], heads=h, features=4, head_dim=4,
                rounds=1, min_time=0.0, max_call_seconds=100.0, max_nn_mb=nn / 2, prune=3.0, threads=None,
                device="cpu", check=False, table=None, check_drop=None, skip=["fft", "fft@float64"])
    status = {r["backend"]: r["status"] for r in calibrate.measure_kind(spec)}
    assert status["dense"] == "ok"  # timed: the forward runs in blocks (it was skipped by the N x N rule)
    status = {r["backend"]: r["status"] for r in calibrate.measure_kind(dict(spec, mode="fwdbwd"))}
    assert status["dense"].startswith("skipped: N x N")  # the unblocked small call holds it


def _bound_in_whole_float64(q, k, bias, causal, mask):
    """The FFT error bound evaluated on whole float64 copies of q and k (its earlier form)."""
    import math

    from hf_kernattn.modeling.kernels_fft import FFT_ERROR_KAPPA

    q64, k64 = q.double(), k.double()
    if bool((q64 < 0).any()) or bool((k64 < 0).any()):
        return math.inf
    if mask is not None:
        k64 = k64 * mask[:, None, :, None].double()
    b = bias.double()
    used = b[:, : q.shape[2]] if causal else b.reshape(b.shape[0], -1)
    span = float((used.amax(-1) - used.amin(-1)).max())
    ratio = 1.0
    if causal:
        total = k64.sum(2, keepdim=True)
        seen, whole = (q64 * k64.cumsum(2)).sum(-1), (q64 * total).sum(-1)
        live = seen > 0
        if bool(live.any()):
            ratio = float((whole[live] / seen[live]).max())
    return FFT_ERROR_KAPPA * torch.finfo(q.dtype).eps * math.exp(span) * ratio


@pytest.mark.parametrize("chunk", [None, 7, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_fft_error_bound_in_slices_equals_the_whole_float64_evaluation(monkeypatch, causal, chunk):
    """``fft_error_bound`` reads q and k in float64 slices of rows (the prefix sums carried from
    slice to slice) and their signs in their own dtype: the bound equals the whole-float64
    evaluation to float64 rounding (1e-12 relative), with padding, keys that leave the first rows
    without mass, and negative features (inf)."""
    from hf_kernattn.modeling import kernels_fft

    if chunk is not None:
        monkeypatch.setattr(kernels_fft, "FFT_BOUND_CHUNK", chunk)  # values per slice: slices of 1 row up
    b, h, n, m = 2, 3, 37, 4
    g = torch.Generator().manual_seed(11)
    q = torch.rand(b, h, n, m, generator=g)
    k = torch.rand(b, h, n, m, generator=g) ** 3
    k[:, :, :5] = 0  # the first rows see no key mass (skipped); later ones a little
    bias = torch.randn(h, 2 * n - 1, generator=g)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 30:] = False
    for key_mask in (None, mask):
        got = kernels_fft.fft_error_bound(q, k, rpe_bias=bias, causal=causal, key_mask=key_mask)
        want = _bound_in_whole_float64(q, k, bias, causal, key_mask)
        assert got == pytest.approx(want, rel=1e-12)
        assert (got > 10 * kernels_fft.fft_error_bound(q, k, rpe_bias=bias)) == causal  # the first rows' ratio
    neg = q.clone()
    neg[1, 2, 30, 3] = -1e-3
    assert kernels_fft.fft_error_bound(neg, k, rpe_bias=bias, causal=causal) == float("inf")
    assert kernels_fft.fft_error_bound(q, -k, rpe_bias=bias, causal=causal) == float("inf")
    nan = q.clone()
    nan[0, 0, 3, 0] = float("nan")  # not negative: as the whole evaluation
    assert kernels_fft.fft_error_bound(nan, k, rpe_bias=bias, causal=causal) == pytest.approx(
        _bound_in_whole_float64(nan, k, bias, causal, None), rel=1e-12, nan_ok=True)


def test_fft_error_bound_makes_no_whole_copy_of_q_or_k(monkeypatch):
    """No tensor of a quarter of q's or k's size is allocated by the bound (a float64 copy was: the
    largest transient on auto's way to the FFT), causal or not, once q is larger than a slice."""
    from hf_kernattn.modeling import kernels_fft
    from hf_kernattn.modeling.kernels_fft import fft_error_bound

    b, h, n, m = 1, 4, 4096, 16
    monkeypatch.setattr(kernels_fft, "FFT_BOUND_CHUNK", b * h * n * m // 8)
    g = torch.Generator().manual_seed(3)
    q, k = torch.rand(b, h, n, m, generator=g), torch.rand(b, h, n, m, generator=g)
    bias = torch.randn(h, 2 * n - 1, generator=g)
    for causal in (False, True):
        with WholeHeadAllocations(h, b * h * n * m // 4) as counter:
            fft_error_bound(q, k, rpe_bias=bias, causal=causal, key_mask=torch.ones(b, n, dtype=torch.bool))
        assert counter.count == 0
