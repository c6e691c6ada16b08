"""Sliding-window hybrid attention: exact softmax weights over a window of recent keys, kernelized beyond.

Formula (``r = j - i``; the window of query ``i`` is ``-W < r <= 0`` when causal, ``|r| < W``
otherwise; a key is allowed when it is not padded and, when causal, ``j <= i``)::

    w_ij = a_h exp(s_ij),  s_ij = scale (q_i . k_j)      allowed j in the window of i
    w_ij = b_h phi(q_i) . phi(k_j)                         every other allowed j
    out_i = sum_j w_ij v_j / (sum_j w_ij + eps)

``q, k`` are the raw (projected) queries and keys, ``phi(q), phi(k)`` their feature-mapped forms,
``a_h, b_h`` optional positive per-head mixing weights (1 when not given). One numerator and one
denominator join both parts (Zhang et al. 2024, LoLCATs).

Stabiliser: with ``m_i = max(0, max_{j in the window} s_ij)`` the numerator, the denominator and
``eps`` are all multiplied by ``exp(-m_i)``: window weights become ``a exp(s - m) <= a``, the
kernelized part ``b exp(-m) phi . phi``. The quotient is unchanged (``m`` carries no gradient, and
none is lost: the function does not depend on it). Window weights underflow only where
``exp(s) << eps`` anyway.

Cost: chunks of ``C`` queries against the keys of their window (rounded out to whole chunks),
plus prefix (and, non-causal, suffix) sums of chunk states ``sum phi(k)^T [v, 1]`` for the keys
beyond: time O(N (C + W) (Dk + M + D) + N M D), memory O(N (C + W) + (N / C) M D): linear in N
for a fixed window.

Causal calls continue from a :class:`HybridState` and return one: the last ``W - 1`` raw keys,
their features, values and a validity flag (padding and the slots before the first token are
invalid), and ``(S, z)`` of every older key. Splitting a sequence, carrying the state and
resuming gives what one call over the whole sequence gives, with constant work and memory per
decoded token.

:func:`hybrid_attention_reference` is the same function written densely with the band mask.

Through ``kernelized_attention``: the feature-mapped ``q, k`` as usual, and the raw queries and
keys, ``W``, the scale and the mixing weights bundled as ``softmax_window=SoftmaxWindow(...)``;
the ``hybrid`` backend (:func:`hybrid_attention`, declared ``softmax_window``) runs such calls,
and its state is an ``AttentionState`` with the window fields of :class:`HybridState`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .attention_inputs import SoftmaxWindow
from .kernels_common import chunk_tokens, full_precision, mask_keys, per_head, with_ones_column
from .registry import register_backend
from .state import AttentionState


class HybridState(NamedTuple):
    """What causal hybrid attention carries from one call to the next.

    Attributes:
        kv: ``S (B, H, M, D)``, ``sum_j phi(k_j)^T v_j`` over the keys older than the window.
        z: ``(B, H, M)``, ``sum_j phi(k_j)`` over the same keys.
        window_k: ``(B, H, W - 1, M)``, features of the most recent keys (oldest first).
        window_v: ``(B, H, W - 1, D)``, their values.
        window_raw: ``(B, H, W - 1, Dk)``, their raw keys (for the exact softmax weights).
        window_valid: ``(B, 1, W - 1)`` bool, False for padding and for slots before the first token.

    The four window tensors are oldest first from a start slot (a ring, see
    ``AttentionState.window_start``; the functions here take the start beside the state).
    """

    kv: torch.Tensor
    z: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    window_raw: torch.Tensor
    window_valid: torch.Tensor


def _mask_padded(k, k_feat, v, key_mask):
    """Raw keys, key features and values of padded positions replaced by zeros
    (``kernels_common.mask_keys``: a NaN in a padded slot reaches neither output nor gradient)."""
    if key_mask is None:
        return k, k_feat, v
    key_mask = key_mask.bool()
    k_feat, v = mask_keys(k_feat, v, key_mask)
    return mask_keys(k, k[..., :1], key_mask)[0], k_feat, v


def _per_head(x: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor | float:
    return 1.0 if x is None else per_head(x.to(like.dtype), 3)  # (H, 1, 1) against (B, H, N, N)


def _band(n_q: int, first_q: int, lo: int, hi: int, window: int, causal: bool, device):
    """Offsets of keys ``[lo, hi)`` from queries at key positions ``first_q ..``: ``(in window,
    causally allowed)`` as ``(Cq, Wb)`` bool masks."""
    r = torch.arange(lo, hi, device=device)[None, :] - torch.arange(first_q, first_q + n_q, device=device)[:, None]
    if causal:
        return (r > -window) & (r <= 0), r <= 0
    return r.abs() < window, None


@full_precision
def hybrid_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    q_feat: torch.Tensor,
    k_feat: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    causal: bool,
    scale: Optional[float] = None,
    key_mask: Optional[torch.Tensor] = None,
    window_weight: Optional[torch.Tensor] = None,
    linear_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    initial_state: Optional[HybridState] = None,
    output_final_state: bool = False,
):
    """Hybrid attention (module docstring) over ``q, k (B, H, N, Dk)``, ``q_feat, k_feat
    (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype; ``window = W >= 1``; ``scale`` defaults to
    ``Dk ** -0.5``; ``key_mask (B, N)`` bool, True for real tokens; ``window_weight`` /
    ``linear_weight`` ``(H,)`` positive mixing weights ``a_h``, ``b_h``. Returns ``(B, H, N, D)``;
    with ``output_final_state`` (causal only) ``(out, HybridState)``, its window oldest first."""
    result = hybrid_window_ring(
        q, k, q_feat, k_feat, v, window=window, causal=causal, scale=scale, key_mask=key_mask,
        window_weight=window_weight, linear_weight=linear_weight, eps=eps, chunk_size=chunk_size,
        initial_state=initial_state, output_final_state=output_final_state)
    if not output_final_state:
        return result
    out, state, start = result
    return out, ordered_window(state, start)


@full_precision
def hybrid_window_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    q_feat: torch.Tensor,
    k_feat: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    causal: bool,
    scale: Optional[float] = None,
    key_mask: Optional[torch.Tensor] = None,
    window_weight: Optional[torch.Tensor] = None,
    linear_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
    initial_state: Optional[HybridState] = None,
    output_final_state: bool = False,
    window_start: int = 0,
):
    """:func:`hybrid_window_attention` with the window as a ring (``window_start``: the slot of
    ``initial_state``'s window that holds its oldest key, see ``AttentionState.window_start``).
    With ``output_final_state`` returns ``(out, HybridState, window_start)``: a one-token step
    writes the new key over the oldest one and advances the start; other calls return the window
    oldest first (start 0)."""
    if not causal and (initial_state is not None or output_final_state):
        raise ValueError("initial_state / output_final_state need causal=True: only causal attention has a state to carry")
    b, h, n, dk = q.shape
    w = int(window)
    scale = dk ** -0.5 if scale is None else float(scale)
    valid = torch.ones(b, 1, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask[:, None, :].bool()
    k, k_feat, v = _mask_padded(k, k_feat, v, key_mask)
    records = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, q_feat, k_feat, v, window_weight, linear_weight,
                                                    *(initial_state or ())))
    if initial_state is not None and n == 1 and not records:  # a decoding step: the window and (S, z) only
        result = _step(q, k, q_feat, k_feat, v, valid, scale, _per_head(window_weight, q), _per_head(linear_weight, q),
                       eps, initial_state, output_final_state, window_start)
        return result if not output_final_state else (result[0], result[1][0], result[1][1])
    initial_state = None if initial_state is None else ordered_window(initial_state, window_start)
    start = 0  # key position of the first query: the state's window goes before the new tokens
    if initial_state is not None:
        start = w - 1
        k = torch.cat([initial_state.window_raw, k], dim=2)
        k_feat = torch.cat([initial_state.window_k, k_feat], dim=2)
        v = torch.cat([initial_state.window_v, v], dim=2)
        valid = torch.cat([initial_state.window_valid, valid], dim=2)
    v1 = with_ones_column(v)
    a_w, b_l = _per_head(window_weight, q), _per_head(linear_weight, q)
    if not isinstance(n, int):  # a symbolic length (export with a dynamic sequence): one block, no loop over N
        out = _whole(q, k, q_feat, k_feat, v1, valid, start, w, causal, scale, a_w, b_l, eps, initial_state)
        return (out, _fold(initial_state, k, k_feat, v, valid, start, w), 0) if output_final_state else out
    nk, c = k.shape[2], max(1, int(chunk_size))
    states = chunk_tokens(k_feat, c).transpose(-1, -2) @ chunk_tokens(v1, c)  # (B, H, nc, M, D+1)
    zero = torch.zeros_like(states[:, :, :1])
    prefix = torch.cat([zero, torch.cumsum(states, dim=2)], dim=2)  # prefix[f]: chunks < f
    if initial_state is not None:
        old = torch.cat([initial_state.kv, initial_state.z[..., None]], dim=-1)[:, :, None]
        prefix = prefix + old
    # inputs cut into chunks once (split / unbind: their backward joins the pieces, instead of one
    # full-size gradient per slice, which would cost O(N^2 / C))
    q_rows, qf_rows = q.split(c, dim=2), q_feat.split(c, dim=2)
    k_cols, kf_cols, v_cols = k.split(c, dim=2), k_feat.split(c, dim=2), v1.split(c, dim=2)
    prefixes = prefix.unbind(dim=2)

    def keys(parts, lo, hi):  # keys [lo, hi) from whole chunks (lo is a chunk boundary)
        return torch.cat(parts[lo // c: -(-hi // c)], dim=2)[:, :, : hi - lo]

    rows = []
    for i, a0 in enumerate(range(0, n, c)):
        a1 = min(a0 + c, n)
        first = start + a0  # key position of the chunk's first query
        lo = max(0, first - w + 1) // c * c
        # keys up to the chunk's last query (causal) or its window's end, rounded up to a chunk (the suffix sums)
        hi = start + a1 if causal else min(nk, -(-(a1 + w - 1) // c) * c)
        inwin, before = _band(a1 - a0, first, lo, hi, w, causal, q.device)
        allowed = valid[:, :, None, lo:hi] if before is None else valid[:, :, None, lo:hi] & before
        win = inwin & allowed
        s = (q_rows[i] @ keys(k_cols, lo, hi).transpose(-1, -2)) * scale
        s_win = s.masked_fill(~win, -torch.inf)
        m = s_win.detach().amax(dim=-1, keepdim=True).clamp_min(0)
        em = torch.exp(-m)
        qf = qf_rows[i]
        lin = (qf @ keys(kf_cols, lo, hi).transpose(-1, -2)).masked_fill(~(allowed & ~inwin), 0)
        weights = a_w * torch.exp(s_win - m) + (b_l * em) * lin
        far = prefixes[lo // c]
        if not causal:
            far = far + prefixes[-1] - prefixes[-(-hi // c)]  # (no state when not causal: prefixes[-1] is every key)
        y = weights @ keys(v_cols, lo, hi) + (b_l * em) * (qf @ far)
        rows.append(y[..., :-1] / (y[..., -1:] + eps * em))
    out = torch.cat(rows, dim=2)
    if not output_final_state:
        return out
    return out, _fold(initial_state, k, k_feat, v, valid, start, w), 0


def _whole(q, k, q_feat, k_feat, v1, valid, start, w, causal, scale, a_w, b_l, eps, state):
    """The chunked form with one chunk of all ``N`` queries against all keys (O(N^2)): what a
    traced program with a symbolic ``N`` runs, the same weights and stabiliser."""
    n, nk = q.shape[2], k.shape[2]
    r = torch.arange(nk, device=q.device)[None, :] - (start + torch.arange(n, device=q.device))[:, None]
    inwin = ((r > -w) & (r <= 0)) if causal else (r.abs() < w)
    allowed = valid[:, :, None, :] & (r <= 0) if causal else valid[:, :, None, :].expand(-1, -1, n, -1)
    s_win = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~(inwin & allowed), -torch.inf)
    m = s_win.detach().amax(dim=-1, keepdim=True).clamp_min(0)
    em = torch.exp(-m)
    lin = (q_feat @ k_feat.transpose(-1, -2)).masked_fill(~(allowed & ~inwin), 0)
    y = (a_w * torch.exp(s_win - m) + (b_l * em) * lin) @ v1
    if state is not None:
        y = y + (b_l * em) * (q_feat @ torch.cat([state.kv, state.z[..., None]], dim=-1))
    return y[..., :-1] / (y[..., -1:] + eps * em)


def _step(q, k, q_feat, k_feat, v, valid, scale, a_w, b_l, eps, state: HybridState, output_final_state,
          window_start: int = 0, in_place: bool = False):
    """One new token from ``state`` (what the chunked form computes for ``N = 1``, with less work):
    exact weights over the window's ``W - 1`` keys and the new one, ``(S, z)`` for every older
    key; then the oldest window key moves into ``(S, z)`` and the new one takes its slot. The
    window is a ring (``window_start``: the slot of the oldest key, see
    ``AttentionState.window_start``), read in slot order and written in one slot: no shift.
    Returns ``out`` and, with ``output_final_state``, ``(HybridState, window_start)`` after the
    token: the state's own tensors written in place with ``in_place``, new ones otherwise (the
    same values). O(W (Dk + D) + M D) per token."""
    keep = state.window_raw.shape[2]
    if keep == 0:  # W = 1: no window, the new key alone gets the exact weight and then leaves
        return _step_alone(q, k, q_feat, k_feat, v, valid, scale, a_w, b_l, eps, state, output_final_state, in_place)
    kv, z, win_k, win_v, win_raw, win_valid = state
    b, h, _, dk = q.shape
    m, d = kv.shape[-2:]
    bh = b * h  # (batched products over (B H): views where the tensors allow, one dispatch each)
    raw_t, win_v3, kv3 = win_raw.reshape(bh, keep, dk).transpose(1, 2), win_v.reshape(bh, keep, d), kv.reshape(bh, m, d)
    q3 = q.reshape(bh, 1, dk)
    # scores of the window's keys (slot order) and of the new one
    s = torch.cat([torch.bmm(q3, raw_t),
                   torch.bmm(q3, k.reshape(bh, dk, 1))], dim=-1).mul_(scale).view(b, h, 1, keep + 1)
    s = s.masked_fill_(torch.cat([win_valid, valid], dim=2).logical_not_().unsqueeze(2), -torch.inf)
    m_ = s.amax(dim=-1, keepdim=True).clamp_min_(0)
    em = m_.neg().exp_()
    p = s.sub_(m_).exp_()
    if not isinstance(a_w, float):
        p = p.mul_(a_w)
    p3 = p.view(bh, 1, keep + 1)
    num = torch.bmm(p3[..., :keep], win_v3).view(b, h, 1, d).addcmul_(p[..., keep:], v)
    den = p.sum(dim=-1, keepdim=True)
    far = em if isinstance(b_l, float) else b_l * em
    qf3 = q_feat.reshape(bh, 1, m)
    num = num.addcmul_(far, torch.bmm(qf3, kv3).view(b, h, 1, d))
    den = den.addcmul_(far, torch.bmm(qf3, z.reshape(bh, m, 1)).view(b, h, 1, 1)).add_(em, alpha=eps)
    out = num.div_(den)
    if not output_final_state:
        return out
    # the oldest key (slot window_start) enters (S, z); the new one takes its slot
    leaving_k, leaving_v = win_k.select(2, window_start), win_v.select(2, window_start)
    outer = (leaving_k.reshape(bh, m, 1), leaving_v.reshape(bh, 1, d))
    start = window_start + 1 if window_start + 1 < keep else 0
    if in_place:
        if kv.is_contiguous():  # kv3 is a view of kv
            kv3.baddbmm_(*outer)
        else:
            kv.copy_(torch.baddbmm(kv3, *outer).view(b, h, m, d))
        z.add_(leaving_k)
        for held, new in ((win_k, k_feat), (win_v, v), (win_raw, k), (win_valid, valid)):
            held.select(2, window_start).copy_(new.select(2, 0))
        return out, (state, start)
    kv, z = torch.baddbmm(kv.reshape(bh, m, d), *outer).view(b, h, m, d), z + leaving_k
    at = dict(dim=2, start=window_start, end=window_start + 1)
    windows = (torch.slice_scatter(held, new, **at) for held, new in ((win_k, k_feat), (win_v, v), (win_raw, k),
                                                                       (win_valid, valid)))
    return out, (HybridState(kv, z, *windows), start)


def _step_alone(q, k, q_feat, k_feat, v, valid, scale, a_w, b_l, eps, state: HybridState, output_final_state,
                in_place):
    """:func:`_step` for ``W = 1``: the new key alone gets the exact weight, then enters ``(S, z)``."""
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~valid[:, :, None, :], -torch.inf)
    m = s.amax(dim=-1, keepdim=True).clamp_min(0)
    em = torch.exp(-m)
    far = torch.cat([state.kv, state.z[..., None]], dim=-1)
    y = (a_w * torch.exp(s - m)) @ with_ones_column(v) + (b_l * em) * (q_feat @ far)
    out = y[..., :-1] / (y[..., -1:] + eps * em)
    if not output_final_state:
        return out
    kv, z = state.kv, state.z
    if in_place:
        kv.add_(k_feat.transpose(-1, -2) @ v)
        z.add_(k_feat[:, :, 0])
        return out, (state, 0)
    return out, (state._replace(kv=kv + k_feat.transpose(-1, -2) @ v, z=z + k_feat[:, :, 0]), 0)


def ordered_window(state: HybridState, window_start: int) -> HybridState:
    """``state`` with its window oldest first (rolled when ``window_start`` is not 0)."""
    if not window_start:
        return state
    return state._replace(**{name: torch.roll(getattr(state, name), -window_start, dims=2)
                             for name in ("window_k", "window_v", "window_raw", "window_valid")})


def _fold(state, k, k_feat, v, valid, start, w) -> HybridState:
    """The state after this call: the last ``W - 1`` keys form the window, older ones (those not
    yet in ``state``'s sums: from key position 0 of this call's key array, which begins with the
    old window) enter ``S`` and ``z``."""
    b, h = k.shape[:2]
    keep = w - 1
    if state is None:  # no earlier window: invalid zero slots before the first token
        pad = (0, 0, keep, 0)
        k, k_feat, v = (torch.nn.functional.pad(x, pad) for x in (k, k_feat, v))
        valid = torch.nn.functional.pad(valid, (keep, 0), value=False)
    leaving = k.shape[2] - keep
    kv = k_feat[:, :, :leaving].transpose(-1, -2) @ v[:, :, :leaving]
    z = k_feat[:, :, :leaving].sum(dim=2)
    if state is not None:
        kv, z = state.kv + kv, state.z + z
    return HybridState(kv, z, k_feat[:, :, leaving:], v[:, :, leaving:], k[:, :, leaving:], valid[:, :, leaving:])


def empty_hybrid_state(b, h, window, dk, m, d, dtype, device) -> HybridState:
    """The state before the first token (every window slot invalid)."""
    keep = window - 1
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    return HybridState(zeros(b, h, m, d), zeros(b, h, m), zeros(b, h, keep, m), zeros(b, h, keep, d),
                       zeros(b, h, keep, dk), torch.zeros(b, 1, keep, dtype=torch.bool, device=device))


def hybrid_attention_reference(
    q, k, q_feat, k_feat, v, *, window, causal, scale=None, key_mask=None, window_weight=None, linear_weight=None,
    eps=1e-6,
):
    """:func:`hybrid_window_attention` written densely (``N x N`` weights with the band mask, no
    stabiliser): the plain reference its tests compare with."""
    b, h, n, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    valid = torch.ones(b, 1, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask[:, None, :].bool()
    k, k_feat, v = _mask_padded(k, k_feat, v, key_mask)
    r = torch.arange(n, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]
    inwin = ((r > -window) & (r <= 0)) if causal else (r.abs() < window)
    allowed = valid[:, :, None, :] & ((r <= 0) if causal else torch.ones_like(inwin))
    exact = torch.exp(q @ k.transpose(-1, -2) * scale)
    kernel = q_feat @ k_feat.transpose(-1, -2)
    a_w, b_l = _per_head(window_weight, q), _per_head(linear_weight, q)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    weights = torch.where(inwin & allowed, a_w * exact, torch.where(allowed, b_l * kernel, zero))
    return (weights @ v) / (weights.sum(dim=-1, keepdim=True) + eps)


def hybrid_attention(q_feat, k_feat, v, *, softmax_window: SoftmaxWindow, causal: bool, key_mask=None, eps: float = 1e-6,
                     initial_state: Optional[AttentionState] = None, output_final_state: bool = False):
    """The ``hybrid`` backend: :func:`hybrid_window_attention` with the feature-mapped ``q, k``
    and ``v`` of ``kernelized_attention`` and the raw queries and keys of ``softmax_window``; its
    state an ``AttentionState`` holding the :class:`HybridState` tensors (same order)."""
    sw = softmax_window
    state = None if initial_state is None else HybridState(*initial_state)
    result = hybrid_window_ring(
        sw.q, sw.k, q_feat, k_feat, v, window=sw.window, causal=causal, scale=sw.scale, key_mask=key_mask,
        window_weight=sw.window_weight, linear_weight=sw.linear_weight, eps=eps, initial_state=state,
        output_final_state=output_final_state, window_start=getattr(initial_state, "window_start", 0),
    )
    if not output_final_state:
        return result
    out, final, start = result
    return out, AttentionState(*final, window_start=start)


register_backend(
    "hybrid", hybrid_attention, takes=("causal", "key_mask", "eps", "softmax_window", "initial_state", "output_final_state"),
    causal=True, noncausal=True, state=True, softmax_window=True, complexity="O(N (C + W) (Dk + M + D) + N M D)",
    description="sliding-window hybrid: exact softmax over a window of W keys, kernelized beyond (softmax_window)",
)
