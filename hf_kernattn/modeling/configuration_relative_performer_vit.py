"""Configuration of the relative-performer ViT: a Vision Transformer with kernelized (Performer)
attention and relative positions on the patch grid (Horn et al. 2021; Luo et al. 2021, Sec. 4.4).

The image fields keep ``transformers.ViTConfig``'s names; the attention fields are the ones every
hf-kernattn family shares, and ``rpe`` picks the position option.
"""

from __future__ import annotations

from typing import Optional

from transformers import PreTrainedConfig

from .attention_config import AttentionSchema, validate_model_fields

# The one Auto-class table of the family: config.json's ``auto_map`` and the in-process registration.
AUTO_MAP = {
    "AutoConfig": "configuration_relative_performer_vit.RelativePerformerViTConfig",
    "AutoModel": "modeling_relative_performer_vit.RelativePerformerViTModel",
    "AutoModelForImageClassification": "modeling_relative_performer_vit.RelativePerformerViTForImageClassification",
}

POSITION_OPTIONS = ("fft_2d", "rotary_features", "clipped", "absolute", "none")
POOLING = ("mean", "cls")

ATTENTION_SCHEMA = AttentionSchema(
    "relative-performer ViT",
    feature_map=("prf", "Performer's positive random features"),
    rpe=("fft_2d", "a learnable 2D relative bias applied by 2D FFT (Luo et al. 2021)"),
    max_relative_position=(16, "a patch grid: offsets beyond 16 patches share one bias"),
)


class RelativePerformerViTConfig(PreTrainedConfig):
    """Configuration of a relative-performer ViT.

    Image and encoder fields (names and defaults as ``transformers.ViTConfig``):

    Args:
        image_size: side of the square images the model is built for (an ``"absolute"`` table
            has one entry per patch of it; relative options take any multiple of the patch size).
        patch_size: side of the square patches.
        num_channels: input channels.
        hidden_size: width C.
        num_hidden_layers: encoder layers.
        num_attention_heads: heads H; ``hidden_size`` must be a multiple of it.
        intermediate_size: width of the MLP.
        hidden_act: MLP activation (a key of ``transformers.activations.ACT2FN``).
        hidden_dropout_prob: dropout on embeddings and every residual branch.
        attention_probs_dropout_prob: kept for ViT configs; kernelized attention forms no
            attention probabilities, so it is not used.
        initializer_range: std of the (truncated) normal initialisation.
        layer_norm_eps: epsilon of the layer norms.

    The family's own fields:

    Args:
        pooling: ``"mean"`` over the patch tokens (translation-invariant, the default) or
            ``"cls"`` (a learned class token; with a grid bias it sits on an extra row above
            the grid's first column, so it sees positions relative to that corner).
        position_scales: length scales per axis of ``rpe="rotary_features"`` (4 features each).
        relative_heads: heads with the Manhattan-distance bias of ``rpe="clipped"`` (default:
            half of them; the others are content-only).
        rpe_shared_across_layers: one position table for the whole model, or one per layer
            (the default).
        rpe_init_std: std of the normal initialisation of the bias tables (0: start at zero).

    ``rpe`` picks the position option: ``"fft_2d"`` (a learnable per-head 2D relative bias on the
    patch grid, clipped at ``max_relative_position``, applied as a Toeplitz-block-Toeplitz matrix
    by 2D FFT), ``"rotary_features"`` (Horn et al.'s first strategy: sinusoidal position features
    with learned length scales, rotated on the query side, concatenated to the content before the
    feature map), ``"clipped"`` (their second: a learned bias of the Manhattan distance clipped at
    ``max_relative_position``, on ``relative_heads`` heads, in O(N K^2)), ``"absolute"`` (a learned
    position table, the ViT baseline) or ``"none"``.

    @shared-attention-fields@

    ``output_attentions`` is accepted and kept, as by every transformers config, but kernelized
    attention never forms the attention matrix: a model built from a config with
    ``output_attentions=True`` returns no attention weights (and warns once), and
    ``forward(output_attentions=True)`` raises ``ValueError``.
    """

    model_type = "relative_performer_vit"

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        num_channels: int = 3,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.0,
        attention_probs_dropout_prob: float = 0.0,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-12,
        pooling: str = "mean",
        position_scales: int = 8,
        relative_heads: Optional[int] = None,
        rpe_shared_across_layers: bool = False,
        rpe_init_std: float = 0.0,
        **kwargs,
    ) -> None:
        for name, value in (("image_size", image_size), ("patch_size", patch_size), ("num_channels", num_channels),
                            ("num_hidden_layers", num_hidden_layers), ("intermediate_size", intermediate_size),
                            ("position_scales", position_scales)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        for name, value in (("hidden_dropout_prob", hidden_dropout_prob),
                            ("attention_probs_dropout_prob", attention_probs_dropout_prob)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
        if pooling not in POOLING:
            raise ValueError(f"pooling must be one of {list(POOLING)}, got {pooling!r}")
        if relative_heads is not None and (
            not isinstance(relative_heads, int) or isinstance(relative_heads, bool)
            or not 1 <= relative_heads <= num_attention_heads
        ):
            raise ValueError(f"relative_heads must be None or an int in [1, num_attention_heads={num_attention_heads}], "
                             f"got {relative_heads!r}")
        if not isinstance(rpe_shared_across_layers, bool):
            raise ValueError(f"rpe_shared_across_layers must be a bool, got {rpe_shared_across_layers!r}")
        if isinstance(rpe_init_std, bool) or not isinstance(rpe_init_std, (int, float)) or rpe_init_std < 0:
            raise ValueError(f"rpe_init_std must be a number >= 0, got {rpe_init_std!r}")
        validate_model_fields(
            family=ATTENTION_SCHEMA.family, hidden_act=hidden_act, initializer_range=initializer_range,
            layer_norm_eps=("layer_norm_eps", layer_norm_eps), output_attentions=kwargs.get("output_attentions"),
        )
        attention = ATTENTION_SCHEMA.take(kwargs, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        if attention["rpe"] not in POSITION_OPTIONS:
            raise ValueError(f"rpe must be one of {list(POSITION_OPTIONS)} for the relative-performer ViT, "
                             f"got {attention['rpe']!r}")

        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.pooling = pooling
        self.position_scales = position_scales
        self.relative_heads = relative_heads
        self.rpe_shared_across_layers = rpe_shared_across_layers
        self.rpe_init_std = float(rpe_init_std)
        ATTENTION_SCHEMA.apply(self, attention)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)


RelativePerformerViTConfig.__doc__ = ATTENTION_SCHEMA.document(RelativePerformerViTConfig.__doc__)

__all__ = ["RelativePerformerViTConfig"]
