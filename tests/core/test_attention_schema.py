"""The one schema of the shared attention fields (``attention_config.py``): every family config
takes its names, defaults, checks and documentation from it; the attention module reads the
fields from the config; one Auto-class table per family serves ``auto_map`` and the in-process
registration; config.json files written before the schema load with the same values and the
same outputs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hf_kernattn
from hf_kernattn import (
    KernelizedSelfAttention,
    LinearGPTConfig,
    LinearGPTForCausalLM,
    LinearGPTModel,
    NPRFBertConfig,
    NPRFBertForMaskedLM,
)
from hf_kernattn.modeling import configuration_linear_gpt, configuration_nprf_bert
from hf_kernattn.modeling.attention_config import (
    BASE_ATTENTION_SCHEMA,
    DOC_MARKER,
    SHARED_FIELD_NAMES,
    AttentionSchema,
)
from hf_kernattn.modeling.registry import AUTO_MAX_ERROR
from hf_kernattn.modeling.feature_maps import FeatureMap
from tests.reference import assert_model_outputs_reordered_close

FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs_v0"

FAMILIES = {
    "nprf_bert": (NPRFBertConfig, configuration_nprf_bert),
    "linear_gpt": (LinearGPTConfig, configuration_linear_gpt),
}
TINY = {
    "nprf_bert": dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=64),
    "linear_gpt": dict(vocab_size=53, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       max_position_embeddings=64),
}

# one refused value per shared field (a new shared field must add one here)
BAD_VALUES = {
    "feature_map": "softmax",
    "num_random_features": 0,
    "num_learned_features": 0,
    "softmax_window": 0,
    "feature_projection": "uniform",
    "normalize_qk": "yes",
    "feature_redraw_interval": -1,
    "feature_seed": -1,
    "rpe": "t5",
    "max_relative_position": 0,
    "attn_backend": "flash",
    "attention_eps": float("nan"),
    "attention_bias": "yes",
    "recompute_attention": 1,
}


def test_every_shared_field_has_a_bad_value_case():
    assert set(BAD_VALUES) == set(SHARED_FIELD_NAMES)


@pytest.mark.parametrize("field", SHARED_FIELD_NAMES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_field_default_present_and_bad_value_refused(family, field):
    """Every family config carries every shared field with its family's default (also in
    to_dict, hence config.json), and refuses a bad value naming the field."""
    cls, module = FAMILIES[family]
    config = cls(**TINY[family])
    assert getattr(config, field) == module.ATTENTION_SCHEMA.default(field)
    assert config.to_dict()[field] == module.ATTENTION_SCHEMA.default(field)
    with pytest.raises((TypeError, ValueError), match=field):
        cls(**TINY[family], **{field: BAD_VALUES[field]})


def test_family_defaults_differ_only_where_a_family_overrides_them_explicitly():
    nprf, gpt = configuration_nprf_bert.ATTENTION_SCHEMA, configuration_linear_gpt.ATTENTION_SCHEMA
    differ = {name for name in SHARED_FIELD_NAMES if nprf.default(name) != gpt.default(name)}
    assert differ == {"feature_map", "normalize_qk", "rpe", "max_relative_position", "recompute_attention"}
    for schema in (nprf, gpt):
        for name in SHARED_FIELD_NAMES:
            if name not in schema.overrides:
                assert schema.default(name) == BASE_ATTENTION_SCHEMA.default(name)
    assert NPRFBertConfig().feature_map == "prf" and LinearGPTConfig().feature_map == "elu"
    assert NPRFBertConfig().recompute_attention is True and LinearGPTConfig().recompute_attention is False


def test_an_override_must_name_a_shared_field_and_pass_its_check():
    with pytest.raises(ValueError, match="not a shared attention field"):
        AttentionSchema("x", hidden_act=("gelu", "why"))
    with pytest.raises(ValueError, match="feature_map"):
        AttentionSchema("x", feature_map=("softmax", "why"))
    with pytest.raises(TypeError, match="reason"):
        AttentionSchema("x", feature_map=("prf",))


def test_both_configs_document_every_shared_field_with_the_schemas_one_text():
    """The shared part of each config's docstring is generated from the schema: the same text
    for every field in both families, once each, and the default stated is the config's."""
    for family, (cls, module) in FAMILIES.items():
        doc = cls.__doc__
        assert DOC_MARKER not in doc
        config = cls()
        for name in SHARED_FIELD_NAMES:
            text = BASE_ATTENTION_SCHEMA.field_doc(name)
            assert module.ATTENTION_SCHEMA.field_doc(name) == text
            assert doc.count(text) == 1, (family, name)
            assert doc.count(f"\n        {name}:") == 1, (family, name)  # documented nowhere else
            default_line = module.ATTENTION_SCHEMA.default_doc(name)
            assert f"Default: ``{getattr(config, name)!r}``" in default_line
            assert text + "\n" + default_line in doc


def test_the_documented_auto_rule_names_the_calibration_table_and_the_accuracy_target():
    doc = BASE_ATTENTION_SCHEMA.field_doc("attn_backend").replace("\n", " ")
    doc = " ".join(doc.split())
    assert "calibration table" in doc and "hf-kernattn bench calibrate" in doc and "load_auto_table" in doc
    assert f"error bound meets {AUTO_MAX_ERROR:g}" in doc


# ----------------------------------------------------------------------------- the module reads the config


def test_attention_module_reads_the_family_configs_fields():
    cfg = LinearGPTConfig(**TINY["linear_gpt"], feature_map="prf", num_random_features=6, feature_projection="sphere",
                          normalize_qk=True, feature_redraw_interval=3, feature_seed=5, attn_backend="dense",
                          attention_eps=1e-3, attention_bias=False, recompute_attention=True)
    attn = LinearGPTModel(cfg).h[1].attn
    assert (attn.backend, attn.eps, attn.recompute, attn.q_proj.bias) == ("dense", 1e-3, True, None)
    fm = attn.feature_map
    ref = FeatureMap(16, "prf", 6, projection="sphere", normalize_qk=True, redraw_interval=3, seed=5 + 1000)
    assert (fm.kind, fm.normalize_qk, fm.redraw_interval) == ("prf", True, 3)
    torch.testing.assert_close(fm.projection, ref.projection, rtol=0, atol=0)
    # Linear GPT's default: no recomputation (its config had no such field; the module assumed True)
    assert LinearGPTModel(LinearGPTConfig(**TINY["linear_gpt"])).h[0].attn.recompute is False


def test_attention_module_from_a_bare_namespace_takes_the_base_defaults():
    attn = KernelizedSelfAttention(SimpleNamespace(hidden_size=16, num_attention_heads=2, attention_eps=0.5))
    base = BASE_ATTENTION_SCHEMA.defaults
    assert attn.eps == 0.5  # given: kept
    assert attn.backend == base["attn_backend"] and attn.recompute is base["recompute_attention"]
    assert attn.feature_map.kind == base["feature_map"] and (attn.q_proj.bias is not None) is base["attention_bias"]


# ----------------------------------------------------------------------------- one Auto-class table


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_map_in_a_saved_config_is_the_registration_table(family, tmp_path):
    cls, module = FAMILIES[family]
    cls(**TINY[family]).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert saved == module.AUTO_MAP
    # in-process: exactly the Auto classes of the table know this config, each with the table's class
    # (both families' Auto classes and a few others; scanning all of transformers imports them all: slow)
    candidates = set(configuration_nprf_bert.AUTO_MAP) | set(configuration_linear_gpt.AUTO_MAP) | {
        "AutoModelForPreTraining", "AutoModelForMultipleChoice", "AutoModelForSeq2SeqLM", "AutoModelForNextSentencePrediction",
    }
    registered = {}
    for auto_name in sorted(candidates - {"AutoConfig"}):
        try:
            registered[auto_name] = getattr(transformers, auto_name)._model_mapping[cls]
        except KeyError:
            pass
    assert set(registered) | {"AutoConfig"} == set(module.AUTO_MAP)
    for auto_name, reference in module.AUTO_MAP.items():
        target = getattr(hf_kernattn, reference.split(".")[1])
        assert target._auto_class == auto_name
        if auto_name == "AutoConfig":
            assert type(transformers.AutoConfig.for_model(cls.model_type)) is target
        else:
            assert registered[auto_name] is target


# ----------------------------------------------------------------------------- configs saved before the schema


@pytest.mark.parametrize("name", ["nprf_bert_default", "nprf_bert_tiny", "linear_gpt_default", "linear_gpt_tiny"])
def test_config_json_written_before_the_schema_loads_with_the_same_values(name, tmp_path):
    """The fixture is the config.json the code wrote before the schema existed. Every key keeps
    its value and meaning; a field it lacks (Linear GPT's recompute_attention) takes the family
    default, which keeps the old behaviour (no recomputation, outputs identical either way)."""
    saved = json.loads((FIXTURES / f"{name}.json").read_text())
    shutil.copy(FIXTURES / f"{name}.json", tmp_path / "config.json")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    cls = NPRFBertConfig if name.startswith("nprf") else LinearGPTConfig
    assert type(config) is cls
    now = config.to_dict()
    for key, value in saved.items():
        if key != "transformers_version":
            assert now[key] == value and type(now[key]) is type(value), key
    added = set(SHARED_FIELD_NAMES) - set(saved)
    # fields added since, each with the default that keeps the old behaviour: the learned maps'
    # width (None: unused by the maps these configs name)
    assert config.num_learned_features is None
    added.discard("num_learned_features")
    # and the sliding-window hybrid's W (None: off)
    assert config.softmax_window is None
    added.discard("softmax_window")
    assert added == (set() if name.startswith("nprf") else {"recompute_attention"})
    assert all(getattr(config, key) is False for key in added)
    # the saved file again has every old key with the same value
    config.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert {k: again[k] for k in saved if k != "transformers_version"} == {
        k: v for k, v in saved.items() if k != "transformers_version"
    }


@pytest.mark.parametrize("name,model_cls", [("nprf_bert_tiny", NPRFBertForMaskedLM), ("linear_gpt_tiny", LinearGPTForCausalLM)])
def test_model_from_a_config_written_before_the_schema_gives_the_same_logits(name, model_cls, tmp_path):
    """Logits saved by the code before the schema (seed 0 init, fixed ids, eval). float32; the
    same function up to rounding: Linear GPT's fused GELU differs from the saved run's
    multi-step one by an ulp, and a weight layout (or another machine's kernels) can change the
    products' summation order: within the float32 bound of reordered sums at the logits'
    magnitude, while any change of the init, a default or the math moves the logits by 1e-3 or
    more."""
    shutil.copy(FIXTURES / f"{name}.json", tmp_path / "config.json")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    expected = load_file(FIXTURES / "logits.safetensors")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        logits = model(expected[f"{name}_ids"]).logits
    assert math.isfinite(float(logits.abs().max()))
    assert_model_outputs_reordered_close(logits, expected[name], config, expected[f"{name}_ids"].shape[-1])
