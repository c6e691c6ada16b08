"""Helpers shared by the attention kernels (the ``kernels_*.py`` files).

Every kernel computes, for feature-mapped ``q, k (B, H, N, M)`` and values ``v (B, H, N, D)``::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal), ``c_r = exp(b_r)`` (ones without a bias); a 1D
bias is ``(H, 2N-1)`` (entry ``r + N - 1``), a 2D one on a row-major grid ``(H, 2Hg-1, 2Wg-1)``.
Kernels get inputs of one compute dtype with padded keys zero, and run with autocast off
(:func:`full_precision`) so custom backwards see the dtypes their forwards saved.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch



def autocast_disabled(device_type: str):
    """A context switching ``torch.autocast`` off for ``device_type`` while it is on (else a null
    context)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def full_precision(fn):
    """Run ``fn`` with autocast off for its first tensor argument's device: autocast would run the
    kernels' matmuls in bf16/fp16 and hand custom backwards gradients of another dtype."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tensor is None:
            return fn(*args, **kwargs)
        with autocast_disabled(tensor.device.type):
            return fn(*args, **kwargs)

    return wrapper


_STEP_CONSTANTS: dict = {}  # (value, dtype, device) -> 0-dim tensor (step_constant)


def step_constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a cached 0-dim tensor of ``like``'s dtype and device: a tensor operand costs less
    than a Python number in a decoding step (same result). Not cached while tracing or for a tensor
    subclass (a fake tensor)."""
    key = (value, like.dtype, like.device)
    made = _STEP_CONSTANTS.get(key)
    if made is None:
        with torch.inference_mode(False), torch.no_grad():
            made = torch.full((), value, dtype=like.dtype, device=like.device)
        if tracing() or like.device.type == "meta" or type(made) is not torch.Tensor:  # e.g. a fake tensor
            return made
        _STEP_CONSTANTS[key] = made
    return made


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """The dtype rule: float64 stays float64, everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mask_keys(
    k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero padded keys (after the feature map) and their values: ``k (B, H, N, M)``,
    ``v (B, H, N, D)``, ``key_mask (B, N)`` bool, True = keep."""
    if key_mask is None:
        return k, v
    keep = key_mask[:, None, :, None]
    # where, not multiply: whatever a padded slot holds (even inf/NaN) must not leak in.
    return torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device)), torch.where(
        keep, v, torch.zeros((), dtype=v.dtype, device=v.device)
    )


def isolate_non_finite(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    causal: bool,
    q_den: Optional[torch.Tensor] = None,
    k_den: Optional[torch.Tensor] = None,
    *,
    queries: bool = True,
    keys: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Keep a non-finite input from reaching any row that does not see it, without a host sync.

    Non-finite keys, values, denominator keys and queries are replaced by zeros, as padding is, so
    no algorithm spreads them, forward or backward. The rows that see one (the query's own; rows
    allowed to see the key) are *poisoned*: the caller sets them to NaN. ``queries`` / ``keys``
    False: that side is known finite and passed through uncopied.

    Returns ``(q, k, v, q_den, k_den, poisoned (B, H, N), bad_key (B, H))``, ``bad_key``: a real key
    of that row and head was replaced (a carried state has seen it).
    """
    b, h, n = q.shape[:3]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    seen = bad_key = None
    if keys:
        good = torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1)  # (B, H, N)
        if k_den is not None:
            good = good & torch.isfinite(k_den).all(dim=-1)
            k_den = torch.where(good[..., None], k_den, zero.to(k_den.dtype))
        bad = ~good if key_mask is None else ~good & key_mask[:, None, :]
        seen = bad.cumsum(dim=-1) > 0 if causal else bad.any(dim=-1, keepdim=True).expand_as(bad)
        bad_key = bad.any(dim=-1)
        k = torch.where(good[..., None], k, zero)
        v = torch.where(good[..., None], v, zero.to(v.dtype))
    if queries:
        good_q = torch.isfinite(q).all(dim=-1)
        if q_den is not None:
            good_q = good_q & torch.isfinite(q_den).all(dim=-1)
            q_den = torch.where(good_q[..., None], q_den, zero.to(q_den.dtype))
        q = torch.where(good_q[..., None], q, zero.to(q.dtype))
        seen = ~good_q if seen is None else seen | ~good_q
    if seen is None:
        seen = torch.zeros((b, h, n), dtype=torch.bool, device=q.device)
    if bad_key is None:
        bad_key = torch.zeros((b, h), dtype=torch.bool, device=q.device)
    return q, k, v, q_den, k_den, seen, bad_key


def tracing() -> bool:
    """Whether ``torch.compile`` / ``torch.export`` / ``torch.jit.trace`` is tracing (no data reads)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def guard_non_finite(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    causal: bool,
    q_den: Optional[torch.Tensor] = None,
    k_den: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
           Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`isolate_non_finite` at almost no cost when every input is finite: in eager mode one
    sum per tensor (one host sync), and only a side whose sum is not finite is checked and isolated;
    all finite, the inputs come back as they are with ``poisoned``, ``bad_key`` None. Takes masked
    keys and values in the compute dtype (float16 sums overflow early)."""
    if tracing() or q.device.type == "meta":  # no data to read
        return isolate_non_finite(q, k, v, key_mask, causal, q_den, k_den)
    query_side = (q,) if q_den is None else (q, q_den)
    key_side = (k, v) if k_den is None else (k, v, k_den)
    with torch.no_grad():
        finite = torch.stack([torch.isfinite(x.sum()) for x in query_side + key_side])
        flags = finite.tolist()  # the one host sync
    queries_ok = all(flags[: len(query_side)])
    keys_ok = all(flags[len(query_side):])
    if queries_ok and keys_ok:
        return q, k, v, q_den, k_den, None, None
    return isolate_non_finite(q, k, v, key_mask, causal, q_den, k_den, queries=not queries_ok, keys=not keys_ok)


def relative_offsets(n: int, grid: Optional[Sequence[int]], device) -> tuple[torch.Tensor, ...]:
    """Index tensors into the bias per (query i, key j): ``(idx,)`` ``(N, N)`` in 1D
    (``j - i + N - 1``), ``(iy, ix)`` in 2D."""
    if grid is None:
        pos = torch.arange(n, device=device)
        return (pos[None, :] - pos[:, None] + n - 1,)
    hg, wg = grid
    # row and column of each token in row-major order, by broadcasting (no integer division: this
    # also exports to ONNX with the grid's sides dynamic)
    y = torch.arange(hg, device=device)[:, None].expand(hg, wg).reshape(-1)
    x = torch.arange(wg, device=device)[None, :].expand(hg, wg).reshape(-1)
    return (y[None, :] - y[:, None] + hg - 1, x[None, :] - x[:, None] + wg - 1)


def dense_bias_matrix(rpe_bias: torch.Tensor, n: int, grid: Optional[Sequence[int]]) -> torch.Tensor:
    """``B[h, i, j] = b_{j-i}``: ``(H, N, N)`` from any per-offset table."""
    idx = relative_offsets(n, grid, rpe_bias.device)
    # one flat index into the table and index_select: several times faster, forward and backward
    # (index_add), than advanced indexing with two index tensors (index_put with accumulation)
    flat = idx[0] if grid is None else idx[0] * rpe_bias.shape[-1] + idx[1]
    table = rpe_bias.reshape(rpe_bias.shape[0], -1)
    return table.index_select(1, flat.reshape(-1)).reshape(rpe_bias.shape[0], n, n)


def bias_shift(rpe_bias: torch.Tensor, n: int, causal: bool) -> torch.Tensor:
    """Per-head maximum of the bias over the offsets in use (``r <= 0`` when causal): ``(H,)``,
    detached, 0 where not finite.

    Kernels exponentiate ``b - shift`` (every coefficient <= 1: no overflow) and divide by
    ``den + eps * exp(-shift)``: the shift cancels exactly, so the gradient needs no term for it.
    """
    b = rpe_bias.detach()
    used = b[:, :n] if causal else b.reshape(b.shape[0], -1)
    m = used.amax(dim=-1)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def shifted_eps(eps: float, shift: torch.Tensor) -> torch.Tensor:
    """``eps * exp(-shift)`` per head, clamped to the dtype's normal range (a positive eps never
    becomes 0, so a row without keys gives 0, not 0 / 0)."""
    if eps == 0:
        return torch.zeros_like(shift)
    info = torch.finfo(shift.dtype)
    return (eps * torch.exp(-shift)).clamp(min=info.tiny, max=info.max)


def shifted_bias(rpe_bias: torch.Tensor, n: int, causal: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b - shift, eps * exp(-shift))`` with the per-head :func:`bias_shift`: same shape as
    ``rpe_bias``, and ``(H,)``."""
    shift = bias_shift(rpe_bias, n, causal)
    return rpe_bias - per_head(shift, rpe_bias.dim()), shifted_eps(eps, shift)


def clipped_table(rpe_bias: torch.Tensor, n: int, clip: int, continuing: bool = False) -> torch.Tensor:
    """A bias clipped at ``clip`` (``(H, 2N-1)`` or ``(H, 2K+1)``) as its table ``(H, 2K+1)``.
    ``continuing``: the call reads a state, whose keys lie up to ``K`` back, which a full bias of
    ``N <= K`` tokens does not reach (``ValueError``)."""
    # sizes may be symbolic (torch.export with a dynamic length): the general form below holds for every n
    if known_true(rpe_bias.shape[-1] == 2 * clip + 1):
        return rpe_bias
    if continuing and n - 1 < clip:
        raise ValueError(
            f"with initial_state, rpe_bias must reach offset -rpe_clip={-clip}: pass the clipped table "
            f"(heads, 2*rpe_clip+1) = ({rpe_bias.shape[0]}, {2 * clip + 1}), got {tuple(rpe_bias.shape)}"
        )
    if known_true(n - 1 >= clip):
        return rpe_bias[:, n - 1 - clip : n + clip]
    idx = torch.arange(-clip, clip + 1, device=rpe_bias.device).clamp(-(n - 1), n - 1) + n - 1
    return rpe_bias[:, idx]


def full_bias(rpe_bias: torch.Tensor, n: int, clip: Optional[int]) -> torch.Tensor:
    """A 1D bias as ``(H, 2N-1)``, expanded from a clipped table ``(H, 2K+1)``."""
    if clip is None or known_true(rpe_bias.shape[-1] == 2 * n - 1):
        return rpe_bias
    r = torch.arange(-(n - 1), n, device=rpe_bias.device)
    return rpe_bias[:, r.clamp(-clip, clip) + clip]


def per_head(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``(H,)`` -> ``(H, 1, ...)`` with ``ndim`` dimensions."""
    return x.reshape((x.shape[0],) + (1,) * (ndim - 1))


def chunk_tokens(x: torch.Tensor, c: int) -> torch.Tensor:
    """Zero-pad ``x (B, H, N, F)`` along N to a multiple of ``c``: ``(B, H, N / c, c, F)``."""
    b, h, n, f = x.shape
    pad = (-n) % c
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(b, h, (n + pad) // c, c, f)


def with_ones_column(v: torch.Tensor) -> torch.Tensor:
    """``[v, 1]``: ``(B, H, N, D) -> (B, H, N, D + 1)``: numerator and denominator in one product."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def is_size(value: object) -> bool:
    """A length or grid side: an ``int`` (not ``bool``) or a ``torch.SymInt`` (a dynamic size under
    ``torch.export``, whose range the program's own guards check)."""
    return isinstance(value, torch.SymInt) or (isinstance(value, int) and not isinstance(value, bool))


def known_true(condition: object) -> bool:
    """``condition`` as a ``bool``; a symbolic one is True only when the traced range proves it, and
    adds no guard (which would pin the dynamic size)."""
    if isinstance(condition, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return statically_known_true(condition)
    return bool(condition)


# ----------------------------------------------------------------------------- the clipped Manhattan distance (2D)


def manhattan_index(grid_h: int, grid_w: int, clip: int, device=None) -> torch.Tensor:
    """``(2Hg-1, 2Wg-1)`` long: ``min(|dy| + |dx|, K)`` per 2D offset."""
    dy = torch.arange(-(grid_h - 1), grid_h, device=device).abs()
    dx = torch.arange(-(grid_w - 1), grid_w, device=device).abs()
    return (dy[:, None] + dx[None, :]).clamp(max=clip)


def manhattan_table(distance_bias: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Per-distance bias ``(H, K+1)`` (entry d holds ``b_d``, the last every distance >= K) -> the
    2D bias ``(H, 2Hg-1, 2Wg-1)`` of the clipped Manhattan distance."""
    clip = distance_bias.shape[-1] - 1
    return distance_bias[:, manhattan_index(grid_h, grid_w, clip, distance_bias.device)]


def manhattan_distances(rpe_bias: torch.Tensor, grid_h: int, grid_w: int, clip: int) -> torch.Tensor:
    """The per-distance values ``(H, K+1)`` of a clipped-Manhattan 2D bias, each read at one offset
    (``dy = min(d, Hg-1)``, ``dx = d - dy``); unreachable distances get the farthest reachable one's."""
    reach = (grid_h - 1) + (grid_w - 1)
    d = torch.arange(clip + 1, device=rpe_bias.device).clamp(max=reach)
    dy = d.clamp(max=grid_h - 1)
    return rpe_bias[:, grid_h - 1 + dy, grid_w - 1 + (d - dy)]
