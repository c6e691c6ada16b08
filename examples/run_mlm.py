#!/usr/bin/env python
"""Masked-language-model pre-training of NPRF-BERT with Accelerate, from plain text files.

* Data: ``--train_file`` (and optionally ``--validation_file``): text, one document or sentence
  per line; lines are tokenised, concatenated and cut into ``--max_seq_length`` blocks (or kept
  one per example with ``--line_by_line``).
* Masking: ``--mlm_probability`` (15%) of the tokens are chosen; of those 80% become ``[MASK]``,
  10% a random token and 10% stay unchanged (BERT's 80/10/10 rule).
* Schedule: AdamW with linear warm-up to ``--learning_rate`` over ``--num_warmup_steps`` and
  linear decay to zero at ``--max_train_steps``: the warm-up + linear-decay schedule of
  Luo et al. 2021 (Table 5). The defaults are BERT-base pre-training values (peak 1e-4,
  10k warm-up steps, weight decay 0.01, Adam eps 1e-6, betas 0.9/0.98); scale them to your run.
* Checkpoints: ``accelerator.save_state`` every ``--checkpointing_steps`` into
  ``--output_dir/step_N``; ``--resume_from_checkpoint latest`` (or a path) continues exactly
  there (optimizer, scheduler, RNG, data position). The final model is saved Hub-ready.
* Model: ``--model_name_or_path`` (an NPRF-BERT checkpoint, or a BERT/RoBERTa one converted on
  the fly), or ``--config_name``/``--tokenizer_name`` to start from scratch with
  ``NPRFBertConfig`` fields given as ``--config_overrides key=value,...``.

Examples::

    python examples/run_mlm.py --model_name_or_path path/to/bert --train_file corpus.txt \\
        --output_dir out/mlm --max_train_steps 100000

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/run_mlm.py --cpu --tokenizer_name tok/ \\
        --config_overrides hidden_size=128,num_hidden_layers=2,num_attention_heads=4 \\
        --train_file corpus.txt --output_dir out/mlm --max_train_steps 200
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from itertools import chain
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    get_linear_schedule_with_warmup,
)

import hf_kernattn  # noqa: F401  (registers NPRF-BERT with the Auto classes)
from hf_kernattn import NPRFBertConfig, NPRFBertForMaskedLM
from hf_kernattn.convert import convert_to_nprf_bert

logger = logging.getLogger(__name__)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_file", required=True, help="text file, one document/sentence per line")
    p.add_argument("--validation_file", default=None)
    p.add_argument("--model_name_or_path", default=None, help="NPRF-BERT checkpoint or BERT/RoBERTa to convert")
    p.add_argument("--config_name", default=None, help="NPRF-BERT config to start from scratch")
    p.add_argument("--config_overrides", default=None, help="key=value,... NPRFBertConfig fields (from scratch)")
    p.add_argument("--tokenizer_name", default=None)
    p.add_argument("--max_seq_length", type=int, default=512)
    p.add_argument("--line_by_line", action="store_true", help="one example per line instead of packed blocks")
    p.add_argument("--mlm_probability", type=float, default=0.15)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.98)
    p.add_argument("--adam_epsilon", type=float, default=1e-6)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_train_steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--num_warmup_steps", type=int, default=10000,
                   help="linear warm-up steps (capped at 10%% of --max_train_steps for short runs)")
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_N folder or 'latest'")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    p.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    p.add_argument("--preprocessing_num_workers", type=int, default=None)
    args = p.parse_args(argv)
    for name in ("max_seq_length", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "max_train_steps", "checkpointing_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.mlm_probability < 1.0:
        raise ValueError(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}")
    if args.model_name_or_path is None and args.config_name is None and args.config_overrides is None:
        raise ValueError("pass --model_name_or_path, or --config_name / --config_overrides to start from scratch")
    if args.model_name_or_path is None and args.tokenizer_name is None:
        raise ValueError("--tokenizer_name is required when starting from scratch")
    return args


def _parse_overrides(text: Optional[str]) -> dict:
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"--config_overrides items must be key=value, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_model(args: argparse.Namespace, tokenizer) -> NPRFBertForMaskedLM:
    if args.model_name_or_path is not None:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        if config.model_type in ("bert", "roberta"):
            return convert_to_nprf_bert(args.model_name_or_path, head="masked_lm", **_parse_overrides(args.config_overrides))
        return AutoModelForMaskedLM.from_pretrained(args.model_name_or_path)
    fields = NPRFBertConfig.from_pretrained(args.config_name).to_dict() if args.config_name else {}
    fields.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    fields.update(_parse_overrides(args.config_overrides))
    for key in ("model_type", "transformers_version", "architectures"):
        fields.pop(key, None)
    return NPRFBertForMaskedLM(NPRFBertConfig(**fields))


def _latest_checkpoint(output_dir: str) -> Optional[str]:
    steps = [(int(m.group(1)), d) for d in Path(output_dir).glob("step_*") if (m := re.fullmatch(r"step_(\d+)", d.name))]
    return str(max(steps)[1]) if steps else None


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision,
        cpu=args.cpu,
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if accelerator.is_main_process else logging.WARNING)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path)
    if tokenizer.mask_token is None or tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError("the tokenizer needs mask, cls and sep tokens for BERT-style MLM")
    model = build_model(args, tokenizer)
    max_len = args.max_seq_length
    if model.config.position_embedding_type == "absolute":
        max_len = min(max_len, model.config.max_position_embeddings)

    files = {"train": args.train_file}
    if args.validation_file:
        files["validation"] = args.validation_file
    raw = load_dataset("text", data_files=files)

    def tokenize(batch):
        lines = [line for line in batch["text"] if line.strip()]
        if args.line_by_line:
            return tokenizer(lines, truncation=True, max_length=max_len, return_special_tokens_mask=True)
        return tokenizer(lines, add_special_tokens=False, return_special_tokens_mask=True)

    def group(batch):
        # Pack documents into blocks of max_len - 2 tokens, each wrapped in [CLS] ... [SEP].
        body = max_len - 2
        ids = list(chain.from_iterable(batch["input_ids"]))
        total = (len(ids) // body) * body
        cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        blocks = [[cls_id] + ids[i : i + body] + [sep_id] for i in range(0, total, body)]
        return {"input_ids": blocks, "special_tokens_mask": [[1] + [0] * body + [1] for _ in blocks]}

    with accelerator.main_process_first():
        data = raw.map(tokenize, batched=True, remove_columns=["text"], num_proc=args.preprocessing_num_workers)
        if not args.line_by_line:
            data = data.map(group, batched=True, remove_columns=data["train"].column_names,
                            num_proc=args.preprocessing_num_workers)
    if len(data["train"]) == 0:
        raise ValueError(f"--train_file gave no training blocks of {max_len} tokens; use --line_by_line or less --max_seq_length")

    collator = DataCollatorForLanguageModeling(
        tokenizer, mlm=True, mlm_probability=args.mlm_probability, mask_replace_prob=0.8, random_replace_prob=0.1,
    )
    train_dl = DataLoader(data["train"], shuffle=True, collate_fn=collator, batch_size=args.per_device_train_batch_size)
    eval_dl = (DataLoader(data["validation"], collate_fn=collator, batch_size=args.per_device_eval_batch_size)
               if "validation" in data else None)

    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n or "_norm" in n or "rpe" in n)]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
    )
    warmup = min(args.num_warmup_steps, max(1, args.max_train_steps // 10)) if args.max_train_steps < 10 * args.num_warmup_steps else args.num_warmup_steps
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup * accelerator.num_processes,
                                                args.max_train_steps * accelerator.num_processes)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)

    def evaluate_ppl() -> dict:
        model.eval()
        losses = []
        with torch.no_grad():
            for batch in eval_dl:
                loss = model(**batch).loss
                losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)))
        model.train()
        loss = torch.cat(losses).mean().item()
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    completed, resume_batches, start_epoch = 0, 0, 0
    resume = args.resume_from_checkpoint
    if resume == "latest":
        resume = _latest_checkpoint(args.output_dir)
        if resume is None:
            logger.info("no checkpoint in %s: starting fresh", args.output_dir)
    if resume:
        accelerator.load_state(resume)
        completed = int(Path(resume).name.split("_")[-1])
        batches_done = completed * args.gradient_accumulation_steps
        start_epoch, resume_batches = divmod(batches_done, len(train_dl))
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume, completed, start_epoch, resume_batches)

    logger.info("training: %d blocks, %d processes, %d steps, warm-up %d, peak lr %g",
                len(data["train"]), accelerator.num_processes, args.max_train_steps, warmup, args.learning_rate)
    bar = tqdm(total=args.max_train_steps, initial=completed, disable=not accelerator.is_local_main_process, desc="mlm")
    model.train()
    history: list[dict] = []
    epoch = start_epoch
    running, counted = 0.0, 0
    while completed < args.max_train_steps:
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_dl, resume_batches) if resume_batches else train_dl
        resume_batches = 0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running += loss.detach().float().item()
            counted += 1
            if not accelerator.sync_gradients:
                continue
            completed += 1
            bar.update(1)
            bar.set_postfix(loss=f"{running / counted:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            history.append({"step": completed, "loss": running / counted, "lr": scheduler.get_last_lr()[0]})
            running, counted = 0.0, 0
            if completed % args.checkpointing_steps == 0 or completed == args.max_train_steps:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed}"))
            if eval_dl is not None and args.eval_steps and completed % args.eval_steps == 0:
                res = evaluate_ppl()
                history[-1].update(res)
                accelerator.print(f"step {completed}: {res}")
            if completed >= args.max_train_steps:
                break
        epoch += 1
    bar.close()

    results = {"train_loss_last": history[-1]["loss"] if history else None, "steps": completed}
    if eval_dl is not None:
        results.update(evaluate_ppl())
        accelerator.print(f"final: {results}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(args.output_dir, safe_serialization=True)
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "mlm_results.json"), "w") as f:
            json.dump({"results": results, "history": history}, f, indent=1)
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()
