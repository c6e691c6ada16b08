#!/usr/bin/env python
"""Masked-language-model pre-training of NPRF-BERT with Accelerate, from plain text files.

* Data: ``--train_file`` (and optionally ``--validation_file``): text, one document or sentence
  per line; lines are tokenised, concatenated and cut into ``--max_seq_length`` blocks (or kept
  one per example with ``--line_by_line``).
* Masking: ``--mlm_probability`` (15%) of the tokens are chosen; of those 80% become ``[MASK]``,
  10% a random token and 10% stay unchanged (BERT's 80/10/10 rule).
* Schedule: AdamW with ``--lr_scheduler_type`` (``transformers.get_scheduler``; default linear)
  after a linear warm-up over ``--num_warmup_steps`` (or ``--warmup_ratio``): warm-up + linear
  decay is the schedule of Luo et al. 2021 (Table 5). The defaults are BERT-base pre-training
  values (peak 1e-4, 10k warm-up steps, capped at 10% of ``--max_train_steps`` when left at the
  default, weight decay 0.01, Adam eps 1e-6, betas 0.9/0.98); scale them to your run. No weight
  decay for biases, normalisation weights and the relative-position bias table (the rule shared
  by every example script).
* Checkpoints every ``--checkpointing_steps`` into ``--output_dir/step_N`` (written atomically, no
  pickle, every file checksummed); ``--resume_from_checkpoint latest`` (or a path) continues from
  the newest complete and intact checkpoint of the same run (a damaged one is skipped with a
  warning) and ends bitwise where the uninterrupted run ends (data order, masking, dropout and all
  other random states, optimizer, scheduler, counters, evaluation history; same number of
  processes and threads); ``--checkpoints_total_limit`` keeps the newest N; ``--num_threads``
  sets torch's CPU threads per process. The final model is saved Hub-ready.
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
from itertools import chain
from typing import Optional

import torch
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
)

import hf_kernattn  # noqa: F401  (registers NPRF-BERT with the Auto classes)
from hf_kernattn import NPRFBertConfig, NPRFBertForMaskedLM
from hf_kernattn.cards import save_model_card
from hf_kernattn.convert import convert_to_nprf_bert
from hf_kernattn import training  # the flags, loop and checkpoints the example scripts share
from hf_kernattn.training import run_main

logger = logging.getLogger(__name__)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_file", required=True, help="text file, one document/sentence per line")
    p.add_argument("--validation_file", default=None)
    p.add_argument("--model_name_or_path", default=None, help="NPRF-BERT checkpoint or BERT/RoBERTa to convert")
    p.add_argument("--config_name", default=None, help="NPRF-BERT config to start from scratch")
    p.add_argument("--allow_pickle", "--allow-pickle", action="store_true",
                   help="when converting a BERT/RoBERTa source that has only pickled weights (pytorch_model*.bin), "
                        "read them (unpickling can run code from the file: only for sources you trust)")
    p.add_argument("--config_overrides", default=None, help="key=value,... NPRFBertConfig fields (from scratch)")
    p.add_argument("--tokenizer_name", default=None)
    p.add_argument("--max_seq_length", type=int, default=512, help="tokens per example, [CLS] and [SEP] included (>= 3)")
    p.add_argument("--line_by_line", action="store_true", help="one example per line instead of packed blocks")
    p.add_argument("--mlm_probability", type=float, default=0.15)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.98)
    p.add_argument("--adam_epsilon", type=float, default=1e-6)
    p.add_argument("--max_train_steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (0: at the end of each epoch)")
    p.add_argument("--preprocessing_num_workers", type=int, default=None)
    training.add_training_args(p, learning_rate=1e-4, weight_decay=0.01, checkpointing_steps="500",
                               warmup_default="10000, BERT-base's, or 10%% of --max_train_steps when that is fewer")
    args = p.parse_args(argv)
    training.check_training_args(p, args)
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "max_train_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_seq_length < 3:
        p.error(f"--max_seq_length must be >= 3 ([CLS], at least one token, [SEP]), got {args.max_seq_length}")
    if args.eval_steps < 0:
        p.error(f"--eval_steps must be >= 0, got {args.eval_steps}")
    if not 0.0 < args.mlm_probability < 1.0:
        p.error(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}")
    if args.model_name_or_path is None and args.config_name is None and args.config_overrides is None:
        p.error("pass --model_name_or_path, or --config_name / --config_overrides to start from scratch")
    if args.model_name_or_path is None and args.tokenizer_name is None:
        p.error("--tokenizer_name is required when starting from scratch")
    return args


def build_model(args: argparse.Namespace, tokenizer) -> NPRFBertForMaskedLM:
    if args.model_name_or_path is not None:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        if config.model_type in ("bert", "roberta"):
            return convert_to_nprf_bert(args.model_name_or_path, head="masked_lm", allow_pickle=args.allow_pickle,
                                        **training.parse_overrides(args.config_overrides))
        return AutoModelForMaskedLM.from_pretrained(args.model_name_or_path)
    fields = NPRFBertConfig.from_pretrained(args.config_name).to_dict() if args.config_name else {}
    fields.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    fields.update(training.parse_overrides(args.config_overrides))
    for key in ("model_type", "transformers_version", "architectures"):
        fields.pop(key, None)
    return NPRFBertForMaskedLM(NPRFBertConfig(**fields))


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    accelerator, _, settings, fingerprint, resume = training.start_run(args, "run_mlm")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if accelerator.is_main_process else logging.WARNING)

    training.check_text_files([args.train_file], "--train_file")
    if args.validation_file:
        training.check_text_files([args.validation_file], "--validation_file")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path)
    if tokenizer.mask_token is None or tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError("the tokenizer needs mask, cls and sep tokens for BERT-style MLM")
    model = build_model(args, tokenizer)
    max_len = args.max_seq_length
    if model.config.position_embedding_type == "absolute":
        max_len = min(max_len, model.config.max_position_embeddings)
    if max_len < 3:
        raise ValueError(f"blocks of {max_len} tokens leave no room for text between [CLS] and [SEP]")

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
    for split, path in files.items():
        if len(data[split]) == 0:
            raise ValueError(f"{path} gives no {split} example of {max_len} tokens; use --line_by_line or a "
                             "smaller --max_seq_length")

    # Masking happens in the training loop, on CPU, with a generator per process whose state
    # goes into the checkpoints (a collator would run ahead of the loop: the data loader fetches
    # one batch in advance). Evaluation masks with its own generator, reset at every evaluation,
    # so evaluations compare like with like and never disturb the training randomness.
    masker = DataCollatorForLanguageModeling(
        tokenizer, mlm=True, mlm_probability=args.mlm_probability, mask_replace_prob=0.8, random_replace_prob=0.1,
    )
    mask_seed = args.seed + 1_000_003 * accelerator.process_index
    train_gen = torch.Generator().manual_seed(mask_seed)
    eval_gen = torch.Generator()

    def pad(examples):
        return tokenizer.pad(examples, return_tensors="pt")

    def mask(batch, generator):
        masker.generator = generator
        batch = dict(batch)
        batch["input_ids"], batch["labels"] = masker.torch_mask_tokens(
            batch["input_ids"], special_tokens_mask=batch.pop("special_tokens_mask"))
        return {k: v.to(accelerator.device) for k, v in batch.items()}

    sampler = training.EpochShuffleSampler(len(data["train"]), args.seed)
    train_dl = DataLoader(data["train"], sampler=sampler, collate_fn=pad, batch_size=args.per_device_train_batch_size,
                          generator=torch.Generator())
    eval_dl = (DataLoader(data["validation"], collate_fn=pad, batch_size=args.per_device_eval_batch_size,
                         generator=torch.Generator())
               if "validation" in data else None)

    optimizer = torch.optim.AdamW(
        training.optimizer_grouped_parameters(model, args.weight_decay),
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
    )
    warmup = training.warmup_steps(args, args.max_train_steps, default=min(10000, max(1, args.max_train_steps // 10)))
    model, optimizer = training.prepare(accelerator, model, optimizer)
    train_dl = accelerator.prepare_data_loader(train_dl, device_placement=False)
    if eval_dl is not None:
        eval_dl = accelerator.prepare_data_loader(eval_dl, device_placement=False)
    scheduler = training.make_scheduler(accelerator, args, optimizer, args.max_train_steps, warmup)
    training.start_tracking(accelerator, args, "run_mlm", settings)

    def evaluate_ppl() -> dict:
        if eval_dl is None:
            return {}
        model.eval()
        eval_gen.manual_seed(mask_seed + 1)
        losses = []
        with torch.no_grad():
            for batch in eval_dl:
                loss = model(**mask(batch, eval_gen)).loss
                losses.append(accelerator.gather_for_metrics(loss.detach().float().reshape(1)))
        model.train()
        loss = torch.cat(losses).mean().item()
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    logger.info("training: %d blocks, %d processes (%d CPU threads each), %d steps, warm-up %d, peak lr %g",
                len(data["train"]), accelerator.num_processes, torch.get_num_threads(), args.max_train_steps, warmup,
                args.learning_rate)
    result = training.train_loop(
        accelerator, args, model=model, optimizer=optimizer, scheduler=scheduler, train_dl=train_dl, sampler=sampler,
        max_train_steps=args.max_train_steps, evaluate=evaluate_ppl, eval_steps=args.eval_steps,
        prepare_batch=lambda b: mask(b, train_gen), generators={"masking": train_gen},
        fingerprint=fingerprint, settings=settings, resume=resume, report=accelerator.print, desc="mlm",
    )
    completed, history = result["step"], result["history"]
    if result["stopped"]:
        accelerator.print(f"stopped after step {completed} (--stop_after_steps); resume with --resume_from_checkpoint latest")
        accelerator.end_training()
        return {"steps": completed, "stopped": True}

    results = {"train_loss_last": history["train"][-1]["loss"] if history["train"] else None, "steps": completed}
    results.update(evaluate_ppl())
    accelerator.print(f"final: {results}")
    if args.with_tracking:
        accelerator.log({f"final_{k}": v for k, v in results.items() if isinstance(v, float)}, step=completed)
    accelerator.wait_for_everyone()
    unwrapped = training.save_final_model(accelerator, model, args.output_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "mlm_results.json"), "w") as f:
            json.dump({"results": results, "history": history["eval"], "train_history": history["train"]}, f, indent=1)
        data_name = os.path.basename(args.train_file)
        save_model_card(
            unwrapped, args.output_dir,
            results=[{"task": "fill-mask", "dataset": data_name, "split": "validation", "metric": "perplexity",
                      "value": results["perplexity"]}] if "perplexity" in results else (),
            base_model=args.model_name_or_path,
            training={"optimizer steps": completed, "training data": data_name},
        )
    training.end_run(accelerator, args, args.output_dir)
    return results


if __name__ == "__main__":
    run_main(main)
