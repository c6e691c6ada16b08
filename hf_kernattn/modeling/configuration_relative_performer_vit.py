"""Configuration of the relative-performer ViT: a Vision Transformer with kernelized (Performer)
attention and relative positions on the patch grid (Horn et al. 2021; Luo et al. 2021, Sec. 4.4).
The image fields keep ``transformers.ViTConfig``'s names.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .attention_config import (AttentionSchema, ConfigField, activation, boolean, choice, finite_above,
                               finite_at_least, int_at_least, optional, probability)

# The Auto classes: config.json's ``auto_map`` (remote code) and the in-process registration.
AUTO_MAP = {
    "AutoConfig": "configuration_relative_performer_vit.RelativePerformerViTConfig",
    "AutoModel": "modeling_relative_performer_vit.RelativePerformerViTModel",
    "AutoModelForImageClassification": "modeling_relative_performer_vit.RelativePerformerViTForImageClassification",
}

# ``rpe``: the position options, named for what is learned (see the config's docstring).
POSITION_OPTIONS = ("learned_2d", "rotary_features", "manhattan", "absolute", "none")
# Their earlier names, accepted for good (checkpoints hold them) and stored as the current name.
POSITION_OPTION_ALIASES = {"fft_2d": "learned_2d", "clipped": "manhattan"}
POOLING = ("mean", "cls")

ATTENTION_SCHEMA = AttentionSchema(
    "relative-performer ViT",
    fields=(
        "Image and encoder fields (names and defaults as ``transformers.ViTConfig``)",
        ConfigField("image_size", 224,
                    "side of the square images the model is built for (an ``\"absolute\"`` table has one entry "
                    "per patch of it; relative options take any multiple of the patch size); a multiple of "
                    "``patch_size``.", int_at_least(1)),
        ConfigField("patch_size", 16, "side of the square patches.", int_at_least(1)),
        ConfigField("num_channels", 3, "input channels.", int_at_least(1)),
        ConfigField("hidden_size", 768, "width C.", int_at_least(1)),
        ConfigField("num_hidden_layers", 12, "encoder layers.", int_at_least(1)),
        ConfigField("num_attention_heads", 12, "heads H; ``hidden_size`` must be a multiple of it.", int_at_least(1)),
        ConfigField("intermediate_size", 3072, "width of the MLP.", int_at_least(1)),
        ConfigField("hidden_act", "gelu", "MLP activation (a key of ``transformers.activations.ACT2FN``).",
                    activation),
        ConfigField("hidden_dropout_prob", 0.0, "dropout on embeddings and every residual branch.", probability),
        ConfigField("attention_probs_dropout_prob", 0.0,
                    "kept for ViT configs; unused: kernelized attention forms no attention probabilities.",
                    probability),
        ConfigField("initializer_range", 0.02, "std of the (truncated) normal initialisation.", finite_at_least(0)),
        ConfigField("layer_norm_eps", 1e-12, "epsilon of the layer norms.", finite_above(0)),
        "The family's own fields",
        ConfigField("pooling", "mean",
                    "``\"mean\"`` over the patch tokens (translation-invariant) or ``\"cls\"`` (a learned class "
                    "token; with a grid bias it sits on an extra row above the grid's first column, so it sees "
                    "positions relative to that corner).", choice(POOLING)),
        ConfigField("position_scales", 8, "length scales per axis of ``rpe=\"rotary_features\"`` (4 features each).",
                    int_at_least(1)),
        ConfigField("relative_heads", None,
                    "heads with the Manhattan-distance bias of ``rpe=\"manhattan\"``, at most "
                    "``num_attention_heads`` (None: half of them; the others are content-only).",
                    optional(int_at_least(1))),
        ConfigField("rpe_shared_across_layers", False, "one position table for the whole model, or one per layer.",
                    boolean),
        ConfigField("rpe_init_std", 0.0, "std of the normal initialisation of the bias tables (0: start at zero).",
                    finite_at_least(0), float),
    ),
    choices={"rpe": POSITION_OPTIONS},
    aliases={"rpe": POSITION_OPTION_ALIASES},
    feature_map=("prf", "Performer's positive random features"),
    rpe=("learned_2d", "a learnable 2D relative bias, Luo et al. 2021"),
    max_relative_position=(16, "a patch grid: offsets beyond 16 patches share one bias"),
)


def check_combinations(values: dict) -> None:
    """Checks across fields: whole patches, heads that exist, no 1D softmax window."""
    image_size, patch_size = values["image_size"], values["patch_size"]
    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    if values["softmax_window"] is not None:
        raise ValueError(f"softmax_window={values['softmax_window']} is not supported by the relative-performer ViT: its "
                         "tokens form a 2D patch grid, where a window of the last W tokens in row-major order has no "
                         "meaning; use softmax_window=None")
    heads, relative_heads = values["num_attention_heads"], values["relative_heads"]
    if relative_heads is not None and relative_heads > heads:
        raise ValueError(f"relative_heads must be None or an int in [1, num_attention_heads={heads}], "
                         f"got {relative_heads!r}")


@ATTENTION_SCHEMA.declare
class RelativePerformerViTConfig(PreTrainedConfig):
    """Configuration of a relative-performer ViT.

    @family-fields@

    ``rpe`` picks the position option: ``"learned_2d"`` (a learnable per-head bias of the 2D
    offset ``(dy, dx)``, clipped at ``max_relative_position`` per axis, applied as a
    Toeplitz-block-Toeplitz matrix by 2D FFT or densely), ``"rotary_features"`` (Horn et al.'s
    strategy 1: sinusoidal position features at learned length scales, rotated on the query side,
    concatenated before the feature map), ``"manhattan"`` (their strategy 2: a learned bias of
    ``min(|dy| + |dx|, max_relative_position)`` on ``relative_heads`` heads, O(N K^2)),
    ``"absolute"`` (a learned table, the ViT baseline) or ``"none"``. The earlier names
    ``"fft_2d"`` and ``"clipped"`` are accepted and stored as ``"learned_2d"`` and ``"manhattan"``.

    @shared-attention-fields@
    """

    model_type = "relative_performer_vit"

    def __init__(self, **kwargs) -> None:
        ATTENTION_SCHEMA.configure(self, kwargs, check_combinations)
        super().__init__(**{"auto_map": dict(AUTO_MAP), **kwargs})


__all__ = ["RelativePerformerViTConfig"]
