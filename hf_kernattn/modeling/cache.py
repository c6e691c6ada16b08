"""Recurrent decoding state of Linear GPT, returned by ``forward`` as ``past_key_values``.

Causal linear attention is an RNN (Katharopoulos et al. 2020): after tokens ``0..t`` a layer
needs only ``S = sum_j k_j v_j^T`` ``(B, H, M, D)`` and ``z = sum_j k_j`` ``(B, H, M)``, so a
decoding step costs the same at any context length. This module stores those per layer.

With rotary features, ``S`` accumulates the *rotated* keys (numerator) and ``z`` the
un-rotated ones (denominator). With a learned relative-position bias clipped at
``K = max_relative_position`` every key older than ``K`` positions carries the same weight
``c_{-K}``, so the state is ``(S, z)`` over those keys plus a window of the last ``K - 1``
keys and values, each weighted by its own ``c_r``: exact, and still constant per token.

The object is a ``transformers`` :class:`~transformers.Cache` so ``generate()`` treats it as a
cache: ``get_seq_length()`` (continuing generation), ``reorder_cache(beam_idx)`` in place (beam
search), ``batch_repeat_interleave`` / ``batch_select_indices`` (expanding a returned state).
It is not compileable and never asks for a 4D mask. Left padding: padded positions have their
keys and values zeroed before they enter ``S``, ``z`` or the window, so they never count.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache


class LinearAttentionState:
    """The decoding state of one layer.

    Attributes:
        state: ``S`` ``(B, H, M, D)`` sum of ``k_j v_j^T`` over keys that left the window, float32+.
        normalizer: ``z`` ``(B, H, M)`` sum of ``k_j`` over the same keys.
        window_keys: ``(B, H, W, M)`` the most recent keys (RPE only; ``W <= window``), or None.
        window_values: ``(B, H, W, D)`` their values, or None.
    """

    def __init__(self) -> None:
        self.state: Optional[torch.Tensor] = None
        self.normalizer: Optional[torch.Tensor] = None
        self.window_keys: Optional[torch.Tensor] = None
        self.window_values: Optional[torch.Tensor] = None

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    def tensors(self) -> list[str]:
        return [n for n in ("state", "normalizer", "window_keys", "window_values") if getattr(self, n) is not None]

    def apply(self, fn) -> None:
        """Replace each held tensor ``x`` by ``fn(x)`` (batch dim first)."""
        for name in self.tensors():
            setattr(self, name, fn(getattr(self, name)))

    def push(
        self,
        k_num: torch.Tensor,
        k_den: torch.Tensor,
        v: torch.Tensor,
        window: int,
    ) -> None:
        """Add keys/values (already masked: padded rows zero) of ``N`` new tokens.

        Args:
            k_num: ``(B, H, N, M)`` keys for the numerator state (rotated when rotary).
            k_den: ``(B, H, N, M)`` keys for the normalizer (un-rotated).
            v: ``(B, H, N, D)``.
            window: how many most recent keys to keep apart (``K - 1`` with RPE, else 0).
                With a window, ``k_num`` and ``k_den`` must be the same tensor.
        """
        b, h, _, m = k_num.shape
        d = v.shape[-1]
        if self.state is None:
            self.state = k_num.new_zeros(b, h, m, d)
            self.normalizer = k_num.new_zeros(b, h, m)
        if window > 0:
            if self.window_keys is not None:
                k_num = torch.cat([self.window_keys, k_num], dim=2)
                v = torch.cat([self.window_values, v], dim=2)
            overflow = max(0, k_num.shape[2] - window)
            old_k, old_v = k_num[:, :, :overflow], v[:, :, :overflow]
            self.window_keys = k_num[:, :, overflow:]
            self.window_values = v[:, :, overflow:]
            k_num, k_den, v = old_k, old_k, old_v
            if overflow == 0:
                return
        if k_num.shape[2] == 1:
            self.state = self.state + k_num[:, :, 0, :, None] * v[:, :, 0, None, :]
            self.normalizer = self.normalizer + k_den[:, :, 0]
        else:
            self.state = self.state + k_num.transpose(-1, -2) @ v
            self.normalizer = self.normalizer + k_den.sum(dim=2)


class LinearGPTCache(Cache):
    """Per-layer recurrent states plus the number of positions seen (padding included).

    Args:
        num_layers: number of decoder layers.
        window: keys kept apart per layer for a clipped relative-position bias (``K - 1``; 0 without RPE).
    """

    def __init__(self, num_layers: int, window: int = 0) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        super().__init__(layers=[LinearAttentionState() for _ in range(num_layers)])
        self.window = window
        self.seen_tokens = 0
        # per row: how many real (non-padded) tokens entered the state; gives the next position id.
        self.real_tokens: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={len(self.layers)}, seen_tokens={self.seen_tokens}, window={self.window})"

    # ------------------------------------------------------------------ what generate() uses
    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.seen_tokens > 0

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_sliding(self) -> list[bool]:  # type: ignore[override]
        return [False] * len(self.layers)

    @property
    def is_linear(self) -> list[bool]:  # type: ignore[override]
        return [True] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:  # type: ignore[override]
        return [False] * len(self.layers)

    @property
    def batch_size(self) -> Optional[int]:  # type: ignore[override]
        return None if self.real_tokens is None else int(self.real_tokens.shape[0])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of positions (padding included) already folded into the state."""
        return self.seen_tokens

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # type: ignore[override]
        return self.seen_tokens + query_length, 0

    def advance(self, attention_mask_new: Optional[torch.Tensor], batch: int, num_tokens: int, device) -> None:
        """Record ``num_tokens`` new positions; ``attention_mask_new`` ``(B, N)`` marks the real ones."""
        if self.real_tokens is None:
            self.real_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        if attention_mask_new is None:
            self.real_tokens = self.real_tokens + num_tokens
        else:
            self.real_tokens = self.real_tokens + attention_mask_new.to(device=device, dtype=torch.long).sum(dim=-1)
        self.seen_tokens += num_tokens

    def _apply_batch(self, fn) -> None:
        for layer in self.layers:
            layer.apply(fn)
        if self.real_tokens is not None:
            self.real_tokens = fn(self.real_tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows ``beam_idx`` ``(B,)`` (in place)."""
        self._apply_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (in place), as generate expands inputs."""
        self._apply_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in place)."""
        self._apply_batch(lambda x: x[indices.to(x.device)])

    def reset(self) -> None:
        """Forget everything (the object can be reused for a new prompt)."""
        for i in range(len(self.layers)):
            self.layers[i] = LinearAttentionState()
        self.seen_tokens = 0
        self.real_tokens = None

    def crop(self, max_length: int) -> None:  # type: ignore[override]
        raise NotImplementedError(
            "LinearGPTCache cannot be cropped: a recurrent state cannot forget tokens "
            "(assisted / speculative decoding is not supported)"
        )

    def copy(self) -> "LinearGPTCache":
        """An independent copy (states are small: no context-length dimension)."""
        new = LinearGPTCache(len(self.layers), self.window)
        new.seen_tokens = self.seen_tokens
        new.real_tokens = None if self.real_tokens is None else self.real_tokens.clone()
        for src, dst in zip(self.layers, new.layers):
            for name in src.tensors():
                setattr(dst, name, getattr(src, name).clone())
        return new
