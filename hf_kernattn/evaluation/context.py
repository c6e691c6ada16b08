"""Mean next-token loss by position: does a model's loss keep falling as it sees more context?

Windows of ``max_length`` tokens are cut from the text (:func:`~.data.context_windows`); every
model scores every window with :func:`~.models.score_tokens` (chunks carrying its cache), and
the loss at position ``i`` (``-log p(x_i | x_0 .. x_{i-1})``, ``1 <= i < max_length``) is averaged
over the windows in log-spaced bins of positions (:func:`log_bins`). A model with a position
table shorter than ``max_length`` is scored on each window's first ``max_positions`` tokens;
bins beyond get no value (``None``), not a zero. For sliding-window hybrids the same pass
records the window/linear shares of attention (:mod:`.hybrid`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.utils import logging

from .data import context_windows, tokenize
from .hybrid import HybridShares
from .models import EvalModel, as_eval_models, check_vocab, num_chunks, score_tokens


def log_bins(max_length: int, per_octave: int = 1) -> list[int]:
    """Edges ``1 = e_0 < e_1 < ... < e_k = max_length`` of the position bins ``[e_j, e_{j+1})``:
    ``per_octave`` bins per doubling (``round(2 ** (j / per_octave))``), the last one cut at
    ``max_length``."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one token of context and one to predict), got {max_length}")
    if per_octave < 1:
        raise ValueError(f"bins_per_octave must be >= 1, got {per_octave}")
    edges, j = [], 0
    while True:
        e = int(round(2 ** (j / per_octave)))
        if e >= max_length:
            break
        if not edges or e > edges[-1]:
            edges.append(e)
        j += 1
    return edges + [max_length]


def bin_means(loss: torch.Tensor, edges: Sequence[int]) -> list[dict]:
    """Per bin ``[lo, hi)`` of positions: the mean of the finite entries of ``loss (W, N)``
    there (None when there are none) and their count."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        part = loss[:, lo:hi]
        ok = torch.isfinite(part)
        count = int(ok.sum())
        rows.append({"lo": int(lo), "hi": int(hi), "mean_loss": float(part[ok].sum() / count) if count else None,
                     "count": count})
    return rows


def evaluate_context(models: Sequence, tokenizer, texts: Sequence[str], max_length: int, *, max_windows: Optional[int] = 8,
                     chunk_size: int = 1024, batch_size: int = 1, bins_per_octave: int = 1, prepend_bos: bool = False,
                     progress: bool = True) -> dict:
    """Per-position loss of each model of ``models`` (:class:`~.models.EvalModel` or causal LMs)
    on windows of ``max_length`` tokens of ``texts`` (each a document), read with the shared
    ``tokenizer``. Returns the report :func:`~.report.write_report` writes: ``settings``,
    ``bins`` (edges), and per model its ``bins`` (``lo``, ``hi``, ``mean_loss``, ``count``:
    scored tokens), ``mean_loss`` over every scored token, ``max_positions`` and, for hybrids,
    ``hybrid`` (per-layer shares, :class:`~.hybrid.HybridShares`)."""
    for name, value, low in (("chunk_size", chunk_size, 2), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    edges = log_bins(max_length, bins_per_octave)
    bos = None
    if prepend_bos:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise ValueError("prepend_bos: the tokenizer has no bos_token")
    windows = context_windows(tokenize(tokenizer, texts), max_length, max_windows=max_windows, bos_token_id=bos)
    models = as_eval_models(models)
    check_vocab(models, tokenizer)
    batches = [windows[i:i + batch_size] for i in range(0, len(windows), batch_size)]
    total = sum(num_chunks(max_length, chunk_size, m.max_positions) * len(batches) for m in models)
    bar = logging.tqdm(total=total, desc="eval context", disable=not progress)
    results = []
    try:
        for m in models:
            bar.set_postfix_str(m.name)
            losses = []
            with HybridShares(m.model) as shares:
                for batch in batches:
                    shares.new_sequence()
                    loss, _ = score_tokens(m.model, batch, chunk_size=chunk_size, max_positions=m.max_positions,
                                           on_chunk=bar.update)
                    losses.append(loss)
            loss = torch.cat(losses)
            finite = torch.isfinite(loss)
            results.append({
                "name": m.name, "source": m.source, "model_type": getattr(m.model.config, "model_type", None),
                "max_positions": m.max_positions,
                "scored_positions": max_length if m.max_positions is None else min(max_length, m.max_positions),
                "mean_loss": float(loss[finite].mean()) if finite.any() else None,
                "bins": bin_means(loss, edges), "hybrid": shares.result() if shares else None,
            })
    finally:
        bar.close()
    return {
        "task": "context",
        "settings": {"max_length": max_length, "windows": len(windows), "max_windows": max_windows,
                     "chunk_size": chunk_size, "batch_size": batch_size, "bins_per_octave": bins_per_octave,
                     "prepend_bos": prepend_bos, "tokenizer_size": len(tokenizer),
                     "position": "i = index of the predicted token in its window (context: the i tokens before it)"},
        "bins": [{"lo": lo, "hi": hi} for lo, hi in zip(edges[:-1], edges[1:])],
        "models": results,
    }
