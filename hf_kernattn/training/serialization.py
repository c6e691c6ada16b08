"""Pickle-free storage of training state: nested dicts, lists and tuples of tensors, NumPy
arrays and plain values as ``NAME.json`` plus ``NAME.safetensors`` (:func:`save_tree` /
:func:`load_tree`; loading never executes code), and this process's random states
(:func:`rng_state` / :func:`set_rng_state`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import safetensors.torch
import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed (damaged, incomplete, or of a run with other settings).
    The example scripts print it as one line and exit with status 1 (see :func:`run_main`)."""



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
    with named_read_errors(folder / f"{name}.safetensors"):
        tensors = safetensors.torch.load_file(str(folder / f"{name}.safetensors"))
    with named_read_errors(folder / f"{name}.json"):
        encoded = json.loads((folder / f"{name}.json").read_text())
    return _decode(encoded, tensors)


class named_read_errors:
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
