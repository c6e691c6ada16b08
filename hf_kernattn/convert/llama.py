"""Llama checkpoints into Linear GPT (through :func:`hf_kernattn.convert.convert_to_linear_gpt`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import (
    CONVERTED_FEATURE_MAP,
    CONVERTED_NUM_RANDOM_FEATURES,
    check_layer_count,
    finish_conversion,
    load_source,
    read_state_dict,
)

# Llama config fields -> Linear GPT config fields
_LLAMA_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size", "hidden_act": "hidden_act",
    "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "layer_norm_epsilon",
    "initializer_range": "initializer_range", "attention_dropout": "attn_pdrop", "attention_bias": "attention_bias",
    "mlp_bias": "mlp_bias", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id", "tie_word_embeddings": "tie_word_embeddings",
}


def _llama_rope_theta(cfg: dict[str, Any]) -> float:
    """Llama's rotary base; ``ValueError`` for rotary variants Linear GPT's ``"rope"`` does not
    reproduce (scaled / partial rotations). Reads transformers 5's ``rope_parameters`` and the
    older ``rope_theta`` / ``rope_scaling`` fields."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"cannot convert a Llama with rope_type={rope_type!r}; supported: 'default' (unscaled rotary positions)")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"cannot convert a Llama with partial_rotary_factor={partial!r}; supported: 1.0")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def convert_llama(src: Path, cfg: dict[str, Any], output_dir, base_model, overrides: dict[str, Any], allow_pickle: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..modeling.configuration_linear_gpt import LinearGPTConfig
    from ..modeling.modeling_linear_gpt import LinearGPTForCausalLM

    theta = _llama_rope_theta(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim * heads != cfg["hidden_size"]:
        raise ValueError(
            f"cannot convert a Llama with head_dim={head_dim} != hidden_size / num_attention_heads = "
            f"{cfg['hidden_size']} / {heads}; supported: head_dim = hidden_size / num_attention_heads"
        )
    raw = read_state_dict(src, allow_pickle)
    check_layer_count(raw, int(cfg.get("num_hidden_layers", 32)), "num_hidden_layers")
    # through transformers' own loading: every Llama key layout arrives in one; what it had to
    # initialise is not in ``state``, so it is refused (or reported initialised), never copied
    state, unused = load_source(LlamaForCausalLM, LlamaConfig.from_dict(dict(cfg)), raw, src)
    del raw
    fields = {dst: cfg[s] for s, dst in _LLAMA_FIELDS.items() if s in cfg}
    fields.update(feature_map=CONVERTED_FEATURE_MAP, num_random_features=CONVERTED_NUM_RANDOM_FEATURES, normalize_qk=False)
    fields.update(overrides)
    fields.update(position_embedding_type="rope", rotary_base=theta, norm_type="rmsnorm", mlp_type="gated")
    model = LinearGPTForCausalLM(LinearGPTConfig(**fields)).eval()
    pairs = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    for i in range(model.config.num_hidden_layers):
        s, d = f"model.layers.{i}", f"transformer.h.{i}"
        pairs[f"{d}.ln_1.weight"] = f"{s}.input_layernorm.weight"
        pairs[f"{d}.ln_2.weight"] = f"{s}.post_attention_layernorm.weight"
        for part in ("weight", "bias"):
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                pairs[f"{d}.attn.{proj}.{part}"] = f"{s}.self_attn.{proj}.{part}"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                pairs[f"{d}.mlp.{proj}.{part}"] = f"{s}.mlp.{proj}.{part}"
    target = model.state_dict()
    pairs = {dst: srck for dst, srck in pairs.items() if dst in target}  # biases only where the config has them
    return finish_conversion(
        model, state, pairs, src, base_model, output_dir, "llama", "causal_lm", cfg, transform=lambda dst, value: value,
        required=lambda dst: True, zero=lambda name: False,
        tied="lm_head.weight" if model.config.tie_word_embeddings else None, unused=unused,
    )
