"""Configuration of Linear GPT, a decoder-only causal LM with kernelized (linear) attention."""

from __future__ import annotations

from typing import Optional

from transformers import PreTrainedConfig

from .attention_config import AttentionSchema, validate_model_fields
from .feature_maps import feature_size
from .registry import backends_for, get_backend

# The one Auto-class table of Linear GPT: written into config.json as ``auto_map`` (remote-code
# loading) and read by ``hf_kernattn/__init__.py`` for the in-process registration.
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
    recompute_attention=(False, "training and prefill keep their intermediates, as before the option existed"),
)


def check_attn_backend(attn_backend: str, *, rpe: str, max_relative_position: int, position_embedding_type: str) -> None:
    """``ValueError`` unless ``attn_backend`` can run every call of a Linear GPT of these options
    without a state (training, prefill): ``"auto"``, or a registered backend that does causal
    attention, with the clipped 1D bias of ``rpe="learned"`` and with the separate denominator
    features of ``position_embedding_type="rotary"`` when the model has them. The message names
    the backends that can. (Calls that continue from a state use it when it carries a state, and
    ``auto``'s choice among those that do otherwise: see the config's docstring.)"""
    if attn_backend == "auto":
        return
    learned = rpe == "learned"
    request = dict(causal=True, rpe="1d" if learned else None, rpe_clip=max_relative_position if learned else None,
                   split=position_embedding_type == "rotary")
    lacks = get_backend(attn_backend).missing(key_mask=False, device=None, **request)
    if lacks:
        model = "a causal LM" + (f" with a bias clipped at K={max_relative_position} (rpe='learned')" if learned else "")
        model += " with separate denominator features (position_embedding_type='rotary')" if request["split"] else ""
        raise ValueError(
            f"attn_backend={attn_backend!r} cannot serve Linear GPT, {model}: it cannot do {', '.join(lacks)}; "
            f"attn_backend must be 'auto' or one of {backends_for(**request)}"
        )


class LinearGPTConfig(PreTrainedConfig):
    """Configuration of :class:`LinearGPTModel` / :class:`LinearGPTForCausalLM` (``model_type="linear_gpt"``).

    Model shape:
        vocab_size: number of token ids.
        hidden_size: width C of the residual stream; a multiple of ``num_attention_heads``.
        num_hidden_layers: number of decoder blocks.
        num_attention_heads: H; the head dim is ``hidden_size // num_attention_heads``.
        num_key_value_heads: key/value heads (grouped-query attention, Ainslie et al. 2023): each
            serves ``num_attention_heads // num_key_value_heads`` query heads. None (default):
            one per query head. The decoding state keeps one sum per query head (the key
            features are shared by a group, the query-side sums are not), so its size does not
            shrink with fewer key/value heads; the key/value projections do.
        intermediate_size: width of the MLP inside each block.
        hidden_act: MLP activation (a ``transformers.activations`` name, e.g. ``"gelu_new"``,
            ``"silu"``).
        mlp_type: ``"standard"`` (GPT-2: ``c_proj(act(c_fc(x)))``, the default) or ``"gated"``
            (Llama: ``down_proj(act(gate_proj(x)) * up_proj(x))``).
        mlp_bias: biases in the MLP's linear layers (GPT-2: True, the default; Llama: False).
        norm_type: ``"layernorm"`` (default) or ``"rmsnorm"`` (Llama's RMSNorm: no mean, no bias).
        max_position_embeddings: size of the learned absolute position table (only used when
            ``position_embedding_type="absolute"``); longer inputs raise a ``ValueError``.
        position_embedding_type: ``"absolute"`` (learned table added to the token embeddings,
            GPT-2 style, the default), ``"rotary"`` (rotations applied to the feature-mapped
            queries and keys, RoFormer style: rotated features in the numerator, un-rotated in
            the denominator, so the denominator stays positive), ``"rope"`` (Llama's rotary
            position embedding: queries and keys rotated *before* the feature map, so with
            ``feature_map="prf"`` the model estimates Llama's ``exp(R_i q . R_j k / sqrt(d))``;
            pairs ``(i, i + D/2)`` of the head dim) or ``"none"`` (no absolute positions; use with
            ``rpe="learned"``).
        rotary_base: base of the rotary frequencies (``theta_i = base ** (-2i / M)``, M the
            feature size for ``"rotary"``, the head size D for ``"rope"``; Llama's ``rope_theta``).
        layer_norm_epsilon: epsilon of the LayerNorms (or RMSNorms).
        initializer_range: std of the normal init of linear and embedding weights.
        embd_pdrop / resid_pdrop / attn_pdrop: dropout on embeddings, residual branches and the
            attention output.

    ``rpe`` takes ``"none"`` or ``"learned"`` here: a causal bias ``b_{j-i}`` per layer and head,
    clipped at ``max_relative_position`` = K, trained in the parallel form with the backend
    ``attn_backend`` picks (``auto``: see below) and decoded exactly in constant time per token
    from a window of the last K - 1 keys (``cache.py``). ``recompute_attention`` applies to the
    parallel form: training forwards and the prefill of a decoding state.

    ``attn_backend`` must be ``"auto"`` or a backend that does causal attention (with the
    clipped bias of ``rpe="learned"``, and the separate denominator features of
    ``position_embedding_type="rotary"``, when the model has them): e.g. ``dense``,
    ``causal_chunked``, ``fft``, ``windowed`` (only with ``rpe="learned"``), ``recurrent``; a
    ``ValueError`` names the ones that can. It runs every call that starts without a state
    (training and prefill, with ``use_cache`` on or off; the state returned is folded from the
    call's keys and values when the backend carries none). A call that continues from a state
    (a continuation or a decoding step) runs it too when it carries a state (``causal_chunked``,
    ``windowed``, ``recurrent`` or any backend registered with ``state=True``), otherwise
    ``auto``'s choice among those that do.

    Generation and tokens:
        use_cache: return the recurrent state (``past_key_values``) from ``forward``.
        pad_token_id / bos_token_id / eos_token_id: special token ids (may be ``None``).
        tie_word_embeddings: share the input embedding with the LM head.

    @shared-attention-fields@

    ``output_attentions`` is accepted and kept, as by every transformers config, but kernelized
    attention never forms the attention matrix: a model built from a config with
    ``output_attentions=True`` returns no attention weights (and warns once), and
    ``forward(output_attentions=True)`` raises ``ValueError``.
    """

    model_type = "linear_gpt"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        *,
        vocab_size: int = 50257,
        hidden_size: int = 512,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 8,
        num_key_value_heads: Optional[int] = None,
        intermediate_size: Optional[int] = None,
        hidden_act: str = "gelu_new",
        mlp_type: str = "standard",
        mlp_bias: bool = True,
        norm_type: str = "layernorm",
        max_position_embeddings: int = 2048,
        position_embedding_type: str = "absolute",
        rotary_base: float = 10000.0,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        embd_pdrop: float = 0.0,
        resid_pdrop: float = 0.0,
        attn_pdrop: float = 0.0,
        use_cache: bool = True,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        if intermediate_size is None:
            intermediate_size = 4 * hidden_size
        for name, value in (
            ("vocab_size", vocab_size),
            ("num_hidden_layers", num_hidden_layers),
            ("intermediate_size", intermediate_size),
            ("max_position_embeddings", max_position_embeddings),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {list(POSITION_EMBEDDING_TYPES)}, got {position_embedding_type!r}"
            )
        for name, value, allowed in (("mlp_type", mlp_type, MLP_TYPES), ("norm_type", norm_type, NORM_TYPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if not isinstance(mlp_bias, bool):
            raise ValueError(f"mlp_bias must be a bool, got {mlp_bias!r}")
        validate_model_fields(
            family=ATTENTION_SCHEMA.family,
            hidden_act=hidden_act,
            initializer_range=initializer_range,
            layer_norm_eps=("layer_norm_epsilon", layer_norm_epsilon),
            use_cache=use_cache,
            output_attentions=kwargs.get("output_attentions"),
        )
        attention = ATTENTION_SCHEMA.take(kwargs, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        if (
            not isinstance(num_key_value_heads, int) or isinstance(num_key_value_heads, bool) or num_key_value_heads < 1
            or num_attention_heads % num_key_value_heads
        ):
            raise ValueError(
                f"num_key_value_heads must be a positive int dividing num_attention_heads={num_attention_heads!r} "
                f"(or None: one per query head), got {num_key_value_heads!r}"
            )
        rpe = attention["rpe"]
        if rpe not in ("none", "learned"):
            raise ValueError(f"rpe must be 'none' or 'learned' for a causal LM, got {rpe!r}")
        if position_embedding_type == "rotary":
            if rpe != "none":
                raise ValueError("position_embedding_type='rotary' cannot be combined with rpe='learned'; pick one")
            m = feature_size(attention["feature_map"], attention["num_random_features"], hidden_size // num_attention_heads)
            if m % 2:
                raise ValueError(f"position_embedding_type='rotary' needs an even feature size, got {m}")
        if position_embedding_type == "rope" and (hidden_size // num_attention_heads) % 2:
            raise ValueError(
                f"position_embedding_type='rope' needs an even head size, got {hidden_size // num_attention_heads}"
            )
        check_attn_backend(attention["attn_backend"], rpe=rpe, max_relative_position=attention["max_relative_position"],
                           position_embedding_type=position_embedding_type)
        if not isinstance(rotary_base, (int, float)) or rotary_base <= 1:
            raise ValueError(f"rotary_base must be a number > 1, got {rotary_base!r}")
        for name, value in (("embd_pdrop", embd_pdrop), ("resid_pdrop", resid_pdrop), ("attn_pdrop", attn_pdrop)):
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.mlp_type = mlp_type
        self.mlp_bias = mlp_bias
        self.norm_type = norm_type
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding_type = position_embedding_type
        self.rotary_base = float(rotary_base)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.embd_pdrop = embd_pdrop
        self.resid_pdrop = resid_pdrop
        self.attn_pdrop = attn_pdrop
        ATTENTION_SCHEMA.apply(self, attention)
        self.use_cache = use_cache
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)


LinearGPTConfig.__doc__ = ATTENTION_SCHEMA.document(LinearGPTConfig.__doc__)
