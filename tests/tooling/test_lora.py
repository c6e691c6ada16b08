"""LoRA through PEFT: every family names its attention and MLP projections so that
``peft.get_peft_model(model, LoraConfig(target_modules=hf_kernattn.lora_target_modules(model)))``
works; a LoRA-wrapped model trains only its adapters, its adapter saves and reloads, the merged
model saves Hub-ready and loads with trust_remote_code in a process without the package with
the same outputs, and a LoRA-wrapped Linear GPT generates what its merged model generates."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import hf_kernattn
from hf_kernattn import LinearGPTForCausalLM, NPRFBertForSequenceClassification, RelativePerformerViTForImageClassification

from tests.conftest import tiny_linear_gpt_config, tiny_nprf_bert_config, tiny_relative_performer_vit_config
from tests.reference import assert_model_outputs_reordered_close
from tests.remote import run_without_package

peft = pytest.importorskip("peft")


def _gpt_inputs(g):
    ids = torch.randint(1, 53, (2, 8), generator=g)
    return dict(input_ids=ids, labels=ids, use_cache=False)


FAMILIES = {
    "linear_gpt": (LinearGPTForCausalLM, lambda: tiny_linear_gpt_config(), _gpt_inputs, "AutoModelForCausalLM",
                   ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]),
    "linear_gpt_llama_style": (
        LinearGPTForCausalLM,
        lambda: tiny_linear_gpt_config(mlp_type="gated", norm_type="rmsnorm", position_embedding_type="rope",
                                       num_key_value_heads=1, feature_map="hedgehog"),
        _gpt_inputs, "AutoModelForCausalLM",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "nprf_bert": (NPRFBertForSequenceClassification, lambda: tiny_nprf_bert_config(num_labels=3),
                  lambda g: dict(input_ids=torch.randint(1, 40, (2, 8), generator=g), labels=torch.tensor([0, 2])),
                  "AutoModelForSequenceClassification",
                  ["q_proj", "k_proj", "v_proj", "o_proj", "intermediate", "output"]),
    "relative_performer_vit": (
        RelativePerformerViTForImageClassification, lambda: tiny_relative_performer_vit_config(feature_map="hedgehog_exp"),
        lambda g: dict(pixel_values=torch.randn(2, 1, 16, 16, generator=g), labels=torch.tensor([1, 2])),
        "AutoModelForImageClassification", ["q_proj", "k_proj", "v_proj", "o_proj", "intermediate", "output"]),
}


def test_target_modules_by_part_and_refusals():
    model = LinearGPTForCausalLM(tiny_linear_gpt_config())
    assert hf_kernattn.lora_target_modules(model, mlp=False) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert hf_kernattn.lora_target_modules(model, attention=False) == ["c_fc", "c_proj"]
    with pytest.raises(ValueError, match="attention and mlp"):
        hf_kernattn.lora_target_modules(model, attention=False, mlp=False)
    with pytest.raises(TypeError, match="hf-kernattn model"):
        hf_kernattn.lora_target_modules(torch.nn.Linear(2, 2))
    config = hf_kernattn.lora_config(model, r=4)
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"}
    assert config.task_type == "CAUSAL_LM" and config.r == 4
    mlm = hf_kernattn.NPRFBertForMaskedLM(tiny_nprf_bert_config())
    assert hf_kernattn.lora_config(mlm).task_type is None and hf_kernattn.lora_config(mlm).modules_to_save is None
    classifier = NPRFBertForSequenceClassification(tiny_nprf_bert_config(num_labels=2))
    assert hf_kernattn.lora_config(classifier, mlp=False).modules_to_save == ["classifier"]
    with pytest.MonkeyPatch.context() as patch:  # without PEFT: the error names the extra
        patch.setitem(sys.modules, "peft", None)
        with pytest.raises(ImportError, match=r"hf-kernattn\[peft\]"):
            hf_kernattn.lora_config(model)


# LoraConfig arguments beyond the defaults: the Llama-style model trains its learned feature maps too
LORA_KWARGS = {"linear_gpt_llama_style": {"modules_to_save": ["feature_map"]}}


def _train_adapt_merge(family: str, folder) -> dict:
    """LoRA-wrap the family's tiny model, train three steps (only adapters and new heads get
    gradients; the loss falls), save the adapter and reload it onto a fresh base (same logits),
    merge, and save the merged model in ``folder/family``. Returns what the merged model gives
    on the evaluation batch (logits, and greedy tokens for a causal LM) for the remote check."""
    cls, make_config, make_inputs, auto, targets = FAMILIES[family]
    torch.manual_seed(0)
    base = cls(make_config()).eval()
    assert hf_kernattn.lora_target_modules(base) == targets
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = peft.get_peft_model(base, hf_kernattn.lora_config(base, r=4, lora_alpha=8, **LORA_KWARGS.get(family, {})))
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(targets)
    batch = make_inputs(torch.Generator().manual_seed(1))
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        trained = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert trained and all("lora_" in n or "modules_to_save" in n for n in trained), sorted(trained)
        optimizer.step()
    assert losses[-1] < losses[0], (family, losses)
    model.eval()
    eval_batch = {k: v for k, v in make_inputs(torch.Generator().manual_seed(2)).items() if k != "labels"}
    with torch.no_grad():
        want = model(**eval_batch).logits

    # the adapter alone: saved, then loaded onto a fresh copy of the base model
    model.save_pretrained(folder / f"{family}-adapter")
    assert (folder / f"{family}-adapter" / "adapter_model.safetensors").exists()
    torch.manual_seed(0)
    fresh = cls(make_config()).eval()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    reloaded = peft.PeftModel.from_pretrained(fresh, folder / f"{family}-adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**eval_batch).logits, want, rtol=0, atol=0)

    # merged: the family's own class again, saved Hub-ready
    merged = model.merge_and_unload().eval()
    assert type(merged) is cls and not any("lora_" in k for k in merged.state_dict())
    maps = [k for k in merged.state_dict() if k.endswith("feature_map.query_weight")]
    trained_maps = any(not torch.equal(merged.state_dict()[k], before[k]) for k in maps)
    assert trained_maps == ("feature_map" in LORA_KWARGS.get(family, {}).get("modules_to_save", ())), family
    with torch.no_grad():
        got = merged(**eval_batch).logits
    # W x + B (A x) against (W + B A) x: the same sums in another order (folding rounds once per weight)
    n = max(v.shape[-1] for v in eval_batch.values() if isinstance(v, torch.Tensor))
    assert_model_outputs_reordered_close(got, want, merged.config, n)
    merged.save_pretrained(folder / family)
    inputs = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in eval_batch.items()}
    result = {"auto": auto, "inputs": inputs, "logits": got.tolist()}
    if cls is LinearGPTForCausalLM:
        result["generate"] = merged.generate(eval_batch["input_ids"], max_new_tokens=5, do_sample=False).tolist()
    return result


def test_lora_trains_the_adapters_only_and_the_merged_models_load_without_the_package(tmp_path):
    """Every family (Linear GPT also Llama-style with a learned feature map, the ViT with the
    exponential one); the merged checkpoints load in one fresh process that cannot import
    hf_kernattn and give the same logits exactly (and the same greedy tokens)."""
    want = {family: _train_adapt_merge(family, tmp_path) for family in FAMILIES}
    (tmp_path / "want.json").write_text(json.dumps(want))
    code = """
import json, torch, transformers
result = {}
for family, spec in json.load(open("want.json")).items():
    m = getattr(transformers, spec["auto"]).from_pretrained(family, trust_remote_code=True).eval()
    assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
    inputs = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in spec["inputs"].items()}
    with torch.no_grad():
        result[family] = {"logits": m(**inputs).logits.tolist()}
    if "generate" in spec:
        result[family]["generate"] = m.generate(inputs["input_ids"], max_new_tokens=5, do_sample=False).tolist()
print(json.dumps(result))
"""
    got = json.loads(run_without_package(code, cwd=str(tmp_path)).strip().splitlines()[-1])
    for family, spec in want.items():
        assert got[family]["logits"] == spec["logits"], family
        assert got[family].get("generate") == spec.get("generate"), family


def test_generate_of_a_lora_wrapped_linear_gpt_equals_the_merged_models():
    """Greedy: the wrapped model (adapters applied on the fly, decoding with the state) and the
    merged one pick the same tokens; a trained adapter makes the two differ from the base. In
    float64: ``x W + (x A) B`` and ``x (W + A B)`` round differently, which in float32 can flip a
    near-tie between two tokens."""
    torch.manual_seed(0)
    base = LinearGPTForCausalLM(tiny_linear_gpt_config()).double().eval()
    ids = torch.randint(1, 53, (2, 5), generator=torch.Generator().manual_seed(3))
    plain = base.generate(ids, max_new_tokens=8, do_sample=False)
    model = peft.get_peft_model(base, hf_kernattn.lora_config(base, r=4, lora_alpha=8))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a trained adapter: B away from its zero init
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.eval()
    wrapped = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    merged = model.merge_and_unload().eval().generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(wrapped, merged)
    assert not torch.equal(wrapped, plain)
