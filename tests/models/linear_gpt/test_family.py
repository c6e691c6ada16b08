"""Linear GPT through the shared family tests (tests/family_mixin.py), decoding state included."""

from __future__ import annotations

import torch

from hf_kernattn import LinearGPTForCausalLM, LinearGPTModel
from hf_kernattn.modeling.configuration_linear_gpt import AUTO_MAP
from tests.conftest import V_GPT, tiny_linear_gpt_config
from tests.family_mixin import CachedFamilyTests


class TestLinearGPTFamily(CachedFamilyTests):
    model_classes = (LinearGPTModel, LinearGPTForCausalLM)
    auto_map = AUTO_MAP
    padding_side = "left"
    cache_model_class = LinearGPTForCausalLM
    cache_class_name = "LinearGPTCache"
    # the conformance checks with random features (the buffers under test) and absolute positions
    conformance_overrides = {"feature_map": "prf", "num_random_features": 16, "position_embedding_type": "absolute"}
    export_variants = {
        "absolute": {},
        "rotary": {"position_embedding_type": "rotary"},
        "rpe": {"rpe": "learned", "max_relative_position": 4, "position_embedding_type": "none"},
    }
    layer_norm_field = "layer_norm_epsilon"
    tied_lm_class = LinearGPTForCausalLM
    training_class = LinearGPTForCausalLM
    # absolute table, rotary (separate numerator / denominator features), a learned bias clipped
    # at 3 (so the state's window of the last K - 1 keys is exercised past K) and Llama-style blocks
    cache_variants = {
        "absolute": {"position_embedding_type": "absolute"},
        "rotary": {"position_embedding_type": "rotary"},
        "rpe": {"rpe": "learned", "max_relative_position": 3, "position_embedding_type": "none"},
        # Llama-style blocks: rotations before the feature map, RMSNorm, gated MLP, one key/value head
        "llama": {"position_embedding_type": "rope", "norm_type": "rmsnorm", "mlp_type": "gated", "mlp_bias": False,
                  "num_key_value_heads": 1, "hidden_act": "silu"},
        # the sliding-window hybrid: exact softmax over the last 3 keys (its state keeps raw keys and validity)
        "window": {"position_embedding_type": "absolute", "softmax_window": 3},
    }

    def make_config(self, **overrides):
        # rotary by default: the position scheme with the most code of its own (split features)
        return tiny_linear_gpt_config(**{"eos_token_id": None, "position_embedding_type": "rotary", **overrides})

    def prepare(self, model):
        with torch.no_grad():  # a non-trivial bias (the config starts it at 0), so RPE paths really count
            for block in model.base_model.h:
                if block.attn.rpe is not None:
                    torch.nn.init.normal_(block.attn.rpe.weight, std=0.7)
        return model

    def make_inputs(self, batch, n, seed=0):
        return {"input_ids": torch.randint(1, V_GPT, (batch, n), generator=torch.Generator().manual_seed(seed))}

    def expected_shapes(self, cls, config, batch, n):
        c = config.hidden_size
        return {
            LinearGPTModel: {"last_hidden_state": (batch, n, c)},
            LinearGPTForCausalLM: {"logits": (batch, n, config.vocab_size)},
        }[cls]


class TestLinearGPTLlamaStyleFamily(TestLinearGPTFamily):
    """The same family tests with Llama-style blocks (what a converted Llama runs): rotations
    before the feature map, RMSNorm, gated MLP without biases, grouped-query attention."""

    cache_variants = {"llama": {}}
    conformance_overrides = {"feature_map": "prf", "num_random_features": 16}
    export_variants = {"llama": {}}

    def make_config(self, **overrides):
        return super().make_config(**{**TestLinearGPTFamily.cache_variants["llama"], **overrides})
