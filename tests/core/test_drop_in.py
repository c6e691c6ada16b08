"""attn_implementation="kernelized" on stock transformers models: BERT, GPT-2, Llama (grouped-query
attention) and ViT built from tiny configs."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel,
)

import hf_kernattn  # noqa: F401  (registers "kernelized")
from hf_kernattn import drop_in

V = 50


def build(name: str, attn: str):
    torch.manual_seed(0)
    if name == "bert":
        return BertModel(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, attn_implementation=attn)).double().eval()
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                                          attn_implementation=attn)).double().eval()
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=64, pad_token_id=0,
                                            attn_implementation=attn)).double().eval()
    return ViTModel(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64, attn_implementation=attn)).double().eval()


DECODERS = ("gpt2", "llama")


def inputs(name: str, padded: bool = True, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)}
    ids = torch.randint(1, V, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        if name in DECODERS:
            mask[1, :3] = 0  # left padding
        else:
            mask[1, -3:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if name in DECODERS:
        out["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return out


def result(model, kw) -> torch.Tensor:
    out = model(**kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(autouse=True)
def default_options():
    saved = drop_in.OPTIONS
    yield
    drop_in.OPTIONS = saved


def real(kw, t):
    """Positions that are real tokens: ``(B, N)`` bool (all for images)."""
    mask = kw.get("attention_mask")
    return torch.ones(t.shape[:2], dtype=torch.bool) if mask is None else mask.bool()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_exact_reference_mode_equals_the_softmax_model(name):
    """With feature_map="exact" the function evaluates the exponential kernel densely: the
    model equals the same weights with SDPA softmax attention (float64: rounding only, 1e-10;
    eager attention is no reference here: it upcasts softmax to float32, and Llama's gives NaN
    on fully padded rows), which checks the scaling, the head layout, the repeated key/value
    heads, the causal mask and the padding mask the mask entry hands over."""
    drop_in.configure(feature_map="exact")
    kw = inputs(name)
    want = result(build(name, "sdpa"), kw)
    got = result(build(name, "kernelized"), kw)
    keep = real(kw, got)
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_random_features_approach_softmax_as_their_number_grows(name):
    """Positive random features estimate exp(s q . k) without bias and with a standard deviation
    falling as 1/sqrt(M): from 16 to 4096 features (256x) the error to the softmax model should
    shrink ~16x; asked: 4x (mean relative error over 3 seeds)."""
    kw = inputs(name)
    with torch.no_grad():
        want = result(build(name, "sdpa"), kw)
    keep = real(kw, want)
    error = {}
    for m in (16, 4096):
        errs = []
        for seed in range(3):
            drop_in.configure(feature_map="prf", num_random_features=m, seed=seed)
            with torch.no_grad():
                got = result(build(name, "kernelized"), kw)
            errs.append(float((got[keep] - want[keep]).norm() / want[keep].norm()))
        error[m] = sum(errs) / len(errs)
    assert error[4096] < error[16] / 4, error


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_a_padded_batch_equals_its_rows_alone(name):
    kw = inputs(name)
    model = build(name, "kernelized")
    batch = result(model, kw)
    for i in range(2):
        keep = kw["attention_mask"][i].bool()
        alone = {k: v[i : i + 1, keep] for k, v in kw.items()}
        torch.testing.assert_close(batch[i, keep], result(model, alone)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", DECODERS)
def test_future_tokens_never_change_past_outputs_and_generate_runs(name):
    model = build(name, "kernelized")
    kw = inputs(name, padded=False)
    changed = {k: v.clone() for k, v in kw.items()}
    changed["input_ids"][:, 6] = (changed["input_ids"][:, 6] + 1) % V
    a, b = result(model, kw), result(model, changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    with torch.no_grad():
        cached = model.generate(kw["input_ids"], max_new_tokens=5, do_sample=False, pad_token_id=0)
        recomputed = model.generate(kw["input_ids"], max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_backward_and_features_kept_with_the_model(name, tmp_path):
    """Gradients reach every attention projection; enable() records the options in the config,
    so a saved and reloaded model draws the same per-layer features and gives the same outputs."""
    model = drop_in.enable(build(name, "sdpa").train(), num_random_features=32, seed=3)
    kw = inputs(name)
    result(model, kw).pow(2).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if any(s in n for s in ("query", "q_proj", "c_attn"))]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    model.eval()
    assert model.config.kernelized_attention["seed"] == 3
    with torch.no_grad():
        want = result(model, kw)
    model.save_pretrained(tmp_path)
    drop_in.configure(seed=99)  # the reloaded model uses its saved features, not new ones
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="kernelized", dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(result(loaded, kw), want, rtol=0, atol=1e-12)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="feature_map must be one of"):
        drop_in.configure(feature_map="softmax")
    with pytest.raises(ValueError, match="num_random_features must be a positive int"):
        drop_in.configure(num_random_features=0)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_a_saved_model_reloads_kernelized_without_arguments(name, tmp_path):
    """enable() -> save_pretrained -> a plain from_pretrained(path) (AutoModel too) runs kernelized
    attention with the saved options: the same float64 logits (rounding only), not softmax ones
    (which differ by 1e-4 and more here). A reloaded model that has run keeps the record when saved
    again; disable() drops it, so that copy loads as softmax."""
    from transformers import AutoModel, AutoModelForCausalLM

    model = drop_in.enable(build(name, "sdpa"), num_random_features=32, seed=3)
    kw = inputs(name)
    with torch.no_grad():
        want = result(model, kw)
    model.save_pretrained(tmp_path / "a")
    drop_in.configure(seed=99, num_random_features=8)  # loading must use the saved options, not these
    auto = AutoModelForCausalLM if name in DECODERS else AutoModel
    for loaded in (type(model).from_pretrained(tmp_path / "a"), auto.from_pretrained(tmp_path / "a")):
        loaded.eval()
        assert loaded.dtype == torch.float64
        assert loaded.config._attn_implementation == drop_in.ATTENTION_NAME
        with torch.no_grad():
            torch.testing.assert_close(result(loaded, kw), want, rtol=0, atol=1e-12)
    with torch.no_grad():
        softmax = result(type(model).from_pretrained(tmp_path / "a", attn_implementation="sdpa").eval(), kw)
    keep = real(kw, want)
    assert (softmax[keep] - want[keep]).abs().max() > 1e-6  # the check above tells the two apart
    loaded.save_pretrained(tmp_path / "b")
    again = type(model).from_pretrained(tmp_path / "b").eval()
    assert again.config._attn_implementation == drop_in.ATTENTION_NAME
    with torch.no_grad():
        torch.testing.assert_close(result(again, kw), want, rtol=0, atol=1e-12)
    fresh = type(model).from_pretrained(tmp_path / "b")  # not run yet: enable() keeps its recorded options
    drop_in.enable(fresh).save_pretrained(tmp_path / "d")
    with torch.no_grad():
        torch.testing.assert_close(result(type(model).from_pretrained(tmp_path / "d").eval(), kw), want, rtol=0, atol=1e-12)
    drop_in.disable(again).save_pretrained(tmp_path / "c")
    plain = type(model).from_pretrained(tmp_path / "c").eval()
    assert plain.config._attn_implementation == "sdpa" and getattr(plain.config, "kernelized_attention", None) is None
    with torch.no_grad():
        torch.testing.assert_close(result(plain, kw)[keep], softmax[keep], rtol=0, atol=1e-12)


def test_loading_a_kernelized_checkpoint_without_the_package_is_refused(tmp_path):
    """Where hf_kernattn is not imported, from_pretrained of a kernelized checkpoint raises
    (transformers does not know the implementation) instead of silently running softmax."""
    from tests.remote import run_without_package

    drop_in.enable(build("gpt2", "sdpa")).save_pretrained(tmp_path / "ckpt")
    out = run_without_package(f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r})
        except ValueError as err:
            print("refused:", err)
        else:
            print("loaded")
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, attn_implementation="sdpa")
        print("explicit:", m.config._attn_implementation)
    """, cwd=str(tmp_path))
    assert "refused:" in out and 'attn_implementation="kernelized"' in out, out
    assert "explicit: sdpa" in out, out


@pytest.mark.parametrize("bad, error, words", [
    (["prf", 64], TypeError, "must be a dict"),
    ("prf", TypeError, "must be a dict"),
    ({"feature_map": "prf", "features": 8}, ValueError, "unknown options"),
    ({"feature_map": "softmax"}, ValueError, "feature_map must be one of"),
    ({"num_random_features": "64"}, ValueError, "num_random_features must be a positive int"),
])
def test_a_bad_recorded_config_is_refused(bad, error, words):
    model = build("bert", "kernelized")
    model.config.kernelized_attention = bad
    with pytest.raises(error, match="config.kernelized_attention") as caught:
        result(model, inputs("bert"))
    assert words in str(caught.value)
    with pytest.raises(ValueError, match="attn_implementation must name a softmax"):
        drop_in.disable(model, "kernelized")
