"""Text for the evaluations: files read, tokenized once with the shared tokenizer, cut into
windows (``context``) or into filler between two copies of a random span (``recall``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch


def read_texts(files: Sequence[Union[str, os.PathLike]]) -> list[str]:
    """The UTF-8 contents of ``files`` (each one document); ``ValueError`` naming a file that
    does not exist, is not a file or is empty."""
    if not files:
        raise ValueError("text: name at least one text file")
    texts = []
    for f in files:
        path = Path(f).expanduser()
        if not path.is_file():
            raise ValueError(f"text file {str(f)!r} " + ("is not a file" if path.exists() else "does not exist"))
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"text file {str(f)!r} is not UTF-8 text: {err}") from None
        if not text.strip():
            raise ValueError(f"text file {str(f)!r} is empty")
        texts.append(text)
    return texts


def tokenize(tokenizer, texts: Sequence[Union[str, Sequence[int]]]) -> list[list[int]]:
    """Each text's token ids, without special tokens (a text already given as token ids is kept)."""
    if isinstance(texts, str) or not texts:
        raise TypeError("texts must be a non-empty list of documents (strings, or lists of token ids)")
    docs = []
    for t in texts:
        if isinstance(t, str):
            docs.append(list(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]))
        else:
            try:
                docs.append([int(i) for i in t])
            except (TypeError, ValueError):
                raise TypeError(f"texts must hold strings or lists of token ids, got {type(t).__name__}") from None
    return docs


def context_windows(documents: Sequence[Sequence[int]], max_length: int, *, max_windows: Optional[int] = None,
                    bos_token_id: Optional[int] = None) -> torch.Tensor:
    """Non-overlapping windows of ``max_length`` tokens, cut from each document in turn (none
    crosses a document's end; a shorter rest is dropped), the first ``max_windows`` of them:
    ``(W, max_length)`` long. ``bos_token_id``: each window starts with it, followed by
    ``max_length - 1`` tokens of text. ``ValueError`` when no document is long enough."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one token of context and one to predict), got {max_length}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None (all), got {max_windows}")
    step = max_length - (bos_token_id is not None)
    windows = []
    for doc in documents:
        for s in range(0, len(doc) - step + 1, step):
            piece = list(doc[s:s + step])
            windows.append(piece if bos_token_id is None else [int(bos_token_id)] + piece)
            if max_windows is not None and len(windows) == max_windows:
                return torch.tensor(windows, dtype=torch.long)
    if not windows:
        longest = max((len(d) for d in documents), default=0)
        raise ValueError(f"the text is too short: its longest document has {longest} tokens, fewer than the "
                         f"{step} a window of max_length={max_length} needs; give a longer text or a smaller max_length")
    return torch.tensor(windows, dtype=torch.long)


def token_stream(documents: Sequence[Sequence[int]], separator: Optional[int] = None) -> torch.Tensor:
    """All documents' tokens in one 1D tensor, ``separator`` (e.g. the EOS id) between documents."""
    out: list[int] = []
    for i, doc in enumerate(documents):
        if i and separator is not None:
            out.append(int(separator))
        out.extend(int(t) for t in doc)
    return torch.tensor(out, dtype=torch.long)


def ordinary_token_ids(tokenizer, limit: Optional[int] = None) -> torch.Tensor:
    """The ids of the tokenizer's ordinary vocabulary: every id below ``len(tokenizer)`` (and
    ``limit``) that is neither a special token nor an added one."""
    n = len(tokenizer) if limit is None else min(len(tokenizer), int(limit))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {int(i) for i in added}
    return torch.tensor([i for i in range(n) if i not in special], dtype=torch.long)


def recall_sequences(spans: torch.Tensor, stream: torch.Tensor, starts: torch.Tensor, distance: int) -> torch.Tensor:
    """``span + stream[start : start + distance] + span`` per trial: ``spans (T, L)``, ``starts
    (T,)`` -> ``(T, 2 L + distance)``."""
    filler = torch.stack([stream[int(s):int(s) + distance] for s in starts]) if distance else spans[:, :0]
    return torch.cat([spans, filler, spans], dim=1)
