"""Recurrent decoding state of Linear GPT, returned by ``forward`` as ``past_key_values``.

Causal linear attention is an RNN (Katharopoulos et al. 2020): after tokens ``0..t`` a layer
needs only ``S = sum_j k_j v_j^T`` ``(B, H, M, D)`` and ``z = sum_j k_j`` ``(B, H, M)``, so a
decoding step costs the same at any context length. With rotary features ``S`` holds the
rotated keys and ``z`` the positive ones; with a learned relative-position bias clipped at
``K = max_relative_position`` the state also holds the window of the last ``K - 1`` keys and
values (every older key carries ``c_{-K}`` and lives in ``S``, ``z``): exact, and still constant
per token. The attention core computes and returns this state
(``kernels_common.AttentionState``); this module only stores it.

Each layer's state lives in a :class:`LinearGPTCacheLayer`, a ``transformers``
:class:`~transformers.cache_utils.LinearAttentionLayer` whose recurrent states are ``S``, ``z``
and, with the bias, the window's keys and values: fixed shapes from the first token on (the
window starts zero-filled: a zero key adds nothing), updated in place by ``copy_`` while
decoding. What transformers' caches offer works on it: ``reset()``, ``reorder_cache(beam_idx)``
(beam search), ``batch_repeat_interleave`` / ``batch_select_indices`` (expanding a returned
state), ``offload()`` / ``prefetch()``, and the layer format ``cache.layers[i].recurrent_states``.

Left padding: padded positions have their keys and values zeroed before they enter ``S``, ``z``
or the window, so they never count.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from .kernels_common import AttentionState


class LinearGPTCacheLayer(LinearAttentionLayer):
    """One layer's decoding state: recurrent states ``0`` = S ``(B, H, M, D)``, ``1`` = z
    ``(B, H, M)`` and, for a relative-position bias clipped at K (``window = K - 1``), ``2`` = the
    window's keys ``(B, H, K - 1, M)``, ``3`` = its values ``(B, H, K - 1, D)``.

    Args:
        window: ``K - 1`` for a bias clipped at ``K``; None without a bias.
    """

    def __init__(self, window: Optional[int] = None) -> None:
        super().__init__(number_of_states=2 if window is None else 4)
        self.window = window
        # the StateKind of the call that produced the state (kept with it, so that a call of
        # another kind, e.g. another model, refuses to continue it)
        self.state_kind = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, initialized={self.is_initialized})"

    @property
    def is_initialized(self) -> bool:
        return bool(self.has_previous_state[0])

    def get_state(self) -> Optional[AttentionState]:
        """The state to continue from (None before the first tokens)."""
        if not self.is_initialized:
            return None
        return AttentionState(*(self.recurrent_states[i] for i in range(self.number_of_states)), kind=self.state_kind)

    def set_state(self, state: AttentionState) -> None:
        """Store the state after the latest tokens: nothing to do for tensors the core already
        updated in place (``kernelized_attention(..., in_place=True)``, decoding); others are
        copied in place into the layer's tensors, except while autograd records through it (training across calls), where the tensors are
        replaced so that the graph of the earlier call keeps the values it saw."""
        tensors = state[: self.number_of_states]
        self.state_kind = getattr(state, "kind", None)
        self.device, self.dtype = tensors[0].device, tensors[0].dtype
        replace = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
        for i, x in enumerate(tensors):
            if x is self.recurrent_states[i]:
                continue  # updated in place by the core (decoding)
            if replace or not self.is_recurrent_states_initialized[i] or self.recurrent_states[i].shape != x.shape:
                self.recurrent_states[i] = x if replace else x.clone()
                self.is_recurrent_states_initialized[i] = True
            else:
                self.update_recurrent_state(x, i)
        self.has_previous_state[0] = True

    def _apply_batch(self, fn) -> None:
        for i in range(self.number_of_states):
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = fn(self.recurrent_states[i])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows ``beam_idx``."""
        self._apply_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times, as generate expands inputs."""
        self._apply_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices``."""
        self._apply_batch(lambda x: x[indices.to(x.device)])


class LinearGPTCache(Cache):
    """Per-layer recurrent states (:class:`LinearGPTCacheLayer`) plus the number of positions
    seen (padding included) and, per row, of real tokens (the next position id).

    Args:
        num_layers: number of decoder layers.
        window: keys kept apart per layer for a relative-position bias clipped at ``K``
            (``K - 1``); None (the default) without a bias.
    """

    def __init__(self, num_layers: int, window: Optional[int] = None) -> None:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
            raise ValueError(f"window must be None (no relative-position bias) or an int >= 0 (K - 1), got {window!r}")
        super().__init__(layers=[LinearGPTCacheLayer(window) for _ in range(num_layers)])
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

    def _apply_to_counts(self, fn) -> None:
        if self.real_tokens is not None:
            self.real_tokens = fn(self.real_tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the rows ``beam_idx`` ``(B,)``."""
        super().reorder_cache(beam_idx)
        self._apply_to_counts(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times, as generate expands inputs."""
        super().batch_repeat_interleave(repeats)
        self._apply_to_counts(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices``."""
        super().batch_select_indices(indices)
        self._apply_to_counts(lambda x: x[indices.to(x.device)])

    def reset(self) -> None:
        """Forget everything (the object and its tensors can be reused for a new prompt)."""
        super().reset()
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
            state = src.get_state()
            if state is not None:
                dst.set_state(AttentionState(*(None if x is None else x.clone() for x in state), kind=state.kind))
        return new
