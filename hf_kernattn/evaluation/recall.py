"""Retrieval at a distance, without training: a random span, ``d`` tokens of real text, the span again.

Each trial draws ``span_length`` distinct ids from the tokenizer's ordinary vocabulary (no
special or added tokens; seeded) and a stretch of the text; the sequence is ``span, text[:d],
span``. A model that keeps the span in context predicts its second copy (after the copy's
first token, which nothing announces); one that has lost it is left at the first copy's level,
that of random tokens. Reported per model and distance ``d``: loss and top-1 accuracy on the
span's tokens ``2 .. L`` in the first and in the repeated copy, over all trials. The same spans
and text stretches serve every model and every distance (trial ``t`` reads ``d`` tokens from
the same start at each ``d``). A model whose position table is shorter than ``2 L + d`` has no
value at that distance (``None``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.utils import logging

from .data import ordinary_token_ids, recall_sequences, token_stream, tokenize
from .models import as_eval_models, check_vocab, num_chunks, score_tokens, vocab_size_of

DEFAULT_DISTANCES = (64, 256, 1024, 4096, 16384)


def recall_trials(tokenizer, texts: Sequence[str], distances: Sequence[int], *, span_length: int = 16, trials: int = 8,
                  seed: int = 0, vocab_limit=None):
    """The spans ``(T, L)``, the text stream and each trial's start in it ``(T,)``, drawn from a
    generator seeded with ``seed``. ``ValueError`` when the text has fewer tokens than the
    longest distance or the vocabulary fewer ordinary ids than ``span_length``."""
    if not distances or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in distances):
        raise ValueError(f"distances must be a non-empty list of ints >= 0, got {list(distances)!r}")
    if not isinstance(span_length, int) or span_length < 2:
        raise ValueError(f"span_length must be an int >= 2 (its first token is not scored), got {span_length!r}")
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    vocab = ordinary_token_ids(tokenizer, vocab_limit)
    if len(vocab) < span_length:
        raise ValueError(f"span_length={span_length} is more than the {len(vocab)} ordinary token ids of the tokenizer")
    stream = token_stream(tokenize(tokenizer, texts), getattr(tokenizer, "eos_token_id", None))
    longest = max(distances)
    if len(stream) < longest:
        raise ValueError(f"the text is too short: it has {len(stream)} tokens and the longest distance needs {longest}; "
                         "give a longer text or smaller distances")
    gen = torch.Generator().manual_seed(int(seed))
    spans = torch.stack([vocab[torch.randperm(len(vocab), generator=gen)[:span_length]] for _ in range(trials)])
    starts = torch.randint(0, len(stream) - longest + 1, (trials,), generator=gen)
    return spans, stream, starts


def evaluate_recall(models: Sequence, tokenizer, texts: Sequence[str], distances: Sequence[int] = DEFAULT_DISTANCES, *,
                    span_length: int = 16, trials: int = 8, seed: int = 0, chunk_size: int = 1024, batch_size: int = 8,
                    progress: bool = True) -> dict:
    """Recall at each distance of ``distances`` for each model of ``models`` (module
    docstring). Returns the report :func:`~.report.write_report` writes: ``settings`` and per
    model ``distances``: rows with ``distance``, ``first_loss``, ``first_accuracy``,
    ``repeat_loss``, ``repeat_accuracy`` (None beyond the model's positions) and ``tokens``
    (scored tokens per copy: ``trials * (span_length - 1)``)."""
    for name, value in (("chunk_size", chunk_size), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < (2 if name == "chunk_size" else 1):
            raise ValueError(f"{name} must be an int >= {2 if name == 'chunk_size' else 1}, got {value!r}")
    models = as_eval_models(models)
    check_vocab(models, tokenizer)
    distances = sorted(set(distances)) if distances else distances
    spans, stream, starts = recall_trials(tokenizer, texts, distances, span_length=span_length, trials=trials, seed=seed,
                                          vocab_limit=min(vocab_size_of(m.model) for m in models))
    L = span_length
    batches = [range(i, min(i + batch_size, trials)) for i in range(0, trials, batch_size)]

    def fits(m, d):
        return m.max_positions is None or 2 * L + d <= m.max_positions

    total = sum(num_chunks(2 * L + d, chunk_size, None) * len(batches) for m in models for d in distances if fits(m, d))
    bar = logging.tqdm(total=total, desc="eval recall", disable=not progress)
    results = []
    try:
        for m in models:
            bar.set_postfix_str(m.name)
            rows = []
            for d in distances:
                row = {"distance": d, "first_loss": None, "first_accuracy": None, "repeat_loss": None,
                       "repeat_accuracy": None, "tokens": trials * (L - 1)}
                if fits(m, d):
                    seqs = recall_sequences(spans, stream, starts, d)
                    first_pos = torch.arange(1, L)
                    repeat_pos = torch.arange(L + d + 1, 2 * L + d)
                    sums = torch.zeros(4, dtype=torch.float64)  # first loss, first hits, repeat loss, repeat hits
                    for rows_of in batches:
                        loss, hit = score_tokens(m.model, seqs[rows_of.start:rows_of.stop], chunk_size=chunk_size,
                                                 on_chunk=bar.update)
                        sums += torch.stack([loss[:, first_pos].sum(), hit[:, first_pos].double().sum(),
                                             loss[:, repeat_pos].sum(), hit[:, repeat_pos].double().sum()])
                    mean = (sums / (trials * (L - 1))).tolist()
                    row.update(first_loss=mean[0], first_accuracy=mean[1], repeat_loss=mean[2], repeat_accuracy=mean[3])
                rows.append(row)
            results.append({"name": m.name, "source": m.source, "model_type": getattr(m.model.config, "model_type", None),
                            "max_positions": m.max_positions, "distances": rows})
    finally:
        bar.close()
    return {
        "task": "recall",
        "settings": {"distances": list(distances), "span_length": L, "trials": trials, "seed": seed,
                     "chunk_size": chunk_size, "batch_size": batch_size, "text_tokens": len(stream),
                     "span_vocabulary": int(len(ordinary_token_ids(tokenizer, min(vocab_size_of(m.model) for m in models)))),
                     "scored": "span tokens 2 .. span_length of each copy (the first is not predictable)"},
        "models": results,
    }
