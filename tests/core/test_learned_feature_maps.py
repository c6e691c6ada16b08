"""Learned feature maps (Hedgehog): the batched map against its plain per-head reference, the
attention module against an independent dense float64 reference (outputs and gradients, causal
and bidirectional, padding, a relative bias, grouped-query heads), every family and backend,
the decoding state, initialisation, save/load, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

import hf_kernattn
from hf_kernattn import (
    KernelizedSelfAttention,
    LinearGPTConfig,
    LinearGPTForCausalLM,
    NPRFBertConfig,
    NPRFBertForMaskedLM,
    RelativePerformerViTConfig,
    RelativePerformerViTForImageClassification,
)
from hf_kernattn.modeling.feature_maps import LEARNED_FEATURE_MAPS, FeatureMap, learned_feature_map_reference

from tests.conftest import (
    tiny_attention_config,
    tiny_linear_gpt_config,
    tiny_nprf_bert_config,
    tiny_relative_performer_vit_config,
)

KINDS = list(LEARNED_FEATURE_MAPS)


def _perturb(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Move every learned feature weight away from its identity init (so the tests see W)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for fm in (m for m in module.modules() if isinstance(m, FeatureMap) and m.is_learned):
            for w in (fm.query_weight, fm.key_weight):
                w.add_(std * torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.dtype))


# ----------------------------------------------------------------------------- the map itself


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize_qk", [False, True])
@pytest.mark.parametrize("width", [None, 3, 11])
def test_batched_map_equals_its_per_head_reference_with_gradients(kind, normalize_qk, width):
    g = torch.Generator().manual_seed(0)
    fm = FeatureMap(6, kind, num_learned_features=width, normalize_qk=normalize_qk, num_heads=4,
                    num_key_value_heads=2).double()
    _perturb(fm, 1)
    m = width or 6
    assert fm.num_features == 2 * m and fm.query_weight.shape == (4, 6, m) and fm.key_weight.shape == (2, 6, m)
    for is_query, heads, weight in ((True, 4, fm.query_weight), (False, 2, fm.key_weight)):
        x = (2 * torch.randn(2, heads, 5, 6, generator=g, dtype=torch.float64)).requires_grad_()
        got = fm(x, is_query=is_query)
        want = learned_feature_map_reference(x, weight, kind, is_query, normalize_qk)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert (got > 0).all() and got.shape == (2, heads, 5, 2 * m)
        if kind == "hedgehog":  # each half sums to one
            torch.testing.assert_close(got[..., :m].sum(-1), torch.ones(2, heads, 5, dtype=torch.float64))
        elif is_query:  # the largest query feature is exactly 1 (the stabiliser)
            assert torch.equal(got.amax(-1), torch.ones(2, heads, 5, dtype=torch.float64))
        ct = torch.randn(got.shape, generator=g, dtype=torch.float64)
        gx, gw = torch.autograd.grad((got * ct).sum(), (x, weight))
        rx, rw = torch.autograd.grad((want * ct).sum(), (x, weight))
        torch.testing.assert_close(gx, rx, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)


def test_identity_init_and_the_plain_formula():
    """A fresh map with m = d is ``[softmax(x), softmax(-x)]`` (``hedgehog``) or ``[exp(x), exp(-x)]``
    for keys (``hedgehog_exp``); with m != d, ``W = I_{d x m}``."""
    x = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fm = FeatureMap(4, "hedgehog", num_heads=2).double()
    torch.testing.assert_close(fm(x, is_query=False), torch.cat([x.softmax(-1), (-x).softmax(-1)], -1))
    fm = FeatureMap(4, "hedgehog_exp").double()
    torch.testing.assert_close(fm(x, is_query=False), torch.cat([x.exp(), (-x).exp()], -1))
    wide = FeatureMap(4, "hedgehog", num_learned_features=6, num_heads=2)
    assert torch.equal(wide.query_weight[1], torch.eye(4, 6)) and torch.equal(wide.key_weight[0], torch.eye(4, 6))


def test_exp_keys_outside_the_range_are_refused_naming_the_rule():
    fm = FeatureMap(4, "hedgehog_exp")
    big = torch.zeros(1, 1, 3, 4)
    big[0, 0, 1, 0] = 70.0  # |z| = 70 > 60 (float32)
    with pytest.raises(ValueError, match=r"hedgehog_exp.*max_m \|\(W x\)_m\| <= 60"):
        fm(big, is_query=False)
    # padding may hold anything; queries are stabilised per row; a decoding step gives NaN instead
    fm(big, is_query=False, key_mask=torch.tensor([[1, 0, 1]]))
    assert torch.isfinite(fm(big, is_query=True)).all()
    out = fm(big, is_query=False, sync_free=True)
    assert out[0, 0, 1].isnan().all() and torch.isfinite(out[0, 0, [0, 2]]).all()
    assert torch.isfinite(FeatureMap(4, "hedgehog")(1e4 * big, is_query=False)).all()


# ----------------------------------------------------------------------------- the module vs a dense reference


def _dense_reference(attn, x, mask, bias, causal, kind):
    """The attention written from the formulas with the module's weights only: projections,
    the learned map without any stabiliser (float64, eps = 0, so the query shift would cancel
    exactly), the dense N x N kernel matrix with the bias exp(b_{j-i}), masks, normalisation."""
    b, n, _ = x.shape
    h, d = attn.num_heads, attn.head_dim
    hk = attn.num_key_value_heads
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(b, n, h, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).view(b, n, hk, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T + attn.v_proj.bias).view(b, n, hk, d).transpose(1, 2)
    k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    wq = attn.feature_map.query_weight
    wk = attn.feature_map.key_weight.repeat_interleave(h // hk, 0)

    def phi(t, w):
        z = torch.einsum("bhnd,hdm->bhnm", t, w)
        if kind == "hedgehog":
            return torch.cat([z.exp() / z.exp().sum(-1, keepdim=True), (-z).exp() / (-z).exp().sum(-1, keepdim=True)], -1)
        return torch.cat([z.exp(), (-z).exp()], -1)

    a = phi(q, wq) @ phi(k, wk).transpose(-1, -2)  # (B, H, N, N)
    if bias is not None:
        idx = torch.arange(n)
        a = a * bias[:, (idx[None, :] - idx[:, None]) + n - 1].exp()[None]
    if causal:
        a = a * torch.ones(n, n, dtype=a.dtype).tril()
    if mask is not None:
        a = a * mask[:, None, None, :].to(a.dtype)
    out = (a @ v) / a.sum(-1, keepdim=True).clamp_min(1e-300)  # rows with no real key (padding): 0
    out = out.transpose(1, 2).reshape(b, n, h * d)
    return out @ attn.o_proj.weight.T + attn.o_proj.bias


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rpe", [False, True])
def test_module_equals_the_dense_reference_outputs_and_gradients(kind, causal, rpe):
    torch.manual_seed(0)
    cfg = tiny_attention_config(feature_map=kind, attention_eps=0.0, num_learned_features=5, attn_backend="dense")
    cfg.num_key_value_heads = 1
    attn = KernelizedSelfAttention(cfg, causal=causal).double()
    _perturb(attn, 2)
    n = 7
    x = torch.randn(2, n, 16, dtype=torch.float64, requires_grad=True)
    # padded keys inside and at the end; the first key is real, so with eps = 0 no row is 0/0
    mask = torch.tensor([[1] * n, [1, 0, 1, 1, 0, 1, 0]])
    bias = 0.5 * torch.randn(2, 2 * n - 1, dtype=torch.float64) if rpe else None
    params = [x] + [p for p in attn.parameters()]
    want = _dense_reference(attn, x, mask, bias, causal, kind)
    real = mask.bool()
    ct = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * real[..., None]
    ref = torch.autograd.grad((want * ct).sum(), params)
    for backend in hf_kernattn.available_backends():
        spec = hf_kernattn.get_backend(backend)
        if spec.missing(causal=causal, rpe="1d" if rpe else None, rpe_clip=None, key_mask=True, device=None, split=False):
            continue
        attn.backend = backend
        got = attn(x, attention_mask=mask, rpe_bias=bias)
        torch.testing.assert_close(got[real], want[real], rtol=1e-9, atol=1e-10, msg=backend)
        grads = torch.autograd.grad((got * ct).sum(), params)
        for (name, _), g1, g2 in zip([("x", None)] + list(attn.named_parameters()), grads, ref):
            torch.testing.assert_close(g1, g2, rtol=1e-8, atol=1e-10, msg=f"{backend}: grad of {name}")
        ids = [id(p) for p in params]
        for w in (attn.feature_map.query_weight, attn.feature_map.key_weight):
            assert grads[ids.index(id(w))].abs().sum() > 0, backend


# ----------------------------------------------------------------------------- every family


FAMILIES = {
    "linear_gpt": (LinearGPTForCausalLM, tiny_linear_gpt_config, lambda g: dict(input_ids=torch.randint(1, 53, (2, 9), generator=g))),
    "nprf_bert": (NPRFBertForMaskedLM, tiny_nprf_bert_config, lambda g: dict(input_ids=torch.randint(1, 40, (2, 9), generator=g))),
    "relative_performer_vit": (RelativePerformerViTForImageClassification, tiny_relative_performer_vit_config,
                               lambda g: dict(pixel_values=torch.randn(2, 1, 16, 16, generator=g))),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_saves_and_reloads_the_learned_weights(family, kind, tmp_path):
    cls, make, inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = cls(make(feature_map=kind, num_learned_features=6))
    maps = [m for m in model.modules() if isinstance(m, FeatureMap)]
    assert maps and all(m.is_learned and m.num_features == 12 for m in maps)
    for fm in maps:  # _init_weights: identity-like
        assert torch.equal(fm.query_weight, torch.eye(fm.head_dim, 6).expand_as(fm.query_weight))
    batch = inputs(torch.Generator().manual_seed(1))
    out = model(**batch, **({"use_cache": False} if family == "linear_gpt" else {}))
    out.logits.square().mean().backward()
    assert all(fm.query_weight.grad.abs().sum() > 0 and fm.key_weight.grad.abs().sum() > 0 for fm in maps)
    _perturb(model, 4)
    model.eval().save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path).eval()
    assert loaded.config.feature_map == kind and loaded.config.num_learned_features == 6
    for a, b in zip(maps, (m for m in loaded.modules() if isinstance(m, FeatureMap))):
        assert torch.equal(a.query_weight, b.query_weight) and torch.equal(a.key_weight, b.key_weight)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


def test_meta_device_build_then_init_weights_sets_the_learned_weights():
    with torch.device("meta"):
        model = LinearGPTForCausalLM(tiny_linear_gpt_config(feature_map="hedgehog_exp", num_key_value_heads=1))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    for fm in (m for m in model.modules() if isinstance(m, FeatureMap)):
        assert fm.key_weight.shape == (1, 16, 16) and torch.equal(fm.key_weight[0], torch.eye(16))
        assert torch.equal(fm.query_weight, torch.eye(16).expand(2, 16, 16))


GPT_VARIANTS = {
    "absolute": {},
    "rotary": dict(position_embedding_type="rotary"),
    "rope_gqa": dict(position_embedding_type="rope", num_key_value_heads=1),
    "learned_bias": dict(position_embedding_type="none", rpe="learned", max_relative_position=4),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
def test_linear_gpt_decoding_state_and_backends_equal_the_full_forward(kind, variant):
    """float64: prefill, a chunk and single tokens from the state on a left-padded batch equal one
    forward without a state, for every backend that can serve the model (1e-10 on O(1) logits)."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config(feature_map=kind, **GPT_VARIANTS[variant])).double().eval()
    _perturb(model, 5)
    n = 12
    ids = torch.randint(1, 53, (2, n), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :4] = 0
    real = mask.bool()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :5], attention_mask=mask[:, :5])
        pieces, state = [out.logits], out.past_key_values
        out = model(ids[:, 5:8], attention_mask=mask[:, :8], past_key_values=state)
        pieces.append(out.logits)
        for t in range(8, n):
            pieces.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=state).logits)
        torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], rtol=0, atol=1e-10)
        attns = [block.attn for block in model.transformer.h]
        for backend in ("dense", "causal_chunked", "fft", "windowed", "recurrent"):
            spec = hf_kernattn.get_backend(backend)
            learned = GPT_VARIANTS[variant].get("rpe") == "learned"
            if spec.missing(causal=True, rpe="1d" if learned else None, rpe_clip=4 if learned else None, key_mask=True,
                            device=None, split=variant == "rotary"):
                continue
            for a in attns:
                a.backend, a._checked_backend = backend, None
            got = model(ids, attention_mask=mask, use_cache=False).logits
            torch.testing.assert_close(got[real], full[real], rtol=0, atol=1e-10, msg=backend)


def test_greedy_generate_with_a_learned_map_equals_use_cache_false():
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config(feature_map="hedgehog")).eval()
    _perturb(model, 7)
    ids = torch.randint(1, 53, (2, 5), generator=torch.Generator().manual_seed(8))
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(got, seq)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config_class", [LinearGPTConfig, NPRFBertConfig, RelativePerformerViTConfig])
@pytest.mark.parametrize("field,value", [("num_learned_features", 0), ("num_learned_features", 1.5),
                                         ("num_learned_features", True), ("feature_map", "hedgehog_softmax")])
def test_bad_learned_map_fields_are_refused_naming_the_field(config_class, field, value):
    with pytest.raises((TypeError, ValueError), match=field):
        config_class(**{field: value})
    with pytest.raises(ValueError, match="num_heads"):
        FeatureMap(4, "hedgehog", num_heads=0)


def test_learned_map_fields_default_so_existing_configs_are_unchanged():
    for config_class in (LinearGPTConfig, NPRFBertConfig, RelativePerformerViTConfig):
        assert config_class().num_learned_features is None
    assert math.isclose(FeatureMap(8, "elu").num_features, 8)


def test_the_drop_in_refuses_a_learned_map():
    from hf_kernattn.drop_in import DropInOptions

    with pytest.raises(ValueError, match="learned map"):
        DropInOptions(feature_map="hedgehog").check()
