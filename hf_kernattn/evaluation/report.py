"""What an evaluation writes: ``<task>.json`` (settings and every number), ``<task>.csv`` (one row
per model and bin or distance), ``<task>.png`` (one line per model) and, when a compared model
is a sliding-window hybrid, ``hybrid.csv`` (its window/linear shares per layer and head); and the
short table printed on the console."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Optional, Union


def _fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _clean(x):
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _rows(result: dict) -> tuple[list[str], list[list]]:
    if result["task"] == "context":
        header = ["model", "bin_lo", "bin_hi", "mean_loss", "count"]
        rows = [[m["name"], b["lo"], b["hi"], b["mean_loss"], b["count"]] for m in result["models"] for b in m["bins"]]
    else:
        header = ["model", "distance", "first_loss", "first_accuracy", "repeat_loss", "repeat_accuracy", "tokens"]
        rows = [[m["name"]] + [r[k] for k in header[1:]] for m in result["models"] for r in m["distances"]]
    return header, rows


def _hybrid_rows(result: dict) -> list[list]:
    return [[m["name"], layer["layer"], layer["module"], layer["window"], h["head"], h["window_share"], h["linear_share"],
             h["window_weight"], h["linear_weight"], layer["queries"]]
            for m in result["models"] for layer in (m.get("hybrid") or []) for h in layer["heads"]]


HYBRID_HEADER = ["model", "layer", "module", "window", "head", "window_share", "linear_share", "window_weight",
                 "linear_weight", "queries"]


def _write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row])


def plot(result: dict, path: Path) -> None:
    """The PNG: loss by position (context; a second panel with the hybrids' window share by
    layer), or accuracy and loss by distance (recall)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    hybrids = [m for m in result["models"] if m.get("hybrid")]
    if result["task"] == "context":
        fig, axes = plt.subplots(1, 2 if hybrids else 1, figsize=(11 if hybrids else 6.4, 4.2), squeeze=False)
        ax = axes[0][0]
        for m in result["models"]:
            pts = [((b["lo"] + b["hi"] - 1) / 2, b["mean_loss"]) for b in m["bins"] if b["mean_loss"] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=m["name"])
        ax.set_xscale("log")
        ax.set_xlabel("token position (tokens of context before it)")
        ax.set_ylabel("mean next-token loss (nats)")
        ax.set_title(f"loss by position, {result['settings']['windows']} windows of {result['settings']['max_length']}")
        if hybrids:
            hx = axes[0][1]
            for m in hybrids:
                layers = m["hybrid"]
                hx.plot([x["layer"] for x in layers], [x["window_share"] for x in layers], marker="o", label=m["name"])
            hx.set_ylim(0, 1.02)
            hx.xaxis.set_major_locator(MaxNLocator(integer=True))
            hx.set_xlabel("layer")
            hx.set_ylabel("share of attention in the softmax window")
            hx.set_title("hybrids: window share (rest: linear part)")
            hx.grid(True, alpha=0.3)
            hx.legend(fontsize=8)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
        acc, lo = axes[0]
        for i, m in enumerate(result["models"]):
            color = f"C{i}"
            for key, ax in (("accuracy", acc), ("loss", lo)):
                for which, style in (("repeat", "-"), ("first", ":")):
                    pts = [(r["distance"], r[f"{which}_{key}"]) for r in m["distances"] if r[f"{which}_{key}"] is not None]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, color=color,
                            label=f"{m['name']} ({which} copy)")
        for ax, what in ((acc, "top-1 accuracy"), (lo, "loss (nats)")):
            ax.set_xscale("symlog", linthresh=1)  # log-spaced distances, 0 included
            ax.set_xlabel("distance d (tokens of text between the copies)")
            ax.set_ylabel(f"span {what}")
        acc.set_ylim(-0.02, 1.02)
        s = result["settings"]
        acc.set_title(f"recall of a {s['span_length']}-token random span ({s['trials']} trials)")
        lo.set_title("solid: repeated copy; dotted: first copy")
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
    fig.axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, out: Union[str, os.PathLike]) -> list[Path]:
    """Write ``result`` (from :func:`~.context.evaluate_context` or
    :func:`~.recall.evaluate_recall`) under the folder ``out``; returns the paths written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    task = result["task"]
    paths = [out / f"{task}.json", out / f"{task}.csv", out / f"{task}.png"]
    paths[0].write_text(json.dumps(_clean(result), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    _write_csv(paths[1], *_rows(result))
    plot(result, paths[2])
    hybrid = _hybrid_rows(result)
    if hybrid:
        paths.append(out / "hybrid.csv")
        _write_csv(paths[-1], HYBRID_HEADER, hybrid)
    return paths


def summary(result: dict) -> str:
    """The console table: positions (rows) by model (columns) for ``context``, distances by
    model for ``recall``; the hybrids' window share per layer below."""
    from hf_kernattn_cli import format_columns

    models = result["models"]
    names = [m["name"] for m in models]
    if result["task"] == "context":
        rows = [["positions", *names]]
        for j, b in enumerate(result["bins"]):
            label = str(b["lo"]) if b["hi"] == b["lo"] + 1 else f"{b['lo']}-{b['hi'] - 1}"
            rows.append([label, *(_fmt(m["bins"][j]["mean_loss"]) for m in models)])
        rows.append(["all scored", *(_fmt(m["mean_loss"]) for m in models)])
        text = "mean next-token loss (nats) by position\n" + format_columns(rows)
        for m in models:
            if m.get("hybrid"):
                shares = " ".join(_fmt(layer["window_share"], 2) for layer in m["hybrid"])
                text += f"\n{m['name']}: share of attention in the softmax window, by layer: {shares}"
        return text
    rows = [["distance", *names]]
    for j, d in enumerate(result["settings"]["distances"]):
        cells = []
        for m in models:
            r = m["distances"][j]
            cells.append("-" if r["repeat_accuracy"] is None else
                         f"{_fmt(r['repeat_accuracy'], 2)} ({_fmt(r['first_accuracy'], 2)})")
        rows.append([str(d), *cells])
    return "top-1 accuracy on the repeated span (on its first copy)\n" + format_columns(rows)
