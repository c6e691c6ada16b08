#!/usr/bin/env python
"""Convert a softmax GPT-2 into a Linear GPT, fine-tune it briefly with ``Trainer``, and generate
with the constant-size state.

1. GPT-2: ``--model_name_or_path`` (a local GPT-2 checkpoint, or a Hub id online), or a small
   ``GPT2LMHeadModel`` trained here with ``Trainer`` for ``--gpt2_steps`` steps.
2. ``hf_kernattn.convert.convert_to_linear_gpt``: every GPT-2 weight copied exactly, positive
   random features (``--num_random_features``) estimating GPT-2's own ``exp(q . k / sqrt(d))``.
3. ``Trainer`` fine-tunes the Linear GPT for ``--finetune_steps`` steps on the same text.
4. One evaluation function (``Trainer.evaluate`` on the same validation blocks) gives the loss
   and perplexity of GPT-2 before conversion, of the Linear GPT right after it and after
   fine-tuning: ``results.json``, ``results.md`` and ``finetune_converted.png`` in ``--output_dir``.
5. ``generate()`` continues a validation prompt with the recurrent state; the state's size is
   printed after ``--generate_tokens`` and twice as many tokens (it does not grow).

Text: ``--train_file`` / ``--validation_file`` (plain text), or by default the Python standard
library's own source files (on every machine, offline), split by file. Tokens: bytes (256 +
``<|endoftext|>``), the byte-level tokenizer of ``run_clm.py``.

    python examples/finetune_converted.py --output_dir out/finetune_converted
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
from transformers.utils import logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_clm import EOS, build_tokenizer  # noqa: E402  (the byte tokenizer of the CLM example)

logger = logging.get_logger("finetune_converted")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--train_file", help="plain-text training file (default: the Python standard library's sources)")
    p.add_argument("--validation_file", help="plain-text validation file (with --train_file)")
    p.add_argument("--max_chars", type=int, default=3_000_000, help="characters of the default corpus to use")
    p.add_argument("--model_name_or_path", help="a GPT-2 checkpoint to convert instead of training one here")
    p.add_argument("--block_size", type=int, default=128, help="tokens per training block (and GPT-2's position table)")
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--gpt2_steps", type=int, default=600, help="training steps of the GPT-2 trained here")
    p.add_argument("--finetune_steps", type=int, default=200, help="fine-tuning steps of the converted Linear GPT")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=1e-3, help="GPT-2 training")
    p.add_argument("--finetune_learning_rate", type=float, default=3e-4)
    p.add_argument("--num_random_features", type=int, default=128, help="PRF features per head of the Linear GPT")
    p.add_argument("--eval_steps", type=int, default=50, help="evaluate every this many steps (the plot's points)")
    p.add_argument("--max_eval_blocks", type=int, default=128, help="validation blocks evaluated")
    p.add_argument("--generate_tokens", type=int, default=48,
                   help="new tokens of the generation (then twice as many, to show the state does not grow)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if bool(args.train_file) != bool(args.validation_file):
        p.error("give both --train_file and --validation_file, or neither")
    for name in ("block_size", "gpt2_steps", "finetune_steps", "batch_size", "eval_steps", "max_eval_blocks",
                 "generate_tokens", "num_random_features", "max_chars"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def default_corpus(max_chars: int) -> tuple[str, str]:
    """Train / validation text from the standard library's ``.py`` files (sorted; every 20th
    file goes to validation), up to ``max_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid, size = [], [], 0
    for i, path in enumerate(sorted(root.glob("*.py"))):
        text = path.read_text(encoding="utf-8", errors="replace")
        (valid if i % 20 == 0 else train).append(text)
        size += len(text)
        if size >= max_chars:
            break
    return EOS.join(train), EOS.join(valid)


def blocks(tokenizer, text: str, block_size: int, limit: int | None = None) -> Dataset:
    """Consecutive blocks of ``block_size`` token ids (labels = inputs; the model shifts)."""
    ids = tokenizer(text)["input_ids"]
    n = len(ids) // block_size
    if limit is not None:
        n = min(n, limit)
    rows = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def training_args(out: Path, steps: int, lr: float, args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=lr, lr_scheduler_type="cosine",
        warmup_steps=min(100, steps // 10), weight_decay=0.01, eval_strategy="steps",
        eval_steps=min(args.eval_steps, steps), logging_steps=min(args.eval_steps, steps), save_strategy="no",
        report_to=[], seed=args.seed, data_seed=args.seed, use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, disable_tqdm=True,
    )


def curve(trainer: Trainer) -> list[tuple[int, float]]:
    """(step, validation loss) of every evaluation of a training run."""
    return [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]


def evaluate(model, eval_set: Dataset, out: Path, args: argparse.Namespace) -> float:
    """Mean next-token loss over the validation blocks, the same for every model."""
    trainer = Trainer(model=model, args=training_args(out, 1, 1e-4, args), eval_dataset=eval_set)
    return float(trainer.evaluate()["eval_loss"])


def state_bytes(cache) -> int:
    """Bytes of every tensor a decoding state holds."""
    return sum(x.numel() * x.element_size() for layer in cache.layers for x in layer.get_state() if x is not None)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.set_verbosity_info()
    set_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.train_file:
        train_text = Path(args.train_file).read_text(encoding="utf-8")
        valid_text = Path(args.validation_file).read_text(encoding="utf-8")
    else:
        train_text, valid_text = default_corpus(args.max_chars)
    tokenizer = build_tokenizer("byte", [], 0, args.block_size)
    train_set = blocks(tokenizer, train_text, args.block_size)
    eval_set = blocks(tokenizer, valid_text, args.block_size, args.max_eval_blocks)
    if len(train_set) == 0 or len(eval_set) == 0:
        raise ValueError(f"the text gives no block of --block_size={args.block_size} tokens (train or validation)")
    logger.info(f"{len(train_set)} training and {len(eval_set)} validation blocks of {args.block_size} tokens")

    # 1. GPT-2: given, or trained here
    gpt2_curve: list[tuple[int, float]] = []
    if args.model_name_or_path:
        gpt2_dir = args.model_name_or_path
        gpt2 = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    else:
        gpt2_dir = str(out / "gpt2")
        gpt2 = GPT2LMHeadModel(GPT2Config(
            vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
            n_head=args.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        trainer = Trainer(model=gpt2, args=training_args(out / "gpt2_run", args.gpt2_steps, args.learning_rate, args),
                          train_dataset=train_set, eval_dataset=eval_set)
        trainer.train()
        gpt2_curve = curve(trainer)
        gpt2.save_pretrained(gpt2_dir)
        tokenizer.save_pretrained(gpt2_dir)
    gpt2_loss = evaluate(gpt2, eval_set, out / "eval", args)

    # 2. conversion: exact copies, new random features
    from hf_kernattn.convert import convert_to_linear_gpt

    linear = convert_to_linear_gpt(gpt2_dir, num_random_features=args.num_random_features)
    converted_loss = evaluate(linear, eval_set, out / "eval", args)

    # 3. fine-tuning with Trainer
    linear.train()
    trainer = Trainer(model=linear, args=training_args(out / "finetune_run", args.finetune_steps,
                                                       args.finetune_learning_rate, args),
                      train_dataset=train_set, eval_dataset=eval_set)
    trainer.train()
    finetune_curve = curve(trainer)
    linear.eval()
    finetuned_loss = evaluate(linear, eval_set, out / "eval", args)

    # 4. generation with the constant-size state (GPT-2's absolute positions bound the length)
    prompt = tokenizer(valid_text[:200], return_tensors="pt")["input_ids"][:, :32]
    limit = linear.config.max_position_embeddings
    if prompt.shape[1] + 2 * args.generate_tokens > limit:
        raise ValueError(f"--generate_tokens={args.generate_tokens}: the prompt ({prompt.shape[1]}) plus twice that "
                         f"exceeds the {limit} positions of the converted GPT-2")
    sizes = {}
    with torch.no_grad():
        for n in (args.generate_tokens, 2 * args.generate_tokens):
            gen = linear.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
            sizes[n] = state_bytes(gen.past_key_values)
            if n == args.generate_tokens:
                sample = tokenizer.decode(gen.sequences[0, prompt.shape[1]:])
    final_dir = out / "linear_gpt"
    linear.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    from hf_kernattn.cards import save_model_card

    stages = [("GPT-2 (softmax), before conversion", gpt2_loss), ("Linear GPT, right after conversion", converted_loss),
              (f"Linear GPT, after {args.finetune_steps} fine-tuning steps", finetuned_loss)]
    save_model_card(linear, final_dir, base_model=gpt2_dir, results=[
        {"task": "text-generation", "dataset": "validation text", "metric": "perplexity", "value": round(math.exp(finetuned_loss), 3)}],
        training={"converted from": f"`{gpt2_dir}` (GPT-2)", "fine-tuning steps": args.finetune_steps})
    results = {
        "stages": [{"stage": s, "loss": loss, "perplexity": math.exp(loss)} for s, loss in stages],
        "gpt2_curve": gpt2_curve, "finetune_curve": finetune_curve, "sample": sample,
        "state_bytes": {str(k): v for k, v in sizes.items()}, "seconds": time.perf_counter() - started,
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "conversion": {"copied": len(linear.conversion_report["copied"]),
                       "initialised": linear.conversion_report["initialised"]},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = ["| stage | validation loss (nats/byte) | perplexity |", "|---|---|---|"]
    table += [f"| {s} | {loss:.4f} | {math.exp(loss):.3f} |" for s, loss in stages]
    (out / "results.md").write_text("\n".join(table) + "\n")
    plot(results, out / "finetune_converted.png", args)
    print("\n".join(table))
    print(f"state after {args.generate_tokens} new tokens: {sizes[args.generate_tokens]} bytes; "
          f"after {2 * args.generate_tokens}: {sizes[2 * args.generate_tokens]} bytes")
    print(f"sample: {sample[:160]!r}")
    print(f"wrote {out / 'results.md'}, {out / 'finetune_converted.png'} and {final_dir} in {results['seconds']:.0f} s")
    return results


def plot(results: dict, path: Path, args: argparse.Namespace) -> None:
    """Validation loss: GPT-2 while it trains, the Linear GPT right after conversion and while it
    is fine-tuned (its steps counted after GPT-2's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offset = results["gpt2_curve"][-1][0] if results["gpt2_curve"] else 0
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if results["gpt2_curve"]:
        ax.plot(*zip(*results["gpt2_curve"]), marker="o", ms=3, label="GPT-2 (softmax) training")
    conv = results["stages"][1]["loss"]
    fine = [(offset, conv)] + [(offset + s, loss) for s, loss in results["finetune_curve"]]
    ax.plot(*zip(*fine), marker="o", ms=3, label="Linear GPT: converted, then fine-tuned")
    ax.axhline(results["stages"][0]["loss"], color="gray", ls="--", lw=1, label="GPT-2 before conversion")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("Converting GPT-2 into Linear GPT and fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
