#!/usr/bin/env python
"""Convert a softmax GPT-2 into a Linear GPT, fine-tune it briefly with ``Trainer``, and generate
with the constant-size state.

1. GPT-2: ``--model_name_or_path`` (a local GPT-2 checkpoint with its tokenizer, or a Hub id
   online), or a small ``GPT2LMHeadModel`` trained here with ``Trainer`` for ``--gpt2_steps``
   steps and saved (safetensors) in ``OUTPUT_DIR/gpt2``.
2. ``hf_kernattn.convert.convert_to_linear_gpt``: every GPT-2 weight copied exactly, positive
   random features (``--num_random_features``) estimating GPT-2's own ``exp(q . k / sqrt(d))``;
   the converted model is saved Hub-ready in ``OUTPUT_DIR/linear_gpt_converted``.
3. ``Trainer`` fine-tunes the Linear GPT for ``--finetune_steps`` steps on the same text; saved
   Hub-ready (weights, code, tokenizer, model card) in ``OUTPUT_DIR/linear_gpt``.
4. One evaluation function (``Trainer.evaluate`` on the same validation blocks) gives the loss
   and perplexity of GPT-2 before conversion, of the Linear GPT right after it and after
   fine-tuning, beside a unigram baseline (training-text token frequencies): ``results.json``,
   ``results.md`` and ``finetune_converted.png`` in ``--output_dir``.
5. ``generate()`` continues a prompt with the recurrent state: greedy ``--generate_tokens``
   tokens, then as many more continued from the returned state (the state's size is printed
   after each: it does not grow, and the continuation equals one greedy call of twice the
   length), and a sampled continuation as the sample.

Text: ``--train_file`` / ``--validation_file`` (plain text), or by default the Python standard
library's own source files (on every machine, offline), every 20th file (sorted by name) for
validation. Tokens: bytes (256 + ``<|endoftext|>``), the byte-level tokenizer of ``run_clm.py``.

    python examples/research/finetune_converted.py --output_dir out/finetune_converted
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from datasets import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, Trainer,
                          TrainingArguments, set_seed)
from transformers.utils import logging

from hf_kernattn_cli import docstring_summary  # (the command line's text helpers, without importing the package)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, beside research/
from run_clm import EOS, build_tokenizer  # noqa: E402  (the byte tokenizer of the CLM example)

from hf_kernattn.training import NUM_THREADS_HELP, configure_threads  # noqa: E402

logger = logging.get_logger("finetune_converted")


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of the text, the tokens and the softmax GPT-2 (given or trained here), shared
    with ``linearize_compare.py``."""
    p.add_argument("--output_dir", required=True, help="folder for the models, results.json/.md and the plot")
    p.add_argument("--train_file", help="plain-text training file (default: the Python standard library's sources)")
    p.add_argument("--validation_file", help="plain-text validation file (with --train_file)")
    p.add_argument("--max_chars", type=int, default=3_000_000, help="characters of the default corpus to use")
    p.add_argument("--model_name_or_path",
                   help="a GPT-2 checkpoint (with its tokenizer) to convert instead of training one here")
    p.add_argument("--block_size", type=int, default=128, help="tokens per training block (and GPT-2's position table)")
    p.add_argument("--n_embd", type=int, default=128, help="width of the GPT-2 trained here")
    p.add_argument("--n_layer", type=int, default=4, help="layers of the GPT-2 trained here")
    p.add_argument("--n_head", type=int, default=4, help="heads of the GPT-2 trained here")
    p.add_argument("--gpt2_steps", type=int, default=1200, help="training steps of the GPT-2 trained here")


def check_source_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...],
                           rates: tuple[str, ...]) -> None:
    """``p.error`` for a bad argument of :func:`add_source_arguments` or among ``positive`` (ints
    that must be >= 1) and ``rates`` (numbers that must be > 0)."""
    if bool(args.train_file) != bool(args.validation_file):
        p.error("give both --train_file and --validation_file, or neither")
    for name in ("block_size", "gpt2_steps", "max_chars", "n_embd", "n_layer", "n_head", *positive):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in rates:
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        p.error(f"--n_embd ({args.n_embd}) must be divisible by --n_head ({args.n_head})")
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num_threads must be >= 1, got {args.num_threads}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=docstring_summary(__doc__),
                                epilog="example: python examples/research/finetune_converted.py --output_dir out/finetune_converted")
    add_source_arguments(p)
    p.add_argument("--finetune_steps", type=int, default=200, help="fine-tuning steps of the converted Linear GPT")
    p.add_argument("--batch_size", type=int, default=16, help="blocks per training step (both trainings)")
    p.add_argument("--learning_rate", type=float, default=2e-3, help="learning rate of the GPT-2 trained here")
    p.add_argument("--finetune_learning_rate", type=float, default=3e-4,
                   help="learning rate of the Linear GPT's fine-tuning")
    p.add_argument("--num_random_features", type=int, default=128, help="PRF features per head of the Linear GPT")
    p.add_argument("--feature_seed", type=int, default=0, help="seed of the Linear GPT's random feature projections")
    p.add_argument("--eval_steps", type=int, default=50, help="evaluate every this many steps (the plot's points)")
    p.add_argument("--max_eval_blocks", type=int, default=128, help="validation blocks evaluated")
    p.add_argument("--prompt", help="generation prompt (default: the first 32 tokens of the validation text)")
    p.add_argument("--generate_tokens", type=int, default=48,
                   help="new tokens per generation call (then as many more from the returned state)")
    p.add_argument("--seed", type=int, default=0, help="seed of data order, initialisation and sampling")
    p.add_argument("--num_threads", type=int, default=None, help=NUM_THREADS_HELP)
    args = p.parse_args(argv)
    check_source_arguments(p, args, ("finetune_steps", "batch_size", "eval_steps", "max_eval_blocks", "generate_tokens",
                                     "num_random_features"), ("learning_rate", "finetune_learning_rate"))
    if args.prompt is not None and not args.prompt:
        p.error("--prompt must not be empty")
    return args


def default_corpus(max_chars: int, separator: str) -> tuple[str, str]:
    """Train / validation text from the standard library's ``.py`` files (sorted by name; every
    20th file goes to validation), up to ``max_chars`` characters, files joined by ``separator``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid, size = [], [], 0
    for i, path in enumerate(sorted(root.glob("*.py"))):
        text = path.read_text(encoding="utf-8", errors="replace")
        (valid if i % 20 == 0 else train).append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not train or not valid:
        raise ValueError(f"the standard library at {root} gave too little text; pass --train_file/--validation_file")
    return separator.join(train), separator.join(valid)


def blocks(ids: list[int], block_size: int, limit: int | None = None) -> Dataset:
    """Consecutive blocks of ``block_size`` token ids (labels = inputs; the model shifts)."""
    n = len(ids) // block_size
    if limit is not None:
        n = min(n, limit)
    rows = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def unigram_loss(train_ids: list[int], eval_set: Dataset, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of the tokens the models predict in ``eval_set`` (every
    block's tokens after its first) under the training text's token frequencies (add-one)."""
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    targets = torch.tensor(eval_set["labels"])[:, 1:]
    return float(-log_p[targets].mean())


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


def load_source(args: argparse.Namespace):
    """The tokenizer and, for ``--model_name_or_path``, the softmax model to convert."""
    if not args.model_name_or_path:
        return build_tokenizer("byte", [], 0, args.block_size), None
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model_name_or_path {args.model_name_or_path}: no tokenizer beside the model ({err})") from None
    limit = model.config.max_position_embeddings
    if args.block_size > limit:
        raise ValueError(f"--block_size={args.block_size} exceeds the {limit} positions of {args.model_name_or_path}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


def generate_demo(model, tokenizer, prompt_ids: torch.Tensor, n: int, seed: int) -> dict:
    """Greedy ``n`` tokens, then ``n`` more continued from the returned state (its size after
    each), compared with one greedy call of ``2n``; and a sampled ``n``-token continuation."""
    common = dict(attention_mask=torch.ones_like(prompt_ids), pad_token_id=tokenizer.pad_token_id,
                  return_dict_in_generate=True)
    with torch.no_grad():
        first = model.generate(prompt_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **common)
        state = first.past_key_values
        after_n = {"bytes": state_bytes(state), "tokens_in_state": state.get_seq_length(),
                   "shapes": [list(x.shape) for x in state.layers[0].get_state() if x is not None]}
        seq = first.sequences
        more = model.generate(seq, attention_mask=torch.ones_like(seq), past_key_values=state, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              return_dict_in_generate=True)
        after_2n = {"bytes": state_bytes(more.past_key_values), "tokens_in_state": more.past_key_values.get_seq_length(),
                    "shapes": [list(x.shape) for x in more.past_key_values.layers[0].get_state() if x is not None]}
        once = model.generate(prompt_ids, max_new_tokens=2 * n, min_new_tokens=2 * n, do_sample=False, **common)
        set_seed(seed)
        sampled = model.generate(prompt_ids, max_new_tokens=n, min_new_tokens=n, do_sample=True, top_p=0.9,
                                 temperature=0.8, **common)
    p = prompt_ids.shape[1]
    return {
        "prompt": tokenizer.decode(prompt_ids[0]),
        "new_tokens": [first.sequences.shape[1] - p, more.sequences.shape[1] - first.sequences.shape[1]],
        "state_after_n": after_n, "state_after_2n": after_2n,
        "greedy": tokenizer.decode(more.sequences[0, p:]),
        "continued_equals_one_call": bool(torch.equal(more.sequences, once.sequences)),
        "sampled": tokenizer.decode(sampled.sequences[0, p:]),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.set_verbosity_info()
    logger.info(f"CPU threads: {configure_threads(args.num_threads)}")
    set_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The Trainers save nothing (save_strategy="no"): their output folders are scratch space, removed
    # at the end, so that only the results and the three models are left in --output_dir.
    scratch = Path(tempfile.mkdtemp(prefix="finetune_converted_"))
    try:
        return _run(args, out, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class SourceData(NamedTuple):
    """The text, its tokens and blocks (see :func:`load_data`)."""

    train_text: str
    valid_text: str
    train_ids: list
    valid_ids: list
    train_set: Dataset
    eval_set: Dataset


def load_data(args: argparse.Namespace, tokenizer) -> SourceData:
    """The training and validation text (``--train_file``/``--validation_file`` or the default
    corpus), tokenized and cut into blocks of ``--block_size`` (at most ``--max_eval_blocks``
    validation blocks)."""
    if args.train_file:
        from hf_kernattn.training import check_text_files

        check_text_files([args.train_file], "--train_file")
        check_text_files([args.validation_file], "--validation_file")
        train_text = Path(args.train_file).read_text(encoding="utf-8")
        valid_text = Path(args.validation_file).read_text(encoding="utf-8")
    else:
        train_text, valid_text = default_corpus(args.max_chars, tokenizer.eos_token or EOS)
    train_ids = tokenizer(train_text)["input_ids"]
    valid_ids = tokenizer(valid_text)["input_ids"]
    train_set = blocks(train_ids, args.block_size)
    eval_set = blocks(valid_ids, args.block_size, args.max_eval_blocks)
    if len(train_set) == 0 or len(eval_set) == 0:
        raise ValueError(f"the text gives no block of --block_size={args.block_size} tokens (train or validation)")
    logger.info(f"{len(train_set)} training and {len(eval_set)} validation blocks of {args.block_size} tokens")
    return SourceData(train_text, valid_text, train_ids, valid_ids, train_set, eval_set)


def prepare_teacher(args: argparse.Namespace, tokenizer, gpt2, data: SourceData, out: Path, scratch: Path):
    """The softmax GPT-2: ``gpt2`` loaded from ``--model_name_or_path``, or (``gpt2`` None) one
    trained here with Trainer (``--gpt2_steps`` at ``--learning_rate``) and saved with the
    tokenizer in ``out/gpt2``. Returns ``(folder, model, [(step, validation loss)...])``."""
    if gpt2 is not None:
        return args.model_name_or_path, gpt2, []
    gpt2_dir = str(out / "gpt2")
    gpt2 = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    trainer = Trainer(model=gpt2, args=training_args(scratch / "gpt2_run", args.gpt2_steps, args.learning_rate, args),
                      train_dataset=data.train_set, eval_dataset=data.eval_set)
    trainer.train()
    gpt2.save_pretrained(gpt2_dir)
    tokenizer.save_pretrained(gpt2_dir)
    return gpt2_dir, gpt2, curve(trainer)


def _run(args: argparse.Namespace, out: Path, scratch: Path) -> dict:
    started = time.perf_counter()
    tokenizer, gpt2 = load_source(args)
    data = load_data(args, tokenizer)
    train_ids, valid_ids, train_set, eval_set = data.train_ids, data.valid_ids, data.train_set, data.eval_set

    # 1. GPT-2: given, or trained here
    gpt2_dir, gpt2, gpt2_curve = prepare_teacher(args, tokenizer, gpt2, data, out, scratch)
    source_name = "GPT-2" if gpt2.config.model_type == "gpt2" else gpt2.config.model_type
    gpt2_loss = evaluate(gpt2, eval_set, scratch / "eval", args)
    vocab_size = gpt2.config.vocab_size
    del gpt2

    # 2. conversion: exact copies, new random features; saved Hub-ready as converted
    from hf_kernattn.cards import save_model_card
    from hf_kernattn.convert import convert_to_linear_gpt

    linear = convert_to_linear_gpt(gpt2_dir, out / "linear_gpt_converted", num_random_features=args.num_random_features,
                                   feature_seed=args.feature_seed, overwrite_output_dir=True)  # this script's own folder
    report = linear.conversion_report
    converted_loss = evaluate(linear, eval_set, scratch / "eval", args)

    # 3. fine-tuning with Trainer
    set_seed(args.seed)
    trainer = Trainer(model=linear, args=training_args(scratch / "finetune_run", args.finetune_steps,
                                                       args.finetune_learning_rate, args),
                      train_dataset=train_set, eval_dataset=eval_set)
    trainer.train()
    finetune_curve = curve(trainer)
    linear.eval()
    finetuned_loss = evaluate(linear, eval_set, scratch / "eval", args)

    # 4. generation with the constant-size state (GPT-2's absolute positions bound the length)
    if args.prompt is not None:
        prompt = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        prompt = torch.tensor([valid_ids[:32]])
    limit = linear.config.max_position_embeddings
    if prompt.shape[1] + 2 * args.generate_tokens > limit:
        raise ValueError(f"--generate_tokens={args.generate_tokens}: the prompt ({prompt.shape[1]} tokens) plus twice that "
                         f"exceeds the {limit} positions of the converted model")
    generation = generate_demo(linear, tokenizer, prompt, args.generate_tokens, args.seed)

    final_dir = out / "linear_gpt"
    linear.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    unit = "nats/byte" if vocab_size == 257 and tokenizer.convert_ids_to_tokens(256) == EOS else "nats/token"
    unigram = unigram_loss(train_ids, eval_set, vocab_size)
    stages = [(f"{source_name} (softmax), before conversion", gpt2_loss),
              ("Linear GPT, right after conversion", converted_loss),
              (f"Linear GPT, after {args.finetune_steps} fine-tuning steps", finetuned_loss)]
    save_model_card(linear, final_dir, base_model=gpt2_dir, results=[
        {"task": "text-generation", "dataset": "validation text", "metric": "perplexity", "value": round(math.exp(finetuned_loss), 3)}],
        training={"converted from": f"`{gpt2_dir}` ({source_name})", "fine-tuning steps": args.finetune_steps,
                  "fine-tuning learning rate": args.finetune_learning_rate})
    results = {
        "stages": [{"stage": s, "loss": loss, "perplexity": math.exp(loss)} for s, loss in stages],
        "unigram_baseline": {"loss": unigram, "perplexity": math.exp(unigram)}, "unit": unit,
        "gpt2_curve": gpt2_curve, "finetune_curve": finetune_curve, "generation": generation,
        "blocks": {"train": len(train_set), "validation": len(eval_set), "block_size": args.block_size},
        "conversion": {"copied": len(report["copied"]), "initialised": report["initialised"]},
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "seconds": time.perf_counter() - started,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = [f"| stage | validation loss ({unit}) | perplexity |", "|---|---|---|"]
    table += [f"| {s} | {loss:.4f} | {math.exp(loss):.3f} |" for s, loss in stages]
    table += [f"| unigram frequencies (baseline) | {unigram:.4f} | {math.exp(unigram):.3f} |"]
    (out / "results.md").write_text("\n".join(table) + "\n")
    plot(results, out / "finetune_converted.png")
    print("\n".join(table))
    g = generation
    print(f"state after {g['new_tokens'][0]} new tokens: {g['state_after_n']['bytes']} bytes "
          f"({g['state_after_n']['tokens_in_state']} tokens folded in); after {sum(g['new_tokens'])}: "
          f"{g['state_after_2n']['bytes']} bytes ({g['state_after_2n']['tokens_in_state']} tokens folded in)")
    print(f"continued from the state == one greedy call of {sum(g['new_tokens'])} tokens: {g['continued_equals_one_call']}")
    print(f"prompt: {g['prompt']!r}\ngreedy: {g['greedy']!r}\nsampled: {g['sampled']!r}")
    print(f"wrote {out / 'results.md'}, {out / 'finetune_converted.png'} and {final_dir} in {results['seconds']:.0f} s")
    return results


def plot(results: dict, path: Path) -> None:
    """Validation loss: GPT-2 while it trains, the Linear GPT right after conversion and while it
    is fine-tuned (its steps counted after GPT-2's); GPT-2's final loss and the unigram baseline
    as lines."""
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
    ax.axhline(results["unigram_baseline"]["loss"], color="gray", ls=":", lw=1, label="unigram baseline")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel(f"validation loss ({results['unit']})")
    ax.set_title("Converting GPT-2 into Linear GPT and fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
