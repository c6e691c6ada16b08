"""Convert a softmax checkpoint (BERT, RoBERTa, GPT-2, Llama or ViT; a folder or a Hub model id) into a kernelized model.

BERT and RoBERTa become NPRF-BERT (:func:`convert_to_nprf_bert`, in ``bert.py``), GPT-2 and Llama
Linear GPT (:func:`convert_to_linear_gpt`; ``gpt2.py``, ``llama.py``), ViT the relative-performer
ViT (:func:`convert_to_relative_performer_vit`, in ``vit.py``), through one mechanism
(``common.py``: reading the source, then ``finish_conversion``: exact copies, a report, a
Hub-ready save). Each family's module says what it copies and what is new.

What is read: ``config.json`` and the weights, from safetensors only: a sharded set through its
``model.safetensors.index.json`` (another ``*.safetensors`` file beside it is ignored, with a
warning), else ``model.safetensors``. Pickled weights (``pytorch_model*.bin``) are refused
unless ``allow_pickle=True`` (command line: ``--allow-pickle``) is given, with the warning model
loading gives for them: unpickling a file can run code from it. A source that lacks a tensor the
conversion copies, or whose ``config.json`` counts more or fewer layers than its weights hold, is
refused with the missing tensors named; nothing that was not in the source is ever reported as
copied.

What to expect (NPRF-BERT): the converted model computes ``exp(q_hat . k_hat)`` (normalised q, k) through
random features instead of ``softmax(q . k / sqrt(d))``, so *before* any training its outputs
differ from the source model's and task accuracy drops (often to near the majority class for
a fine-tuned classifier). The copied weights are a much better start than random: after MLM
adaptation and/or fine-tuning, Luo et al. (2021) report NPRF-BERT within about one point of
softmax BERT on GLUE. See ``docs/architecture.md`` (NPRF-BERT).

The source is a local directory or, as with ``from_pretrained``, a model id on the Hugging Face
Hub (downloaded into the usual Hub cache; offline, a copy already cached is used).

Python::

    from hf_kernattn.convert import convert_to_nprf_bert
    model = convert_to_nprf_bert("google-bert/bert-base-uncased", "path/to/nprf-bert")

CLI::

    hf-kernattn convert google-bert/bert-base-uncased path/to/nprf-bert [--head auto] [--num-random-features 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from .bert import HEADS, convert_to_nprf_bert
from .common import (
    CONVERTED_FEATURE_MAP,
    CONVERTED_NUM_RANDOM_FEATURES,
    SUPPORTED_MODEL_TYPES,
    check_output_dir,
    read_config,
    resolve_checkpoint,
)
from .gpt2 import convert_gpt2
from .llama import convert_llama
from .vit import convert_to_relative_performer_vit

__all__ = [
    "CONVERTED_FEATURE_MAP", "CONVERTED_NUM_RANDOM_FEATURES", "HEADS", "SUPPORTED_MODEL_TYPES", "add_arguments",
    "convert", "convert_to_linear_gpt", "convert_to_nprf_bert", "convert_to_relative_performer_vit", "run",
]


def convert_to_linear_gpt(
    checkpoint_dir: str | Path,
    output_dir: Optional[str | Path] = None,
    *,
    revision: Optional[str] = None,
    base_model: Optional[str] = None,
    allow_pickle: bool = False,
    overwrite_output_dir: bool = False,
    **attention_overrides: Any,
):
    """Build a Linear GPT from a GPT-2 or Llama checkpoint (a directory or a Hub model id).

    GPT-2, copied exactly: token and position embeddings, every block's LayerNorms, the query,
    key and value projections (GPT-2's fused ``c_attn`` Conv1D split in three and transposed
    into ``nn.Linear`` layout), the output projection, the MLP and the final LayerNorm; the LM
    head is tied to the embeddings as in GPT-2.

    Llama (``LlamaForCausalLM``), copied exactly: token embeddings, every block's RMSNorms, the
    query/key/value/output projections (grouped-query attention kept: ``num_key_value_heads``),
    the gated MLP, the final RMSNorm and the LM head (tied or not, as the source). Llama's rotary
    position embedding becomes ``position_embedding_type="rope"`` with its ``rope_theta``: the
    same rotations of queries and keys, applied before the feature map. Supported: the default
    rotary scaling only, ``head_dim = hidden_size / num_attention_heads``.

    New in both: the random features (drawn from ``feature_seed``). The default feature map is
    ``prf``, positive random features estimating the source's own kernel
    ``exp(q . k / sqrt(d))`` (after Llama's rotations), so the converted model starts close to
    the original (closer with more features, ``num_random_features``) and decodes with a
    constant-size state.

    Args and returns as :func:`convert_to_nprf_bert` (``attention_overrides``: Linear GPT config
    fields). ``ValueError`` for variants it cannot reproduce (GPT-2: unscaled or layer-scaled
    attention, cross-attention; Llama: rotary scaling, partial rotary, a head size of its own).
    """
    from ..modeling.configuration_linear_gpt import LinearGPTConfig

    src = resolve_checkpoint(checkpoint_dir, revision, allow_pickle)
    if output_dir is not None:
        check_output_dir(output_dir, src, overwrite=overwrite_output_dir)
    cfg = read_config(src, ("gpt2", "llama"))
    unknown = set(attention_overrides) - set(LinearGPTConfig().to_dict())
    if unknown:
        raise ValueError(f"unknown Linear GPT config fields in overrides: {sorted(unknown)}")
    convert_one = convert_llama if cfg["model_type"] == "llama" else convert_gpt2
    return convert_one(src, cfg, output_dir, base_model or checkpoint_dir, attention_overrides, allow_pickle)


def convert(checkpoint_dir: str | Path, output_dir: Optional[str | Path] = None, **kwargs):
    """Convert a softmax checkpoint into the family that fits it: BERT and RoBERTa into NPRF-BERT
    (:func:`convert_to_nprf_bert`), GPT-2 and Llama into Linear GPT (:func:`convert_to_linear_gpt`), ViT into
    the relative-performer ViT (:func:`convert_to_relative_performer_vit`)."""
    src = resolve_checkpoint(checkpoint_dir, kwargs.get("revision"), bool(kwargs.get("allow_pickle", False)))
    model_type = read_config(src, SUPPORTED_MODEL_TYPES)["model_type"]
    kwargs.pop("revision", None)  # resolved above: the converters get the local folder
    if model_type == "vit":
        kwargs.pop("head", None)
        return convert_to_relative_performer_vit(src, output_dir, base_model=str(checkpoint_dir), **kwargs)
    if model_type in ("gpt2", "llama"):
        kwargs.pop("head", None)
        return convert_to_linear_gpt(src, output_dir, base_model=str(checkpoint_dir), **kwargs)
    return convert_to_nprf_bert(src, output_dir, base_model=str(checkpoint_dir), **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..modeling.configuration_nprf_bert import ATTENTION_SCHEMA as NPRF_BERT_SCHEMA
    from ..modeling.feature_maps import FEATURE_MAPS

    nprf_features, nprf_map = NPRF_BERT_SCHEMA.default("num_random_features"), NPRF_BERT_SCHEMA.default("feature_map")
    map_default = (f"{nprf_map}" if nprf_map == CONVERTED_FEATURE_MAP
                   else f"{nprf_map} for BERT and RoBERTa, {CONVERTED_FEATURE_MAP} for GPT-2, Llama and ViT")
    parser.add_argument("checkpoint_dir", help="a BERT, RoBERTa, GPT-2, Llama or ViT checkpoint: a directory written by "
                                               "save_pretrained, or a Hub model id")
    parser.add_argument("output_dir", help="where to save the converted checkpoint, with the source's tokenizer or "
                                           "image-processor files")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a Hub model id")
    parser.add_argument("--head", choices=HEADS, default="auto",
                        help="the head a BERT or RoBERTa source is converted with (default: auto, the one its "
                             "config's architectures name); other sources keep their own")
    parser.add_argument("--num-random-features", type=int, default=None,
                        help=f"random features per attention head (default: {nprf_features} for BERT and RoBERTa, "
                             f"{CONVERTED_NUM_RANDOM_FEATURES} for GPT-2, Llama and ViT)")
    parser.add_argument("--max-relative-position", type=int, default=None,
                        help="BERT and RoBERTa: relative offsets beyond this share one position bias (default: the "
                             "source's number of positions)")
    parser.add_argument("--feature-map", default=None, choices=FEATURE_MAPS,
                        help=f"the feature map of the converted attention (default: {map_default})")
    parser.add_argument("--attn-backend", default=None,
                        help="auto (the default) or a registered backend name (hf-kernattn backends lists them)")
    parser.add_argument("--softmax-window", type=int, default=None,
                        help="W: exact softmax over a sliding window of W keys, kernelized attention beyond (the "
                             "sliding-window hybrid; GPT-2, Llama, BERT and RoBERTa; default: off)")
    parser.add_argument("--num-labels", type=int, default=None, help="the number of labels of a new classification head")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read pickled weights (pytorch_model*.bin) of a source that has no safetensors ones; "
                             "unpickling a file can run code from it, so only for sources you trust (default: refused)")
    parser.add_argument("--overwrite_output_dir", "--overwrite-output-dir", dest="overwrite_output_dir",
                        action="store_true",
                        help="write into an output_dir that already holds files (the result's files replace those of "
                             "the same names; default: refused). The source folder itself is never written to")


def run(args: argparse.Namespace) -> int:
    """``hf-kernattn convert``: convert and print what was copied and what was initialised."""
    overrides = {
        k: v
        for k, v in (
            ("num_random_features", args.num_random_features),
            ("max_relative_position", args.max_relative_position),
            ("feature_map", args.feature_map),
            ("attn_backend", args.attn_backend),
            ("softmax_window", args.softmax_window),
            ("num_labels", args.num_labels),
        )
        if v is not None
    }
    model = convert(args.checkpoint_dir, args.output_dir, head=args.head, revision=args.revision,
                    allow_pickle=args.allow_pickle, overwrite_output_dir=args.overwrite_output_dir, **overrides)
    rep = model.conversion_report
    print(f"converted {rep['source_model_type']} -> {type(model).__name__} (head={rep['head']})")
    print(f"copied {len(rep['copied'])} tensors; left at initialisation: {rep['initialised']}")
    if rep["unused_source_keys"]:
        print(f"source tensors not used: {rep['unused_source_keys']}")
    print(f"saved to {args.output_dir}")
    return 0
