"""Linear attention without a position-dependent weight: non-causal, causal chunked, recurrent.

``out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)`` with ``c = 1``
factors through ``S = sum_j k_j^T v_j (M x D)`` and ``z = sum_j k_j (M)``:
``out_i = q_i S / (q_i . z + eps)``, over all keys or, causal, ``j <= i`` (running sums).

* :func:`linear_attention`: non-causal; time O(N M D), memory O(N (M + D) + M D).
* :func:`causal_chunked_attention` (readable form: :func:`causal_linear_sums`): exact ``C x C``
  blocks within chunks of ``C`` tokens plus the earlier chunks' state; time
  O(N C (M + D) + N M D), memory O(N (M + D) + (N / C) M D).
* :func:`recurrent_step` / :func:`recurrent_attention`: one token at a time, O(M D) per token;
  with a 1D bias clipped at K also the last K - 1 keys, O(K (M + D) + M D); with an unclipped
  one O(t (M + D)) at step t, no state.

Causal forms continue from and return an :class:`~state.AttentionState`: split, carry, resume
equals one call. ``q_den``, ``k_den`` give the denominator its own features,
``sum_j (q_i . k_j) v_j / (sum_j (q_den_i . k_den_j) + eps)`` (rotary: signed numerator,
positive denominator). Inputs as in ``kernels_common``: one dtype, padded keys and values zero.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels_common import chunk_tokens, clipped_table, full_precision, shifted_bias
from .state import AttentionState, fold_into_state


class _Linear(torch.autograd.Function):
    """``out = q (k^T v) / (q_den . sum_j k_den_j + eps)``; the backward keeps the inputs, the
    ``M x D`` sums, the denominator and the output (not autograd's ``N x D`` numerator). With
    ``g = d out / r`` and ``dr = -rowsum(d out * out) / r``::

        dQ = g S^T,  dS = Q^T g,  dK = V dS^T,  dV = K dS,  dQd = dr z^T,  dKd = 1 (Qd^T dr)^T
    """

    @staticmethod
    def forward(ctx, q, k, v, q_den, k_den, eps):  # type: ignore[override]
        split = q_den is not None
        if not split:
            q_den, k_den = q, k
        kv = k.transpose(-1, -2) @ v  # (B, H, M, D)
        z = k_den.sum(dim=-2)  # (B, H, M')
        r = (q_den @ z[..., None]).add_(eps)  # (B, H, N, 1)
        out = (q @ kv).div_(r)
        ctx.split = split
        ctx.save_for_backward(q, k, v, q_den if split else None, k_den if split else None, kv, z, r, out)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, k, v, q_den, k_den, kv, z, r, out = ctx.saved_tensors
        if not ctx.split:
            q_den = q
        g = torch.mul(d_out, out)  # one N x D buffer: first for dr, then g
        dr = g.sum(dim=-1, keepdim=True).div_(r).neg_()  # (B, H, N, 1)
        torch.div(d_out, r, out=g)
        d_kv = q.transpose(-1, -2) @ g  # (B, H, M, D)
        dq = g @ kv.transpose(-1, -2)
        dk = v @ d_kv.transpose(-1, -2)
        dv = k @ d_kv
        dk_den = (q_den.transpose(-1, -2) @ dr).transpose(-1, -2)  # (B, H, 1, M'): the same for every key
        if ctx.split:
            return dq, dk, dv, dr * z[:, :, None, :], dk_den.expand(-1, -1, k.shape[2], -1).contiguous(), None
        return dq.addcmul_(dr, z[:, :, None, :]), dk.add_(dk_den), dv, None, None, None


@full_precision
def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float = 1e-6,
    q_den: Optional[torch.Tensor] = None, k_den: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Non-causal: ``q (k^T v) / (q_den . sum_j k_den_j + eps)`` (``q_den, k_den`` default
    ``q, k``); ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` -> ``(B, H, N, D)``."""
    return _Linear.apply(q, k, v, q_den, k_den, float(eps))


@full_precision
def causal_linear_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Unnormalised causal sums ``Y_i = sum_{j <= i} (q_i . k_j) v_j`` by chunks (the readable form
    of :class:`_CausalChunked`'s numerator): ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` ->
    ``(B, H, N, D)``."""
    n, d = q.shape[2], v.shape[-1]
    c = max(1, min(chunk_size, n))
    qc, kc, vc = chunk_tokens(q, c), chunk_tokens(k, c), chunk_tokens(v, c)
    chunk_states = kc.transpose(-1, -2) @ vc  # (B, H, nc, M, D)
    prefix = torch.cumsum(chunk_states, dim=2) - chunk_states  # states of strictly earlier chunks
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(tri, qc @ kc.transpose(-1, -2), torch.zeros((), dtype=q.dtype, device=q.device))
    y = qc @ prefix + scores @ vc  # (B, H, nc, C, D)
    return y.reshape(q.shape[0], q.shape[1], -1, d)[:, :, :n]


def _chunk_prefix_(x: torch.Tensor, initial: Optional[torch.Tensor] = None, reverse: bool = False) -> torch.Tensor:
    """Exclusive running sums over dim 2 of ``x (B, H, nc, ...)``, in place: entry ``c`` becomes
    ``initial + sum_{c' < c} x_c'`` (``reverse``: ``sum_{c' > c} x_c'``). One chunk at a time:
    ``cumsum`` over a middle dim is several times slower here, and a copy would double the
    kernel's largest tensor."""
    nc = x.shape[2]
    if nc == 0:
        return x
    running = torch.zeros_like(x[:, :, 0]) if initial is None else initial.clone()
    for c in (range(nc - 1, -1, -1) if reverse else range(nc)):
        entry = x[:, :, c]
        here = entry.clone()
        entry.copy_(running)
        running += here
    return x


class _CausalChunked(torch.autograd.Function):
    """``out = causal(q k^T) v / (causal(q_den k_den^T) 1 + eps)`` by chunks; the backward keeps
    the inputs, the output, the denominator and ``A_c``, ``P_c``, ``Z_c``.

    Per chunk ``c`` of ``C`` tokens (``A_c = tril(Q_c K_c^T)``, ``S_c = K_c^T V_c``,
    ``P_c = S_0 + sum_{c' < c} S_c'``, likewise ``Z_c = z_0 + sum_{c' < c} 1^T Kd_c'`` for the
    denominator keys)::

        Y_c = Q_c P_c + A_c V_c,   r_c = rowsum(tril(Qd_c Kd_c^T)) + Qd_c Z_c + eps,   out_c = Y_c / r_c

    Backward with ``g = d out / r``, ``dr = -rowsum(d out * out) / r``, ``G_c = sum_{c' > c}
    Q_c'^T g_c'`` and ``F_c = sum_{c' > c} Qd_c'^T dr_c'`` (what later chunks read of chunk
    ``c``'s keys)::

        dA_c = tril(g_c V_c^T) (+ tril(dr_c 1^T) when the denominator shares q, k)
        dQ_c = g_c P_c^T + dA_c K_c + dr_c Z_c      dK_c = dA_c^T Q_c + V_c G_c^T + 1 F_c
        dV_c = A_c^T g_c + K_c G_c                  dS_0 = sum_c Q_c^T g_c,  dz_0 = sum_c Qd_c^T dr_c

    (with separate denominator features the ``dr`` terms go to ``q_den``, ``k_den`` through
    their own ``tril(dr_c 1^T)``).
    """

    @staticmethod
    def forward(ctx, q, k, v, q_den, k_den, s0, z0, eps, c):  # type: ignore[override]
        n = q.shape[2]
        qc, kc, vc = chunk_tokens(q, c), chunk_tokens(k, c), chunk_tokens(v, c)
        split = q_den is not None
        qdc, kdc = (chunk_tokens(q_den, c), chunk_tokens(k_den, c)) if split else (qc, kc)
        a = (qc @ kc.transpose(-1, -2)).tril_()
        prefix = _chunk_prefix_(kc.transpose(-1, -2) @ vc, s0)
        z = _chunk_prefix_(kdc.sum(dim=3), z0)  # (B, H, nc, M')
        ad = (qdc @ kdc.transpose(-1, -2)).tril_() if split else a
        r = ad.sum(dim=-1).add_((qdc @ z[..., None])[..., 0]).add_(eps)  # (B, H, nc, C)
        y = (qc @ prefix).add_(a @ vc).div_(r[..., None])
        ctx.c, ctx.n, ctx.split = c, n, split
        ctx.save_for_backward(q, k, v, q_den, k_den, y, r, a, prefix, z)
        b, h = q.shape[:2]
        return y.reshape(b, h, -1, v.shape[-1])[:, :, :n]

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, k, v, q_den, k_den, out, r, a, prefix, z = ctx.saved_tensors
        c, n, split = ctx.c, ctx.n, ctx.split
        b, h = q.shape[:2]
        qc, kc, vc = chunk_tokens(q, c), chunk_tokens(k, c), chunk_tokens(v, c)
        qdc, kdc = (chunk_tokens(q_den, c), chunk_tokens(k_den, c)) if split else (qc, kc)
        d_out = chunk_tokens(d_out.contiguous(), c)
        g = torch.mul(d_out, out)  # one N x D buffer: first for dr, then g
        dr = g.sum(dim=-1).div_(r).neg_()  # (B, H, nc, C)
        torch.div(d_out, r[..., None], out=g)
        later = qc.transpose(-1, -2) @ g  # Q_c^T g_c (B, H, nc, M, D), then G_c in place
        ds0 = later.sum(dim=2) if ctx.needs_input_grad[5] else None
        _chunk_prefix_(later, reverse=True)
        later_z = (qdc.transpose(-1, -2) @ dr[..., None])[..., 0]  # (B, H, nc, M'), then F_c
        dz0 = later_z.sum(dim=2) if ctx.needs_input_grad[6] else None
        _chunk_prefix_(later_z, reverse=True)
        da = g @ vc.transpose(-1, -2)
        if not split:
            da.add_(dr[..., None])
        da.tril_()
        dq = (g @ prefix.transpose(-1, -2)).add_(da @ kc)
        dk = (da.transpose(-1, -2) @ qc).add_(vc @ later.transpose(-1, -2))
        dv = (a.transpose(-1, -2) @ g).add_(kc @ later)
        if split:
            dad = dr[..., None].expand(*dr.shape, c).tril()
            dqd = (dad @ kdc).addcmul_(dr[..., None], z[:, :, :, None])
            dkd = (dad.transpose(-1, -2) @ qdc).add_(later_z[:, :, :, None])
        else:
            dq.addcmul_(dr[..., None], z[:, :, :, None])
            dk.add_(later_z[:, :, :, None])

        def unchunk(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(b, h, -1, x.shape[-1])[:, :, :n]

        grads = (unchunk(dq), unchunk(dk), unchunk(dv)) + ((unchunk(dqd), unchunk(dkd)) if split else (None, None))
        return (*grads, ds0, dz0, None, None)


@full_precision
def causal_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    eps: float = 1e-6,
    chunk_size: int = 64,
    q_den: Optional[torch.Tensor] = None,
    k_den: Optional[torch.Tensor] = None,
    initial_state: Optional[AttentionState] = None,
    output_final_state: bool = False,
):
    """Causal linear attention by chunks (:class:`_CausalChunked`; denominator over ``q_den,
    k_den``, default ``q, k``). ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` -> ``(B, H, N, D)``, with
    ``output_final_state`` ``(out, AttentionState)``; ``initial_state``: ``(S, z)`` of earlier
    tokens, read by every query (``q S``, ``q_den . z``)."""
    c = max(1, min(chunk_size, q.shape[2]))
    s0 = z0 = None
    if initial_state is not None:
        s0, z0 = initial_state.kv, initial_state.z
    out = _CausalChunked.apply(q, k, v, q_den, k_den, s0, z0, float(eps), c)
    if not output_final_state:
        return out
    return out, fold_into_state(initial_state, k, v, k if k_den is None else k_den)


def recurrent_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: torch.Tensor,
    normalizer: torch.Tensor,
    eps: float = 1e-6,
    q_den_t: Optional[torch.Tensor] = None,
    k_den_t: Optional[torch.Tensor] = None,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One RNN step: ``S' = S + k^T v``, ``z' = z + k_den``, ``out = q S' / (q_den . z' + eps)``,
    batched over the ``B H`` rows. O(M D).

    ``q_t, k_t (B, H, M)``, ``v_t (B, H, D)`` (or ``(B, H, 1, .)``); ``state`` S ``(B, H, M, D)``,
    ``normalizer`` z ``(B, H, M')``; ``q_den_t, k_den_t (B, H, M')`` (default ``q_t, k_t``).
    ``in_place``: write ``S'``, ``z'`` into the given tensors (decoding, no autograd); the same
    operations, the same bits. Returns ``(out_t, S', z')``, ``out_t`` shaped like ``v_t``.
    """
    b, h, m, d = state.shape
    k_den_t = k_t if k_den_t is None else k_den_t
    k_col, v_row = k_t.reshape(b, h, m, 1), v_t.reshape(b, h, 1, d)
    k_den_t = k_den_t.reshape(normalizer.shape)
    if in_place:
        state, normalizer = state.addcmul_(k_col, v_row), normalizer.add_(k_den_t)
    else:
        state, normalizer = torch.addcmul(state, k_col, v_row), normalizer + k_den_t
    q3 = q_t.reshape(b * h, 1, m)
    q_den3 = q3 if q_den_t is None else q_den_t.reshape(b * h, 1, -1)
    num = torch.bmm(q3, state.reshape(b * h, m, d))
    out = num.div_(torch.bmm(q_den3, normalizer.reshape(b * h, -1, 1)).add_(eps))
    return out.view(v_t.shape), state, normalizer


@full_precision
def recurrent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: Optional[torch.Tensor] = None,
    rpe_clip: Optional[int] = None,
    eps: float = 1e-6,
    q_den: Optional[torch.Tensor] = None,
    k_den: Optional[torch.Tensor] = None,
    initial_state: Optional[AttentionState] = None,
    output_final_state: bool = False,
):
    """Causal attention as an RNN, one token at a time: ``(B, H, N, D)``, with
    ``output_final_state`` ``(out, AttentionState)``.

    Without a bias it carries ``(S, z)``. With a bias clipped at ``K = rpe_clip`` (``rpe_bias``
    the table ``(H, 2K+1)``, entry ``r + K``, or ``(H, 2N-1)``) step ``t`` reads the ``K - 1``
    keys before it with ``c_{-(K-1)} .. c_{-1}``, its own with ``c_0`` and ``(S, z)`` with
    ``c_{-K}``, then moves the oldest window key into ``(S, z)``. Unclipped: no state, each step
    re-reads the past.
    """
    if rpe_bias is not None and q_den is not None:
        raise ValueError("separate denominator features (q_den, k_den) cannot be combined with rpe_bias")
    if rpe_bias is not None and rpe_clip is None:
        if initial_state is not None or output_final_state:
            raise ValueError("a state with an unclipped 1D bias does not exist: pass rpe_clip=K for a bias clipped at K")
        return _recurrent_full_bias(q, k, v, rpe_bias, eps)
    outs = []
    if rpe_bias is None:
        b, h, _, m = q.shape
        state, norm = (initial_state.kv, initial_state.z) if initial_state is not None else (None, None)
        if state is None:
            state = q.new_zeros(b, h, m, v.shape[-1])
            norm = q.new_zeros(b, h, m if k_den is None else k_den.shape[-1])
        for t in range(q.shape[2]):
            den_t = (None, None) if q_den is None else (q_den[:, :, t], k_den[:, :, t])
            o, state, norm = recurrent_step(q[:, :, t], k[:, :, t], v[:, :, t], state, norm, eps, *den_t)
            outs.append(o)
        out = torch.stack(outs, dim=2)
        return (out, AttentionState(state, norm)) if output_final_state else out
    # a bias clipped at K: the window [window_k, k] and the far sums (S, z)
    big_k = int(rpe_clip)
    window = max(big_k - 1, 0)
    rpe_bias = clipped_table(rpe_bias, q.shape[2], big_k, continuing=initial_state is not None)
    bias, eps_h = shifted_bias(rpe_bias, big_k + 1, True, eps)  # (H, 2K+1), entry r + K
    c = torch.exp(bias)
    eps_h = eps_h[None, :, None]  # (1, H, 1)
    c_far = c[:, 0][None, :, None]  # c_{-K}: (1, H, 1)
    w = c[:, big_k - window : big_k + 1][None]  # offsets -(K-1)..0: (1, H, K)
    if initial_state is None:
        initial_state = fold_into_state(None, k[:, :, :0], v[:, :, :0], k[:, :, :0], window)
    keys = torch.cat([initial_state.window_k, k], dim=2)  # key t of this call is keys[window + t]
    vals = torch.cat([initial_state.window_v, v], dim=2)
    s_far, z_far = initial_state.kv, initial_state.z
    for t in range(q.shape[2]):
        q_t = q[:, :, t]
        scores = (keys[:, :, t : t + window + 1] @ q_t[..., None])[..., 0] * w  # (B, H, K)
        num = (scores[..., None] * vals[:, :, t : t + window + 1]).sum(dim=2) + c_far * (q_t[:, :, None, :] @ s_far)[:, :, 0]
        den = scores.sum(dim=-1, keepdim=True) + c_far * (q_t * z_far).sum(dim=-1, keepdim=True)
        outs.append(num / (den + eps_h))
        if t < q.shape[2] - 1 or output_final_state:  # the oldest window key becomes a far key
            s_far = s_far + keys[:, :, t, :, None] * vals[:, :, t, None, :]
            z_far = z_far + keys[:, :, t]
    out = torch.stack(outs, dim=2)
    if not output_final_state:
        return out
    n = q.shape[2]
    return out, AttentionState(s_far, z_far, keys[:, :, n:], vals[:, :, n:])


def _recurrent_full_bias(q, k, v, rpe_bias, eps):
    """:func:`recurrent_attention` with an unclipped 1D bias ``(H, 2N-1)``: step t re-reads keys 0..t."""
    n = q.shape[2]
    bias, eps_h = shifted_bias(rpe_bias, n, True, eps)
    c = torch.exp(bias)  # (H, 2N-1), every used coefficient <= 1
    eps_h = eps_h[None, :, None]  # (1, H, 1)
    outs = []
    for t in range(n):
        w = c[:, n - 1 - t : n][None]  # offsets -t..0 for keys 0..t: (1, H, t+1)
        s = (k[:, :, : t + 1] @ q[:, :, t, :, None])[..., 0] * w  # (B, H, t+1)
        outs.append((s[..., None] * v[:, :, : t + 1]).sum(dim=2) / (s.sum(-1, keepdim=True) + eps_h))
    return torch.stack(outs, dim=2)
