"""The README's main demo: a quick tour of what hf-kernattn does, with measured figures.

Each step is a function ``step(args) -> None`` in :data:`STEPS`, run in order; :data:`FIGURES`
names the plots each writes (listed before the first step, so a user knows where to look).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable


def _step_attention(args: argparse.Namespace) -> None:
    """Attention core: the FFT path against exact softmax with a materialised RPE bias."""
    from .bench import attention

    attention.run(attention.build_parser().parse_args(["--quick", "--out", f"{args.out}/attention"]))


def _step_linear_gpt(args: argparse.Namespace) -> None:
    """Linear GPT: generate() with a constant-size recurrent state vs recomputing vs GPT-2 + KV cache."""
    import torch

    from . import LinearGPTConfig, LinearGPTForCausalLM
    from .modeling.cache import CACHE_FIELD
    from .bench import generate as bench_generate

    torch.manual_seed(0)
    model = LinearGPTForCausalLM(LinearGPTConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=4200,
        pad_token_id=0, eos_token_id=None,
    )).eval()
    for n in (64, 4096):
        out = model.generate(torch.randint(1, 256, (1, n)), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        state = getattr(out, CACHE_FIELD)  # past_key_values (transformers < 5.24) or cache
        size = sum(x.numel() * x.element_size() for layer in state.layers for x in layer.get_state() if x is not None)
        print(f"prompt of {n:5d} tokens -> state after generate(): {type(state).__name__}, "
              f"{state.get_seq_length()} positions seen, {size / 1024:.1f} KiB (does not grow with the context)")
    bench_generate.run(bench_generate.build_parser().parse_args(["--quick", "--out", f"{args.out}/generate"]))


# Ordered demo steps; families append theirs here.
STEPS: list[tuple[str, Callable[[argparse.Namespace], None]]] = [
    ("attention core: FFT relative positions vs exact softmax", _step_attention),
    ("Linear GPT: stateful generate() and its decoding speed", _step_linear_gpt),
]


# The plots each step writes (under --out) and what they show.
FIGURES: dict[str, list[tuple[str, str]]] = {
    STEPS[0][0]: [("attention/attention_bench.png", "attention time and peak memory against N, every case")],
    STEPS[1][0]: [("generate/generate.png", "decode latency per token and decoding state against the context")],
}


def _figures(args: argparse.Namespace, title: str) -> list[str]:
    return [f"  open {Path(args.out) / path}   ({what})" for path, what in FIGURES.get(title, [])]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_results/demo",
                        help="folder for the CSVs and plots (each benchmark in a sub-folder named after it)")


def run(args: argparse.Namespace) -> int:
    shown = [line for title, _ in STEPS for line in _figures(args, title)]
    if shown:
        print("The demo measures as it goes (progress below) and draws its plots; when a step ends:", flush=True)
        print("\n".join(shown), flush=True)
    for title, step in STEPS:
        print(f"\n=== {title} ===", flush=True)
        start = time.perf_counter()
        step(args)
        print(f"[{title}: {time.perf_counter() - start:.1f}s]", flush=True)
        for line in _figures(args, title):
            print(line, flush=True)
    return 0
