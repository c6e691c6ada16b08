"""Relative-position tables and the shared attention module."""

from __future__ import annotations


import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling.attention_config import validate_attention_fields
from hf_kernattn.modeling.registry import get_backend

from tests.conftest import tiny_attention_config

from tests.reference import assert_reordered_close, literal_reference


def test_1d_bias_layout_and_clipping():
    rpe = hf_kernattn.RelativePositionBias1D(num_heads=2, max_relative_position=3)
    with torch.no_grad():
        rpe.weight.copy_(torch.arange(14, dtype=torch.float32).reshape(2, 7))
    n = 6
    bias = rpe(n)
    assert bias.shape == (2, 2 * n - 1)
    for r in range(-(n - 1), n):
        clipped = max(-3, min(3, r))
        assert bias[1, r + n - 1] == rpe.weight[1, clipped + 3]
    # offsets beyond the table share the edge weight: a longer sequence works by the clipping rule
    long_bias = rpe(50)
    assert torch.equal(long_bias[:, 0], rpe.weight[:, 0]) and torch.equal(long_bias[:, -1], rpe.weight[:, -1])
    offs = torch.tensor([[-10, 0], [2, 9]])
    assert torch.equal(rpe.offset_bias(offs)[0], rpe.weight[0][offs.clamp(-3, 3) + 3])


def test_2d_bias_layout_and_gradient():
    torch.manual_seed(0)
    rpe = hf_kernattn.RelativePositionBias2D(num_heads=1, max_relative_position=2, init_std=1.0)
    bias = rpe(3, 4)
    assert bias.shape == (1, 5, 7)
    for dy in range(-2, 3):
        for dx in range(-3, 4):
            assert bias[0, dy + 2, dx + 3] == rpe.weight[0, dy + 2, max(-2, min(2, dx)) + 2]
    bias.sum().backward()
    assert rpe.weight.grad is not None and rpe.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_relative_position(bad):
    with pytest.raises(ValueError, match="max_relative_position"):
        hf_kernattn.RelativePositionBias1D(2, bad)


def _config(**kw):
    return tiny_attention_config(**{"rpe": "learned", "max_relative_position": 4, **kw})


def _manual_attention(attn, x, mask, bias, causal):
    """Softmax-free reference built from the module's own weights, without the module's code path."""
    b, n, c = x.shape
    h, d = attn.num_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(b, n, h, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(b, n, h, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T + attn.v_proj.bias).view(b, n, h, d).transpose(1, 2)
    qf, kf = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    out = literal_reference(qf, kf, v, bias, causal, mask)
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_manual_reference_with_padding(causal):
    torch.manual_seed(0)
    attn = hf_kernattn.KernelizedSelfAttention(_config(), causal=causal).double()
    rpe = hf_kernattn.RelativePositionBias1D(2, 4, init_std=0.5).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.ones(2, 7, dtype=torch.float64)
    mask[0, :2] = 0
    out = attn(x, attention_mask=mask, rpe_bias=rpe(7))
    ref = _manual_attention(attn, x, mask, rpe(7), causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_module_padding_does_not_change_real_tokens():
    torch.manual_seed(1)
    attn = hf_kernattn.KernelizedSelfAttention(_config(feature_map="prf"))
    rpe = hf_kernattn.RelativePositionBias1D(2, 4, init_std=0.5)
    x = torch.randn(1, 5, 16)
    alone = attn(x, rpe_bias=rpe(5))
    padded = torch.cat([x, torch.randn(1, 3, 16) * 100], dim=1)
    mask = torch.tensor([[1] * 5 + [0] * 3])
    out = attn(padded, attention_mask=mask, rpe_bias=rpe(8))
    # float32, another length: the projections (width 16), attention (8 keys) and output
    # projection sum in another order
    assert_reordered_close(out[:, :5], alone, terms=16, layers=3)


def test_module_2d_grid_translation_equivariance():
    """With a 2D bias and a grid, shifting a pattern inside an empty (masked) frame shifts the output."""
    torch.manual_seed(2)
    attn = hf_kernattn.KernelizedSelfAttention(_config(feature_map="prf")).double()
    rpe = hf_kernattn.RelativePositionBias2D(2, 6, init_std=0.5).double()
    hg = wg = 6
    img = torch.randn(1, 3, 3, 16, dtype=torch.float64)
    outs = []
    for oy, ox in ((0, 0), (2, 1)):
        x = torch.zeros(1, hg, wg, 16, dtype=torch.float64)
        mask = torch.zeros(1, hg, wg)
        x[:, oy : oy + 3, ox : ox + 3] = img
        mask[:, oy : oy + 3, ox : ox + 3] = 1
        y = attn(x.view(1, hg * wg, 16), attention_mask=mask.view(1, -1), rpe_bias=rpe(hg, wg), grid=(hg, wg))
        outs.append(y.view(1, hg, wg, 16)[:, oy : oy + 3, ox : ox + 3])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "field,value",
    [
        ("feature_map", "softmax"), ("feature_projection", "uniform"), ("num_random_features", 0),
        ("feature_redraw_interval", -2), ("rpe", "t5"), ("max_relative_position", 0),
        ("attn_backend", "flash"), ("hidden_size", 15), ("normalize_qk", "yes"),
    ],
)
def test_validate_attention_fields_names_the_field(field, value):
    cfg = vars(_config(feature_map="prf"))
    cfg[field] = value
    with pytest.raises(ValueError, match=field if field != "hidden_size" else "hidden_size"):
        validate_attention_fields(**cfg)


def _check_recompute_cases(monkeypatch, attn, cases):
    """For each ``(recompute keyword, whether a checkpoint is expected)``: the module checkpoints
    its attention exactly then, and outputs and gradients agree across the cases (float64)."""
    rpe = hf_kernattn.RelativePositionBias1D(2, 4, init_std=0.5).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = []
    for recompute, expect in cases:
        attn.zero_grad()
        xs = x.clone().requires_grad_(True)
        calls.clear()
        out = attn(xs, rpe_bias=rpe(6), recompute=recompute)
        assert bool(calls) == expect, recompute
        out.pow(2).sum().backward()
        results.append((out.detach(), xs.grad, attn.q_proj.weight.grad.clone()))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    return x


@pytest.mark.parametrize("configured", [True, False])
def test_forward_recompute_keyword_overrides_the_configured_recompute(monkeypatch, configured):
    """recompute=None follows recompute_attention, False never checkpoints inside (an enclosing
    checkpointed layer already recomputes), True always does; outputs and gradients agree (the
    named ``fft`` backend, which does not declare ``keeps_inputs``: see the next test)."""
    torch.manual_seed(3)
    attn = hf_kernattn.KernelizedSelfAttention(_config(feature_map="prf", recompute_attention=configured,
                                                       attn_backend="fft")).double()
    x = _check_recompute_cases(monkeypatch, attn, ((None, configured), (False, False), (True, True)))
    with pytest.raises(TypeError, match="recompute must be None or a bool"):
        attn(x, recompute="no")


@pytest.mark.parametrize("backend,recomputes", [("auto", False), ("dense", False), ("fft", True)])
def test_the_configured_recompute_skips_a_backend_that_keeps_only_its_inputs(monkeypatch, backend, recomputes):
    """With ``recompute_attention`` on, a call whose backend declares ``keeps_inputs`` (``dense``:
    ``auto``'s choice at N = 6) runs once, since recomputing it would save no memory; an explicit
    ``recompute=True`` still recomputes. Outputs and gradients are the same either way."""
    assert get_backend("dense").keeps_inputs and get_backend("manhattan").keeps_inputs
    assert not get_backend("fft").keeps_inputs and not get_backend("linear").keeps_inputs
    torch.manual_seed(4)
    attn = hf_kernattn.KernelizedSelfAttention(_config(feature_map="prf", attn_backend=backend)).double()
    _check_recompute_cases(monkeypatch, attn, ((None, recomputes), (True, True), (False, False)))


@pytest.mark.parametrize("backend", ["auto", "fft", "windowed"])
def test_recompute_projections_reruns_the_whole_block_with_the_same_result(monkeypatch, backend):
    """``recompute_attention="projections"`` checkpoints the whole block (q/k/v and output
    projections included, for every backend, also ``dense`` which ``auto`` runs at N = 6 and
    which keeps only its inputs): the projections run again in the backward pass, and outputs
    and gradients equal those of a run that keeps everything (float64, the same operations:
    ulps at most). The explicit ``recompute`` keyword keeps its meaning (True: the kernel only;
    False: nothing)."""
    torch.manual_seed(5)
    attn = hf_kernattn.KernelizedSelfAttention(_config(feature_map="prf", attn_backend=backend,
                                                       recompute_attention="projections")).double()
    assert attn.recompute == "projections"
    projections = []
    attn.q_proj.register_forward_hook(lambda *_: projections.append(1))
    rpe = hf_kernattn.RelativePositionBias1D(2, 4, init_std=0.5).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    results = []
    for recompute, runs in ((False, 1), (None, 2), (True, 1)):
        attn.zero_grad()
        projections.clear()
        xs = x.clone().requires_grad_(True)
        out = attn(xs, attention_mask=mask, rpe_bias=rpe(6), rpe_clip=4, recompute=recompute)
        out.pow(2).sum().backward()
        assert len(projections) == runs, recompute
        results.append([out.detach(), xs.grad] + [p.grad.clone() for p in attn.parameters() if p.grad is not None])
    for got in results[1:]:
        assert len(got) == len(results[0])
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    with torch.no_grad():  # nothing to recompute without gradients: one run
        projections.clear()
        attn(x, rpe_bias=rpe(6), rpe_clip=4)
        assert len(projections) == 1


@pytest.mark.parametrize("value,error", [("yes", ValueError), ("Projections", ValueError), (1, TypeError), (None, TypeError)])
def test_recompute_attention_refuses_other_values(value, error):
    with pytest.raises(error, match="recompute_attention must be True, False or 'projections'|recompute_attention must be a bool"):
        hf_kernattn.NPRFBertConfig(recompute_attention=value)
