#!/usr/bin/env python
"""Linearize a BERT classifier on a GLUE-style task: today's conversion against attention transfer.

1. Data: by default a local task built from Python's own documentation (the ``pydoc`` topics,
   i.e. the language reference, and the standard library's docstrings; on every machine,
   offline), written as GLUE-style CSV files in ``OUTPUT_DIR/data``. ``--local_task origin``
   (default, single sentences like SST-2): was the sentence written for the language reference
   (label 0) or as a library docstring (label 1)? ``--local_task pairs`` (like MRPC): is sentence
   2 an edited copy of sentence 1 (label 1) or of another sentence of the same document (label
   0; an edit replaces about a quarter of the words with words of the other sentence and drops
   one)? Whole documents go to training or validation (about a tenth of the sentences
   validate), so validation sentences are never seen in training. Or
   ``--train_file/--validation_file`` (CSV/JSON as ``examples/run_glue.py`` reads them) or
   ``--task_name`` (a GLUE task through ``datasets``; online).
2. Teacher: ``--model_name_or_path`` (a BERT checkpoint with its tokenizer), or a small BERT
   with a WordPiece tokenizer trained here (``--mlm_steps`` of masked-language modelling on the
   training documents), then fine-tuned on the task (``--finetune_steps``, softmax attention).
3. (i) Today's recipe: ``hf_kernattn.convert`` (as ``run_glue.py`` converts a BERT source:
   NPRF-BERT, positive random features) and full fine-tuning for ``--finetune_steps``.
4. (ii) Attention transfer: ``hf_kernattn.convert.linearize.linearize`` on the fine-tuned
   teacher and the task's own training inputs (one sequence per example, sentence pairs as
   pairs, padded batches, both models reading the padding mask; ``--transfer_steps``; only the
   learned feature maps train), then
   fine-tuning for ``--finetune_steps`` with LoRA (``hf_kernattn.lora_config``: the attention and
   MLP projections, the classifier in full; ``--student_finetune full`` fine-tunes every weight
   instead); the adapters are merged and the model saved Hub-ready.
5. (iii) As (ii) with the sliding-window hybrid (``--softmax_window W``, 0 = off): exact
   ``exp(q . k / sqrt(d))`` over the keys within W positions, the learned feature map beyond, one
   normaliser, learned per-head mixing weights (trained with the feature maps).
6. Accuracy and F1 (scikit-learn) on the validation split for the teacher and every stage, the
   majority class as baseline: ``results.json`` and ``results.md`` in ``--output_dir``.

    python examples/research/linearize_bert_glue.py --output_dir out/linearize_bert_glue
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from datasets import Dataset
from sklearn.metrics import accuracy_score, f1_score
from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification,
                          DataCollatorForLanguageModeling, DataCollatorWithPadding, Trainer, TrainingArguments,
                          set_seed)
from transformers.utils import logging

from hf_kernattn_cli import docstring_summary  # (the command line's text helpers, without importing the package)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, beside research/
from run_glue import TASK_TO_KEYS, DataArguments, ModelArguments, build_model, load_raw, text_keys  # noqa: E402

from hf_kernattn.training import NUM_THREADS_HELP, configure_threads  # noqa: E402

logger = logging.get_logger("linearize_bert_glue")
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LOCAL_TASKS = {
    "origin": "local single sentences (Python documentation: language reference or library docstring?)",
    "pairs": "local sentence pairs (Python documentation: is sentence 2 an edited copy of sentence 1?)",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=docstring_summary(__doc__),
                                epilog="example: python examples/research/linearize_bert_glue.py --output_dir out/linearize_bert_glue")
    p.add_argument("--output_dir", required=True, help="folder for the data, the models and results.json/.md")
    p.add_argument("--task_name", default=None, help=f"a GLUE task through datasets (online): {sorted(TASK_TO_KEYS)}")
    p.add_argument("--train_file", default=None, help="CSV/JSON training file as run_glue.py reads it")
    p.add_argument("--validation_file", default=None, help="CSV/JSON validation file (with --train_file)")
    p.add_argument("--local_task", choices=sorted(LOCAL_TASKS), default="origin",
                   help="the local task (without --task_name/--train_file): origin (default; one sentence: language "
                        "reference or library docstring?) or pairs (is sentence 2 an edited copy of sentence 1?)")
    p.add_argument("--max_sentences", type=int, default=6000,
                   help="sentences of the local documentation text to use (local tasks; half of each origin at most)")
    p.add_argument("--model_name_or_path", default=None,
                   help="a BERT checkpoint with its tokenizer as the teacher's start instead of the one trained here")
    p.add_argument("--vocab_size", type=int, default=4000, help="WordPiece vocabulary of the BERT trained here")
    p.add_argument("--hidden_size", type=int, default=128, help="width of the BERT trained here")
    p.add_argument("--num_layers", type=int, default=4, help="layers of the BERT trained here")
    p.add_argument("--num_heads", type=int, default=4, help="attention heads of the BERT trained here")
    p.add_argument("--max_seq_length", type=int, default=64, help="tokens per example ([CLS] and [SEP]s included)")
    p.add_argument("--mlm_steps", type=int, default=300, help="masked-language-model steps of the BERT trained here")
    p.add_argument("--mlm_learning_rate", type=float, default=1e-3, help="learning rate of the masked-LM training")
    p.add_argument("--finetune_steps", type=int, default=250,
                   help="task fine-tuning steps of the teacher and of each kernelized model")
    p.add_argument("--learning_rate", type=float, default=5e-4,
                   help="full fine-tuning learning rate (the teacher and today's recipe)")
    p.add_argument("--transfer_steps", type=int, default=100, help="attention-transfer steps")
    p.add_argument("--transfer_learning_rate", type=float, default=1e-2, help="attention-transfer learning rate")
    p.add_argument("--feature_map", default="hedgehog", help="the learned feature map of attention transfer")
    p.add_argument("--softmax_window", type=int, default=8,
                   help="W of (iii), the sliding-window hybrid: exact softmax over the keys within W positions, "
                        "the learned feature map beyond (default 8; 0 leaves (iii) out)")
    p.add_argument("--student_finetune", choices=("lora", "full"), default="lora",
                   help="how the attention-transferred model is fine-tuned (default: lora)")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora_learning_rate", type=float, default=2e-3, help="learning rate of the LoRA fine-tuning")
    p.add_argument("--num_random_features", type=int, default=64, help="random features per head of today's recipe")
    p.add_argument("--batch_size", type=int, default=32, help="examples per step (every training)")
    p.add_argument("--max_train_samples", type=int, default=None, help="use at most this many training examples")
    p.add_argument("--max_eval_samples", type=int, default=None, help="evaluate at most this many examples")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, the initialisation and the data order")
    p.add_argument("--num_threads", type=int, default=None, help=NUM_THREADS_HELP)
    args = p.parse_args(argv)
    if args.task_name is not None and (args.train_file or args.validation_file):
        p.error("give --task_name or --train_file/--validation_file, not both")
    if bool(args.train_file) != bool(args.validation_file):
        p.error("give both --train_file and --validation_file, or neither")
    for name in ("max_sentences", "vocab_size", "hidden_size", "num_layers", "num_heads", "finetune_steps",
                 "transfer_steps", "batch_size", "lora_r", "num_random_features"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.softmax_window < 0:
        p.error(f"--softmax_window must be >= 0 (0: off), got {args.softmax_window}")
    if args.mlm_steps < 0:
        p.error(f"--mlm_steps must be >= 0, got {args.mlm_steps}")
    if args.max_seq_length < 8:
        p.error(f"--max_seq_length must be >= 8, got {args.max_seq_length}")
    for name in ("mlm_learning_rate", "learning_rate", "transfer_learning_rate", "lora_learning_rate"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.hidden_size % args.num_heads:
        p.error(f"--hidden_size ({args.hidden_size}) must be divisible by --num_heads ({args.num_heads})")
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num_threads must be >= 1, got {args.num_threads}")
    return args


# ----------------------------------------------------------------------------- the local task

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def documentation_documents(max_sentences: int) -> list[tuple[int, list[str]]]:
    """Documents (lists of English sentences of 6-24 words) from Python's own documentation, each
    with its origin: 0 for the language reference (the ``pydoc`` topics), 1 for the standard
    library's docstrings (files sorted by name); at most ``max_sentences // 2`` sentences of each
    origin, and no more docstring sentences than reference ones (balanced classes)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship Python without pydoc_data
        topics = {}
    docs: list[tuple[int, list[str]]] = []
    count = [0, 0]
    limit = [max_sentences // 2, max_sentences // 2]

    def add(origin: int, text: str) -> None:
        sents = [s for s in _SENTENCE_END.split(re.sub(r"\s+", " ", text))
                 if 6 <= len(s.split()) <= 24 and sum(c.isalpha() for c in s) > 0.7 * len(s.replace(" ", ""))]
        sents = sents[: limit[origin] - count[origin]]
        if sents:
            docs.append((origin, sents))
            count[origin] += len(sents)

    for key in sorted(topics):
        if count[0] < limit[0]:
            add(0, topics[key])
    limit[1] = min(limit[1], count[0])
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if count[1] >= limit[1]:
            break
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and count[1] < limit[1]:
                    add(1, doc)
    if min(count) < 10:
        raise ValueError(f"Python's documentation gave only {count[0]} reference and {count[1]} docstring sentences "
                         "(is pydoc_data missing?); pass --train_file/--validation_file")
    return docs


def _edit(sentence: str, donor: str, rng: random.Random) -> str:
    """About a quarter of the words replaced with words of ``donor``, then one word dropped."""
    words, other = sentence.split(), donor.split()
    words = [rng.choice(other) if rng.random() < 0.25 else w for w in words]
    del words[rng.randrange(len(words))]
    return " ".join(words)


def pair_examples(docs: list[list[str]], rng: random.Random) -> list[dict]:
    """One example per sentence A: (A, an edited copy of A) labelled 1 or (A, an edited copy of
    another sentence of A's document, with words of A) labelled 0, each with probability 1/2."""
    every = [s for d in docs for s in d]
    rows = []
    for doc in docs:
        for i, a in enumerate(doc):
            others = [s for j, s in enumerate(doc) if j != i] or [s for s in every if s != a]
            other = rng.choice(others)
            if rng.random() < 0.5:
                rows.append({"sentence1": a, "sentence2": _edit(a, other, rng), "label": 1})
            else:
                rows.append({"sentence1": a, "sentence2": _edit(other, a, rng), "label": 0})
    rng.shuffle(rows)
    return rows


def write_local_task(folder: Path, kind: str, max_sentences: int, seed: int) -> tuple[Path, Path, list[str]]:
    """The local task's ``train.csv`` / ``validation.csv`` in ``folder`` (``kind``: ``origin``,
    single sentences, or ``pairs``); also the training documents' sentences (the masked-LM text)."""
    import csv

    docs = documentation_documents(max_sentences)
    train_docs, valid_docs = [], []
    for origin in (0, 1):  # whole documents to validation while they hold less than a tenth of the sentences
        seen = held = 0
        for o, doc in docs:
            if o != origin:
                continue
            seen += len(doc)
            if held + len(doc) <= 0.1 * seen:
                valid_docs.append((o, doc))
                held += len(doc)
            else:
                train_docs.append((o, doc))
    if {o for o, _ in valid_docs} != {0, 1} or {o for o, _ in train_docs} != {0, 1}:
        raise ValueError(f"the documentation text ({len(docs)} documents) cannot be split into training and "
                         "validation documents of both origins; raise --max_sentences")
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, split in (("train", train_docs), ("validation", valid_docs)):
        if kind == "pairs":
            rows, fields = pair_examples([d for _, d in split], rng), ["sentence1", "sentence2", "label"]
        else:
            rows, fields = [{"sentence": s, "label": o} for o, d in split for s in d], ["sentence", "label"]
            rng.shuffle(rows)
        path = folder / f"{name}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        paths.append(path)
    return paths[0], paths[1], [s for _, d in train_docs for s in d]


# ----------------------------------------------------------------------------- models


def build_tokenizer(sentences: list[str], vocab_size: int, folder: Path):
    """A lower-cased WordPiece (BERT) tokenizer trained on ``sentences``, saved in ``folder``."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(sentences, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                           show_progress=False)
    folder.mkdir(parents=True, exist_ok=True)
    wp.save_model(str(folder))
    tok = BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=True)  # (transformers 5: vocab=, not vocab_file=)
    tok.save_pretrained(folder)
    return tok


def training_args(out: Path, steps: int, lr: float, args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=args.batch_size, learning_rate=lr,
        lr_scheduler_type="linear", warmup_steps=max(1, steps // 10), weight_decay=0.01, eval_strategy="no",
        save_strategy="no", logging_steps=max(1, steps // 5), report_to=[], seed=args.seed, data_seed=args.seed,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True,
    )


def train(model, dataset, collator, steps: int, lr: float, args, scratch: Path) -> dict:
    """Train ``model`` for ``steps`` steps with ``Trainer``; wall and CPU seconds, the last loss."""
    wall, cpu = time.perf_counter(), time.process_time()
    set_seed(args.seed)
    trainer = Trainer(model=model, args=training_args(scratch, steps, lr, args), train_dataset=dataset,
                      data_collator=collator)
    result = trainer.train()
    model.eval()
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "train_loss": float(result.training_loss)}


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def predict(model, dataset, collator, batch_size: int) -> np.ndarray:
    """Predicted classes of ``dataset`` (padded batches, ``eval()`` mode)."""
    model.eval()
    preds = []
    for i in range(0, len(dataset), batch_size):
        rows = dataset[i:i + batch_size]
        features = [{k: rows[k][j] for k in rows if k != "labels"} for j in range(len(rows["input_ids"]))]
        logits = model(**collator(features)).logits
        preds.append(logits.argmax(-1).numpy())
    return np.concatenate(preds)


def scores(model, dataset, collator, batch_size: int) -> dict:
    """Accuracy and F1 (scikit-learn: of class 1 with two classes, macro otherwise)."""
    labels = np.asarray(dataset["labels"])
    preds = predict(model, dataset, collator, batch_size)
    binary = len(set(labels.tolist()) | set(preds.tolist())) <= 2 and set(labels.tolist()) <= {0, 1}
    return {"accuracy": float(accuracy_score(labels, preds)),
            "f1": float(f1_score(labels, preds, average="binary" if binary else "macro", zero_division=0))}


def render_table(results: dict) -> list[str]:
    """The lines of ``results.md``: one row per model (CPU seconds of its training: the figure
    that does not depend on what else the machine runs; wall seconds beside it)."""
    ex = results["examples"]
    lines = [f"Task: {results['task']}; {ex['train']} training / {ex['validation']} validation examples.", "",
             "| model | trained | trainable parameters | accuracy | F1 | training CPU time (s) | wall time (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        cpu, wall = (f"{r['cpu_seconds']:.0f}", f"{r['seconds']:.0f}") if "seconds" in r else ("-", "-")
        lines.append(f"| {r['model']} | {r['trained']} | {r['trainable_parameters']:,} | {r['accuracy']:.4f} | "
                     f"{r['f1']:.4f} | {cpu} | {wall} |")
    base = results["majority_class"]
    lines.append(f"| majority class (baseline) | - | - | {base['accuracy']:.4f} | {base['f1']:.4f} | - | - |")
    return lines


# ----------------------------------------------------------------------------- the run


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.set_verbosity_info()
    logger.info(f"CPU threads: {configure_threads(args.num_threads)}")
    set_seed(args.seed)
    out = Path(args.output_dir)
    # what the user gave is read and checked before anything is written
    if args.train_file or args.task_name:
        raw = load_raw(DataArguments(task_name=args.task_name, train_file=args.train_file,
                                     validation_file=args.validation_file), cache_dir=None)
        if args.model_name_or_path is None and args.mlm_steps > 0 and "train" not in raw:
            raise ValueError("the data has no training split")
    if args.model_name_or_path is not None:
        from hf_kernattn.convert.common import read_config, resolve_checkpoint

        read_config(resolve_checkpoint(args.model_name_or_path), ("bert",))
    scratch = Path(tempfile.mkdtemp(prefix="linearize_bert_glue_"))
    try:
        return _run(args, out, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, out: Path, scratch: Path) -> dict:
    import peft

    import hf_kernattn
    from hf_kernattn.convert.linearize import linearize

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    mlm_text = None
    if args.train_file or args.task_name:
        train_file, valid_file, task = args.train_file, args.validation_file, args.task_name or Path(args.train_file).name
    else:
        train_file, valid_file, mlm_text = write_local_task(out / "data", args.local_task, args.max_sentences, args.seed)
        task = LOCAL_TASKS[args.local_task]
    data_args = DataArguments(task_name=args.task_name, train_file=str(train_file) if train_file else None,
                              validation_file=str(valid_file) if valid_file else None)
    raw = load_raw(data_args, cache_dir=None)
    eval_name = "validation_matched" if args.task_name == "mnli" else "validation"
    key1, key2 = text_keys(data_args, raw["train"].column_names)
    label_feature = raw["train"].features.get("label")
    if str(getattr(label_feature, "dtype", "")).startswith("float") or args.task_name == "stsb":
        raise ValueError("this comparison is of classification accuracy; the labels are real numbers (regression)")
    if hasattr(label_feature, "names"):
        label2id = {n: i for i, n in enumerate(label_feature.names)}
    else:
        label2id = {str(x): i for i, x in enumerate(sorted({x for x in raw["train"]["label"]}))}
    named = hasattr(label_feature, "names")
    if mlm_text is None:
        mlm_text = [t for t in raw["train"][key1] if t] + ([t for t in raw["train"][key2] if t] if key2 else [])

    # 1. the teacher's start: given, or a BERT trained here by masked-language modelling
    times = {}
    if args.model_name_or_path:
        start_dir = args.model_name_or_path
        tokenizer = AutoTokenizer.from_pretrained(start_dir)
    else:
        start_dir = str(out / "bert_mlm")
        tokenizer = build_tokenizer(mlm_text, args.vocab_size, Path(start_dir))
        set_seed(args.seed)
        bert = BertForMaskedLM(BertConfig(
            vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
            num_attention_heads=args.num_heads, intermediate_size=4 * args.hidden_size,
            max_position_embeddings=max(128, args.max_seq_length), pad_token_id=tokenizer.pad_token_id))
        if args.mlm_steps:
            mlm_set = Dataset.from_dict(
                dict(tokenizer(mlm_text, truncation=True, max_length=args.max_seq_length)))
            times["mlm"] = train(bert, mlm_set, DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
                                 args.mlm_steps, args.mlm_learning_rate, args, scratch / "mlm")
        bert.save_pretrained(start_dir)
        tokenizer.save_pretrained(start_dir)
        del bert
    max_len = args.max_seq_length

    def preprocess(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        enc = tokenizer(*texts, truncation=True, max_length=max_len)
        enc["labels"] = batch["label"] if named else [label2id[str(x)] for x in batch["label"]]
        return enc

    train_set = raw["train"].map(preprocess, batched=True, remove_columns=raw["train"].column_names)
    eval_set = raw[eval_name].map(preprocess, batched=True, remove_columns=raw[eval_name].column_names)
    if args.max_train_samples:
        train_set = train_set.select(range(min(len(train_set), args.max_train_samples)))
    if args.max_eval_samples:
        eval_set = eval_set.select(range(min(len(eval_set), args.max_eval_samples)))
    collator = DataCollatorWithPadding(tokenizer)
    num_labels = len(label2id)
    id2label = {i: str(n) for n, i in label2id.items()}
    logger.info(f"{task}: {len(train_set)} training and {len(eval_set)} validation examples, {num_labels} classes")

    def evaluate(model) -> dict:
        return scores(model, eval_set, collator, 4 * args.batch_size)

    rows = []
    # 2. the softmax teacher, fine-tuned on the task
    teacher_dir = out / "teacher"
    set_seed(args.seed)
    teacher = BertForSequenceClassification.from_pretrained(start_dir, num_labels=num_labels, id2label=id2label,
                                                            label2id={v: k for k, v in id2label.items()})
    times["teacher"] = train(teacher, train_set, collator, args.finetune_steps, args.learning_rate, args,
                             scratch / "teacher")
    teacher.save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    rows.append({"model": "BERT teacher (softmax attention), fine-tuned", "trained": f"all weights, {args.finetune_steps} steps",
                 "trainable_parameters": trainable(teacher), **evaluate(teacher), **times["teacher"]})
    del teacher

    # 3. (i) today's recipe: convert as run_glue.py does, then full fine-tuning
    converted = build_model(ModelArguments(model_name_or_path=str(teacher_dir), num_random_features=args.num_random_features),
                            num_labels, False, label2id)
    rows.append({"model": f"(i) converted (prf, {args.num_random_features} features), before fine-tuning",
                 "trained": "nothing", "trainable_parameters": 0, **evaluate(converted)})
    times["converted"] = train(converted, train_set, collator, args.finetune_steps, args.learning_rate, args,
                               scratch / "converted")
    rows.append({"model": "(i) converted + full fine-tuning", "trained": f"all weights, {args.finetune_steps} steps",
                 "trainable_parameters": trainable(converted), **evaluate(converted), **times["converted"]})
    converted.save_pretrained(out / "converted_finetuned")
    tokenizer.save_pretrained(out / "converted_finetuned")
    del converted

    # 4. (ii) attention transfer on the task's own inputs, then fine-tuning (LoRA or full);
    #    (iii) the same with the sliding-window hybrid: exact softmax over the keys within W
    data = dict(dataset="nyu-mll/glue", dataset_config=args.task_name) if args.task_name else dict(train_files=[str(train_file)])
    variants = [("(ii)", "linearized", {})]
    if args.softmax_window:
        variants.append(("(iii)", f"linearized_window{args.softmax_window}",
                         {"softmax_window": args.softmax_window, "rpe": "none"}))
    transfer = {}
    for tag, folder, extra in variants:
        wall, cpu = time.perf_counter(), time.process_time()
        linear = linearize(teacher_dir, out / folder, **data, text_column=key1, text_pair_column=key2,
                           line_by_line=True, feature_map=args.feature_map, steps=args.transfer_steps,
                           batch_size=args.batch_size, block_size=max_len, learning_rate=args.transfer_learning_rate,
                           seed=args.seed, progress=False, **extra)
        spent = {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}
        report = linear.linearize_report
        transfer[tag] = {"layer_loss_before": report["layer_loss_before"], "layer_loss_after": report["layer_loss_after"],
                         **spent}
        name = f"attention transfer ({args.feature_map}" + (f", softmax window {args.softmax_window})" if extra else ")")
        rows.append({"model": f"{tag} {name}, before fine-tuning", "trained": f"feature maps, {args.transfer_steps} steps",
                     "trainable_parameters": report["trainable_parameter_count"], **evaluate(linear), **spent})
        linear.train()
        if args.student_finetune == "lora":
            model = peft.get_peft_model(linear, hf_kernattn.lora_config(linear, r=args.lora_r, lora_alpha=2 * args.lora_r))
            lr, what = args.lora_learning_rate, f"LoRA r={args.lora_r} + classifier"
        else:
            model, lr, what = linear, args.learning_rate, "all weights"
        n_trainable = trainable(model)
        spent = train(model, train_set, collator, args.finetune_steps, lr, args, scratch / folder)
        if args.student_finetune == "lora":
            model = model.merge_and_unload()
        rows.append({"model": f"{tag} {name} + {args.student_finetune} fine-tuning",
                     "trained": f"{what}, {args.finetune_steps} steps", "trainable_parameters": n_trainable,
                     **evaluate(model), **spent})
        model.save_pretrained(out / f"{folder}_finetuned")
        tokenizer.save_pretrained(out / f"{folder}_finetuned")
        del model, linear

    labels = np.asarray(eval_set["labels"])
    majority = np.bincount(labels).argmax()
    baseline = {"accuracy": float(accuracy_score(labels, np.full_like(labels, majority))),
                "f1": float(f1_score(labels, np.full_like(labels, majority),
                                     average="binary" if num_labels == 2 else "macro", zero_division=0))}
    results = {
        "task": task, "examples": {"train": len(train_set), "validation": len(eval_set)}, "rows": rows,
        "majority_class": baseline, "mlm": times.get("mlm"),
        "attention_transfer": transfer,
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "seconds": time.perf_counter() - started,
    }
    table = render_table(results)
    (out / "results.md").write_text("\n".join(table) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))  # last: its presence marks a finished run
    print("\n".join(table))
    print(f"wrote {out / 'results.md'} and {out / 'results.json'} in {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
