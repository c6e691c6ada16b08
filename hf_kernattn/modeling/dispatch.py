"""The single entry point :func:`kernelized_attention`: check -> prepare -> choose -> run -> finish.

The registry and the ``auto`` rule live in ``registry.py``, the eight built-in backends are
registered in ``builtin_backends.py`` (the kernels themselves are the ``kernels_*.py`` files).

Each backend declares what it can do when it is registered (causal / non-causal, 1D or 2D
relative-position bias, key padding masks, step-wise decoding, devices). A call asks for a
combination; :func:`kernelized_attention` validates the inputs, then either runs the named
backend (raising ``ValueError`` with the backends that *can* do it if it cannot) or, with
``backend="auto"``, the fastest valid one according to the calibration table
(``registry.auto_candidates``: measured crossovers per mode, bias kind, causality and dtype)
that is also accurate: a backend declared exact always is; an approximate one (declared
``error_bound``, e.g. ``fft``) is kept only where its bound for the data, in the dtype it would
compute in, is at most :data:`AUTO_MAX_ERROR` = 1e-4, otherwise ``auto`` takes the next
candidate the table ranks (an exact backend, or the FFT computed in float64, whichever was
measured faster). Where the dense backend would hold a whole ``(B, H, N, N)`` matrix larger than
``registry.AUTO_MAX_NN_BYTES`` (256 MiB; its unblocked form, which ``torch.export`` traces at any
N; eager mode, and ``torch.compile`` beyond small calls, dynamic shapes included, work in
blocks), ``auto`` takes the next candidate too (dense only when
nothing else can run the call).

The work common to every backend happens here, once, in stages of one job each: check
(:func:`_check`, with the checks of ``attention_inputs.py``), prepare (the dtype rule: float32
at least, float64 stays float64, the bias and a state too; key masking: padded keys and their
values zeroed), choose (:func:`_choose`), the non-finite guard
(``kernels_common.guard_non_finite``: in eager mode one sum per tensor and one host sync, and
only when a sum is not finite the isolation of the non-finite rows; the inputs reach the backend
uncopied otherwise), run (:func:`_run`: the backend receives exactly the keyword arguments it
declared at registration, ``takes``, and nothing else) and finish (:func:`_finish`: non-finite
rows, the output dtype, the state). A backend declared ``propagates_non_finite`` (its output is
not finite whenever a real input entry is not) runs before the guard instead: one sum of its
output (and of separate denominator features) answers whether anything was not finite; only
then does the guard run and, when it isolates rows, the backend run again on the isolated inputs
(the first result, and its autograd graph, dropped). While compiling or tracing the
branch-free isolation runs first, as before.

Causal calls carry a state (``initial_state``, ``output_final_state``; see
``state.AttentionState``): prefill, continuation with many new tokens and one-token
decoding are one call. ``auto`` then takes a backend declared ``state``: for a single new token
one declared ``decoding`` (``recurrent``: no per-call set-up), otherwise ``causal_chunked``
(no bias) or ``windowed`` (a bias clipped at K; a state with an unclipped bias would have to
keep every key, so it is refused). A named backend that carries no state runs a call that
starts without one and asks for the final state: the state is folded from the call's keys and
values. Reading a state (``initial_state``) needs a backend declared ``state``.

The sliding-window hybrid (``softmax_window``: exact softmax weights over a window of raw keys,
kernelized beyond) is a capability like the others: only a backend declared ``softmax_window``
(``hybrid``) runs such calls, ``auto`` then picks it, and every other backend refuses them. Its
raw queries and keys go through the same stages (dtype, key masking, the non-finite guard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers.utils import logging

from .attention_inputs import (
    SoftmaxWindow,
    check_clipped_bias,
    check_denominator_features,
    check_grid,
    check_rpe,
    check_softmax_window,
    check_rpe_clip,
    check_state,
    check_state_kind,
    check_tensor,
    normalize_mask,
)
from .builtin_backends import STATE_ARGUMENTS  # noqa: F401  (importing it registers the built-in backends)
from .kernels_common import (
    autocast_disabled, clipped_table, compute_dtype_for, full_bias, guard_non_finite, known_true, manhattan_distances,
    manhattan_table, mask_keys, tracing,
)
from .kernels_dense import dense_attention, materialized_scores
from .registry import _REGISTRY, AUTO_MAX_ERROR, AUTO_MAX_NN_BYTES, auto_candidates, available_backends, get_backend
from .state import AttentionState, StateKind, fold_into_state

logger = logging.get_logger(__name__)


def _auto_precision(candidates, q: torch.Tensor, k: torch.Tensor, full_bias, causal: bool, key_mask, *,
                    table: bool = False, backward: bool = False):
    """``auto``'s accuracy rule over its ranked candidates (``registry.auto_candidates``): the
    first exact one, or the first approximate one (declared ``error_bound``) whose bound for these
    data, in the dtype it would compute in (the input's compute dtype, or float64 where the table
    ranks its float64 variant), meets :data:`AUTO_MAX_ERROR`. So an exact float32 backend is
    preferred to an FFT in float64 wherever the table measured it faster. ``full_bias()`` gives
    the bias in full form for a bound. While compiling, data are not inspected (no host sync):
    only float64 is assumed to meet the target. When no candidate qualifies, the first
    approximate one runs in float64 (in its dtype on MPS, which has no float64). Returns the
    backend's name and the dtype to compute in.

    Memory: the built-in ``dense`` backend is passed over where it would hold a ``(B, H, N, N)``
    matrix of more than :data:`~registry.AUTO_MAX_NN_BYTES` (:func:`_dense_too_large`: its
    unblocked form, which runs at any N while ``torch.export`` traces; ``table``: a bias or causal,
    ``backward``: autograd records); it runs only when no other candidate can run the call (then
    with a warning, outside TorchDynamo's graphs, which cannot log)."""
    dt = compute_dtype_for(q)
    approximate = None
    too_large = None  # dense passed over for its N x N matrix: run only when nothing else can
    for name, want in candidates:
        spec = get_backend(name)
        run_dt = want if want is not None else dt
        if spec.fn is dense_attention and _dense_too_large(q, run_dt, table, backward):
            too_large = too_large or (name, run_dt)
            continue
        if spec.error_bound is None:
            return name, run_dt
        approximate = approximate or name
        if torch.compiler.is_compiling():
            bound = 0.0 if run_dt == torch.float64 else math.inf
        else:
            bound = spec.error_bound(q, k, rpe_bias=full_bias(), causal=causal, key_mask=key_mask, dtype=run_dt)
        if bound <= AUTO_MAX_ERROR:
            return name, run_dt
    if approximate is None and too_large is not None:
        if not torch.compiler.is_dynamo_compiling():
            b, h, n = q.shape[:3]
            logger.warning(
                f"backend='auto': only the dense backend can run this call (B={b}, H={h}, N={n}); it holds a "
                f"(B, H, N, N) matrix here (traced, or a small call), more than AUTO_MAX_NN_BYTES = "
                f"{AUTO_MAX_NN_BYTES} bytes (the largest the traced sizes allow)"
            )
        return too_large
    return approximate, (torch.float64 if q.device.type != "mps" else dt)


def _dense_too_large(q: torch.Tensor, dt: torch.dtype, table: bool, backward: bool) -> bool:
    """Whether ``dense`` computing in ``dt`` would hold a ``(B, H, N, N)`` matrix of more than
    :data:`~registry.AUTO_MAX_NN_BYTES` (``kernels_dense.materialized_scores``); with symbolic
    sizes, unless their declared ranges prove it smaller (no guard is added)."""
    b, h, n = q.shape[:3]
    scores = materialized_scores(b, h, n, table=table, backward=backward)
    if isinstance(scores, int) and scores == 0:
        return False
    return not known_true(scores * dt.itemsize <= AUTO_MAX_NN_BYTES)


def kernelized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False,
    attention_mask: Optional[torch.Tensor] = None,
    grid: Optional[Sequence[int]] = None,
    backend: str = "auto",
    eps: float = 1e-6,
    rpe_clip: Optional[int] = None,
    *,
    q_den: Optional[torch.Tensor] = None,
    k_den: Optional[torch.Tensor] = None,
    initial_state: Optional[AttentionState] = None,
    output_final_state: bool = False,
    in_place: bool = False,
    softmax_window: Optional[SoftmaxWindow] = None,
):
    """Kernelized attention over feature-mapped queries and keys.

    ``out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)``, ``c = exp(rpe_bias)``.

    Args:
        q: ``(B, H, N, M)`` query features (after the feature map).
        k: ``(B, H, N, M)`` key features.
        v: ``(B, H, N, D)`` values.
        rpe_bias: None, ``(H, 2N-1)`` (1D, entry ``r + N - 1`` = offset ``r = j - i``) or, with
            ``grid``, ``(H, 2Hg-1, 2Wg-1)``. With ``rpe_clip = K`` also the clipped table
            ``(H, 2K+1)`` (entry ``r + K``), the form a call with ``initial_state`` needs when
            ``N <= K``; with ``grid`` and ``rpe_clip = K`` also the per-distance table ``(H, K+1)``
            of the clipped Manhattan distance (entry ``d`` holds ``b_d``).
        causal: only keys ``j <= i`` (1D only).
        attention_mask: ``(B, N)``, 1 keep, 0 padding (padded keys contribute nothing).
        grid: ``(Hg, Wg)`` with ``Hg * Wg == N`` for a 2D bias on a row-major token grid.
        backend: ``"auto"`` or a registered name (:func:`available_backends`). ``auto`` picks
            the fastest valid backend whose error meets 1e-4 relative to the values (see
            :data:`AUTO_MAX_ERROR`); a named ``fft`` runs in the input's dtype with the error
            stated in ``kernels_fft.fft_attention``.
        eps: added to the denominator.
        rpe_clip: optional ``K``: declares the 1D bias constant for offsets beyond ``+-K`` (a
            clipped table, as :class:`RelativePositionBias1D` makes). Enables the O(N K)
            ``windowed`` backend; gradients of the clipped region then land on entries ``+-K``
            (the gradient of the table is unchanged). With a 2D bias it declares a bias of the
            clipped Manhattan distance ``min(|dy| + |dx|, K)`` (Horn et al.), which enables the
            O(N K^2) ``manhattan`` backend. Checked in eager mode: a bias that is
            not constant there raises ``ValueError`` (while ``torch.compile`` / ``torch.export``
            trace, the declaration is trusted).
        q_den, k_den: keyword-only, optional ``(B, H, N, M')`` features for the denominator:
            ``out_i = sum_j (q_i . k_j) v_j / (sum_j (q_den_i . k_den_j) + eps)`` (no bias).
            Rotary features rotate ``q`` and ``k`` (signed) and keep the positive ones here.
        initial_state: keyword-only, causal only: the :class:`AttentionState` an earlier call
            returned; the new tokens continue after it (a bias needs ``rpe_clip``).
        output_final_state: keyword-only, causal only: also return the state after these tokens.
            A backend that does not carry a state (not declared ``state``, e.g. ``dense``, ``fft``)
            still runs a call without ``initial_state``: the state is then folded from the call's
            keys and values (O(N M D)); continuing from a state needs a backend declared ``state``.
        in_place: keyword-only: write the state after these tokens into ``initial_state``'s own
            tensors and return them (decoding without allocating a state per token; a one-token
            step of the ``recurrent`` backend without a bias updates them with one fused
            operation each). Needs ``initial_state`` in the compute dtype, ``output_final_state``
            and no autograd recording through the state or the inputs.
        softmax_window: keyword-only, the sliding-window hybrid (``kernels_hybrid.py``): a
            :class:`~attention_inputs.SoftmaxWindow` ``(q, k, window, scale, window_weight,
            linear_weight)`` of the raw queries and keys ``(B, H, N, Dk)``, ``W = window >= 1``,
            the softmax scale (None: ``Dk ** -0.5``) and optional positive per-head mixing weights
            ``(H,)``. Each query then weighs the keys of its window (the last ``W`` when causal,
            ``|j - i| < W`` otherwise) by ``a_h exp(scale q_i . k_j)`` and the others by
            ``b_h phi(q_i) . phi(k_j)``, one numerator and one denominator. Only the ``hybrid``
            backend runs it (``auto`` picks it); no ``rpe_bias`` or ``q_den``/``k_den``. Its
            state also keeps the last ``W - 1`` raw keys, features and values: constant size.
    Returns:
        ``(B, H, N, D)`` in the dtype of ``v``; with ``output_final_state`` ``(out, state)``,
        the state in the compute dtype (float32, or float64 for float64 inputs). Splitting a
        sequence, carrying the state and resuming gives what one call over it gives.

    Empty inputs: a batch of 0 sequences (or 0 heads) gives an empty ``(0, H, N, D)`` result
    (after every other check); ``N = 0``, ``M = 0`` or ``D = 0`` raise ``ValueError``, as does
    an ``eps`` that is negative or not finite.

    Non-finite inputs stay where they are: a NaN/inf in a query, or in the key or value of a
    real position, makes NaN exactly the rows that see it (its own row; when causal the later
    ones; otherwise all), and never an earlier row or a row of another sequence or head, in the
    outputs or their gradients. Through a returned state every row of later calls sees it and is
    non-finite too (NaN; an inf that a one-token step, which isolates nothing, carried into the
    state may stay inf). Padded positions may hold anything.

    Host syncs: the mask values and a clipped bias are checked in eager mode, except in a
    one-token step from a state (decoding), whose mask is used unchecked; the non-finite guard
    reads one sum per input tensor, together (one sync; not in a one-token step from a state),
    or, for a backend declared ``propagates_non_finite`` (``linear``, ``causal_chunked``), one sum
    of its output (and of ``q_den``, ``k_den``) after it ran: only when that is not finite are
    the inputs checked and, if one is not finite, its rows isolated and the backend run again.
    """
    call = _check(q, k, v, rpe_bias, causal, attention_mask, grid, backend, eps, rpe_clip, q_den, k_den,
                  initial_state, output_final_state, in_place, softmax_window)
    q, k, v, q_den, k_den, sw = _prepare(call, compute_dtype_for(q), q, k, v, q_den, k_den)
    chosen = _choose(call, backend, q, k, rpe_bias, output_final_state)
    run = (call, rpe_bias, causal, eps, output_final_state)
    poisoned = bad_key = None
    if call.initial_state is None or call.n > 1:  # a one-token step's only row sees all it reads: nothing to isolate
        first = None
        if chosen[0].propagates_non_finite and call.b and call.h and not tracing() and q.device.type != "meta":
            # the output tells whether the inputs were finite (one sum over it instead of one over each input)
            first = _run(*run, chosen, q, k, v, q_den, k_den, sw)
            if _finite(first[0], q_den, k_den):
                return _finish(call, *first, None, None, call.out_dtype, in_place)
        q, k, v, q_den, k_den, sw, poisoned, bad_key = _guard(call, q, k, v, q_den, k_den, sw, causal)
        if poisoned is None and first is not None:  # nothing to isolate (a non-finite state, an overflow): as run
            return _finish(call, *first, None, None, call.out_dtype, in_place)
        first = None  # a first run's graph is dropped here
        if poisoned is not None and not tracing():  # auto chooses on what the backend will receive
            chosen = _choose(call, backend, q, k, rpe_bias, output_final_state)
    if (call.b == 0 or call.h == 0) and sw is None:
        with autocast_disabled(q.device.type):
            q, k, v, q_den, k_den, sw, state = _in_dtype(call, chosen[1], q, k, v, q_den, k_den, sw)
            return _empty(call, q, k, v, k_den, rpe_bias, state, output_final_state, chosen[1])
    out, state = _run(*run, chosen, q, k, v, q_den, k_den, sw)
    return _finish(call, out, state, poisoned, bad_key, call.out_dtype, in_place)


def _run(call, rpe_bias, causal, eps, output_final_state, chosen, q, k, v, q_den, k_den, sw):
    """Stage 4, run: the chosen backend (``chosen`` from :func:`_choose`) receives exactly the
    keyword arguments it declared (``takes``), in the dtype it computes in, autocast off.
    Returns ``(out, state)`` (state None unless ``output_final_state``; folded from the keys
    and values for a backend that carries none), before :func:`_finish`."""
    spec, dt, fold, full = chosen
    with autocast_disabled(q.device.type):  # the core computes in float32 at least, also under autocast
        q, k, v, q_den, k_den, sw, state = _in_dtype(call, dt, q, k, v, q_den, k_den, sw)
        bias = _bias_for(spec, call, rpe_bias, full, dt)
        given = dict(
            rpe_bias=bias, causal=causal, key_mask=call.key_mask, grid=call.grid, eps=float(eps), rpe_clip=call.rpe_clip,
            q_den=q_den, k_den=k_den, initial_state=state, output_final_state=output_final_state, softmax_window=sw,
        )
        result = spec.fn(q, k, v, **{arg: given[arg] for arg in spec.takes})
        if fold:  # a backend without a state: the final state folded from this call's keys and values
            result = result, fold_into_state(None, k, v, k if k_den is None else k_den, call.window)
    return result if output_final_state else (result, None)


def _finite(out: torch.Tensor, q_den: Optional[torch.Tensor], k_den: Optional[torch.Tensor]) -> bool:
    """Whether the output of a backend declared ``propagates_non_finite`` and the denominator
    features (which it does not cover) are finite: one sum each (a NaN/inf entry, or finite
    entries whose sum overflows, gives a sum that is not finite), read on the host together
    (the call's one sync)."""
    with torch.no_grad():
        flags = torch.stack([torch.isfinite(x.sum()) for x in (out, q_den, k_den) if x is not None])
        return all(flags.tolist())


@dataclass
class _Call:
    """What the checks found out about a call, in normal form."""

    b: int
    h: int
    n: int
    rpe: Optional[str]  # "1d", "2d" or None
    grid: Optional[tuple[int, int]]
    rpe_clip: Optional[int]
    clipped: Optional[torch.Tensor]  # a clipped bias as its table
    window: Optional[int]
    kind: StateKind
    initial_state: Optional[AttentionState]  # as given (its tensors are written when in_place)
    key_mask: Optional[torch.Tensor]
    softmax_window: Optional[SoftmaxWindow]  # checked, in normal form
    request: dict  # what the backend must be able to do (BackendSpec.missing)
    out_dtype: torch.dtype


def _check_tensors(q, k, v, causal, output_final_state, in_place, backend, eps) -> None:
    """Stage 1a: the tensors' shapes, dtypes and devices and the scalar arguments."""
    check_tensor("q", q, 4, "(batch, heads, seq, features)")
    check_tensor("k", k, 4, "(batch, heads, seq, features)")
    check_tensor("v", v, 4, "(batch, heads, seq, head_dim)")
    qs, vs = q.shape, v.shape
    if qs != k.shape:
        raise ValueError(f"q and k must have the same shape (batch, heads, seq, features), got {tuple(qs)} and {tuple(k.shape)}")
    if vs[:3] != qs[:3]:
        raise ValueError(f"v must match q in (batch, heads, seq) = {tuple(qs[:3])}, got {tuple(vs[:3])}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if type(causal) is not bool:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if type(output_final_state) is not bool:
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    if type(in_place) is not bool:
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string: 'auto' or one of {available_backends()}")
    if not valid_eps(eps):
        raise ValueError(f"eps must be a number >= 0 (finite, not NaN), got {eps!r}")
    if qs[2] == 0:
        raise ValueError(f"q, k and v must hold at least one token (seq >= 1), got q of shape {tuple(qs)}")
    if qs[3] == 0:
        raise ValueError(f"q and k must have at least one feature (features >= 1), got shape {tuple(qs)}")
    if vs[3] == 0:
        raise ValueError(f"v must have head_dim >= 1, got shape {tuple(vs)}")


def valid_eps(eps: object) -> bool:
    """``eps`` is a number >= 0, finite (not a bool)."""
    return (type(eps) is float or (isinstance(eps, (int, float)) and not isinstance(eps, bool))) and 0 <= eps < math.inf


def _check_bias(q, rpe_bias, causal, grid, rpe_clip, q_den, stateful, continuing):
    """Stage 1b: the positions (grid, bias, its clipping): ``(rpe, grid, rpe_clip, clipped table)``."""
    h, n = q.shape[1], q.shape[2]
    grid_t = check_grid(grid, n)
    if grid_t is not None and causal:
        raise ValueError("causal=True is only defined for 1D sequences; drop grid or causal")
    rpe_clip = check_rpe_clip(rpe_clip)
    rpe = None
    if rpe_bias is not None:
        rpe = check_rpe(rpe_bias, h, n, grid_t, rpe_clip)
        if rpe_bias.device != q.device:
            raise ValueError(f"rpe_bias must be on the device of q ({q.device}), got {rpe_bias.device}")
    elif grid_t is not None:
        grid_t = None  # a grid without a bias changes nothing
    if rpe_clip is not None:
        check_clipped_bias(rpe_bias, rpe, n, rpe_clip, grid_t)
    if q_den is not None and rpe is not None:
        raise ValueError("separate denominator features (q_den, k_den) cannot be combined with rpe_bias")
    if stateful and rpe is not None and rpe_clip is None:
        raise ValueError(
            "a state with a relative-position bias needs rpe_clip=K (a bias clipped at K): with an unclipped bias "
            "every key keeps its own weight for ever, so no constant-size state exists"
        )
    # a clipped bias as its table; refused when a state must be read K back and the bias does not reach
    return rpe, grid_t, rpe_clip, _clipped_table(rpe_bias, rpe, n, grid_t, rpe_clip, continuing=continuing)


def _check(q, k, v, rpe_bias, causal, attention_mask, grid, backend, eps, rpe_clip, q_den, k_den,
           initial_state, output_final_state, in_place, softmax_window=None) -> _Call:
    """Stage 1, check: every argument (``TypeError`` / ``ValueError`` naming it), in normal form."""
    _check_tensors(q, k, v, causal, output_final_state, in_place, backend, eps)
    b, h, n, m = q.shape
    d = v.shape[-1]
    check_denominator_features(q_den, k_den, q)
    stateful = initial_state is not None or output_final_state
    if stateful and not causal:
        raise ValueError("initial_state / output_final_state need causal=True: only causal attention has a state to carry")
    rpe, grid_t, rpe_clip, clipped = _check_bias(q, rpe_bias, causal, grid, rpe_clip, q_den, stateful,
                                                 initial_state is not None)
    sw = check_softmax_window(softmax_window, q, causal, rpe, q_den, inspect=initial_state is None or n > 1)
    window = max(rpe_clip - 1, 0) if rpe_clip is not None else None
    kind = StateKind(split=q_den is not None, features=m, den_features=m if q_den is None else q_den.shape[-1],
                     values=d, window=window, softmax_window=None if sw is None else sw.window)
    shapes = _state_shapes(kind, b, h, None if sw is None else sw.k.shape[-1])
    given_kind = getattr(initial_state, "kind", None)
    initial_state = check_state(initial_state, shapes, q.device)
    check_state_kind(given_kind, kind)  # what the shapes cannot tell apart (the rotary split has M' = M)
    if in_place:
        _check_in_place(initial_state, output_final_state, compute_dtype_for(q), q, k, v, q_den, k_den, rpe_bias)
    # a one-token step from a state (decoding) reads no mask values: no host sync per token
    key_mask = normalize_mask(attention_mask, b, n, q.device, inspect=initial_state is None or n > 1)
    request = dict(
        causal=causal, rpe=rpe, key_mask=key_mask is not None, device=q.device.type, rpe_clip=rpe_clip,
        state=stateful, split=q_den is not None, window=sw is not None,
    )
    return _Call(b, h, n, rpe, grid_t, rpe_clip, clipped, window, kind, initial_state, key_mask, sw, request, v.dtype)


def _state_shapes(kind: StateKind, b: int, h: int, raw: Optional[int]) -> dict[str, tuple[int, ...]]:
    """The shapes of a state's tensors for a call of this ``kind`` (``raw``: the raw key size of
    the sliding-window hybrid)."""
    m, d = kind.features, kind.values
    shapes = {"kv": (b, h, m, d), "z": (b, h, kind.den_features)}
    if kind.window is not None:
        shapes.update(window_k=(b, h, kind.window, m), window_v=(b, h, kind.window, d))
    if kind.softmax_window is not None:
        keep = kind.softmax_window - 1
        shapes.update(window_k=(b, h, keep, m), window_v=(b, h, keep, d), window_raw=(b, h, keep, raw),
                      window_valid=(b, 1, keep))
    return shapes


def _choose(call: _Call, backend: str, q, k, rpe_bias, output_final_state: bool):
    """Stage 3, choose: the backend (``auto``'s choice or the named one, refused with the
    backends that can when it cannot), the compute dtype, whether the final state is folded
    (a backend without a state) and the full bias when ``auto``'s FFT check made it."""
    request = dict(call.request)
    dt = compute_dtype_for(q)  # the dtype rule
    full = None
    if backend == "auto":
        # forward+backward when autograd records through the inputs: the table ranks each mode
        backward = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, rpe_bias))
        candidates = auto_candidates(n=call.n, **request, backward=backward, dtype=dt, heads=call.h)
        made = []

        def full_bias():  # made at most once, and only for an approximate backend's bound
            if not made:
                made.append(_full_bias(rpe_bias, call.rpe, call.n, call.grid, call.rpe_clip) if call.rpe else None)
            return made[0]

        name, dt = _auto_precision(candidates, q, k, full_bias, request["causal"], call.key_mask,
                                   table=rpe_bias is not None or request["causal"], backward=backward)
        full = made[0] if made else None
    else:
        name = backend
    spec = get_backend(name)
    # A backend that carries no state still runs a call that starts without one: the final state is then folded
    # from this call's keys and values (O(N M D)), so a named backend also serves training and prefill with a state.
    fold = output_final_state and call.initial_state is None and not spec.state
    if fold:
        request["state"] = False
    lacks = spec.missing(**request) if backend != "auto" else ()  # auto's candidates can run the call
    if lacks:
        able = [s.name for s in _REGISTRY.values() if not s.missing(**request)]
        raise ValueError(f"backend {name!r} cannot do {', '.join(lacks)}; backends that can: {able}")
    if backend != "auto" and spec.error_bound is not None and rpe_bias is not None and name not in _WARNED \
            and not tracing() and q.device.type != "meta":
        with torch.no_grad():  # (nothing recorded: a recomputation in the backward need not repeat it)
            bias = _full_bias(rpe_bias.detach(), call.rpe, call.n, call.grid, call.rpe_clip)
            bound = spec.error_bound(q, k, rpe_bias=bias, causal=request["causal"], key_mask=call.key_mask, dtype=dt)
        if bound > NAMED_WARN_ERROR:
            _WARNED.add(name)
            logger.warning(
                f"backend={name!r}: its error bound for these inputs is {bound:.3g} of the values (above "
                f"{NAMED_WARN_ERROR}), a bias spanning {float(bias.max() - bias.min()):.3g} in {dt}: the result may be "
                "wrong. backend='auto' computes such calls exactly (or in float64); float64 inputs run it in float64. "
                "(Said once per backend.)")
    return spec, dt, fold, full


# a named approximate backend (``fft``) whose error bound for a call's data exceeds this (relative to the values)
# is reported once: ``auto`` keeps to AUTO_MAX_ERROR, a named one runs as asked
NAMED_WARN_ERROR = 1e-2
_WARNED: set = set()


def _prepare(call: _Call, dt, q, k, v, q_den, k_den):
    """Stage 2, prepare: the dtype rule (the inputs in the compute dtype ``dt``) and key masking
    (padded keys and their values zeroed, so whatever a padded slot holds reaches nothing, and
    the non-finite guard that follows does not look at it), the raw queries and keys of a
    softmax window alike. No copy when nothing is to do."""
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    k, v = mask_keys(k, v, call.key_mask)
    if q_den is not None:
        q_den = q_den.to(dt)
        k_den = mask_keys(k_den.to(dt), k_den[..., :1], call.key_mask)[0]
    sw = call.softmax_window
    if sw is not None:
        sw = sw._replace(q=sw.q.to(dt), k=mask_keys(sw.k.to(dt), sw.k[..., :1], call.key_mask)[0])
    return q, k, v, q_den, k_den, sw


def _guard(call: _Call, q, k, v, q_den, k_den, sw, causal):
    """The non-finite guard (``kernels_common.guard_non_finite``) over the inputs, the raw
    queries and keys of a softmax window included (on the query and key sides, as separate
    denominator features are: a call has one or the other)."""
    if sw is None:
        q, k, v, q_den, k_den, poisoned, bad_key = guard_non_finite(q, k, v, call.key_mask, causal, q_den, k_den)
        return q, k, v, q_den, k_den, None, poisoned, bad_key
    q, k, v, raw_q, raw_k, poisoned, bad_key = guard_non_finite(q, k, v, call.key_mask, causal, sw.q, sw.k)
    return q, k, v, q_den, k_den, sw._replace(q=raw_q, k=raw_k), poisoned, bad_key


def _in_dtype(call: _Call, dt, q, k, v, q_den, k_den, sw):
    """The inputs (prepared, guarded) and a state in the dtype ``dt`` the chosen backend computes
    in (float64 when ``auto`` runs the FFT in float64; otherwise they already are; a state's
    validity flags stay bool)."""
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if q_den is not None:
        q_den, k_den = q_den.to(dt), k_den.to(dt)
    if sw is not None:
        sw = sw._replace(q=sw.q.to(dt), k=sw.k.to(dt))
    state = call.initial_state
    if state is not None:
        state = AttentionState(*(x if x is None or x.dtype == torch.bool else x.to(dt) for x in state),
                               window_start=state.window_start)
    return q, k, v, q_den, k_den, sw, state


def _empty(call: _Call, q, k, v, k_den, rpe_bias, state, output_final_state, dt):
    """Nothing to attend over (0 sequences or heads): an empty result, attached to every input."""
    attached = q.sum() + k.sum() + (rpe_bias.sum().to(dt) if rpe_bias is not None else 0)
    out = (v * 0 + attached * 0).to(call.out_dtype)
    if not output_final_state:
        return out
    return out, AttentionState(*fold_into_state(state, k, v, k if k_den is None else k_den, call.window), kind=call.kind)


def _bias_for(spec, call: _Call, rpe_bias, full, dt):
    """The bias in the form the backend takes, in ``dt``: a clipped table for a backend that
    takes ``rpe_clip``, the full bias otherwise."""
    if rpe_bias is None:
        return None
    if call.clipped is not None and "rpe_clip" in spec.takes:
        bias = call.clipped
    else:
        bias = full if full is not None else _full_bias(rpe_bias, call.rpe, call.n, call.grid, call.rpe_clip)
    return bias.to(dt)


def _finish(call: _Call, out, state, poisoned, bad_key, out_dtype, in_place):
    """Stage 5, finish: rows that saw a non-finite input made NaN, the output in the dtype of
    ``v``, a state that saw a non-finite key made NaN, written into the given tensors when
    ``in_place``, and recorded with the call's kind (autocast off, as for the backend)."""
    with autocast_disabled(out.device.type):
        return _finish_rows(call, out, state, poisoned, bad_key, out_dtype, in_place)


def _finish_rows(call: _Call, out, state, poisoned, bad_key, out_dtype, in_place):
    nan = torch.full((), math.nan, dtype=out.dtype, device=out.device)
    if poisoned is not None:
        out = torch.where(poisoned[..., None], nan, out)
    out = out.to(out_dtype)
    if state is None:
        return out
    if bad_key is not None:
        # a non-finite real key was replaced by zeros here; every later row sees it, in later calls too
        seen = bad_key[..., None, None]
        state = AttentionState(torch.where(seen, nan, state.kv), torch.where(seen[..., 0], nan, state.z), *state[2:],
                               window_start=state.window_start)
    start = getattr(state, "window_start", 0)  # the hybrid's ring: where its window starts after this call
    if in_place:
        for mine, new in zip(call.initial_state, state):
            if mine is not None and mine is not new:
                mine.copy_(new)
        state = call.initial_state
    return out, AttentionState(*state, kind=call.kind, window_start=start)


def _clipped_table(rpe_bias, rpe, n, grid, rpe_clip, continuing):
    """A bias declared clipped at ``K`` as its table (what a backend taking ``rpe_clip`` gets):
    1D ``(H, 2K+1)``, 2D the per-distance table ``(H, K+1)`` of the clipped Manhattan distance;
    None without ``rpe_clip``."""
    if rpe_clip is None or rpe is None:
        return None
    if rpe == "1d":
        return clipped_table(rpe_bias, n, rpe_clip, continuing=continuing)
    return rpe_bias if rpe_bias.dim() == 2 else manhattan_distances(rpe_bias, grid[0], grid[1], rpe_clip)


def _full_bias(rpe_bias, rpe, n, grid, rpe_clip):
    """The bias as ``(H, 2N-1)`` / ``(H, 2Hg-1, 2Wg-1)`` (from a clipped table when given one)."""
    if rpe == "2d":
        return manhattan_table(rpe_bias, grid[0], grid[1]) if rpe_bias.dim() == 2 else rpe_bias
    return full_bias(rpe_bias, n, rpe_clip)


def _shares_memory(x: torch.Tensor) -> bool:
    """Whether several elements of ``x`` lie at one memory location (a dimension of size > 1
    with stride 0, as ``expand`` makes): such a tensor cannot be written in place."""
    return any(st == 0 and sz > 1 for st, sz in zip(x.stride(), x.shape))


def _check_in_place(state, output_final_state, dt, *inputs) -> None:
    """``ValueError`` unless ``in_place=True`` can write the final state into ``state``."""
    if state is None or not output_final_state:
        raise ValueError("in_place=True needs initial_state and output_final_state=True: it writes the final state "
                         "into initial_state's tensors")
    tensors = [x for x in state if x is not None and x.dtype != torch.bool]  # the hybrid's validity flags stay bool
    if any(x.dtype != dt for x in tensors):
        raise ValueError(f"in_place=True needs initial_state in the compute dtype {dt}, got "
                         f"{sorted({str(x.dtype) for x in tensors})}")
    for name, x in state._asdict().items():
        if x is not None and _shares_memory(x):
            raise ValueError(
                f"in_place=True cannot write into initial_state.{name} of shape {tuple(x.shape)} and strides "
                f"{x.stride()}: it is expanded (a dimension of stride 0, as .expand() makes), so one memory location "
                "holds several of its elements. Pass a state that owns its memory (.contiguous() or .clone() of each "
                "tensor), or in_place=False"
            )
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (*tensors, *inputs)):
        raise ValueError("in_place=True cannot be used while autograd records through the state or the inputs "
                         "(the earlier graph needs the old state): use in_place=False")
