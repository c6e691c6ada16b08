"""Numerics of the attention core: mixed precision, redraw under recomputation, the FFT path's
accuracy, non-finite inputs, feature maps at large norms and empty inputs.

Ground truth is an independent float64 evaluation of the formula (``_reference`` below), never
another backend of the package.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling.backends import get_backend


def _reference(q, k, v, bias=None, causal=False, mask=None, eps=1e-6):
    """``out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)`` over the
    allowed j, in float64, written from scratch (1D bias only). Keys that are not allowed are
    dropped by indexing, so whatever they hold never enters."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(n):
            js = [j for j in range(n) if (not causal or j <= i) and (mask is None or bool(mask[bi, j]))]
            if not js:
                continue
            js_t = torch.tensor(js)
            w = (k[bi][:, js_t] @ q[bi, :, i, :, None])[..., 0]  # (H, |js|)
            if bias is not None:
                w = w * torch.exp(bias.double()[:, js_t - i + n - 1])
            out[bi, :, i] = (w[..., None] * v[bi][:, js_t]).sum(1) / (w.sum(1, keepdim=True) + eps)
    return out


# ----------------------------------------------------------------------------- mixed precision

# (backend, causal, rpe) for the module test: every built-in backend in a call it can run
MODULE_CASES = [
    ("dense", False, True), ("linear", False, False), ("causal_chunked", True, False),
    ("fft", False, True), ("fft", True, True), ("windowed", False, True), ("recurrent", True, True),
]


def _module_config(**kw):
    base = dict(hidden_size=16, num_attention_heads=2, feature_map="prf", num_random_features=8,
                feature_projection="orthogonal", normalize_qk=False, feature_redraw_interval=0,
                attn_backend="auto", recompute_attention=True)
    base.update(kw)
    return SimpleNamespace(**base)


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
    attn = hf_kernattn.KernelizedSelfAttention(
        _module_config(feature_map=feature_map, attn_backend=backend), causal=causal
    )
    table = hf_kernattn.RelativePositionBias1D(2, 3, init_std=0.5)
    n = 9
    x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, -2:] = 0
    results = []
    for autocast in (False, True):
        attn.zero_grad(), table.zero_grad()
        xs = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            bias = table(n) if rpe else None
            out = attn(xs, attention_mask=mask, rpe_bias=bias, rpe_clip=3 if rpe else None)
            loss = out.float().pow(2).sum()
        loss.backward()
        grads = [xs.grad, attn.q_proj.weight.grad, attn.v_proj.weight.grad] + ([table.weight.grad] if rpe else [])
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
    table = hf_kernattn.RelativePositionBias1D(2, 3, init_std=0.5)
    results = []
    for autocast in (False, True):
        bias = table(n) if rpe else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = hf_kernattn.kernelized_attention(q, k, v, bias, causal, backend=backend, rpe_clip=3 if rpe else None)
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
    from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM, NPRFBertConfig, NPRFBertForMaskedLM

    torch.manual_seed(0)
    bert = NPRFBertForMaskedLM(NPRFBertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_random_features=16, max_relative_position=8, rpe_init_std=0.5,
    )).train()
    gpt = LinearGPTForCausalLM(LinearGPTConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, feature_map="prf", num_random_features=16,
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
