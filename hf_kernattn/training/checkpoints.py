"""Resumable checkpoints of the example scripts, written without pickle.

A checkpoint (:func:`save_checkpoint` / :func:`load_checkpoint`) holds everything needed to
continue a run exactly where it stopped: model weights, optimizer, learning-rate scheduler,
gradient scaler, step counters, the data position, the evaluation history, and every process's
random states (torch, CUDA, Python ``random``, NumPy, and any named ``torch.Generator``). Tensors
go to safetensors files and everything else to JSON (:mod:`~hf_kernattn.training.serialization`):
nothing is pickled and loading never executes code.

A checkpoint is written into a temporary folder and renamed into place when complete, with its
``training_state.json`` written last: it records a fingerprint of the run's arguments and the size
and SHA-256 of every other file, which are flushed to disk (``fsync``, files and folder) before it
is written; a folder without it is ignored. :func:`resolve_checkpoint` picks the newest complete
and intact checkpoint of the same run for ``--resume_from_checkpoint latest`` (a damaged one, say
a truncated ``model.safetensors``, is skipped with a warning naming the file), refuses a named
checkpoint that is damaged, and refuses one written with other arguments, naming the settings that
differ. :func:`prune_checkpoints` keeps at most ``--checkpoints_total_limit`` of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import safetensors.torch
import torch
from torch import nn
from transformers.utils import logging

from .distributed import fsdp2_full_state, fsdp2_load_full_state, sharding_of
from .serialization import CheckpointError, load_tree, named_read_errors, rng_state, save_tree, set_rng_state

logger = logging.get_logger(__name__)

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "training_state.json"
MODEL_FILE = "model.safetensors"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".tmp"


# --------------------------------------------------------------------------------------------
# run fingerprint


def run_fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of the settings that determine a run's trajectory (JSON, sorted keys)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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

    Checks every file the state file lists: inside the checkpoint folder (a name that leaves it,
    absolute or with ``..``, is a problem: nothing outside is opened), present, of the recorded
    size and SHA-256.
    Checkpoints written before sizes and checksums were recorded get the checks their files
    allow: safetensors headers against file sizes, JSON files parse."""
    path = Path(path)
    state = _read_state(path, state_file)
    files = state.get("files")
    problems = []
    if isinstance(files, dict):
        for rel, meta in sorted(files.items()):
            f = path / rel
            if not rel or Path(rel).is_absolute() or Path(rel).drive or ".." in Path(rel).parts:
                problems.append(f"{state_file} lists {rel!r}, a name that leaves the checkpoint folder (only the "
                                "checkpoint's own files are checked and read)")
            elif not f.is_file():
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


def begin_checkpoint(output_dir: str | os.PathLike, step: int, prefix: str = CHECKPOINT_PREFIX) -> Path:
    """A fresh temporary folder for the checkpoint of ``step`` (an earlier, interrupted one removed);
    :func:`publish_checkpoint` turns it into ``output_dir/{prefix}{step}``."""
    tmp = Path(output_dir) / f"{prefix}{step}{_TMP_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_checkpoint(output_dir: str | os.PathLike, step: int, fingerprint: str, settings: dict[str, Any],
                       total_limit: Optional[int] = None, prefix: str = CHECKPOINT_PREFIX, **extra: Any) -> Path:
    """Complete the temporary folder of :func:`begin_checkpoint` (every file written): the state
    file last (:func:`write_state_file`, with ``step`` and ``extra``), then an atomic rename to
    ``output_dir/{prefix}{step}`` (replacing one of the same step), the folder flushed, and the
    oldest complete checkpoints of this run beyond ``total_limit`` deleted. Returns the folder."""
    final = Path(output_dir) / f"{prefix}{step}"
    tmp = Path(output_dir) / f"{prefix}{step}{_TMP_SUFFIX}"
    write_state_file(tmp, fingerprint, settings, step=step, **extra)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(Path(output_dir))
    prune_checkpoints(output_dir, total_limit, fingerprint, prefix=prefix)
    return final


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
        begin_checkpoint(output_dir, step)
    accelerator.wait_for_everyone()
    save_tree(tmp, f"rng_state_{accelerator.process_index}", rng_state(generators))
    optim = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    sharding = sharding_of(accelerator)
    if sharding == "fsdp2":  # gather the full model and optimizer state (every process takes part)
        model_state, optim_state = fsdp2_full_state(model, optim)
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
        publish_checkpoint(output_dir, step, fingerprint, settings, total_limit, num_processes=accelerator.num_processes,
                           sharding=sharding, progress=progress)
    accelerator.wait_for_everyone()
    return final


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
    sharding, saved_sharding = sharding_of(accelerator), state.get("sharding", "none")
    if sharding != saved_sharding:
        raise ValueError(f"the checkpoint {path} was written with sharding {saved_sharding!r}; resume it with the same "
                         f"(now {sharding!r}: 'fsdp2' is an accelerate launch with an FSDP2 configuration)")
    optim = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    if sharding == "fsdp2":
        with named_read_errors(path / MODEL_FILE):
            full_state = safetensors.torch.load_file(str(path / MODEL_FILE))
        fsdp2_load_full_state(model, optim, full_state, load_tree(path, "optimizer"), path)
    else:
        with named_read_errors(path / MODEL_FILE):
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
