"""Each family config is a declaration: its own fields are rows of a table in its schema (name,
default, documentation, check), checked by the schema's checkers like the shared fields and
documented from the same rows; and the ViT's position options keep their earlier names as
aliases (stored as the current name, same model, same outputs)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from hf_kernattn import (
    LinearGPTConfig,
    NPRFBertConfig,
    RelativePerformerViTConfig,
    RelativePerformerViTForImageClassification,
)
from hf_kernattn.modeling import configuration_linear_gpt, configuration_nprf_bert, configuration_relative_performer_vit
from hf_kernattn.modeling.attention_config import SHARED_FIELD_NAMES, AttentionSchema, ConfigField, int_at_least

from tests.conftest import tiny_relative_performer_vit_config

FAMILIES = {
    "nprf_bert": (NPRFBertConfig, configuration_nprf_bert),
    "linear_gpt": (LinearGPTConfig, configuration_linear_gpt),
    "relative_performer_vit": (RelativePerformerViTConfig, configuration_relative_performer_vit),
}

# one refused value per checked field of each family's own table (a new checked field must add one)
BAD_VALUES = {
    "nprf_bert": dict(
        vocab_size=0, hidden_size=0, num_hidden_layers=0, num_attention_heads=0, intermediate_size=1.5,
        hidden_act="swish_me", hidden_dropout_prob=1.0, attention_probs_dropout_prob=-0.1, max_position_embeddings=0,
        type_vocab_size=0, initializer_range=-1.0, layer_norm_eps=0.0, pad_token_id=-1, position_embedding_type="rope",
        classifier_dropout=2.0, tie_word_embeddings="yes", rpe_shared_across_layers="yes", rpe_init_std=float("nan"),
    ),
    "linear_gpt": dict(
        vocab_size=0, hidden_size=0, num_hidden_layers=0, num_attention_heads=0, num_key_value_heads=0,
        intermediate_size=0, hidden_act=3, mlp_type="moe", mlp_bias=1, norm_type="batchnorm",
        max_position_embeddings=0, position_embedding_type="alibi", rotary_base=1.0, layer_norm_epsilon=float("inf"),
        initializer_range=float("nan"), embd_pdrop=1.0, resid_pdrop=True, attn_pdrop="0.1", use_cache="yes",
        tie_word_embeddings=None,
    ),
    "relative_performer_vit": dict(
        image_size=0, patch_size=0, num_channels=0, hidden_size=0, num_hidden_layers=0, num_attention_heads=0,
        intermediate_size=0, hidden_act="nope", hidden_dropout_prob=1.0, attention_probs_dropout_prob=True,
        initializer_range="0.02", layer_norm_eps=-1e-12, pooling="max", position_scales=0, relative_heads=0,
        rpe_shared_across_layers=1, rpe_init_std=-0.5,
    ),
}


def own_fields(family: str) -> tuple[ConfigField, ...]:
    return FAMILIES[family][1].ATTENTION_SCHEMA.own_fields


def test_every_checked_own_field_has_a_bad_value_case():
    for family in FAMILIES:
        assert set(BAD_VALUES[family]) == {f.name for f in own_fields(family) if f.check is not None}, family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_own_fields_take_their_declared_defaults_and_refuse_bad_values_naming_the_field(family):
    cls, module = FAMILIES[family]
    config = cls()
    schema = module.ATTENTION_SCHEMA
    for field in own_fields(family):
        expected = field.default if field.convert is None else field.convert(field.default)
        if field.default is None and field.name in ("intermediate_size", "num_key_value_heads"):
            continue  # derived from other fields (checked below)
        assert getattr(config, field.name) == expected and type(getattr(config, field.name)) is type(expected), field.name
        assert schema.default(field.name) == field.default
    for name, value in BAD_VALUES[family].items():
        with pytest.raises((TypeError, ValueError), match=name):
            cls(**{name: value})
    if family == "linear_gpt":
        assert (config.intermediate_size, config.num_key_value_heads) == (4 * config.hidden_size, config.num_attention_heads)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_docstring_and_signature_come_from_the_table(family):
    """Every field is documented once, from its row, with the default the config takes; the
    signature lists every field, keyword-only, with that default."""
    cls, module = FAMILIES[family]
    schema, config, doc = module.ATTENTION_SCHEMA, cls(), cls.__doc__
    assert "@" not in doc
    for field in own_fields(family):
        text = schema.field_doc(field.name)
        assert doc.count(f"\n        {field.name}:") == 1, field.name
        assert text + "\n" + schema.default_doc(field.name) in doc, field.name
    parameters = inspect.signature(cls).parameters
    assert list(parameters) == [*schema.field_names, "kwargs"]
    for name in schema.field_names:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and parameters[name].default == schema.default(name)
    assert set(schema.field_names) <= set(config.to_dict())
    assert schema.field_names[-len(SHARED_FIELD_NAMES):] == SHARED_FIELD_NAMES


def test_a_schema_refuses_a_malformed_table():
    row = ConfigField("width", 4, "w.", int_at_least(1))
    with pytest.raises(TypeError, match="headings"):
        AttentionSchema("x", fields=(row,))
    with pytest.raises(ValueError, match="declared twice"):
        AttentionSchema("x", fields=("h", ConfigField("rpe", "none", "r.")))
    with pytest.raises(ValueError, match="hidden_size and num_attention_heads"):
        AttentionSchema("x", fields=("h", row))
    with pytest.raises(ValueError, match="rpe"):
        AttentionSchema("x", choices={"rpe": ("none", "t5")})
    with pytest.raises(ValueError, match=r"rpe must be one of \['none'\] for x"):
        AttentionSchema("x", choices={"rpe": ("none",)}, rpe=("learned", "why"))


@pytest.mark.parametrize("family,kinds,name", [("nprf_bert", ["learned", "none"], "NPRF-BERT"),
                                              ("linear_gpt", ["none", "learned"], "Linear GPT")])
def test_a_family_takes_only_its_rpe_kinds(family, kinds, name):
    cls, _ = FAMILIES[family]
    for rpe in ("learned_2d", "manhattan", "fft_2d", "rotary_features"):
        with pytest.raises(ValueError, match=re.escape(f"rpe must be one of {kinds} for {name}, got {rpe!r}")):
            cls(rpe=rpe)


# ----------------------------------------------------------------------------- the ViT's earlier option names

ALIASES = {"fft_2d": "learned_2d", "clipped": "manhattan"}


@pytest.mark.parametrize("old,new", ALIASES.items())
def test_an_earlier_position_option_name_is_stored_as_the_current_one(old, new, tmp_path):
    assert configuration_relative_performer_vit.POSITION_OPTION_ALIASES == ALIASES
    old_config, new_config = tiny_relative_performer_vit_config(rpe=old), tiny_relative_performer_vit_config(rpe=new)
    assert old_config.rpe == new and old_config.to_dict() == new_config.to_dict()
    # a config.json holding the earlier name loads with the current one, and is saved with it
    saved = new_config.to_dict()
    saved["rpe"] = old
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is RelativePerformerViTConfig and loaded.rpe == new
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["rpe"] == new


@pytest.mark.parametrize("old,new", ALIASES.items())
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_checkpoint_saved_under_an_earlier_name_loads_and_gives_identical_outputs(old, new, pooling, tmp_path):
    """Weights written by a model built under the earlier name load into the current one with the
    same parameter names and give bitwise the same logits."""
    torch.manual_seed(0)
    model = RelativePerformerViTForImageClassification(tiny_relative_performer_vit_config(rpe=old, pooling=pooling)).eval()
    with torch.no_grad():  # non-zero position tables (the Manhattan one starts at zero)
        for name, p in model.named_parameters():
            if ".positions." in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(2))
    pixels = torch.randn(2, 1, 16, 20, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rpe"] = old  # as the earlier code wrote it
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.rpe == new
    assert list(loaded.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixel_values=pixels).logits, logits, rtol=0, atol=0)
    torch.manual_seed(0)
    fresh = RelativePerformerViTForImageClassification(tiny_relative_performer_vit_config(rpe=new, pooling=pooling))
    assert {n: p.shape for n, p in fresh.state_dict().items()} == {n: p.shape for n, p in model.state_dict().items()}


def test_the_fixture_checkpoint_written_with_fft_2d_loads_as_learned_2d():
    folder = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints" / "relative_performer_vit"
    assert json.loads((folder / "config.json").read_text())["rpe"] == "fft_2d"
    assert transformers.AutoConfig.from_pretrained(folder).rpe == "learned_2d"


def test_position_options_are_refused_with_the_current_names():
    with pytest.raises(ValueError, match=r"rpe must be one of \['learned_2d', 'rotary_features', 'manhattan', 'absolute', "
                                         r"'none'\] for relative-performer ViT, got 'learned'"):
        RelativePerformerViTConfig(rpe="learned")
