#!/usr/bin/env python
"""How well each position option of the relative-performer ViT holds up when test images shift.

Horn et al. (*Translational Equivariance in Kernelizable Attention*) find that Performer
attention with relative positions degrades far less than with absolute positions when the
objects in test images are translated. This script measures that on data available offline:

* Data: the 8x8 handwritten digits bundled with scikit-learn (1797 images, 10 classes),
  upsampled to 16x16 (bilinear) and centred in a ``--canvas`` x ``--canvas`` (32 x 32) black
  canvas, split 80/20 (stratified, fixed seed).
* Training: every position option (``--options``; default ``learned_2d``, ``rotary_features``,
  ``manhattan``, ``absolute``, ``none``) with the same model size and budget (``--epochs`` of AdamW,
  cosine schedule) on the centred images, for ``--seeds`` seeds.
* Test: accuracy on the test images shifted by ``s`` pixels along x, ``s`` in
  ``-max_shift .. max_shift`` (the digit stays inside the canvas; vacated pixels are black).
  A shift by a multiple of the patch size moves the content by whole patches.
* Output: ``shift_robustness.csv`` (one row per option, seed and shift), ``shift_robustness.png``
  (mean accuracy vs shift, the band spanning the seeds' min and max) and a Markdown table.

Example::

    python examples/research/shift_robustness.py --output_dir out/shift        # about 16 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.metrics import accuracy_score
from sklearn.model_selection import train_test_split
from transformers import get_scheduler

from hf_kernattn import RelativePerformerViTConfig, RelativePerformerViTForImageClassification
from hf_kernattn.training import NUM_THREADS_HELP, configure_threads

OPTIONS = ("learned_2d", "rotary_features", "manhattan", "absolute", "none")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--options", nargs="+", default=list(OPTIONS), choices=OPTIONS, help="position options (rpe)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--canvas", type=int, default=32, help="image side in pixels (the digit is 16 x 16, centred)")
    p.add_argument("--patch_size", type=int, default=4)
    p.add_argument("--max_shift", type=int, default=8, help="largest shift along x, in pixels")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--num_random_features", type=int, default=32)
    p.add_argument("--num_threads", "--threads", type=int, default=None, help=NUM_THREADS_HELP)
    args = p.parse_args(argv)
    if args.canvas < 16 or args.canvas % args.patch_size:
        p.error(f"--canvas must be >= 16 and a multiple of --patch_size ({args.patch_size}), got {args.canvas}")
    if not 0 <= args.max_shift <= (args.canvas - 16) // 2:
        p.error(f"--max_shift must be in [0, {(args.canvas - 16) // 2}] so the digit stays inside the canvas")
    for name in ("seeds", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def digits_on_canvas(canvas: int) -> tuple[torch.Tensor, np.ndarray]:
    """``(1797, 1, canvas, canvas)`` float images in [-1, 1] (black background) and their labels."""
    digits = load_digits()
    small = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (n, 1, 8, 8) in [0, 1]
    big = torch.nn.functional.interpolate(small, size=(16, 16), mode="bilinear", align_corners=False)
    images = torch.zeros(len(small), 1, canvas, canvas)
    top = (canvas - 16) // 2
    images[:, :, top : top + 16, top : top + 16] = big
    return images * 2 - 1, digits.target


def shift_x(images: torch.Tensor, s: int) -> torch.Tensor:
    """Move the content ``s`` pixels along x (right for s > 0); vacated pixels are background (-1)."""
    if s == 0:
        return images
    out = torch.full_like(images, -1.0)
    if s > 0:
        out[..., s:] = images[..., :-s]
    else:
        out[..., :s] = images[..., -s:]
    return out


def train_one(args, option: str, seed: int, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(seed)
    config = RelativePerformerViTConfig(
        image_size=args.canvas, patch_size=args.patch_size, num_channels=1, num_labels=10,
        hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads, intermediate_size=2 * args.hidden_size,
        num_random_features=args.num_random_features, rpe=option, feature_seed=seed,
    )
    model = RelativePerformerViTForImageClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    steps = args.epochs * math.ceil(len(x) / args.batch_size)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=steps // 20, num_training_steps=steps)
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(args.epochs):
        for idx in torch.randperm(len(x), generator=order).split(args.batch_size):
            loss = model(pixel_values=x[idx], labels=y[idx]).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return model.eval()


@torch.no_grad()
def accuracy(model, x: torch.Tensor, y: np.ndarray) -> float:
    preds = torch.cat([model(pixel_values=b).logits.argmax(-1) for b in x.split(256)])
    return float(accuracy_score(y, preds.numpy()))


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    print(f"CPU threads: {configure_threads(args.num_threads)}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    images, labels = digits_on_canvas(args.canvas)
    idx_train, idx_test = train_test_split(np.arange(len(labels)), test_size=0.2, random_state=0, stratify=labels)
    x_train, y_train = images[idx_train], torch.tensor(labels[idx_train])
    x_test, y_test = images[idx_test], labels[idx_test]
    shifts = list(range(-args.max_shift, args.max_shift + 1))
    rows = []
    for option in args.options:
        for seed in range(args.seeds):
            start = time.perf_counter()
            model = train_one(args, option, seed, x_train, y_train)
            accs = {s: accuracy(model, shift_x(x_test, s), y_test) for s in shifts}
            rows += [{"option": option, "seed": seed, "shift": s, "accuracy": a} for s, a in accs.items()]
            print(f"{option:16s} seed {seed}: centred {accs[0]:.3f}, shift +-{args.max_shift}: "
                  f"{accs[-args.max_shift]:.3f} / {accs[args.max_shift]:.3f}  ({time.perf_counter() - start:.0f}s)",
                  flush=True)
    write_outputs(args, rows, shifts, out)
    return rows


def write_outputs(args, rows: list[dict], shifts: list[int], out: Path) -> None:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(out / "shift_robustness.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["option", "seed", "shift", "accuracy"])
        writer.writeheader()
        writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    shown = [s for s in shifts if s % 2 == 0 or abs(s) == args.max_shift]
    header = "| option | " + " | ".join(f"{s:+d}" for s in shown) + " | mean over shifts |"
    table = [header, "|---" * (len(shown) + 2) + "|"]
    for option in args.options:
        acc = np.array([[r["accuracy"] for r in rows if r["option"] == option and r["seed"] == seed]
                        for seed in range(args.seeds)])  # (seeds, shifts)
        mean = acc.mean(0)
        ax.plot(shifts, mean, marker="o", ms=3, label=option)
        ax.fill_between(shifts, acc.min(0), acc.max(0), alpha=0.2)
        cells = [f"{mean[shifts.index(s)]:.3f}" for s in shown]
        table.append(f"| `{option}` | " + " | ".join(cells) + f" | {mean.mean():.3f} |")
    ax.set_xlabel("shift along x (pixels; patch size %d)" % args.patch_size)
    ax.set_ylabel("test accuracy")
    ax.set_title(f"digits on a {args.canvas}x{args.canvas} canvas, trained centred; "
                 f"mean of {args.seeds} seeds, band = min..max", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "shift_robustness.png", dpi=120)
    plt.close(fig)
    text = "\n".join(table)
    (out / "shift_robustness.md").write_text(text + "\n")
    (out / "settings.json").write_text(json.dumps(vars(args), indent=1))
    print("\n" + text)
    print(f"\nwrote {out / 'shift_robustness.csv'}, {out / 'shift_robustness.png'}")


if __name__ == "__main__":
    main()
