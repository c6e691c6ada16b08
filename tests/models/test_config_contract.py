"""Every family config against what a transformers config is expected to do with the
arguments every ``PreTrainedConfig`` takes (the checks of transformers' ``ConfigTester``:
JSON and ``save_pretrained`` round trips, the common arguments kept as given, ``num_labels``,
``AutoConfig.from_pretrained(path, **overrides)``, no log output from a default config).

``output_attentions`` is one of those common arguments: a config accepts and keeps it as
transformers' models without attention weights (Mamba, RWKV) do. The models have no attention
weights to return, so ``forward(output_attentions=True)`` still raises ``ValueError``; a config
asking for them (e.g. loaded with ``output_attentions=True``) runs, returns no attentions, and
says so once in the log.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_kernattn import (
    LinearGPTConfig,
    LinearGPTForCausalLM,
    NPRFBertConfig,
    NPRFBertForSequenceClassification,
    RelativePerformerViTConfig,
    RelativePerformerViTForImageClassification,
)

from tests.conftest import (
    V_BERT,
    V_GPT,
    tiny_linear_gpt_config,
    tiny_nprf_bert_config,
    tiny_relative_performer_vit_config,
)

# the arguments every transformers config takes, with values different from their defaults
COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["SomeModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}

FAMILIES = {
    "nprf_bert": (NPRFBertConfig, tiny_nprf_bert_config, NPRFBertForSequenceClassification),
    "linear_gpt": (LinearGPTConfig, tiny_linear_gpt_config, LinearGPTForCausalLM),
    "relative_performer_vit": (
        RelativePerformerViTConfig, tiny_relative_performer_vit_config, RelativePerformerViTForImageClassification,
    ),
}


def tiny_kwargs(family: str) -> dict:
    """The tiny config of the family as keyword arguments (the non-default values it sets)."""
    _, make, _ = FAMILIES[family]
    return {k: v for k, v in make().to_diff_dict().items() if k not in ("transformers_version", "model_type", "id2label", "label2id")}


def inputs_for(family: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    if family == "relative_performer_vit":
        return {"pixel_values": torch.randn(2, 1, 16, 16, generator=gen)}
    vocab = V_BERT if family == "nprf_bert" else V_GPT
    return {"input_ids": torch.randint(1, vocab, (2, 7), generator=gen)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_common_arguments_are_kept_as_given(family):
    cls, _, _ = FAMILIES[family]
    config = cls(**COMMON_KWARGS)
    for key, value in COMMON_KWARGS.items():
        if key == "dtype":
            assert config.dtype == torch.float16
        else:
            assert getattr(config, key) == value, key
    assert config.output_attentions is True


@pytest.mark.parametrize("family", list(FAMILIES))
def test_output_attentions_survives_json_and_save_pretrained(family, tmp_path):
    cls, _, _ = FAMILIES[family]
    kwargs = {**tiny_kwargs(family), "output_attentions": True, "output_hidden_states": True}
    config = cls(**kwargs)
    as_json = json.loads(config.to_json_string())
    for key, value in kwargs.items():
        assert as_json[key] == value, key

    config.to_json_file(tmp_path / "config.json")
    assert cls.from_json_file(tmp_path / "config.json").to_dict() == config.to_dict()

    config.save_pretrained(tmp_path / "saved")
    again = cls.from_pretrained(tmp_path / "saved")
    assert again.to_dict() == config.to_dict()
    assert again.output_attentions is True

    config.save_pretrained(tmp_path / "outer" / "sub")
    assert cls.from_pretrained(tmp_path / "outer", subfolder="sub").to_dict() == config.to_dict()
    with pytest.raises(OSError):
        cls.from_pretrained(str(tmp_path / "no such folder"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_config_from_pretrained_keeps_output_attentions(family, tmp_path):
    cls, make, _ = FAMILIES[family]
    make().save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, output_attentions=True)
    assert type(config) is cls
    assert config.output_attentions is True
    config, unused = AutoConfig.from_pretrained(tmp_path, output_attentions=True, foo=False, return_unused_kwargs=True)
    assert config.output_attentions is True and unused == {"foo": False}
    # and it is saved as given
    config.save_pretrained(tmp_path / "again")
    assert AutoConfig.from_pretrained(tmp_path / "again").output_attentions is True


@pytest.mark.parametrize("family", list(FAMILIES))
def test_num_labels_and_quiet_defaults(family):
    cls, _, _ = FAMILIES[family]
    config = cls(**tiny_kwargs(family), num_labels=5)
    assert len(config.id2label) == len(config.label2id) == 5
    config.num_labels = 3
    assert len(config.id2label) == len(config.label2id) == 3
    logging.warning_once.cache_clear()
    logger = logging.get_logger("transformers.configuration_utils")
    with CaptureLogger(logger) as captured:
        cls()
        cls(**tiny_kwargs(family))
    assert captured.out == ""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_output_attentions_must_be_a_bool(family):
    cls, _, _ = FAMILIES[family]
    with pytest.raises(TypeError, match="output_attentions"):
        cls(output_attentions="yes")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_from_a_config_asking_for_attentions_runs_without_them(family, tmp_path):
    _, make, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(make()).eval()
    inputs = inputs_for(family)
    with torch.no_grad():
        reference = model(**inputs)
    model.save_pretrained(tmp_path)

    loaded = model_cls.from_pretrained(tmp_path, output_attentions=True).eval()
    assert loaded.config.output_attentions is True
    logging.warning_once.cache_clear()
    logger = logging.get_logger("hf_kernattn.modeling.pretrained")
    with CaptureLogger(logger) as captured, torch.no_grad():
        out = loaded(**inputs)
    assert "output_attentions" in captured.out and "no attention weights" in captured.out
    assert getattr(out, "attentions", None) is None
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=0)
    # asked for in the call itself: still refused
    with pytest.raises(ValueError, match="no attention weights"):
        loaded(**inputs, output_attentions=True)
    # and explicitly not asked for: no attentions, no error
    with torch.no_grad():
        assert getattr(loaded(**inputs, output_attentions=False), "attentions", None) is None


def test_causal_lm_from_a_config_asking_for_attentions_generates_without_them(tmp_path):
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config()).eval()
    ids = inputs_for("linear_gpt")["input_ids"]
    reference = model.generate(ids, max_new_tokens=4, do_sample=False)
    model.save_pretrained(tmp_path)
    loaded = LinearGPTForCausalLM.from_pretrained(tmp_path, output_attentions=True).eval()
    logging.warning_once.cache_clear()
    with CaptureLogger(logging.get_logger("hf_kernattn.modeling.pretrained")) as captured:
        out = loaded.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert "no attention weights" in captured.out
    assert torch.equal(out.sequences, reference)
    assert not getattr(out, "attentions", None)
    # asked for in the call: refused before decoding
    with pytest.raises(ValueError, match="no attention weights"):
        loaded.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
