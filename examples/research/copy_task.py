#!/usr/bin/env python
"""Sequence duplication (Katharopoulos et al. 2020, Sec. 4.1.1), scaled to a CPU.

Each example is ``s_1 .. s_n SEP s_1 .. s_n`` with ``s_i`` drawn from ``--symbols`` symbols and
``n`` uniform in ``[--min-len, --max-len]`` (shorter examples are right-padded; padding is
masked). A causal LM must reproduce the first half after the separator; the loss is the
cross-entropy on the copied half (the first half is random and cannot be predicted).

Linear GPT (kernelized attention, elu+1 features) and a ``transformers`` GPT-2 of the same
shape with softmax attention (SDPA) train side by side on the same batches with the same
optimiser. Writes both loss curves to a PNG and a CSV in ``--out`` (default
``outputs/copy_task/``) and reports the copy accuracy of greedy ``generate()`` on held-out
sequences. The figure committed with the project (``docs/figures/``) is only replaced when asked
for: ``--out docs/figures``.

Defaults take about 3 minutes on 2 CPU cores (one thread is enough)::

    python examples/research/copy_task.py
    python examples/research/copy_task.py --steps 300 --out /tmp/copy   # a quick look
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from transformers import get_scheduler  # noqa: E402

from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM  # noqa: E402
from hf_kernattn.training import (  # noqa: E402
    NUM_THREADS_HELP,
    WEIGHT_DECAY_HELP,
    configure_threads,
    optimizer_grouped_parameters,
)

PAD, SEP = 0, 1  # symbols are 2 .. symbols + 1


def make_batch(batch: int, symbols: int, min_len: int, max_len: int, gen: torch.Generator):
    """``input_ids (B, 2 max_len + 1)``, ``attention_mask`` and ``labels`` (-100 outside the copy)."""
    total = 2 * max_len + 1
    ids = torch.full((batch, total), PAD, dtype=torch.long)
    mask = torch.zeros(batch, total, dtype=torch.long)
    labels = torch.full((batch, total), -100, dtype=torch.long)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
    for b, n in enumerate(lengths.tolist()):
        s = torch.randint(2, symbols + 2, (n,), generator=gen)
        ids[b, :n], ids[b, n], ids[b, n + 1 : 2 * n + 1] = s, SEP, s
        mask[b, : 2 * n + 1] = 1
        labels[b, n + 1 : 2 * n + 1] = s
    return ids, mask, labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss: logits at t predict labels at t + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def build_models(args):
    vocab = args.symbols + 2
    torch.manual_seed(args.seed)
    linear = LinearGPTForCausalLM(LinearGPTConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden, max_position_embeddings=2 * args.max_len + 2, feature_map=args.feature_map,
        position_embedding_type=args.positions, pad_token_id=PAD, eos_token_id=None, bos_token_id=None,
    ))
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    softmax = GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_inner=4 * args.hidden,
        n_positions=2 * args.max_len + 2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa", pad_token_id=PAD, eos_token_id=None, bos_token_id=None,
    ))
    return {"linear (Linear GPT, elu+1)": linear, "softmax (GPT-2, SDPA)": softmax}


@torch.no_grad()
def copy_accuracy(model, args, gen: torch.Generator, n_eval: int = 64) -> float:
    """Fraction of held-out sequences (length max_len) that greedy generate() copies exactly."""
    model.eval()
    n = args.max_len
    s = torch.randint(2, args.symbols + 2, (n_eval, n), generator=gen)
    prompt = torch.cat([s, torch.full((n_eval, 1), SEP)], dim=1)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=PAD, eos_token_id=None)
    model.train()
    return (out[:, n + 1 :] == s).all(dim=1).float().mean().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--symbols", type=int, default=10)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--feature-map", default="elu")
    p.add_argument("--positions", default="absolute", choices=["absolute", "rotary"])
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps, then cosine decay (get_scheduler)")
    p.add_argument("--weight_decay", type=float, default=0.0, help=WEIGHT_DECAY_HELP + " (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_threads", type=int, default=None, help=NUM_THREADS_HELP)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--converged", type=float, default=0.05, help="loss below which a model counts as converged")
    p.add_argument("--out", default="outputs/copy_task",
                   help="folder for copy_task.png and copy_task.csv (default %(default)s; the committed figure is "
                        "docs/figures: pass --out docs/figures to replace it)")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("--min-len must be in [1, --max-len]")
    for name in ("steps", "batch", "symbols", "hidden", "layers", "heads", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    print(f"CPU threads: {configure_threads(args.num_threads)}")

    models = build_models(args)
    opts = {k: torch.optim.AdamW(optimizer_grouped_parameters(m, args.weight_decay), lr=args.lr)
            for k, m in models.items()}
    sched = {k: get_scheduler("cosine", o, num_warmup_steps=args.warmup, num_training_steps=args.steps)
             for k, o in opts.items()}
    for m in models.values():
        m.train()
    gen = torch.Generator().manual_seed(args.seed)
    history = {k: [] for k in models}
    running = {k: 0.0 for k in models}
    seconds = {k: 0.0 for k in models}
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, mask, labels = make_batch(args.batch, args.symbols, args.min_len, args.max_len, gen)
        for name, model in models.items():
            t0 = time.perf_counter()
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            loss = lm_loss(logits, labels)
            opts[name].zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
            sched[name].step()
            seconds[name] += time.perf_counter() - t0
            running[name] += loss.item()
        if step % args.log_every == 0:
            line = [f"step {step:5d}"]
            for name in models:
                history[name].append((step, running[name] / args.log_every))
                line.append(f"{name.split()[0]} {running[name] / args.log_every:.4f}")
                running[name] = 0.0
            print("  ".join(line) + f"  [{time.perf_counter() - started:.0f}s]", flush=True)

    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    results = []
    for name, model in models.items():
        final = sum(l for _, l in history[name][-4:]) / max(1, len(history[name][-4:]))
        first_conv = next((s for s, l in history[name] if l < args.converged), None)
        acc = copy_accuracy(model, args, eval_gen)
        results.append({"model": name, "final_loss": final, "first_step_below": first_conv, "copy_accuracy": acc,
                        "train_seconds": seconds[name]})
        print(f"{name:28s} final loss {final:.4f}  below {args.converged} from step {first_conv}  "
              f"greedy copy accuracy {acc:.3f}  train time {seconds[name]:.0f}s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "copy_task.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + list(models))
        for i in range(len(history[next(iter(models))])):
            w.writerow([history[next(iter(models))][i][0]] + [f"{history[k][i][1]:.5f}" for k in models])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in models:
        ax.plot([s for s, _ in history[name]], [l for _, l in history[name]], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy on the copied half")
    ax.set_title(f"copy task: {args.symbols} symbols, length {args.min_len}-{args.max_len}, "
                 f"{args.layers}x{args.hidden}, {args.heads} heads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "copy_task.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'copy_task.png'} and {out / 'copy_task.csv'} in {time.perf_counter() - started:.0f}s")
    linear = results[0]
    if linear["final_loss"] >= args.converged:
        print(f"WARNING: linear attention did not reach loss {args.converged} in {args.steps} steps")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
