"""Dense kernelized attention: the exact, quadratic reference.

Formula (``r = j - i``, ``c_r = exp(b_r)``, all ones without a bias)::

    out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)

over the allowed ``j`` (``j <= i`` when causal), 1D or 2D bias. With ``A[i, j] = c_{j-i} (q_i . k_j)``
it returns ``A v / (A 1 + eps)``; with separate denominator features ``A v / (A' 1 + eps)``,
``A'[i, j] = q_den_i . k_den_j`` (no bias).

The matrix is never held whole (:class:`DenseBlockProduct`): blocks of queries meet all their
keys, one block of scores at a time (about :data:`DENSE_BLOCK_SCORES` of them), and the
coefficients of a block are a strided view of the per-offset table (no index, no gather): with
the queries in reverse order, ``i' = N-1-i``, the offset of (i, j) is ``j + i'`` in 1D and
``(y_j + y_i', x_j + x_i')`` in 2D, so a block's coefficients are the table read with unit
strides. Causal masking is folded into the table (zero for ``r > 0``). The backward keeps only
q, k, the values and the table and recomputes each block's scores; the table's gradient sums
each block's pair gradients along their offsets (a copy into a skewed buffer and one sum).

Cost: time O(N^2 (M + D)) (causal: half); memory O(N (M + D)) besides one block of scores
(the forward and backward keep no N x N matrix). Traced calls (``torch.export``,
``torch.jit.trace``, ``torch.compile`` up to :data:`DENSE_COMPILED_SCORES` scores) and small
calls with a backward (:func:`runs_unblocked`: a few hundred tokens with a bias or causal and at
most :data:`DENSE_UNBLOCKED_TABLE_SCORES` scores in all, at most :data:`DENSE_UNBLOCKED_SCORES`
scores otherwise) run the same formula unblocked (:func:`dense_attention_unblocked`), which materialises the ``N x N``
matrix (:func:`materialized_scores`; ``backend="auto"`` passes over dense where that matrix would
exceed ``registry.AUTO_MAX_NN_BYTES``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from .kernels_common import (dense_bias_matrix, full_precision, shifted_bias, tracing,
                             with_ones_column)

# scores per block (queries x keys x heads): 1 MB in float32, so that a block's scores, their
# weighted copy and their gradient stay in the core's cache between the products that use them
DENSE_BLOCK_SCORES = 1 << 18
# fewest queries per block in 1D (products of fewer rows run far below the machine's matrix rate)
DENSE_MIN_ROWS = 32
# Forward+backward calls the unblocked form serves faster (:func:`runs_unblocked`; measured
# fwd+bwd, 1 thread, M = D = 64, 1 / 4 / 12 heads, N 144..2,304, 1D and 2D, CPU time): without a
# coefficient table (no bias, not causal), at most this many scores (batch x heads x N^2; 8 MB in
# float32): unblocked / blocked 0.8-1.0x up to it (1 head to 1,536 tokens, 4 heads to 768, 12 heads
# at 256), 1.1-1.4x past it
DENSE_UNBLOCKED_SCORES = 1 << 21
# with a table (a bias, or causal), whatever the head count, at most this many tokens: the
# unblocked form spreads and multiplies an N x N coefficient matrix per head, forward and
# backward, and is 0.8-1.0x the blocked one up to here, 1.1-1.3x at 256-324 tokens and 1.2-3.5x
# from 512 tokens (1 head: 1D 512 1.2x, 1,024 1.4-2.0x; causal 1,024 2.8x; 2D 32 x 32 3.0x)
DENSE_UNBLOCKED_TOKENS = 196
# and, with a table, at most this many scores in all (batch x heads x N^2; 16 MB in float32): autograd
# keeps two (B, H, N, N) matrices of the unblocked form per call, so a large batch runs blocked (at
# 64 x 12 heads x 196 tokens, 29.5M scores, the unblocked form keeps 236 MB per layer and peaks at
# 537 MB, the blocked one at 347 MB); the price: blocked / unblocked fwd+bwd CPU time at 196 tokens,
# 12 heads (1 thread, medians of 2-3 fresh-process rounds, two runs): 1D bias 1.03-1.16x, a 14 x 14
# 2D bias 1.09-1.23x (batch 1 to 64); about 9 batch rows of 12 heads at 196 tokens fit under the cap
DENSE_UNBLOCKED_TABLE_SCORES = 1 << 22
# Under torch.compile (TorchDynamo, not torch.export; dynamic shapes too: Dynamo shows the sizes to
# Python as guarded ints), calls of more than this many scores (batch x heads x N^2; 256 MiB in
# float64, ``registry.AUTO_MAX_NN_BYTES``, so that ``auto`` never passes over dense under
# torch.compile; 128 MiB in float32) run the blocked
# form outside the graph (a graph break; ``fullgraph=True`` refuses it) instead of the unblocked form
# inside it: memory O(N) instead of (B, H, N, N) matrices. 12 heads at 64 x 64 tokens (201M scores),
# fwd+bwd, 1 thread, M = D = 64, 2D bias: compiled unblocked 4.1-4.4 s CPU and 2,483 MB peak, blocked
# outside the graph 3.9-4.1 s and 140 MB
DENSE_COMPILED_SCORES = 1 << 25
# 2D grids narrower than this: a block's coefficients are copied out once for the backward's two weightings
DENSE_SHORT_RUN = 32


class DensePlan:
    """The blocks of :class:`DenseBlockProduct`: groups of (batch row, head) pairs times reversed
    queries ``[s, e)`` (whole grid rows in 2D) against keys ``[0, kend)`` (``kend = N - s`` when
    causal: the keys at or before the block's last query), and the strided views of a block's
    coefficients in a flat table ``(Ht, P)``.

    A group is either some heads of one batch row or all heads of some batch rows; the rows per
    block are as many as fit :data:`DENSE_BLOCK_SCORES` scores of one head (at least
    :data:`DENSE_MIN_ROWS` in 1D, one grid row in 2D), then as many heads as still fit."""

    def __init__(self, b: int, h: int, n: int, grid: Optional[Sequence[int]], causal: bool,
                 block_scores: Optional[int] = None) -> None:
        self.b, self.h, self.n, self.causal = b, h, n, causal
        self.grid = None if grid is None else (int(grid[0]), int(grid[1]))
        budget = DENSE_BLOCK_SCORES if block_scores is None else block_scores
        unit = 1 if self.grid is None else self.grid[1]  # queries come in whole grid rows in 2D
        least = 1 if self.grid is not None else min(n, DENSE_MIN_ROWS)
        self.rows = min(max(budget // (n * unit), least, 1) * unit, n)
        heads = max(1, budget // (self.rows * n))  # (batch row, head) pairs per block
        if heads >= h:
            per = min(heads // h, b)
            self.groups = [(b0, min(b0 + per, b), 0, h) for b0 in range(0, b, per)]
        else:
            self.groups = [(i, i + 1, h0, min(h0 + heads, h)) for i in range(b) for h0 in range(0, h, heads)]

    def blocks(self):
        """``(b0, b1, h0, h1, s, e, kend)``: batch rows ``[b0, b1)``, heads ``[h0, h1)``, reversed
        queries ``[s, e)``, keys ``[0, kend)``."""
        for b0, b1, h0, h1 in self.groups:
            for s in range(0, self.n, self.rows):
                e = min(s + self.rows, self.n)
                yield b0, b1, h0, h1, s, e, (self.n - s if self.causal else self.n)

    def score_shape(self, rows: int, kend: int) -> tuple[int, ...]:
        """The shape a block's ``(pairs, rows, kend)`` scores take per head to meet its coefficients."""
        if self.grid is None:
            return (rows, kend)
        hg, wg = self.grid
        return (rows // wg, wg, hg, wg)

    def coefficients(self, c: torch.Tensor, rows: int, s: int, kend: int) -> torch.Tensor:
        """The coefficients of reversed queries ``[s, s + rows)`` and keys ``[0, kend)``: a view of
        the flat table ``c (Ht, P)`` (rows of one stride), shaped ``(Ht, *score_shape)``."""
        p, off = c.stride(0), c.storage_offset()
        if self.grid is None:  # c[i' + j]
            return c.as_strided((c.shape[0], rows, kend), (p, 1, 1), off + s)
        hg, wg = self.grid
        q = 2 * wg - 1  # c[(y_j + y_i') Q + x_j + x_i']
        return c.as_strided((c.shape[0], rows // wg, wg, hg, wg), (p, q, 1, q, 1), off + (s // wg) * q)

    def skewed(self, heads: int, rows: int, kend: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed buffer ``z`` and its view ``(heads, *score_shape)`` in which each query's pair
        values sit shifted by the query's position, so that :meth:`offset_sums` of ``z`` adds every
        pair into the entry of its offset. 1D: ``z (heads, rows, kend + rows - 1)``, row ``i'``
        shifted ``i'`` entries. 2D: ``z (heads, r, Hg, Wg, Q)`` (``Q = 2Wg-1``), the keys of grid
        row ``y`` for query ``(y', x')`` at row ``(y', y, x')`` shifted ``x'`` entries (about twice
        the block's scores; the rows are then summed along ``y' + y`` on ``Wg`` times fewer values)."""
        if self.grid is None:
            width = kend + rows - 1
            z = like.new_zeros(heads, rows, width)
            return z, z.as_strided((heads, rows, kend), (rows * width, width + 1, 1))
        hg, wg = self.grid
        q = 2 * wg - 1
        r = rows // wg
        z = like.new_zeros(heads, r, hg, wg, q)
        return z, z.as_strided((heads, r, wg, hg, wg), (r * hg * wg * q, hg * wg * q, q + 1, wg * q, 1))

    def offset_sums(self, z: torch.Tensor) -> torch.Tensor:
        """The sums of a :meth:`skewed` buffer per offset: ``(heads, width)``, entry ``o`` the
        table's entry ``table_start(s) + o`` (1D width ``kend + rows - 1``, 2D ``(Hg + r - 1) Q``)."""
        if self.grid is None:
            return z.sum(1)
        heads, r, hg, _, q = z.shape
        by_row = z.sum(3)  # (heads, r, Hg, Q): x offsets summed
        y = by_row.new_zeros(heads, r, hg + r - 1, q)  # query grid row y' shifted y' rows
        y.as_strided(by_row.shape, (r * (hg + r - 1) * q, (hg + r) * q, q, 1)).copy_(by_row)
        return y.sum(1).view(heads, -1)

    def table_start(self, s: int) -> int:
        return s if self.grid is None else (s // self.grid[1]) * (2 * self.grid[1] - 1)


def _pairs(x: torch.Tensor, plan: DensePlan, b0: int, b1: int, h0: int, h1: int) -> torch.Tensor:
    """``x (B H, N, F)``: the (batch row, head) pairs of a group."""
    return x[b0 * plan.h + h0 : (b1 - 1) * plan.h + h1]


def _coefficients(c: torch.Tensor, plan: DensePlan, h0: int, h1: int, rows: int, s: int, kend: int) -> torch.Tensor:
    return plan.coefficients(c if c.shape[0] == 1 else c[h0:h1], rows, s, kend)


def _weigh(scores: torch.Tensor, coef: torch.Tensor, plan: DensePlan, rows: int, kend: int,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scores (pairs, rows, kend)`` times a block's coefficients ``(Ht or heads, ...)`` (in place
    unless ``out``)."""
    view = scores.view(-1, coef.shape[0] if coef.shape[0] > 1 else 1, *plan.score_shape(rows, kend))
    if out is None:
        view.mul_(coef)
        return scores
    torch.mul(view, coef, out=out.view(view.shape))
    return out


class DenseBlockProduct(torch.autograd.Function):
    """``Y = (S * C) W`` with ``S = q k^T`` and ``C[i, j] = c[offset(i, j)]`` (all ones when
    ``c`` is None), in blocks of queries (:class:`DensePlan`, see the module docstring).

    ``q, k (B, H, N, M)``, ``w (B, H, N, E)``, ``c (Ht, P)`` a flat contiguous table
    (``Ht`` 1 or H; ``P = 2N-1`` in 1D, ``(2Hg-1)(2Wg-1)`` in 2D) or None. Returns ``(B, H, N, E)``.
    Saves only its inputs; the backward recomputes each block's scores."""

    @staticmethod
    @full_precision
    def forward(ctx, q, k, w, c, plan):  # type: ignore[override]
        b, h, n, m = q.shape
        e = w.shape[-1]
        qr = q.flip(-2).reshape(b * h, n, m)  # reversed queries (a copy)
        k3 = k.reshape(b * h, n, m)
        w3 = w.reshape(b * h, n, e)
        y = q.new_empty(b * h, n, e)
        for b0, b1, h0, h1, s, t, kend in plan.blocks():
            pairs = slice(b0 * h + h0, (b1 - 1) * h + h1)
            scores = torch.bmm(qr[pairs, s:t], k3[pairs, :kend].transpose(1, 2))
            if c is not None:
                _weigh(scores, _coefficients(c, plan, h0, h1, t - s, s, kend), plan, t - s, kend)
            y[pairs, s:t] = torch.bmm(scores, w3[pairs, :kend])
        ctx.save_for_backward(q, k, w, c)
        ctx.plan = plan
        return y.view(b, h, n, e).flip(-2)

    @staticmethod
    @once_differentiable
    @full_precision
    def backward(ctx, gy):  # type: ignore[override]
        q, k, w, c = ctx.saved_tensors
        plan = ctx.plan
        need_q, need_k, need_w, need_c = ctx.needs_input_grad[:4]
        need_c = need_c and c is not None
        b, h, n, m = q.shape
        e = w.shape[-1]
        qr = q.flip(-2).reshape(b * h, n, m)
        k3 = k.reshape(b * h, n, m)
        w3 = w.reshape(b * h, n, e)
        gr = gy.flip(-2).reshape(b * h, n, e)
        dqr = torch.empty_like(qr) if need_q else None
        dk = torch.zeros_like(k3) if need_k else None
        dw = torch.zeros_like(w3) if need_w else None
        dc = torch.zeros_like(c) if need_c else None
        skewed = {}  # skewed buffers by shape: a block writes the same entries as the last one of its shape
        for b0, b1, h0, h1, s, t, kend in plan.blocks():
            pairs = slice(b0 * h + h0, (b1 - 1) * h + h1)
            rows = t - s
            q_blk, g_blk = qr[pairs, s:t], gr[pairs, s:t]
            k_blk, w_blk = k3[pairs, :kend], w3[pairs, :kend]
            coef = None if c is None else _coefficients(c, plan, h0, h1, rows, s, kend)
            if coef is not None and plan.grid is not None and plan.grid[1] < DENSE_SHORT_RUN:
                coef = coef.contiguous()  # short runs of keys: one strided pass here, not two below
            scores = torch.bmm(q_blk, k_blk.transpose(1, 2))  # (pairs, rows, kend)
            if need_w:
                a = scores if coef is None else _weigh(scores, coef, plan, rows, kend, out=torch.empty_like(scores))
                dw[pairs, :kend].baddbmm_(a.transpose(1, 2), g_blk)
            if not (need_q or need_k or need_c):
                continue
            da = torch.bmm(g_blk, w_blk.transpose(1, 2))  # d(weighted scores)
            if need_c:  # pair gradients da * scores, summed along their offsets
                shared = c.shape[0] == 1  # one table for every head
                heads = 1 if shared else h1 - h0
                key = (heads, rows, kend)
                if key not in skewed:
                    skewed = {key: plan.skewed(heads, rows, kend, scores)}
                z, zv = skewed[key]
                if b1 - b0 == 1 and not (shared and h1 - h0 > 1):
                    torch.mul(da.view(zv.shape), scores.view(zv.shape), out=zv)
                else:  # several batch rows, or several heads sharing the table: sum those first
                    pair = (da * scores).view(-1, heads, *zv.shape[1:])
                    zv.copy_(pair.sum((0, 1))[None] if shared else pair.sum(0))
                sums = plan.offset_sums(z)
                start = plan.table_start(s)
                dc[slice(0, 1) if shared else slice(h0, h1), start : start + sums.shape[-1]] += sums
            if coef is not None:
                _weigh(da, coef, plan, rows, kend)  # d(scores)
            if need_q:
                dqr[pairs, s:t] = torch.bmm(da, k_blk)
            if need_k:
                dk[pairs, :kend].baddbmm_(da.transpose(1, 2), q_blk)
        dq = None if dqr is None else dqr.view(b, h, n, m).flip(-2)
        dk = None if dk is None else dk.view(b, h, n, m)
        dw = None if dw is None else dw.view(b, h, n, e)
        return dq, dk, dw, dc, None


def runs_unblocked(b: int, h: int, n: int, table: bool) -> bool:
    """Whether a forward+backward of ``b`` batch rows, ``h`` heads and ``n`` tokens runs the
    unblocked form (:func:`dense_attention_unblocked`) in eager mode: with a coefficient table
    (``table``: a bias, or causal) at most :data:`DENSE_UNBLOCKED_TOKENS` tokens and
    :data:`DENSE_UNBLOCKED_TABLE_SCORES` scores in all (batch x heads x N^2), otherwise at most
    :data:`DENSE_UNBLOCKED_SCORES` scores in all. Forwards without autograd always run blocked."""
    if table:
        return n <= DENSE_UNBLOCKED_TOKENS and b * h * n * n <= DENSE_UNBLOCKED_TABLE_SCORES
    return b * h * n * n <= DENSE_UNBLOCKED_SCORES


def materialized_scores(b, h, n, *, table: bool, backward: bool):
    """How many scores :func:`dense_attention` holds as one ``(B, H, N, N)`` matrix for a call of
    ``b`` batch rows, ``h`` heads and ``n`` tokens: ``b h n^2`` where it runs unblocked (traced,
    or a small forward+backward call, :func:`runs_unblocked`; ``table``: a bias, or causal), 0
    where it runs in blocks (at most :data:`DENSE_BLOCK_SCORES` scores at a time; under
    torch.compile also calls above :data:`DENSE_COMPILED_SCORES`, outside the graph). Symbolic
    sizes give a symbolic count."""
    if _outside_graph(b, h, n):
        return 0
    if _traced(b, h, n) or (backward and runs_unblocked(b, h, n, table)):
        return b * h * n * n
    return 0


def _outside_graph(b, h, n, *sizes) -> bool:
    """Whether TorchDynamo (torch.compile, not torch.export) traces a call of static sizes with
    more than :data:`DENSE_COMPILED_SCORES` scores: :func:`dense_attention` then runs its blocked
    form eagerly, outside the graph (a graph break)."""
    if not torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting():
        return False
    if any(isinstance(x, torch.SymInt) for x in (b, h, n, *sizes)):
        return False
    return b * h * n * n > DENSE_COMPILED_SCORES


def _traced(*sizes) -> bool:
    """Sizes that ``torch.export`` / ``torch.compile`` trace symbolically, or any tracing: the
    blocks' Python loops would fix the sizes, so the unblocked form runs instead."""
    return tracing() or any(isinstance(x, torch.SymInt) for x in sizes)


@full_precision
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False, grid: Optional[Sequence[int]] = None, eps: float = 1e-6,
    q_den: Optional[torch.Tensor] = None, k_den: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact quadratic reference: ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype, padded
    keys and values already zero (``kernels_common.mask_keys``); ``rpe_bias`` ``(H, 2N-1)`` or,
    with ``grid = (Hg, Wg)``, ``(H, 2Hg-1, 2Wg-1)``; ``q_den, k_den`` ``(B, H, N, M')`` or None.
    Returns ``(B, H, N, D)``. Blocked (:class:`DenseBlockProduct`) in eager mode, and under
    torch.compile for calls of more than :data:`DENSE_COMPILED_SCORES` scores (eagerly, outside
    the graph: a graph break; ``fullgraph=True`` refuses it); other traced calls, and the small
    forward+backward calls :func:`runs_unblocked` names, run :func:`dense_attention_unblocked`."""
    b, h, n = q.shape[:3]
    if grid is not None and causal:
        raise ValueError("causal=True is only defined for 1D sequences; drop grid or causal")
    sizes = (q.shape[-1], v.shape[-1], *(grid or ()))
    if _outside_graph(b, h, n, *sizes):  # torch.compile, a large call: blocked, eagerly (a graph break)
        return _dense_outside_graph(q, k, v, rpe_bias=rpe_bias, causal=causal, grid=grid, eps=eps,
                                    q_den=q_den, k_den=k_den)
    # traced first: comparing symbolic sizes would add a guard that pins them
    if _traced(b, h, n, *sizes) or (
        runs_unblocked(b, h, n, rpe_bias is not None or causal) and torch.is_grad_enabled()
        and any(x is not None and x.requires_grad for x in (q, k, v, rpe_bias, q_den, k_den))
    ):
        return dense_attention_unblocked(q, k, v, rpe_bias=rpe_bias, causal=causal, grid=grid, eps=eps,
                                         q_den=q_den, k_den=k_den)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    plan = DensePlan(b, h, n, grid if rpe_bias is not None else None, causal)
    c = None
    if rpe_bias is not None:
        bias, eps_h = shifted_bias(rpe_bias, n, causal, eps)
        c = torch.exp(bias).reshape(bias.shape[0], -1)  # one exponential per offset
        eps = eps_h[None, :, None, None]
    if causal:  # zero coefficients for the keys after each query (offsets r > 0 of the 1D table)
        keep = torch.arange(2 * n - 1, device=q.device) < n
        c = keep.to(q.dtype)[None] if c is None else c * keep
    if c is not None:
        c = c.contiguous()
    if q_den is None:
        y = DenseBlockProduct.apply(q, k, with_ones_column(v), c, plan)  # numerator and denominator at once
        return y[..., :-1] / (y[..., -1:] + eps)
    if causal:
        den = DenseBlockProduct.apply(q_den.contiguous(), k_den.contiguous(), torch.ones_like(v[..., :1]), c, plan)
    else:  # no bias on the denominator: sum_j q_den_i . k_den_j = q_den_i . (sum_j k_den_j)
        den = q_den @ k_den.sum(-2, keepdim=True).transpose(-1, -2)
    return DenseBlockProduct.apply(q, k, v, c, plan) / (den + eps)


# dense_attention run eagerly from compiled code (TorchDynamo does not trace into it: a graph break)
_dense_outside_graph = torch.compiler.disable(dense_attention)


def dense_attention_unblocked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False, grid: Optional[Sequence[int]] = None, eps: float = 1e-6,
    q_den: Optional[torch.Tensor] = None, k_den: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`dense_attention` with the ``(B, H, N, N)`` matrix materialised (and kept for the
    backward by autograd): plain operations, the form traced by ``torch.export`` with dynamic
    sizes."""
    n = q.shape[-2]
    a = q @ k.transpose(-1, -2)  # (B, H, N, N)
    a_den = None if q_den is None else q_den @ k_den.transpose(-1, -2)
    if rpe_bias is not None:
        bias, eps_h = shifted_bias(rpe_bias, n, causal, eps)
        # exp on the (H, 2N-1) / (H, 2Hg-1, 2Wg-1) table, then spread to (H, N, N): one
        # exponential per offset instead of one per (query, key) pair, same values
        a = a * dense_bias_matrix(torch.exp(bias), n, grid)[None]
        eps = eps_h[None, :, None, None]
    if causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        a = torch.where(allowed, a, zero)
        a_den = None if a_den is None else torch.where(allowed, a_den, zero)
    if a_den is not None:
        return (a @ v) / (a_den.sum(dim=-1, keepdim=True) + eps)
    # numerator and denominator in one product: no separate pass over the (N, N) matrix for its
    # row sums, forward or backward
    y = a @ with_ones_column(v)
    return y[..., :-1] / (y[..., -1:] + eps)
