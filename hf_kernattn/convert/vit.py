"""ViT checkpoints into the relative-performer ViT (:func:`convert_to_relative_performer_vit`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from .common import (
    CONVERTED_FEATURE_MAP,
    CONVERTED_NUM_RANDOM_FEATURES,
    check_layer_count,
    check_output_dir,
    finish_conversion,
    load_source,
    read_config,
    read_state_dict,
    resolve_checkpoint,
)

# ViT config fields copied into RelativePerformerViTConfig (same names)
_VIT_FIELDS = (
    "image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
    "layer_norm_eps", "id2label", "label2id", "problem_type",
)


def convert_to_relative_performer_vit(
    checkpoint_dir: str | Path,
    output_dir: Optional[str | Path] = None,
    *,
    revision: Optional[str] = None,
    base_model: Optional[str] = None,
    allow_pickle: bool = False,
    overwrite_output_dir: bool = False,
    **attention_overrides: Any,
):
    """Build a relative-performer ViT from a ViT checkpoint (``ViTModel`` or
    ``ViTForImageClassification``; a directory or a Hub model id).

    Copied exactly: the patch embedding, the position table (the class token's row is added to
    the class token, as ViT adds it), every layer's LayerNorms, q/k/v/output projections and MLP,
    the final LayerNorm and the classifier. The converted model uses ``rpe="absolute"`` and
    ``pooling="cls"`` (what ViT computes); new are the random features (default ``prf``, 256 per
    head, estimating ViT's ``exp(q . k / sqrt(d))``). Switch to a relative position option by
    fine-tuning from it. Args and returns as :func:`convert_to_nprf_bert`.
    """
    from transformers import ViTConfig, ViTForImageClassification, ViTModel

    from ..modeling.configuration_relative_performer_vit import RelativePerformerViTConfig
    from ..modeling.modeling_relative_performer_vit import (
        RelativePerformerViTForImageClassification,
        RelativePerformerViTModel,
    )

    src = resolve_checkpoint(checkpoint_dir, revision, allow_pickle)
    if output_dir is not None:
        check_output_dir(output_dir, src, overwrite=overwrite_output_dir)
    cfg = read_config(src, ("vit",))
    if not cfg.get("qkv_bias", True):
        raise ValueError("cannot convert a ViT with qkv_bias=False; supported: qkv_bias=True")
    classifier = "ForImageClassification" in " ".join(cfg.get("architectures") or [])
    raw = read_state_dict(src, allow_pickle)
    check_layer_count(raw, int(cfg.get("num_hidden_layers", 12)), "num_hidden_layers")
    # through transformers' own loading: checkpoints of every ViT key layout arrive in one; what
    # it had to initialise is not in ``state``, so it is refused (or reported initialised), never copied
    state, unused = load_source(ViTForImageClassification if classifier else ViTModel, ViTConfig.from_dict(dict(cfg)), raw, src)
    del raw
    fields = {k: cfg[k] for k in _VIT_FIELDS if k in cfg}
    if "id2label" in fields:
        fields["id2label"] = {int(k): v for k, v in fields["id2label"].items()}
    fields.update(rpe="absolute", pooling="cls", feature_map=CONVERTED_FEATURE_MAP, num_random_features=CONVERTED_NUM_RANDOM_FEATURES,
                  normalize_qk=False)
    unknown = set(attention_overrides) - set(RelativePerformerViTConfig().to_dict()) - {"num_labels"}
    if unknown:
        raise ValueError(f"unknown relative-performer ViT config fields in overrides: {sorted(unknown)}")
    fields.update(attention_overrides)
    config = RelativePerformerViTConfig(**fields)
    model = (RelativePerformerViTForImageClassification if classifier else RelativePerformerViTModel)(config).eval()
    s = "vit." if classifier else ""
    if f"{s}embeddings.cls_token" in state and f"{s}embeddings.position_embeddings" in state:
        state[f"{s}embeddings.cls_token+position"] = state.pop(f"{s}embeddings.cls_token") + state[f"{s}embeddings.position_embeddings"][:, :1]
    cls_source = f"{s}embeddings.cls_token" + ("+position" if f"{s}embeddings.cls_token+position" in state else "")
    pairs = {
        f"{s}embeddings.cls_token": cls_source,
        f"{s}embeddings.position_embeddings": f"{s}embeddings.position_embeddings",
        f"{s}layernorm.weight": f"{s}layernorm.weight", f"{s}layernorm.bias": f"{s}layernorm.bias",
    }
    for part in ("weight", "bias"):
        pairs[f"{s}embeddings.patch_embeddings.{part}"] = f"{s}embeddings.patch_embeddings.projection.{part}"
        for i in range(config.num_hidden_layers):
            d = f"{s}layers.{i}"
            for name in ("layernorm_before", "layernorm_after", "attention.q_proj", "attention.k_proj",
                         "attention.v_proj", "attention.o_proj"):
                pairs[f"{d}.{name}.{part}"] = f"{d}.{name}.{part}"
            pairs[f"{d}.intermediate.{part}"] = f"{d}.mlp.fc1.{part}"
            pairs[f"{d}.output.{part}"] = f"{d}.mlp.fc2.{part}"
        if classifier:
            pairs[f"classifier.{part}"] = f"classifier.{part}"

    def transform(dst: str, value: torch.Tensor) -> torch.Tensor:
        return value[:, 1:] if dst.endswith("position_embeddings") else value  # the patches' rows

    return finish_conversion(
        model, state, pairs, src, base_model or checkpoint_dir, output_dir, "vit",
        "image_classification" if classifier else "base", cfg, transform=transform,
        required=lambda dst: not dst.startswith("classifier."), zero=lambda name: False, tied=None, unused=unused,
    )
