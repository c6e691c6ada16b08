#!/usr/bin/env python
"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and Improving
Recall in Efficient Language Models"), scaled to a CPU: softmax attention against linear
attention and sliding-window hybrids, trained from scratch with the same budget.

The task. Token ids: 0 is filler, keys are ``1 .. K``, values ``K + 1 .. K + V`` (disjoint
ranges). A sequence of ``T`` tokens starts with ``P`` key-value pairs ``k_1 v_1 .. k_P v_P``
(distinct keys, values drawn at random), followed by two-token slots ``q 0`` in which keys of
the pairs come back as queries, after the pairs and in random order: with ``--queries once``
(Zoology's layout) each key once, in random slots; with ``--queries all`` (the default) every
slot holds one, each key at least once, so a sequence has ``(T - 2P) / 2`` answers to learn
from instead of ``P``. The model must output the queried key's value at the query position; the
loss and the accuracy count those positions only. Softmax attention solves this by looking back
at the token after the matching key; a recurrent state of fixed size must hold every pair at
once, which is where linear attention falls behind (Zoology, Based).

The models (``--models``): ``softmax`` (the stock ``transformers`` model: LlamaForCausalLM, or
GPT2LMHeadModel with ``--architecture gpt2``), Linear GPT with ``feature_map`` ``elu``, ``prf``
(positive random features) and ``hedgehog`` (learned), and ``windowW``: Linear GPT with
``softmax_window=W`` (exact softmax over the last ``W`` keys, ``--window_feature_map`` beyond).
All share one layout (``--architecture``: Llama's RMSNorm, gated MLP and rotary positions by
default; GPT-2's LayerNorm, GELU MLP and learned absolute positions), width, depth, heads, MLP
width, vocabulary and initialisation seed, differing only in attention, and train on the same
batches with the same optimiser (AdamW, linear warm-up then cosine decay, gradient clipping at
1). Each training step draws one ``(T, P)`` of the training grid in turn (``--seq_lens`` x
``--pairs``), so every model sees every difficulty; accuracy is measured on fresh sequences of
every ``(T, P)`` of the grid. ``--widths`` with more than one width repeats everything per width.

Why the defaults are what they are: learning MQAR from scratch is a phase transition; until a
model forms its lookup circuit it sits at accuracy ``1 / P`` (one of the values in the
context). On this budget a GPT-2 layout (learned absolute positions) stayed on that plateau for
10,000 steps (T in {32, 64}, P in {2, 4, 8}, each key queried once, lr 3e-3) and for 3,000
steps at T = 16, P = 2 with every slot queried (lr 3e-4 to 1e-3, width 64 or 128, 2 or 3
layers), while the Llama layout (rotary positions) with every slot queried left it within 1,500
steps at T = 16 and reached 0.94-0.99 at 3,000 steps on T in {32, 64}, P in {2, 4, 8} (Linear
GPT with hedgehog features, same budget: still 1 / P); hence the Llama layout, ``--queries
all`` and 8,000 steps by default. Where the softmax model stays near ``1 / P`` a run has not
shown where linear attention falls behind: raise ``--steps``.

Output (``--out``, default ``docs/figures``): ``mqar.json`` (every setting, and per model its
configuration, parameter count, state size, loss curve, training time and accuracy per
``(T, P)``), ``mqar.md`` (the table) and ``mqar.png`` (one panel per sequence length, accuracy
against the number of pairs, or against the width when several are given; one line per model,
as Zoology's figures). The data are deterministic given ``--seed``: batch ``i`` comes from a
generator seeded with ``(seed, i)``, whatever the model or the process.

Runtime: the defaults (6 models of width 64, 8,000 steps of 32 sequences of 32 or 64 tokens,
one thread per model, 2 models at a time) take about 30 minutes on 2 otherwise idle CPU cores,
extrapolated from a run of 5% of the steps (3,340 CPU seconds of training in all, the hybrids
the slowest at 0.09-0.11 s per step). Each model runs in its own process (``--workers``,
default 2) with one thread.

Commands::

    python examples/research/mqar.py                          # writes docs/figures/mqar.*
    python examples/research/mqar.py --steps 600 --out /tmp/mqar
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

FILLER = 0  # the token between pairs and queries; keys are 1 .. K, values K + 1 .. K + V
BASE_MODELS = ("softmax", "elu", "prf", "hedgehog")
DEFAULT_MODELS = ("softmax", "elu", "prf", "hedgehog", "window8", "window16")
RESULT_TAG = "MQAR_RESULT "


# ----------------------------------------------------------------------------- data


def mqar_batch(batch: int, seq_len: int, num_pairs: int, num_keys: int, num_values: int,
               generator: torch.Generator, fill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids (B, T)`` and ``targets (B, T)``: ``P`` pairs ``k v`` at positions ``0 .. 2P - 1``
    (keys distinct, from ``1 .. K``; values from ``K + 1 .. K + V``), then each key once as a query
    at position ``2P + 2s`` for ``P`` distinct random slots ``s < (T - 2P) // 2`` (``fill``: every
    slot holds a query, each key at least once, the other slots random keys of the pairs);
    ``targets`` holds the queried key's value at the query's position (the model predicts it
    there), -100 elsewhere. Everything else is ``FILLER``."""
    if num_pairs < 1 or num_pairs > num_keys:
        raise ValueError(f"num_pairs must be in [1, num_keys={num_keys}], got {num_pairs}")
    slots = (seq_len - 2 * num_pairs) // 2
    if slots < num_pairs:
        raise ValueError(f"seq_len={seq_len} has room for {max(slots, 0)} query slots after {num_pairs} pairs; "
                         f"it needs at least 4 * num_pairs = {4 * num_pairs} tokens")
    ids = torch.full((batch, seq_len), FILLER, dtype=torch.long)
    targets = torch.full((batch, seq_len), -100, dtype=torch.long)
    ctx = 2 * num_pairs
    for b in range(batch):
        keys = torch.randperm(num_keys, generator=generator)[:num_pairs] + 1
        values = torch.randint(0, num_values, (num_pairs,), generator=generator) + num_keys + 1
        ids[b, 0:ctx:2], ids[b, 1:ctx:2] = keys, values
        order = torch.randperm(num_pairs, generator=generator)  # which pair each query asks for
        if fill:
            order = torch.cat([order, torch.randint(0, num_pairs, (slots - num_pairs,), generator=generator)])
        pos = ctx + 2 * torch.randperm(slots, generator=generator)[:len(order)]
        ids[b, pos] = keys[order]
        targets[b, pos] = values[order]
    return ids, targets


def grid(seq_lens: Sequence[int], pairs: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(T, P)`` combinations with room for every query (``T >= 4 P``)."""
    return [(t, p) for t in seq_lens for p in pairs if t >= 4 * p]


def train_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Batch ``step`` of the training stream: the ``(T, P)`` of the grid in turn, from a
    generator seeded with ``(seed, step)``."""
    combos = grid(args.seq_lens, args.pairs)
    t, p = combos[step % len(combos)]
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    return (*mqar_batch(args.batch_size, t, p, args.num_keys, args.num_values, gen, args.queries == "all"), t, p)


# ----------------------------------------------------------------------------- models


def parse_model(name: str) -> tuple[str, Optional[int]]:
    """``"softmax"``, ``"elu"``, ``"prf"``, ``"hedgehog"`` -> ``(name, None)``; ``"windowW"`` ->
    ``("window", W)``."""
    if name in BASE_MODELS:
        return name, None
    if name.startswith("window") and name[6:].isdigit() and int(name[6:]) >= 1:
        return "window", int(name[6:])
    raise ValueError(f"unknown model {name!r}: use {', '.join(BASE_MODELS)} or windowW (e.g. window16)")


def build_model(name: str, width: int, args) -> torch.nn.Module:
    """The model ``name`` at ``width`` in ``args.architecture``'s layout, initialised from
    ``args.seed``: ``softmax`` is the stock ``transformers`` model (LlamaForCausalLM or
    GPT2LMHeadModel), the others Linear GPT with the same layout (Llama: RMSNorm, gated MLP,
    rotary positions on queries and keys; GPT-2: LayerNorm, GELU MLP, learned absolute
    positions), differing only in attention."""
    kind, window = parse_model(name)
    vocab = 1 + args.num_keys + args.num_values
    positions = max(args.seq_lens)
    llama = args.architecture == "llama"
    torch.manual_seed(args.seed)
    if kind == "softmax" and llama:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=width, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, intermediate_size=4 * width, max_position_embeddings=positions,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            attn_implementation="sdpa"))
    if kind == "softmax":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=args.layers, n_head=args.heads, n_inner=4 * width,
            n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, attn_implementation="sdpa"))
    from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM

    layout = (dict(norm_type="rmsnorm", mlp_type="gated", mlp_bias=False, attention_bias=False, hidden_act="silu",
                   position_embedding_type="rope", layer_norm_epsilon=1e-6) if llama else {})
    return LinearGPTForCausalLM(LinearGPTConfig(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=4 * width, max_position_embeddings=positions,
        feature_map=args.window_feature_map if kind == "window" else kind,
        num_random_features=args.num_random_features, softmax_window=window,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **layout))


def state_floats(model: torch.nn.Module, seq_len: int) -> int:
    """Numbers a decoding state holds per layer after ``seq_len`` tokens: keys and values of
    every token (softmax), ``H (M D + M)`` for ``(S, z)`` (linear; ``M`` features), plus the
    last ``W - 1`` raw keys, features and values (hybrid)."""
    cfg = model.config
    if cfg.model_type in ("gpt2", "llama"):
        return 2 * seq_len * cfg.hidden_size
    attn = model.transformer.h[0].attn
    h, d, m = attn.num_heads, attn.head_dim, attn.feature_map.num_features
    size = h * (m * d + m)
    if attn.softmax_window is not None:
        size += h * (attn.softmax_window - 1) * (d + m + d)
    return size


def query_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    keep = targets != -100
    return F.cross_entropy(logits[keep].float(), targets[keep])


@torch.no_grad()
def accuracy(model: torch.nn.Module, seq_len: int, pairs: int, args) -> tuple[float, int]:
    """Top-1 accuracy on the queries of ``args.eval_examples`` fresh sequences ``(T, P)`` (a
    generator seeded apart from training's), and the number of queries."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 999_983 * seq_len + pairs + 10**9)
    hits = total = 0
    left = args.eval_examples
    while left > 0:
        n = min(args.batch_size, left)
        ids, targets = mqar_batch(n, seq_len, pairs, args.num_keys, args.num_values, gen, args.queries == "all")
        logits = model(input_ids=ids, use_cache=False).logits
        keep = targets != -100
        hits += int((logits[keep].argmax(-1) == targets[keep]).sum())
        total += int(keep.sum())
        left -= n
    model.train()
    return hits / total, total


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The learning rate's multiplier at ``step``: linear warm-up over ``warmup`` steps, then a
    cosine decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


def run_job(name: str, width: int, args) -> dict:
    """Train one model and measure it: the record ``mqar.json`` keeps for it."""
    from hf_kernattn.training import optimizer_grouped_parameters

    model = build_model(name, width, args)
    model.train()
    opt = torch.optim.AdamW(optimizer_grouped_parameters(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, args.warmup, args.steps))
    curve, running, count = [], 0.0, 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        ids, targets, _, _ = train_batch(step, args)
        loss = query_loss(model(input_ids=ids, use_cache=False).logits, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running, count = running + float(loss.detach()), count + 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            curve.append([step + 1, running / count])
            print(f"[{name} w{width}] step {step + 1:5d}  query loss {running / count:.4f}  "
                  f"[{time.perf_counter() - started:.0f}s]", file=sys.stderr, flush=True)
            running, count = 0.0, 0
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    rows = []
    for t, p in grid(args.eval_seq_lens or args.seq_lens, args.eval_pairs or args.pairs):
        acc, queries = accuracy(model, t, p, args)
        rows.append({"seq_len": t, "num_pairs": p, "accuracy": acc, "queries": queries})
    cfg = {k: v for k, v in model.config.to_dict().items()
           if k in ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
                    "num_attention_heads", "n_head", "intermediate_size", "n_inner", "max_position_embeddings",
                    "n_positions", "feature_map", "num_random_features", "num_learned_features", "softmax_window",
                    "normalize_qk", "position_embedding_type", "feature_projection")}
    return {
        "model": name, "width": width, "config": cfg,
        "parameters": sum(p.numel() for p in model.parameters()),
        "state_floats_per_layer": state_floats(model, max(args.seq_lens)),
        "train_seconds": seconds, "train_cpu_seconds": cpu_seconds, "cpu_seconds_per_step": cpu_seconds / args.steps,
        "final_loss": curve[-1][1], "loss_curve": curve, "accuracy": rows,
    }


# ----------------------------------------------------------------------------- running


def _run_all(jobs: list[tuple[str, int]], args, argv: list[str]) -> list[dict]:
    """Every job in-process (``--workers 1``), or each in a fresh one-thread process, ``--workers``
    at a time; results in job order."""
    if args.workers == 1:
        torch.set_num_threads(1)
        return [run_job(name, width, args) for name, width in jobs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    pending, running, results = list(enumerate(jobs)), {}, {}
    while pending or running:
        while pending and len(running) < args.workers:
            i, (name, width) = pending.pop(0)
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--workers", "1", "--job", name, str(width)]
            running[i] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        for i, proc in list(running.items()):
            if proc.poll() is None:
                continue
            out = proc.stdout.read()
            del running[i]
            line = next((x for x in reversed(out.splitlines()) if x.startswith(RESULT_TAG)), None)
            if proc.returncode != 0 or line is None:
                for other in running.values():
                    other.kill()
                raise RuntimeError(f"the job {jobs[i]} failed (exit status {proc.returncode})")
            results[i] = json.loads(line[len(RESULT_TAG):])
        time.sleep(0.2)
    return [results[i] for i in range(len(jobs))]


def label(rec: dict, several_widths: bool) -> str:
    kind, window = parse_model(rec["model"])
    softmax = "Llama (softmax)" if rec["config"]["model_type"] == "llama" else "GPT-2 (softmax)"
    text = {"softmax": softmax, "elu": "Linear GPT, elu", "prf": "Linear GPT, prf",
            "hedgehog": "Linear GPT, hedgehog"}.get(kind) or f"hybrid, window {window}"
    return f"{text}, width {rec['width']}" if several_widths else text


def markdown(report: dict) -> str:
    """The table: one row per model (and width), one column per ``(T, P)``, then the state
    size and the training's CPU time (one thread)."""
    s = report["settings"]
    recs = report["models"]
    several = len(s["widths"]) > 1
    combos = [(r["seq_len"], r["num_pairs"]) for r in recs[0]["accuracy"]]
    head = ["model", *[f"T={t} P={p}" for t, p in combos], "state / layer", "train CPU s"]
    lines = [
        f"MQAR accuracy (top-1 on the queries, {s['eval_examples']} sequences per column; chance "
        f"{1 / s['num_values']:.3f}). {s['layers']} layers, {s['heads']} heads, width {', '.join(map(str, s['widths']))}, "
        f"{s['steps']} steps of batch {s['batch_size']}, AdamW lr {s['lr']}, {s['num_keys']} keys, "
        f"{s['num_values']} values. State: numbers per layer (softmax: its KV cache at T={max(s['seq_lens'])}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in recs:
        cells = [label(r, several), *[f"{a['accuracy']:.3f}" for a in r["accuracy"]],
                 f"{r['state_floats_per_layer']:,}", f"{r['train_cpu_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """One panel per sequence length; accuracy against the number of pairs (one width) or
    against the width (several, averaged over the pairs), one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = report["settings"]
    recs = report["models"]
    several = len(s["widths"]) > 1
    seq_lens = sorted({a["seq_len"] for a in recs[0]["accuracy"]})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(4.2 * len(seq_lens), 3.8), squeeze=False, sharey=True)
    names = list(dict.fromkeys(r["model"] for r in recs))
    for ax, t in zip(axes[0], seq_lens):
        for i, name in enumerate(names):
            mine = [r for r in recs if r["model"] == name]
            if several:
                xs = [r["width"] for r in mine]
                ys = [sum(a["accuracy"] for a in r["accuracy"] if a["seq_len"] == t)
                      / max(1, sum(a["seq_len"] == t for a in r["accuracy"])) for r in mine]
            else:
                pts = [(a["num_pairs"], a["accuracy"]) for a in mine[0]["accuracy"] if a["seq_len"] == t]
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", color=f"C{i}", label=label(mine[0], False))
        if not several:  # the plateau before a model learns the lookup: one of the P values in context
            ps = sorted({a["num_pairs"] for a in recs[0]["accuracy"] if a["seq_len"] == t})
            ax.plot(ps, [1 / p for p in ps], ls="--", color="grey", lw=0.8, label="1 / P")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("model width" if several else "key-value pairs")
        ax.set_title(f"sequence length {t}")
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(1 / s["num_values"], color="grey", lw=0.8, ls=":")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy" + (" (mean over pairs)" if several else ""))
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.suptitle(f"MQAR, {s['layers']} layers, {s['steps']} steps" + ("" if several else f", width {s['widths'][0]}"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                   help="softmax, elu, prf, hedgehog or windowW (default: %(default)s)")
    p.add_argument("--architecture", choices=("llama", "gpt2"), default="llama",
                   help="the layout every model shares: llama (RMSNorm, gated MLP, rotary positions; softmax: "
                        "LlamaForCausalLM) or gpt2 (LayerNorm, GELU MLP, learned absolute positions; softmax: "
                        "GPT2LMHeadModel) (default: %(default)s)")
    p.add_argument("--widths", type=int, nargs="+", default=[64], help="model widths (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (default: %(default)s)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (default: %(default)s)")
    p.add_argument("--seq_lens", type=int, nargs="+", default=[32, 64],
                   help="training sequence lengths T (default: %(default)s)")
    p.add_argument("--pairs", type=int, nargs="+", default=[2, 4, 8, 16],
                   help="training numbers of key-value pairs P (default: %(default)s)")
    p.add_argument("--eval_seq_lens", type=int, nargs="+", default=None, help="evaluated T (default: --seq_lens)")
    p.add_argument("--eval_pairs", type=int, nargs="+", default=None, help="evaluated P (default: --pairs)")
    p.add_argument("--queries", choices=("once", "all"), default="all",
                   help="once: each key queried once (Zoology); all: every free slot after the pairs holds a query "
                        "(each key at least once), more answers to learn from per sequence (default: %(default)s)")
    p.add_argument("--num_keys", type=int, default=64, help="key ids K (default: %(default)s)")
    p.add_argument("--num_values", type=int, default=64, help="value ids V (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8000, help="training steps per model (default: %(default)s)")
    p.add_argument("--batch_size", type=int, default=32, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps, then cosine (default: %(default)s)")
    p.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--num_random_features", type=int, default=64, help="prf: random features (default: %(default)s)")
    p.add_argument("--window_feature_map", default="hedgehog",
                   help="feature map of the hybrids' linear part (default: %(default)s)")
    p.add_argument("--eval_examples", type=int, default=256, help="sequences per evaluated (T, P) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the initialisation (default: %(default)s)")
    p.add_argument("--log_every", type=int, default=100, help="steps per loss-curve point (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2,
                   help="models trained at once, each in its own one-thread process; 1: in this process "
                        "(default: %(default)s)")
    p.add_argument("--out", default=str(ROOT / "docs" / "figures"),
                   help="folder for mqar.json, mqar.md and mqar.png (default: the repository's docs/figures)")
    p.add_argument("--job", nargs=2, metavar=("MODEL", "WIDTH"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("layers", "heads", "num_keys", "num_values", "steps", "batch_size", "eval_examples", "log_every",
                 "workers", "num_random_features"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for m in args.models:
        try:
            parse_model(m)
        except ValueError as err:
            p.error(str(err))
    if any(w < 1 or w % args.heads for w in args.widths):
        p.error(f"--widths must be positive multiples of --heads ({args.heads})")
    if max(args.pairs + (args.eval_pairs or [])) > args.num_keys:
        p.error("--pairs cannot exceed --num_keys (keys are distinct)")
    if not grid(args.seq_lens, args.pairs):
        p.error("no training (T, P) with T >= 4 P: lengthen --seq_lens or lower --pairs")
    if not grid(args.eval_seq_lens or args.seq_lens, args.eval_pairs or args.pairs):
        p.error("no evaluated (T, P) with T >= 4 P")
    if args.eval_seq_lens and max(args.eval_seq_lens) > max(args.seq_lens):
        p.error("--eval_seq_lens cannot exceed the longest --seq_lens (the position tables' size)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.job is not None:  # one model, in a worker process
        torch.set_num_threads(1)
        rec = run_job(args.job[0], int(args.job[1]), args)
        print(RESULT_TAG + json.dumps(rec), flush=True)
        return rec
    started = time.perf_counter()
    jobs = [(m, w) for w in args.widths for m in args.models]
    records = _run_all(jobs, args, argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("job", "out")}
    settings.update(vocab_size=1 + args.num_keys + args.num_values, train_grid=grid(args.seq_lens, args.pairs),
                    eval_grid=grid(args.eval_seq_lens or args.seq_lens, args.eval_pairs or args.pairs),
                    chance_accuracy=1 / args.num_values, threads_per_model=1, torch=torch.__version__,
                    wall_seconds=None)
    settings["wall_seconds"] = time.perf_counter() - started
    report = {"task": "mqar", "settings": settings, "models": records}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mqar.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "mqar.md").write_text(markdown(report), encoding="utf-8")
    plot(report, out / "mqar.png")
    print(markdown(report))
    print(f"wrote {out / 'mqar.json'}, {out / 'mqar.md'}, {out / 'mqar.png'} in {settings['wall_seconds']:.0f}s")
    return report


if __name__ == "__main__":
    main()
    raise SystemExit(0)
