"""The attention backend registry: each backend's declared capabilities, and ``auto``'s choice.

``backend="auto"`` (:func:`auto_candidates`) keeps the backends whose declarations can run a
call and ranks them by N with a calibration table of measured crossovers per kind of call. The
table is data beside the registry (``auto_table.py``, carried by checkpoints); a table measured
by ``hf-kernattn bench calibrate`` loads with ``hf_kernattn.load_auto_table`` or
``HF_KERNATTN_AUTO_TABLE``.
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
        fn: ``fn(q, k, v, **kwargs) -> (B, H, N, D)`` (``(out, AttentionState)`` with
            ``output_final_state=True``), called with exactly the keyword arguments in ``takes``.
        takes: its keyword arguments, among :data:`BACKEND_ARGUMENTS`.
        causal, noncausal: supports ``causal=True`` / ``causal=False``.
        rpe_1d, rpe_2d: supports a 1D bias ``(H, 2N-1)`` / a 2D bias ``(H, 2Hg-1, 2Wg-1)``.
        key_mask: supports padding.
        decoding: a recurrent form: ``auto`` prefers it for one new token from a state, never runs
            it on a sequence.
        state: continues from ``initial_state`` and returns the final state.
        split_denominator: takes ``q_den``, ``k_den``.
        needs_rpe_clip: runs only a bias declared clipped, received as its table (1D ``(H, 2K+1)``,
            2D ``(H, K+1)``).
        softmax_window: runs exactly the calls carrying ``softmax_window``.
        symbolic_n: runs a symbolic N (``torch.export``, dynamic length): no Python loop over N.
        propagates_non_finite: a NaN/inf in ``q``, or in a real key or value, makes some output
            entry NaN/inf, so one sum of the output replaces the input check.
        keeps_inputs: its backward keeps only its inputs, so ``recompute_attention`` saves nothing.
        error_bound: None when exact; else ``error_bound(q, k, *, rpe_bias, causal, key_mask,
            dtype) -> float``, the error relative to the values (``inf`` if unknown).
        devices: device types it runs on.
        complexity: a short note, e.g. ``"O(N)"``.
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
        """No :attr:`error_bound` declared."""
        return self.error_bound is None

    def missing(
        self, *, causal: bool, rpe: Optional[str], key_mask: bool, device: Optional[str], rpe_clip: Optional[int] = None,
        state: bool = False, split: bool = False, window: bool = False,
    ) -> list[str]:
        """What this backend lacks for the call (empty when it can run it); ``device`` None: any."""
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
# bumped by every registration and every table made active: auto's choices change only with it
_AUTO_VERSION = 0


def auto_version() -> tuple:
    """A token that changes whenever ``auto``'s choices may (compared by identity of its items): a
    caller asking the same question per token keeps the answer while it compares equal."""
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

    ``fn`` receives ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` in the compute dtype, padded keys and
    values zero, and the keyword arguments in ``takes`` (default ``rpe_bias, causal, key_mask, grid,
    eps``, plus ``rpe_clip`` with ``needs_rpe_clip``), which must include those its capabilities
    need. It returns ``(B, H, N, D)``, or ``(out, AttentionState)`` when asked for the final state.
    Declare ``propagates_non_finite`` only where it provably holds: ``fn`` then also receives
    non-finite inputs. ``auto`` considers a backend only where the active table ranks it, or where
    no ranked one can run the call.
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
    """Remove the backend ``name`` (nothing if absent)."""
    global _AUTO_VERSION
    if _REGISTRY.pop(name, None) is not None:
        _AUTO_VERSION += 1


def available_backends() -> list[str]:
    """Names of every registered backend (calls also accept ``"auto"``)."""
    return list(_REGISTRY)


def backends_for(
    *, causal: bool, rpe: Optional[str] = None, rpe_clip: Optional[int] = None, split: bool = False, state: bool = False,
    window: bool = False,
) -> list[str]:
    """The registered backends that can run calls of this kind (any device, padded or not): e.g.
    what a model's ``attn_backend`` may be."""
    request = dict(causal=causal, rpe=rpe, key_mask=False, device=None, rpe_clip=rpe_clip, state=state, split=split,
                   window=window)
    return [name for name, spec in _REGISTRY.items() if not spec.missing(**request)]


def get_backend(name: str) -> BackendSpec:
    """The :class:`BackendSpec` registered as ``name``; ``ValueError`` listing known names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {['auto'] + available_backends()}")
    return _REGISTRY[name]


# ----------------------------------------------------------------------------- the automatic choice

# ``auto`` runs an approximate backend only where its error bound, relative to the values, is at most this.
AUTO_MAX_ERROR = 1e-4
# ``auto`` skips dense where its unblocked form (traced, or small fwd+bwd calls) would hold a (B, H, N, N)
# matrix above this many bytes. 256 MiB: about what eager softmax attention keeps per layer for ViT-Base
# (12 heads) at 48 x 48 tokens.
AUTO_MAX_NN_BYTES = 1 << 28
# The kinds of call a calibration table distinguishes.
TABLE_MODES = ("fwd", "fwdbwd")  # fwdbwd: autograd records through q, k or the bias
TABLE_BIASES = ("none", "1d", "2d")
TABLE_DTYPES = ("float32", "float64")  # the compute dtype
# An entry measured at clip K serves calls clipped at K' <= CLIP_REACH * K (nearest K on a log scale);
# beyond, the unclipped entry does.
CLIP_REACH = 2


_ACTIVE_TABLE: Optional[dict[tuple, tuple]] = None
# gives a user's table on the first automatic choice (the package sets it: HF_KERNATTN_AUTO_TABLE)
_TABLE_SOURCE: Optional[Callable[[], Optional[dict]]] = None


def shipped_auto_table() -> dict[tuple, tuple]:
    """The table of ``auto_table.py`` in the form ``auto`` reads: ``{(mode, bias, causal, clip,
    dtype, heads): ((n_max, ((name, dtype or None), ...)), ...)}``."""
    from .auto_table import AUTO_TABLE

    def ranked(names):
        return tuple((name, dtype or None) for name, _, dtype in (item.partition("@") for item in names))

    return {(e["mode"], e["bias"], e["causal"], e["clip"], e["dtype"], e.get("heads", 1)):
            tuple((n_max, ranked(names)) for n_max, names in e["ranking"]) for e in AUTO_TABLE["entries"]}


def activate_auto_table(table: dict[tuple, tuple]) -> dict[tuple, tuple]:
    """Make the checked ``table`` the one ``auto`` reads."""
    global _ACTIVE_TABLE, _AUTO_VERSION
    _ACTIVE_TABLE = table
    _AUTO_VERSION += 1
    return table


def forget_auto_table() -> None:
    """Forget the active table: the next choice reads it again, as a new process does."""
    global _ACTIVE_TABLE, _AUTO_VERSION
    _ACTIVE_TABLE = None
    _AUTO_VERSION += 1


def set_table_source(source: Optional[Callable[[], Optional[dict]]]) -> None:
    """What gives a user's table on the first automatic choice (it activates and returns it, or
    returns None: the shipped table)."""
    global _TABLE_SOURCE
    _TABLE_SOURCE = source


def active_auto_table() -> dict[tuple, tuple]:
    """The table ``auto`` reads (the user's, else the shipped one)."""
    if _ACTIVE_TABLE is None and (_TABLE_SOURCE is None or _TABLE_SOURCE() is None):
        activate_auto_table(shipped_auto_table())
    return _ACTIVE_TABLE


def _smallest(values, key):
    """``min(values, key=key)`` as a loop: TorchDynamo breaks the graph on ``min`` with a ``key``."""
    best = best_key = None
    for value in values:
        k = key(value)
        if best_key is None or k < best_key:
            best, best_key = value, k
    return best


def _nearest_heads(table: dict, kind: tuple, heads: Optional[int]):
    """The ranking of ``kind`` (mode, bias, causal, clip, dtype) measured at the head count nearest
    ``heads`` (log scale; ties and None: the fewer), or None."""
    measured = [key[5] for key in table if key[:5] == kind]
    if not measured:
        return None
    h = heads if type(heads) is int and heads >= 1 else 1
    return table[kind + (_smallest(measured, lambda m: (abs(math.log(h / m)), m)),)]


def _table_ranking(table: dict, mode: str, bias: str, causal: bool, clip: Optional[int], dtype: str,
                   heads: Optional[int] = None):
    """The ranking segments for a kind of call: its mode and dtype's entry (else float32, else the
    other mode); a clipped bias takes the nearest measured K (log scale) while ``K <= CLIP_REACH *``
    the largest, else the unclipped entry; then the nearest head count."""
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
    """The backends ranked for ``n`` tokens; a symbolic ``n``: the first segment its range proves,
    else the last."""
    for n_max, ranked in ranking:
        if n_max is None or known_true(n <= n_max):
            return ranked
    return ()


# auto's candidates per kind of call and N (a dict lookup instead of ranking and capability checks),
# valid for one active table and set of backends (``_AUTO_CACHE_FOR``); cleared when full.
_AUTO_CACHE: dict[tuple, tuple] = {}
_AUTO_CACHE_FOR: tuple = (None, ())
AUTO_CACHE_SIZE = 4096


def auto_candidates(
    *, n: int, causal: bool, rpe: Optional[str], key_mask: bool, device: str, rpe_clip: Optional[int] = None,
    state: bool = False, split: bool = False, backward: bool = False, dtype: torch.dtype = torch.float32,
    window: bool = False,
    heads: Optional[int] = None,
) -> list[tuple[str, Optional[torch.dtype]]]:
    """``auto``'s candidates for a call, best first: ``(name, dtype to compute in or None)``, each
    able to run it; cached per arguments for the active table and registry.

    1. One new token from a state: the backends declared ``decoding``.
    2. The table's ranking for the kind of call (mode, bias, clip, causality, compute dtype, the
       nearest head count) at ``n`` tokens; no ``decoding`` backend for a sequence, no float64 on
       ``mps``. Unranked backends only when no ranked one can run the call.
    3. A symbolic ``n`` (``torch.export``) reads the long-input segment unless its range proves a
       shorter one, among ``symbolic_n`` backends.

    Approximate backends are candidates whatever their error: ``kernelized_attention`` checks it."""
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
    """:func:`auto_candidates` without the cache."""
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
    """``auto``'s first candidate (:func:`auto_candidates`; forward in float32 unless ``backward``
    / ``dtype`` say otherwise), before an approximate backend's accuracy check."""
    return auto_candidates(n=n, causal=causal, rpe=rpe, key_mask=key_mask, device=device, rpe_clip=rpe_clip,
                           state=state, split=split, backward=backward, dtype=dtype, window=window, heads=heads)[0][0]
