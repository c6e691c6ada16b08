"""The attention backend registry: what each backend declares it can do, and the automatic choice.

Each backend declares at registration what it can do (causal / non-causal, 1D or 2D
relative-position bias, key padding masks, carrying a state, separate denominator features,
step-wise decoding, devices) and which keyword arguments it takes; :func:`choose_backend` is the
``backend="auto"`` rule, from crossovers measured by ``hf-kernattn bench attention``. The single
entry point that validates a call and dispatches it is ``dispatch.kernelized_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .kernels_common import known_true

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
# The keyword arguments a backend may take (declared at registration as ``takes``).
BACKEND_ARGUMENTS = (
    "rpe_bias", "causal", "key_mask", "grid", "eps", "rpe_clip", "q_den", "k_den", "initial_state", "output_final_state",
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
    devices: tuple[str, ...] = DEVICE_TYPES
    complexity: str = ""
    description: str = ""

    def missing(
        self, *, causal: bool, rpe: Optional[str], key_mask: bool, device: Optional[str], rpe_clip: Optional[int] = None,
        state: bool = False, split: bool = False,
    ) -> list[str]:
        """What this backend lacks for the requested call (empty when it can do it); ``device``
        None: on any device."""
        lacks = []
        if state and not self.state:
            lacks.append("a state (initial_state / output_final_state)")
        if split and not self.split_denominator:
            lacks.append("separate denominator features (q_den, k_den)")
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
    devices: Sequence[str] = DEVICE_TYPES,
    complexity: str = "",
    description: str = "",
    overwrite: bool = False,
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
    (None, or features for the denominator). Raises ``ValueError`` if the name is taken (unless
    ``overwrite``) or ``auto``, or if ``takes`` names an unknown argument or lacks one a declared
    capability needs (``causal`` for a backend that runs both causal and non-causal calls,
    ``rpe_bias`` for a bias, ``grid`` for a 2D bias, ``rpe_clip`` with ``needs_rpe_clip``,
    ``initial_state`` and ``output_final_state`` with ``state``, ``q_den`` and ``k_den`` with
    ``split_denominator``); ``TypeError`` if ``fn`` is not callable.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
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
        devices=tuple(devices),
        complexity=complexity,
        description=description,
    )
    _REGISTRY[name] = spec
    return spec


def available_backends() -> list[str]:
    """Names of every registered backend (``"auto"`` is also accepted by the calls)."""
    return list(_REGISTRY)


def backends_for(
    *, causal: bool, rpe: Optional[str] = None, rpe_clip: Optional[int] = None, split: bool = False, state: bool = False
) -> list[str]:
    """Names of the registered backends that can run calls of this kind (on some device, padded
    or not): e.g. what a model's configured ``attn_backend`` may be."""
    request = dict(causal=causal, rpe=rpe, key_mask=False, device=None, rpe_clip=rpe_clip, state=state, split=split)
    return [name for name, spec in _REGISTRY.items() if not spec.missing(**request)]


def get_backend(name: str) -> BackendSpec:
    """The :class:`BackendSpec` registered as ``name``; ``ValueError`` listing known names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {['auto'] + available_backends()}")
    return _REGISTRY[name]


# Crossovers measured with `hf-kernattn bench attention --crossover` on a 2-core CPU
# (M = D = 64, batch 1, one head, float32, N in 32..1024): up to these N the quadratic dense
# form was faster than the O(N) / O(N log N) forms. Measured: linear beats dense from N = 48
# (1.01x; 12x at N = 1024); causal_chunked from N = 256 (1.08x; 6x at 1024); fft with a bias
# was still 4.7x slower than dense at N = 1024 (its crossover lies above the measured range),
# so "rpe" is capped at 1024, where dense's N x N matrices are still small.
AUTO_DENSE_MAX_N = {"plain": 32, "causal": 192, "rpe": 1024}
# With a bias clipped at K (rpe_clip) the windowed backend, O(N (2K + C)), is chosen once
# N >= AUTO_WINDOWED_MIN_N and N >= AUTO_WINDOWED_MIN_RATIO * K. Forward+backward, 12 heads,
# M = D = 64, float32, 2 CPU threads: at K = 512 windowed/dense took 0.030/0.040 s at N = 512,
# 0.075/0.256 at 1024, 0.165/1.108 at 2048; below N = 512 dense was faster (0.39-0.89x at
# N = 128-256 for K = 16 and 512). Against fft it was 2.5-10x faster for N = 1k-16k, K = 128-512.
AUTO_WINDOWED_MIN_N = 512
AUTO_WINDOWED_MIN_RATIO = 2
# ``auto`` runs the fft backend in the input's compute dtype only where its error bound
# (:func:`fft_error_bound`, relative to the values) is at most this; otherwise it takes the exact
# ``windowed`` backend for a clipped bias, or the FFT computed in float64.
AUTO_FFT_MAX_ERROR = 1e-4
# With a 2D bias of the clipped Manhattan distance (rpe_clip with a grid) the manhattan backend,
# O(N K^2), is chosen once the grid has at least this many tokens (below, dense is cheap).
AUTO_MANHATTAN_MIN_N = 256


def choose_backend(
    *, n: int, causal: bool, rpe: Optional[str], key_mask: bool, device: str, rpe_clip: Optional[int] = None,
    state: bool = False, split: bool = False,
) -> str:
    """The fastest backend valid for the request (see :data:`AUTO_DENSE_MAX_N`; a call with a
    state: see the module docstring).

    A symbolic ``n`` (``torch.export`` with a dynamic sequence or grid: one program serves every
    length) takes the choice for long inputs unless the declared range of lengths proves a short
    one, among the backends whose work does not depend on N through Python loops (``fft``,
    ``windowed`` and ``causal_chunked`` walk blocks whose number depends on N): ``linear`` (no
    bias), ``manhattan`` (a clipped 2D bias), ``dense`` otherwise (exact, O(N^2))."""
    symbolic = isinstance(n, torch.SymInt)

    def at_least(bound: int) -> bool:  # n >= bound; a symbolic n: unless its range proves n < bound
        return not known_true(n < bound) if symbolic else n >= bound

    request = dict(causal=causal, rpe=rpe, key_mask=key_mask, device=device, rpe_clip=rpe_clip, state=state, split=split)
    decoders = [name for name, spec in _REGISTRY.items() if spec.decoding]
    if state:
        preferred = "windowed" if rpe is not None else "causal_chunked"
        order = decoders + [preferred] if known_true(n == 1) else [preferred]
    elif rpe == "1d" and rpe_clip is not None and not symbolic and n >= max(AUTO_WINDOWED_MIN_N, AUTO_WINDOWED_MIN_RATIO * rpe_clip):
        order = ["windowed"]
    elif rpe == "2d" and rpe_clip is not None and at_least(AUTO_MANHATTAN_MIN_N):
        order = ["manhattan"]
    else:
        if rpe is not None:
            preferred, limit = "fft", AUTO_DENSE_MAX_N["rpe"]
        elif causal:
            preferred, limit = "causal_chunked", AUTO_DENSE_MAX_N["causal"]
        else:
            preferred, limit = "linear", AUTO_DENSE_MAX_N["plain"]
        order = ["dense", preferred] if not at_least(limit + 1) or (symbolic and preferred != "linear") else [preferred, "dense"]
    order += [name for name in _REGISTRY if name not in order and name not in decoders]
    for name in order:
        spec = _REGISTRY.get(name)
        if spec is not None and not spec.missing(**request):
            return name
    able = [name for name, spec in _REGISTRY.items() if not spec.missing(**request)]
    if able:  # only step-by-step forms can do it
        return able[0]
    raise ValueError("no registered backend can run this call")
