#!/usr/bin/env python
"""Fine-tune NPRF-BERT on a GLUE task (or your own CSV/JSON files) with the Hugging Face Trainer.

Data: ``--task_name`` (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli) downloads GLUE from
the Hub (``nyu-mll/glue``); ``--train_file`` / ``--validation_file`` (/ ``--test_file``) read
local CSV or JSON files instead (text in ``sentence1`` [+ ``sentence2``] or ``sentence``
[+ ...], label in ``label``; float labels mean regression). Metrics come from the GLUE
``evaluate`` module shipped with hf-kernattn, so evaluation works offline.

Model: ``--model_name_or_path`` is an NPRF-BERT checkpoint, or a BERT/RoBERTa checkpoint that is
converted on the fly (``hf_kernattn.convert``: weights copied, relative-position bias zero).

Defaults you can switch off (all said again in ``--help``):

* ``--mixed_precision auto``: bf16 on CUDA GPUs that support it, else fp16 on CUDA, none on CPU
  (``--mixed_precision no`` switches it off; ``--fp16`` / ``--bf16`` choose one yourself).
* Best-model loading: when ``--eval_strategy`` equals ``--save_strategy``, the checkpoint with the
  best ``--metric_for_best_model`` (default: the task's main metric) is loaded at the end and saved
  (``--no_load_best_model_at_end`` switches it off).
* Early stopping after ``--early_stopping_patience 3`` evaluations without improvement, with
  best-model loading (``--early_stopping_patience 0`` switches it off).

Also: dynamic padding; the data files are checked before anything runs (a clear error names the
file, row and problem); ``--cpu`` is ``--use_cpu``; weight decay follows the rule shared by every
example script (none for biases, normalisation weights and the relative-position bias table);
checkpoints carry a fingerprint of the run, and ``--resume_from_checkpoint latest`` resumes the
newest complete and intact checkpoint of the same run exactly (the Trainer restores data position,
random states, optimizer and scheduler; a half-written checkpoint is skipped, a damaged one skipped
with a warning, another run's refused, naming the settings that differ). Checkpoints hold no
pickle: the optimizer, scheduler, gradient scaler and random states are written as safetensors +
JSON and the training arguments as ``training_args.json`` (instead of the Trainer's
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth`` and ``training_args.bin``),
except under DeepSpeed, FSDP or XLA, whose own checkpoint formats are kept. The Trainer applies an
FSDP or DeepSpeed launch configuration on GPUs only: on CPU processes it trains with plain DDP,
and the script says so with a warning (the Accelerate scripts shard on CPU too). The best checkpoint is
saved Hub-ready (weights, modeling code for ``trust_remote_code``, tokenizer, model card, results)
in ``--output_dir``. ``--num_threads`` sets torch's CPU threads per process.

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

import argparse
import csv
import io
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
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
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import evaluate
import hf_kernattn  # noqa: F401  (registers NPRF-BERT with the Auto classes)
from hf_kernattn.cards import save_model_card
from hf_kernattn.convert import convert_to_nprf_bert
from hf_kernattn.push import PushError, exit_not_pushed, push_folder
from hf_kernattn.metrics import GLUE_METRIC_PATH
from hf_kernattn.training import (
    NUM_THREADS_HELP,
    CheckpointError,
    check_training_values,
    configure_threads,
    decay_parameter_names,
    launch_sharding,
    load_tree,
    local_process_count,
    resolve_checkpoint,
    rng_state,
    run_fingerprint,
    run_main,
    save_tree,
    set_rng_state,
    write_state_file,
)

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
RUN_STATE_FILE = "hf_kernattn_run.json"  # in each checkpoint-N: complete, and of which run
MAIN_METRIC = {"cola": "matthews_correlation", "stsb": "pearson", "mrpc": "f1", "qqp": "f1"}


@dataclass
class ModelArguments:
    """Which model and tokenizer to fine-tune."""

    model_name_or_path: str = field(metadata={"help": "NPRF-BERT checkpoint, or a BERT/RoBERTa one to convert"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "tokenizer if not the model's"})
    num_random_features: Optional[int] = field(default=None, metadata={"help": "override when converting"})
    attn_backend: Optional[str] = field(default=None, metadata={"help": "override the attention backend"})
    allow_pickle: bool = field(
        default=False,
        metadata={"help": "when converting a BERT/RoBERTa source that has only pickled weights (pytorch_model*.bin), "
                          "read them (unpickling can run code from the file: only for sources you trust)"},
    )


@dataclass
class RunArguments:
    """Defaults of this script that change what the Trainer does, each of which can be switched off."""

    mixed_precision: str = field(
        default="auto",
        metadata={"help": "auto (default): bf16 on CUDA GPUs that support it, else fp16 on CUDA, none on CPU; "
                          "'no' switches mixed precision off; fp16 / bf16 force one",
                  "choices": ["auto", "no", "fp16", "bf16"]},
    )
    no_load_best_model_at_end: bool = field(
        default=False,
        metadata={"help": "by default, when --eval_strategy equals --save_strategy, the checkpoint with the best "
                          "--metric_for_best_model (default: the task's main metric) is loaded at the end and saved; "
                          "this flag switches that off (and early stopping with it)"},
    )
    early_stopping_patience: int = field(
        default=3, metadata={"help": "with best-model loading: stop after this many evaluations without "
                                     "improvement (default 3; 0 switches early stopping off)"}
    )
    cpu: bool = field(default=False, metadata={"help": "run on CPU (the same as --use_cpu)"})
    stop_after_steps: Optional[int] = field(
        default=None,
        metadata={"help": "end this invocation after N more optimizer steps (counted from where it starts or "
                          "resumes), with a checkpoint, as a job with a time limit would; the same command with "
                          "--resume_from_checkpoint latest then runs the next N"},
    )
    num_threads: Optional[int] = field(default=None, metadata={"help": NUM_THREADS_HELP})

    def __post_init__(self) -> None:
        if self.early_stopping_patience < 0:
            raise ValueError(f"--early_stopping_patience must be >= 0, got {self.early_stopping_patience}")
        check_training_values({"stop_after_steps": self.stop_after_steps, "num_threads": self.num_threads},
                              {"stop_after_steps": "--stop_after_steps", "num_threads": "--num_threads"})


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


def _read_records(path: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """Columns and ``(line, row)`` pairs of a CSV or JSON / JSON-lines file; ``ValueError`` naming
    the file and line for a missing, empty, header-only or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    records: list[tuple[int, dict]] = []
    if p.suffix == ".csv":
        reader = csv.reader(io.StringIO(text, newline=""))
        try:
            header = next(reader)
            columns = [c.strip() for c in header]
            if any(not c for c in columns) or len(set(columns)) != len(columns):
                raise ValueError(f"{path}, line 1: the header needs distinct, non-empty column names, got {header}")
            for row in reader:
                if not row:
                    continue
                if len(row) != len(columns):
                    raise ValueError(f"{path}, line {reader.line_num}: {len(row)} fields, but the header has "
                                     f"{len(columns)} ({columns})")
                records.append((reader.line_num, dict(zip(columns, row))))
        except csv.Error as err:
            raise ValueError(f"{path}, line {reader.line_num}: malformed CSV ({err})") from None
        if not records:
            raise ValueError(f"{path}: only a header, no data rows")
        return columns, records
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        items = [(i + 1, r) for i, r in enumerate(whole)]
        where = "item"
    elif isinstance(whole, dict) and len(text.strip().splitlines()) > 1:
        raise ValueError(f"{path}: expected JSON lines (one object per line) or a list of objects, got one object")
    else:
        items, where = [], "line"
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append((i, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {i}: not valid JSON ({err.msg})") from None
    if not items:
        raise ValueError(f"{path}: no rows")
    columns = None
    for i, row in items:
        if not isinstance(row, dict):
            raise ValueError(f"{path}, {where} {i}: expected an object with named fields, got {type(row).__name__}")
        if columns is None:
            columns = list(row)
        elif set(row) != set(columns):
            raise ValueError(f"{path}, {where} {i}: fields {sorted(row)} differ from the first row's {sorted(columns)}")
        records.append((i, row))
    return columns, records


def _is_no_label(value) -> bool:
    """GLUE's test files mark "no label" with -1."""
    return str(value).strip() in ("-1", "-1.0")


def check_data_files(data: DataArguments) -> dict[str, list[str]]:
    """Check the local files before anything runs; returns each split's columns.

    Errors name the file, the line and the problem: empty, header-only or malformed files, files
    whose columns differ, missing or empty text, missing or empty labels in the training and
    validation files, and the "no label" value -1 there. In the test file labels are not needed:
    -1 or an empty cell means unlabeled.
    """
    files = {k: v for k, v in (("train", data.train_file), ("validation", data.validation_file),
                               ("test", data.test_file)) if v is not None}
    if len({Path(v).suffix == ".csv" for v in files.values()}) > 1:
        raise ValueError(f"the data files must all be CSV or all JSON, got {sorted(files.values())}")
    read = {split: _read_records(path) for split, path in files.items()}
    ref_split = "train" if "train" in read else "validation" if "validation" in read else "test"
    ref = [c for c in read[ref_split][0] if c != "label"]
    for split, (columns, _) in read.items():
        if sorted(c for c in columns if c != "label") != sorted(ref):
            raise ValueError(f"{files[split]} has the columns {columns}, but {files[ref_split]} has "
                             f"{read[ref_split][0]}: every file needs the same text columns")
    key1, key2 = text_keys(data, read[ref_split][0])
    for split, (columns, records) in read.items():
        path = files[split]
        if split != "test" and "label" not in columns:
            raise ValueError(f"{path}: no 'label' column (needed in the {split} file)")
        for line, row in records:
            for key in (key1, key2):
                if key is not None and (not isinstance(row.get(key), str) or not row[key].strip()):
                    raise ValueError(f"{path}, line {line}: empty text in column {key!r}")
            if split == "test" or "label" not in columns:
                continue
            label = row["label"]
            if label is None or (isinstance(label, str) and not label.strip()):
                raise ValueError(f"{path}, line {line}: empty label (every {split} row needs one; empty cells would "
                                 "otherwise turn the task into regression)")
            if _is_no_label(label):
                raise ValueError(f"{path}, line {line}: label -1 means 'no label' in GLUE files; the {split} file "
                                 "needs real labels")
    return {split: columns for split, (columns, _) in read.items()}


def load_raw(data: DataArguments, cache_dir: Optional[str]):
    if data.task_name is not None and data.train_file is None and data.validation_file is None:
        return load_dataset("nyu-mll/glue", data.task_name, cache_dir=cache_dir)
    check_data_files(data)
    files = {k: v for k, v in (("train", data.train_file), ("validation", data.validation_file),
                               ("test", data.test_file)) if v is not None}
    kind = "csv" if next(iter(files.values())).endswith(".csv") else "json"
    # The test file is read on its own: its labels (if any, -1 = none) must not shape the others.
    raw = load_dataset(kind, data_files={k: v for k, v in files.items() if k != "test"}, cache_dir=cache_dir) \
        if set(files) - {"test"} else None
    if "test" in files:
        test = load_dataset(kind, data_files={"test": files["test"]}, cache_dir=cache_dir)
        if raw is None:
            raw = test
        else:
            raw["test"] = test["test"]
    return raw


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
            problem_type=problem_type, allow_pickle=args.allow_pickle, **overrides,
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


TRAINING_ARGS_JSON = "training_args.json"


class NPRFBertTrainer(Trainer):
    """The Trainer with the weight-decay rule of every example script
    (:func:`hf_kernattn.training.decay_parameter_names`) and checkpoints without pickle.

    The Trainer pickles the optimizer, scheduler, scaler and random states (``optimizer.pt``,
    ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``) and the training arguments
    (``training_args.bin``); here they are safetensors + JSON (``optimizer``, ``scheduler``,
    ``scaler``, ``rng_state_{process}`` ``.safetensors``/``.json``, :func:`hf_kernattn.training.save_tree`)
    and ``training_args.json``, read back without unpickling. Under DeepSpeed, FSDP or XLA the
    Trainer's own formats are kept. With ``run_state=(fingerprint, settings)``, each checkpoint is
    marked complete and of this run once every process has written its files (``RUN_STATE_FILE``:
    the fingerprint and the size and SHA-256 of every file)."""

    def __init__(self, *a, run_state: Optional[tuple[str, dict]] = None, **kw):
        super().__init__(*a, **kw)
        self.run_state = run_state

    def get_decay_parameter_names(self, model) -> list[str]:
        return decay_parameter_names(model)

    def _own_format(self) -> bool:
        from transformers.utils import is_torch_xla_available

        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled or is_torch_xla_available())

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return super()._save(output_dir, state_dict)  # non-writer ranks of sharded models join the gathers
        os.makedirs(output_dir, exist_ok=True)
        self.accelerator.unwrap_model(self.model, keep_torch_compile=False).save_pretrained(
            output_dir, state_dict=state_dict, is_main_process=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        # The Trainer would pickle its arguments into training_args.bin: JSON instead.
        Path(output_dir, TRAINING_ARGS_JSON).write_text(self.args.to_json_string())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._own_format():
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            save_tree(Path(output_dir), "optimizer", self.optimizer.state_dict())
            save_tree(Path(output_dir), "scheduler", self.lr_scheduler.state_dict())

    def _save_scaler(self, output_dir: str) -> None:
        if not self._own_format():
            return super()._save_scaler(output_dir)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            save_tree(Path(output_dir), "scaler", scaler.state_dict())

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._own_format():
            return super()._save_rng_state(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        save_tree(Path(output_dir), f"rng_state_{self.args.process_index}", rng_state())

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or not self._own_format():
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._require(checkpoint, "optimizer")
        self.optimizer.load_state_dict(load_tree(Path(checkpoint), "optimizer"))
        self._require(checkpoint, "scheduler")
        self.lr_scheduler.load_state_dict(load_tree(Path(checkpoint), "scheduler"))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or not self._own_format():
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and Path(checkpoint, "scaler.json").is_file():
            scaler.load_state_dict(load_tree(Path(checkpoint), "scaler"))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or not self._own_format():
            return super()._load_rng_state(checkpoint)
        name = f"rng_state_{self.args.process_index}"
        self._require(checkpoint, name)
        set_rng_state(load_tree(Path(checkpoint), name))

    @staticmethod
    def _require(checkpoint: str, name: str) -> None:
        if not (Path(checkpoint, f"{name}.json").is_file() and Path(checkpoint, f"{name}.safetensors").is_file()):
            raise CheckpointError(
                f"the checkpoint {checkpoint} has no {name}.json/.safetensors (a checkpoint written with pickled "
                "optimizer and random states, or by another number of processes): it is not resumed, as this "
                "script never unpickles; start afresh or resume one of its own checkpoints")

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.run_state is None:
            return
        self.accelerator.wait_for_everyone()  # every process's random state is written
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            write_state_file(folder, *self.run_state, RUN_STATE_FILE, step=self.state.global_step)
        self.accelerator.wait_for_everyone()


class StopAfterStepsCallback(TrainerCallback):
    """``--stop_after_steps N``: end the run, with a checkpoint, N optimizer steps after the step
    this invocation started (or resumed) at."""

    def __init__(self, stop_after_steps: int):
        self.stop_after_steps, self.stop_at = stop_after_steps, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.stop_at = state.global_step + self.stop_after_steps
        if self.stop_at < state.max_steps:
            logger.info("--stop_after_steps %d: this invocation stops after step %d (of %d), with a checkpoint",
                        self.stop_after_steps, self.stop_at, state.max_steps)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_save = True
            control.should_training_stop = True
        return control


# TrainingArguments that change what a run computes: they make up the run's fingerprint.
TRAJECTORY_ARGS = (
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "num_train_epochs",
    "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "seed", "data_seed",
    "per_device_train_batch_size", "gradient_accumulation_steps", "fp16", "bf16", "optim", "label_smoothing_factor",
    "eval_strategy", "eval_steps", "save_strategy", "save_steps", "metric_for_best_model", "load_best_model_at_end",
    "gradient_checkpointing",
)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, RunArguments, TrainingArguments),
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, run_args, training_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        argv = list(sys.argv[1:] if argv is None else argv)
        if "--cpu" in argv and "--use_cpu" not in argv:
            argv.append("--use_cpu")  # --cpu, the flag of the Accelerate scripts, is the Trainer's --use_cpu
        model_args, data_args, run_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO
                        if training_args.process_index == 0 else logging.WARNING, handlers=[logging.StreamHandler()])
    transformers.utils.logging.set_verbosity_warning()
    logger.info("CPU threads per process: %d", configure_threads(run_args.num_threads, local_process_count()))

    if run_args.mixed_precision == "no":
        if training_args.fp16 or training_args.bf16:
            raise ValueError("--mixed_precision no contradicts --fp16/--bf16")
    elif run_args.mixed_precision in ("fp16", "bf16"):
        setattr(training_args, run_args.mixed_precision, True)
    elif torch.cuda.is_available() and not (training_args.fp16 or training_args.bf16 or training_args.use_cpu):
        if torch.cuda.is_bf16_supported():
            training_args.bf16 = True
        else:
            training_args.fp16 = True
    logger.info("mixed precision: %s", "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no")
    set_seed(training_args.seed)
    # --push_to_hub publishes the final folder once, through hf_kernattn.push (the card this script
    # renders, the checkpoint's files only); the Trainer's own pushes at every save are off.
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False

    raw = load_raw(data_args, cache_dir=None)
    labelled = [raw[k] for k in raw if k != "test" and "label" in raw[k].column_names]
    split0 = raw["train"] if "train" in raw else raw["validation"] if "validation" in raw else raw["test"]
    label_feature = labelled[0].features.get("label") if labelled else None
    is_regression = (data_args.task_name == "stsb") or (
        data_args.task_name is None and str(getattr(label_feature, "dtype", "")).startswith("float"))
    label2id = None
    if is_regression:
        num_labels = 1
    elif hasattr(label_feature, "names"):
        num_labels = len(label_feature.names)
        label2id = {n: i for i, n in enumerate(label_feature.names)}
    else:
        labels = sorted({x for s in labelled for x in s["label"] if x is not None and not _is_no_label(x)})
        num_labels = len(labels)
        label2id = {str(l): i for i, l in enumerate(labels)}
    if not is_regression and num_labels < 2:
        raise ValueError(f"classification needs at least 2 distinct labels in the training/validation data, "
                         f"found {num_labels}")

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = build_model(model_args, num_labels, is_regression, label2id)
    key1, key2 = text_keys(data_args, split0.column_names)
    max_len = min(data_args.max_seq_length, getattr(model.config, "max_position_embeddings", 10**9)
                  if model.config.position_embedding_type == "absolute" else 10**9)

    def preprocess(batch, with_labels: bool):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        out = tokenizer(*texts, truncation=True, max_length=max_len)
        if with_labels and "label" in batch:
            if is_regression:
                out["labels"] = [float(x) for x in batch["label"]]
            elif label2id is not None and not hasattr(label_feature, "names"):
                out["labels"] = [label2id[str(x)] for x in batch["label"]]
            else:
                out["labels"] = batch["label"]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        # Test splits are predicted, never scored: their labels (GLUE's -1 = none) are dropped.
        processed = {name: split.map(preprocess, batched=True, remove_columns=split.column_names,
                                     fn_kwargs={"with_labels": not name.startswith("test")})
                     for name, split in raw.items()}
    train_ds = processed["train"] if training_args.do_train else None
    eval_name = "validation_matched" if data_args.task_name == "mnli" else "validation"
    needs_eval = training_args.do_eval or training_args.eval_strategy != "no"
    if needs_eval and eval_name not in processed:
        raise ValueError("evaluation (--do_eval or --eval_strategy) needs --validation_file")
    if training_args.do_train and train_ds is None:
        raise ValueError("--do_train needs --train_file (or --task_name)")
    eval_ds = processed[eval_name] if needs_eval else None
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
    if training_args.eval_strategy != "no" and training_args.do_train and not run_args.no_load_best_model_at_end:
        if training_args.save_strategy == training_args.eval_strategy:
            training_args.load_best_model_at_end = True
            if training_args.metric_for_best_model in (None, "loss"):
                training_args.metric_for_best_model = MAIN_METRIC.get(metric_task, "accuracy")
                training_args.greater_is_better = True
            logger.info("best-model loading on (%s); --no_load_best_model_at_end switches it off",
                        training_args.metric_for_best_model)
            if run_args.early_stopping_patience > 0:
                callbacks.append(EarlyStoppingCallback(early_stopping_patience=run_args.early_stopping_patience))
        else:
            logger.warning("save_strategy != eval_strategy: no best-checkpoint selection or early stopping")

    settings = {k: getattr(training_args, k, None) for k in TRAJECTORY_ARGS} | {
        "script": "run_glue", "model": asdict(model_args), "data": asdict(data_args),
        "mixed_precision": run_args.mixed_precision, "early_stopping_patience": run_args.early_stopping_patience,
        "world_size": training_args.world_size, "device": training_args.device.type,
    }
    fingerprint = run_fingerprint(json.loads(json.dumps(settings, default=str)))
    resume = None
    if training_args.do_train and training_args.resume_from_checkpoint:
        resume = resolve_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir, fingerprint,
                                    prefix=f"{PREFIX_CHECKPOINT_DIR}-", state_file=RUN_STATE_FILE,
                                    settings=json.loads(json.dumps(settings, default=str)))
        if resume is None:
            logger.warning("no checkpoint of this run in %s: starting fresh", training_args.output_dir)
    stopper = StopAfterStepsCallback(run_args.stop_after_steps) if run_args.stop_after_steps is not None else None
    if stopper is not None:
        callbacks.append(stopper)

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if (training_args.fp16 or training_args.bf16) else None)
    trainer = NPRFBertTrainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        data_collator=collator, compute_metrics=compute_metrics, callbacks=callbacks,
        run_state=(fingerprint, settings),
    )
    asked = launch_sharding() or ("FSDP" if training_args.fsdp else "DeepSpeed" if training_args.deepspeed else None)
    if asked and not (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled) and training_args.process_index == 0:
        logger.warning("%s was asked for, but the Trainer applies FSDP and DeepSpeed only on GPUs: these %d %s "
                       "process(es) train unsharded (plain DDP: each holds the whole model and optimizer). The "
                       "Accelerate scripts (run_mlm.py, run_clm.py, run_image_classification.py) shard on CPU too",
                       asked, training_args.world_size, training_args.device.type)
    results: dict = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        if stopper is not None and stopper.stop_at is not None and \
                stopper.stop_at <= trainer.state.global_step < trainer.state.max_steps:
            logger.warning("stopped after step %d (--stop_after_steps); resume with --resume_from_checkpoint latest",
                           trainer.state.global_step)
            return {"stopped": True, "step": trainer.state.global_step}
        trainer.save_model()  # the best checkpoint when load_best_model_at_end
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        # Trainer's metric names already carry their prefix (train_runtime, train_loss, ...).
        results.update({k if k.startswith("train_") else f"train_{k}": v for k, v in train_result.metrics.items()})
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
                for i, p in enumerate(np.atleast_1d(preds)):
                    f.write(f"{i}\t{p:.4f}\n" if is_regression else f"{i}\t{model.config.id2label[int(p)]}\n")
    if training_args.do_train and trainer.is_world_process_zero():
        dataset = f"glue/{data_args.task_name}" if data_args.task_name else os.path.basename(data_args.train_file)
        card_results = [
            {"task": "text-classification", "dataset": dataset, "split": "validation",
             "metric": key[len("eval_"):], "value": float(value)}
            for key, value in results.items()
            if key.startswith("eval_") and key not in NOT_METRICS and isinstance(value, (int, float))
        ]
        save_model_card(
            trainer.model, training_args.output_dir, results=card_results, base_model=model_args.model_name_or_path,
            datasets=["nyu-mll/glue"] if data_args.task_name else None,
            training={"optimizer steps": trainer.state.global_step, "epochs": training_args.num_train_epochs,
                      "learning rate": training_args.learning_rate},
        )
        with open(os.path.join(training_args.output_dir, "run_glue_results.json"), "w") as f:
            json.dump(results, f, indent=2, default=float)
        if push_to_hub:
            try:
                url = push_folder(training_args.output_dir, training_args.hub_model_id or Path(training_args.output_dir).name,
                                  private=bool(training_args.hub_private_repo), token=training_args.hub_token)
                logger.info("pushed to %s", url)
            except (PushError, ValueError) as err:
                exit_not_pushed(err)  # one line, exit status 1; everything above is saved
    return results


# Trainer's evaluation entries that are not metrics of the model
NOT_METRICS = {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_epoch"}


if __name__ == "__main__":
    run_main(main)
