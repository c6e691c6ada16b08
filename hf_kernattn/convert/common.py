"""What every conversion shares: reading a source checkpoint (a local folder or a Hub snapshot;
``config.json``; safetensors weights, sharded through their index, pickled ones only when
allowed) with errors that name the file or tensor at fault, and :func:`finish_conversion`, the one
mechanism that copies tensors exactly, reports what was copied and saves the result Hub-ready.
"""

from __future__ import annotations

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

from ..modeling.pretrained import warn_pickle_weights

logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "gpt2", "llama", "vit")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
    "merges.txt", "added_tokens.json", "tokenizer.model", "preprocessor_config.json",
)

# The number of random features per head a converted GPT-2, Llama or ViT gets unless told
# otherwise (NPRF-BERT keeps its config's default); quoted by ``hf-kernattn convert --help``.
CONVERTED_NUM_RANDOM_FEATURES = 256
CONVERTED_FEATURE_MAP = "prf"
_SAFE_INDEX = "model.safetensors.index.json"
_SAFE_SINGLE = "model.safetensors"
_PICKLE_INDEX = "pytorch_model.bin.index.json"


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def resolve_checkpoint(checkpoint: str | Path, revision: Optional[str] = None, allow_pickle: bool = False) -> Path:
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
    metadata = ["config.json", *TOKENIZER_FILES]
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
            f"{one_line(err)}"
        ) from err
    return folder


def check_output_dir(output_dir: str | Path, source: Path, *, overwrite: bool = False, ours=lambda path: False) -> Path:
    """``output_dir`` as a ``Path`` once it is safe to write a result there; ``ValueError`` otherwise.

    Never the source folder, a folder inside it or one holding it (the result would overwrite or
    mix with the source model). An existing folder must be empty, or hold only what ``ours(path)``
    accepts (a run's own checkpoints and earlier result), unless ``overwrite``: files of the
    user's are never replaced without it."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {str(out)!r} exists and is not a folder")
    o, s = out.resolve(), Path(source).resolve()
    where = ("is the source folder" if o == s else "is inside the source folder" if s in o.parents
             else "holds the source folder" if o in s.parents else None)
    if where is not None:
        raise ValueError(f"output_dir {str(out)!r} {where} {str(source)!r}: writing the result there would overwrite "
                         "or mix with the source model; choose another folder")
    if out.is_dir() and not overwrite:
        foreign = sorted(p.name for p in out.iterdir() if not ours(p))
        if foreign:
            raise ValueError(
                f"output_dir {str(out)!r} already holds other files ({names(foreign, 5)}), which the result would "
                "overwrite or mix with; choose a new or empty folder, or pass overwrite_output_dir=True (command "
                "line: --overwrite_output_dir) to write into it anyway"
            )
    return out


def inside_folder(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a relative ``name`` that stays inside ``folder``; ``ValueError``
    naming ``what`` for an absolute name or one with a ``..`` part."""
    path = Path(name)
    if not name or path.is_absolute() or path.drive or ".." in path.parts:
        raise ValueError(f"{what} names {name!r}, which leaves the folder {str(folder)!r}: only files inside it are read")
    return folder / path


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {one_line(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object ({{...}}), got a JSON {type(data).__name__}")
    return data


def read_config(src: Path, supported: tuple[str, ...] = ("bert", "roberta")) -> dict[str, Any]:
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"checkpoint_dir {str(src)!r} has no config.json; expected a checkpoint directory of one of "
                         f"{list(supported)}")
    cfg = read_json(path, "config")
    model_type = cfg.get("model_type")
    if model_type not in supported:
        raise ValueError(
            f"cannot convert model_type={model_type!r} (architectures={cfg.get('architectures')}) here; "
            f"supported source architectures: {list(supported)} (all conversions: {list(SUPPORTED_MODEL_TYPES)}: "
            "BERT and RoBERTa encoders into NPRF-BERT, GPT-2 and Llama into Linear GPT, ViT into the relative-performer ViT)"
        )
    return cfg


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"cannot read weights file {str(path)!r} (damaged or not a safetensors file): {one_line(err)}") from None


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    import pickle

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise ValueError(f"cannot read weights file {str(path)!r} (damaged, or more than tensors in it): {one_line(err)}") from None
    if not isinstance(state, dict):
        raise ValueError(f"weights file {str(path)!r} holds a {type(state).__name__}, not a state dict")
    return state


def _read_sharded(src: Path, index: Path, load) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors of every file ``index`` (a ``*.index.json``) lists; also the file names."""
    weight_map = read_json(index, "weights index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"weights index {str(index)!r} has no weight_map ({{tensor name: file name}})")
    files = sorted(set(weight_map.values()))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = inside_folder(src, name, f"weights index {str(index)!r}")
        if not path.is_file():
            raise ValueError(f"weights index {str(index)!r} lists {name!r}, which is not in {str(src)!r}")
        state.update(load(path))
    absent = sorted(k for k, f in weight_map.items() if k not in state)
    if absent:
        raise ValueError(f"weights index {str(index)!r} lists tensors its files do not hold: {names(absent)}")
    return state, set(files)


def read_state_dict(src: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
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


def names(keys: list[str], shown: int = 8) -> str:
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


def check_layer_count(keys, num_layers: int, field: str) -> None:
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


def load_source(model_class, config, state: dict[str, torch.Tensor], src: Path):
    """``model_class`` (a transformers model) holding ``state``, read as transformers reads a
    checkpoint (its key renamings included), and the source's state dict without the tensors
    transformers had to initialise (missing from ``state``), plus the keys it did not use."""
    try:
        with _transformers_quiet():
            source, info = model_class.from_pretrained(None, config=config, state_dict=state, output_loading_info=True)
    except RuntimeError as err:  # e.g. a tensor of another shape than config.json implies
        raise ValueError(f"the weights in {str(src)!r} do not fit its config.json: {one_line(err)}") from None
    missing = set(info.get("missing_keys", ()))
    loaded = {k: v.detach() for k, v in source.state_dict().items() if k not in missing}
    return loaded, sorted(info.get("unexpected_keys", ()))


def finish_conversion(model, state, pairs, src, base_model, output_dir, model_type, head, cfg, *,
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
            f"checkpoint has no {names(missing)}: not a complete {model_type} model "
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
        from ..cards import save_model_card

        out = Path(output_dir)
        model.save_pretrained(out)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        save_model_card(model, out, base_model=str(base_model), training={
            "converted from": f"`{base_model}` ({model_type})", "tensors copied": len(copied),
            "initialised": ", ".join(model.conversion_report["initialised"]) or "none",
        })
    return model
