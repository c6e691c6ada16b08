#!/usr/bin/env python
"""Train a Linear GPT causal LM with Accelerate on text files (or a Hub dataset, online).

* Tokenizer: ``--tokenizer byte`` (256 byte tokens + ``<|endoftext|>``, nothing to train) or
  ``--tokenizer bpe`` (a byte-level BPE trained here with ``tokenizers`` on the training text).
* Accelerate: multi-process (CPU gloo or GPUs), mixed precision where the device has it
  (``--mixed_precision bf16|fp16`` or from ``accelerate launch``), gradient accumulation,
  checkpoints every ``--checkpointing_steps`` and ``--resume_from_checkpoint``, a tqdm progress
  bar, evaluation perplexity.
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
import json
import math
import sys
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import hf_kernattn  # noqa: E402  (registers Linear GPT with the Auto classes)
from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM  # noqa: E402

EOS = "<|endoftext|>"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    model.add_argument("--gradient_checkpointing", action="store_true")
    train = p.add_argument_group("training")
    train.add_argument("--per_device_train_batch_size", type=int, default=8)
    train.add_argument("--per_device_eval_batch_size", type=int, default=8)
    train.add_argument("--learning_rate", type=float, default=1e-3)
    train.add_argument("--weight_decay", type=float, default=0.01)
    train.add_argument("--num_train_epochs", type=int, default=1)
    train.add_argument("--max_train_steps", type=int, help="overrides --num_train_epochs")
    train.add_argument("--warmup_steps", type=int, default=0)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="default: what accelerate launch says")
    train.add_argument("--cpu", action="store_true", help="force CPU (with accelerate launch: gloo processes)")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--output_dir", required=True)
    train.add_argument("--checkpointing_steps", type=int, default=0, help="save a resumable checkpoint every N optimizer steps (0: only at the end)")
    train.add_argument("--resume_from_checkpoint", help="a checkpoint folder (step_N) or 'latest'")
    train.add_argument("--eval_steps", type=int, default=0, help="evaluate every N optimizer steps (0: at the end of each epoch)")
    train.add_argument("--max_eval_batches", type=int, default=0, help="cap evaluation batches (0: all)")
    args = p.parse_args(argv)
    if not args.train_file and not args.dataset_name:
        p.error("give --train_file or --dataset_name")
    for name in ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "num_train_epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def build_tokenizer(kind: str, texts, vocab_size: int):
    """A byte-level tokenizer (``byte``: 256 byte tokens) or a byte-level BPE trained on ``texts``."""
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
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None)


def load_text(args):
    from datasets import load_dataset

    if args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name)
    else:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        raw = load_dataset("text", data_files=files)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    accel_kwargs = dict(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=args.cpu)
    if args.mixed_precision:
        accel_kwargs["mixed_precision"] = args.mixed_precision
    accelerator = Accelerator(**accel_kwargs)
    set_seed(args.seed)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    accelerator.print(f"processes: {accelerator.num_processes}, device: {accelerator.device}, "
                      f"mixed precision: {accelerator.mixed_precision}")

    raw = load_text(args)
    column = args.text_column

    # Tokenizer: built once on the main process, then loaded by every process.
    from transformers import AutoTokenizer

    tok_dir = args.tokenizer_name or args.model_name_or_path or str(out / "tokenizer")
    if not (args.tokenizer_name or args.model_name_or_path):
        if accelerator.is_main_process:
            texts = (t for t in raw["train"][column] if t)
            build_tokenizer(args.tokenizer, texts, args.bpe_vocab_size).save_pretrained(tok_dir)
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
    if len(lm["train"]) == 0:
        raise ValueError(f"the training text gives no full block of --block_size={args.block_size} tokens")

    if args.model_name_or_path:
        model = LinearGPTForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        config = LinearGPTConfig(
            vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads, max_position_embeddings=max(args.block_size, 1024),
            feature_map=args.feature_map, position_embedding_type=args.position_embedding_type, rpe=args.rpe,
            max_relative_position=args.max_relative_position, bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        model = LinearGPTForCausalLM(config)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()

    train_dl = DataLoader(lm["train"], batch_size=args.per_device_train_batch_size, shuffle=True)
    eval_dl = DataLoader(lm["validation"], batch_size=args.per_device_eval_batch_size)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate
    )
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    epochs = math.ceil(max_steps / steps_per_epoch)

    def lr_lambda(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / max(1, args.warmup_steps)
        return max(0.0, (max_steps - step) / max(1, max_steps - args.warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    accelerator.register_for_checkpointing(scheduler)

    step, start_epoch, skip_batches = 0, 0, 0
    if args.resume_from_checkpoint:
        ckpt = args.resume_from_checkpoint
        if ckpt == "latest":
            found = sorted(out.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
            if not found:
                raise ValueError(f"--resume_from_checkpoint latest: no step_* folder in {out}")
            ckpt = str(found[-1])
        accelerator.load_state(ckpt)
        step = int(Path(ckpt).name.split("_")[1])
        start_epoch = step // steps_per_epoch
        skip_batches = (step % steps_per_epoch) * args.gradient_accumulation_steps
        accelerator.print(f"resumed from {ckpt} at step {step}")

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
        mean = torch.cat(losses).mean().item() if losses else float("nan")
        return {"eval_loss": mean, "perplexity": math.exp(min(mean, 50.0))}

    history = []
    bar = tqdm(total=max_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    model.train()
    for epoch in range(start_epoch, epochs):
        if step >= max_steps:
            break
        loader = accelerator.skip_first_batches(train_dl, skip_batches) if (epoch == start_epoch and skip_batches) else train_dl
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                accelerator.save_state(str(out / f"step_{step}"))
            if args.eval_steps and step % args.eval_steps == 0:
                metrics = evaluate() | {"step": step}
                history.append(metrics)
                accelerator.print(json.dumps(metrics))
            if step >= max_steps:
                break
        if not args.eval_steps:
            metrics = evaluate() | {"step": step, "epoch": epoch}
            history.append(metrics)
            accelerator.print(json.dumps(metrics))
        if step >= max_steps:
            break
    bar.close()
    final = evaluate() | {"step": step}
    accelerator.print("final " + json.dumps(final))

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out)
        (out / "eval_results.json").write_text(json.dumps({"final": final, "history": history}, indent=2))
        card = Path(__file__).resolve().parents[1] / "model_cards" / "linear_gpt.md"
        if card.exists():
            cfg = unwrapped.config
            text = card.read_text().format(
                model_name=out.name, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                num_attention_heads=cfg.num_attention_heads, feature_map=cfg.feature_map,
                position_embedding_type=cfg.position_embedding_type, rpe=cfg.rpe, vocab_size=cfg.vocab_size,
                train_data=", ".join(args.train_file or [args.dataset_name]), train_steps=step,
                eval_loss=f"{final['eval_loss']:.4f}", perplexity=f"{final['perplexity']:.2f}",
                repo_id=f"your-name/{out.name}",
            )
            (out / "README.md").write_text(text)
        accelerator.print(f"saved model, tokenizer and card to {out}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
