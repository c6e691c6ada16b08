"""The command-line flags the Accelerate example scripts share (same names and meaning in each),
their checks, and small parsers of flag values.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Iterable, Optional

from .optimizer import WEIGHT_DECAY_HELP
from .threads import NUM_THREADS_HELP

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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# name -> (what is allowed, test); a value of None is "not given" and passes
_VALUE_RULES = {
    "learning_rate": ("a finite number > 0", lambda v: _is_number(v) and v > 0),
    "weight_decay": ("a finite number >= 0", lambda v: _is_number(v) and v >= 0),
    "max_grad_norm": ("a finite number >= 0 (0: no clipping)", lambda v: _is_number(v) and v >= 0),
    "num_warmup_steps": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "warmup_ratio": ("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1),
    "gradient_accumulation_steps": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "stop_after_steps": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "checkpoints_total_limit": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "num_threads": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "checkpointing_steps": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
}


def check_training_values(values: dict, names: Optional[dict[str, str]] = None, allow_epoch: bool = False) -> None:
    """``ValueError`` naming the first bad value of the run settings the example scripts and
    ``linearize`` share (keys of ``values``: ``learning_rate``, ``weight_decay``, ``max_grad_norm``,
    ``num_warmup_steps``, ``warmup_ratio``, ``gradient_accumulation_steps``, ``stop_after_steps``,
    ``checkpoints_total_limit``, ``num_threads``, ``checkpointing_steps``), each shown as
    ``names[key]`` (default: the key). ``None`` means not given and passes; ``allow_epoch``: a
    ``checkpointing_steps`` of ``"epoch"`` or a string of digits (a script's flag) passes too."""
    names = names or {}
    for key, value in values.items():
        what, ok = _VALUE_RULES[key]
        if key == "checkpointing_steps" and allow_epoch:
            what = "a positive integer or 'epoch'"
            if value == "epoch":
                continue
            if isinstance(value, str) and value.isdigit():
                value = int(value)
        if value is not None and not ok(value):
            raise ValueError(f"{names.get(key, key)} must be {what}, got {value!r}")
    if values.get("warmup_ratio") is not None and values.get("num_warmup_steps") is not None:
        raise ValueError(f"give {names.get('num_warmup_steps', 'num_warmup_steps')} or "
                         f"{names.get('warmup_ratio', 'warmup_ratio')}, not both")


# the shared flags :func:`check_training_values` checks
_CHECKED_FLAGS = ("learning_rate", "weight_decay", "max_grad_norm", "num_warmup_steps", "warmup_ratio",
                  "gradient_accumulation_steps", "stop_after_steps", "checkpoints_total_limit", "num_threads",
                  "checkpointing_steps")


def check_training_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values of the shared flags (argparse error naming the flag;
    :func:`check_training_values`)."""
    try:
        check_training_values({key: getattr(args, key) for key in _CHECKED_FLAGS},
                              {key: f"--{key}" for key in _CHECKED_FLAGS}, allow_epoch=True)
    except ValueError as err:
        p.error(str(err))


def warmup_steps(args: argparse.Namespace, max_train_steps: int, default: int = 0) -> int:
    """Warm-up steps: ``--warmup_ratio`` of the run when given, else ``--num_warmup_steps``, else
    ``default``."""
    if args.warmup_ratio is not None:
        if args.num_warmup_steps is not None:
            raise ValueError("give --num_warmup_steps or --warmup_ratio, not both")
        return math.ceil(args.warmup_ratio * max_train_steps)
    return default if args.num_warmup_steps is None else args.num_warmup_steps


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
