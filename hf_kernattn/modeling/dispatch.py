"""The entry point :func:`kernelized_attention`: check -> prepare -> choose -> run -> finish.

Backends declare what they can do at registration (``registry.py``). A named backend that cannot
run a call is refused, naming those that can. ``backend="auto"`` runs the first candidate the
calibration table ranks that is accurate: exact, or approximate (``error_bound``, e.g. ``fft``)
with a bound for the data within :data:`AUTO_MAX_ERROR`; it skips ``dense`` where that would hold
a ``(B, H, N, N)`` matrix above ``registry.AUTO_MAX_NN_BYTES``, unless nothing else can run.

Done here once for every backend: checks (``attention_inputs.py``); the compute dtype (float32
at least, float64 stays); padded keys and values zeroed; the non-finite guard
(``kernels_common.guard_non_finite``); the backend called with exactly its declared ``takes``;
non-finite rows, output dtype and state. A ``propagates_non_finite`` backend runs before the
guard: one sum of its output tells whether the guard and a second run are needed.

Causal calls carry a state (``state.AttentionState``): prefill, continuation and one-token
decoding are one call. A backend without a state serves a call that starts without one: the
final state is folded from its keys and values.
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
    """``auto``'s accuracy rule: ``(name, compute dtype)`` of the first ranked candidate that is
    exact, or approximate with a bound (on ``full_bias()``, in the dtype the table ranks it at) within
    :data:`AUTO_MAX_ERROR`; while compiling only float64 counts as within. Failing all, the first
    approximate one in float64 (MPS: its own dtype). ``dense`` is skipped where
    :func:`_dense_too_large` says so (``table``: a bias or causal; ``backward``: autograd records) and
    runs only when nothing else can (with a warning outside TorchDynamo)."""
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
    """Whether ``dense`` in ``dt`` would hold a ``(B, H, N, N)`` matrix above
    :data:`~registry.AUTO_MAX_NN_BYTES`; symbolic sizes count unless their ranges prove it smaller."""
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
        q, k: ``(B, H, N, M)`` query and key features (after the feature map).
        v: ``(B, H, N, D)`` values.
        rpe_bias: None, ``(H, 2N-1)`` (entry ``r + N - 1`` holds offset ``r = j - i``) or, with
            ``grid``, ``(H, 2Hg-1, 2Wg-1)``. With ``rpe_clip = K`` also the table ``(H, 2K+1)``
            (entry ``r + K``; needed to continue from a state when ``N <= K``) or, with ``grid``,
            the per-distance table ``(H, K+1)``.
        causal: only keys ``j <= i`` (1D only).
        attention_mask: ``(B, N)``, 1 keep, 0 padding.
        grid: ``(Hg, Wg)``, ``Hg * Wg == N``: a 2D bias on a row-major token grid.
        backend: ``"auto"`` (the fastest backend within :data:`AUTO_MAX_ERROR`, 1e-4 of the
            values) or a registered name (:func:`available_backends`; a named ``fft`` computes in
            the input's dtype, error: ``kernels_fft.fft_error_bound``).
        eps: added to the denominator.
        rpe_clip: ``K``: declares the 1D bias constant beyond offsets ``+-K`` (O(N K) ``windowed``;
            gradients of the clipped region land on entries ``+-K``), or the 2D bias a function of
            ``min(|dy| + |dx|, K)`` (Horn et al.; O(N K^2) ``manhattan``). Checked in eager mode.
        q_den, k_den: optional ``(B, H, N, M')`` denominator features:
            ``out_i = sum_j (q_i . k_j) v_j / (sum_j (q_den_i . k_den_j) + eps)`` (no bias); rotary
            features pass their rotated (signed) features as ``q``, ``k`` and the positive ones here.
        initial_state: causal only: the :class:`AttentionState` an earlier call returned; the new
            tokens continue after it (a bias needs ``rpe_clip``).
        output_final_state: causal only: also return the state after these tokens.
        in_place: write the final state into ``initial_state``'s tensors (decoding without an
            allocation per token). Needs ``output_final_state``, a state in the compute dtype and
            no autograd recording through the state or the inputs.
        softmax_window: the sliding-window hybrid (``kernels_hybrid.py``), a
            :class:`~attention_inputs.SoftmaxWindow` of the raw queries and keys: keys in the
            window weigh ``a_h exp(scale q_i . k_j)``, the others ``b_h phi(q_i) . phi(k_j)``, in
            one numerator and denominator. Excludes ``rpe_bias`` and ``q_den``/``k_den``.

    Returns:
        ``(B, H, N, D)`` in the dtype of ``v``; with ``output_final_state`` ``(out, state)``, the
        state in the compute dtype. Splitting a sequence and carrying the state gives what one call
        over it gives.

    Bad arguments raise ``TypeError`` / ``ValueError`` naming them. A NaN/inf in a query, or in a
    real key or value, makes NaN exactly the rows that see it (its own; later ones when causal,
    all otherwise), in outputs and gradients, and every row of later calls through a returned
    state. Host syncs in eager mode: mask values, a clipped bias and one check of the inputs (or
    output) being finite; a one-token step from a state has none.
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
            # one sum over the output instead of one per input
            first = _run(*run, chosen, q, k, v, q_den, k_den, sw)
            if _finite(first[0], q_den, k_den):
                return _finish(call, *first, None, None, call.out_dtype, in_place)
        q, k, v, q_den, k_den, sw, poisoned, bad_key = _guard(call, q, k, v, q_den, k_den, sw, causal)
        if poisoned is None and first is not None:  # nothing to isolate (a non-finite state, an overflow): as run
            return _finish(call, *first, None, None, call.out_dtype, in_place)
        first = None  # drop the first run's graph
        if poisoned is not None and not tracing():  # auto chooses on what the backend will receive
            chosen = _choose(call, backend, q, k, rpe_bias, output_final_state)
    if (call.b == 0 or call.h == 0) and sw is None:
        with autocast_disabled(q.device.type):
            q, k, v, q_den, k_den, sw, state = _in_dtype(call, chosen[1], q, k, v, q_den, k_den, sw)
            return _empty(call, q, k, v, k_den, rpe_bias, state, output_final_state, chosen[1])
    out, state = _run(*run, chosen, q, k, v, q_den, k_den, sw)
    return _finish(call, out, state, poisoned, bad_key, call.out_dtype, in_place)


def _run(call, rpe_bias, causal, eps, output_final_state, chosen, q, k, v, q_den, k_den, sw):
    """Stage 4, run: the chosen backend (:func:`_choose`) with its ``takes`` arguments in its
    compute dtype, autocast off. Returns ``(out, state or None)``, the state folded for a backend
    without one."""
    spec, dt, fold, full = chosen
    with autocast_disabled(q.device.type):
        q, k, v, q_den, k_den, sw, state = _in_dtype(call, dt, q, k, v, q_den, k_den, sw)
        bias = _bias_for(spec, call, rpe_bias, full, dt)
        given = dict(
            rpe_bias=bias, causal=causal, key_mask=call.key_mask, grid=call.grid, eps=float(eps), rpe_clip=call.rpe_clip,
            q_den=q_den, k_den=k_den, initial_state=state, output_final_state=output_final_state, softmax_window=sw,
        )
        result = spec.fn(q, k, v, **{arg: given[arg] for arg in spec.takes})
        if fold:
            result = result, fold_into_state(None, k, v, k if k_den is None else k_den, call.window)
    return result if output_final_state else (result, None)


def _finite(out: torch.Tensor, q_den: Optional[torch.Tensor], k_den: Optional[torch.Tensor]) -> bool:
    """Whether a ``propagates_non_finite`` backend's output and the denominator features (which it
    does not cover) are finite: one sum each, one host sync."""
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
    """``eps`` is a finite number >= 0 (not a bool)."""
    return (type(eps) is float or (isinstance(eps, (int, float)) and not isinstance(eps, bool))) and 0 <= eps < math.inf


def _check_bias(q, rpe_bias, causal, grid, rpe_clip, q_den, stateful, continuing):
    """Stage 1b: grid, bias and clipping: ``(rpe, grid, rpe_clip, clipped table)``."""
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
    """Stage 1, check: every argument, in normal form."""
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
    check_state_kind(given_kind, kind)  # what shapes cannot tell apart (the rotary split has M' = M)
    if in_place:
        _check_in_place(initial_state, output_final_state, compute_dtype_for(q), q, k, v, q_den, k_den, rpe_bias)
    # a one-token step from a state reads no mask values: no host sync per token
    key_mask = normalize_mask(attention_mask, b, n, q.device, inspect=initial_state is None or n > 1)
    request = dict(
        causal=causal, rpe=rpe, key_mask=key_mask is not None, device=q.device.type, rpe_clip=rpe_clip,
        state=stateful, split=q_den is not None, window=sw is not None,
    )
    return _Call(b, h, n, rpe, grid_t, rpe_clip, clipped, window, kind, initial_state, key_mask, sw, request, v.dtype)


def _state_shapes(kind: StateKind, b: int, h: int, raw: Optional[int]) -> dict[str, tuple[int, ...]]:
    """The shapes of a state's tensors for ``kind`` (``raw``: the hybrid's raw key size)."""
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
    """Stage 3, choose: ``(spec, compute dtype, fold the final state?, full bias if auto made
    it)``; a named backend that cannot run the call is refused."""
    request = dict(call.request)
    dt = compute_dtype_for(q)
    full = None
    if backend == "auto":
        # the table ranks forward and forward+backward separately
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
    # a backend without a state serves a call that starts without one: its final state is folded (O(N M D))
    fold = output_final_state and call.initial_state is None and not spec.state
    if fold:
        request["state"] = False
    lacks = spec.missing(**request) if backend != "auto" else ()  # auto's candidates can run the call
    if lacks:
        able = [s.name for s in _REGISTRY.values() if not s.missing(**request)]
        raise ValueError(f"backend {name!r} cannot do {', '.join(lacks)}; backends that can: {able}")
    if backend != "auto" and spec.error_bound is not None and rpe_bias is not None and call.b and call.h \
            and name not in _WARNED \
            and not tracing() and q.device.type != "meta":
        with torch.no_grad():
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


# a named approximate backend whose error bound (relative to the values) exceeds this warns once
NAMED_WARN_ERROR = 1e-2
_WARNED: set = set()


def _prepare(call: _Call, dt, q, k, v, q_den, k_den):
    """Stage 2, prepare: inputs (the softmax window's raw ones too) in ``dt``, padded keys and their
    values zeroed, so the guard never looks at padding; no copy when nothing changes."""
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
    """The non-finite guard over the inputs; the hybrid's raw queries and keys take the place of
    separate denominator features (a call has one or the other)."""
    if sw is None:
        q, k, v, q_den, k_den, poisoned, bad_key = guard_non_finite(q, k, v, call.key_mask, causal, q_den, k_den)
        return q, k, v, q_den, k_den, None, poisoned, bad_key
    q, k, v, raw_q, raw_k, poisoned, bad_key = guard_non_finite(q, k, v, call.key_mask, causal, sw.q, sw.k)
    return q, k, v, q_den, k_den, sw._replace(q=raw_q, k=raw_k), poisoned, bad_key


def _in_dtype(call: _Call, dt, q, k, v, q_den, k_den, sw):
    """Inputs and state in the backend's dtype ``dt`` (float64 when ``auto`` runs the FFT in
    float64); validity flags stay bool."""
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
    """0 sequences or heads: an empty result, attached to every input."""
    attached = q.sum() + k.sum() + (rpe_bias.sum().to(dt) if rpe_bias is not None else 0)
    out = (v * 0 + attached * 0).to(call.out_dtype)
    if not output_final_state:
        return out
    return out, AttentionState(*fold_into_state(state, k, v, k if k_den is None else k_den, call.window), kind=call.kind)


def _bias_for(spec, call: _Call, rpe_bias, full, dt):
    """The bias in the backend's form, in ``dt``: the clipped table if it takes ``rpe_clip``, else
    the full bias."""
    if rpe_bias is None:
        return None
    if call.clipped is not None and "rpe_clip" in spec.takes:
        bias = call.clipped
    else:
        bias = full if full is not None else _full_bias(rpe_bias, call.rpe, call.n, call.grid, call.rpe_clip)
    return bias.to(dt)


def _finish(call: _Call, out, state, poisoned, bad_key, out_dtype, in_place):
    """Stage 5, finish: rows that saw a non-finite input to NaN, the output in ``out_dtype``, a
    state that saw a non-finite key to NaN (written into the given tensors when ``in_place``),
    recorded with the call's kind."""
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
    start = getattr(state, "window_start", 0)  # the hybrid's ring position after this call
    if in_place:
        for mine, new in zip(call.initial_state, state):
            if mine is not None and mine is not new:
                mine.copy_(new)
        state = call.initial_state
    return out, AttentionState(*state, kind=call.kind, window_start=start)


def _clipped_table(rpe_bias, rpe, n, grid, rpe_clip, continuing):
    """A bias clipped at ``K`` as its table (1D ``(H, 2K+1)``, 2D ``(H, K+1)``); None unclipped."""
    if rpe_clip is None or rpe is None:
        return None
    if rpe == "1d":
        return clipped_table(rpe_bias, n, rpe_clip, continuing=continuing)
    return rpe_bias if rpe_bias.dim() == 2 else manhattan_distances(rpe_bias, grid[0], grid[1], rpe_clip)


def _full_bias(rpe_bias, rpe, n, grid, rpe_clip):
    """The bias as ``(H, 2N-1)`` / ``(H, 2Hg-1, 2Wg-1)``, expanded from a clipped table."""
    if rpe == "2d":
        return manhattan_table(rpe_bias, grid[0], grid[1]) if rpe_bias.dim() == 2 else rpe_bias
    return full_bias(rpe_bias, n, rpe_clip)


def _shares_memory(x: torch.Tensor) -> bool:
    """Whether ``x`` has a dimension of size > 1 and stride 0 (``expand``): not writable in place."""
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
