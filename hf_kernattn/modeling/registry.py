"""The attention backend registry: what each backend declares it can do, and the automatic choice.

Each backend declares at registration what it can do (causal / non-causal, 1D or 2D
relative-position bias, key padding masks, carrying a state, separate denominator features,
step-wise decoding, a softmax window over raw queries and keys, a symbolic length, devices),
whether it is exact or approximate (an ``error_bound``), and which keyword arguments it takes.

``backend="auto"`` (:func:`auto_candidates`, :func:`choose_backend`) reads only those
declarations and data: the declared capabilities filter the backends that can run a call, and a
calibration table of measured crossovers ranks them by N for the kind of call (forward or
forward+backward, no / 1D / 2D bias, clipped at K or not, causal or not, compute dtype). The
table is data beside the registry (``auto_table.py``, so that a checkpoint carries it), measured by
``hf-kernattn bench calibrate``, which also writes a JSON table for the machine it runs on:
load it with ``hf_kernattn.load_auto_table`` or the ``HF_KERNATTN_AUTO_TABLE`` environment variable. The
single entry point that validates a call and dispatches it is ``dispatch.kernelized_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .kernels_common import known_true

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
# The keyword arguments a backend may take (declared at registration as ``takes``).
BACKEND_ARGUMENTS = (
    "rpe_bias", "causal", "key_mask", "grid", "eps", "rpe_clip", "q_den", "k_den", "initial_state", "output_final_state",
    "softmax_window",
)
# What a backend registered without ``takes`` receives (plus ``rpe_clip`` when it needs one).
DEFAULT_TAKES = ("rpe_bias", "causal", "key_mask", "grid", "eps")


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend and its declared capabilities.

    Attributes:
        name: registry key.
        fn: ``fn(q, k, v, **kwargs) -> (B, H, N, D)`` (``(out, AttentionState)`` when called
            with ``output_final_state=True``), called with exactly the keyword arguments named
            in ``takes``.
        takes: the keyword arguments ``fn`` accepts, among :data:`BACKEND_ARGUMENTS`.
        causal: supports ``causal=True``.
        noncausal: supports ``causal=False``.
        rpe_1d: supports a 1D bias ``(H, 2N-1)``.
        rpe_2d: supports a 2D bias on a grid ``(H, 2Hg-1, 2Wg-1)``.
        key_mask: supports an ``attention_mask`` with padding.
        decoding: a step-by-step (recurrent) form: ``backend="auto"`` prefers it for a single
            new token from a state (decoding) and never picks it for a sequence.
        state: continues from ``initial_state`` and returns the final state (causal calls;
            with a bias only a clipped one).
        split_denominator: takes separate denominator features ``q_den``, ``k_den``.
        needs_rpe_clip: only runs a bias declared clipped (``rpe_clip``): a 1D bias constant
            beyond ``+-K``, or a 2D bias of the clipped Manhattan distance. A backend that takes
            ``rpe_clip`` receives a clipped 1D bias as its table ``(H, 2K+1)`` and a clipped 2D
            bias as its per-distance table ``(H, K+1)``.
        softmax_window: runs exactly the calls that carry ``softmax_window`` (exact softmax
            weights over a window of raw queries and keys, kernelized beyond: the sliding-window
            hybrid); every other backend refuses such calls.
        symbolic_n: runs a symbolic N (``torch.export`` with a dynamic sequence or grid: one
            program serves every length): its work does not depend on N through Python loops.
            (Under ``torch.compile``, dynamic shapes included, TorchDynamo shows the sizes to
            Python as ints and guards every comparison made on them: a backend's loops then
            recompile when N leaves the guarded range instead; ``symbolic_n`` does not apply.)
        propagates_non_finite: every NaN/inf entry of ``q``, ``k`` or ``v`` at a real position (a
            query anywhere, a key or value not padded) makes at least one entry of its output
            NaN/inf, so that the output alone tells whether the inputs were finite: the entry
            point then runs the backend first and checks its output with one sum (one read of
            the output instead of one of each input), isolating non-finite rows and running it
            again only when the output is not finite (separate denominator features are still
            summed: an inf there can vanish in a division). False when unknown.
        keeps_inputs: its backward pass needs only its inputs (and the bias table): it keeps no
            intermediate of size N x N or N x M x D for it, so recomputing it in the backward
            pass (the models' ``recompute_attention``) would save no memory; the models then run
            it once. False when unknown.
        error_bound: None for a backend exact up to ordinary floating-point summation; for an
            approximate one, ``error_bound(q, k, *, rpe_bias, causal, key_mask, dtype) -> float``,
            a bound on its error relative to the values when computed in ``dtype`` (``inf`` when
            none is known). ``auto`` runs it only where that bound meets :data:`AUTO_MAX_ERROR`.
        devices: device types it runs on.
        complexity: a short note for docs and error messages, e.g. ``"O(N)"``.
        description: one line for ``hf-kernattn backends``.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    takes: tuple[str, ...] = DEFAULT_TAKES
    causal: bool = False
    noncausal: bool = True
    rpe_1d: bool = False
    rpe_2d: bool = False
    key_mask: bool = True
    decoding: bool = False
    state: bool = False
    split_denominator: bool = False
    needs_rpe_clip: bool = False
    softmax_window: bool = False
    symbolic_n: bool = False
    error_bound: Optional[Callable[..., float]] = None
    devices: tuple[str, ...] = DEVICE_TYPES
    complexity: str = ""
    description: str = ""
    propagates_non_finite: bool = False
    keeps_inputs: bool = False

    @property
    def exact(self) -> bool:
        """Exact up to ordinary floating-point summation (no :attr:`error_bound` declared)."""
        return self.error_bound is None

    def missing(
        self, *, causal: bool, rpe: Optional[str], key_mask: bool, device: Optional[str], rpe_clip: Optional[int] = None,
        state: bool = False, split: bool = False, window: bool = False,
    ) -> list[str]:
        """What this backend lacks for the requested call (empty when it can do it); ``device``
        None: on any device."""
        lacks = []
        if state and not self.state:
            lacks.append("a state (initial_state / output_final_state)")
        if split and not self.split_denominator:
            lacks.append("separate denominator features (q_den, k_den)")
        if window and not self.softmax_window:
            lacks.append("a softmax window (softmax_window)")
        if self.softmax_window and not window:
            lacks.append("calls without softmax_window")
        if self.needs_rpe_clip and (rpe is None or rpe_clip is None):
            kind = "1D " if self.rpe_1d and not self.rpe_2d else "2D " if self.rpe_2d and not self.rpe_1d else ""
            lacks.append(f"calls without a {kind}rpe_bias declared clipped by rpe_clip")
        if causal and not self.causal:
            lacks.append("causal=True")
        if not causal and not self.noncausal:
            lacks.append("causal=False")
        if rpe == "1d" and not self.rpe_1d:
            lacks.append("a 1D rpe_bias")
        if rpe == "2d" and not self.rpe_2d:
            lacks.append("a 2D rpe_bias (grid)")
        if key_mask and not self.key_mask:
            lacks.append("attention_mask with padding")
        if device is not None and device not in self.devices:
            lacks.append(f"device {device!r}")
        return lacks


_REGISTRY: dict[str, BackendSpec] = {}
# bumped by every registration and every table made active (load_auto_table, the environment's table read on
# the first automatic choice): what auto chooses can change only with it (see auto_version)
_AUTO_VERSION = 0


def auto_version() -> tuple:
    """A token that changes whenever ``auto``'s choices may: a backend registered (or replaced),
    another table made active, or the registry or table replaced as objects. A caller that asks
    ``auto`` the same question repeatedly (a decoding step, per token) keeps the answer while the
    token compares equal (identity of its items). Removing an entry from the private registry
    dict by hand does not change it (:func:`auto_candidates` itself compares the entries)."""
    return (_AUTO_VERSION, _REGISTRY, _ACTIVE_TABLE)


def register_backend(
    name: str,
    fn: Callable[..., torch.Tensor],
    *,
    causal: bool = False,
    noncausal: bool = True,
    rpe_1d: bool = False,
    rpe_2d: bool = False,
    key_mask: bool = True,
    decoding: bool = False,
    state: bool = False,
    split_denominator: bool = False,
    needs_rpe_clip: bool = False,
    softmax_window: bool = False,
    symbolic_n: bool = False,
    error_bound: Optional[Callable[..., float]] = None,
    devices: Sequence[str] = DEVICE_TYPES,
    complexity: str = "",
    description: str = "",
    overwrite: bool = False,
    propagates_non_finite: bool = False,
    keeps_inputs: bool = False,
    takes: Optional[Sequence[str]] = None,
) -> BackendSpec:
    """Register an attention backend under ``name`` with its declared capabilities.

    ``fn`` receives feature-mapped ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` in the compute
    dtype (float32 at least; float64 stays float64), padded keys and their values already zero,
    and the keyword arguments named in ``takes`` (default ``rpe_bias, causal, key_mask ((B, N)
    bool or None), grid, eps``, plus ``rpe_clip`` when ``needs_rpe_clip``); it returns
    ``(B, H, N, D)``. A backend declared ``state`` takes ``initial_state`` (an
    ``AttentionState`` in the compute dtype, or None) and ``output_final_state`` and then returns
    ``(out, AttentionState)``; one declared ``split_denominator`` takes ``q_den``, ``k_den``
    (None, or features for the denominator); one declared ``softmax_window`` takes
    ``softmax_window`` (a ``kernels_hybrid.SoftmaxWindow`` of the raw queries and keys, in the
    compute dtype, padded raw keys zero). Raises ``ValueError`` if the name is taken (unless
    ``overwrite``) or ``auto``, or if ``takes`` names an unknown argument or lacks one a declared
    capability needs (``causal`` for a backend that runs both causal and non-causal calls,
    ``rpe_bias`` for a bias, ``grid`` for a 2D bias, ``rpe_clip`` with ``needs_rpe_clip``,
    ``initial_state`` and ``output_final_state`` with ``state``, ``q_den`` and ``k_den`` with
    ``split_denominator``, ``softmax_window`` with ``softmax_window``); ``TypeError`` if ``fn`` or a given ``error_bound`` is not callable.

    ``propagates_non_finite=True`` (see :class:`BackendSpec`) lets the entry point run ``fn``
    before checking the inputs and check its output instead (cheaper by the inputs' size);
    ``fn`` then also receives non-finite inputs. Declare it only for a backend whose output is
    provably not finite whenever a real entry of ``q``, ``k`` or ``v`` is not: otherwise a
    non-finite input could pass unisolated.

    ``backend="auto"`` considers a backend only where the calibration table ranks it (see
    :func:`choose_backend`; a table measured on your machine with ``hf-kernattn bench calibrate``
    ranks every registered backend that can run each measured kind of call), or where no ranked
    backend can run the call; by name it is always usable.
    """
    global _AUTO_VERSION
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if error_bound is not None and not callable(error_bound):
        raise TypeError(f"error_bound must be None or callable, got {type(error_bound).__name__}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"backend {name!r} is already registered; pass overwrite=True to replace it")
    unknown = [d for d in devices if d not in DEVICE_TYPES]
    if unknown:
        raise ValueError(f"devices must be among {list(DEVICE_TYPES)}, got {unknown}")
    if takes is None:
        takes = DEFAULT_TAKES + (("rpe_clip",) if needs_rpe_clip else ())
    takes = tuple(takes)
    unknown = [a for a in takes if a not in BACKEND_ARGUMENTS]
    if unknown:
        raise ValueError(f"takes must name arguments among {list(BACKEND_ARGUMENTS)}, got {unknown}")
    needed = {
        "causal": causal and noncausal, "rpe_bias": rpe_1d or rpe_2d, "grid": rpe_2d, "rpe_clip": needs_rpe_clip,
        "initial_state": state, "output_final_state": state, "q_den": split_denominator, "k_den": split_denominator,
        "softmax_window": softmax_window,
    }
    lacking = [a for a, need in needed.items() if need and a not in takes]
    if lacking:
        raise ValueError(f"takes must include {lacking} for the declared capabilities of backend {name!r}")
    spec = BackendSpec(
        name=name,
        fn=fn,
        takes=takes,
        causal=causal,
        noncausal=noncausal,
        rpe_1d=rpe_1d,
        rpe_2d=rpe_2d,
        key_mask=key_mask,
        decoding=decoding,
        state=state,
        split_denominator=split_denominator,
        needs_rpe_clip=needs_rpe_clip,
        softmax_window=bool(softmax_window),
        symbolic_n=bool(symbolic_n),
        error_bound=error_bound,
        devices=tuple(devices),
        complexity=complexity,
        description=description,
        propagates_non_finite=bool(propagates_non_finite),
        keeps_inputs=bool(keeps_inputs),
    )
    _REGISTRY[name] = spec
    _AUTO_VERSION += 1
    return spec


def unregister_backend(name: str) -> None:
    """Remove the backend registered as ``name`` (no error when there is none); ``auto``'s
    choices are made afresh."""
    global _AUTO_VERSION
    if _REGISTRY.pop(name, None) is not None:
        _AUTO_VERSION += 1


def available_backends() -> list[str]:
    """Names of every registered backend (``"auto"`` is also accepted by the calls)."""
    return list(_REGISTRY)


def backends_for(
    *, causal: bool, rpe: Optional[str] = None, rpe_clip: Optional[int] = None, split: bool = False, state: bool = False,
    window: bool = False,
) -> list[str]:
    """Names of the registered backends that can run calls of this kind (on some device, padded
    or not): e.g. what a model's configured ``attn_backend`` may be."""
    request = dict(causal=causal, rpe=rpe, key_mask=False, device=None, rpe_clip=rpe_clip, state=state, split=split,
                   window=window)
    return [name for name, spec in _REGISTRY.items() if not spec.missing(**request)]


def get_backend(name: str) -> BackendSpec:
    """The :class:`BackendSpec` registered as ``name``; ``ValueError`` listing known names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {['auto'] + available_backends()}")
    return _REGISTRY[name]


# ----------------------------------------------------------------------------- the automatic choice

# ``auto`` runs an approximate backend (one declaring ``error_bound``) only where its bound,
# relative to the values, is at most this in the dtype it would compute in.
AUTO_MAX_ERROR = 1e-4
AUTO_FFT_MAX_ERROR = AUTO_MAX_ERROR  # the former name
# ``auto`` skips the dense backend where it would hold a (B, H, N, N) matrix of more than this many
# bytes (its unblocked form, which torch.export and torch.jit.trace trace at any N: their graphs
# cannot hold the blocks' Python loops; under torch.compile, dynamic shapes included, TorchDynamo
# shows sizes as guarded ints and large calls run blocked outside the graph): the next candidate the table
# ranks runs instead. 256 MiB: about what eager softmax attention keeps per layer for ViT-Base (12
# heads) at 48 x 48 tokens.
AUTO_MAX_NN_BYTES = 1 << 28
# The kinds of call a calibration table distinguishes.
TABLE_MODES = ("fwd", "fwdbwd")  # forward only; forward and backward (autograd records through q, k or the bias)
TABLE_BIASES = ("none", "1d", "2d")
TABLE_DTYPES = ("float32", "float64")  # the compute dtype
# An entry measured with a bias clipped at K serves calls clipped at K' <= CLIP_REACH * K (the
# entry of the nearest measured K, on a log scale); beyond it the unclipped entry serves them.
CLIP_REACH = 2


_ACTIVE_TABLE: Optional[dict[tuple, tuple]] = None
# what gives a user's table on the first automatic choice (the package sets it: HF_KERNATTN_AUTO_TABLE)
_TABLE_SOURCE: Optional[Callable[[], Optional[dict]]] = None


def shipped_auto_table() -> dict[tuple, tuple]:
    """The table shipped in ``auto_table.py``, in the form ``auto`` reads: ``{(mode, bias, causal,
    clip, dtype, heads): ((n_max, ((name, dtype or None), ...)), ...)}`` (checked by the package's
    tests and ``hf_kernattn.auto_tables.check_auto_table``)."""
    from .auto_table import AUTO_TABLE

    def ranked(names):
        return tuple((name, dtype or None) for name, _, dtype in (item.partition("@") for item in names))

    return {(e["mode"], e["bias"], e["causal"], e["clip"], e["dtype"], e.get("heads", 1)):
            tuple((n_max, ranked(names)) for n_max, names in e["ranking"]) for e in AUTO_TABLE["entries"]}


def activate_auto_table(table: dict[tuple, tuple]) -> dict[tuple, tuple]:
    """Make ``table`` (a checked table) the one ``auto`` reads; ``auto`` chooses afresh."""
    global _ACTIVE_TABLE, _AUTO_VERSION
    _ACTIVE_TABLE = table
    _AUTO_VERSION += 1
    return table


def forget_auto_table() -> None:
    """Forget the active table: the next automatic choice reads it again as a new process does (a
    user's table, ``HF_KERNATTN_AUTO_TABLE`` where the package is imported, or the shipped one)."""
    global _ACTIVE_TABLE, _AUTO_VERSION
    _ACTIVE_TABLE = None
    _AUTO_VERSION += 1


def set_table_source(source: Optional[Callable[[], Optional[dict]]]) -> None:
    """What gives a user's table on the first automatic choice (it activates it and returns it, or
    returns None: the shipped table)."""
    global _TABLE_SOURCE
    _TABLE_SOURCE = source


def active_auto_table() -> dict[tuple, tuple]:
    """The table ``auto`` reads (the shipped one, overlaid by a user's)."""
    if _ACTIVE_TABLE is None and (_TABLE_SOURCE is None or _TABLE_SOURCE() is None):
        activate_auto_table(shipped_auto_table())
    return _ACTIVE_TABLE


def _smallest(values, key):
    """``min(values, key=key)`` written as a loop: TorchDynamo (``torch.compile``, where ``auto``
    chooses inside the graph) does not trace ``min`` with a ``key``, and would break the graph."""
    best = best_key = None
    for value in values:
        k = key(value)
        if best_key is None or k < best_key:
            best, best_key = value, k
    return best


def _nearest_heads(table: dict, kind: tuple, heads: Optional[int]):
    """The ranking of ``kind`` (mode, bias, causal, clip, dtype) measured at the head count
    nearest to ``heads`` (log scale; a tie or ``heads`` None: the fewer), or None."""
    measured = [key[5] for key in table if key[:5] == kind]
    if not measured:
        return None
    h = heads if type(heads) is int and heads >= 1 else 1
    return table[kind + (_smallest(measured, lambda m: (abs(math.log(h / m)), m)),)]


def _table_ranking(table: dict, mode: str, bias: str, causal: bool, clip: Optional[int], dtype: str,
                   heads: Optional[int] = None):
    """The ranking segments for a kind of call: the entry of its mode and compute dtype (else
    float32, else the other mode); a clipped bias takes the entry of the nearest measured K
    (log scale) while ``K <= CLIP_REACH *`` the largest one, the unclipped entry otherwise; of
    those, the one measured at the head count nearest to ``heads``."""
    modes = (mode,) + tuple(m for m in TABLE_MODES if m != mode)
    for dt in dict.fromkeys((dtype, "float32")):
        for md in modes:
            if clip is not None:
                measured = [key[3] for key in table if key[:3] == (md, bias, causal) and key[4] == dt and key[3] is not None]
                if measured and clip <= CLIP_REACH * max(measured):
                    nearest = _smallest(measured, lambda c: (abs(math.log((clip + 1) / (c + 1))), c))
                    return _nearest_heads(table, (md, bias, causal, nearest, dt), heads)
            found = _nearest_heads(table, (md, bias, causal, None, dt), heads)
            if found is not None:
                return found
    return ()


def _segment(ranking, n) -> tuple:
    """The backends ranked for ``n`` tokens; a symbolic ``n``: the first segment its declared
    range proves, else the last (long inputs)."""
    for n_max, ranked in ranking:
        if n_max is None or known_true(n <= n_max):
            return ranked
    return ()


# auto's candidates per kind of call and N, valid for one active table and one set of registered
# backends (``_AUTO_CACHE_FOR``): a call whose kind was seen costs a dict lookup instead of the
# table's ranking and the capability checks. Cleared when another table becomes active
# (``load_auto_table``, ``HF_KERNATTN_AUTO_TABLE`` read on the first choice) or a backend is
# registered, replaced or removed; bounded (cleared when full).
_AUTO_CACHE: dict[tuple, tuple] = {}
_AUTO_CACHE_FOR: tuple = (None, ())
AUTO_CACHE_SIZE = 4096


def auto_candidates(
    *, n: int, causal: bool, rpe: Optional[str], key_mask: bool, device: str, rpe_clip: Optional[int] = None,
    state: bool = False, split: bool = False, backward: bool = False, dtype: torch.dtype = torch.float32,
    window: bool = False,
    heads: Optional[int] = None,
) -> list[tuple[str, Optional[torch.dtype]]]:
    """``auto``'s candidates for a call, best first: ``(name, dtype to compute in, or None for
    the compute dtype)``. Every candidate can run the call (its declared capabilities).
    The answer is cached per kind of call and ``n`` (every argument here) for the active table
    and the registered backends: loading a table or registering a backend starts afresh.

    1. One new token from a state (decoding): the backends declared ``decoding`` first.
    2. The calibration table's ranking (:func:`active_auto_table`) for the kind of call: mode
       (``backward``: forward+backward), bias (none / 1D / 2D, clipped at ``rpe_clip`` or not),
       causality and compute dtype, measured at the head count nearest to ``heads`` (None: the
       fewest measured), at ``n`` tokens; backends declared ``decoding`` never for a
       sequence, float64 variants not on ``mps``. A backend the table does not rank is not
       considered, unless no ranked one can run the call: then every able backend, in the order
       of registration (those declared ``decoding`` last).
    3. A symbolic ``n`` (``torch.export`` with a dynamic sequence or grid: one program serves
       every length) reads the segment for long inputs unless the declared range of lengths
       proves a shorter one, among backends declared ``symbolic_n`` (no Python loops whose count
       depends on N: ``fft``, ``windowed`` and ``causal_chunked`` walk blocks). Under
       ``torch.compile``, dynamic shapes included, ``n`` arrives as an int (TorchDynamo guards
       the comparisons made on it): the choice is made as for static sizes and holds while N
       stays in the guarded range (a recompile beyond).

    An approximate backend (declared ``error_bound``) is a candidate here whatever its error:
    ``kernelized_attention`` runs the first candidate whose bound for the data meets
    :data:`AUTO_MAX_ERROR` (an exact one always does)."""
    global _AUTO_CACHE_FOR
    if type(n) is not int or (heads is not None and type(heads) is not int) or torch.compiler.is_compiling():
        # a symbolic length or head count, or tracing: no cache
        return _auto_candidates(active_auto_table(), n, causal, rpe, key_mask, device, rpe_clip, state, split,
                                backward, dtype, heads, window)
    table = _ACTIVE_TABLE if _ACTIVE_TABLE is not None else active_auto_table()
    specs = tuple(_REGISTRY.values())
    valid_for = _AUTO_CACHE_FOR
    if valid_for[0] is not table or valid_for[1] != specs:  # another table or other backends
        _AUTO_CACHE.clear()
        _AUTO_CACHE_FOR = (table, specs)
    key = (n, causal, rpe, key_mask, device, rpe_clip, state, split, backward, dtype, heads, window)
    found = _AUTO_CACHE.get(key)
    if found is None:
        found = tuple(_auto_candidates(table, n, causal, rpe, key_mask, device, rpe_clip, state, split, backward, dtype,
                                       heads, window))
        if len(_AUTO_CACHE) >= AUTO_CACHE_SIZE:
            _AUTO_CACHE.clear()
        _AUTO_CACHE[key] = found
    return list(found)


def _auto_candidates(table, n, causal, rpe, key_mask, device, rpe_clip, state, split, backward, dtype, heads=None,
                     window=False):
    """:func:`auto_candidates` without the cache, from ``table`` (the checked form)."""
    symbolic = isinstance(n, torch.SymInt)
    request = dict(causal=causal, rpe=rpe, key_mask=key_mask, device=device, rpe_clip=rpe_clip, state=state, split=split,
                   window=window)

    def able(spec: Optional[BackendSpec]) -> bool:
        return spec is not None and not spec.missing(**request)

    out: list[tuple[str, Optional[torch.dtype]]] = []
    if state and known_true(n == 1):
        out += [(name, None) for name, spec in _REGISTRY.items() if spec.decoding and able(spec)]
    clip = rpe_clip
    if clip is not None and rpe == "1d" and not symbolic:
        clip = min(clip, n - 1)  # offsets beyond N - 1 never occur
    mode = TABLE_MODES[1] if backward else TABLE_MODES[0]
    kind_dtype = "float64" if dtype == torch.float64 else "float32"
    ranking = _table_ranking(table, mode, rpe or "none", causal, clip if rpe else None, kind_dtype,
                             heads if type(heads) is int else None)
    for name, want in _segment(ranking, n):
        spec = _REGISTRY.get(name)
        want_dt = None if want is None else getattr(torch, want)
        if not able(spec) or spec.decoding or (symbolic and not spec.symbolic_n):
            continue
        if want_dt == torch.float64 and device == "mps":  # MPS has no float64
            continue
        if (name, want_dt) not in out:
            out.append((name, want_dt))
    if not out:  # nothing ranked can run it: every able backend, whole-sequence forms first
        specs = sorted(_REGISTRY.values(), key=lambda s: s.decoding)
        out = [(spec.name, None) for spec in specs if able(spec)]
    if not out:
        raise ValueError("no registered backend can run this call")
    return out


def choose_backend(
    *, n: int, causal: bool, rpe: Optional[str], key_mask: bool, device: str, rpe_clip: Optional[int] = None,
    state: bool = False, split: bool = False, backward: bool = False, dtype: torch.dtype = torch.float32,
    window: bool = False,
    heads: Optional[int] = None,
) -> str:
    """The backend ``auto`` ranks first for the request (:func:`auto_candidates`; a forward call
    in float32 unless ``backward`` / ``dtype`` say otherwise; ``heads``: the call's head count),
    before the accuracy check of an
    approximate backend, which reads the data (``kernelized_attention`` then may take the next
    candidate)."""
    return auto_candidates(n=n, causal=causal, rpe=rpe, key_mask=key_mask, device=device, rpe_clip=rpe_clip,
                           state=state, split=split, backward=backward, dtype=dtype, window=window, heads=heads)[0][0]
