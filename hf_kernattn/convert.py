"""Convert a softmax checkpoint (BERT, RoBERTa, GPT-2, Llama or ViT; a folder or a Hub model id) into a kernelized model.

BERT and RoBERTa become NPRF-BERT (below), GPT-2 and Llama Linear GPT (:func:`convert_to_linear_gpt`),
ViT the relative-performer ViT (:func:`convert_to_relative_performer_vit`), through one mechanism
(:func:`_finish_conversion`: exact copies, a report, a Hub-ready save).

What is read: ``config.json`` and the weights, from safetensors only: a sharded set through its
``model.safetensors.index.json`` (another ``*.safetensors`` file beside it is ignored, with a
warning), else ``model.safetensors``. Pickled weights (``pytorch_model*.bin``) are refused
unless ``allow_pickle=True`` (command line: ``--allow-pickle``) is given, with the warning model
loading gives for them: unpickling a file can run code from it. A source that lacks a tensor the
conversion copies, or whose ``config.json`` counts more or fewer layers than its weights hold, is
refused with the missing tensors named; nothing that was not in the source is ever reported as
copied.

Copied: word / token-type / absolute-position embeddings and their LayerNorm, the q/k/v/output
projections of every layer, the feed-forward weights, both LayerNorms per layer, the pooler and
whatever head the checkpoint has (MLM, sequence classification, token classification, question
answering). New and left at their initial values: the relative-position bias (zero, so
``exp(b) = 1``: plain kernel attention) and the random feature projections (drawn from
``feature_seed``). RoBERTa's position table is offset by ``padding_idx + 1``; its rows are
shifted so position ``i`` reads RoBERTa's position ``i + padding_idx + 1`` (what RoBERTa uses
for right-padded input).

What to expect: the converted model computes ``exp(q_hat . k_hat)`` (normalised q, k) through
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
import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.utils import validate_repo_id
from transformers.utils import logging

from .modeling.pretrained import warn_pickle_weights

logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "gpt2", "llama", "vit")
HEADS = ("auto", "base", "masked_lm", "sequence_classification", "token_classification", "question_answering")
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
    "merges.txt", "added_tokens.json", "tokenizer.model", "preprocessor_config.json",
)
# BERT config fields copied verbatim into NPRFBertConfig.
_COPIED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "type_vocab_size", "initializer_range",
    "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "classifier_dropout", "id2label",
    "label2id", "problem_type",
)


# The number of random features per head a converted GPT-2, Llama or ViT gets unless told
# otherwise (NPRF-BERT keeps its config's default); quoted by ``hf-kernattn convert --help``.
CONVERTED_NUM_RANDOM_FEATURES = 256
CONVERTED_FEATURE_MAP = "prf"
_SAFE_INDEX = "model.safetensors.index.json"
_SAFE_SINGLE = "model.safetensors"
_PICKLE_INDEX = "pytorch_model.bin.index.json"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _resolve_checkpoint(checkpoint: str | Path, revision: Optional[str] = None, allow_pickle: bool = False) -> Path:
    """A local checkpoint directory, or the local snapshot of Hub model id ``checkpoint``.

    Only what conversion reads is downloaded: the config, tokenizer files and one weight format
    (safetensors; ``pytorch_model*.bin`` only with ``allow_pickle``)."""
    src = Path(checkpoint)
    if src.is_dir():
        return src
    name = str(checkpoint)
    if src.exists():
        raise ValueError(f"checkpoint_dir {name!r} is not a directory; expected a checkpoint directory "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)}) or Hub model id")
    try:
        validate_repo_id(name)
    except ValueError:
        raise ValueError(
            f"checkpoint_dir {name!r} is neither a local directory nor a Hub model id (like 'google-bert/bert-base-uncased')"
        ) from None
    metadata = ["config.json", *_TOKENIZER_FILES]
    try:
        logger.info(f"fetching {name!r} from the Hugging Face Hub")
        folder = Path(snapshot_download(name, revision=revision, allow_patterns=metadata + ["*.safetensors", "*.safetensors.index.json"]))
        if not any(folder.glob("*.safetensors")):
            if not allow_pickle:
                raise ValueError(
                    f"checkpoint_dir {name!r} (Hugging Face Hub) has no safetensors weights; pickled weights "
                    "(pytorch_model*.bin), if it has them, are downloaded and read only with allow_pickle=True "
                    "(command line: --allow-pickle), as unpickling a file can run code from it: only for sources you trust"
                )
            folder = Path(snapshot_download(name, revision=revision, allow_patterns=metadata + ["pytorch_model*.bin", _PICKLE_INDEX]))
    except OSError as err:  # not found, gated, offline without a cached copy, no connection
        raise OSError(
            f"checkpoint_dir {name!r} is not a local directory and could not be fetched from the Hugging Face Hub: "
            f"{_one_line(err)}"
        ) from err
    return folder


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {_one_line(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object ({{...}}), got a JSON {type(data).__name__}")
    return data


def _read_config(src: Path, supported: tuple[str, ...] = ("bert", "roberta")) -> dict[str, Any]:
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"checkpoint_dir {str(src)!r} has no config.json; expected a checkpoint directory of one of "
                         f"{list(supported)}")
    cfg = _read_json(path, "config")
    model_type = cfg.get("model_type")
    if model_type not in supported:
        raise ValueError(
            f"cannot convert model_type={model_type!r} (architectures={cfg.get('architectures')}) here; "
            f"supported source architectures: {list(supported)} (all conversions: {list(SUPPORTED_MODEL_TYPES)}: "
            "BERT and RoBERTa encoders into NPRF-BERT, GPT-2 and Llama into Linear GPT, ViT into the relative-performer ViT)"
        )
    return cfg


def _check_bert_config(cfg: dict[str, Any]) -> None:
    """What NPRF-BERT cannot reproduce of a BERT/RoBERTa config: a decoder or cross-attention,
    positions other than the absolute table."""
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError("cannot convert a decoder / cross-attention BERT: NPRF-BERT is a bidirectional encoder")
    pet = cfg.get("position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise ValueError(f"cannot convert position_embedding_type={pet!r}; only 'absolute' source positions are supported")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"cannot read weights file {str(path)!r} (damaged or not a safetensors file): {_one_line(err)}") from None


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    import pickle

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise ValueError(f"cannot read weights file {str(path)!r} (damaged, or more than tensors in it): {_one_line(err)}") from None
    if not isinstance(state, dict):
        raise ValueError(f"weights file {str(path)!r} holds a {type(state).__name__}, not a state dict")
    return state


def _read_sharded(src: Path, index: Path, load) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors of every file ``index`` (a ``*.index.json``) lists; also the file names."""
    weight_map = _read_json(index, "weights index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"weights index {str(index)!r} has no weight_map ({{tensor name: file name}})")
    files = sorted(set(weight_map.values()))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (src / name).is_file():
            raise ValueError(f"weights index {str(index)!r} lists {name!r}, which is not in {str(src)!r}")
        state.update(load(src / name))
    absent = sorted(k for k, f in weight_map.items() if k not in state)
    if absent:
        raise ValueError(f"weights index {str(index)!r} lists tensors its files do not hold: {_names(absent)}")
    return state, set(files)


def _read_state_dict(src: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The source's weights: the files ``model.safetensors.index.json`` lists when there is one
    (other safetensors files beside them are ignored, with a warning), else ``model.safetensors``,
    else every ``*.safetensors`` file. Pickled weights (``pytorch_model*.bin``, through their
    index when present) only when there are no safetensors ones and ``allow_pickle`` is set."""
    if (src / _SAFE_INDEX).is_file():
        state, listed = _read_sharded(src, src / _SAFE_INDEX, _load_safetensors)
        ignored = sorted(p.name for p in src.glob("*.safetensors") if p.name not in listed)
        if ignored:
            logger.warning(f"{str(src)!r}: {_SAFE_INDEX} lists the weights to read; ignoring {', '.join(ignored)} beside them")
        return state
    if (src / _SAFE_SINGLE).is_file():
        return _load_safetensors(src / _SAFE_SINGLE)
    files = sorted(src.glob("*.safetensors"))
    if files:
        state, seen = {}, {}
        for f in files:
            for key, value in _load_safetensors(f).items():
                if key in seen:
                    raise ValueError(f"tensor {key!r} is in both {seen[key]!r} and {f.name!r} and no {_SAFE_INDEX} says which to read")
                seen[key], state[key] = f.name, value
        return state
    pickled = [src / _PICKLE_INDEX] if (src / _PICKLE_INDEX).is_file() else sorted(src.glob("pytorch_model*.bin"))
    if pickled:
        if not allow_pickle:
            raise ValueError(
                f"checkpoint_dir {str(src)!r} has only pickled weights ({', '.join(p.name for p in pickled)}): conversion "
                "reads safetensors only, as loading does, since unpickling a file can run code from it. Pass "
                "allow_pickle=True (command line: --allow-pickle) for a source you trust, or save the source again "
                "with save_pretrained (safetensors)"
            )
        warn_pickle_weights("allow_pickle=True")
        if pickled[0].name == _PICKLE_INDEX:
            return _read_sharded(src, pickled[0], _load_pickle)[0]
        state = {}
        for f in pickled:
            state.update(_load_pickle(f))
        return state
    raise ValueError(f"checkpoint_dir {str(src)!r} has no *.safetensors or pytorch_model*.bin weights")


def _names(keys: list[str], shown: int = 8) -> str:
    """``'a', 'b', ... and N more``."""
    head = ", ".join(repr(k) for k in keys[:shown])
    return head + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[list[int]] = []
    for i in indices:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


# a layer's index in a tensor name: BERT/ViT "encoder.layer.3.", Llama "model.layers.3.", GPT-2 "h.3."
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layer|layers|h)\.(\d+)\.")


def _check_layer_count(keys, num_layers: int, field: str) -> None:
    """``ValueError`` unless the weights hold exactly layers ``0 .. num_layers - 1`` (``num_layers``
    from ``config.json``'s ``field``), naming the missing tensors or the extra layers."""
    example: dict[int, tuple[str, re.Match]] = {}
    for key in sorted(keys):
        if (m := _LAYER_INDEX.search(key)) is not None:
            example.setdefault(int(m.group(1)), (key, m))
    found = sorted(example)
    if found == list(range(num_layers)):
        return
    held = f"{len(found)} layer{'s' if len(found) != 1 else ''} ({_spans(found)})" if found else "no layer tensors"
    msg = f"config.json has {field}={num_layers} but the weights hold {held}"
    absent = [i for i in range(num_layers) if i not in example]
    if absent and found:
        key, m = example[found[0]]
        like = key[: m.start(1)] + str(absent[0]) + key[m.end(1):]
        msg += f"; missing: every tensor of layer{'s' if len(absent) > 1 else ''} {_spans(absent)}, e.g. {like!r}"
    extra = [i for i in found if i >= num_layers]
    if extra:
        msg += f"; beyond {field}: layer{'s' if len(extra) > 1 else ''} {_spans(extra)}"
    raise ValueError(msg + ". The config does not describe these weights")


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' own load report and progress bar off: conversion reports what it copied,
    and refuses what is missing, itself."""
    from transformers.utils import logging as hf_logging

    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def _load_source(model_class, config, state: dict[str, torch.Tensor], src: Path):
    """``model_class`` (a transformers model) holding ``state``, read as transformers reads a
    checkpoint (its key renamings included), and the source's state dict without the tensors
    transformers had to initialise (missing from ``state``), plus the keys it did not use."""
    try:
        with _transformers_quiet():
            source, info = model_class.from_pretrained(None, config=config, state_dict=state, output_loading_info=True)
    except RuntimeError as err:  # e.g. a tensor of another shape than config.json implies
        raise ValueError(f"the weights in {str(src)!r} do not fit its config.json: {_one_line(err)}") from None
    missing = set(info.get("missing_keys", ()))
    loaded = {k: v.detach() for k, v in source.state_dict().items() if k not in missing}
    return loaded, sorted(info.get("unexpected_keys", ()))


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
    **attention_overrides: Any,
):
    """Build an NPRF-BERT model from a BERT or RoBERTa checkpoint.

    Args:
        checkpoint_dir: a directory written by ``save_pretrained`` of a BERT/RoBERTa model
            (``config.json`` + safetensors or ``pytorch_model.bin``), or a model id on the
            Hugging Face Hub (``"google-bert/bert-base-uncased"``), fetched as ``from_pretrained``
            does (Hub cache, token and offline settings of ``huggingface_hub``).
        output_dir: if given, the converted model is saved there (Hub-ready, with its code for
            ``trust_remote_code``) together with the source tokenizer files.
        head: ``"auto"`` (from the checkpoint's ``architectures``), ``"base"``, ``"masked_lm"``,
            ``"sequence_classification"``, ``"token_classification"`` or ``"question_answering"``.
        revision: branch, tag or commit of a Hub model id (ignored for a local directory).
        base_model: the name the model card gives the source (default: ``checkpoint_dir``).
        allow_pickle: read pickled weights (``pytorch_model*.bin``) of a source that has no
            safetensors ones, with a warning (unpickling a file can run code from it: only for
            sources you trust). By default they are refused.
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
    from .modeling.configuration_nprf_bert import NPRFBertConfig
    from .modeling.modeling_nprf_bert import (
        NPRFBertForMaskedLM,
        NPRFBertForQuestionAnswering,
        NPRFBertForSequenceClassification,
        NPRFBertForTokenClassification,
        NPRFBertModel,
    )

    if head not in HEADS:
        raise ValueError(f"head must be one of {list(HEADS)}, got {head!r}")
    src = _resolve_checkpoint(checkpoint_dir, revision, allow_pickle)
    cfg = _read_config(src)
    _check_bert_config(cfg)
    model_type = cfg["model_type"]
    state = _read_state_dict(src, allow_pickle)
    _check_layer_count(state, int(cfg.get("num_hidden_layers", 12)), "num_hidden_layers")
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
    return _finish_conversion(
        model, state, pairs, src, base_model or checkpoint_dir, output_dir, model_type, head, cfg,
        transform=lambda dst, value: value[offset:] if dst.endswith("position_embeddings.weight") and offset else value,
        required=lambda dst: dst.startswith(dst_prefix + "embeddings.") or dst.startswith(dst_prefix + "layers."),
        zero=lambda name: name.endswith("rpe.weight"),  # exp(0) = 1: start from plain (position-free) kernel attention
        tied="lm_head.decoder.weight",
    )


def _finish_conversion(model, state, pairs, src, base_model, output_dir, model_type, head, cfg, *,
                       transform, required, zero, tied, unused=()):
    """What every conversion shares: copy ``state[src_key]`` (after ``transform(dst, value)``)
    into each target key of ``pairs`` exactly, refusing missing keys that are ``required`` (all
    named) or a shape mismatch; zero the new tensors ``zero`` names; tie; attach
    ``conversion_report`` (copied, initialised, unused source keys, with ``unused`` added); with
    ``output_dir`` save the model Hub-ready with the source tokenizer files and a model card
    naming the base model. ``state`` holds only tensors read from the source: whatever is copied
    came from it."""
    missing = [srck for dst, srck in pairs.items() if srck not in state and dst != tied and required(dst)]
    if missing:
        raise ValueError(
            f"checkpoint has no {_names(missing)}: not a complete {model_type} model "
            f"(architectures={cfg.get('architectures')})"
        )
    target = model.state_dict()
    copied, used = [], set()
    with torch.no_grad():
        for dst, srck in pairs.items():
            if srck not in state:
                continue  # tied (comes with the word embeddings), or a head / pooler the source does not have: stays initialised
            value = transform(dst, state[srck])
            if tuple(value.shape) != tuple(target[dst].shape):
                raise ValueError(f"shape mismatch for {dst!r} <- {srck!r}: {tuple(target[dst].shape)} vs {tuple(value.shape)}")
            target[dst].copy_(value.to(target[dst].dtype))
            copied.append(dst)
            used.add(srck)
        for name, tensor in target.items():
            if zero(name):
                tensor.zero_()
    model.tie_weights()
    model.conversion_report = {
        "source_model_type": model_type,
        "head": head,
        "copied": copied,
        "initialised": sorted(k for k in target if k not in copied and k != tied),
        "unused_source_keys": sorted({k for k in state if k not in used and not k.endswith(("position_ids", ".attn.bias", ".attn.masked_bias"))}
                                     | set(unused)),
    }
    if output_dir is not None:
        from .cards import save_model_card

        out = Path(output_dir)
        model.save_pretrained(out)
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        save_model_card(model, out, base_model=str(base_model), training={
            "converted from": f"`{base_model}` ({model_type})", "tensors copied": len(copied),
            "initialised": ", ".join(model.conversion_report["initialised"]) or "none",
        })
    return model


# GPT-2 config fields -> Linear GPT config fields
_GPT2_FIELDS = {
    "vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
    "activation_function": "hidden_act", "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_epsilon", "initializer_range": "initializer_range", "embd_pdrop": "embd_pdrop",
    "resid_pdrop": "resid_pdrop", "attn_pdrop": "attn_pdrop", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
}


def convert_to_linear_gpt(
    checkpoint_dir: str | Path,
    output_dir: Optional[str | Path] = None,
    *,
    revision: Optional[str] = None,
    base_model: Optional[str] = None,
    allow_pickle: bool = False,
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
    from .modeling.configuration_linear_gpt import LinearGPTConfig

    src = _resolve_checkpoint(checkpoint_dir, revision, allow_pickle)
    cfg = _read_config(src, ("gpt2", "llama"))
    unknown = set(attention_overrides) - set(LinearGPTConfig().to_dict())
    if unknown:
        raise ValueError(f"unknown Linear GPT config fields in overrides: {sorted(unknown)}")
    convert_one = _convert_llama if cfg["model_type"] == "llama" else _convert_gpt2
    return convert_one(src, cfg, output_dir, base_model or checkpoint_dir, attention_overrides, allow_pickle)


def _convert_gpt2(src: Path, cfg: dict[str, Any], output_dir, base_model, overrides: dict[str, Any], allow_pickle: bool):
    from .modeling.configuration_linear_gpt import LinearGPTConfig
    from .modeling.modeling_linear_gpt import LinearGPTForCausalLM

    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("reorder_and_upcast_attn", False)):
        if cfg.get(field, ok) != ok:
            raise ValueError(f"cannot convert a GPT-2 with {field}={cfg[field]!r}; supported: {field}={ok!r}")
    state = _read_state_dict(src, allow_pickle)
    _check_layer_count(state, int(cfg.get("n_layer", 12)), "n_layer")
    fields = {dst: cfg[s] for s, dst in _GPT2_FIELDS.items() if s in cfg}
    fields["intermediate_size"] = cfg.get("n_inner") or 4 * fields["hidden_size"]
    fields.update(feature_map=CONVERTED_FEATURE_MAP, num_random_features=CONVERTED_NUM_RANDOM_FEATURES, normalize_qk=False)
    fields.update(overrides)
    fields["position_embedding_type"] = "absolute"
    model = LinearGPTForCausalLM(LinearGPTConfig(**fields)).eval()
    hidden = model.config.hidden_size
    prefix = "transformer." if any(k.startswith("transformer.") for k in state) else ""
    pairs: dict[str, str] = {}
    slices: dict[str, slice] = {}
    for name in ("wte", "wpe"):
        pairs[f"transformer.{name}.weight"] = f"{prefix}{name}.weight"
    for part in ("weight", "bias"):
        pairs[f"transformer.ln_f.{part}"] = f"{prefix}ln_f.{part}"
    for i in range(model.config.num_hidden_layers):
        s, d = f"{prefix}h.{i}", f"transformer.h.{i}"
        for part in ("weight", "bias"):
            for ln in ("ln_1", "ln_2"):
                pairs[f"{d}.{ln}.{part}"] = f"{s}.{ln}.{part}"
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                pairs[f"{d}.attn.{proj}.{part}"] = f"{s}.attn.c_attn.{part}"
                slices[f"{d}.attn.{proj}.{part}"] = slice(j * hidden, (j + 1) * hidden)
            pairs[f"{d}.attn.o_proj.{part}"] = f"{s}.attn.c_proj.{part}"
            pairs[f"{d}.mlp.c_fc.{part}"] = f"{s}.mlp.c_fc.{part}"
            pairs[f"{d}.mlp.c_proj.{part}"] = f"{s}.mlp.c_proj.{part}"
    pairs["lm_head.weight"] = "lm_head.weight"

    def transform(dst: str, value: torch.Tensor) -> torch.Tensor:
        if dst in slices:  # fused q, k, v: the output columns of c_attn
            value = value[..., slices[dst]]
        if dst.endswith(".weight") and (".attn." in dst or ".mlp." in dst):
            value = value.t()  # Conv1D (in, out) -> nn.Linear (out, in)
        return value

    return _finish_conversion(
        model, state, pairs, src, base_model, output_dir, "gpt2", "causal_lm", cfg, transform=transform,
        required=lambda dst: dst.startswith("transformer."), zero=lambda name: False, tied="lm_head.weight",
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


def _convert_llama(src: Path, cfg: dict[str, Any], output_dir, base_model, overrides: dict[str, Any], allow_pickle: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from .modeling.configuration_linear_gpt import LinearGPTConfig
    from .modeling.modeling_linear_gpt import LinearGPTForCausalLM

    theta = _llama_rope_theta(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim * heads != cfg["hidden_size"]:
        raise ValueError(
            f"cannot convert a Llama with head_dim={head_dim} != hidden_size / num_attention_heads = "
            f"{cfg['hidden_size']} / {heads}; supported: head_dim = hidden_size / num_attention_heads"
        )
    raw = _read_state_dict(src, allow_pickle)
    _check_layer_count(raw, int(cfg.get("num_hidden_layers", 32)), "num_hidden_layers")
    # through transformers' own loading: every Llama key layout arrives in one; what it had to
    # initialise is not in ``state``, so it is refused (or reported initialised), never copied
    state, unused = _load_source(LlamaForCausalLM, LlamaConfig.from_dict(dict(cfg)), raw, src)
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
    return _finish_conversion(
        model, state, pairs, src, base_model, output_dir, "llama", "causal_lm", cfg, transform=lambda dst, value: value,
        required=lambda dst: True, zero=lambda name: False,
        tied="lm_head.weight" if model.config.tie_word_embeddings else None, unused=unused,
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

    from .modeling.configuration_relative_performer_vit import RelativePerformerViTConfig
    from .modeling.modeling_relative_performer_vit import (
        RelativePerformerViTForImageClassification,
        RelativePerformerViTModel,
    )

    src = _resolve_checkpoint(checkpoint_dir, revision, allow_pickle)
    cfg = _read_config(src, ("vit",))
    if not cfg.get("qkv_bias", True):
        raise ValueError("cannot convert a ViT with qkv_bias=False; supported: qkv_bias=True")
    classifier = "ForImageClassification" in " ".join(cfg.get("architectures") or [])
    raw = _read_state_dict(src, allow_pickle)
    _check_layer_count(raw, int(cfg.get("num_hidden_layers", 12)), "num_hidden_layers")
    # through transformers' own loading: checkpoints of every ViT key layout arrive in one; what
    # it had to initialise is not in ``state``, so it is refused (or reported initialised), never copied
    state, unused = _load_source(ViTForImageClassification if classifier else ViTModel, ViTConfig.from_dict(dict(cfg)), raw, src)
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

    return _finish_conversion(
        model, state, pairs, src, base_model or checkpoint_dir, output_dir, "vit",
        "image_classification" if classifier else "base", cfg, transform=transform,
        required=lambda dst: not dst.startswith("classifier."), zero=lambda name: False, tied=None, unused=unused,
    )


def convert(checkpoint_dir: str | Path, output_dir: Optional[str | Path] = None, **kwargs):
    """Convert a softmax checkpoint into the family that fits it: BERT and RoBERTa into NPRF-BERT
    (:func:`convert_to_nprf_bert`), GPT-2 and Llama into Linear GPT (:func:`convert_to_linear_gpt`), ViT into
    the relative-performer ViT (:func:`convert_to_relative_performer_vit`)."""
    src = _resolve_checkpoint(checkpoint_dir, kwargs.get("revision"), bool(kwargs.get("allow_pickle", False)))
    model_type = _read_config(src, SUPPORTED_MODEL_TYPES)["model_type"]
    kwargs.pop("revision", None)  # resolved above: the converters get the local folder
    if model_type == "vit":
        kwargs.pop("head", None)
        return convert_to_relative_performer_vit(src, output_dir, base_model=str(checkpoint_dir), **kwargs)
    if model_type in ("gpt2", "llama"):
        kwargs.pop("head", None)
        return convert_to_linear_gpt(src, output_dir, base_model=str(checkpoint_dir), **kwargs)
    return convert_to_nprf_bert(src, output_dir, base_model=str(checkpoint_dir), **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .modeling.configuration_nprf_bert import ATTENTION_SCHEMA as NPRF_BERT_SCHEMA
    from .modeling.feature_maps import FEATURE_MAPS

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
    parser.add_argument("--num-labels", type=int, default=None, help="the number of labels of a new classification head")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read pickled weights (pytorch_model*.bin) of a source that has no safetensors ones; "
                             "unpickling a file can run code from it, so only for sources you trust (default: refused)")


def run(args: argparse.Namespace) -> int:
    """``hf-kernattn convert``: convert and print what was copied and what was initialised."""
    overrides = {
        k: v
        for k, v in (
            ("num_random_features", args.num_random_features),
            ("max_relative_position", args.max_relative_position),
            ("feature_map", args.feature_map),
            ("attn_backend", args.attn_backend),
            ("num_labels", args.num_labels),
        )
        if v is not None
    }
    model = convert(args.checkpoint_dir, args.output_dir, head=args.head, revision=args.revision,
                    allow_pickle=args.allow_pickle, **overrides)
    rep = model.conversion_report
    print(f"converted {rep['source_model_type']} -> {type(model).__name__} (head={rep['head']})")
    print(f"copied {len(rep['copied'])} tensors; left at initialisation: {rep['initialised']}")
    if rep["unused_source_keys"]:
        print(f"source tensors not used: {rep['unused_source_keys']}")
    print(f"saved to {args.output_dir}")
    return 0
