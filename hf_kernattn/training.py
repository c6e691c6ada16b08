"""Shared training code of the example scripts: the command-line flags they have in common, one
weight-decay rule, the Accelerate training loop, and resumable checkpoints written without pickle.

Weight decay (:func:`decay_parameter_names`, :func:`optimizer_grouped_parameters`): the
``transformers`` rule (no decay for biases and normalisation weights, as
``Trainer.get_decay_parameter_names``), extended to the relative-position bias tables
(``RelativePositionBias1D``): they are additive biases on the attention logits, and decaying them
pulls the model towards having no position information. Embedding tables are decayed, as
``transformers`` does.

Checkpoints (:func:`save_checkpoint` / :func:`load_checkpoint`) hold everything needed to continue
a run exactly where it stopped: model weights, optimizer, learning-rate scheduler, gradient scaler,
step counters, the data position, the evaluation history, and every process's random states
(torch, CUDA, Python ``random``, NumPy, and any named ``torch.Generator``). Tensors go to
safetensors files and everything else to JSON: nothing is pickled and loading never executes code.
A checkpoint is written into a temporary folder and renamed into place when complete, with its
``training_state.json`` written last: it records a fingerprint of the run's arguments and the size
and SHA-256 of every other file, which are flushed to disk (``fsync``, files and folder) before it
is written; a folder without it is ignored. :func:`resolve_checkpoint` picks the newest complete
and intact checkpoint of the same run for ``--resume_from_checkpoint latest`` (a damaged one, say
a truncated ``model.safetensors``, is skipped with a warning naming the file), refuses a named
checkpoint that is damaged, and refuses one written with other arguments, naming the settings that
differ. :func:`prune_checkpoints` keeps at most ``--checkpoints_total_limit`` of them.

Threads (:func:`configure_threads`): ``--num_threads``, else ``OMP_NUM_THREADS``, else the
physical cores divided among this machine's processes (what ``accelerate launch`` sets on CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import safetensors.torch
import torch
from torch import nn
from transformers.trainer_pt_utils import get_parameter_names
from transformers.utils import logging

logger = logging.get_logger(__name__)

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "training_state.json"
MODEL_FILE = "model.safetensors"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".tmp"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed (damaged, incomplete, or of a run with other settings).
    The example scripts print it as one line and exit with status 1 (see :func:`run_main`)."""


def run_main(main: Callable[[], Any]) -> None:
    """Run a script's ``main()``; a :class:`CheckpointError` ends it with its one-line message
    (no traceback) and exit status 1."""
    try:
        main()
    except CheckpointError as err:
        name = Path(sys.argv[0]).name or "script"
        print(f"{name}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None

# transformers' patterns (Trainer.get_decay_parameter_names), matched on lower-cased names.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
_NO_DECAY_MODULES = ("RelativePositionBias1D", "LinearGPTRMSNorm")

WEIGHT_DECAY_HELP = (
    "weight decay of AdamW; as in transformers, biases and normalisation weights get none, and "
    "neither do the relative-position bias tables (embeddings are decayed)"
)


# --------------------------------------------------------------------------------------------
# weight decay


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that get weight decay (see the module docstring for the rule)."""
    forbidden = [nn.LayerNorm]
    # By class name as well: a model loaded as remote code has its own copy of the class.
    forbidden += list({type(m) for m in model.modules() if type(m).__name__ in _NO_DECAY_MODULES})
    return get_parameter_names(model, forbidden, _NO_DECAY_PATTERNS)


def optimizer_grouped_parameters(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups following :func:`decay_parameter_names` (trainable parameters)."""
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------------------------
# run fingerprint


def run_fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of the settings that determine a run's trajectory (JSON, sorted keys)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# JSON + safetensors encoding of state dicts (no pickle)


def _encode(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"cannot store a state dict key of type {type(k).__name__} at {path!r}")
            out[f"{'i' if isinstance(k, int) else 's'}:{k}"] = _encode(v, tensors, f"{path}.{k}" if path else str(k))
        return {"__dict__": out}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a value of type {type(obj).__name__} at {path!r} without pickle")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__dict__" in obj:
        out = {}
        for k, v in obj["__dict__"].items():
            kind, name = k.split(":", 1)
            out[int(name) if kind == "i" else name] = _decode(v, tensors)
        return out
    raise ValueError(f"unknown entry in a stored state: {sorted(obj)}")


def save_tree(folder: Path, name: str, tree: Any) -> None:
    """Write ``tree`` (nested dicts/lists/tuples of tensors, arrays and plain values) as
    ``name.json`` plus ``name.safetensors``."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, "")
    safetensors.torch.save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(encoded))


def load_tree(folder: Path, name: str) -> Any:
    """Read what :func:`save_tree` wrote (JSON and safetensors only); an unreadable file raises
    :class:`CheckpointError` naming it."""
    folder = Path(folder)
    with _naming(folder / f"{name}.safetensors"):
        tensors = safetensors.torch.load_file(str(folder / f"{name}.safetensors"))
    with _naming(folder / f"{name}.json"):
        encoded = json.loads((folder / f"{name}.json").read_text())
    return _decode(encoded, tensors)


class _naming:
    """Turn an error while reading ``path`` into a one-line :class:`CheckpointError` naming it."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if kind is None or isinstance(err, CheckpointError) or not isinstance(err, Exception):
            return False
        raise CheckpointError(f"cannot read {self.path}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                              ) from err


# --------------------------------------------------------------------------------------------
# random states


def rng_state(generators: Optional[dict[str, torch.Generator]] = None) -> dict:
    """This process's random states: Python, NumPy, torch (CPU and CUDA), named generators."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generators: Optional[dict[str, torch.Generator]] = None) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in (generators or {}).items():
        if k not in state["generators"]:
            raise ValueError(f"the checkpoint has no state for the random generator {k!r}")
        g.set_state(state["generators"][k])


# --------------------------------------------------------------------------------------------
# checkpoints


def is_complete(path: Path, state_file: str = STATE_FILE) -> bool:
    """A checkpoint folder whose state file (written last) is present and readable."""
    try:
        state = json.loads((Path(path) / state_file).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("format_version") == FORMAT_VERSION and state.get("complete") is True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file or a folder to disk (folders: where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # folders cannot be fsynced on some platforms
    finally:
        os.close(fd)


def checkpoint_manifest(folder: str | os.PathLike, state_file: str = STATE_FILE, sync: bool = True) -> dict:
    """``{relative path: {"size", "sha256"}}`` of every file in ``folder`` (recursively) except the
    state file; with ``sync``, each file and folder is flushed to disk first."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in (state_file, state_file + _TMP_SUFFIX):
            continue
        if sync:
            _fsync(path)
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    if sync:
        for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
            _fsync(sub)
        _fsync(folder)
    return files


def _check_safetensors_header(path: Path) -> Optional[str]:
    """Why a safetensors file is unreadable (bad header, size not the one its header gives), or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                return f"{path.name} is truncated ({size} bytes, shorter than its header says)"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError):
        return f"{path.name} has an unreadable header"
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return f"{path.name} has an unreadable header"
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{path.name} has {size} bytes, its header says {expected} (truncated or damaged)"
    return None


def verify_checkpoint(path: str | os.PathLike, state_file: str = STATE_FILE) -> list[str]:
    """What is damaged in a complete checkpoint (an empty list when it is intact).

    Checks every file the state file lists: present, of the recorded size and SHA-256.
    Checkpoints written before sizes and checksums were recorded get the checks their files
    allow: safetensors headers against file sizes, JSON files parse."""
    path = Path(path)
    state = _read_state(path, state_file)
    files = state.get("files")
    problems = []
    if isinstance(files, dict):
        for rel, meta in sorted(files.items()):
            f = path / rel
            if not f.is_file():
                problems.append(f"{rel} is missing")
            elif f.stat().st_size != meta.get("size"):
                problems.append(f"{rel} has {f.stat().st_size} bytes, {meta.get('size')} were written (truncated or "
                                "damaged)")
            elif _sha256(f) != meta.get("sha256"):
                problems.append(f"{rel} does not match the SHA-256 recorded when it was written (corrupted)")
        return problems
    for f in sorted(path.rglob("*")):
        if not f.is_file() or f.name == state_file:
            continue
        if f.suffix == ".safetensors":
            problem = _check_safetensors_header(f)
            if problem:
                problems.append(problem)
        elif f.suffix == ".json":
            try:
                json.loads(f.read_text())
            except (OSError, ValueError):
                problems.append(f"{f.relative_to(path).as_posix()} is not valid JSON (truncated or damaged)")
    return problems


def _checkpoints(output_dir: str | os.PathLike, prefix: str) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the folders ``{prefix}N`` in ``output_dir``, newest first."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    out = Path(output_dir)
    return sorted(((int(m.group(1)), p) for p in (out.iterdir() if out.is_dir() else [])
                   if p.is_dir() and (m := pattern.match(p.name))), reverse=True)


def resolve_checkpoint(spec: Optional[str], output_dir: str | os.PathLike, fingerprint: str,
                       prefix: str = CHECKPOINT_PREFIX, state_file: str = STATE_FILE,
                       settings: Optional[dict[str, Any]] = None) -> Optional[Path]:
    """The checkpoint folder to resume from, or ``None`` to start fresh.

    ``spec`` is ``None`` (no resume), ``"latest"`` (the newest complete and intact checkpoint
    ``output_dir/{prefix}N`` written by a run with the same ``fingerprint``; half-written folders
    are skipped, damaged ones (see :func:`verify_checkpoint`) skipped with a warning naming what is
    damaged; ``None`` when there is none at all) or a folder. Raises :class:`CheckpointError` (a
    ``ValueError``) for a folder that is incomplete, damaged or was written with other settings
    (naming the ones that differ from ``settings``), for ``latest`` when the output folder holds
    complete checkpoints but all of another run, and when every checkpoint of this run is damaged.
    """
    if spec is None:
        return None
    if spec != "latest":
        path = Path(spec)
        if not path.is_dir():
            raise CheckpointError(f"--resume_from_checkpoint: {spec} is not a folder")
        if not is_complete(path, state_file):
            raise CheckpointError(f"--resume_from_checkpoint: {spec} is not a complete checkpoint (no valid "
                                  f"{state_file}; it may have been interrupted while being written)")
        _check_fingerprint(path, fingerprint, state_file, settings)
        problems = verify_checkpoint(path, state_file)
        if problems:
            raise CheckpointError(f"--resume_from_checkpoint: the checkpoint {spec} is damaged: {'; '.join(problems)}")
        return path
    others, damaged = [], []
    for _, path in _checkpoints(output_dir, prefix):
        if not is_complete(path, state_file):
            logger.warning(f"ignoring the incomplete checkpoint {path}")
            continue
        if _read_state(path, state_file).get("fingerprint") != fingerprint:
            others.append(path)
            continue
        problems = verify_checkpoint(path, state_file)
        if problems:
            logger.warning(f"skipping the damaged checkpoint {path}: {'; '.join(problems)}")
            damaged.append(path)
            continue
        if damaged:
            logger.warning(f"resuming from {path}, the newest intact checkpoint of this run")
        return path
    if damaged:
        raise CheckpointError(f"every checkpoint of this run in {output_dir} is damaged "
                              f"({', '.join(p.name for p in damaged)}); remove them to start afresh")
    if others:
        _check_fingerprint(others[0], fingerprint, state_file, settings)  # raises, naming the settings
    return None


def prune_checkpoints(output_dir: str | os.PathLike, limit: Optional[int], fingerprint: str,
                      prefix: str = CHECKPOINT_PREFIX, state_file: str = STATE_FILE) -> list[Path]:
    """Delete the oldest complete checkpoints of the run ``fingerprint`` beyond the newest
    ``limit`` (``None``: keep all); returns the deleted folders. Half-written folders and other
    runs' checkpoints are left alone."""
    if limit is None:
        return []
    mine = [p for _, p in _checkpoints(output_dir, prefix)
            if is_complete(p, state_file) and _read_state(p, state_file).get("fingerprint") == fingerprint]
    removed = mine[limit:]
    for path in removed:
        logger.info(f"deleting {path} (--checkpoints_total_limit {limit})")
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _read_state(path: Path, state_file: str = STATE_FILE) -> dict:
    return json.loads((Path(path) / state_file).read_text())


def _flatten(settings: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(settings, dict):
        out: dict[str, Any] = {}
        for k, v in settings.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: settings}


_ABSENT = object()


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``name: old -> new`` for every setting that differs (nested settings as ``a.b``; values as
    JSON, an absent one as ``(absent)``)."""
    old = _flatten(json.loads(json.dumps(old, default=str)))
    new = _flatten(json.loads(json.dumps(new, default=str)))

    def show(v):
        return "(absent)" if v is _ABSENT else json.dumps(v)

    return [f"{k}: {show(old.get(k, _ABSENT))} -> {show(new.get(k, _ABSENT))}" for k in sorted(set(old) | set(new))
            if old.get(k, _ABSENT) != new.get(k, _ABSENT)]


def _check_fingerprint(path: Path, fingerprint: str, state_file: str = STATE_FILE,
                       settings: Optional[dict[str, Any]] = None) -> None:
    state = _read_state(path, state_file)
    if state.get("fingerprint") == fingerprint:
        return
    diff = settings_diff(state.get("settings", {}), settings) if settings is not None else []
    if diff:
        what = ", ".join(diff)
    else:  # no settings to compare with: show the checkpoint's
        what = (f"fingerprint {state.get('fingerprint')}, this run {fingerprint}; its settings: "
                f"{json.dumps(state.get('settings', {}), sort_keys=True, default=str)}")
    raise CheckpointError(
        f"the checkpoint {path} was written by a run with other settings ({what}). "
        "Resume with the same arguments, or use another --output_dir."
    )


def write_state_file(folder: Path, fingerprint: str, settings: dict[str, Any], state_file: str = STATE_FILE,
                     **extra: Any) -> None:
    """Mark ``folder`` as a complete checkpoint of the run ``fingerprint`` (call it last, when every
    other file is written): records the size and SHA-256 of every file after flushing them to disk,
    then writes the state file atomically and flushes the folder."""
    files = checkpoint_manifest(folder, state_file)
    state = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "settings": settings, **extra,
             "files": files, "complete": True}
    tmp = Path(folder) / (state_file + _TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(json.dumps(state, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(folder) / state_file)
    _fsync(Path(folder))


def save_checkpoint(
    accelerator,
    output_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    fingerprint: str,
    settings: dict[str, Any],
    progress: dict[str, Any],
    generators: Optional[dict[str, torch.Generator]] = None,
    save_extra: Optional[Callable[[Path], None]] = None,
    total_limit: Optional[int] = None,
) -> Path:
    """Write ``output_dir/step_{step}`` atomically; every process must call it.

    ``progress`` is JSON (counters, data position, evaluation history); ``generators`` are
    torch generators of this process to restore as well; ``save_extra(folder)`` (main process)
    adds files such as the tokenizer. Every file is flushed to disk and recorded (size, SHA-256)
    in the state file, which is written last. With ``total_limit``, the oldest complete
    checkpoints of this run beyond the newest ``total_limit`` are deleted afterwards.
    """
    final = Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"
    tmp = Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}{_TMP_SUFFIX}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_tree(tmp, f"rng_state_{accelerator.process_index}", rng_state(generators))
    optim = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    sharding = _sharding(accelerator)
    if sharding == "fsdp2":  # gather the full model and optimizer state (every process takes part)
        model_state, optim_state = _fsdp2_full_state(model, optim)
    if accelerator.is_main_process:
        if sharding == "fsdp2":
            # our own copies: tied weights are saved under each name (no shared storage)
            safetensors.torch.save_file({k: v.detach().contiguous().clone() for k, v in model_state.items()},
                                        str(tmp / MODEL_FILE))
            save_tree(tmp, "optimizer", optim_state)
        else:
            safetensors.torch.save_model(accelerator.unwrap_model(model), str(tmp / MODEL_FILE))
            save_tree(tmp, "optimizer", optim.state_dict())
        sched = scheduler.scheduler if hasattr(scheduler, "scheduler") else scheduler
        save_tree(tmp, "scheduler", sched.state_dict())
        if accelerator.scaler is not None:
            save_tree(tmp, "scaler", accelerator.scaler.state_dict())
        if save_extra is not None:
            save_extra(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_state_file(tmp, fingerprint, settings, step=step, num_processes=accelerator.num_processes,
                         sharding=sharding, progress=progress)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(Path(output_dir))
        prune_checkpoints(output_dir, total_limit, fingerprint)
    accelerator.wait_for_everyone()
    return final


def _sharding(accelerator) -> str:
    """How the model's weights are laid out over the processes: ``"fsdp2"`` (torch FSDP2
    shards, through ``accelerate launch`` with ``fsdp_version: 2``) or ``"none"`` (every process
    holds them whole: one process, DDP)."""
    return "fsdp2" if getattr(accelerator, "is_fsdp2", False) else "none"


def _fsdp2_full_state(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model's and optimizer's state gathered from FSDP2 shards onto the CPU of the
    main process (parameter names as keys; other processes get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optim, options=options)


def _fsdp2_load_full_state(model: nn.Module, optim: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                           path: Path) -> None:
    """Load what :func:`_fsdp2_full_state` gathered into an FSDP2 model and its optimizer (every
    process reads the whole state and keeps its own shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optim, optim_state, options=options)
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"the checkpoint {path} does not fit the model: {err}") from err


def load_checkpoint(
    accelerator,
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    generators: Optional[dict[str, torch.Generator]] = None,
) -> dict:
    """Restore what :func:`save_checkpoint` wrote; returns its ``progress`` dict.

    Reads only JSON and safetensors. The number of processes must be the one that wrote it.
    """
    path = Path(path)
    state = _read_state(path)
    if state["num_processes"] != accelerator.num_processes:
        raise ValueError(f"the checkpoint {path} was written by {state['num_processes']} processes; "
                         f"resume it with the same number (now {accelerator.num_processes})")
    sharding, saved_sharding = _sharding(accelerator), state.get("sharding", "none")
    if sharding != saved_sharding:
        raise ValueError(f"the checkpoint {path} was written with sharding {saved_sharding!r}; resume it with the same "
                         f"(now {sharding!r}: 'fsdp2' is an accelerate launch with an FSDP2 configuration)")
    optim = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    if sharding == "fsdp2":
        with _naming(path / MODEL_FILE):
            full_state = safetensors.torch.load_file(str(path / MODEL_FILE))
        _fsdp2_load_full_state(model, optim, full_state, load_tree(path, "optimizer"), path)
    else:
        with _naming(path / MODEL_FILE):
            missing, unexpected = safetensors.torch.load_model(
                accelerator.unwrap_model(model), str(path / MODEL_FILE), strict=False, device="cpu"
            )
        if missing or unexpected:
            raise ValueError(f"the checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")
        optim.load_state_dict(load_tree(path, "optimizer"))
    sched = scheduler.scheduler if hasattr(scheduler, "scheduler") else scheduler
    sched.load_state_dict(load_tree(path, "scheduler"))
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(load_tree(path, "scaler"))
    set_rng_state(load_tree(path, f"rng_state_{accelerator.process_index}"), generators)
    return state["progress"]


def fingerprint_settings(args, exclude: Iterable[str]) -> dict[str, Any]:
    """The argparse namespace as a dict, without the keys in ``exclude``."""
    skip = set(exclude)
    return {k: v for k, v in sorted(vars(args).items()) if k not in skip}


# --------------------------------------------------------------------------------------------
# command-line flags shared by the Accelerate scripts

SCHEDULER_TYPES = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                   "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay"]
# Flags that do not change what a run computes: a checkpoint may be resumed with other values.
NOT_FINGERPRINTED = ("output_dir", "resume_from_checkpoint", "stop_after_steps", "checkpointing_steps",
                     "checkpoints_total_limit", "num_threads", "with_tracking", "report_to", "preprocessing_num_workers", "push_to_hub", "hub_model_id",
                     "hub_private_repo", "hub_token")


def add_training_args(p: argparse.ArgumentParser, *, learning_rate: float, weight_decay: float,
                      warmup_default: str, checkpointing_steps: Optional[str]) -> None:
    """The flags every Accelerate example script has, with the same names and meaning."""
    g = p.add_argument_group("optimisation and checkpoints (shared by the Accelerate scripts)")
    g.add_argument("--learning_rate", type=float, default=learning_rate, help="peak learning rate of AdamW")
    g.add_argument("--weight_decay", type=float, default=weight_decay, help=WEIGHT_DECAY_HELP)
    g.add_argument("--lr_scheduler_type", default="linear", choices=SCHEDULER_TYPES,
                   help="schedule after warm-up (transformers.get_scheduler)")
    g.add_argument("--num_warmup_steps", type=int, default=None, help=f"linear warm-up steps (default: {warmup_default})")
    g.add_argument("--warmup_ratio", type=float, default=None,
                   help="warm-up as a fraction of the optimizer steps (instead of --num_warmup_steps)")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: none)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--checkpointing_steps", default=checkpointing_steps,
                   help="save a resumable checkpoint (output_dir/step_N) every N optimizer steps, or 'epoch'")
    g.add_argument("--checkpoints_total_limit", type=int, default=None,
                   help="keep at most this many checkpoints of this run in --output_dir, deleting the oldest "
                        "(default: keep all; keep 2 or more so that resuming can fall back on an older one if the "
                        "newest is damaged)")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="a step_N folder, or 'latest': the newest complete and intact checkpoint of this run in "
                        "--output_dir (none: start fresh; a damaged one is skipped with a warning). Checkpoints of a "
                        "run with other settings are refused, naming the settings that differ")
    g.add_argument("--stop_after_steps", type=int, default=None,
                   help="end this invocation after N more optimizer steps (counted from where it starts or resumes), "
                        "with a checkpoint, as a job with a time limit would; the same command with "
                        "--resume_from_checkpoint latest then runs the next N (the schedule still spans the whole run)")
    g.add_argument("--num_threads", type=int, default=None, help=NUM_THREADS_HELP)
    g.add_argument("--with_tracking", action="store_true", help="log metrics to the trackers of --report_to")
    g.add_argument("--report_to", default="all",
                   help="trackers for --with_tracking: 'all', or tensorboard, wandb, comet_ml, clearml, ...")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                   help="default: what accelerate launch / accelerate config say")
    g.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU exists "
                   "(with accelerate launch --multi_gpu: gloo processes)")
    g.add_argument("--seed", type=int, default=42, help="seed of initialisation, data order, dropout and masking")
    g.add_argument("--output_dir", required=True, help="final model and checkpoints")
    g.add_argument("--push_to_hub", action="store_true",
                   help="publish the final model folder on the Hub (hf-kernattn push does the same later)")
    g.add_argument("--hub_model_id", default=None, help="repository for --push_to_hub (default: the --output_dir name)")
    g.add_argument("--hub_private_repo", action="store_true", help="create the --push_to_hub repository private")
    g.add_argument("--hub_token", default=None, help="token for --push_to_hub (default: the one `hf auth login` saved)")


def push_if_asked(args: argparse.Namespace, folder: str | os.PathLike, report: Callable[[str], None] = logger.info) -> None:
    """``--push_to_hub``: publish the saved model ``folder`` (``hf_kernattn.hub.push_folder``).
    A failed push (offline, no token, a refused token) ends the run with one ``error: not
    pushed: ...`` line on stderr and exit status 1; the saved folder stays as it is."""
    if not args.push_to_hub:
        return
    from .hub import PushError, exit_not_pushed, push_folder

    repo_id = args.hub_model_id or Path(folder).name
    try:
        url = push_folder(folder, repo_id, private=args.hub_private_repo, token=args.hub_token)
    except (PushError, ValueError) as err:
        exit_not_pushed(err)
    report(f"pushed to {url}")


def check_training_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values of the shared flags (argparse error naming the flag)."""
    if args.gradient_accumulation_steps < 1:
        p.error(f"--gradient_accumulation_steps must be >= 1, got {args.gradient_accumulation_steps}")
    if args.num_warmup_steps is not None and args.num_warmup_steps < 0:
        p.error(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}")
    if args.warmup_ratio is not None and not 0.0 <= args.warmup_ratio <= 1.0:
        p.error(f"--warmup_ratio must be in [0, 1], got {args.warmup_ratio}")
    if args.warmup_ratio is not None and args.num_warmup_steps is not None:
        p.error("give --num_warmup_steps or --warmup_ratio, not both")
    if not args.weight_decay >= 0.0:
        p.error(f"--weight_decay must be >= 0, got {args.weight_decay}")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        p.error(f"--stop_after_steps must be >= 1, got {args.stop_after_steps}")
    if args.checkpoints_total_limit is not None and args.checkpoints_total_limit < 1:
        p.error(f"--checkpoints_total_limit must be >= 1, got {args.checkpoints_total_limit}")
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num_threads must be >= 1, got {args.num_threads}")
    c = args.checkpointing_steps
    if c is not None and c != "epoch" and not (str(c).isdigit() and int(c) >= 1):
        p.error(f"--checkpointing_steps must be a positive integer or 'epoch', got {c!r}")


def warmup_steps(args: argparse.Namespace, max_train_steps: int, default: int = 0) -> int:
    """Warm-up steps: ``--warmup_ratio`` of the run when given, else ``--num_warmup_steps``, else
    ``default``."""
    if args.warmup_ratio is not None:
        if args.num_warmup_steps is not None:
            raise ValueError("give --num_warmup_steps or --warmup_ratio, not both")
        return math.ceil(args.warmup_ratio * max_train_steps)
    return default if args.num_warmup_steps is None else args.num_warmup_steps


NUM_THREADS_HELP = (
    "CPU threads of torch in each process (default: OMP_NUM_THREADS when set, else the machine's physical cores "
    "divided among the processes on it, as accelerate launch does; on a machine shared with other jobs, 1 is "
    "often fastest)"
)


def local_process_count() -> int:
    """Processes of this run on this machine (``LOCAL_WORLD_SIZE`` of torchrun / accelerate launch, else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def configure_threads(num_threads: Optional[int] = None, local_processes: Optional[int] = None) -> int:
    """Set torch's CPU thread count for this process and return it: ``num_threads`` when given,
    else ``OMP_NUM_THREADS`` when set, else the physical cores divided among the
    ``local_processes`` of this run on the machine (at least 1), the default of
    ``accelerate launch`` on CPU. torch's own default (every core, in every process) oversubscribes
    the cores when several processes run, and on a shared machine."""
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    if num_threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env.isdigit() and int(env) >= 1:
            num_threads = int(env)
        else:
            try:
                import psutil

                cores = psutil.cpu_count(logical=False)
            except ImportError:
                cores = None
            cores = cores or os.cpu_count() or 1
            num_threads = max(1, cores // (local_processes or local_process_count()))
    torch.set_num_threads(num_threads)
    return num_threads


def _launch_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def make_accelerator(args: argparse.Namespace, **kwargs):
    """The ``Accelerator`` of an example script (``--cpu``, ``--mixed_precision``, tracking,
    gradient accumulation), honouring an FSDP or DeepSpeed ``accelerate launch`` on CPU processes;
    also sets the CPU threads (``--num_threads``, :func:`configure_threads`).

    accelerate (1.15) applies an FSDP or DeepSpeed launch configuration only on GPUs and similar
    devices: on CPU an FSDP launch silently trains with DDP (with ``--cpu``) or as unconnected
    single processes, and a DeepSpeed launch fails on its batch-size check (it sees one process).
    Here an FSDP launch with ``--cpu`` or on a machine without CUDA shards with FSDP over gloo,
    and a DeepSpeed launch with ``--cpu`` or on a machine without CUDA runs DeepSpeed over gloo on
    its CPU accelerator (``DS_ACCELERATOR=cpu``). DeepSpeed
    keeps the optimizer partitioned in its own format, which our checkpoints (safetensors and
    JSON) cannot hold: under DeepSpeed ``--stop_after_steps`` and ``--resume_from_checkpoint``
    are refused with a ``ValueError``, and ``--checkpointing_steps`` is ignored with a warning
    (only the final model is saved)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    if args.mixed_precision:
        kwargs["mixed_precision"] = args.mixed_precision
    if args.with_tracking:
        kwargs.update(log_with=args.report_to, project_dir=args.output_dir)
    cpu = args.cpu
    if _launch_flag("ACCELERATE_USE_DEEPSPEED"):
        why = ("resumable checkpoints are not supported under DeepSpeed (it keeps the optimizer partitioned in its "
               "own pickled format; our checkpoints are safetensors and JSON only); FSDP (accelerate config "
               "fsdp_version: 2) checkpoints and resumes")
        flags = [f"--{name}" for name in ("stop_after_steps", "resume_from_checkpoint")
                 if getattr(args, name, None) is not None]
        if flags:
            raise ValueError(f"{', '.join(flags)}: {why}")
        if getattr(args, "checkpointing_steps", None) is not None:
            logger.warning(f"--checkpointing_steps {args.checkpointing_steps} ignored: {why}. Only the final model "
                           "is saved.")
            args.checkpointing_steps = None
        if cpu or not torch.cuda.is_available():
            from deepspeed.accelerator import get_accelerator

            if get_accelerator().device_name() != "cpu":
                raise ValueError(f"--cpu under DeepSpeed needs DeepSpeed's CPU accelerator (set DS_ACCELERATOR=cpu); "
                                 f"it chose {get_accelerator().device_name()!r}")
            # accelerate hands DeepSpeed only to an Accelerator without cpu=True, and on a machine
            # without CUDA it needs the process-group backend named to see every process.
            cpu = False
            kwargs["kwargs_handlers"] = list(kwargs.get("kwargs_handlers", [])) + [InitProcessGroupKwargs(backend="gloo")]
    elif _launch_flag("ACCELERATE_USE_FSDP") and not torch.cuda.is_available():
        cpu = True  # otherwise accelerate runs each process alone on a machine without CUDA
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=cpu, **kwargs)
    if _launch_flag("ACCELERATE_USE_FSDP") and accelerator.distributed_type == DistributedType.MULTI_CPU:
        _use_fsdp_on_cpu(accelerator)
    batch = getattr(args, "per_device_train_batch_size", None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and batch is not None:
        # DeepSpeed needs the micro-batch when the model is prepared; scripts that prepare their
        # data loaders separately would leave it unknown ("auto")
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds_config["train_micro_batch_size_per_gpu"] = batch
    configure_threads(getattr(args, "num_threads", None))
    return accelerator


def _use_fsdp_on_cpu(accelerator) -> None:
    """Switch an ``Accelerator`` of CPU processes (gloo) from DDP to the FSDP plugin of the launch
    configuration (the ``FSDP_*`` variables ``accelerate launch`` sets), as accelerate does on GPUs."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    logger.info(f"FSDP{plugin.fsdp_version} on {accelerator.num_processes} CPU processes (gloo)")


def parse_overrides(text: Optional[str], flag: str = "--config_overrides") -> dict:
    """``key=value,...`` -> dict; values are read as JSON where they parse (numbers, booleans,
    lists), else kept as strings. ``ValueError`` naming ``flag`` for an item without ``=``."""
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"{flag} items must be key=value, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def check_text_files(paths: Iterable[str], flag: str) -> None:
    """Refuse missing, unreadable (not UTF-8) or empty text files, naming the file (and line)."""
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"{flag}: {path} is not a file")
        has_text = False
        with open(p, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{flag}: {path}, line {lineno}: not UTF-8 text ({err.reason})") from None
                has_text = has_text or bool(text.strip())
        if not has_text:
            raise ValueError(f"{flag}: {path} holds no text (empty or only blank lines)")


# --------------------------------------------------------------------------------------------
# data order and the training loop


class EpochShuffleSampler(torch.utils.data.Sampler):
    """A random permutation per epoch, drawn from ``seed + epoch`` alone (no global RNG): the data
    order of any epoch can be reproduced when a run resumes.

    Give the ``DataLoader`` its own ``generator=torch.Generator()`` as well: otherwise every new
    iterator draws its base seed from the global RNG, which shifts the dropout randomness of a
    resumed run (it starts an iterator mid-epoch)."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=g).tolist())


def train_loop(
    accelerator,
    args: argparse.Namespace,
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    train_dl,
    sampler: EpochShuffleSampler,
    max_train_steps: int,
    evaluate: Callable[[], dict],
    eval_steps: int = 0,
    prepare_batch: Optional[Callable[[dict], dict]] = None,
    generators: Optional[dict[str, torch.Generator]] = None,
    fingerprint: str,
    settings: dict[str, Any],
    save_extra: Optional[Callable[[Path], None]] = None,
    resume: Optional[Path] = None,
    desc: str = "train",
    report: Optional[Callable[[str], None]] = None,
) -> dict:
    """Train to ``max_train_steps`` optimizer steps (resuming when asked); returns
    ``{"step", "history", "stopped"}``. ``history`` holds the evaluations (every ``eval_steps``
    steps, else at the end of each epoch) and per-step training losses, kept across resumes.
    ``stopped`` is true when ``--stop_after_steps`` ended the run early (a checkpoint was saved).
    ``resume`` is the checkpoint from :func:`resolve_checkpoint` (``None``: start fresh);
    ``report`` receives the progress lines (default: this module's logger, at info level); lines
    reported while the progress bar is shown are written above it, never onto it.
    ``--stop_after_steps N`` counts from the step this invocation starts (or resumes) at.
    ``--checkpoints_total_limit`` keeps that many checkpoints of the run."""
    from tqdm.auto import tqdm

    step, epoch, batch_in_epoch, history = 0, 0, 0, {"eval": [], "train": []}
    report = report or logger.info
    ckpt = resume
    if ckpt is None and args.resume_from_checkpoint == "latest":
        logger.warning(f"no checkpoint of this run in {args.output_dir}: starting fresh")
    if ckpt is not None:
        progress = load_checkpoint(accelerator, ckpt, model, optimizer, scheduler, generators)
        step, epoch, batch_in_epoch, history = (progress["step"], progress["epoch"], progress["batch_in_epoch"],
                                                progress["history"])
        report(f"resumed from {ckpt} at step {step} (epoch {epoch}, batch {batch_in_epoch})")
    stop_at = max_train_steps if args.stop_after_steps is None else min(max_train_steps, step + args.stop_after_steps)
    if args.stop_after_steps is not None and stop_at < max_train_steps:
        report(f"--stop_after_steps {args.stop_after_steps}: this invocation stops after step {stop_at} "
               f"(of {max_train_steps}), with a checkpoint")
    every = None if args.checkpointing_steps in (None, "epoch") else int(args.checkpointing_steps)
    total_limit = getattr(args, "checkpoints_total_limit", None)
    bar = tqdm(total=max_train_steps, initial=step, disable=not accelerator.is_local_main_process, desc=desc)

    def say(line: str) -> None:  # above the progress bar, not onto it
        with tqdm.external_write_mode():
            report(line)
    model.train()
    running, counted = 0.0, 0
    while step < stop_at:
        loader = accelerator.skip_first_batches(train_dl, batch_in_epoch) if batch_in_epoch else train_dl
        # Accelerate's loaders pass their own epoch counter to the sampler when iterated: set both.
        for obj in (sampler, train_dl, loader):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
        for batch in loader:
            batch_in_epoch += 1
            if prepare_batch is not None:
                batch = prepare_batch(batch)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running += loss.detach().float().item()
            counted += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            epoch_done = batch_in_epoch == len(train_dl)
            lr = scheduler.get_last_lr()[0]
            history["train"].append({"step": step, "loss": running / counted, "lr": lr})
            bar.update(1)
            bar.set_postfix(loss=f"{running / counted:.3f}", lr=f"{lr:.2e}")
            if args.with_tracking:
                accelerator.log({"train_loss": running / counted, "lr": lr}, step=step)
            running, counted = 0.0, 0
            if (eval_steps and step % eval_steps == 0) or (not eval_steps and epoch_done):
                metrics = evaluate() | {"step": step, "epoch": epoch}
                history["eval"].append(metrics)
                say(json.dumps(metrics))
                if args.with_tracking:
                    accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            if (every and step % every == 0) or (args.checkpointing_steps == "epoch" and epoch_done) \
                    or (step == stop_at < max_train_steps):
                position = (epoch + 1, 0) if epoch_done else (epoch, batch_in_epoch)
                save_checkpoint(
                    accelerator, args.output_dir, step, model, optimizer, scheduler, fingerprint, settings,
                    {"step": step, "epoch": position[0], "batch_in_epoch": position[1], "history": history},
                    generators, save_extra, total_limit,
                )
            if step >= stop_at:
                break
        else:
            epoch, batch_in_epoch = epoch + 1, 0
            continue
        if batch_in_epoch == len(train_dl):
            epoch, batch_in_epoch = epoch + 1, 0
    bar.close()
    return {"step": step, "history": history, "stopped": step < max_train_steps}


def finish_run(accelerator, args: argparse.Namespace, model: nn.Module, evaluate: Callable[[], dict], result: dict,
               output_dir: str | os.PathLike):
    """The end of an Accelerate example run after :func:`train_loop`: when ``--stop_after_steps``
    stopped it, say how to resume, end training and return ``(None, None)``; otherwise evaluate
    once more, log the final figures, save the model (weights, config and code) into
    ``output_dir`` from the main process and return ``(final metrics, unwrapped model)``."""
    step = result["step"]
    if result["stopped"]:
        accelerator.print(f"stopped after step {step} (--stop_after_steps); resume with --resume_from_checkpoint latest")
        accelerator.end_training()
        return None, None
    final = evaluate() | {"step": step}
    accelerator.print("final " + json.dumps(final))
    if args.with_tracking:
        accelerator.log({f"final_{k}": v for k, v in final.items() if k != "step"}, step=step)
    accelerator.wait_for_everyone()
    unwrapped = save_final_model(accelerator, model, output_dir)
    return final, unwrapped


def save_final_model(accelerator, model: nn.Module, output_dir: str | os.PathLike) -> nn.Module:
    """Save the trained model (weights, config and code) into ``output_dir`` with
    ``save_pretrained``; every process must call it. The weights are gathered whole first
    (``accelerator.get_state_dict``: from FSDP shards or DeepSpeed ZeRO-3 partitions) and written by
    the main process. Returns the unwrapped model."""
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir, state_dict=state_dict)
    accelerator.wait_for_everyone()
    return unwrapped
