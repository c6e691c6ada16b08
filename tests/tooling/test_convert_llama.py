"""Llama checkpoints into Linear GPT (hf_kernattn.convert): exact weight copies (grouped-query
attention, RMSNorm, gated MLP), the same network as Llama once the kernel is the exact softmax,
a start that tightens with more random features, stateful generation, a Hub-ready save that loads
without the package, and clear errors for what cannot be converted."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kernattn.modeling.attention as attention_module
from hf_kernattn import LinearGPTCache
from hf_kernattn.convert import convert, convert_to_linear_gpt
from hf_kernattn.modeling.feature_maps import FeatureMap

from tests.reference import assert_model_outputs_reordered_close
from tests.remote import causal_lm_logits_without_package

C, L, H, KV, V = 32, 2, 4, 2, 50


def _llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, hidden_size=C, intermediate_size=48, num_hidden_layers=L, num_attention_heads=H,
               num_key_value_heads=KV, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               initializer_range=0.1)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = _llama(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    with torch.no_grad():  # non-trivial norm weights, so a missing copy shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder, model


def test_every_mapped_weight_is_copied_exactly(llama_dir):
    folder, llama = llama_dir
    lm = convert(folder)
    cfg = lm.config
    assert (cfg.num_key_value_heads, cfg.norm_type, cfg.mlp_type, cfg.position_embedding_type, cfg.rotary_base) == (
        KV, "rmsnorm", "gated", "rope", 500.0)
    assert not cfg.tie_word_embeddings and not cfg.mlp_bias and not cfg.attention_bias
    src, dst = llama.state_dict(), lm.state_dict()
    assert torch.equal(dst["transformer.wte.weight"], src["model.embed_tokens.weight"])
    assert torch.equal(dst["transformer.ln_f.weight"], src["model.norm.weight"])
    assert torch.equal(dst["lm_head.weight"], src["lm_head.weight"])
    for i in range(L):
        s, d = f"model.layers.{i}", f"transformer.h.{i}"
        assert torch.equal(dst[f"{d}.ln_1.weight"], src[f"{s}.input_layernorm.weight"])
        assert torch.equal(dst[f"{d}.ln_2.weight"], src[f"{s}.post_attention_layernorm.weight"])
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(dst[f"{d}.attn.{proj}.weight"], src[f"{s}.self_attn.{proj}.weight"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(dst[f"{d}.mlp.{proj}.weight"], src[f"{s}.mlp.{proj}.weight"])
    assert dst["transformer.h.0.attn.k_proj.weight"].shape == (KV * C // H, C)  # grouped-query layout kept
    report = lm.conversion_report
    assert report["unused_source_keys"] == [] and len(report["copied"]) == 3 + 9 * L
    assert report["initialised"] and all(".feature_map." in k for k in report["initialised"])


def _softmax_kernel(q, k, v, *, causal, attention_mask=None, **_):
    """Dense causal softmax on the (un-mapped) queries and keys: what Llama computes."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = q.shape[2]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def test_with_the_exact_softmax_kernel_the_converted_model_is_llama(llama_dir, monkeypatch):
    """Everything around the kernel (embeddings, RMSNorm, rotations, grouped-query heads, gated
    MLP, head) is Llama's: with the feature map made the identity and the kernel a dense softmax,
    the logits equal Llama's in float64. Llama computes its rotation angles in float32 (error
    <= position * 2^-24 rad, ~1e-6 here), hence 1e-5 rather than float64 rounding; a wrong
    rotation pairing, frequency or head grouping changes the logits at O(1)."""
    folder, llama = llama_dir
    lm = convert(folder).double()
    ids = torch.randint(1, V, (2, 11), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(FeatureMap, "forward", lambda self, x, **_: x)
    monkeypatch.setattr(attention_module, "kernelized_attention", _softmax_kernel)
    with torch.no_grad():
        want = llama.double()(ids).logits
        got = lm(ids, use_cache=False).logits
        llama.float()
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_converted_model_approaches_llama_as_features_grow_and_decodes_with_a_state(llama_dir):
    """Positive random features estimate exp(q . k / sqrt(d)) of the rotated queries and keys
    without bias, with a spread falling as 1/sqrt(M): from 16 to 4096 features (256x) the
    logits' relative error to Llama should shrink ~16x; asked: 4x."""
    folder, llama = llama_dir
    ids = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = llama(ids).logits
        err = {m: float((convert(folder, num_random_features=m)(ids, use_cache=False).logits - want).norm() / want.norm())
               for m in (16, 4096)}
    assert err[4096] < err[16] / 4, err
    lm = convert(folder)
    out = lm.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert isinstance(out.past_key_values, LinearGPTCache) and out.sequences.shape == (2, 14)
    with torch.no_grad():  # the stateful steps equal one parallel forward over the whole sequence
        full = lm(out.sequences[:, :-1], use_cache=False).logits[:, 8:]
    assert_model_outputs_reordered_close(torch.stack(out.logits, 1), full, lm.config, out.sequences.shape[1])


def test_saved_conversion_loads_without_the_package(llama_dir, tmp_path):
    folder, _ = llama_dir
    lm = convert_to_linear_gpt(folder, tmp_path / "linear")
    ids = torch.randint(1, V, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = lm(ids, use_cache=False).logits.tolist()
    assert causal_lm_logits_without_package("linear", ids, tmp_path) == want
    assert "base_model:" in (tmp_path / "linear" / "README.md").read_text()


def test_tied_llama_keeps_its_tie(tmp_path):
    _llama(tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    lm = convert(tmp_path / "tied")
    assert lm.config.tie_word_embeddings and lm.lm_head.weight.data_ptr() == lm.transformer.wte.weight.data_ptr()


def test_what_cannot_be_converted_is_refused(tmp_path):
    scaled = _llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    scaled.save_pretrained(tmp_path / "scaled")
    with pytest.raises(ValueError, match="rope_type='linear'; supported: 'default'"):
        convert(tmp_path / "scaled")
    (tmp_path / "own_head_dim").mkdir()
    cfg = {**_llama().config.to_dict(), "head_dim": 16}
    (tmp_path / "own_head_dim" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="head_dim=16 != hidden_size / num_attention_heads"):
        convert(tmp_path / "own_head_dim")
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"cannot convert model_type='mistral'.*'gpt2', 'llama', 'vit'\]"):
        convert(tmp_path / "mistral")
