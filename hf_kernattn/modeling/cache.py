"""Recurrent decoding state of Linear GPT, returned by ``forward`` as ``past_key_values``.

Causal linear attention is an RNN (Katharopoulos et al. 2020): after tokens ``0..t`` a layer
needs only ``S = sum_j k_j v_j^T`` ``(B, H, M, D)`` and ``z = sum_j k_j`` ``(B, H, M)``, so a
decoding step costs the same at any context length. With rotary features ``S`` holds the
rotated keys and ``z`` the positive ones; with a learned relative-position bias clipped at
``K = max_relative_position`` the state also holds the window of the last ``K - 1`` keys and
values (every older key carries ``c_{-K}`` and lives in ``S``, ``z``): exact, and still constant
per token. With the sliding-window hybrid (``softmax_window = W``) the state holds the window of
the last ``W - 1`` keys' features, values, raw keys and validity flags besides ``S`` and ``z``:
constant size too. The attention core computes and returns this state
(``state.AttentionState``); this module only stores it.

Each layer's state lives in a :class:`LinearGPTCacheLayer`, a ``transformers``
:class:`~transformers.cache_utils.LinearAttentionLayer` whose recurrent states are ``S``, ``z``
and, with the bias, the window's keys and values: fixed shapes from the first token on (the
window starts zero-filled: a zero key adds nothing), updated in place by ``copy_`` while
decoding. The layers sit in a stock :class:`~transformers.DynamicCache` (what ``forward``
returns is :class:`LinearGPTCache`, a ``DynamicCache`` that only builds them), so what
transformers' caches offer works on it: ``reset()``, ``reorder_cache(beam_idx)`` (beam search),
``batch_repeat_interleave`` / ``batch_select_indices`` (expanding a returned state),
``get_seq_length()``, ``offload()`` / ``prefetch()``, and the layer format
``cache.layers[i].recurrent_states``.

Counters: each layer counts the positions folded into it, padding included
(``get_seq_length()``, as transformers' key/value layers do); position ids come from the
``(B, past + N)`` attention mask, as ``generate()`` passes it (and makes them), or follow
``get_seq_length()`` without one.

Left padding: padded positions have their keys and values zeroed before they enter ``S``, ``z``
or the window, so they never count.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from transformers.modeling_outputs import BaseModelOutputWithPast

from .state import AttentionState

# transformers names the decoding cache ``cache`` from 5.24 (``past_key_values`` before; it still
# takes the old name, with a deprecation warning): the models build and read their outputs under
# the installed version's name and accept both names as arguments (:func:`cache_argument`)
CACHE_FIELD = "cache" if "cache" in getattr(BaseModelOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def cache_argument(past_key_values: object, cache: object) -> object:
    """The decoding state a call was given: ``past_key_values``, or ``cache``, the name
    ``generate()`` passes it under from transformers 5.24; ``ValueError`` when both name
    different objects."""
    if cache is None:
        return past_key_values
    if past_key_values is not None and past_key_values is not cache:
        raise ValueError("pass the decoding state once, as cache= or as past_key_values=, not both")
    return cache

# the layer's window is not fixed yet: the first state stored decides it
UNSET = "unset"


def _check_window(window: object) -> None:
    if window != UNSET and window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 0
    ):
        raise ValueError(f"window must be None (no relative-position bias) or an int >= 0 (K - 1), got {window!r}")


def _check_softmax_window(softmax_window: object) -> None:
    if softmax_window is not None and (
        not isinstance(softmax_window, int) or isinstance(softmax_window, bool) or softmax_window < 1
    ):
        raise ValueError(f"softmax_window must be None (no sliding-window hybrid) or an int >= 1 (W), "
                         f"got {softmax_window!r}")


class LinearGPTCacheLayer(LinearAttentionLayer, CacheLayerMixin):
    """One layer's decoding state: recurrent states ``0`` = S ``(B, H, M, D)``, ``1`` = z
    ``(B, H, M)`` and, for a relative-position bias clipped at K (``window = K - 1``), ``2`` = the
    window's keys ``(B, H, K - 1, M)``, ``3`` = its values ``(B, H, K - 1, D)``; for the
    sliding-window hybrid (``softmax_window = W``) ``2``, ``3`` = the features and values of the
    last ``W - 1`` keys, ``4`` = their raw keys ``(B, H, W - 1, Dk)``, ``5`` = their validity
    ``(B, 1, W - 1)`` (bool), kept as a ring: ``window_start`` is the slot (along dim 2) of the
    oldest key, the others follow cyclically (a decoding step writes the new key over the one
    that leaves); :meth:`get_state` gives them oldest first.

    A linear-attention layer that also counts the positions folded in (``get_seq_length()``,
    padding included), so that the stock :class:`~transformers.cache_utils.Cache` answers
    ``get_seq_length()`` / ``get_mask_sizes()`` from it as from a key/value layer. It holds no
    keys and values (``update`` raises) and cannot be cropped: a recurrent state cannot forget
    tokens.

    Args:
        window: ``K - 1`` for a bias clipped at ``K``; None without a bias; left unset (the
            default), the first state stored decides.
        softmax_window: ``W`` for the sliding-window hybrid, None without it (with ``window``
            unset, the first state stored decides).
    """

    # the recurrent states have static shapes, but Linear GPT's forward is not compiled as a
    # whole graph (``_can_compile_fullgraph = False``): generate() must not compile it on its own
    is_compileable = False

    def __init__(self, window: Union[int, None, str] = UNSET, softmax_window: Optional[int] = None, **kwargs) -> None:
        _check_window(window)
        _check_softmax_window(softmax_window)
        super().__init__(number_of_states=6 if softmax_window is not None else 4 if isinstance(window, int) else 2)
        self.window = window
        self.softmax_window = softmax_window
        # positions folded into the state, padding included (DynamicLayer's name for it)
        self.cumulative_length = 0
        # the StateKind of the call that produced the state (kept with it, so that a call of
        # another kind, e.g. another model, refuses to continue it)
        self.state_kind = None
        # the hybrid's window is a ring: the slot of its oldest key (AttentionState.window_start)
        self.window_start = 0

    def __repr__(self) -> str:
        hybrid = f", softmax_window={self.softmax_window}" if self.softmax_window is not None else ""
        return f"{type(self).__name__}(window={self.window}{hybrid}, initialized={self.is_initialized})"

    @property
    def is_initialized(self) -> bool:
        return bool(self.has_previous_state[0])

    @property
    def batch_size(self) -> Optional[int]:
        """Rows of the state (None before the first tokens)."""
        return int(self.recurrent_states[0].shape[0]) if self.is_recurrent_states_initialized[0] else None

    def get_seq_length(self) -> int:
        """Number of positions (padding included) already folded into the state."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} holds a recurrent state (get_state / set_state), not keys and values"
        )

    # the attention module asks for the stored ring (get_state(ordered=False)), not a copy in order
    keeps_window_ring = True

    def get_state(self, ordered: bool = True) -> Optional[AttentionState]:
        """The state to continue from (None before the first tokens): the sliding-window hybrid's
        window oldest first (new tensors where the ring does not start at slot 0), or with
        ``ordered=False`` the layer's own tensors as stored, with their ``window_start``."""
        if not self.is_initialized:
            return None
        state = AttentionState(*(self.recurrent_states[i] for i in range(self.number_of_states)), kind=self.state_kind,
                               window_start=self.window_start)
        return state.ordered() if ordered else state

    def set_state(self, state: AttentionState) -> None:
        """Store the state after the latest tokens: nothing to do for tensors the core already
        updated in place (``kernelized_attention(..., in_place=True)``, decoding); others are
        copied in place into the layer's tensors, except while autograd records through it (training across calls), where the tensors are
        replaced so that the graph of the earlier call keeps the values it saw."""
        if self.window == UNSET:  # the first state decides: the hybrid's (6 tensors), with a window (4) or not (2)
            if len(state) > 4 and state[4] is not None:
                self.window, self.softmax_window = None, int(state[4].shape[2]) + 1
                LinearAttentionCacheLayerMixin.__init__(self, number_of_states=6)
            else:
                self.window = None if len(state) < 3 or state[2] is None else int(state[2].shape[2])
                if self.window is not None:
                    LinearAttentionCacheLayerMixin.__init__(self, number_of_states=4)
        tensors = state[: self.number_of_states]
        self.state_kind = getattr(state, "kind", None)
        self.window_start = getattr(state, "window_start", 0)
        self.device, self.dtype = tensors[0].device, tensors[0].dtype
        replace = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
        for i, x in enumerate(tensors):
            if x is self.recurrent_states[i]:
                continue  # updated in place by the core (decoding)
            held = self.recurrent_states[i]
            if (replace or not self.is_recurrent_states_initialized[i] or held.shape != x.shape or held.dtype != x.dtype
                    or held.device != x.device):  # (a model cast or moved between calls: its state follows)
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

    def reset(self) -> None:
        """Zero the states and the count (the tensors are kept for reuse)."""
        super().reset()
        self.cumulative_length = 0
        self.window_start = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a Linear GPT decoding state cannot be cropped: a recurrent state cannot forget tokens "
            "(assisted / speculative decoding is not supported)"
        )


def is_linear_gpt_cache(cache: object) -> bool:
    """Whether ``cache`` is a transformers ``Cache`` of Linear GPT layers (a :class:`LinearGPTCache`,
    or any cache built of :class:`LinearGPTCacheLayer`, also from another copy of this code)."""
    layers = getattr(cache, "layers", None)
    return isinstance(cache, Cache) and bool(layers) and all(
        isinstance(layer, LinearAttentionCacheLayerMixin) and hasattr(layer, "get_state") and hasattr(layer, "set_state")
        and hasattr(layer, "cumulative_length")
        for layer in layers
    )


class LinearGPTCache(DynamicCache):
    """The decoding state ``forward`` and ``generate()`` return: a stock
    :class:`~transformers.DynamicCache` whose layers are :class:`LinearGPTCacheLayer`; everything
    but building them is transformers' own.

    Args:
        num_layers: number of decoder layers.
        window: keys kept apart per layer for a relative-position bias clipped at ``K``
            (``K - 1``); None (the default) without a bias.
        softmax_window: ``W`` of the sliding-window hybrid; None (the default) without it.
    """

    def __init__(self, num_layers: int, window: Optional[int] = None, softmax_window: Optional[int] = None) -> None:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        _check_window(window)
        if window == UNSET:
            raise ValueError(f"window must be None (no relative-position bias) or an int >= 0 (K - 1), got {window!r}")
        super().__init__()
        _check_softmax_window(softmax_window)
        self.layers = [LinearGPTCacheLayer(window, softmax_window) for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        # the flat one-token step of the model decoding from this cache (decoding.DecodingPlan), made
        # after its first one-token step; None: not made yet; False: the model's modules run every step
        self.decoding_plan = None

    @property
    def window(self) -> Union[int, None, str]:
        return self.layers[0].window

    @property
    def softmax_window(self) -> Optional[int]:
        return self.layers[0].softmax_window

    def __repr__(self) -> str:
        hybrid = f", softmax_window={self.softmax_window}" if self.softmax_window is not None else ""
        return (f"{type(self).__name__}(layers={len(self.layers)}, seen_tokens={self.get_seq_length()}, "
                f"window={self.window}{hybrid})")

    def copy(self) -> "LinearGPTCache":
        """An independent copy (states are small: no context-length dimension)."""
        new = LinearGPTCache(len(self.layers))
        # each layer as its source was made (a layer left unset is decided by the state copied in)
        new.layers = [LinearGPTCacheLayer(src.window, src.softmax_window if src.window != UNSET else None)
                      for src in self.layers]
        for src, dst in zip(self.layers, new.layers):
            dst.cumulative_length = src.cumulative_length
            state = src.get_state()
            if state is not None:
                dst.set_state(AttentionState(*(None if x is None else x.clone() for x in state), kind=state.kind))
        return new
