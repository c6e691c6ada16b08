"""Numerics of the attention core: mixed precision, redraw under recomputation, the FFT path's
accuracy, non-finite inputs, feature maps at large norms and empty inputs.

Ground truth is an independent float64 evaluation of the formula (``tests/reference.py``), never
another backend of the package.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling.registry import get_backend
from hf_kernattn import SoftmaxWindow

from tests.conftest import tiny_attention_config, tiny_linear_gpt_config, tiny_nprf_bert_config

from tests.reference import literal_reference


# ----------------------------------------------------------------------------- mixed precision

# (backend, causal, rpe) for the module test: every built-in backend in a call it can run
MODULE_CASES = [
    ("dense", False, True), ("linear", False, False), ("causal_chunked", True, False),
    ("fft", False, True), ("fft", True, True), ("windowed", False, True), ("recurrent", True, True),
    ("manhattan", False, "2d"), ("hybrid", True, "window"), ("hybrid", False, "window"),
]


def _bias(rpe, n: int, heads: int = 2):
    """The case's bias arguments: a 1D table clipped at 3, or a 2D bias of the Manhattan
    distance clipped at 2 on a grid of n tokens, as a module (its parameter gets the gradient);
    none for the sliding-window hybrid ("window")."""
    from hf_kernattn.modeling.kernels_common import manhattan_table

    if rpe == "window":
        return None, lambda: {}
    if rpe == "2d":
        grid = {9: (3, 3), 40: (5, 8)}[n]
        table = torch.nn.Parameter(0.5 * torch.randn(heads, 3, generator=torch.Generator().manual_seed(5)))
        return table, lambda: dict(rpe_bias=manhattan_table(table, *grid), grid=grid, rpe_clip=2)
    table = hf_kernattn.RelativePositionBias1D(heads, 3, init_std=0.5)
    return table.weight, lambda: dict(rpe_bias=table(n), rpe_clip=3) if rpe else {}


def _module_config(**kw):
    return tiny_attention_config(**{"feature_map": "prf", "recompute_attention": True, **kw})


def test_every_backend_is_registered_in_the_mixed_precision_cases():
    assert {c[0] for c in MODULE_CASES} == set(hf_kernattn.available_backends())


@pytest.mark.parametrize("feature_map", ["elu", "relu", "prf", "trf"])
@pytest.mark.parametrize("backend,causal,rpe", MODULE_CASES)
def test_attention_module_forward_backward_under_bf16_autocast(backend, causal, rpe, feature_map):
    """Under torch.autocast(cpu, bf16) the module runs forward and backward (the custom autograd
    ops see the dtypes they saved), and agrees with the float32 run to bf16 precision: the only
    autocast ops are the four projections (8-bit mantissa, eps_bf16 = 2^-7), whose relative error
    reaches the features at most amplified by |W||u| ~ 3 for prf/trf at these scales; 0.1 in
    relative norm is ~4x that, and far below the error of a wrong computation (order 1)."""
    torch.manual_seed(0)
    window = dict(softmax_window=3) if rpe == "window" else {}
    attn = hf_kernattn.KernelizedSelfAttention(
        _module_config(feature_map=feature_map, attn_backend=backend, **window), causal=causal
    )
    n = 9
    table, bias = _bias(rpe, n)
    x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, -2:] = 0
    results = []
    for autocast in (False, True):
        attn.zero_grad()
        if table is not None:
            table.grad = None
        xs = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attn(xs, attention_mask=mask, **bias())
            loss = out.float().pow(2).sum()
        loss.backward()
        grads = [xs.grad, attn.q_proj.weight.grad, attn.v_proj.weight.grad] + ([table.grad] if rpe and rpe != "window" else [])
        results.append((out.detach().float(), [g.clone() for g in grads]))
    (ref, ref_grads), (out, grads) = results
    for got, want in [(out, ref)] + list(zip(grads, ref_grads)):
        assert torch.isfinite(got).all()
        # relu and trf features can make a denominator q . sum k arbitrarily small (zero or
        # cancelling features), where no precision carries over: only finiteness is checked there
        if feature_map in ("elu", "prf"):
            assert (got - want).norm() <= 0.1 * want.norm()


@pytest.mark.parametrize("backend,causal,rpe", MODULE_CASES)
def test_attention_core_ignores_autocast(backend, causal, rpe):
    """Inside autocast the core itself still computes in float32: the result equals the call
    outside autocast to float32 rounding (bf16 products would differ by ~1e-2)."""
    g = torch.Generator().manual_seed(2)
    n = 40
    q = torch.rand(2, 2, n, 6, generator=g).requires_grad_(True)
    k = torch.rand(2, 2, n, 6, generator=g).requires_grad_(True)
    v = torch.randn(2, 2, n, 5, generator=g).requires_grad_(True)
    _, bias = _bias(rpe, n)
    window = dict(softmax_window=SoftmaxWindow(q, k, 3)) if rpe == "window" else {}  # q, k serve as the raw ones
    results = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = hf_kernattn.kernelized_attention(q, k, v, causal=causal, backend=backend, **bias(), **window)
        assert out.dtype == torch.float32
        grads = torch.autograd.grad(out.pow(2).sum(), [q, k, v])
        results.append((out, grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["prf", "trf"])
def test_feature_maps_ignore_autocast(kind):
    fm = hf_kernattn.FeatureMap(8, kind, 16, seed=4)
    x = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    outs = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            phi = fm(x, is_query=True)
        assert phi.dtype == torch.float32
        outs.append((phi, torch.autograd.grad(phi.sum(), x)[0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-6)


def test_tiny_models_train_under_bf16_autocast():
    """Forward and backward of both families under bf16 autocast on the CPU (the default prf map
    of NPRF-BERT included): a finite loss and finite gradients for every parameter."""
    from hf_kernattn import LinearGPTForCausalLM, NPRFBertForMaskedLM

    torch.manual_seed(0)
    bert = NPRFBertForMaskedLM(tiny_nprf_bert_config()).train()
    gpt = LinearGPTForCausalLM(tiny_linear_gpt_config(
        vocab_size=40, pad_token_id=None, initializer_range=0.02, feature_map="prf", num_random_features=16,
    )).train()
    ids = torch.randint(5, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -3:] = 0
    for model in (bert, gpt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        for name, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), name


# ----------------------------------------------------------------------------- redraw and recompute


@pytest.mark.parametrize("kind", ["prf", "trf"])
def test_redraw_between_two_forwards_and_one_backward_with_recompute(kind):
    """Gradient accumulation with a redraw in between: forward (projection P0), redraw (P1),
    forward (P1), one backward of the summed loss. The recomputation of the first forward must
    use P0. Reference: two copies of the module without recomputation, one holding P0 and one
    P1, gradients summed; float64, so the only tolerance is rounding (1e-10)."""
    import copy

    torch.manual_seed(0)
    attn = hf_kernattn.KernelizedSelfAttention(
        _module_config(feature_map=kind, feature_redraw_interval=1, recompute_attention=True)
    ).double().train()
    x1 = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x2 = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref0 = copy.deepcopy(attn)
    loss = attn(x1).pow(2).sum()
    attn.feature_map.step()  # redraw: draw 1
    assert int(attn.feature_map.num_draws) == 1
    ref1 = copy.deepcopy(attn)
    loss = loss + attn(x2).pow(2).sum()
    loss.backward()

    ref0.recompute = ref1.recompute = False
    assert not torch.equal(ref0.feature_map.projection, ref1.feature_map.projection)
    ref_loss = ref0(x1).pow(2).sum() + ref1(x2).pow(2).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-12, atol=0)
    for (name, p), p0, p1 in zip(attn.named_parameters(), ref0.parameters(), ref1.parameters()):
        torch.testing.assert_close(p.grad, p0.grad + p1.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_redraw_without_recompute_keeps_saved_projection_valid():
    """Without recomputation the feature op saves the projection for its backward: a redraw
    before the backward must not modify that tensor (autograd would refuse it, or worse)."""
    torch.manual_seed(0)
    attn = hf_kernattn.KernelizedSelfAttention(
        _module_config(feature_map="prf", feature_redraw_interval=1, recompute_attention=False)
    ).double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before = attn.feature_map.projection
    saved = before.clone()
    out = attn(x)
    attn.feature_map.step()
    assert attn.feature_map.projection is not before and torch.equal(before, saved)
    out.sum().backward()  # no "modified by an inplace operation" error
    assert attn.q_proj.weight.grad is not None


# ----------------------------------------------------------------------------- FFT accuracy


def _clipped_bias(n, seed, clip=2, h=2):
    """A bias from a table clipped at ``clip`` (what the windowed backend needs), float64."""
    torch.manual_seed(seed)
    return hf_kernattn.RelativePositionBias1D(h, clip, init_std=0.5).double()(n).detach()


def _positive_inputs(n, seed, b=2, h=2, m=5, d=4, dtype=torch.float32, span=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, m, generator=g, dtype=torch.float64) + 0.1
    k = torch.rand(b, h, n, m, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    bias = (torch.rand(h, 2 * n - 1, generator=g, dtype=torch.float64) - 0.5) * span
    return q.to(dtype), k.to(dtype), v.to(dtype), bias.to(dtype)


@pytest.mark.parametrize("seed", [10, 110, 210])
@pytest.mark.parametrize("causal", [True, False])
def test_fft_rows_without_allowed_keys_are_exactly_zero(causal, seed):
    """Causal with left padding: the padded prefix has no allowed key. Non-causal: a batch row
    that is all padding. Those rows are exactly 0 (as in dense), gradients finite, the other
    rows equal the float64 reference within the transform's own bound, ``fft_error_bound`` times
    max|v| (causal: the first real row after the padding sees one key while the transform's
    error scales with the mass of all 59, so the bound is ~2e-4 there, not the ~1e-6 of a
    non-causal call)."""
    from hf_kernattn.modeling.kernels_fft import fft_error_bound

    q, k, v, bias = _positive_inputs(64, seed=seed)
    mask = torch.ones(2, 64, dtype=torch.long)
    if causal:
        mask[1, :5] = 0
    else:
        mask[1] = 0
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = hf_kernattn.kernelized_attention(*xs, bias, causal, mask, backend="fft")
    empty = (mask.cumsum(-1) == 0) if causal else (mask.sum(-1, keepdim=True) == 0).expand_as(mask)
    assert empty.any()
    assert (out[empty[:, None, :, None].expand_as(out)] == 0).all()
    dense = hf_kernattn.kernelized_attention(q, k, v, bias, causal, mask, backend="dense")
    assert (dense[empty[:, None, :, None].expand_as(dense)] == 0).all()
    tol = fft_error_bound(q, k, rpe_bias=bias, causal=causal, key_mask=mask.bool()) * float(v.abs().max())
    assert tol < 1e-3  # a meaningful bound for these inputs
    torch.testing.assert_close(out.double(), literal_reference(q, k, v, bias, causal, mask), rtol=0, atol=tol)
    out.pow(2).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in xs)


BIAS_CASES = [("dense", False), ("dense", True), ("fft", False), ("fft", True), ("windowed", False),
              ("windowed", True), ("recurrent", True)]


@pytest.mark.parametrize("backend,causal", BIAS_CASES)
def test_constant_bias_cancels_in_every_backend(backend, causal):
    """A constant bias cancels: +-90 (exp(90) overflows float32) gives no NaN, matches the
    float64 formula with c = exp(b) taken literally, and with eps = 0 equals bias 0 (outputs
    and gradients, to float32 rounding)."""
    n = 24
    q, k, v, _ = _positive_inputs(n, seed=11)
    results = {}
    for const in (0.0, 90.0, -90.0):
        bias = torch.full((2, 2 * n - 1), const).requires_grad_(True)
        for eps in (1e-6, 0.0):
            xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = hf_kernattn.kernelized_attention(*xs, bias, causal, backend=backend, eps=eps, rpe_clip=3)
            grads = torch.autograd.grad(out.pow(2).sum(), xs + [bias])
            assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads), (const, eps)
            results[const, eps] = (out, grads)
        # the float64 literal formula (with eps = 1e-6: for -90 it is ~0, as computed)
        torch.testing.assert_close(results[const, 1e-6][0].double(), literal_reference(q, k, v, bias.detach(), causal),
                                   rtol=1e-5, atol=1e-6)
    for const in (90.0, -90.0):
        torch.testing.assert_close(results[const, 0.0][0], results[0.0, 0.0][0], rtol=1e-5, atol=1e-6)
        for g, g0 in zip(results[const, 0.0][1], results[0.0, 0.0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [12, 112, 212])
@pytest.mark.parametrize("n,causal,span", [(256, False, 0.0), (256, True, 0.0), (1024, True, 0.0),
                                           (1024, False, 8.0), (512, True, 6.0), (300, True, 8.0)])
def test_fft_float32_error_stays_within_its_stated_bound(n, causal, span, seed):
    """fft_error_bound is an upper bound of the measured float32 error (relative to max|v|)
    against the float64 formula, and it is not vacuous (below 1) in these cases."""
    from hf_kernattn.modeling.kernels_fft import fft_error_bound

    q, k, v, bias = _positive_inputs(n, seed=seed, b=1, h=1, span=span)
    out = hf_kernattn.kernelized_attention(q, k, v, bias, causal, backend="fft")
    err = ((out.double() - literal_reference(q, k, v, bias, causal)).abs().max() / v.abs().max()).item()
    bound = fft_error_bound(q, k, rpe_bias=bias, causal=causal)
    assert err <= bound < 1, (err, bound)


def test_auto_meets_1e4_where_float32_fft_cannot():
    """Float32, N = 2048 (above the dense crossover), causal, a bias spanning 9 that weighs far
    keys more: the float32 FFT misses 1e-4 (the first rows, small against the late ones, are
    the hardest), so auto must not use it; non-causal with a small span the float32 FFT meets
    the target and auto keeps it."""
    from hf_kernattn.modeling.kernels_fft import fft_error_bound

    n = 2048
    q, k, v, bias = _positive_inputs(n, seed=13, b=1, h=1, span=1.0)
    bias[:, : n // 2] += 8.0  # far keys (offsets < -N/2) weigh e^8 more: late rows are large, early ones small
    ref = literal_reference(q, k, v, bias, causal=True)
    scale = v.abs().max().item()
    fft32 = hf_kernattn.kernelized_attention(q, k, v, bias, True, backend="fft")
    assert (fft32.double() - ref).abs().max().item() / scale > 1e-4
    assert fft_error_bound(q, k, rpe_bias=bias, causal=True) > 1e-4
    auto = hf_kernattn.kernelized_attention(q, k, v, bias, True)
    assert (auto.double() - ref).abs().max().item() / scale <= 1e-4
    # a clipped bias: auto takes the exact windowed backend
    table = hf_kernattn.RelativePositionBias1D(1, 1500, init_std=3.0)
    clipped = table(n).detach()
    ref = literal_reference(q, k, v, clipped, causal=True)
    auto = hf_kernattn.kernelized_attention(q, k, v, clipped, True, rpe_clip=1500)
    assert (auto.double() - ref).abs().max().item() / scale <= 1e-4
    # non-causal, small span, where the table ranks the FFT first: the float32 FFT meets the target and is kept
    # (identical result)
    small = (torch.rand(1, 2 * n - 1, generator=torch.Generator().manual_seed(14)) - 0.5)
    fft_first = dict(mode="fwd", bias="1d", causal=False, clip=None, dtype="float32", ranking=[[None, ["fft", "dense"]]])
    try:
        hf_kernattn.load_auto_table({"format": 1, "entries": [fft_first]})
        auto = hf_kernattn.kernelized_attention(q, k, v, small, False)
    finally:
        hf_kernattn.load_auto_table(None)
    assert torch.equal(auto, hf_kernattn.kernelized_attention(q, k, v, small, False, backend="fft"))
    assert (auto.double() - literal_reference(q, k, v, small)).abs().max().item() / scale <= 1e-4


def test_core_reads_no_tensor_values_while_tracing(monkeypatch):
    """While torch.compile / torch.export trace (``torch.compiler.is_compiling()``), the core's
    value checks (mask values, "nothing padded", the rpe_clip declaration, the FFT error bound)
    read no tensor value: no ``bool()``/``int()``/``float()``/``item()`` of a tensor, no
    ``torch.equal``. The result is the one of the eager call (float64, same operations)."""
    from hf_kernattn.modeling import attention_inputs, kernels_fft

    n = 12
    q, k, v, _ = _positive_inputs(n, seed=3, dtype=torch.float64)
    table = hf_kernattn.RelativePositionBias1D(2, 3, init_std=1.0).double()
    bias = table(n).detach()
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, 8:] = 0
    full = torch.ones(2, n)
    want = [hf_kernattn.kernelized_attention(q, k, v, bias, causal, attention_mask=m, rpe_clip=3, backend=b)
            for causal in (False, True) for m in (mask, full) for b in ("windowed", "fft")]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    reads = []
    for name in ("__bool__", "__int__", "__float__", "item"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _original=original, _name=name, **kw):
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    monkeypatch.setattr(torch, "equal", lambda *a: reads.append("equal") or True)
    got = [hf_kernattn.kernelized_attention(q, k, v, bias, causal, attention_mask=m, rpe_clip=3, backend=b)
           for causal in (False, True) for m in (mask, full) for b in ("windowed", "fft")]
    assert attention_inputs.normalize_mask(full, 2, n, q.device) is not None  # kept, not inspected
    assert kernels_fft.fft_error_bound(q, k, rpe_bias=bias, causal=True, key_mask=mask.bool()) == math.inf
    monkeypatch.undo()
    assert reads == []
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)  # masking with all-ones changes nothing


# ----------------------------------------------------------------------------- non-finite inputs

PADDED_CASES = [("dense", False, True), ("dense", True, False), ("linear", False, False),
                ("causal_chunked", True, False), ("fft", False, True), ("fft", True, True),
                ("windowed", False, True), ("windowed", True, True), ("recurrent", True, True)]


@pytest.mark.parametrize("backend,causal,rpe", PADDED_CASES)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_padding_reaches_no_output_or_gradient(backend, causal, rpe, poison):
    """Padded keys and values holding NaN/inf: the real rows' outputs and every gradient equal
    those of the clean inputs (float64, rounding-level tolerance)."""
    n = 13
    q, k, v, _ = _positive_inputs(n, seed=20, dtype=torch.float64)
    bias = _clipped_bias(n, seed=20)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[0, -3:] = 0
    mask[1, :2] = 0
    pad = (mask == 0)[:, None, :, None]
    results = []
    for dirty in (False, True):
        kd = torch.where(pad, torch.full_like(k, poison), k) if dirty else k.clone()
        vd = torch.where(pad, torch.full_like(v, poison), v) if dirty else v.clone()
        xs = [q.clone().requires_grad_(True), kd.requires_grad_(True), vd.requires_grad_(True)]
        out = hf_kernattn.kernelized_attention(*xs, bias if rpe else None, causal, mask, backend=backend, rpe_clip=2 if rpe else None)
        real = mask.bool()[:, None, :, None].expand_as(out)
        grads = torch.autograd.grad(out[real].pow(2).sum(), xs)
        results.append((out[real].detach(), grads))
    (clean, clean_grads), (out, grads) = results
    torch.testing.assert_close(out, clean, rtol=0, atol=1e-12)
    for g, cg in zip(grads, clean_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, cg, rtol=0, atol=1e-12)


CAUSAL_CASES = [("dense", True), ("dense", False), ("causal_chunked", False), ("fft", True), ("fft", False),
                ("windowed", True), ("recurrent", True), ("recurrent", False)]


@pytest.mark.parametrize("backend,rpe", CAUSAL_CASES)
@pytest.mark.parametrize("where", ["value", "key", "query"])
def test_non_finite_future_token_does_not_reach_earlier_rows(backend, rpe, where):
    """Causal: an inf in the last token's value (or key, or query) is an input only at its own
    position. Earlier rows and the gradients of a loss on them equal the float64 formula on
    the sequence without that token; the last row is NaN (it sees the inf)."""
    n = 11
    q, k, v, _ = _positive_inputs(n, seed=21, dtype=torch.float64)
    bias = _clipped_bias(n, seed=21)
    target = {"value": v, "key": k, "query": q}[where]
    target[1, 0, -1, 0] = float("inf")  # one batch row, one head
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = hf_kernattn.kernelized_attention(*xs, bias if rpe else None, True, backend=backend, rpe_clip=2 if rpe else None)
    assert torch.isnan(out[1, 0, -1]).all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[1, 0, -1] = False
    assert torch.isfinite(out[keep]).all()
    grads = torch.autograd.grad(out[:, :, :-1].pow(2).sum(), xs)
    # reference: the first n - 1 tokens alone (their bias entries are offsets -(n-2) .. n-2)
    prefix = [x[:, :, :-1].detach().clone().requires_grad_(True) for x in (q, k, v)]
    ref = literal_reference(*prefix, bias[:, 1:-1] if rpe else None, causal=True)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), prefix)
    torch.testing.assert_close(out[:, :, :-1], ref, rtol=0, atol=1e-10)
    for name, g, rg in zip(("query", "key", "value"), grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g[:, :, :-1], rg, rtol=0, atol=1e-10)
        if name == where:
            assert (g[1, 0, -1] == 0).all()  # the non-finite entry itself: exactly no gradient
        assert g[:, :, -1].abs().max() <= 1e-10  # the last token: 0 up to the FFT's rounding
    # the other batch row / head never sees the inf: its last row is finite too
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, 1]).all()


def _spy_backend(calls):
    """Register ``linear`` under a test name that records what reaches it; returns the name."""
    from hf_kernattn.modeling.kernels_linear import linear_attention
    from hf_kernattn.modeling.registry import register_backend

    def spy(q, k, v, *, eps):
        calls.append((q, k, v))
        return linear_attention(q, k, v, eps=eps)

    register_backend("test_guard_spy", spy, takes=("eps",))
    return "test_guard_spy"


def test_finite_inputs_reach_the_backend_uncopied():
    """The non-finite guard copies nothing when every input is finite: the backend receives the
    caller's q, k and v themselves (float32, nothing padded), and the outputs and gradients are
    the bare kernel's exactly. A NaN in one query copies (isolates) the queries only."""
    from hf_kernattn.modeling.kernels_linear import linear_attention

    calls = []
    name = _spy_backend(calls)
    try:
        q, k, v, _ = _positive_inputs(9, seed=24)
        xs = [x.requires_grad_(True) for x in (q, k, v)]
        out = hf_kernattn.kernelized_attention(*xs, backend=name)
        assert [x.data_ptr() for x in calls[0]] == [x.data_ptr() for x in xs]
        grads = torch.autograd.grad(out.pow(2).sum(), xs)
        bare = linear_attention(*xs, eps=1e-6)
        bare_grads = torch.autograd.grad(bare.pow(2).sum(), xs)
        assert torch.equal(out, bare)
        assert all(torch.equal(g, bg) for g, bg in zip(grads, bare_grads))

        q = q.detach().clone()
        q[1, 0, 4, 2] = math.nan
        out = hf_kernattn.kernelized_attention(q, k, v, backend=name)
        got_q, got_k, got_v = calls[1]
        assert got_q.data_ptr() != q.data_ptr() and torch.isfinite(got_q).all()
        assert got_k.data_ptr() == k.data_ptr() and got_v.data_ptr() == v.data_ptr()
        assert torch.isnan(out[1, 0, 4]).all()
        assert int(torch.isnan(out).sum()) == out.shape[-1]
    finally:
        hf_kernattn.unregister_backend(name)


@pytest.mark.parametrize("causal", [False, True])
def test_finite_values_whose_sum_overflows_poison_no_row(causal):
    """Finite values so large that their float32 sum overflows (the guard's cheap test then
    cannot tell) are checked entry by entry: no row becomes NaN, the result is the float64
    formula's (relative float32 rounding, ~1e-6 with margin)."""
    q, k, v, _ = _positive_inputs(6, seed=25)
    v[:, :, 1:3] = 3e38  # sum over the tensor: inf in float32; every attention average stays below 3e38
    q, k = q / 5, k / 5  # keep q . (k^T v) below the float32 maximum
    out = hf_kernattn.kernelized_attention(q, k, v, causal=causal, backend="causal_chunked" if causal else "linear")
    assert torch.isfinite(out).all()
    ref = literal_reference(q.double(), k.double(), v.double(), None, causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=0)


def test_an_exported_program_isolates_non_finite_inputs():
    """``torch.export`` (dynamic length) traces the branch-free isolation: the program gives
    the eager call's result, NaN rows included, at lengths other than the traced one, with a
    NaN query, an inf value of a real key and NaN in padded slots."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return hf_kernattn.kernelized_attention(q, k, v, attention_mask=mask, backend="linear")

    def inputs(n, seed):
        q, k, v, _ = _positive_inputs(n, seed=seed, dtype=torch.float64)
        mask = torch.ones(2, n, dtype=torch.long)
        mask[0, -2:] = 0
        q[0, 1, 2, 1] = math.nan
        v[1, 0, 5, 0] = math.inf
        v[0, :, -1] = math.nan
        return q, k, v, mask

    n = torch.export.Dim("n", min=2, max=64)
    program = torch.export.export(Attend(), inputs(8, 26), dynamic_shapes=({2: n}, {2: n}, {2: n}, {1: n}))
    for length, seed in ((8, 27), (11, 28)):
        args = inputs(length, seed)
        got, want = program.module()(*args), Attend()(*args)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.isnan(got[1, 0]).all() and torch.isnan(got[0, 1, 2]).all()
        assert int(got.isnan().sum()) == (length + 1) * got.shape[-1]
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=1e-12)


def test_dense_kernel_masks_padded_keys_before_the_product():
    """The dense kernel on keys masked as the entry point masks them before dispatch, without
    the entry point's isolation of non-finite values: NaN in padded keys must not make the
    query gradients NaN."""
    from hf_kernattn.modeling.kernels_common import mask_keys
    from hf_kernattn.modeling.kernels_dense import dense_attention

    q, k, v, _ = _positive_inputs(7, seed=22, dtype=torch.float64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, -2:] = False
    k[0, :, -2:] = float("nan")
    q.requires_grad_(True)
    out = dense_attention(q, *mask_keys(k, v, mask))
    (g,) = torch.autograd.grad(out.sum(), [q])
    assert torch.isfinite(g).all()


# ----------------------------------------------------------------------------- feature maps at large norms


def _direction(d, seed):
    x = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm()


def test_trf_queries_of_any_norm_give_the_formula():
    """trf query amplitudes exp(|u|^2/2) overflowed float32 (NaN attention from |x| ~ 30 at
    d = 64). A per-query factor cancels; the capped map gives the formula's attention.
    Reference: float64 features with the query amplitude dropped (it cancels; eps = 0 there,
    while with the true amplitude e^{|u|^2/2} eps is negligible). Tolerance: the float32 angles
    W u (|W u| <= ~150 here) carry ~1e-5 absolute error; 1e-3 of max|v| leaves margin."""
    d, m, n = 8, 16, 6
    fm = hf_kernattn.FeatureMap(d, "trf", m, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True) * torch.tensor([1.0, 5.0, 30.0, 60.0, 90.0, 120.0], dtype=torch.float64)[:, None]
    y = 1.5 * torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, 3, generator=g, dtype=torch.float64)
    out = hf_kernattn.kernelized_attention(fm(x.float(), True), fm(y.float(), False), v.float(), backend="dense")
    assert torch.isfinite(out).all()
    w = fm.projection.double()
    u, uk = x * d ** -0.25, y * d ** -0.25
    qf = torch.cat([torch.cos(u @ w.T), torch.sin(u @ w.T)], -1)
    kf = torch.cat([torch.cos(uk @ w.T), torch.sin(uk @ w.T)], -1) * torch.exp(0.5 * (uk * uk).sum(-1, keepdim=True))
    ref = literal_reference(qf, kf, v, eps=0.0)
    assert (out.double() - ref).abs().max() <= 1e-3 * v.abs().max()
    # below the cap nothing changed: the amplitude is exp(|u|^2/2) / sqrt(m) exactly
    small = fm(x[:, :, :2].float(), True).double()
    amp = torch.exp(0.5 * (u[:, :, :2] ** 2).sum(-1, keepdim=True)) / math.sqrt(m)
    torch.testing.assert_close(small, qf[:, :, :2] * amp, rtol=1e-5, atol=1e-6)


def _prf_key_log_scale(fm, x):
    u = x.double() * fm.head_dim ** -0.25
    return (u @ fm.projection.double().T).amax(-1) - 0.5 * (u * u).sum(-1)


@pytest.mark.parametrize("kind", ["prf", "trf"])
def test_keys_beyond_the_representable_range_are_refused(kind):
    """Keys: a per-key factor does not cancel, so a key whose log feature scale leaves
    [-60, 60] (float32) is refused with a ValueError naming the map and the fix; just inside
    the range the features are finite and non-zero; float64 goes to 600; queries of any norm
    and padded keys of any norm are fine."""
    d, m = 8, 16
    fm = hf_kernattn.FeatureMap(d, kind, m, seed=5)
    direction = _direction(d, 6)

    def log_scale(r):
        x = (r * direction)[None, None, None]
        return float(_prf_key_log_scale(fm, x)) if kind == "prf" else r * r / (2 * math.sqrt(d))

    def radius(target):  # log_scale(r) crosses the target once for r > 0: bisection
        lo, hi = 0.0, 1000.0
        for _ in range(100):
            mid = (lo + hi) / 2
            inside = log_scale(mid) >= target if kind == "prf" else log_scale(mid) <= target
            lo, hi = (mid, hi) if inside else (lo, mid)
        return lo

    sign = -1 if kind == "prf" else 1
    r_in, r_out = radius(sign * 59.0), radius(sign * 61.0)
    inside = fm((r_in * direction).float()[None, None, None], is_query=False)
    assert torch.isfinite(inside).all() and inside.abs().max() > 0
    key = (r_out * direction).float()[None, None, None]
    with pytest.raises(ValueError, match=rf"feature_map='{kind}' cannot represent a key.*normalize_qk=True"):
        fm(key, is_query=False)
    assert torch.isfinite(fm(key, is_query=True)).all()  # the same vector as a query: fine
    assert torch.isfinite(fm.double()(key.double(), is_query=False)).all()  # float64: range 600
    fm.float()
    # padded keys may hold anything: with the mask they are not checked
    keys = torch.cat([key, torch.zeros_like(key)], dim=2)
    assert torch.isfinite(fm(keys, is_query=False, key_mask=torch.tensor([[0, 1]]))[:, :, 1]).all()
    with pytest.raises(ValueError):
        fm(keys, is_query=False, key_mask=torch.tensor([[1, 1]]))


def test_module_refuses_out_of_range_keys_but_not_padding():
    torch.manual_seed(0)
    attn = hf_kernattn.KernelizedSelfAttention(_module_config(feature_map="trf"))
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1))
    big = x.clone()
    big[:, -2:] *= 1e3
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    assert torch.isfinite(attn(big, attention_mask=mask)[:, :4]).all()
    with pytest.raises(ValueError, match="cannot represent a key"):
        attn(big)


@pytest.mark.parametrize("dtype", [torch.long, torch.float32, torch.bool])
def test_a_padding_mask_is_checked_and_read_on_the_host_once(monkeypatch, dtype):
    """``normalize_mask`` reads its 0/1 check and "nothing padded" together: one host sync."""
    from hf_kernattn.modeling.attention_inputs import normalize_mask

    reads = []
    for name in ("__bool__", "item", "__int__", "__float__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    padded = normalize_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]).to(dtype), 2, 3, "cpu")
    assert len(reads) == 1
    none = normalize_mask(torch.ones(2, 3, dtype=dtype), 2, 3, "cpu")
    assert len(reads) == 2
    monkeypatch.undo()
    assert none is None and padded.dtype == torch.bool and padded.tolist() == [[True, True, False], [True] * 3]
    if dtype != torch.bool:
        with pytest.raises(ValueError, match="attention_mask must hold only 1"):
            normalize_mask(torch.tensor([[1, 2, 0]]).to(dtype), 1, 3, "cpu")
