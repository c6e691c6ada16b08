"""Linear GPT's decoding state (``past_key_values``): a transformers ``DynamicCache`` of
:class:`LinearGPTCacheLayer`.

Causal linear attention is an RNN (Katharopoulos et al. 2020): after tokens ``0..t`` a layer
needs only ``S = sum_j k_j v_j^T`` and ``z = sum_j k_j`` (with a clipped bias or the hybrid also a
window of the last keys), so a step costs the same at any length. The core computes the state
(``state.AttentionState``); this module stores it, in place while decoding. Transformers' cache
API works on it: ``reset()``, ``reorder_cache`` (beam search), ``batch_repeat_interleave``,
``batch_select_indices``, ``get_seq_length()``, ``offload()`` / ``prefetch()``.
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

# the outputs' name of the decoding cache: ``cache`` from transformers 5.24, ``past_key_values``
# before; the models take both as arguments (:func:`cache_argument`)
CACHE_FIELD = "cache" if "cache" in getattr(BaseModelOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def cache_argument(past_key_values: object, cache: object) -> object:
    """The state passed as ``past_key_values`` or ``cache`` (``generate()``'s name from
    transformers 5.24); ``ValueError`` when both name different objects."""
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
    """One layer's state: recurrent states ``0`` = S ``(B, H, M, D)``, ``1`` = z ``(B, H, M)``;
    with a bias clipped at K (``window = K - 1``) ``2``, ``3`` = the window's keys
    ``(B, H, K - 1, M)`` and values ``(B, H, K - 1, D)``; with the hybrid (``softmax_window = W``)
    ``2``, ``3`` = the last ``W - 1`` keys' features and values, ``4`` = their raw keys
    ``(B, H, W - 1, Dk)``, ``5`` = their validity ``(B, 1, W - 1)``, a ring along dim 2 whose
    oldest slot is ``window_start`` (a step overwrites the key that leaves).

    Counts the positions folded in, padding included (``get_seq_length()``, as a key/value
    layer); no ``update`` or ``crop`` (a recurrent state cannot forget tokens).

    Args:
        window: ``K - 1``; None without a bias; unset: the first state stored decides.
        softmax_window: ``W``, or None (with ``window`` unset, the first state decides).
    """

    # static shapes, but Linear GPT's forward is no full graph: generate() must not compile it
    is_compileable = False

    def __init__(self, window: Union[int, None, str] = UNSET, softmax_window: Optional[int] = None, **kwargs) -> None:
        _check_window(window)
        _check_softmax_window(softmax_window)
        super().__init__(number_of_states=6 if softmax_window is not None else 4 if isinstance(window, int) else 2)
        self.window = window
        self.softmax_window = softmax_window
        # positions folded into the state, padding included (DynamicLayer's name for it)
        self.cumulative_length = 0
        # the StateKind of the call that made the state: a call of another kind refuses it
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
        """The state to continue from (None before the first tokens), the hybrid's window oldest
        first (copied unless the ring starts at slot 0); ``ordered=False``: the stored tensors
        and their ``window_start``."""
        if not self.is_initialized:
            return None
        state = AttentionState(*(self.recurrent_states[i] for i in range(self.number_of_states)), kind=self.state_kind,
                               window_start=self.window_start)
        return state.ordered() if ordered else state

    def set_state(self, state: AttentionState) -> None:
        """Store the state after the latest tokens: tensors the core updated in place are kept,
        others copied in; while autograd records (training across calls) the tensors are
        replaced instead, so the earlier call's graph keeps its values."""
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
    """The state ``forward`` and ``generate()`` return: a ``DynamicCache`` of
    :class:`LinearGPTCacheLayer`.

    Args:
        num_layers: decoder layers.
        window: ``K - 1`` for a bias clipped at ``K``; None without.
        softmax_window: ``W`` of the hybrid; None without.
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
        # the model's flat one-token step (decoding.DecodingPlan), made at its first one-token step;
        # None: not yet; False: the modules run every step
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
