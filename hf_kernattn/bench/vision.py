"""Relative-performer ViT as users get it vs transformers' ViTModel with SDPA: time and peak memory.

The relative-performer ViT runs through its configured defaults (``attn_backend="auto"``,
positive random features with the config's number of features, ``max_relative_position`` 16,
``recompute_attention``): only the widths, the depth and ``rpe`` are set. Every ``rpe`` option
(``--rpe``, default all: ``learned_2d``, ``rotary_features``, ``manhattan``, ``absolute``,
``none``) is compared with ``transformers.ViTModel`` of the same shape with
``attn_implementation="sdpa"``; both use patches of ``--patch-size`` 16 and dropout 0.

Two parts:

* **layer**: one encoder layer at ViT-Base width (``--hidden`` 768, ``--heads`` 12, MLP
  ``--intermediate`` 3072) on a ``G x G`` patch grid (images of ``16 G`` pixels; ``G^2`` tokens),
  forward+backward through the mean square of the last hidden state (``--layer-modes``), for
  ``G`` in ``--grids`` (default 14 and 32; ``--large`` adds ``--large-grids``, 64 and 128, where
  ViT's quadratic attention takes minutes per run: these grids time one run per round; a case
  over ``--timeout`` seconds or ``--max-memory-gb`` of address space is reported as timed out or
  out of memory and not run again in later rounds).
* **model**: whole models on 224 x 224 images (14 x 14 patches) with ``--depth`` 4 layers and a
  1000-class head (``RelativePerformerViTForImageClassification`` vs
  ``ViTForImageClassification``), forward without autograd and forward+backward through the
  cross-entropy loss (``--model-modes``); ``--depth 0`` skips this part.

For every (part, grid, mode) the cases alternate (ViT, each option, ..., then in reverse) over
``--rounds`` rounds, each in a fresh process with ``--threads`` threads (default 1)
(:func:`hf_kernattn.bench.common.alternate`): time is the median of ``--repeats`` runs after one
untimed run that measures the peak resident memory above the set-up, on the wall clock and as the
process's CPU time. The ratios RP-ViT / ViT (time, CPU time, memory; below 1: RP-ViT is faster
or smaller) are taken within each round and reported as median [min-max]. Writes ``vision.csv``
(one row per case and round), ``vision_summary.csv``, ``vision.json`` (settings, rows and
summary) and ``vision.png``, and prints the summary table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Optional

from transformers.utils import logging

from ..modeling.configuration_relative_performer_vit import POSITION_OPTIONS
from .common import (
    add_common_arguments,
    alternate,
    build_parser as common_parser,
    format_table,
    hidden_state_step,
    per_round_ratios,
    plot_series,
    ratio_spreads,
    spread,
    write_csv,
)

logger = logging.get_logger(__name__)

NAME = "vision"
TARGET = "hf_kernattn.bench.vision:workload"
MODELS = ("vit", "rpvit")
# the relative-performer ViT's ``rpe`` options: learned_2d, rotary_features, manhattan, absolute, none
RPE_OPTIONS = tuple(POSITION_OPTIONS)
MODES = ("fwd", "fwdbwd")
GRIDS = (14, 32)
LARGE_GRIDS = (64, 128)
IMAGE_SIZE = 224
PROJECTIONS_SUFFIX = "+projections"  # cases with recompute_attention="projections" (--recompute-projections)
NUM_LABELS = 1000


def workload(
    model: str, grid: int, rpe: str = "learned_2d", mode: str = "fwdbwd", layers: int = 1, hidden: int = 768,
    heads: int = 12, intermediate: int = 3072, patch: int = 16, features: Optional[int] = None, batch: int = 1,
    classifier: bool = False, device: str = "cpu", recompute_attention: Optional[object] = None,
) -> Callable[[], None]:
    """One model on a ``grid x grid`` patch grid (images of ``grid * patch`` pixels); returns a
    callable running one forward+backward (``mode="fwdbwd"``) or forward without autograd
    (``"fwd"``) on random pixels.

    ``model``: ``"rpvit"`` (:class:`RelativePerformerViTModel` with ``rpe``, every other attention
    field at its config default; ``features`` overrides ``num_random_features``) or ``"vit"``
    (``transformers.ViTModel``, SDPA, no pooler). ``classifier``: the image-classification model
    with a ``NUM_LABELS``-class head instead, trained through its cross-entropy loss.
    ``recompute_attention``: the RP-ViT's setting of that name (None: the config's default).
    """
    import torch

    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    torch.manual_seed(0)
    shape = dict(image_size=grid * patch, patch_size=patch, num_channels=3, hidden_size=hidden,
                 num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=intermediate,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    head = dict(num_labels=NUM_LABELS) if classifier else {}
    if model == "rpvit":
        from hf_kernattn.modeling.configuration_relative_performer_vit import RelativePerformerViTConfig
        from hf_kernattn.modeling.modeling_relative_performer_vit import (
            RelativePerformerViTForImageClassification, RelativePerformerViTModel)

        extra = {} if features is None else dict(num_random_features=features)
        if recompute_attention is not None:
            extra["recompute_attention"] = recompute_attention
        cfg = RelativePerformerViTConfig(**shape, rpe=rpe, **extra, **head)
        net = RelativePerformerViTForImageClassification(cfg) if classifier else RelativePerformerViTModel(cfg)
    else:
        from transformers import ViTConfig, ViTForImageClassification, ViTModel

        cfg = ViTConfig(**shape, attn_implementation="sdpa", **head)
        net = ViTForImageClassification(cfg) if classifier else ViTModel(cfg, add_pooling_layer=False)
        if net.config._attn_implementation != "sdpa":
            raise RuntimeError(f"ViTModel did not select SDPA (got {net.config._attn_implementation!r})")
    net = net.to(device).train(mode != "fwd")
    pixels = torch.randn(batch, 3, grid * patch, grid * patch, device=device)
    if not classifier:
        return hidden_state_step(net, {"pixel_values": pixels}, backward=mode != "fwd")
    labels = torch.randint(0, NUM_LABELS, (batch,), device=device)

    if mode == "fwd":
        def run() -> None:
            with torch.no_grad():
                net(pixel_values=pixels)
        return run

    def run() -> None:
        net(pixel_values=pixels, labels=labels).loss.backward()
        net.zero_grad(set_to_none=True)
    return run


def build_parser() -> argparse.ArgumentParser:
    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, NAME, "grids 14 and 32, model depth 2, one round, one timed run")
    parser.add_argument("--grids", type=int, nargs="+", default=None,
                        help=f"patch-grid sides G of the one-layer part (default {list(GRIDS)})")
    parser.add_argument("--large", action="store_true",
                        help=f"also the large grids (--large-grids, default {list(LARGE_GRIDS)}): minutes per ViT run")
    parser.add_argument("--large-grids", type=int, nargs="+", default=list(LARGE_GRIDS),
                        help="grids added by --large (one timed run per round)")
    parser.add_argument("--rpe", nargs="+", default=list(RPE_OPTIONS), choices=RPE_OPTIONS,
                        help="relative-performer ViT position options compared with ViT (default all)")
    parser.add_argument("--layer-modes", nargs="+", default=["fwdbwd"], choices=MODES,
                        help="modes of the one-layer part (default fwdbwd)")
    parser.add_argument("--model-modes", nargs="+", default=list(MODES), choices=MODES,
                        help="modes of the whole-model part (default both)")
    parser.add_argument("--depth", type=int, default=4,
                        help=f"layers of the whole models at {IMAGE_SIZE} px (0: skip that part)")
    parser.add_argument("--hidden", type=int, default=768, help="width of both models (default 768, ViT-Base)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    parser.add_argument("--intermediate", type=int, default=3072, help="MLP width (default 3072)")
    parser.add_argument("--patch-size", type=int, default=16, help="side of the square patches in pixels (default 16)")
    parser.add_argument("--features", type=int, default=None,
                        help="random features per head of the RP-ViT (default: the config's)")
    parser.add_argument("--recompute-projections", action="store_true",
                        help="also every option with recompute_attention='projections' (the whole attention block "
                             "recomputed in the backward pass: less memory, more time), rows named <rpe>+projections")
    parser.add_argument("--batch", type=int, default=1, help="images per step (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case and round (median); one untimed run before")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (ratios: median [min-max])")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a case is reported as timed out")
    parser.add_argument("--max-memory-gb", type=float, default=8.0,
                        help="address-space cap of each measured process (default 8): a case needing more is "
                             "reported as out of memory")


def _check(args: argparse.Namespace) -> None:
    for name in ("hidden", "heads", "intermediate", "patch_size", "batch", "repeats", "rounds", "threads"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
    if args.depth < 0:
        raise ValueError(f"--depth must be an int >= 0 (0 skips the whole-model part), got {args.depth!r}")
    if args.features is not None and args.features < 1:
        raise ValueError(f"--features must be a positive int, got {args.features!r}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if IMAGE_SIZE % args.patch_size and args.depth:
        raise ValueError(f"--patch-size must divide {IMAGE_SIZE} for the whole-model part, got {args.patch_size}")
    grids = list(args.grids or []) + list(args.large_grids or [])
    if any(g < 1 for g in grids):
        raise ValueError(f"--grids and --large-grids must be positive, got {grids}")
    if not args.rpe:
        raise ValueError("--rpe needs at least one option")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout!r}")
    if not args.max_memory_gb > 0:
        raise ValueError(f"--max-memory-gb must be > 0, got {args.max_memory_gb!r}")


def _groups(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The alternated groups to measure: one per (part, grid, mode)."""
    grids = list(args.grids or GRIDS) + (list(args.large_grids) if args.large else [])
    large = set(args.large_grids) if args.large else set()
    groups = [dict(part="layer", grid=g, mode=m, layers=1, classifier=False, repeats=1 if g in large else args.repeats)
              for g in dict.fromkeys(grids) for m in args.layer_modes]
    if args.depth:
        groups += [dict(part="model", grid=IMAGE_SIZE // args.patch_size, mode=m, layers=args.depth, classifier=True,
                        repeats=args.repeats) for m in args.model_modes]
    return groups


def measure_group(args: argparse.Namespace, group: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """ViT and every ``--rpe`` option of one group, alternated over ``--rounds`` rounds:
    ``{case: [one result per round]}`` with cases ``"vit"`` and ``"rpvit_<rpe>"``."""
    shape = dict(grid=group["grid"], mode=group["mode"], layers=group["layers"], hidden=args.hidden, heads=args.heads,
                 intermediate=args.intermediate, patch=args.patch_size, batch=args.batch,
                 classifier=group["classifier"], device=args.device)
    cases = [("vit", TARGET, dict(model="vit", **shape))]
    cases += [(f"rpvit_{rpe}", TARGET, dict(model="rpvit", rpe=rpe, features=args.features, **shape)) for rpe in args.rpe]
    if args.recompute_projections:
        cases += [(f"rpvit_{rpe}{PROJECTIONS_SUFFIX}", TARGET,
                   dict(model="rpvit", rpe=rpe, features=args.features, recompute_attention="projections", **shape))
                  for rpe in args.rpe]
    return alternate(cases, rounds=args.rounds, repeats=group["repeats"], timeout_s=args.timeout,
                     max_seconds=args.timeout / 2, threads=args.threads, max_memory_gb=args.max_memory_gb,
                     stop_failed=True)


def summarize(group: dict[str, Any], results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per ``rpe`` option of a group: medians over rounds and the per-round ratios
    RP-ViT / ViT of wall time, CPU time and peak memory as median [min-max]."""
    vit = results["vit"]
    rows = []
    for case, res in results.items():
        if case == "vit":
            continue
        bad = [r["status"] for r in res + vit if r["status"] != "ok"]
        time_ratio, cpu_ratio = ratio_spreads(res, vit)
        mem = per_round_ratios(res, vit, "peak_mb")
        med_mem = spread(mem)
        rows.append({
            "part": group["part"], "grid": f"{group['grid']}x{group['grid']}", "tokens": group["grid"] ** 2,
            "layers": group["layers"], "mode": group["mode"], "rpe": case[len("rpvit_"):],
            "rpvit_s": spread(r["time_s"] for r in res)[0], "vit_s": spread(r["time_s"] for r in vit)[0],
            "time rpvit/vit": time_ratio, "CPU time rpvit/vit": cpu_ratio,
            "rpvit_cpu_s": spread(r.get("cpu_s", float("nan")) for r in res)[0],
            "vit_cpu_s": spread(r.get("cpu_s", float("nan")) for r in vit)[0],
            "rpvit_MB": spread(r["peak_mb"] for r in res)[0], "vit_MB": spread(r["peak_mb"] for r in vit)[0],
            "memory rpvit/vit": f"{med_mem[0]:.2f} [{med_mem[1]:.2f}-{med_mem[2]:.2f}]" if med_mem[0] == med_mem[0] else "nan",
            "status": bad[0] if bad else "ok",
        })
    return rows


COLUMNS = ["part", "grid", "layers", "mode", "rpe", "vit_s", "rpvit_s", "time rpvit/vit", "CPU time rpvit/vit",
           "vit_MB", "rpvit_MB", "memory rpvit/vit", "status"]


def run(args: argparse.Namespace) -> int:
    """Measure every group, print the summary, write CSV, JSON and PNG. Returns 0."""
    if args.quick:
        args.grids = args.grids or list(GRIDS)
        args.depth = min(args.depth, 2)
        args.rounds, args.repeats = 1, 1
    _check(args)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for group in _groups(args):
        results = measure_group(args, group)
        for case, res in results.items():
            for rnd, r in enumerate(res):
                rows.append({"part": group["part"], "grid": group["grid"], "tokens": group["grid"] ** 2,
                             "layers": group["layers"], "mode": group["mode"], "case": case, "round": rnd,
                             **{k: r.get(k, float("nan")) for k in ("time_s", "cpu_s", "peak_mb", "runs")},
                             "status": r["status"]})
        summary += summarize(group, results)
        for s in summary[-len(args.rpe):]:
            logger.info(f"{s['part']} G={s['grid']} {s['mode']} {s['rpe']}: time {s['time rpvit/vit']}, "
                        f"CPU {s['CPU time rpvit/vit']}, memory {s['memory rpvit/vit']} ({s['status']})")
    out = Path(args.out)
    write_csv(rows, out / "vision.csv")
    public = [{k: v for k, v in s.items() if not k.startswith("_")} for s in summary]
    write_csv(public, out / "vision_summary.csv")
    settings = {k: getattr(args, k) for k in ("hidden", "heads", "intermediate", "patch_size", "features", "batch",
                                               "depth", "repeats", "rounds", "threads", "device", "rpe")}
    with open(out / "vision.json", "w") as f:
        json.dump(_json_safe({"settings": settings, "rows": rows, "summary": public}), f, indent=1)
    print(format_table(public, COLUMNS))
    _plot(summary, rows, args, out / "vision.png")
    print(f"wrote {out / 'vision.csv'}, {out / 'vision_summary.csv'}, {out / 'vision.json'} and {out / 'vision.png'}")
    return 0


def _json_safe(x: Any) -> Any:
    """``x`` with NaN and infinite floats (failed cases) as ``None``: strict JSON."""
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _plot(summary: list[dict[str, Any]], rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Time and peak memory of the one-layer part (its first mode) over the token count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    mode = args.layer_modes[0]
    layer = [s for s in summary if s["part"] == "layer" and s["mode"] == mode]
    if layer:
        vit_pts = sorted({(s["tokens"], s["vit_s"], s["vit_MB"]) for s in layer})
        time_series = {"ViT + SDPA": ([p[0] for p in vit_pts], [p[1] for p in vit_pts])}
        mem_series = {"ViT + SDPA": ([p[0] for p in vit_pts], [p[2] for p in vit_pts])}
        for rpe in args.rpe:
            sel = sorted((s["tokens"], s["rpvit_s"], s["rpvit_MB"]) for s in layer if s["rpe"] == rpe)
            time_series[f"RP-ViT {rpe}"] = ([p[0] for p in sel], [p[1] for p in sel])
            mem_series[f"RP-ViT {rpe}"] = ([p[0] for p in sel], [p[2] for p in sel])
        label = "forward+backward" if mode == "fwdbwd" else "forward"
        plot_series(time_series, None, title=f"one layer, {label}", xlabel="tokens (patch grid G x G)",
                    ylabel="seconds", ax=axes[0])
        plot_series(mem_series, None, title="peak memory over set-up", xlabel="tokens (patch grid G x G)",
                    ylabel="MiB", ax=axes[1])
    fig.suptitle(f"hidden {args.hidden}, {args.heads} heads, MLP {args.intermediate}, patch {args.patch_size}, "
                 f"attn_backend auto, batch {args.batch}, {args.device}, {args.threads} thread(s)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
