"""Linearize a pretrained softmax model by attention transfer: convert it, then train only its feature maps.

Converting copies every weight and puts a feature map in place of ``exp(q . k / sqrt(d))``
(``hf-kernattn convert``); attention transfer (Zhang et al. 2024, LoLCATs; Hedgehog) then trains
only what conversion added, so that each layer's kernelized attention reproduces the softmax
attention it replaces:

1. The teacher (the source model, softmax attention) and the student (its conversion, with a
   learned feature map: ``hedgehog`` by default) read the same token blocks.
2. Every attention layer of the student receives the *teacher's* input to that layer (hooks on
   both models), so the layers train together but independently of each other's errors.
3. The loss is the mean over layers of the mean squared error between the student's and the
   teacher's attention output (after the output projection, before the residual).
4. Only the feature maps' weights train (``train="feature_maps"``), and with the sliding-window
   hybrid (``softmax_window=W``) each layer's per-head mixing weights; ``train="attention"`` also
   trains the attention's projections (T2R, Kasai et al. 2021). Everything else stays the copied
   source weights.

Text: a ``datasets`` name (``dataset``, online or from the local cache) or local files
(``train_files``: plain text, or ``.csv``/``.json``/``.jsonl`` tables read from ``text_column``),
tokenized with the source's tokenizer and cut into blocks of ``block_size`` tokens; or, with
``line_by_line`` or ``text_pair_column`` (sentence pairs, e.g. a GLUE task for an encoder), one
sequence per example with the tokenizer's special tokens, in padded batches whose padding mask
both models read (the loss counts real positions only). Batches are a function of the step and the seed only, and checkpoints
(``checkpointing_steps``; JSON and safetensors only) hold the trained weights, the optimizer,
the scheduler and the random states: a run stopped and resumed
(``resume_from_checkpoint="latest"``) ends bitwise where the uninterrupted run ends. The result
is saved Hub-ready (weights, code, tokenizer, a model card recording the recipe).

Python::

    from hf_kernattn.convert.linearize import linearize
    model = linearize("openai-community/gpt2", "gpt2-linear", train_files=["train.txt"], steps=500)

CLI::

    hf-kernattn linearize openai-community/gpt2 gpt2-linear --train_file train.txt --steps 500
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn
from transformers.utils import logging

from .common import check_output_dir, read_config, resolve_checkpoint

logger = logging.get_logger("hf_kernattn")

# where a source model's attention starts (the module whose input is the attention's input) and
# ends (the module whose output is the attention's output, after the output projection)
TEACHER_ATTENTION = {
    "gpt2": (r"transformer\.h\.(\d+)\.attn", r"transformer\.h\.(\d+)\.attn"),
    "llama": (r"model\.layers\.(\d+)\.self_attn", r"model\.layers\.(\d+)\.self_attn"),
    "bert": (r"(?:bert\.)?encoder\.layer\.(\d+)\.attention\.self", r"(?:bert\.)?encoder\.layer\.(\d+)\.attention\.output\.dense"),
    "roberta": (r"(?:roberta\.)?encoder\.layer\.(\d+)\.attention\.self",
                r"(?:roberta\.)?encoder\.layer\.(\d+)\.attention\.output\.dense"),
}
TRAINABLE = ("feature_maps", "attention")
DEFAULT_FEATURE_MAP = "hedgehog"


def _layer_modules(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules whose full name matches ``pattern`` (one group: the layer index), by layer."""
    found = {}
    for name, module in model.named_modules():
        m = re.fullmatch(pattern, name)
        if m:
            found[int(m.group(1))] = module
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"attention layers {sorted(found)} of {type(model).__name__} are not numbered 0..N-1")
    return [found[i] for i in range(len(found))]


def attention_pairs(teacher: nn.Module, student: nn.Module, model_type: str):
    """Per layer ``(teacher input module, teacher output module, student attention module)``."""
    from ..modeling.attention import KernelizedSelfAttention

    if model_type not in TEACHER_ATTENTION:
        raise ValueError(f"attention transfer supports sources of type {sorted(TEACHER_ATTENTION)}, got {model_type!r}")
    first, last = (_layer_modules(teacher, p) for p in TEACHER_ATTENTION[model_type])
    mine = [m for m in student.modules() if isinstance(m, KernelizedSelfAttention)]
    if not (len(first) == len(last) == len(mine)) or not mine:
        raise ValueError(f"the teacher has {len(first)} attention layers and the student {len(mine)}: "
                         "they must match one to one")
    return list(zip(first, last, mine))


def _hidden_states_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _output_of(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def transfer_hooks(pairs):
    """Hooks for one step: the teacher's attention inputs and outputs are recorded, and each
    student attention layer runs on the teacher's input to that layer, its output recorded.
    Yields ``(teacher_outputs, student_outputs)``, two lists filled by the forward passes."""
    n = len(pairs)
    inputs: list[Optional[torch.Tensor]] = [None] * n
    teacher_out: list[Optional[torch.Tensor]] = [None] * n
    student_out: list[Optional[torch.Tensor]] = [None] * n

    def record_input(i):
        def hook(module, args, kwargs):
            inputs[i] = _hidden_states_of(args, kwargs).detach()
        return hook

    def record(i, where):
        def hook(module, args, kwargs, output):
            where[i] = _output_of(output)
        return hook

    def substitute(i):
        def hook(module, args, kwargs):
            given = _hidden_states_of(args, kwargs)
            mine = inputs[i].to(given.dtype)
            if args:
                return (mine, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": mine}
        return hook

    handles = []
    try:
        for i, (first, last, student) in enumerate(pairs):
            handles.append(first.register_forward_pre_hook(record_input(i), with_kwargs=True))
            handles.append(last.register_forward_hook(record(i, teacher_out), with_kwargs=True))
            handles.append(student.register_forward_pre_hook(substitute(i), with_kwargs=True))
            handles.append(student.register_forward_hook(record(i, student_out), with_kwargs=True))
        yield teacher_out, student_out
    finally:
        for h in handles:
            h.remove()


def transfer_loss(teacher_out: Sequence[torch.Tensor], student_out: Sequence[torch.Tensor],
                  attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[float]]:
    """Mean over layers of the mean squared error; also each layer's value. With
    ``attention_mask`` (``(B, N)``, 1 real, 0 padding) the mean runs over real positions only:
    what either model computes at a padded position is read by nothing."""
    if attention_mask is None:
        per_layer = [nn.functional.mse_loss(s.float(), t.float()) for t, s in zip(teacher_out, student_out)]
    else:
        real = attention_mask.bool()[..., None]
        count = real.sum() * teacher_out[0].shape[-1]
        per_layer = [torch.where(real, (s.float() - t.float()) ** 2, 0.0).sum() / count
                     for t, s in zip(teacher_out, student_out)]
    return torch.stack(per_layer).mean(), [float(x.detach()) for x in per_layer]


def select_trainable(student: nn.Module, train: str) -> list[str]:
    """Freeze every parameter of ``student`` but those attention transfer trains; their names."""
    from ..modeling.attention import WINDOW_WEIGHTS, KernelizedSelfAttention

    if train not in TRAINABLE:
        raise ValueError(f"train must be one of {list(TRAINABLE)}, got {train!r}")
    keep = set()
    for name, module in student.named_modules():
        if isinstance(module, KernelizedSelfAttention):
            part = module.feature_map if train == "feature_maps" else module
            keep.update(id(p) for p in part.parameters())
            # the sliding-window hybrid's mixing weights belong to what attention transfer fits
            keep.update(id(p) for n in WINDOW_WEIGHTS if (p := module._parameters.get(n)) is not None)
    names = []
    for name, p in student.named_parameters():
        p.requires_grad_(id(p) in keep)
        if id(p) in keep:
            names.append(name)
    if not names:
        raise ValueError(
            f"nothing to train: the student's feature map {getattr(student.config, 'feature_map', '?')!r} has no weights. "
            "Use a learned feature map (feature_map='hedgehog' or 'hedgehog_exp') or train='attention'"
        )
    return names


# ----------------------------------------------------------------------------- data

TABLE_SUFFIXES = (".csv", ".json", ".jsonl")  # train files read as tables (columns), not as plain text


def _read_table(path: Path, columns: Sequence[str]) -> list[dict]:
    """The rows of a CSV or JSON(-lines) file, with ``ValueError`` naming the file for what cannot
    be read and for missing columns."""
    import datasets

    kind = "csv" if path.suffix == ".csv" else "json"
    try:
        data = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:  # datasets raises many kinds for malformed files
        raise ValueError(f"train file {str(path)!r} cannot be read as {kind.upper()}: {' '.join(str(err).split())[:300]}") from None
    missing = [c for c in columns if c not in data.column_names]
    if missing:
        raise ValueError(f"train file {str(path)!r} has no column {missing[0]!r}; its columns: {data.column_names}")
    return [dict(zip(columns, values)) for values in zip(*(data[c] for c in columns))]


def read_texts(train_files: Optional[Sequence[str]] = None, dataset: Optional[str] = None,
               dataset_config: Optional[str] = None, split: str = "train", text_column: str = "text",
               text_pair_column: Optional[str] = None, line_by_line: bool = False) -> list:
    """The training texts: local files or a ``datasets`` dataset's ``text_column``.

    Local files are plain text (a whole file is one text; with ``line_by_line`` each non-empty
    line is one example) or tables (``.csv``, ``.json``, ``.jsonl``: one example per row, read
    from ``text_column``). With ``text_pair_column`` (tables and datasets) each example is a
    ``(text, text_pair)`` pair, as sentence-pair tasks give an encoder. ``ValueError`` naming the
    file for a missing, unreadable (not UTF-8, malformed), empty file or a missing column."""
    from ..training.args import check_text_files

    if bool(train_files) == bool(dataset):
        raise ValueError("give exactly one source of text: train_files (local plain-text files) or dataset (a datasets name)")
    columns = [text_column] + ([text_pair_column] if text_pair_column else [])

    def examples_of(rows: Iterable[dict], where: str) -> list:
        out = []
        for i, row in enumerate(rows, 1):
            values = [row[c] for c in columns]
            if any(v is not None and not isinstance(v, str) for v in values):
                raise ValueError(f"{where}, row {i}: column {columns[0]!r}"
                                 f"{' / ' + repr(columns[1]) if len(columns) > 1 else ''} must hold text, got {values!r}")
            if all(v and v.strip() for v in values):
                out.append(values[0] if len(values) == 1 else tuple(values))
        return out

    if train_files:
        texts: list = []
        for path in train_files:
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"train file {path!r} does not exist")
            check_text_files([path], "train_files")
            if p.suffix in TABLE_SUFFIXES:
                texts.extend(examples_of(_read_table(p, columns), f"train file {path!r}"))
                continue
            if text_pair_column:
                raise ValueError(f"text_pair_column needs table train files ({', '.join(TABLE_SUFFIXES)}) or a dataset; "
                                 f"{path!r} is plain text")
            text = p.read_text(encoding="utf-8")
            texts.extend([line for line in text.splitlines() if line.strip()] if line_by_line else [text])
        if not texts:
            raise ValueError(f"train files {list(train_files)} hold no example with text in {columns}")
        return texts
    import datasets

    data = datasets.load_dataset(dataset, dataset_config, split=split)
    for column in columns:
        if column not in data.column_names:
            raise ValueError(f"dataset {dataset!r} has no column {column!r}; its columns: {data.column_names}")
    if text_pair_column is None and not line_by_line:
        return [t for t in data[text_column] if t]
    return examples_of(({c: row[c] for c in columns} for row in data), f"dataset {dataset!r}")


def token_blocks(tokenizer, texts: Iterable[str], block_size: int) -> torch.Tensor:
    """``(num_blocks, block_size)`` token ids: the texts tokenized (no special tokens), joined
    by the end-of-text (or separator) token and cut into whole blocks."""
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for text in texts:
        # (verbose=False: the text is cut into blocks below, so its length before is no concern)
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
    n = len(ids) // block_size
    if n == 0:
        raise ValueError(f"the text holds {len(ids)} tokens: fewer than one block of block_size={block_size}")
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)


def token_sequences(tokenizer, examples: Sequence, max_length: int) -> list[dict[str, list[int]]]:
    """One token sequence per example (a text or a ``(text, text_pair)`` pair), with the
    tokenizer's special tokens (BERT: ``[CLS] a [SEP] b [SEP]`` and its token types), truncated
    to ``max_length`` tokens: what the model reads when it is used, one example at a time."""
    keep = ("input_ids", "token_type_ids")
    seqs = []
    for example in examples:
        pair = (example,) if isinstance(example, str) else tuple(example)
        enc = tokenizer(*pair, truncation=True, max_length=max_length)
        seqs.append({k: list(enc[k]) for k in keep if k in enc})
    if not seqs:
        raise ValueError("no example to train on: the text gave no sequence")
    return seqs


def pad_sequences(seqs: Sequence[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A batch of sequences padded on the right to the longest, with the ``attention_mask``
    (1 real, 0 padding) the teacher and the student both read."""
    n = max(len(s["input_ids"]) for s in seqs)
    batch = {"input_ids": torch.tensor([s["input_ids"] + [pad_token_id] * (n - len(s["input_ids"])) for s in seqs]),
             "attention_mask": torch.tensor([[1] * len(s["input_ids"]) + [0] * (n - len(s["input_ids"])) for s in seqs])}
    if all("token_type_ids" in s for s in seqs):
        batch["token_type_ids"] = torch.tensor([s["token_type_ids"] + [0] * (n - len(s["token_type_ids"])) for s in seqs])
    return batch


def rows_for_step(n: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The example indices of step ``step`` (0-based) among ``n``: epochs of a shuffle seeded by
    ``seed`` and the epoch, so that a resumed run reads exactly what an uninterrupted one would."""
    rows = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        rows.append(int(order[pos]))
    return rows


def batch_for_step(blocks: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The batch of step ``step`` (0-based): the rows :func:`rows_for_step` picks."""
    return blocks[rows_for_step(blocks.shape[0], step, batch_size, seed)]


# ----------------------------------------------------------------------------- training


def source_positions(cfg: dict) -> tuple[int, str]:
    """The longest input the source model takes (its position table) and the ``config.json``
    field that gives it. RoBERTa's positions start after its padding index."""
    if cfg["model_type"] == "gpt2":
        return int(cfg.get("n_positions", 1024)), "n_positions"
    n = int(cfg.get("max_position_embeddings", 2048 if cfg["model_type"] == "llama" else 512))
    if cfg["model_type"] == "roberta":
        pad = int(cfg.get("pad_token_id", 1))
        return n - pad - 1, f"max_position_embeddings - pad_token_id - 1 = {n} - {pad} - 1"
    return n, "max_position_embeddings"


def data_sha256(data) -> str:
    """SHA-256 of the token data a run trains on: packed blocks (a tensor) or per-example sequences."""
    import hashlib

    if isinstance(data, torch.Tensor):
        return hashlib.sha256(data.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _ours(out: Path):
    """What ``linearize`` itself leaves in ``out``: its checkpoints (``step_N``, and ``step_N.tmp``
    half-written), its temporary result folder, and with an earlier complete result (its report
    is written last) everything."""
    from ..training.checkpoints import CHECKPOINT_PREFIX

    earlier_result = (out / REPORT_FILE).is_file()
    pattern = re.compile(rf"{re.escape(CHECKPOINT_PREFIX)}\d+(\.tmp)?")

    def ours(path: Path) -> bool:
        return earlier_result or path.name == _RESULT_TMP or (path.is_dir() and pattern.fullmatch(path.name) is not None)

    return ours


def format_losses(losses: Optional[Sequence[float]]) -> str:
    """Per-layer losses to 4 significant digits (``n/a`` for none)."""
    return "n/a" if losses is None else ", ".join(f"{x:.4g}" for x in losses)


def _load_teacher(src: Path, model_type: str, dtype: torch.dtype):
    from transformers import AutoModel, AutoModelForCausalLM

    cls = AutoModelForCausalLM if model_type in ("gpt2", "llama") else AutoModel
    teacher = cls.from_pretrained(src, attn_implementation="eager", dtype=dtype)
    return teacher.eval().requires_grad_(False)


def linearize(
    source: str | Path,
    output_dir: str | Path,
    *,
    train_files: Optional[Sequence[str]] = None,
    dataset: Optional[str] = None,
    dataset_config: Optional[str] = None,
    dataset_split: str = "train",
    text_column: str = "text",
    text_pair_column: Optional[str] = None,
    line_by_line: bool = False,
    feature_map: str = DEFAULT_FEATURE_MAP,
    train: str = "feature_maps",
    steps: int = 200,
    batch_size: int = 8,
    block_size: int = 128,
    learning_rate: float = 1e-2,
    warmup_steps: int = 0,
    scheduler: str = "cosine",
    seed: int = 0,
    checkpointing_steps: Optional[int] = None,
    checkpoints_total_limit: Optional[int] = None,
    resume_from_checkpoint: Optional[str] = None,
    stop_after_steps: Optional[int] = None,
    revision: Optional[str] = None,
    allow_pickle: bool = False,
    overwrite_output_dir: bool = False,
    progress: bool = True,
    **overrides: Any,
):
    """Convert ``source`` (GPT-2, Llama, BERT or RoBERTa; a folder or a Hub id) and train its
    feature maps by attention transfer (module docstring); saves the result Hub-ready in
    ``output_dir`` and returns it, with ``linearize_report`` (per-layer losses before and after,
    the recipe). ``overrides``: config fields of the converted family. ``stop_after_steps``:
    end this invocation after that many steps of this invocation (a checkpoint is written there),
    e.g. to split a long run into jobs resumed with ``resume_from_checkpoint="latest"``.

    Text is packed into blocks of ``block_size`` tokens by default. With ``line_by_line`` (or
    ``text_pair_column``) every example (a line of a plain-text file, a row of a table file or
    dataset; a ``(text_column, text_pair_column)`` pair) is one sequence with the tokenizer's
    special tokens, truncated to ``block_size``; the batches are padded and both models read the
    padding mask, and the loss counts real positions only: encoders are trained on what they read
    in use. BERT and RoBERTa students with a learned feature map default to ``normalize_qk=False``
    (the map sees the queries' and keys' lengths, on which softmax's sharpness depends).

    ``output_dir`` is never the source folder, inside it or holding it. An existing one must be
    empty or hold only this command's checkpoints and earlier result, unless
    ``overwrite_output_dir`` (the result's files then replace those of the same names). Resuming
    checks the token data too (its SHA-256 is part of the run's settings), not only its size.

    Nothing is written before the source, the settings and the text have been read: bad input
    leaves ``output_dir`` untouched. The result is written in a temporary folder and then moved
    into place, ``linearize_report.json`` last."""
    from transformers import AutoTokenizer, get_scheduler

    from . import convert
    from ..modeling.feature_maps import LEARNED_FEATURE_MAPS
    from ..training import checkpoints as ckpt
    from ..training.args import check_training_values
    from ..training.serialization import load_tree, save_tree

    for name, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1), ("block_size", block_size, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    check_training_values({"learning_rate": learning_rate, "num_warmup_steps": warmup_steps,
                           "checkpointing_steps": checkpointing_steps, "checkpoints_total_limit": checkpoints_total_limit,
                           "stop_after_steps": stop_after_steps}, {"num_warmup_steps": "warmup_steps"})
    src = resolve_checkpoint(source, revision, allow_pickle)
    cfg = read_config(src, tuple(TEACHER_ATTENTION))
    model_type = cfg["model_type"]
    if train not in TRAINABLE:
        raise ValueError(f"train must be one of {list(TRAINABLE)}, got {train!r}")
    positions, field = source_positions(cfg)
    if block_size > positions:
        raise ValueError(f"block_size={block_size} is more than the source's {positions} positions ({field} in its "
                         f"config.json): give block_size <= {positions}")
    out = check_output_dir(output_dir, src, overwrite=overwrite_output_dir, ours=_ours(Path(output_dir)))
    encoder = model_type in ("bert", "roberta")
    if encoder and feature_map in LEARNED_FEATURE_MAPS:
        overrides.setdefault("normalize_qk", False)
    per_example = bool(line_by_line or text_pair_column)
    texts = read_texts(train_files, dataset, dataset_config, dataset_split, text_column, text_pair_column, per_example)
    tokenizer = AutoTokenizer.from_pretrained(src)
    if per_example:
        seqs = token_sequences(tokenizer, texts, block_size)
        pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
        num_examples = len(seqs)

        def batch_of(rows):
            return pad_sequences([seqs[r] for r in rows], pad_id)
    else:
        blocks = token_blocks(tokenizer, texts, block_size)
        num_examples = int(blocks.shape[0])

        def batch_of(rows):
            return {"input_ids": blocks[rows]}

    torch.manual_seed(seed)
    student = convert(src, None, feature_map=feature_map, allow_pickle=allow_pickle, **overrides)
    teacher = _load_teacher(src, model_type, next(student.parameters()).dtype)
    student.eval()  # attention transfer: no dropout, so that a step is a function of the weights and the batch
    trained = select_trainable(student, train)
    pairs = attention_pairs(teacher, student, model_type)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    sched = get_scheduler(scheduler, optimizer, num_warmup_steps=warmup_steps, num_training_steps=steps)

    settings = dict(source=str(source), model_type=model_type, texts=len(texts), blocks=num_examples,
                    feature_map=feature_map, train=train, steps=steps, batch_size=batch_size, block_size=block_size,
                    learning_rate=learning_rate, warmup_steps=warmup_steps, scheduler=scheduler, seed=seed,
                    overrides=overrides)
    if per_example:
        settings.update(line_by_line=True, text_column=text_column, text_pair_column=text_pair_column)
    settings["data_sha256"] = data_sha256(seqs if per_example else blocks)
    fingerprint = ckpt.run_fingerprint(settings)
    start, history = 0, []
    resume = ckpt.resolve_checkpoint(resume_from_checkpoint, out, fingerprint, settings=settings)
    if resume is not None:
        state = ckpt._read_state(resume)
        _load_trained(student, resume)
        optimizer.load_state_dict(load_tree(resume, "optimizer"))
        sched.load_state_dict(load_tree(resume, "scheduler"))
        start, history = state["step"], state["progress"]["history"]
        logger.info(f"resuming attention transfer from {resume} (step {start} of {steps})")

    extra = {"use_cache": False} if model_type in ("gpt2", "llama") else {}

    def step_loss(batch: dict[str, torch.Tensor]):
        with transfer_hooks(pairs) as (t_out, s_out):
            with torch.no_grad():
                teacher(**batch, **extra)
            student(**batch, **extra)
            return transfer_loss(t_out, s_out, batch.get("attention_mask"))

    def evaluate_layers() -> list[float]:  # per-layer loss on the first examples (fixed), no grad
        with torch.no_grad():
            return step_loss(batch_of(list(range(min(batch_size, num_examples)))))[1]

    before = evaluate_layers() if start == 0 else None
    bar = logging.tqdm(total=steps, initial=start, desc="attention transfer", disable=not progress)
    step = start
    with bar:
        while step < steps:
            loss, _ = step_loss(batch_of(rows_for_step(num_examples, step, batch_size, seed)))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            step += 1
            history.append([step, float(loss.detach())])
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.4g}")
            done_here = stop_after_steps is not None and step - start >= stop_after_steps
            if step < steps and ((checkpointing_steps and step % checkpointing_steps == 0) or done_here):
                _save_step(out, step, student, trained, optimizer, sched, fingerprint, settings, history,
                           checkpoints_total_limit, save_tree)
            if done_here and step < steps:
                logger.info(f"stopped after {step - start} steps at step {step}; resume with resume_from_checkpoint='latest'")
                return student
    after = evaluate_layers()
    student.linearize_report = {"recipe": settings, "trained_parameters": trained,
                                "trainable_parameter_count": sum(p.numel() for p in params),
                                "layer_loss_before": before, "layer_loss_after": after, "history": history}
    _save_result(student, src, out, source, settings, before, after, sum(p.numel() for p in params))
    return student


def _trained_state(student: nn.Module, trained: Sequence[str]) -> dict[str, torch.Tensor]:
    params = dict(student.named_parameters())
    return {name: params[name].detach().contiguous().clone() for name in trained}


def _load_trained(student: nn.Module, folder: Path) -> None:
    import safetensors.torch

    from ..training.serialization import named_read_errors

    with named_read_errors(folder / "trained.safetensors"):
        state = safetensors.torch.load_file(str(folder / "trained.safetensors"))
    params = dict(student.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise ValueError(f"the checkpoint {folder} holds weights the model does not have: {unknown}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def _save_step(out, step, student, trained, optimizer, sched, fingerprint, settings, history, limit, save_tree) -> None:
    """``out/step_N`` (the trained weights, optimizer, scheduler), written as the example scripts'
    checkpoints are: in a temporary folder, the state file last, then renamed."""
    import safetensors.torch

    from ..training import checkpoints as ckpt

    tmp = ckpt.begin_checkpoint(out, step)
    safetensors.torch.save_file(_trained_state(student, trained), str(tmp / "trained.safetensors"))
    save_tree(tmp, "optimizer", optimizer.state_dict())
    save_tree(tmp, "scheduler", sched.state_dict())
    ckpt.publish_checkpoint(out, step, fingerprint, settings, limit, progress={"history": history})


def _save_result(student, src: Path, out: Path, source, settings, before, after, trainable: int) -> None:
    from ..cards import save_model_card
    from .common import TOKENIZER_FILES

    final, out = out, _result_folder(out)
    student.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)

    def fmt(xs):
        return "n/a (resumed)" if xs is None else ", ".join(f"{x:.3g}" for x in xs)

    save_model_card(student, out, base_model=str(source), training={
        "method": "attention transfer (each layer's kernelized attention trained to reproduce the source's softmax "
                  "attention output on the source's own layer inputs, mean squared error)",
        "converted from": f"`{source}` ({settings['model_type']})",
        "trained": f"{settings['train']} ({trainable} parameters; every other weight copied from the source)",
        "feature map": f"`{settings['feature_map']}`",
        "softmax window": (f"W = {student.config.softmax_window} (exact softmax over the last W keys, kernelized "
                           "beyond, learned per-head mixing weights)"
                           if getattr(student.config, "softmax_window", None) is not None else "off"),
        "steps x batch x block": f"{settings['steps']} x {settings['batch_size']} x {settings['block_size']} tokens",
        "learning rate": f"{settings['learning_rate']} ({settings['scheduler']}, {settings['warmup_steps']} warmup steps)",
        "per-layer loss before": fmt(before),
        "per-layer loss after": fmt(after),
    })
    (out / REPORT_FILE).write_text(json.dumps(student.linearize_report, indent=1, default=str))
    _publish_result(out, final)


REPORT_FILE = "linearize_report.json"  # written last: a folder with it holds a complete result
_RESULT_TMP = ".linearize-result.tmp"


def _result_folder(out: Path) -> Path:
    """A fresh temporary folder the result is written in before :func:`_publish_result` moves it to ``out``:
    beside ``out`` when ``out`` does not exist yet, else inside it (beside the run's checkpoints)."""
    tmp = out.parent / f".{out.name}{_RESULT_TMP}" if not out.exists() else out / _RESULT_TMP
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish_result(tmp: Path, out: Path) -> None:
    """Move the complete result from ``tmp`` to ``out``: one rename when ``out`` does not exist,
    else file by file with the report last (an earlier result's report removed first)."""
    import os

    if tmp.parent != out:
        os.replace(tmp, out)
        return
    (out / REPORT_FILE).unlink(missing_ok=True)
    names = sorted(p.name for p in tmp.iterdir())
    for name in sorted(names, key=lambda n: n == REPORT_FILE):
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(tmp / name, target)
    tmp.rmdir()


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a GPT-2, Llama, BERT or RoBERTa checkpoint: a folder written by save_pretrained "
                                       "(with its tokenizer), or a Hub model id")
    parser.add_argument("output_dir", help="where the linearized model (and the run's checkpoints) are saved")
    parser.add_argument("--train_file", nargs="+", default=None, help="local plain-text training files")
    parser.add_argument("--dataset", default=None, help="a datasets name to read the text from (instead of --train_file)")
    parser.add_argument("--dataset_config", default=None, help="the dataset's configuration name")
    parser.add_argument("--dataset_split", default="train", help="the split to read (default: train)")
    parser.add_argument("--text_column", default="text",
                        help="the text column of a dataset or of .csv/.json/.jsonl train files (default: text)")
    parser.add_argument("--text_pair_column", default=None,
                        help="a second text column: every example is a (text, text pair) sequence, as sentence-pair "
                             "tasks give an encoder (implies --line_by_line)")
    parser.add_argument("--line_by_line", action="store_true",
                        help="one sequence per example (a line of a plain-text file, a row of a table or dataset) with "
                             "the tokenizer's special tokens, in padded batches, instead of packed blocks")
    parser.add_argument("--feature_map", default=DEFAULT_FEATURE_MAP,
                        help=f"the student's feature map (default: {DEFAULT_FEATURE_MAP}, a learned map)")
    parser.add_argument("--softmax_window", type=int, default=None,
                        help="W: the sliding-window hybrid (exact softmax over a window of W keys, the learned feature "
                             "map beyond; its mixing weights train with the feature maps); default: off")
    parser.add_argument("--train", choices=TRAINABLE, default="feature_maps",
                        help="what trains: the feature maps only (default) or the whole attention (projections too)")
    parser.add_argument("--steps", type=int, default=200, help="optimisation steps (default: 200)")
    parser.add_argument("--batch_size", type=int, default=8, help="blocks per step (default: 8)")
    parser.add_argument("--block_size", type=int, default=128, help="tokens per block (default: 128)")
    parser.add_argument("--learning_rate", type=float, default=1e-2, help="AdamW learning rate (default: 1e-2)")
    parser.add_argument("--warmup_steps", type=int, default=0, help="linear warm-up steps (default: 0)")
    parser.add_argument("--lr_scheduler_type", default="cosine", help="a transformers scheduler name (default: cosine)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch order and the conversion (default: 0)")
    parser.add_argument("--checkpointing_steps", type=int, default=None, help="write a checkpoint every this many steps")
    parser.add_argument("--checkpoints_total_limit", type=int, default=None,
                        help="keep at most this many checkpoints of this run, deleting the oldest")
    parser.add_argument("--resume_from_checkpoint", default=None,
                        help="'latest' (the newest checkpoint of this run in output_dir) or a checkpoint folder")
    parser.add_argument("--stop_after_steps", type=int, default=None,
                        help="stop this invocation after this many steps (a checkpoint is written; resume with "
                             "--resume_from_checkpoint latest)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a Hub model id")
    parser.add_argument("--allow-pickle", dest="allow_pickle", action="store_true",
                        help="read pickled weights of a source without safetensors ones (only for sources you trust)")
    parser.add_argument("--overwrite_output_dir", "--overwrite-output-dir", dest="overwrite_output_dir",
                        action="store_true",
                        help="write into an output_dir that holds other files than this command's checkpoints and "
                             "earlier result (the result's files replace those of the same names; default: refused). "
                             "The source folder itself is never written to")


def run(args: argparse.Namespace) -> int:
    """``hf-kernattn linearize``: convert, train the feature maps by attention transfer, save."""
    model = linearize(
        args.source, args.output_dir, train_files=args.train_file, dataset=args.dataset,
        dataset_config=args.dataset_config, dataset_split=args.dataset_split, text_column=args.text_column,
        text_pair_column=args.text_pair_column, line_by_line=args.line_by_line,
        feature_map=args.feature_map, train=args.train, steps=args.steps, batch_size=args.batch_size,
        block_size=args.block_size, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
        scheduler=args.lr_scheduler_type, seed=args.seed, checkpointing_steps=args.checkpointing_steps,
        checkpoints_total_limit=args.checkpoints_total_limit, resume_from_checkpoint=args.resume_from_checkpoint,
        stop_after_steps=args.stop_after_steps, revision=args.revision, allow_pickle=args.allow_pickle,
        overwrite_output_dir=args.overwrite_output_dir, progress=not getattr(args, "quiet", False),
        **({} if args.softmax_window is None else {"softmax_window": args.softmax_window}),
    )
    report = getattr(model, "linearize_report", None)
    if report is None:
        print(f"stopped early; checkpoints in {args.output_dir}")
        return 0
    before, after = report["layer_loss_before"], report["layer_loss_after"]
    mean = (f" (mean {sum(before) / len(before):.4g} -> {sum(after) / len(after):.4g})" if before else "")
    print(f"attention transfer: per-layer loss {format_losses(before)} -> {format_losses(after)}{mean}")
    print(f"saved to {args.output_dir}")
    return 0
