"""Configuration of Linear GPT, a decoder-only causal LM with kernelized (linear) attention."""

from __future__ import annotations

from typing import Optional

from transformers import PreTrainedConfig

from .attention_config import (AttentionSchema, ConfigField, activation, boolean, choice, finite_above,
                               finite_at_least, int_at_least, optional, probability)
from .feature_maps import feature_size
from .registry import backends_for, get_backend

# The Auto classes: config.json's ``auto_map`` (remote code) and the in-process registration.
AUTO_MAP = {
    "AutoConfig": "configuration_linear_gpt.LinearGPTConfig",
    "AutoModel": "modeling_linear_gpt.LinearGPTModel",
    "AutoModelForCausalLM": "modeling_linear_gpt.LinearGPTForCausalLM",
}

POSITION_EMBEDDING_TYPES = ("absolute", "rotary", "rope", "none")
NORM_TYPES = ("layernorm", "rmsnorm")
MLP_TYPES = ("standard", "gated")

ATTENTION_SCHEMA = AttentionSchema(
    "Linear GPT",
    fields=(
        "Model shape",
        ConfigField("vocab_size", 50257, "number of token ids.", int_at_least(1)),
        ConfigField("hidden_size", 512, "width C of the residual stream; a multiple of ``num_attention_heads``.",
                    int_at_least(1)),
        ConfigField("num_hidden_layers", 6, "number of decoder blocks.", int_at_least(1)),
        ConfigField("num_attention_heads", 8, "H; the head dim is ``hidden_size // num_attention_heads``.",
                    int_at_least(1)),
        ConfigField("num_key_value_heads", None,
                    "key/value heads (grouped-query attention, Ainslie et al. 2023), a divisor of "
                    "``num_attention_heads``; None: one per query head. Fewer shrink the key/value projections, "
                    "not the decoding state (one sum per query head).", optional(int_at_least(1))),
        ConfigField("intermediate_size", None, "width of the MLP inside each block; None: ``4 * hidden_size``.",
                    optional(int_at_least(1))),
        ConfigField("hidden_act", "gelu_new",
                    "MLP activation (a ``transformers.activations`` name, e.g. ``\"gelu_new\"``, ``\"silu\"``).",
                    activation),
        ConfigField("mlp_type", "standard",
                    "``\"standard\"`` (GPT-2: ``c_proj(act(c_fc(x)))``) or ``\"gated\"`` (Llama: "
                    "``down_proj(act(gate_proj(x)) * up_proj(x))``).", choice(MLP_TYPES)),
        ConfigField("mlp_bias", True, "biases in the MLP's linear layers (GPT-2: True; Llama: False).", boolean),
        ConfigField("norm_type", "layernorm",
                    "``\"layernorm\"`` or ``\"rmsnorm\"`` (Llama's RMSNorm: no mean, no bias).", choice(NORM_TYPES)),
        ConfigField("max_position_embeddings", 2048,
                    "size of the learned position table of ``position_embedding_type=\"absolute\"``; longer "
                    "inputs raise ``ValueError``.",
                    int_at_least(1)),
        ConfigField("position_embedding_type", "absolute",
                    "``\"absolute\"`` (a learned table added to the token embeddings, GPT-2), ``\"rotary\"`` "
                    "(RoFormer: the feature-mapped queries and keys rotated in the numerator, un-rotated in the "
                    "denominator, which stays positive), ``\"rope\"`` (Llama's RoPE: queries and keys rotated "
                    "*before* the feature map, pairs ``(i, i + D/2)``; with ``feature_map=\"prf\"`` the model "
                    "estimates ``exp(R_i q . R_j k / sqrt(d))``) or ``\"none\"`` (use with ``rpe=\"learned\"``).",
                    choice(POSITION_EMBEDDING_TYPES)),
        ConfigField("rotary_base", 10000.0,
                    "base of the rotary frequencies (``theta_i = base ** (-2i / M)``, M the feature size for "
                    "``\"rotary\"``, the head size D for ``\"rope\"``; Llama's ``rope_theta``).",
                    finite_above(1), float),
        ConfigField("layer_norm_epsilon", 1e-5, "epsilon of the LayerNorms (or RMSNorms).", finite_above(0)),
        ConfigField("initializer_range", 0.02, "std of the normal init of linear and embedding weights.",
                    finite_at_least(0)),
        ConfigField("embd_pdrop", 0.0, "dropout on the embeddings.", probability),
        ConfigField("resid_pdrop", 0.0, "dropout on the residual branches.", probability),
        ConfigField("attn_pdrop", 0.0, "dropout on the attention output.", probability),
        "Generation and tokens",
        ConfigField("use_cache", True, "return the recurrent state (``past_key_values``) from ``forward``.", boolean),
        ConfigField("pad_token_id", None, "id of the padding token (may be ``None``)."),
        ConfigField("bos_token_id", None, "id of the beginning-of-sequence token (may be ``None``)."),
        ConfigField("eos_token_id", None, "id of the end-of-sequence token (may be ``None``)."),
        ConfigField("tie_word_embeddings", True, "share the input embedding with the LM head.", boolean),
    ),
    choices={"rpe": ("none", "learned")},  # a causal LM: a 1D bias
    recompute_attention=(False, "training and prefill keep their intermediates, as before the option existed"),
)


def check_attn_backend(attn_backend: str, *, rpe: str, max_relative_position: int, position_embedding_type: str,
                       softmax_window: Optional[int] = None) -> None:
    """``ValueError`` naming the backends that can, unless ``attn_backend`` is ``"auto"`` or runs
    every call without a state (training, prefill) of a Linear GPT with these options: causal,
    with the clipped bias, separate denominator features or the hybrid where the model has them."""
    if attn_backend == "auto":
        return
    learned = rpe == "learned"
    request = dict(causal=True, rpe="1d" if learned else None, rpe_clip=max_relative_position if learned else None,
                   split=position_embedding_type == "rotary", window=softmax_window is not None)
    lacks = get_backend(attn_backend).missing(key_mask=False, device=None, **request)
    if lacks:
        model = "a causal LM" + (f" with a bias clipped at K={max_relative_position} (rpe='learned')" if learned else "")
        model += " with separate denominator features (position_embedding_type='rotary')" if request["split"] else ""
        model += f" with a softmax window (softmax_window={softmax_window})" if request["window"] else ""
        raise ValueError(
            f"attn_backend={attn_backend!r} cannot serve Linear GPT, {model}: it cannot do {', '.join(lacks)}; "
            f"attn_backend must be 'auto' or one of {backends_for(**request)}"
        )


def complete_and_check(values: dict) -> None:
    """Fill the defaults that depend on other fields and check what involves more than one field."""
    heads, head_size = values["num_attention_heads"], values["hidden_size"] // values["num_attention_heads"]
    if values["intermediate_size"] is None:
        values["intermediate_size"] = 4 * values["hidden_size"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if heads % values["num_key_value_heads"]:
        raise ValueError(
            f"num_key_value_heads must be a positive int dividing num_attention_heads={heads!r} "
            f"(or None: one per query head), got {values['num_key_value_heads']!r}"
        )
    rpe, positions = values["rpe"], values["position_embedding_type"]
    if positions == "rotary":
        if rpe != "none":
            raise ValueError("position_embedding_type='rotary' cannot be combined with rpe='learned'; pick one")
        m = feature_size(values["feature_map"], values["num_random_features"], head_size, values["num_learned_features"])
        if m % 2:
            raise ValueError(f"position_embedding_type='rotary' needs an even feature size, got {m}")
    if positions == "rope" and head_size % 2:
        raise ValueError(f"position_embedding_type='rope' needs an even head size, got {head_size}")
    check_softmax_window(values["softmax_window"], rpe, positions)
    check_attn_backend(values["attn_backend"], rpe=rpe, max_relative_position=values["max_relative_position"],
                       position_embedding_type=positions, softmax_window=values["softmax_window"])


def check_softmax_window(softmax_window: Optional[int], rpe: str, positions: str) -> None:
    """``ValueError`` when ``softmax_window`` meets ``rpe="learned"`` or ``"rotary"`` features
    (absolute positions and ``"rope"`` are fine)."""
    if softmax_window is None:
        return
    if rpe != "none":
        raise ValueError(f"softmax_window={softmax_window} cannot be combined with rpe={rpe!r}: the sliding-window "
                         "hybrid takes no relative-position bias; use rpe='none'")
    if positions == "rotary":
        raise ValueError(f"softmax_window={softmax_window} cannot be combined with position_embedding_type='rotary' "
                         "(rotated features); use 'absolute', 'rope' or 'none'")


@ATTENTION_SCHEMA.declare
class LinearGPTConfig(PreTrainedConfig):
    """Configuration of :class:`LinearGPTModel` / :class:`LinearGPTForCausalLM` (``model_type="linear_gpt"``).

    @family-fields@

    ``rpe`` takes ``"none"`` or ``"learned"``: a causal bias ``b_{j-i}`` per layer and head,
    clipped at K = ``max_relative_position``, decoded exactly in constant time per token from a
    window of the last K - 1 keys. ``softmax_window = W`` needs ``rpe="none"`` and positions
    ``"absolute"``, ``"rope"`` or ``"none"``; the decoding state then also keeps the last W - 1
    keys and values.

    ``attn_backend``: ``"auto"`` or a backend that does causal attention with this model's options
    (e.g. ``dense``, ``causal_chunked``, ``fft``, ``recurrent``; ``windowed`` with
    ``rpe="learned"``; only ``hybrid`` with ``softmax_window``); a ``ValueError`` names those that
    can. It runs every call without a state (training, prefill); a call from a state runs it if
    it carries state (``causal_chunked``, ``windowed``, ``recurrent``, any registered with
    ``state=True``), else ``auto``'s choice.

    @shared-attention-fields@
    """

    model_type = "linear_gpt"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, **kwargs) -> None:
        ATTENTION_SCHEMA.configure(self, kwargs, complete_and_check)
        super().__init__(**{"auto_map": dict(AUTO_MAP), **kwargs})

