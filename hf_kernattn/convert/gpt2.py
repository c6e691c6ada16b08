"""GPT-2 checkpoints into Linear GPT (through :func:`hf_kernattn.convert.convert_to_linear_gpt`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .common import CONVERTED_FEATURE_MAP, CONVERTED_NUM_RANDOM_FEATURES, check_layer_count, finish_conversion, read_state_dict

# GPT-2 config fields -> Linear GPT config fields
_GPT2_FIELDS = {
    "vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
    "activation_function": "hidden_act", "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_epsilon", "initializer_range": "initializer_range", "embd_pdrop": "embd_pdrop",
    "resid_pdrop": "resid_pdrop", "attn_pdrop": "attn_pdrop", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
}


def convert_gpt2(src: Path, cfg: dict[str, Any], output_dir, base_model, overrides: dict[str, Any], allow_pickle: bool):
    from ..modeling.configuration_linear_gpt import LinearGPTConfig
    from ..modeling.modeling_linear_gpt import LinearGPTForCausalLM

    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("reorder_and_upcast_attn", False)):
        if cfg.get(field, ok) != ok:
            raise ValueError(f"cannot convert a GPT-2 with {field}={cfg[field]!r}; supported: {field}={ok!r}")
    state = read_state_dict(src, allow_pickle)
    check_layer_count(state, int(cfg.get("n_layer", 12)), "n_layer")
    fields = {dst: cfg[s] for s, dst in _GPT2_FIELDS.items() if s in cfg}
    fields["intermediate_size"] = cfg.get("n_inner") or 4 * fields["hidden_size"]
    fields.update(feature_map=CONVERTED_FEATURE_MAP, num_random_features=CONVERTED_NUM_RANDOM_FEATURES, normalize_qk=False)
    fields.update(overrides)
    fields["position_embedding_type"] = "absolute"
    model = LinearGPTForCausalLM(LinearGPTConfig(**fields)).eval()
    hidden = model.config.hidden_size
    prefix = "transformer." if any(k.startswith("transformer.") for k in state) else ""
    pairs: dict[str, str] = {}
    slices: dict[str, slice] = {}
    for name in ("wte", "wpe"):
        pairs[f"transformer.{name}.weight"] = f"{prefix}{name}.weight"
    for part in ("weight", "bias"):
        pairs[f"transformer.ln_f.{part}"] = f"{prefix}ln_f.{part}"
    for i in range(model.config.num_hidden_layers):
        s, d = f"{prefix}h.{i}", f"transformer.h.{i}"
        for part in ("weight", "bias"):
            for ln in ("ln_1", "ln_2"):
                pairs[f"{d}.{ln}.{part}"] = f"{s}.{ln}.{part}"
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                pairs[f"{d}.attn.{proj}.{part}"] = f"{s}.attn.c_attn.{part}"
                slices[f"{d}.attn.{proj}.{part}"] = slice(j * hidden, (j + 1) * hidden)
            pairs[f"{d}.attn.o_proj.{part}"] = f"{s}.attn.c_proj.{part}"
            pairs[f"{d}.mlp.c_fc.{part}"] = f"{s}.mlp.c_fc.{part}"
            pairs[f"{d}.mlp.c_proj.{part}"] = f"{s}.mlp.c_proj.{part}"
    pairs["lm_head.weight"] = "lm_head.weight"

    def transform(dst: str, value: torch.Tensor) -> torch.Tensor:
        if dst in slices:  # fused q, k, v: the output columns of c_attn
            value = value[..., slices[dst]]
        if dst.endswith(".weight") and (".attn." in dst or ".mlp." in dst):
            value = value.t()  # Conv1D (in, out) -> nn.Linear (out, in)
        return value

    return finish_conversion(
        model, state, pairs, src, base_model, output_dir, "gpt2", "causal_lm", cfg, transform=transform,
        required=lambda dst: dst.startswith("transformer."), zero=lambda name: False, tied="lm_head.weight",
    )
