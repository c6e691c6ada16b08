"""The README's main demo: a quick tour of what hf-kernattn does, with measured figures.

Each step is a function ``step(args) -> None`` in :data:`STEPS`, run in order.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable


def _step_attention(args: argparse.Namespace) -> None:
    """Attention core: the FFT path against exact softmax with a materialised RPE bias."""
    from .bench import attention

    bench_args = attention.build_parser().parse_args(["--quick", "--out", args.out])
    attention.run(bench_args)


# Ordered demo steps; families append theirs here.
STEPS: list[tuple[str, Callable[[argparse.Namespace], None]]] = [
    ("attention core: FFT relative positions vs exact softmax", _step_attention),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results/demo", help="folder for the CSVs and plots")


def run(args: argparse.Namespace) -> int:
    for title, step in STEPS:
        print(f"\n=== {title} ===", flush=True)
        start = time.perf_counter()
        step(args)
        print(f"[{title}: {time.perf_counter() - start:.1f}s]", flush=True)
    return 0
