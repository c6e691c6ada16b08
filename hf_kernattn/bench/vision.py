"""One relative-performer ViT layer (2D FFT bias) vs one ViT layer with SDPA: forward+backward time and memory.

Both models have one encoder layer of the same widths (``--hidden`` 384, ``--heads`` 6, MLP
``--intermediate`` 1536) on a ``G x G`` patch grid (patch size 1, so an image of ``G x G`` pixels
gives ``G^2`` tokens): ``rpvit`` is :class:`RelativePerformerViTModel` with ``rpe="learned_2d"``
(positive random features, ``--features`` 32 per head, a learnable 2D relative bias applied by
2D FFT, ``attn_backend="fft"``); ``vit`` is ``transformers.ViTModel`` with
``attn_implementation="sdpa"``. Each case runs in a fresh process
(:func:`hf_kernattn.bench.common.measure`: median time of ``--repeats`` forward+backward runs,
peak resident memory above the set-up); for every grid the two models alternate
(vit, rpvit, vit, rpvit, ...) over ``--rounds`` rounds and the ratio is reported as median
[min-max]. Writes ``vision.csv`` and ``vision.png`` and prints the table with the crossover.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Callable

from transformers.utils import logging

from .common import (
    add_common_arguments,
    add_model_size_arguments,
    build_parser as common_parser,
    format_table,
    hidden_state_step,
    measure,
    plot_series,
    write_csv,
)

logger = logging.get_logger(__name__)

NAME = "vision"
MODELS = ("vit", "rpvit")
FULL_GRIDS = (32, 64, 128, 256)
QUICK_GRIDS = (16, 32)


def workload(
    model: str, grid: int, hidden: int = 384, heads: int = 6, intermediate: int = 1536, features: int = 32,
    batch: int = 1, device: str = "cpu", mode: str = "fwdbwd",
) -> Callable[[], None]:
    """One model of one layer on a ``grid x grid`` patch grid; returns a callable running one
    forward+backward (``mode="fwdbwd"``) or forward (``"fwd"``) on random pixels."""
    import torch

    torch.manual_seed(0)
    if model == "rpvit":
        from hf_kernattn import RelativePerformerViTConfig, RelativePerformerViTModel

        cfg = RelativePerformerViTConfig(
            image_size=grid, patch_size=1, num_channels=3, hidden_size=hidden, num_hidden_layers=1,
            num_attention_heads=heads, intermediate_size=intermediate, rpe="learned_2d", num_random_features=features,
            attn_backend="fft", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        net = RelativePerformerViTModel(cfg)
    elif model == "vit":
        from transformers import ViTConfig, ViTModel

        cfg = ViTConfig(
            image_size=grid, patch_size=1, num_channels=3, hidden_size=hidden, num_hidden_layers=1,
            num_attention_heads=heads, intermediate_size=intermediate, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
        )
        net = ViTModel(cfg, add_pooling_layer=False)
    else:
        raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
    net = net.to(device).train()
    pixels = torch.randn(batch, 3, grid, grid, device=device)

    return hidden_state_step(net, {"pixel_values": pixels}, backward=mode != "fwd")


def build_parser() -> argparse.ArgumentParser:
    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, NAME, f"grids {QUICK_GRIDS}, one round")
    parser.add_argument("--grids", type=int, nargs="+", default=None, help=f"patch-grid sides G (default {FULL_GRIDS})")
    add_model_size_arguments(parser, hidden=384, heads=6, intermediate=1536, features=32,
                             features_help="random features per head (rpvit)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per case (median); one untimed run before")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds per grid")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a case is reported as timed out")


def run(args: argparse.Namespace) -> int:
    for name in ("hidden", "heads", "intermediate", "features", "batch", "repeats", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive int, got {getattr(args, name)!r}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    grids = args.grids or (QUICK_GRIDS if args.quick else FULL_GRIDS)
    rounds = 1 if args.quick else args.rounds
    shape = dict(hidden=args.hidden, heads=args.heads, intermediate=args.intermediate, features=args.features,
                 batch=args.batch, device=args.device)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for grid in grids:
        ratios, mem_ratios, runs = [], [], {m: [] for m in MODELS}
        for rnd in range(rounds):
            res = {}
            for model in MODELS:  # alternated: vit, rpvit, vit, rpvit, ...
                res[model] = measure("hf_kernattn.bench.vision:workload", dict(model=model, grid=grid, **shape),
                                     repeats=args.repeats, timeout_s=args.timeout, max_seconds=args.timeout / 2,
                                     threads=args.threads)
                runs[model].append(res[model])
                rows.append({"grid": grid, "tokens": grid * grid, "round": rnd, "model": model, **res[model]})
                logger.info(f"G={grid:4d} round {rnd} {model:6s} time={res[model]['time_s']:.4g}s "
                            f"peak={res[model]['peak_mb']:.4g}MB {res[model]['status']}")
            ok = all(r["status"] == "ok" for r in res.values())
            ratios.append(res["vit"]["time_s"] / res["rpvit"]["time_s"] if ok else float("nan"))
            mem_ratios.append(res["vit"]["peak_mb"] / res["rpvit"]["peak_mb"] if ok and res["rpvit"]["peak_mb"] > 0
                              else float("nan"))
        good = [r for r in ratios if r == r]
        good_mem = [r for r in mem_ratios if r == r]
        summary.append({
            "grid": f"{grid}x{grid}", "tokens": grid * grid,
            "vit_s": statistics.median(r["time_s"] for r in runs["vit"]),
            "rpvit_s": statistics.median(r["time_s"] for r in runs["rpvit"]),
            "speed-up vit/rpvit": f"{statistics.median(good):.2f} [{min(good):.2f}-{max(good):.2f}]" if good else "nan",
            "vit_MB": statistics.median(r["peak_mb"] for r in runs["vit"]),
            "rpvit_MB": statistics.median(r["peak_mb"] for r in runs["rpvit"]),
            "memory vit/rpvit": f"{statistics.median(good_mem):.2f}" if good_mem else "nan",
            "_speedup": statistics.median(good) if good else float("nan"),
        })
    out = Path(args.out)
    write_csv(rows, out / "vision.csv")
    print(format_table(summary, ["grid", "tokens", "vit_s", "rpvit_s", "speed-up vit/rpvit", "vit_MB", "rpvit_MB",
                                 "memory vit/rpvit"]))
    faster = [s["grid"] for s in summary if s["_speedup"] > 1]
    print(f"\nrpvit is faster from grid {faster[0]} on" if faster and all(
        s["_speedup"] > 1 for s in summary[[x["grid"] for x in summary].index(faster[0]):]) else
        "\nno grid from which rpvit is faster at every larger measured grid")
    xs = [s["tokens"] for s in summary]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    plot_series({"ViT + SDPA": (xs, [s["vit_s"] for s in summary]), "RP-ViT learned_2d": (xs, [s["rpvit_s"] for s in summary])},
                None, title="one layer, forward+backward", xlabel="tokens (patch grid G x G)", ylabel="seconds", ax=axes[0])
    plot_series({"ViT + SDPA": (xs, [s["vit_MB"] for s in summary]), "RP-ViT learned_2d": (xs, [s["rpvit_MB"] for s in summary])},
                None, title="peak memory over set-up", xlabel="tokens (patch grid G x G)", ylabel="MiB", ax=axes[1])
    fig.suptitle(f"hidden {args.hidden}, {args.heads} heads, MLP {args.intermediate}, {args.features} features, "
                 f"batch {args.batch}, {args.device}, {args.threads} thread(s)", fontsize=9)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "vision.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'vision.csv'} and {out / 'vision.png'}")
    return 0
