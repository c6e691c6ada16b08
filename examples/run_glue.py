#!/usr/bin/env python
"""Fine-tune NPRF-BERT on a GLUE task (or your own CSV/JSON files) with the Hugging Face Trainer.

Data: ``--task_name`` (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli) downloads GLUE from
the Hub (``nyu-mll/glue``); ``--train_file`` / ``--validation_file`` (/ ``--test_file``) read
local CSV or JSON files instead (text in ``sentence1`` [+ ``sentence2``] or ``sentence``
[+ ...], label in ``label``; float labels mean regression). Metrics come from the GLUE
``evaluate`` module shipped with hf-kernattn, so evaluation works offline.

Model: ``--model_name_or_path`` is an NPRF-BERT checkpoint, or a BERT/RoBERTa checkpoint that is
converted on the fly (``hf_kernattn.convert``: weights copied, relative-position bias zero).

Also: dynamic padding, bf16/fp16 picked automatically on GPUs that have it (``--auto_precision``),
early stopping on the task's main metric, and the best checkpoint saved Hub-ready (weights,
modeling code for ``trust_remote_code``, tokenizer, model card, results) in ``--output_dir``.

Examples::

    python examples/run_glue.py --model_name_or_path path/to/nprf-bert --task_name mrpc \\
        --do_train --do_eval --output_dir out/mrpc --eval_strategy epoch --save_strategy epoch \\
        --num_train_epochs 3 --learning_rate 2e-5 --per_device_train_batch_size 32

    # two CPU processes (gloo), local files
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/run_glue.py --use_cpu --model_name_or_path path/to/nprf-bert \\
        --train_file train.csv --validation_file dev.csv --do_train --do_eval --output_dir out/local
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    EvalPrediction,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)

import evaluate
import hf_kernattn  # noqa: F401  (registers NPRF-BERT with the Auto classes)
from hf_kernattn.convert import convert_to_nprf_bert
from hf_kernattn.metrics import GLUE_METRIC_PATH

logger = logging.getLogger(__name__)

TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
MAIN_METRIC = {"cola": "matthews_correlation", "stsb": "pearson", "mrpc": "f1", "qqp": "f1"}


@dataclass
class ModelArguments:
    """Which model and tokenizer to fine-tune."""

    model_name_or_path: str = field(metadata={"help": "NPRF-BERT checkpoint, or a BERT/RoBERTa one to convert"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "tokenizer if not the model's"})
    num_random_features: Optional[int] = field(default=None, metadata={"help": "override when converting"})
    attn_backend: Optional[str] = field(default=None, metadata={"help": "override the attention backend"})
    auto_precision: bool = field(
        default=True, metadata={"help": "on CUDA without --fp16/--bf16: use bf16 if supported, else fp16"}
    )
    early_stopping_patience: int = field(
        default=3, metadata={"help": "evaluations without improvement before stopping (0 disables)"}
    )


@dataclass
class DataArguments:
    """What data to train and evaluate on."""

    task_name: Optional[str] = field(default=None, metadata={"help": f"GLUE task: {sorted(TASK_TO_KEYS)}"})
    metric_task: Optional[str] = field(
        default=None,
        metadata={"help": "GLUE metric config for local files (default: task_name, else stsb for regression, "
                          "mrpc for 2 classes, sst2 otherwise)"},
    )
    train_file: Optional[str] = field(default=None, metadata={"help": "CSV or JSON training file"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "CSV or JSON validation file"})
    test_file: Optional[str] = field(default=None, metadata={"help": "CSV or JSON file to predict"})
    max_seq_length: int = field(default=128, metadata={"help": "longer inputs are truncated"})
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)

    def __post_init__(self) -> None:
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            if self.task_name not in TASK_TO_KEYS:
                raise ValueError(f"--task_name must be one of {sorted(TASK_TO_KEYS)}, got {self.task_name!r}")
        elif self.train_file is None and self.validation_file is None:
            raise ValueError("pass --task_name or --train_file/--validation_file")
        for name in ("train_file", "validation_file", "test_file"):
            path = getattr(self, name)
            if path is not None and Path(path).suffix not in (".csv", ".json", ".jsonl"):
                raise ValueError(f"--{name} must be a .csv, .json or .jsonl file, got {path!r}")
        if self.max_seq_length < 2:
            raise ValueError(f"--max_seq_length must be >= 2, got {self.max_seq_length}")


def load_raw(data: DataArguments, cache_dir: Optional[str]):
    if data.task_name is not None and data.train_file is None and data.validation_file is None:
        return load_dataset("nyu-mll/glue", data.task_name, cache_dir=cache_dir)
    files = {k: v for k, v in (("train", data.train_file), ("validation", data.validation_file),
                               ("test", data.test_file)) if v is not None}
    kind = "csv" if next(iter(files.values())).endswith(".csv") else "json"
    return load_dataset(kind, data_files=files, cache_dir=cache_dir)


def text_keys(data: DataArguments, columns: list[str]) -> tuple[str, Optional[str]]:
    if data.task_name is not None and data.task_name in TASK_TO_KEYS and TASK_TO_KEYS[data.task_name][0] in columns:
        return TASK_TO_KEYS[data.task_name]
    if "sentence1" in columns:
        return "sentence1", ("sentence2" if "sentence2" in columns else None)
    if "sentence" in columns:
        return "sentence", None
    rest = [c for c in columns if c not in ("label", "idx")]
    if not rest:
        raise ValueError(f"no text column found among {columns}")
    return rest[0], (rest[1] if len(rest) > 1 else None)


def build_model(args: ModelArguments, num_labels: int, is_regression: bool, label2id: Optional[dict]):
    overrides = {k: v for k, v in (("num_random_features", args.num_random_features),
                                   ("attn_backend", args.attn_backend)) if v is not None}
    problem_type = "regression" if is_regression else "single_label_classification"
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    id2label = {i: l for l, i in label2id.items()} if label2id else None
    if config.model_type in ("bert", "roberta"):
        logger.info("converting %s checkpoint %s to NPRF-BERT", config.model_type, args.model_name_or_path)
        model = convert_to_nprf_bert(
            args.model_name_or_path, head="sequence_classification", num_labels=num_labels,
            problem_type=problem_type, **overrides,
        )
        if id2label:
            model.config.id2label, model.config.label2id = id2label, dict(label2id)
        return model
    if config.model_type != "nprf_bert":
        raise ValueError(f"--model_name_or_path must be an NPRF-BERT, BERT or RoBERTa checkpoint, got {config.model_type!r}")
    kwargs = dict(num_labels=num_labels, problem_type=problem_type, **overrides)
    if id2label:
        kwargs.update(id2label=id2label, label2id=dict(label2id))
    return AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, ignore_mismatched_sizes=True, **kwargs
    )


def main(argv: Optional[list[str]] = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO
                        if training_args.process_index == 0 else logging.WARNING, handlers=[logging.StreamHandler()])
    transformers.utils.logging.set_verbosity_warning()

    if model_args.auto_precision and torch.cuda.is_available() and not (training_args.fp16 or training_args.bf16) \
            and not training_args.use_cpu:
        if torch.cuda.is_bf16_supported():
            training_args.bf16 = True
        else:
            training_args.fp16 = True
        logger.info("mixed precision: %s", "bf16" if training_args.bf16 else "fp16")
    set_seed(training_args.seed)

    raw = load_raw(data_args, cache_dir=None)
    split0 = raw["train"] if "train" in raw else raw["validation"]
    label_feature = split0.features.get("label")
    is_regression = (data_args.task_name == "stsb") or (
        data_args.task_name is None and str(getattr(label_feature, "dtype", "")).startswith("float"))
    label2id = None
    if is_regression:
        num_labels = 1
    elif hasattr(label_feature, "names"):
        num_labels = len(label_feature.names)
        label2id = {n: i for i, n in enumerate(label_feature.names)}
    else:
        labels = sorted({x for s in raw.values() if "label" in s.column_names for x in s["label"] if x is not None})
        num_labels = len(labels)
        label2id = {str(l): i for i, l in enumerate(labels)}
    if not is_regression and num_labels < 2:
        raise ValueError(f"classification needs at least 2 distinct labels, found {num_labels}")

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = build_model(model_args, num_labels, is_regression, label2id)
    key1, key2 = text_keys(data_args, split0.column_names)
    max_len = min(data_args.max_seq_length, getattr(model.config, "max_position_embeddings", 10**9)
                  if model.config.position_embedding_type == "absolute" else 10**9)

    def preprocess(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        out = tokenizer(*texts, truncation=True, max_length=max_len)
        if "label" in batch and all(x is not None and x != -1 for x in batch["label"]):  # test splits: no labels
            if is_regression:
                out["labels"] = [float(x) for x in batch["label"]]
            elif label2id is not None and not hasattr(label_feature, "names"):
                out["labels"] = [label2id[str(x)] for x in batch["label"]]
            else:
                out["labels"] = batch["label"]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        processed = {name: split.map(preprocess, batched=True, remove_columns=split.column_names)
                     for name, split in raw.items()}
    train_ds = processed["train"] if training_args.do_train else None
    eval_name = "validation_matched" if data_args.task_name == "mnli" else "validation"
    eval_ds = processed[eval_name] if (training_args.do_eval or training_args.eval_strategy != "no") else None
    if train_ds is not None and data_args.max_train_samples:
        train_ds = train_ds.select(range(min(len(train_ds), data_args.max_train_samples)))
    if eval_ds is not None and data_args.max_eval_samples:
        eval_ds = eval_ds.select(range(min(len(eval_ds), data_args.max_eval_samples)))

    metric_task = data_args.metric_task or data_args.task_name or (
        "stsb" if is_regression else "mrpc" if num_labels == 2 else "sst2")
    metric = evaluate.load(GLUE_METRIC_PATH, config_name=metric_task)

    def compute_metrics(p: EvalPrediction) -> dict:
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        result = metric.compute(predictions=preds, references=p.label_ids)
        if len(result) > 1:
            result["combined_score"] = float(np.mean(list(result.values())))
        return result

    callbacks = []
    if training_args.eval_strategy != "no" and training_args.do_train:
        if training_args.save_strategy == training_args.eval_strategy:
            training_args.load_best_model_at_end = True
            if training_args.metric_for_best_model in (None, "loss"):
                training_args.metric_for_best_model = MAIN_METRIC.get(metric_task, "accuracy")
                training_args.greater_is_better = True
            if model_args.early_stopping_patience > 0:
                callbacks.append(EarlyStoppingCallback(early_stopping_patience=model_args.early_stopping_patience))
        else:
            logger.warning("save_strategy != eval_strategy: no best-checkpoint selection or early stopping")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if (training_args.fp16 or training_args.bf16) else None)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        data_collator=collator, compute_metrics=compute_metrics, callbacks=callbacks,
    )
    results: dict = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()  # the best checkpoint when load_best_model_at_end
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        results.update({f"train_{k}": v for k, v in train_result.metrics.items()})
    if training_args.do_eval and eval_ds is not None:
        metrics = trainer.evaluate(eval_dataset=eval_ds)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if training_args.do_predict and "test" in processed:
        test_ds = processed["test"].remove_columns([c for c in ("labels",) if c in processed["test"].column_names])
        preds = trainer.predict(test_ds).predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predict_results.txt"), "w") as f:
                f.write("index\tprediction\n")
                for i, p in enumerate(preds):
                    f.write(f"{i}\t{p:.4f}\n" if is_regression else f"{i}\t{model.config.id2label[int(p)]}\n")
    if training_args.do_train and trainer.is_world_process_zero():
        kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-classification"}
        if data_args.task_name:
            kwargs.update(language="en", dataset_tags="nyu-mll/glue", dataset_args=data_args.task_name,
                          dataset=f"GLUE {data_args.task_name.upper()}")
        try:
            trainer.create_model_card(**kwargs)
        except Exception as err:  # model cards need nothing online, but never fail a finished run on one
            logger.warning("could not write a model card: %s", err)
        with open(os.path.join(training_args.output_dir, "run_glue_results.json"), "w") as f:
            json.dump(results, f, indent=2, default=float)
        if training_args.push_to_hub:
            trainer.push_to_hub(**kwargs)
    return results


if __name__ == "__main__":
    main()
