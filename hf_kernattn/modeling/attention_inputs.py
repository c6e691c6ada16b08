"""Checks and normal forms of what :func:`~dispatch.kernelized_attention` is given.

Each check names the parameter and what is allowed (``TypeError`` for a type, ``ValueError`` for
a shape or value). Checks that read values (mask values, a clipped bias's constancy) run in eager
mode only: while tracing they would need a host sync, so the declaration is trusted.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from .kernels_common import is_size, known_true, manhattan_distances, manhattan_table, tracing
from .state import AttentionState, StateKind


class SoftmaxWindow(NamedTuple):
    """The sliding-window hybrid's inputs to ``kernelized_attention(..., softmax_window=...)``.

    Attributes:
        q, k: ``(B, H, N, Dk)`` raw (projected, not feature-mapped) queries and keys.
        window: ``W >= 1``: each query weighs the last ``W`` keys (causal; itself included) or those
            with ``|j - i| < W`` (bidirectional) by ``exp(scale q . k)``.
        scale: the softmax scale; None: ``Dk ** -0.5``.
        window_weight: None or ``(H,)`` positive per-head weight ``a_h`` of the window part.
        linear_weight: None or ``(H,)`` positive per-head weight ``b_h`` of the kernelized part.
    """

    q: torch.Tensor
    k: torch.Tensor
    window: int
    scale: Optional[float] = None
    window_weight: Optional[torch.Tensor] = None
    linear_weight: Optional[torch.Tensor] = None


def check_tensor(name: str, x: object, ndim: int, shape_doc: Union[str, Callable[[], str]]) -> torch.Tensor:
    """``x`` must be a floating-point tensor with ``ndim`` dimensions. ``shape_doc`` may be a
    function, called only for a message (formatting a symbolic size would pin it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {_doc(shape_doc)}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {_doc(shape_doc)}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    return x


def _doc(shape_doc: Union[str, Callable[[], str]]) -> str:
    return shape_doc if isinstance(shape_doc, str) else shape_doc()


def check_attention_mask(attention_mask: object, b: int, n: int) -> None:
    """``attention_mask``: None or a ``(b, n)`` tensor."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor of shape (batch, seq) = ({b}, {n}) or None")
    if tuple(attention_mask.shape) != (b, n):
        raise ValueError(
            f"attention_mask must have shape (batch, seq) = ({b}, {n}) with 1 = keep and 0 = padding, "
            f"got {tuple(attention_mask.shape)}"
        )


def normalize_mask(attention_mask: object, b: int, n: int, device, inspect: bool = True) -> Optional[torch.Tensor]:
    """``(B, N)`` 1/0 (bool, int or float) -> bool, or None when nothing is padded. While tracing
    or without ``inspect`` (a one-token decoding step) it is converted unchecked (no host sync) and
    kept even if it pads nothing."""
    check_attention_mask(attention_mask, b, n)
    if attention_mask is None:
        return None
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if tracing() or not inspect:
        return mask
    everything_kept = mask.all()
    if attention_mask.dtype == torch.bool:
        return None if bool(everything_kept) else mask
    # the 0/1 check and "nothing padded" read on the host together: one sync
    not_binary = ((attention_mask != 0) & (attention_mask != 1)).any()
    not_binary, everything_kept = torch.stack([not_binary, everything_kept.to(not_binary.device)]).tolist()
    if not_binary:
        raise ValueError("attention_mask must hold only 1 (keep) and 0 (padding)")
    return None if everything_kept else mask


def check_grid(grid: object, n: int) -> Optional[tuple[int, int]]:
    """None, or ``(Hg, Wg)`` positive sizes with ``Hg * Wg == n``."""
    if grid is None:
        return None
    if (
        not isinstance(grid, (tuple, list))
        or len(grid) != 2
        or not all(is_size(g) and g > 0 for g in grid)
    ):
        raise ValueError(f"grid must be a pair of positive ints (height, width), got {grid!r}")
    if grid[0] * grid[1] != n:
        raise ValueError(f"grid {tuple(grid)} has {grid[0] * grid[1]} cells but the sequence has N={n} tokens")
    return grid[0], grid[1]


def check_rpe_clip(rpe_clip: object) -> Optional[int]:
    """None, or the clipping distance ``K``: an int >= 0."""
    if rpe_clip is not None and (not isinstance(rpe_clip, int) or isinstance(rpe_clip, bool) or rpe_clip < 0):
        raise ValueError(f"rpe_clip must be an int >= 0 (the clipping distance K of the bias), got {rpe_clip!r}")
    return rpe_clip


def check_rpe(rpe_bias: torch.Tensor, h: int, n: int, grid: Optional[Sequence[int]], rpe_clip: Optional[int]) -> str:
    """The kind of bias (``"1d"`` / ``"2d"``) after checking its shape: 1D ``(H, 2N-1)`` or, with
    ``rpe_clip = K``, ``(H, 2K+1)``; 2D ``(H, 2Hg-1, 2Wg-1)`` or, with ``rpe_clip``, ``(H, K+1)``."""
    # messages are formatted only when raised: formatting a symbolic size would pin it
    if grid is None:
        def want() -> str:
            doc = f"(heads, 2*seq-1) = ({h}, {2 * n - 1})"
            if rpe_clip is not None:
                doc += f" or, clipped at rpe_clip={rpe_clip}, (heads, 2*rpe_clip+1) = ({h}, {2 * rpe_clip + 1})"
            return doc

        if isinstance(rpe_bias, torch.Tensor) and rpe_bias.dim() == 3:
            raise ValueError(f"rpe_bias must have shape {want()}; a 3D bias needs grid=(height, width)")
        check_tensor("rpe_bias", rpe_bias, 2, want)
        # symbolic sizes (torch.export): the table's width is compared without a guard, never with the length
        table = rpe_clip is not None and known_true(rpe_bias.shape[1] == 2 * rpe_clip + 1)
        if rpe_bias.shape[0] != h or not (table or rpe_bias.shape[1] == 2 * n - 1):
            raise ValueError(f"rpe_bias must have shape {want()}, got {tuple(rpe_bias.shape)}")
        return "1d"
    hg, wg = grid
    want = (h, 2 * hg - 1, 2 * wg - 1)
    if rpe_clip is not None and isinstance(rpe_bias, torch.Tensor) and rpe_bias.dim() == 2:
        # the per-distance table of a bias of the clipped Manhattan distance
        table = (h, rpe_clip + 1)
        check_tensor("rpe_bias", rpe_bias, 2, lambda: f"(heads, rpe_clip+1) = {table}")
        if tuple(rpe_bias.shape) != table:
            raise ValueError(f"rpe_bias must have shape (heads, 2*grid_h-1, 2*grid_w-1) = {want} or, as the table of "
                             f"the clipped Manhattan distance, (heads, rpe_clip+1) = {table}, got {tuple(rpe_bias.shape)}")
        return "2d"
    check_tensor("rpe_bias", rpe_bias, 3, lambda: f"(heads, 2*grid_h-1, 2*grid_w-1) = {want}")
    if tuple(rpe_bias.shape) != want:
        raise ValueError(f"rpe_bias must have shape (heads, 2*grid_h-1, 2*grid_w-1) = {want}, got {tuple(rpe_bias.shape)}")
    return "2d"


def check_clipped_bias(rpe_bias: torch.Tensor, rpe: Optional[str], n: int, rpe_clip: int,
                       grid: Optional[Sequence[int]] = None) -> None:
    """``rpe_clip`` needs a bias really clipped at K: a full 1D bias constant beyond ``+-K``, or a 2D
    bias of ``min(|dy| + |dx|, K)`` only. Eager mode only; a clipped table is clipped by construction."""
    if rpe is None:
        raise ValueError("rpe_clip needs a 1D rpe_bias (heads, 2*seq-1) or, with grid, a 2D one")
    if tracing() or is_clipped_table(rpe_bias, rpe, rpe_clip):
        return  # traced: the declaration is trusted; a table is clipped by construction
    if rpe == "2d":

        with torch.no_grad():
            rebuilt = manhattan_table(manhattan_distances(rpe_bias, grid[0], grid[1], rpe_clip), grid[0], grid[1])
            if not torch.equal(rebuilt, rpe_bias):
                raise ValueError(
                    f"rpe_bias is not a function of the clipped Manhattan distance min(|dy| + |dx|, {rpe_clip}), "
                    f"so rpe_clip={rpe_clip} does not hold for this 2D bias"
                )
        return
    clip = min(rpe_clip, n - 1)
    with torch.no_grad():
        left = rpe_bias[:, : n - 1 - clip]
        right = rpe_bias[:, n + clip :]
        if not (
            torch.equal(left, rpe_bias[:, n - 1 - clip : n - clip].expand_as(left))
            and torch.equal(right, rpe_bias[:, n - 1 + clip : n + clip].expand_as(right))
        ):
            raise ValueError(f"rpe_bias is not constant beyond offsets +-{rpe_clip}, so rpe_clip={rpe_clip} does not hold")


def is_clipped_table(rpe_bias: torch.Tensor, rpe: Optional[str], rpe_clip: Optional[int]) -> bool:
    """Whether a bias declared clipped at ``K`` is given as its table: 1D ``(H, 2K+1)`` (the full
    bias itself when ``2K+1 = 2N-1``), 2D ``(H, K+1)``."""
    if rpe_clip is None:
        return False
    if rpe == "2d":
        return rpe_bias.dim() == 2
    return rpe == "1d" and known_true(rpe_bias.shape[-1] == 2 * rpe_clip + 1)


def check_denominator_features(q_den: object, k_den: object, q: torch.Tensor) -> None:
    """``q_den``, ``k_den``: both None, or ``(B, H, N, M')`` matching ``q`` in batch, heads, length,
    dtype and device."""
    if (q_den is None) != (k_den is None):
        raise ValueError("pass both q_den and k_den (separate denominator features) or neither")
    if q_den is None:
        return
    doc = f"(batch, heads, seq, features) with (batch, heads, seq) = {tuple(q.shape[:3])}"
    check_tensor("q_den", q_den, 4, doc)
    check_tensor("k_den", k_den, 4, doc)
    if q_den.shape != k_den.shape or q_den.shape[:3] != q.shape[:3] or q_den.shape[-1] == 0:
        raise ValueError(f"q_den and k_den must have one shape {doc} and features >= 1, got "
                         f"{tuple(q_den.shape)} and {tuple(k_den.shape)}")
    if q_den.dtype != q.dtype or k_den.dtype != q.dtype or q_den.device != q.device or k_den.device != q.device:
        raise ValueError(f"q_den and k_den must have the dtype and device of q ({q.dtype}, {q.device})")


def check_state(
    initial_state: object, shapes: dict[str, tuple[int, ...]], device
) -> Optional[AttentionState]:
    """None, or an :class:`AttentionState` (or a tuple of its 2, 4 or 6 tensors) with the given
    ``shapes`` (window tensors only for a clipped bias or the hybrid)."""
    if initial_state is None:
        return None
    if not isinstance(initial_state, tuple) or len(initial_state) not in (2, 4, 6):
        raise TypeError(
            "initial_state must be an AttentionState (kv, z[, window_k, window_v[, window_raw, window_valid]]) "
            f"returned by an earlier call with output_final_state=True, got {type(initial_state).__name__}"
        )
    # (a hand-built tuple's window is oldest first; an AttentionState says where it starts)
    state = AttentionState(*initial_state, window_start=getattr(initial_state, "window_start", 0))
    for name, want in shapes.items():
        x = getattr(state, name)
        doc = str(want)
        if x is None:
            raise ValueError(f"initial_state.{name} must be a tensor of shape {doc} for this call, got None")
        if name == "window_valid":
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bool:
                raise TypeError(f"initial_state.window_valid must be a bool tensor of shape {doc}, got "
                                f"{getattr(x, 'dtype', type(x).__name__)}")
        else:
            check_tensor(f"initial_state.{name}", x, len(want), doc)
        if tuple(x.shape) != want:
            raise ValueError(f"initial_state.{name} must have shape {doc} for this call, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"initial_state.{name} must be on the device of q ({device}), got {x.device}")
    extra = [n for n in ("window_raw", "window_valid") if n not in shapes and getattr(state, n) is not None]
    if extra:
        raise ValueError(
            f"initial_state holds {extra}, the window of the sliding-window hybrid, but this call has no "
            "softmax_window: a state only continues a call of the same kind"
        )
    extra = [n for n in ("window_k", "window_v") if n not in shapes and getattr(state, n) is not None]
    if extra:
        raise ValueError(
            f"initial_state holds {extra}, the window of a relative-position bias clipped at K, but this call "
            "has no clipped bias: a state only continues a call of the same kind"
        )
    return state


def check_softmax_window(
    softmax_window: object, q: torch.Tensor, causal: bool, rpe: Optional[str], q_den: Optional[torch.Tensor],
    inspect: bool = True,
) -> Optional[SoftmaxWindow]:
    """None, or ``softmax_window`` checked against ``q`` and in normal form (``window`` an int,
    ``scale`` a float). Mixing weights are read in eager mode with ``inspect`` (one host sync)."""
    if softmax_window is None:
        return None
    if not isinstance(softmax_window, SoftmaxWindow):
        raise TypeError("softmax_window must be None or a SoftmaxWindow(q, k, window, scale, window_weight, "
                        f"linear_weight) of the raw queries and keys, got {type(softmax_window).__name__}")
    sw = softmax_window
    b, h, n = q.shape[:3]
    for name in ("q", "k"):
        x = check_tensor(f"softmax_window.{name}", getattr(sw, name), 4, "(batch, heads, seq, head_dim)")
        if tuple(x.shape[:3]) != (b, h, n) or x.shape[3] == 0:
            raise ValueError(f"softmax_window.{name} (the raw {'queries' if name == 'q' else 'keys'}) must have shape "
                             f"(batch, heads, seq, head_dim >= 1) with (batch, heads, seq) = {(b, h, n)} as q, "
                             f"got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"softmax_window.{name} must have the dtype and device of q ({q.dtype}, {q.device}), got "
                             f"{x.dtype}, {x.device}")
    if sw.q.shape[3] != sw.k.shape[3]:
        raise ValueError(f"softmax_window.q and softmax_window.k must have one head_dim, got {sw.q.shape[3]} and "
                         f"{sw.k.shape[3]}")
    window = sw.window
    if not isinstance(window, int) or isinstance(window, bool):
        raise TypeError(f"softmax_window.window must be an int >= 1 (W, the keys each query sees exactly), "
                        f"got {window!r}")
    if window < 1:
        raise ValueError(f"softmax_window.window must be an int >= 1 (W, the keys each query sees exactly), "
                         f"got {window}")
    scale = sw.scale
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"softmax_window.scale must be None (head_dim ** -0.5) or a number > 0, got {scale!r}")
        if not 0 < scale < float("inf"):
            raise ValueError(f"softmax_window.scale must be None (head_dim ** -0.5) or a finite number > 0, "
                             f"got {scale!r}")
        scale = float(scale)
    for name in ("window_weight", "linear_weight"):
        w = getattr(sw, name)
        if w is None:
            continue
        check_tensor(f"softmax_window.{name}", w, 1, f"(heads,) = ({h},)")
        if tuple(w.shape) != (h,) or w.device != q.device:
            raise ValueError(f"softmax_window.{name} must be None or a tensor of shape (heads,) = ({h},) on "
                             f"{q.device} (positive per-head mixing weights), got shape {tuple(w.shape)} on {w.device}")
        if inspect and not tracing() and w.device.type != "meta":
            with torch.no_grad():
                if not bool(((w > 0) & torch.isfinite(w)).all()):
                    raise ValueError(f"softmax_window.{name} must hold positive finite per-head mixing weights, got "
                                     f"{[round(float(x), 6) for x in w.detach().flatten().tolist()]}")
    if rpe is not None:
        raise ValueError("softmax_window cannot be combined with rpe_bias (or grid): the sliding-window hybrid "
                         "takes no relative-position bias")
    if q_den is not None:
        raise ValueError("softmax_window cannot be combined with separate denominator features (q_den, k_den)")
    return sw._replace(window=int(window), scale=scale)


def check_state_kind(given: Optional[StateKind], kind: StateKind) -> None:
    """``ValueError`` naming what differs when a state's recorded kind ``given`` is not this call's
    ``kind``; a state without one (built by hand) is trusted."""
    if given is None or given == kind:
        return
    raise ValueError(
        "initial_state was produced by a call of another kind, and a state only continues a call of the same "
        f"kind: {'; '.join(given.differences(kind))} (state: {given.describe()}; this call: {kind.describe()})"
    )
