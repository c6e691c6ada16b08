"""NPRF-BERT through the shared family tests (tests/family_mixin.py)."""

from __future__ import annotations

import torch

from hf_kernattn import (
    NPRFBertForMaskedLM,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
)
from hf_kernattn.modeling.configuration_nprf_bert import AUTO_MAP
from tests.conftest import V_BERT, tiny_nprf_bert_config
from tests.family_mixin import FamilyTests


class TestNPRFBertFamily(FamilyTests):
    model_classes = (
        NPRFBertModel, NPRFBertForMaskedLM, NPRFBertForSequenceClassification,
        NPRFBertForTokenClassification, NPRFBertForQuestionAnswering,
    )
    auto_map = AUTO_MAP
    padding_side = "right"
    tied_lm_class = NPRFBertForMaskedLM
    training_class = NPRFBertForMaskedLM
    recompute_overrides = {"hidden_dropout_prob": 0.0, "recompute_attention": False}

    def make_config(self, **overrides):
        return tiny_nprf_bert_config(**overrides)  # num_labels 2: what question answering needs

    def make_inputs(self, batch, n, seed=0):
        return {"input_ids": torch.randint(1, V_BERT, (batch, n), generator=torch.Generator().manual_seed(seed))}

    def expected_shapes(self, cls, config, batch, n):
        c, labels = config.hidden_size, config.num_labels
        return {
            NPRFBertModel: {"last_hidden_state": (batch, n, c), "pooler_output": (batch, c)},
            NPRFBertForMaskedLM: {"logits": (batch, n, config.vocab_size)},
            NPRFBertForSequenceClassification: {"logits": (batch, labels)},
            NPRFBertForTokenClassification: {"logits": (batch, n, labels)},
            NPRFBertForQuestionAnswering: {"start_logits": (batch, n), "end_logits": (batch, n)},
        }[cls]
