"""Configuration of Linear GPT, a decoder-only causal LM with kernelized (linear) attention."""

from __future__ import annotations

from typing import Optional

from transformers import PreTrainedConfig

from .attention_config import validate_attention_fields, validate_model_fields
from .feature_maps import feature_size

POSITION_EMBEDDING_TYPES = ("absolute", "rotary", "none")


class LinearGPTConfig(PreTrainedConfig):
    """Configuration of :class:`LinearGPTModel` / :class:`LinearGPTForCausalLM` (``model_type="linear_gpt"``).

    Model shape:
        vocab_size: number of token ids.
        hidden_size: width C of the residual stream; a multiple of ``num_attention_heads``.
        num_hidden_layers: number of decoder blocks.
        num_attention_heads: H; the head dim is ``hidden_size // num_attention_heads``.
        intermediate_size: width of the MLP inside each block.
        hidden_act: MLP activation (a ``transformers.activations`` name, e.g. ``"gelu_new"``).
        max_position_embeddings: size of the learned absolute position table (only used when
            ``position_embedding_type="absolute"``); longer inputs raise a ``ValueError``.
        position_embedding_type: ``"absolute"`` (learned table added to the token embeddings,
            GPT-2 style, the default), ``"rotary"`` (rotations applied to the feature-mapped
            queries and keys, RoFormer style: rotated features in the numerator, un-rotated in
            the denominator, so the denominator stays positive) or ``"none"`` (no absolute
            positions; use with ``rpe="learned"``).
        rotary_base: base of the rotary frequencies (``theta_i = base ** (-2i / M)``).
        layer_norm_epsilon: epsilon of the LayerNorms.
        initializer_range: std of the normal init of linear and embedding weights.
        embd_pdrop / resid_pdrop / attn_pdrop: dropout on embeddings, residual branches and the
            attention output.
        attention_bias: use biases in the q/k/v/o projections.
        attention_eps: epsilon added to the attention denominator.

    Shared attention fields (same names in every family, see ``attention.py``):
        feature_map: ``"elu"`` (elu + 1, the default, Katharopoulos et al. 2020), ``"relu"``,
            ``"prf"`` or ``"trf"``.
        num_random_features: m for the random maps ``prf`` / ``trf``.
        feature_projection: ``"gaussian"`` | ``"orthogonal"`` | ``"sphere"`` random projections.
        normalize_qk: l2-normalise queries and keys before the feature map.
        feature_redraw_interval: training steps between redraws of the random projections (0 never).
        feature_seed: seed of the random projections (layer ``l`` uses ``feature_seed + 1000 l``).
        rpe: ``"none"`` or ``"learned"``: a causal relative-position bias ``b_{j-i}`` per layer
            and head, clipped at ``max_relative_position`` (trained with the ``fft`` backend;
            decoded exactly in constant time per token, see ``cache.py``).
        max_relative_position: K, the clipping distance of the bias.
        attn_backend: ``"auto"`` or a registered backend name for the parallel (training/prefill) form.

    Generation and tokens:
        use_cache: return the recurrent state (``past_key_values``) from ``forward``.
        pad_token_id / bos_token_id / eos_token_id: special token ids (may be ``None``).
        tie_word_embeddings: share the input embedding with the LM head.

    ``output_attentions=True`` is refused (``ValueError``): kernelized attention never forms the
    attention matrix, so there are no attention weights to return.
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
        intermediate_size: Optional[int] = None,
        hidden_act: str = "gelu_new",
        max_position_embeddings: int = 2048,
        position_embedding_type: str = "absolute",
        rotary_base: float = 10000.0,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        embd_pdrop: float = 0.0,
        resid_pdrop: float = 0.0,
        attn_pdrop: float = 0.0,
        attention_bias: bool = True,
        attention_eps: float = 1e-6,
        feature_map: str = "elu",
        num_random_features: int = 64,
        feature_projection: str = "orthogonal",
        normalize_qk: bool = False,
        feature_redraw_interval: int = 0,
        feature_seed: int = 0,
        rpe: str = "none",
        max_relative_position: int = 64,
        attn_backend: str = "auto",
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
        validate_model_fields(
            hidden_act=hidden_act,
            initializer_range=initializer_range,
            layer_norm_eps=("layer_norm_epsilon", layer_norm_epsilon),
            attention_eps=attention_eps,
            feature_seed=feature_seed,
            use_cache=use_cache,
            output_attentions=kwargs.get("output_attentions"),
        )
        validate_attention_fields(
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            feature_map=feature_map,
            num_random_features=num_random_features,
            feature_projection=feature_projection,
            normalize_qk=normalize_qk,
            feature_redraw_interval=feature_redraw_interval,
            rpe=rpe,
            max_relative_position=max_relative_position,
            attn_backend=attn_backend,
        )
        if rpe not in ("none", "learned"):
            raise ValueError(f"rpe must be 'none' or 'learned' for a causal LM, got {rpe!r}")
        if position_embedding_type == "rotary":
            if rpe != "none":
                raise ValueError("position_embedding_type='rotary' cannot be combined with rpe='learned'; pick one")
            m = feature_size(feature_map, num_random_features, hidden_size // num_attention_heads)
            if m % 2:
                raise ValueError(f"position_embedding_type='rotary' needs an even feature size, got {m}")
        if not isinstance(rotary_base, (int, float)) or rotary_base <= 1:
            raise ValueError(f"rotary_base must be a number > 1, got {rotary_base!r}")
        for name, value in (("embd_pdrop", embd_pdrop), ("resid_pdrop", resid_pdrop), ("attn_pdrop", attn_pdrop)):
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding_type = position_embedding_type
        self.rotary_base = float(rotary_base)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.embd_pdrop = embd_pdrop
        self.resid_pdrop = resid_pdrop
        self.attn_pdrop = attn_pdrop
        self.attention_bias = attention_bias
        self.attention_eps = attention_eps
        self.feature_map = feature_map
        self.num_random_features = num_random_features
        self.feature_projection = feature_projection
        self.normalize_qk = normalize_qk
        self.feature_redraw_interval = feature_redraw_interval
        self.feature_seed = feature_seed
        self.rpe = rpe
        self.max_relative_position = max_relative_position
        self.attn_backend = attn_backend
        self.use_cache = use_cache
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        kwargs.setdefault(
            "auto_map",
            {
                "AutoConfig": "configuration_linear_gpt.LinearGPTConfig",
                "AutoModel": "modeling_linear_gpt.LinearGPTModel",
                "AutoModelForCausalLM": "modeling_linear_gpt.LinearGPTForCausalLM",
            },
        )
        super().__init__(**kwargs)
