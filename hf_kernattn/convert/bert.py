"""BERT and RoBERTa checkpoints into NPRF-BERT (:func:`convert_to_nprf_bert`).

Copied: word / token-type / absolute-position embeddings and their LayerNorm, the q/k/v/output
projections of every layer, the feed-forward weights, both LayerNorms per layer, the pooler and
whatever head the checkpoint has (MLM, sequence classification, token classification, question
answering). New and left at their initial values: the relative-position bias (zero, so
``exp(b) = 1``: plain kernel attention) and the random feature projections (drawn from
``feature_seed``). RoBERTa's position table is offset by ``padding_idx + 1``; its rows are
shifted so position ``i`` reads RoBERTa's position ``i + padding_idx + 1`` (what RoBERTa uses
for right-padded input).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .common import check_layer_count, check_output_dir, finish_conversion, read_config, read_state_dict, resolve_checkpoint

HEADS = ("auto", "base", "masked_lm", "sequence_classification", "token_classification", "question_answering")
# BERT config fields copied verbatim into NPRFBertConfig.
_COPIED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "type_vocab_size", "initializer_range",
    "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "classifier_dropout", "id2label",
    "label2id", "problem_type",
)


def _check_bert_config(cfg: dict[str, Any]) -> None:
    """What NPRF-BERT cannot reproduce of a BERT/RoBERTa config: a decoder or cross-attention,
    positions other than the absolute table."""
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError("cannot convert a decoder / cross-attention BERT: NPRF-BERT is a bidirectional encoder")
    pet = cfg.get("position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise ValueError(f"cannot convert position_embedding_type={pet!r}; only 'absolute' source positions are supported")


def _infer_head(cfg: dict[str, Any]) -> str:
    arch = " ".join(cfg.get("architectures") or [])
    for key, head in (
        ("ForSequenceClassification", "sequence_classification"),
        ("ForTokenClassification", "token_classification"),
        ("ForQuestionAnswering", "question_answering"),
        ("ForMaskedLM", "masked_lm"),
        ("ForPreTraining", "masked_lm"),
    ):
        if key in arch:
            return head
    return "base"


def _key_map(model_type: str, num_layers: int, head: str, src_prefix: str, dst_prefix: str) -> dict[str, str]:
    """Target key -> source key for every copied tensor (weights and biases)."""
    s, d = src_prefix, dst_prefix
    pairs: dict[str, str] = {}

    def lin(dst: str, src: str) -> None:
        pairs[f"{dst}.weight"] = f"{src}.weight"
        pairs[f"{dst}.bias"] = f"{src}.bias"

    pairs[f"{d}embeddings.word_embeddings.weight"] = f"{s}embeddings.word_embeddings.weight"
    pairs[f"{d}embeddings.token_type_embeddings.weight"] = f"{s}embeddings.token_type_embeddings.weight"
    pairs[f"{d}embeddings.position_embeddings.weight"] = f"{s}embeddings.position_embeddings.weight"
    lin(f"{d}embeddings.LayerNorm", f"{s}embeddings.LayerNorm")
    for i in range(num_layers):
        src_l, dst_l = f"{s}encoder.layer.{i}", f"{d}layers.{i}"
        lin(f"{dst_l}.attention.q_proj", f"{src_l}.attention.self.query")
        lin(f"{dst_l}.attention.k_proj", f"{src_l}.attention.self.key")
        lin(f"{dst_l}.attention.v_proj", f"{src_l}.attention.self.value")
        lin(f"{dst_l}.attention.o_proj", f"{src_l}.attention.output.dense")
        lin(f"{dst_l}.attention_norm", f"{src_l}.attention.output.LayerNorm")
        lin(f"{dst_l}.intermediate", f"{src_l}.intermediate.dense")
        lin(f"{dst_l}.output", f"{src_l}.output.dense")
        lin(f"{dst_l}.output_norm", f"{src_l}.output.LayerNorm")
    if head in ("base", "sequence_classification") and model_type == "bert":
        lin(f"{d}pooler.dense", f"{s}pooler.dense")
    if head == "masked_lm":
        if model_type == "bert":
            lin("lm_head.dense", "cls.predictions.transform.dense")
            lin("lm_head.LayerNorm", "cls.predictions.transform.LayerNorm")
            pairs["lm_head.decoder.weight"] = "cls.predictions.decoder.weight"
            pairs["lm_head.decoder.bias"] = "cls.predictions.bias"
        else:
            lin("lm_head.dense", "lm_head.dense")
            lin("lm_head.LayerNorm", "lm_head.layer_norm")
            pairs["lm_head.decoder.weight"] = "lm_head.decoder.weight"
            pairs["lm_head.decoder.bias"] = "lm_head.bias"
    elif head == "sequence_classification":
        if model_type == "bert":
            lin("classifier", "classifier")
        else:  # RoBERTa's head is dense + tanh + out_proj: the same as pooler + classifier
            lin(f"{d}pooler.dense", "classifier.dense")
            lin("classifier", "classifier.out_proj")
    elif head == "token_classification":
        lin("classifier", "classifier")
    elif head == "question_answering":
        lin("qa_outputs", "qa_outputs")
    return pairs


def convert_to_nprf_bert(
    checkpoint_dir: str | Path,
    output_dir: Optional[str | Path] = None,
    *,
    head: str = "auto",
    revision: Optional[str] = None,
    base_model: Optional[str] = None,
    allow_pickle: bool = False,
    overwrite_output_dir: bool = False,
    **attention_overrides: Any,
):
    """Build an NPRF-BERT model from a BERT or RoBERTa checkpoint.

    Args:
        checkpoint_dir: a directory written by ``save_pretrained`` of a BERT/RoBERTa model
            (``config.json`` + safetensors or ``pytorch_model.bin``), or a model id on the
            Hugging Face Hub (``"google-bert/bert-base-uncased"``), fetched as ``from_pretrained``
            does (Hub cache, token and offline settings of ``huggingface_hub``).
        output_dir: if given, the converted model is saved there (Hub-ready, with its code for
            ``trust_remote_code``) together with the source tokenizer files. Never the source
            folder, inside it or holding it; an existing folder must be empty unless
            ``overwrite_output_dir``.
        head: ``"auto"`` (from the checkpoint's ``architectures``), ``"base"``, ``"masked_lm"``,
            ``"sequence_classification"``, ``"token_classification"`` or ``"question_answering"``.
        revision: branch, tag or commit of a Hub model id (ignored for a local directory).
        base_model: the name the model card gives the source (default: ``checkpoint_dir``).
        allow_pickle: read pickled weights (``pytorch_model*.bin``) of a source that has no
            safetensors ones, with a warning (unpickling a file can run code from it: only for
            sources you trust). By default they are refused.
        overwrite_output_dir: write into an ``output_dir`` that already holds files (the
            result's files replace those of the same names).
        **attention_overrides: NPRF-BERT config fields to set (``num_random_features``,
            ``max_relative_position``, ``feature_map``, ``attn_backend``, ``num_labels``, ...).
            Head weights the source lacks (e.g. a classifier when converting a pre-trained
            MLM checkpoint) stay at their initialisation, as with ``from_pretrained``.
    Returns:
        The NPRF-BERT model (``eval()`` mode); ``model.conversion_report`` lists the copied
        keys, the target keys left at initialisation and the unused source keys.
    Raises:
        ValueError: unknown architecture; missing or damaged files; a malformed ``config.json``;
            missing tensors or a layer count the weights do not hold (named); pickled weights
            without ``allow_pickle``.
        OSError: a Hub model id that cannot be fetched (unknown, gated, or offline and not cached).
    """
    from ..modeling.configuration_nprf_bert import NPRFBertConfig
    from ..modeling.modeling_nprf_bert import (
        NPRFBertForMaskedLM,
        NPRFBertForQuestionAnswering,
        NPRFBertForSequenceClassification,
        NPRFBertForTokenClassification,
        NPRFBertModel,
    )

    if head not in HEADS:
        raise ValueError(f"head must be one of {list(HEADS)}, got {head!r}")
    src = resolve_checkpoint(checkpoint_dir, revision, allow_pickle)
    if output_dir is not None:
        check_output_dir(output_dir, src, overwrite=overwrite_output_dir)
    cfg = read_config(src)
    _check_bert_config(cfg)
    model_type = cfg["model_type"]
    state = read_state_dict(src, allow_pickle)
    check_layer_count(state, int(cfg.get("num_hidden_layers", 12)), "num_hidden_layers")
    if head == "auto":
        head = _infer_head(cfg)

    fields = {k: cfg[k] for k in _COPIED_FIELDS if k in cfg}
    if "id2label" in fields:
        fields["id2label"] = {int(k): v for k, v in fields["id2label"].items()}
    max_pos = int(cfg.get("max_position_embeddings", 512))
    pad = cfg.get("pad_token_id", 0)
    offset = (int(pad) + 1) if model_type == "roberta" else 0
    fields["max_position_embeddings"] = max_pos - offset
    fields.setdefault("max_relative_position", fields["max_position_embeddings"])
    unknown = set(attention_overrides) - set(NPRFBertConfig().to_dict()) - {"num_labels", "problem_type"}
    if unknown:
        raise ValueError(f"unknown NPRF-BERT config fields in overrides: {sorted(unknown)}")
    if "num_labels" in attention_overrides:
        fields.pop("id2label", None)
        fields.pop("label2id", None)
    if attention_overrides.get("softmax_window") is not None and "rpe" not in attention_overrides:
        fields["rpe"] = "none"  # the sliding-window hybrid takes no relative-position bias (BERT has none to copy)
    fields.update(attention_overrides)
    fields["position_embedding_type"] = "absolute"
    config = NPRFBertConfig(**fields)
    if head == "question_answering":
        config.num_labels = 2
    cls = {
        "base": NPRFBertModel,
        "masked_lm": NPRFBertForMaskedLM,
        "sequence_classification": NPRFBertForSequenceClassification,
        "token_classification": NPRFBertForTokenClassification,
        "question_answering": NPRFBertForQuestionAnswering,
    }[head]
    model = cls(config)
    model.eval()

    # Source prefix: "bert." / "roberta." for head models, none for a bare BertModel save.
    src_prefix = f"{model_type}." if any(k.startswith(f"{model_type}.") for k in state) else ""
    dst_prefix = "" if head == "base" else "nprf_bert."
    pairs = _key_map(model_type, config.num_hidden_layers, head, src_prefix, dst_prefix)
    return finish_conversion(
        model, state, pairs, src, base_model or checkpoint_dir, output_dir, model_type, head, cfg,
        transform=lambda dst, value: value[offset:] if dst.endswith("position_embeddings.weight") and offset else value,
        required=lambda dst: dst.startswith(dst_prefix + "embeddings.") or dst.startswith(dst_prefix + "layers."),
        zero=lambda name: name.endswith("rpe.weight"),  # exp(0) = 1: start from plain (position-free) kernel attention
        tied="lm_head.decoder.weight",
    )
