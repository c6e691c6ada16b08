"""Dense kernelized attention: the exact, quadratic reference.

With ``A[i, j] = c_{j-i} (q_i . k_j)`` (``c_r = exp(b_r)``, 1D or 2D offsets; ones without a
bias; zero for ``j > i`` when causal): ``out = A v / (A 1 + eps)``; with denominator features
``A v / (A' 1 + eps)``, ``A'[i, j] = q_den_i . k_den_j`` (no bias).

:class:`DenseBlockProduct` never holds the matrix: blocks of queries meet all their keys. With
queries reversed (``i' = N-1-i``) the offset of (i, j) is ``j + i'`` (2D: ``(y_j + y_i', x_j +
x_i')``), so a block's coefficients are a unit-stride view of the per-offset table. The backward
recomputes each block; the table's gradient sums pair gradients along their offsets.

Cost: time O(N^2 (M + D)) (causal: half); memory O(N (M + D)) plus one block. Traced and small
forward+backward calls run :func:`dense_attention_unblocked`, which holds the ``(B, H, N, N)``
matrix.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from .kernels_common import (dense_bias_matrix, full_precision, shifted_bias, tracing,
                             with_ones_column)

# scores per block (queries x keys x heads): 1 MB in float32, so a block's scores, weighted copy and
# gradient stay in cache between the products that use them
DENSE_BLOCK_SCORES = 1 << 18
# fewest queries per block in 1D (products of fewer rows run far below the machine's matrix rate)
DENSE_MIN_ROWS = 32
# Forward+backward calls the unblocked form runs (:func:`runs_unblocked`), where it measured as fast or
# faster than the blocked one: without a table (no bias, not causal), up to this many scores (B H N^2)
DENSE_UNBLOCKED_SCORES = 1 << 21
# with a table (a bias, or causal), up to this many tokens (beyond, spreading an N x N coefficient
# matrix per head costs more than it saves)
DENSE_UNBLOCKED_TOKENS = 196
# and, with a table, up to this many scores (B H N^2): autograd keeps two (B, H, N, N) matrices of the
# unblocked form, so a large batch runs blocked, for memory (about 9 rows of 12 heads at 196 tokens fit)
DENSE_UNBLOCKED_TABLE_SCORES = 1 << 22
# Under torch.compile (not export), calls above this many scores (B H N^2) run blocked outside the graph
# (a graph break) instead of unblocked inside it: O(N) memory. 256 MiB in float64, equal to
# ``registry.AUTO_MAX_NN_BYTES``, so ``auto`` never passes over dense under torch.compile.
DENSE_COMPILED_SCORES = 1 << 25
# 2D grids narrower than this: a block's coefficients are copied once for the backward's two weightings
DENSE_SHORT_RUN = 32


class DensePlan:
    """The blocks of :class:`DenseBlockProduct`: groups of (batch row, head) pairs times reversed
    queries ``[s, e)`` (whole grid rows in 2D) against keys ``[0, kend)`` (``kend = N - s`` when
    causal), and the strided views of a block's coefficients in a flat table ``(Ht, P)``. A block
    holds about :data:`DENSE_BLOCK_SCORES` scores (at least :data:`DENSE_MIN_ROWS` rows in 1D)."""

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
        """``(b0, b1, h0, h1, s, e, kend)``: batch rows, heads, reversed queries ``[s, e)``, keys
        ``[0, kend)``."""
        for b0, b1, h0, h1 in self.groups:
            for s in range(0, self.n, self.rows):
                e = min(s + self.rows, self.n)
                yield b0, b1, h0, h1, s, e, (self.n - s if self.causal else self.n)

    def score_shape(self, rows: int, kend: int) -> tuple[int, ...]:
        """The per-head shape of a block's ``(rows, kend)`` scores that meets its coefficients."""
        if self.grid is None:
            return (rows, kend)
        hg, wg = self.grid
        return (rows // wg, wg, hg, wg)

    def coefficients(self, c: torch.Tensor, rows: int, s: int, kend: int) -> torch.Tensor:
        """Coefficients of reversed queries ``[s, s + rows)`` and keys ``[0, kend)``: a view of
        ``c (Ht, P)``, shaped ``(Ht, *score_shape)``."""
        p, off = c.stride(0), c.storage_offset()
        if self.grid is None:  # c[i' + j]
            return c.as_strided((c.shape[0], rows, kend), (p, 1, 1), off + s)
        hg, wg = self.grid
        q = 2 * wg - 1  # c[(y_j + y_i') Q + x_j + x_i']
        return c.as_strided((c.shape[0], rows // wg, wg, hg, wg), (p, q, 1, q, 1), off + (s // wg) * q)

    def skewed(self, heads: int, rows: int, kend: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed buffer ``z`` and its view ``(heads, *score_shape)`` holding each query's pair values
        shifted by its position, so that :meth:`offset_sums` adds each pair into its offset's entry
        (1D: ``z (heads, rows, kend + rows - 1)``; 2D: ``z (heads, r, Hg, Wg, 2Wg-1)``)."""
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
        """Per-offset sums of a :meth:`skewed` buffer: ``(heads, width)``, entry ``o`` the table's
        entry ``table_start(s) + o``."""
        if self.grid is None:
            return z.sum(1)
        heads, r, hg, _, q = z.shape
        by_row = z.sum(3)  # (heads, r, Hg, Q): x offsets summed
        y = by_row.new_zeros(heads, r, hg + r - 1, q)  # query grid row y' shifted y' rows
        y.as_strided(by_row.shape, (r * (hg + r - 1) * q, (hg + r) * q, q, 1)).copy_(by_row)
        return y.sum(1).view(heads, -1)

    def table_start(self, s: int) -> int:
        return s if self.grid is None else (s // self.grid[1]) * (2 * self.grid[1] - 1)


def _coefficients(c: torch.Tensor, plan: DensePlan, h0: int, h1: int, rows: int, s: int, kend: int) -> torch.Tensor:
    return plan.coefficients(c if c.shape[0] == 1 else c[h0:h1], rows, s, kend)


def _weigh(scores: torch.Tensor, coef: torch.Tensor, plan: DensePlan, rows: int, kend: int,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scores (pairs, rows, kend)`` times a block's coefficients (in place unless ``out``)."""
    view = scores.view(-1, coef.shape[0] if coef.shape[0] > 1 else 1, *plan.score_shape(rows, kend))
    if out is None:
        view.mul_(coef)
        return scores
    torch.mul(view, coef, out=out.view(view.shape))
    return out


class DenseBlockProduct(torch.autograd.Function):
    """``Y = (S * C) W``, ``S = q k^T``, ``C[i, j] = c[offset(i, j)]`` (ones when ``c`` is None), in
    blocks of queries (:class:`DensePlan`).

    ``q, k (B, H, N, M)``, ``w (B, H, N, E)``, ``c (Ht, P)`` a flat contiguous table (``Ht`` 1 or
    H; ``P = 2N-1`` in 1D, ``(2Hg-1)(2Wg-1)`` in 2D) or None. Returns ``(B, H, N, E)``. Saves only
    its inputs."""

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
        skewed = {}  # by shape: a block writes the same entries as the last one of its shape
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
    """Whether an eager forward+backward runs :func:`dense_attention_unblocked`: with a table
    (``table``: a bias, or causal) up to :data:`DENSE_UNBLOCKED_TOKENS` tokens and
    :data:`DENSE_UNBLOCKED_TABLE_SCORES` scores, otherwise up to :data:`DENSE_UNBLOCKED_SCORES`
    scores (``b h n^2``)."""
    if table:
        return n <= DENSE_UNBLOCKED_TOKENS and b * h * n * n <= DENSE_UNBLOCKED_TABLE_SCORES
    return b * h * n * n <= DENSE_UNBLOCKED_SCORES


def materialized_scores(b, h, n, *, table: bool, backward: bool):
    """Scores :func:`dense_attention` holds as one ``(B, H, N, N)`` matrix: ``b h n^2`` where it
    runs unblocked (traced, or :func:`runs_unblocked` with ``backward``), else 0 (symbolic sizes: a
    symbolic count)."""
    if _outside_graph(b, h, n):
        return 0
    if _traced(b, h, n) or (backward and runs_unblocked(b, h, n, table)):
        return b * h * n * n
    return 0


def _outside_graph(b, h, n, *sizes) -> bool:
    """Whether TorchDynamo (not export) traces static sizes above :data:`DENSE_COMPILED_SCORES`
    scores: the blocked form then runs eagerly (a graph break)."""
    if not torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting():
        return False
    if any(isinstance(x, torch.SymInt) for x in (b, h, n, *sizes)):
        return False
    return b * h * n * n > DENSE_COMPILED_SCORES


def _traced(*sizes) -> bool:
    """Tracing, or symbolic sizes: the blocks' loops would fix the sizes, so the unblocked form runs."""
    return tracing() or any(isinstance(x, torch.SymInt) for x in sizes)


@full_precision
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rpe_bias: Optional[torch.Tensor] = None,
    causal: bool = False, grid: Optional[Sequence[int]] = None, eps: float = 1e-6,
    q_den: Optional[torch.Tensor] = None, k_den: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact quadratic attention. ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype, padded keys
    and values zero; ``rpe_bias`` ``(H, 2N-1)`` or, with ``grid = (Hg, Wg)``, ``(H, 2Hg-1, 2Wg-1)``;
    ``q_den, k_den`` ``(B, H, N, M')`` or None. Returns ``(B, H, N, D)``.

    Blocked (:class:`DenseBlockProduct`) in eager mode and, as a graph break, under
    ``torch.compile`` above :data:`DENSE_COMPILED_SCORES`; other traced calls and the calls
    :func:`runs_unblocked` names run :func:`dense_attention_unblocked`."""
    b, h, n = q.shape[:3]
    if grid is not None and causal:
        raise ValueError("causal=True is only defined for 1D sequences; drop grid or causal")
    sizes = (q.shape[-1], v.shape[-1], *(grid or ()))
    if _outside_graph(b, h, n, *sizes):
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
    """:func:`dense_attention` with the ``(B, H, N, N)`` matrix materialised: plain operations,
    what ``torch.export`` traces with dynamic sizes."""
    n = q.shape[-2]
    a = q @ k.transpose(-1, -2)  # (B, H, N, N)
    a_den = None if q_den is None else q_den @ k_den.transpose(-1, -2)
    if rpe_bias is not None:
        bias, eps_h = shifted_bias(rpe_bias, n, causal, eps)
        # exp per offset, then spread to (H, N, N): not one per (query, key) pair
        a = a * dense_bias_matrix(torch.exp(bias), n, grid)[None]
        eps = eps_h[None, :, None, None]
    if causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        a = torch.where(allowed, a, zero)
        a_den = None if a_den is None else torch.where(allowed, a_den, zero)
    if a_den is not None:
        return (a @ v) / (a_den.sum(dim=-1, keepdim=True) + eps)
    # numerator and denominator in one product: no separate pass over the (N, N) matrix
    y = a @ with_ones_column(v)
    return y[..., :-1] / (y[..., -1:] + eps)
