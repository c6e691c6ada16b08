"""Model cards of hf-kernattn checkpoints, rendered through ``huggingface_hub``.

:func:`render_model_card` fills the family's template (``hf_kernattn/model_cards/<model_type>.md``)
and puts the metadata in the card's YAML header through :class:`huggingface_hub.ModelCardData`:
``library_name``, license, tags, datasets, the base model when converted from one, and a
``model-index`` block holding exactly the evaluation results passed in (task, dataset, split,
metric, value), so the Hub shows them. The body states the attention settings (feature map,
features, position option, K, backend) read from the config, the training facts given, how to
load the checkpoint with ``trust_remote_code=True``, intended use and limitations.
:func:`save_model_card` writes it as ``README.md`` beside the weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from huggingface_hub import EvalResult, ModelCard, ModelCardData

TEMPLATES = Path(__file__).resolve().parent / "model_cards"
PIPELINE_TAGS = {
    "nprf_bert": "fill-mask",
    "linear_gpt": "text-generation",
    "relative_performer_vit": "image-classification",
}
AUTO_CLASSES = {
    "nprf_bert": "AutoModelForMaskedLM",
    "linear_gpt": "AutoModelForCausalLM",
    "relative_performer_vit": "AutoModelForImageClassification",
}
ATTENTION_FIELDS = (
    ("feature map", "feature_map"), ("random features per head", "num_random_features"),
    ("learned features per head", "num_learned_features"),
    ("l2-normalised q/k", "normalize_qk"), ("relative positions", "rpe"),
    ("clipping distance K", "max_relative_position"), ("attention backend", "attn_backend"),
)


def _table(rows: Iterable[tuple[str, Any]]) -> str:
    lines = ["| | |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def render_model_card(
    model_or_config,
    *,
    results: Sequence[dict[str, Any]] = (),
    datasets: Optional[Sequence[str]] = None,
    base_model: Optional[str] = None,
    license: str = "apache-2.0",
    tags: Sequence[str] = (),
    training: Optional[dict[str, Any]] = None,
    model_name: Optional[str] = None,
    repo_id: Optional[str] = None,
) -> ModelCard:
    """The model card of a checkpoint of one of our families.

    Args:
        model_or_config: the model (or its config); its ``model_type`` picks the template.
        results: evaluation results, each ``{"task", "dataset", "metric", "value"}`` plus
            optional ``"split"``, ``"dataset_config"``, ``"metric_name"``; they form the
            ``model-index`` and the card's results table.
        datasets: Hub ids of the training data (the ``datasets`` field), if any.
        base_model: the checkpoint this one was converted from, if any.
        training: facts about the run for the card (e.g. ``{"optimizer steps": 1000}``).
        model_name, repo_id: the name in the card and the id in its loading snippet.
    Raises ``ValueError`` for a model type without a template or a result missing a key.
    """
    config = getattr(model_or_config, "config", model_or_config)
    family = getattr(config, "model_type", None)
    template = TEMPLATES / f"{family}.md"
    if family not in PIPELINE_TAGS or not template.is_file():
        raise ValueError(f"no model card template for model_type {family!r}; families: {sorted(PIPELINE_TAGS)}")
    name = model_name or (repo_id.split("/")[-1] if repo_id else family)
    eval_results = []
    for r in results:
        missing = [k for k in ("task", "dataset", "metric", "value") if k not in r]
        if missing:
            raise ValueError(f"each result needs task, dataset, metric and value; {r!r} lacks {missing}")
        eval_results.append(EvalResult(
            task_type=r["task"], dataset_type=r["dataset"], dataset_name=r["dataset"],
            dataset_config=r.get("dataset_config"), dataset_split=r.get("split"),
            metric_type=r["metric"], metric_name=r.get("metric_name", r["metric"]), metric_value=r["value"],
        ))
    data = ModelCardData(
        model_name=name, license=license, library_name="transformers", pipeline_tag=PIPELINE_TAGS[family],
        tags=["kernelized-attention", "linear-attention", family, "custom_code", *tags],
        datasets=list(datasets) if datasets else None, base_model=base_model,
        eval_results=eval_results or None,
    )
    skip = set()
    if getattr(config, "feature_map", None) not in ("prf", "trf"):
        skip.add("num_random_features")  # deterministic and learned maps: no random features
    if getattr(config, "feature_map", None) not in ("hedgehog", "hedgehog_exp"):
        skip.add("num_learned_features")
    if getattr(config, "rpe", "none") in ("none", "absolute"):
        skip.add("max_relative_position")
    settings = [(label, f"`{getattr(config, field)}`") for label, field in ATTENTION_FIELDS
                if hasattr(config, field) and field not in skip]
    shape = [(label, getattr(config, field)) for label, field in (
        ("hidden size", "hidden_size"), ("layers", "num_hidden_layers"), ("attention heads", "num_attention_heads"),
    ) if hasattr(config, field)]
    if hasattr(config, "image_size"):
        shape.append(("image size / patch size", f"{config.image_size} / {config.patch_size}"))
    result_rows = [(f"{r['metric']} ({r['dataset']}{', ' + r['split'] if r.get('split') else ''})",
                    f"{r['value']:.4g}" if isinstance(r["value"], float) else r["value"]) for r in results]
    body = template.read_text(encoding="utf-8").format(
        model_name=name,
        repo_id=repo_id or f"your-name/{name}",
        auto_class=AUTO_CLASSES[family],
        architecture=_table(shape + settings),
        results=_table(result_rows) if result_rows else "No evaluation results were recorded for this checkpoint.",
        training=_table(sorted((training or {}).items())) if training else "Not recorded.",
        base_model=f"Converted from `{base_model}`." if base_model else "Trained from scratch.",
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def save_model_card(model_or_config, output_dir: str | os.PathLike, **kwargs) -> Path:
    """Render the card (:func:`render_model_card`) into ``output_dir/README.md``; returns the path."""
    path = Path(output_dir) / "README.md"
    render_model_card(model_or_config, **kwargs).save(path)
    return path
