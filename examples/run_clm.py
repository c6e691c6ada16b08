#!/usr/bin/env python
"""Train a Linear GPT causal LM with Accelerate on text files (or a Hub dataset, online).

* Tokenizer: ``--tokenizer byte`` (256 byte tokens + ``<|endoftext|>``, nothing to train) or
  ``--tokenizer bpe`` (a byte-level BPE trained here with ``tokenizers`` on the training text).
* Accelerate: multi-process (CPU gloo or GPUs), mixed precision where the device has it
  (``--mixed_precision bf16|fp16`` or from ``accelerate launch``), gradient accumulation, a tqdm
  progress bar, evaluation perplexity, ``--with_tracking`` / ``--report_to``.
* AdamW with ``--lr_scheduler_type`` (``transformers.get_scheduler``) after ``--num_warmup_steps``
  (or ``--warmup_ratio``); no weight decay for biases, normalisation weights and the
  relative-position bias tables (the rule shared by every example script).
* Checkpoints every ``--checkpointing_steps`` (``output_dir/step_N``, written atomically, no
  pickle, every file checksummed); ``--resume_from_checkpoint latest`` continues from the newest
  complete and intact checkpoint of the same run (a damaged one is skipped with a warning) and
  ends bitwise where the uninterrupted run ends (same number of processes and threads);
  ``--checkpoints_total_limit`` keeps the newest N; ``--stop_after_steps N`` ends an invocation N
  steps after where it started; ``--num_threads`` sets torch's CPU threads per process.
* A model from scratch takes its shape from the flags and any other ``LinearGPTConfig`` field from
  ``--config_overrides key=value,...`` (``softmax_window``, the Llama options ``norm_type=rmsnorm``,
  ``mlp_type=gated``, ``num_key_value_heads``, ...), checked by the config before any work.
* Saves a Hub-ready checkpoint: ``save_pretrained`` (weights, config with ``auto_map``, the
  modeling code for ``trust_remote_code=True``), the tokenizer and a model card.

One process::

    python examples/run_clm.py --train_file data/train.txt --validation_file data/valid.txt --output_dir out/lgpt

Two real CPU processes (gloo)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/run_clm.py --cpu --train_file data/train.txt --output_dir out/lgpt
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import hf_kernattn  # noqa: E402  (registers Linear GPT with the Auto classes)
from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM  # noqa: E402
from hf_kernattn.cards import save_model_card  # noqa: E402
from hf_kernattn import training  # noqa: E402  (the flags, loop and checkpoints the example scripts share)
from hf_kernattn.training import run_main  # noqa: E402

EOS = "<|endoftext|>"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--train_file", nargs="+", help="one or more .txt files (one document per line)")
    data.add_argument("--validation_file", nargs="+", help="validation .txt files (default: split off the train set)")
    data.add_argument("--dataset_name", help="a Hub dataset name instead of files (needs network)")
    data.add_argument("--dataset_config_name")
    data.add_argument("--text_column", default="text")
    data.add_argument("--validation_split_percentage", type=int, default=5)
    data.add_argument("--block_size", type=int, default=128, help="tokens per training sequence")
    data.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    data.add_argument("--tokenizer_name", help="a saved tokenizer folder to reuse instead of building one")
    data.add_argument("--bpe_vocab_size", type=int, default=2048)
    model = p.add_argument_group("model")
    model.add_argument("--model_name_or_path", help="start from a saved Linear GPT instead of a fresh one")
    model.add_argument("--hidden_size", type=int, default=128)
    model.add_argument("--num_hidden_layers", type=int, default=4)
    model.add_argument("--num_attention_heads", type=int, default=4)
    model.add_argument("--feature_map", default="elu")
    model.add_argument("--position_embedding_type", default="absolute", choices=["absolute", "rotary", "none"])
    model.add_argument("--rpe", default="none", choices=["none", "learned"])
    model.add_argument("--max_relative_position", type=int, default=64)
    model.add_argument("--config_overrides", default=None,
                       help="key=value,... LinearGPTConfig fields of a model from scratch, applied over the flags "
                            "above and checked by the config (e.g. softmax_window=64,norm_type=rmsnorm,mlp_type=gated,"
                            "num_key_value_heads=2); values are read as JSON (numbers, true/false, null), else as text")
    model.add_argument("--gradient_checkpointing", action="store_true")
    train = p.add_argument_group("training")
    train.add_argument("--per_device_train_batch_size", type=int, default=8)
    train.add_argument("--per_device_eval_batch_size", type=int, default=8)
    train.add_argument("--num_train_epochs", type=int, default=1)
    train.add_argument("--max_train_steps", type=int, help="optimizer steps (overrides --num_train_epochs)")
    train.add_argument("--eval_steps", type=int, default=0, help="evaluate every N optimizer steps (0: at the end of each epoch)")
    train.add_argument("--max_eval_batches", type=int, default=0, help="cap evaluation batches (0: all)")
    training.add_training_args(p, learning_rate=1e-3, weight_decay=0.01, warmup_default="0", checkpointing_steps=None)
    args = p.parse_args(argv)
    training.check_training_args(p, args)
    if not args.train_file and not args.dataset_name:
        p.error("give --train_file or --dataset_name")
    for name in ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_train_steps is not None and args.max_train_steps < 1:
        p.error(f"--max_train_steps must be >= 1, got {args.max_train_steps}")
    if args.eval_steps < 0 or args.max_eval_batches < 0:
        p.error("--eval_steps and --max_eval_batches must be >= 0")
    if args.config_overrides is not None:
        if args.model_name_or_path:
            p.error("--config_overrides sets up a model from scratch; it cannot be combined with --model_name_or_path")
        try:
            config = model_config(args)
        except ValueError as err:
            p.error(f"--config_overrides: {' '.join(str(err).split())}")
        if config.position_embedding_type == "absolute" and config.max_position_embeddings < args.block_size:
            p.error(f"--config_overrides: max_position_embeddings={config.max_position_embeddings} is less than "
                    f"--block_size={args.block_size}")
    return args


# Set from the tokenizer, not through --config_overrides.
TOKENIZER_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def model_config(args: argparse.Namespace, tokenizer=None) -> LinearGPTConfig:
    """The config of a model from scratch: the model flags, then ``--config_overrides`` (fields of
    ``LinearGPTConfig``, checked by the config itself), then the tokenizer's vocabulary and token
    ids (without a tokenizer: the config's defaults, to check the flags before any work)."""
    from hf_kernattn.modeling.configuration_linear_gpt import ATTENTION_SCHEMA

    fields = dict(
        hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads, max_position_embeddings=max(args.block_size, 1024),
        feature_map=args.feature_map, position_embedding_type=args.position_embedding_type, rpe=args.rpe,
        max_relative_position=args.max_relative_position,
    )
    overrides = training.parse_overrides(args.config_overrides)
    for key in overrides:
        if key in TOKENIZER_FIELDS:
            raise ValueError(f"{key} is set from the tokenizer")
        if key not in ATTENTION_SCHEMA.field_names:
            raise ValueError(f"{key!r} is not a LinearGPTConfig field; the fields: "
                             f"{', '.join(n for n in ATTENTION_SCHEMA.field_names if n not in TOKENIZER_FIELDS)}")
    fields.update(overrides)
    if tokenizer is not None:
        fields.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LinearGPTConfig(**fields)


def build_tokenizer(kind: str, texts, vocab_size: int, model_max_length: int):
    """A byte-level tokenizer (``byte``: 256 byte tokens) or a byte-level BPE trained on ``texts``;
    ``model_max_length`` is the longest input the model takes (its position table)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "byte":
        vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
        vocab[EOS] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind == "bpe")
    tok.decoder = decoders.ByteLevel()
    if kind == "bpe":
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet, show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None,
                                   model_max_length=model_max_length)


def load_text(args):
    from datasets import load_dataset

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    else:
        training.check_text_files(args.train_file, "--train_file")
        files = {"train": args.train_file}
        if args.validation_file:
            training.check_text_files(args.validation_file, "--validation_file")
            files["validation"] = args.validation_file
        raw = load_dataset("text", data_files=files)
    if args.text_column not in raw["train"].column_names:
        raise ValueError(f"--text_column {args.text_column!r} is not a column of the data: {raw['train'].column_names}")
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    accelerator, out, settings, fingerprint, resume = training.start_run(args, "run_clm")

    raw = load_text(args)
    column = args.text_column
    max_positions = model_config(args).max_position_embeddings

    # Tokenizer: a resumed run takes the one saved in its checkpoint; otherwise it is built on the
    # main process straight into --output_dir (where the final model goes) and loaded by all.
    from transformers import AutoTokenizer

    tok_dir = args.tokenizer_name or args.model_name_or_path or (str(resume) if resume else str(out))
    if not (args.tokenizer_name or args.model_name_or_path or resume):
        if accelerator.is_main_process:
            texts = (t for t in raw["train"][column] if t)
            build_tokenizer(args.tokenizer, texts, args.bpe_vocab_size, max_positions).save_pretrained(tok_dir)
        accelerator.wait_for_everyone()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)

    def tokenize(batch):
        return tokenizer([t + EOS for t in batch[column] if t is not None])

    def group(batch):
        ids = [i for seq in batch["input_ids"] for i in seq]
        n = (len(ids) // args.block_size) * args.block_size
        blocks = [ids[i : i + args.block_size] for i in range(0, n, args.block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
        lm = tokenized.map(group, batched=True, remove_columns=tokenized["train"].column_names)
    lm.set_format("torch")
    for split in ("train", "validation"):
        if len(lm[split]) == 0:
            raise ValueError(f"the {split} text gives no full block of --block_size={args.block_size} tokens "
                             f"({sum(len(x) for x in tokenized[split]['input_ids'])} tokens in all): "
                             "give more text or a smaller --block_size")

    if args.model_name_or_path:
        model = LinearGPTForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        model = LinearGPTForCausalLM(model_config(args, tokenizer))
    if args.gradient_checkpointing:  # the 5.x name where it exists, the older one otherwise
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()

    sampler = training.EpochShuffleSampler(len(lm["train"]), args.seed)
    train_dl = DataLoader(lm["train"], batch_size=args.per_device_train_batch_size, sampler=sampler,
                          generator=torch.Generator())
    eval_dl = DataLoader(lm["validation"], batch_size=args.per_device_eval_batch_size,
                         generator=torch.Generator())
    optimizer = torch.optim.AdamW(training.optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate)
    model, optimizer, train_dl, eval_dl = training.prepare(accelerator, model, optimizer, train_dl, eval_dl)
    steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    scheduler = training.make_scheduler(accelerator, args, optimizer, max_steps, training.warmup_steps(args, max_steps))
    training.start_tracking(accelerator, args, "run_clm", settings)

    def evaluate() -> dict:
        model.eval()
        losses = []
        for i, batch in enumerate(eval_dl):
            if args.max_eval_batches and i >= args.max_eval_batches:
                break
            with torch.no_grad():
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
            losses.append(accelerator.gather_for_metrics(loss.detach().float().reshape(1).repeat(batch["input_ids"].shape[0])))
        model.train()
        mean = torch.cat(losses).mean().item()
        return {"eval_loss": mean, "perplexity": math.exp(min(mean, 50.0))}

    result = training.train_loop(
        accelerator, args, model=model, optimizer=optimizer, scheduler=scheduler, train_dl=train_dl, sampler=sampler,
        max_train_steps=max_steps, evaluate=evaluate, eval_steps=args.eval_steps,
        prepare_batch=lambda b: {"input_ids": b["input_ids"], "labels": b["labels"], "use_cache": False},
        fingerprint=fingerprint, settings=settings, save_extra=tokenizer.save_pretrained, resume=resume, report=accelerator.print, desc="train",
    )
    step = result["step"]
    final, unwrapped = training.finish_run(accelerator, args, model, evaluate, result, out)
    if final is None:
        return {"step": step, "stopped": True}
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out)
        save_model_card(
            unwrapped, out,
            results=[{"task": "text-generation", "dataset": args.dataset_name or "local text", "split": "validation",
                      "metric": "perplexity", "value": final["perplexity"]},
                     {"task": "text-generation", "dataset": args.dataset_name or "local text", "split": "validation",
                      "metric": "loss", "value": final["eval_loss"]}],
            datasets=[args.dataset_name] if args.dataset_name else None,
            training={"optimizer steps": step, "training data": ", ".join(args.train_file or [args.dataset_name])},
        )
    training.end_run(accelerator, args, out, saved="model, tokenizer and card")
    return final


if __name__ == "__main__":
    run_main(main)
