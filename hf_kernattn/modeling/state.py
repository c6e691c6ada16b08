"""The state of causal attention: what one call carries to the next.

After keys ``0..t``: ``S = sum_j k_j^T v_j (M x D)`` and ``z = sum_j k_j (M)`` (of the
denominator's keys when separate), plus, for a 1D bias clipped at ``K``, the last ``K - 1`` keys
and values, which still carry their own weights ``c_{-1} .. c_{-(K-1)}`` (older keys carry
``c_{-K}`` and live in ``S``, ``z``). The sliding-window hybrid keeps the last ``W - 1`` key
features and values, their raw keys and validity flags, as a ring (a decoding step writes one
slot instead of shifting). The sums are unweighted, so a state does not depend on the bias; an
all-zero state is the empty one, so the window has a fixed size from the first token on.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple, Optional

import torch


@dataclasses.dataclass
class StateKind:
    """The kind of call that produced a state: a state only continues a call of the same kind
    (shapes cannot tell whether ``z`` sums separate denominator features: rotary keeps ``M' = M``).

    Attributes:
        split: ``z`` sums separate denominator features (``q_den``, ``k_den``).
        features, den_features, values: M, M' (``M`` unless ``split``) and D.
        window: ``K - 1`` for a 1D bias clipped at ``K``; else None.
        softmax_window: ``W`` for the sliding-window hybrid; else None.

    A mutable dataclass: transformers' exporters rebuild the tuples in a cache and set attributes back.
    """

    split: bool
    features: int
    den_features: int
    values: int
    window: Optional[int]
    softmax_window: Optional[int] = None

    def describe(self) -> str:
        """The kind in words, for error messages."""
        den = ("separate denominator features (q_den, k_den) of size M'=" + str(self.den_features)
               if self.split else "no separate denominator features")
        bias = (f"a 1D bias clipped at K={self.window + 1} (a window of {self.window} keys)"
                if self.window is not None else "no clipped bias (no window)")
        hybrid = (f", a softmax window of W={self.softmax_window} keys" if self.softmax_window is not None
                  else ", no softmax window")
        return f"feature size M={self.features}, value size D={self.values}, {den}, {bias}{hybrid}"

    def differences(self, other: "StateKind") -> list[str]:
        """What differs between a state of kind ``self`` and a call of kind ``other``, in words."""
        out = []
        if self.split != other.split:
            out.append("the state was produced " + ("with" if self.split else "without")
                       + " separate denominator features (q_den, k_den), this call has "
                       + ("none" if self.split else "them"))
        if self.features != other.features:
            out.append(f"feature size M: state {self.features}, call {other.features}")
        if self.den_features != other.den_features and self.split == other.split:
            out.append(f"denominator feature size M': state {self.den_features}, call {other.den_features}")
        if self.values != other.values:
            out.append(f"value size D: state {self.values}, call {other.values}")
        if self.window != other.window:
            def bias(w):
                return f"a bias clipped at K={w + 1}" if w is not None else "no clipped bias"
            out.append(f"relative-position bias: state {bias(self.window)}, call {bias(other.window)}")
        if self.softmax_window != other.softmax_window:
            def hybrid(w):
                return f"a softmax window of W={w}" if w is not None else "no softmax window"
            out.append(f"softmax window: state {hybrid(self.softmax_window)}, call {hybrid(other.softmax_window)}")
        return out


class _StateTensors(NamedTuple):
    kv: torch.Tensor
    z: torch.Tensor
    window_k: Optional[torch.Tensor] = None
    window_v: Optional[torch.Tensor] = None


class AttentionState(_StateTensors):
    """What causal attention carries from one call to the next: a tuple ``(kv, z, window_k,
    window_v)``, or for the hybrid ``(..., window_raw, window_valid)``, plus keyword-only ``kind``
    and ``window_start``.

    Attributes:
        kv: ``S (B, H, M, D)``, the sum of ``k_j^T v_j``.
        z: ``(B, H, M')``, the sum of the denominator's key features.
        window_k, window_v: the latest keys ``(B, H, K - 1, M)`` and values ``(B, H, K - 1, D)`` for
            a bias clipped at ``K`` (oldest first); ``W - 1`` of them for the hybrid; else None.
        window_raw: ``(B, H, W - 1, Dk)``, the hybrid's raw keys; else None.
        window_valid: ``(B, 1, W - 1)`` bool, the hybrid's real keys; else None.
        kind: the :class:`StateKind` of the producing call, or None (built by hand: trusted).
        window_start: the hybrid's ring: the slot of the oldest key (0 for every other state);
            :meth:`ordered` rolls it to 0.
    """

    kind: Optional[StateKind] = None
    window_start: int = 0

    def __new__(cls, kv, z, window_k=None, window_v=None, window_raw=None, window_valid=None, *,
                kind: Optional[StateKind] = None, window_start: int = 0):
        if window_raw is None and window_valid is None:
            self = super().__new__(cls, kv, z, window_k, window_v)
        else:  # the hybrid's six tensors (the first four read as usual by index)
            self = tuple.__new__(cls, (kv, z, window_k, window_v, window_raw, window_valid))
        if kind is not None:
            if not isinstance(kind, StateKind):
                raise TypeError(f"kind must be a StateKind or None, got {type(kind).__name__}")
            self.kind = kind
        if type(window_start) is not int or window_start:  # (0, the default: nothing to check or record)
            if not isinstance(window_start, int) or isinstance(window_start, bool):
                raise TypeError(f"window_start must be an int, got {type(window_start).__name__}")
            if window_start:
                slots = window_raw.shape[2] if isinstance(window_raw, torch.Tensor) and window_raw.dim() == 4 else 0
                if not 0 < window_start < slots:
                    raise ValueError(
                        f"window_start must lie in [0, W - 1) = [0, {slots}) (a slot of the sliding-window "
                        f"hybrid's window; 0 for every other state), got {window_start}")
                self.window_start = window_start
        return self

    def replaced(self, *tensors, window_start: Optional[int] = None) -> "AttentionState":
        """The state with other tensors (None keeps this one's), same kind and window start (or
        ``window_start``)."""
        tensors = [mine if new is None else new for mine, new in itertools.zip_longest(self, tensors)]
        return AttentionState(*tensors, kind=self.kind,
                              window_start=self.window_start if window_start is None else window_start)

    def ordered(self) -> "AttentionState":
        """The same state with its window oldest first (itself when already so)."""
        start = self.window_start
        if not start:
            return self
        return AttentionState(*self[:2], *(torch.roll(x, -start, dims=2) for x in self[2:]), kind=self.kind)

    @property
    def window_raw(self) -> Optional[torch.Tensor]:
        return self[4] if len(self) > 4 else None

    @property
    def window_valid(self) -> Optional[torch.Tensor]:
        return self[5] if len(self) > 5 else None

    def _asdict(self) -> dict:
        names = self._fields + (("window_raw", "window_valid") if len(self) > 4 else ())
        return dict(zip(names, self))

    def __repr__(self) -> str:
        start = f", window_start={self.window_start}" if self.window_start else ""
        return type(self).__name__ + "(" + ", ".join(f"{k}={v!r}" for k, v in self._asdict().items()) + \
            f", kind={self.kind!r}{start})"


def fold_into_state(
    state: Optional[AttentionState], k: torch.Tensor, v: torch.Tensor, k_den: torch.Tensor, window: Optional[int] = None
) -> AttentionState:
    """The state after keys ``k (B, H, N, M)`` (denominator keys ``k_den``) and values ``v`` follow
    ``state`` (None: empty). With ``window`` (``K - 1``; ``k_den`` is then ``k``) the last
    ``window`` keys of ``[window_k, k]`` form the new window and older ones enter ``S`` and ``z``.
    Time O((N + window) M D)."""
    b, h, _, m = k.shape
    if window is not None:
        if state is None:
            k = torch.nn.functional.pad(k, (0, 0, window, 0))
            v = torch.nn.functional.pad(v, (0, 0, window, 0))
        else:
            k = torch.cat([state.window_k, k], dim=2)
            v = torch.cat([state.window_v, v], dim=2)
        leaving = k.shape[2] - window
        window_k, window_v = k[:, :, leaving:], v[:, :, leaving:]
        k, v, k_den = k[:, :, :leaving], v[:, :, :leaving], k[:, :, :leaving]
    else:
        window_k = window_v = None
    kv = k.transpose(-1, -2) @ v
    z = k_den.sum(dim=2)
    if state is not None:
        kv, z = state.kv + kv, state.z + z
    return AttentionState(kv, z, window_k, window_v)
