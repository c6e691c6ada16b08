"""Attention with a 2D bias of the clipped Manhattan distance (Horn et al. 2021), in O(N K^2).

On a row-major ``(Hg, Wg)`` grid, ``d_ij = min(|dy| + |dx|, K)``, ``c_d = exp(b_d)``::

    out_i = sum_j c_{d_ij} (q_i . k_j) v_j / (sum_j c_{d_ij} (q_i . k_j) + eps)

Every key at distance ``>= K`` carries ``c_K``, so the sums split into a far term over all keys
and a near sum over the ``2K^2 - 2K + 1`` offsets closer than K::

    Y_i = c_K q_i [S, z] + sum_{|dy|+|dx| < K} (c_d - c_K) (q_i . k_{i+delta}) [v_{i+delta}, 1]

with ``[S, z] = sum_j k_j^T [v_j, 1]``; ``out_i = Y_i[:D] / (Y_i[D] + eps)``.

:class:`ManhattanAttention` computes both with matrix products: tiles of ``Ty x Tx`` queries
(8 x 4) against runs of keys, the inputs stored in strips of ``Tx`` columns so that the keys a
tile reaches in a neighbouring strip are consecutive tokens (:class:`TilePlan`). Score blocks are
weighed by ``c_d - c_K`` (0 beyond the diamond) and cover about 1.5-1.8x the diamond's keys.

Cost: time O(N K^2 (M + D) + N M D); memory O(N (M + D)): the backward keeps inputs, output and
denominator and recomputes each score block. :func:`manhattan_offsets_near` is the near sum
offset by offset (what ``torch.export`` traces with a dynamic grid).
"""

from __future__ import annotations

import functools

import torch

from .kernels_common import full_precision, manhattan_distances, shifted_bias, with_ones_column
from .registry import register_backend


# Grids of at most this many tokens are one tile (see :func:`tile_shape`).
WHOLE_GRID_MAX_N = 400
# Tokens of the tiles one product call covers: their score blocks stay in cache.
GROUP_TOKENS = 4096


class TilePlan:
    """The geometry of :class:`ManhattanAttention` for one call: ``ty x tx`` tiles on a ``(hg, wg)``
    grid (padded to ``(hq, wq)``), the strip offsets ``s`` with their runs' half-height
    ``h_s = K - 1 - min |dx|``, the distance index of every (run position, tile position) pair, and
    the groups of columns walked at once.

    Strip layout of ``(B, H, N, F)``: a flat ``(L, F)`` buffer, ``L = ntx B H hq tx``, ordered
    (strip, batch row, head, row, column in strip), zero off the grid. Tile row ``r`` of column
    ``c`` is the ``ty tx`` tokens from ``c hq tx + r ty tx``; its run of offset ``s`` is rows
    ``[r ty - h_s, (r + 1) ty + h_s)`` of column ``c + s B H``: for one tile row and offset, the
    tiles and runs of consecutive columns are strided views (one batched product)."""

    def __init__(self, b: int, h: int, grid: tuple[int, int], clip: int, tile: tuple[int, int], device,
                 group_tokens: int | None = None) -> None:
        hg, wg = grid
        ty, tx = tile
        self.b, self.h, self.hg, self.wg, self.clip, self.ty, self.tx = b, h, hg, wg, clip, ty, tx
        self.nty, self.ntx = -(-hg // ty), -(-wg // tx)
        self.hq, self.wq = self.nty * ty, self.ntx * tx
        self.t2 = ty * tx
        self.bh = b * h  # columns of one strip
        self.column = self.hq * tx  # tokens of a column
        self.length = self.ntx * self.bh * self.column
        reach_x = min(clip - 1, wg - 1)
        offsets = []
        for s in range(-(self.ntx - 1), self.ntx):
            nearest = 0 if s == 0 else (abs(s) - 1) * tx + 1  # the smallest |dx| between a tile and strip s
            if nearest <= reach_x:
                offsets.append((s, min(clip - 1 - nearest, hg - 1)))
        self.offsets = sorted(offsets, key=lambda o: abs(o[0]))
        offsets = self.offsets
        self.keys = [(ty + 2 * hs) * tx for _, hs in offsets]
        self.max_keys = max(self.keys, default=0)
        # the rows of each run on the grid: (first row, first key of the full run, keys) per tile row
        self.rows = [[(max(0, r * ty - hs), (max(0, r * ty - hs) - (r * ty - hs)) * tx,
                       (min(hg, (r + 1) * ty + hs) - max(0, r * ty - hs)) * tx) for r in range(self.nty)]
                     for _, hs in offsets]
        group_tokens = group_tokens or GROUP_TOKENS
        if self.bh * self.t2 <= group_tokens:  # whole strips (every batch row and head) at a time
            step = group_tokens // (self.bh * self.t2)
            self.groups = [(x, min(x + step, self.ntx), 0, self.bh) for x in range(0, self.ntx, step)]
        else:  # one strip, a few (batch row, head) pairs at a time: whole batch rows, or heads of one
            step = max(1, group_tokens // self.t2)
            step = step // h * h if step >= h else max(x for x in range(1, step + 1) if h % x == 0)
            self.groups = [(x, x + 1, r, min(r + step, self.bh)) for x in range(self.ntx) for r in range(0, self.bh, step)]
        # distance index of every (run position, tile position) pair, per offset; clip = no near weight
        iy = torch.arange(ty, device=device).repeat_interleave(tx)[None, :]
        ix = torch.arange(tx, device=device).repeat(ty)[None, :]
        index = torch.full((len(offsets), self.max_keys, self.t2), clip, dtype=torch.long, device=device)
        for i, (s, hs) in enumerate(offsets):
            run = ty + 2 * hs
            ry = torch.arange(run, device=device).repeat_interleave(tx)[:, None]
            rx = torch.arange(tx, device=device).repeat(run)[:, None]
            index[i, : self.keys[i]] = ((ry - hs - iy).abs() + (s * tx + rx - ix).abs()).clamp(max=clip)
        self.index = index

    @functools.cached_property
    def steps(self) -> list:
        """The walk's products as plain numbers: per group and tile row ``(a, z, r, first tile token,
        items)``, one item per on-grid strip offset; sets ``self.blocks``, the distinct weight blocks."""
        out, blocks = [], {}
        for group in self.groups:
            for r in range(self.nty):
                a, z = self.columns(None, group)
                items = []
                for i, (s, _) in enumerate(self.offsets):
                    c0, c1 = self.columns(i, group)
                    if c0 >= c1:
                        continue
                    lo, first, keys = self.rows[i][r]
                    heads = min(c1 - c0, self.h)
                    block = blocks.setdefault((i, c0 % self.h, heads, first, keys), len(blocks))
                    items.append((i, c0, c1, (c0 + s * self.bh) * self.column + lo * self.tx, keys, c0 % self.h, heads, first, block))
                out.append((a, z, r, a * self.column + r * self.t2, items))
        self.blocks = list(blocks)
        return out

    def weights(self, c: torch.Tensor) -> torch.Tensor:
        """``c (H, K+1)`` -> near weights ``c_d - c_K`` (0 from K on) per pair:
        ``(H, offsets, max keys, ty tx)``."""
        near = torch.cat([c[:, : self.clip] - c[:, self.clip :], torch.zeros_like(c[:, :1])], dim=1)
        return near.index_select(1, self.index.flatten()).view(c.shape[0], *self.index.shape)

    def weights_backward(self, dw: torch.Tensor) -> torch.Tensor:
        """Gradient of :meth:`weights`: ``dw (H, offsets, max keys, ty tx)`` -> ``dc (H, K+1)``."""
        dnear = dw.new_zeros(dw.shape[0], self.clip + 1).index_add_(1, self.index.flatten(), dw.flatten(1))
        dc = dnear.clone()
        dc[:, self.clip] = -dnear[:, : self.clip].sum(1)
        return dc

    def to_strips(self, x: torch.Tensor, ones: bool = False) -> torch.Tensor:
        """``(B, H, N, F)`` -> the strip buffer ``(L, F)``; ``ones``: with a ones column, ``(L, F + 1)``."""
        f = x.shape[-1]
        buf = x.new_empty(self.length, f + ones)
        region = buf.view(self.ntx, self.b, self.h, self.hq, self.tx, f + ones)
        xg = x.reshape(self.b, self.h, self.hg, self.wg, f)
        full = self.wg // self.tx
        if self.hq > self.hg:  # the padding rows and columns of the grid
            region[:, :, :, self.hg :, :, :f].zero_()
        if full < self.ntx:
            region[full, ..., :f].zero_()
        if full:
            region[:full, :, :, : self.hg, :, :f].copy_(
                xg[:, :, :, : full * self.tx].reshape(self.b, self.h, self.hg, full, self.tx, f).permute(3, 0, 1, 2, 4, 5))
        if full < self.ntx:
            region[full, :, :, : self.hg, : self.wg - full * self.tx, :f].copy_(xg[:, :, :, full * self.tx :])
        if ones:
            buf[:, f].fill_(1)
        return buf

    def to_strips_t(self, x: torch.Tensor, ones: bool = False) -> torch.Tensor:
        """``(B, H, N, F)`` -> the feature-major strip buffer: ``ntx B H`` columns of ``(F, hq tx)``;
        ``ones``: a row of ones appended."""
        f = x.shape[-1]
        rows = f + ones
        buf = x.new_empty(self.ntx * self.bh * rows * self.column)
        region = buf.view(self.ntx, self.b, self.h, rows, self.hq, self.tx)
        xg = x.reshape(self.b, self.h, self.hg, self.wg, f)
        full = self.wg // self.tx
        if self.hq > self.hg:
            region[:, :, :, :f, self.hg :].zero_()
        if full < self.ntx:
            region[full, :, :, :f].zero_()
        if full:
            region[:full, :, :, :f, : self.hg].copy_(
                xg[:, :, :, : full * self.tx].reshape(self.b, self.h, self.hg, full, self.tx, f).permute(3, 0, 1, 5, 2, 4))
        if full < self.ntx:
            region[full, :, :, :f, : self.hg, : self.wg - full * self.tx].copy_(xg[:, :, :, full * self.tx :].permute(0, 1, 4, 2, 3))
        if ones:
            region[:, :, :, f].fill_(1)
        return buf

    def to_tiles_t(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, N, F)`` -> feature-major tiles ``(ntx B H, nty, F, ty tx)``, zero off the grid."""
        f = x.shape[-1]
        if (self.hq, self.wq) != (self.hg, self.wg):  # tiles past the grid's edge: via the zero-padded strips
            return self.to_strips(x).view(-1, self.t2, f).transpose(1, 2).contiguous().view(self.ntx * self.bh, self.nty, f, self.t2)
        buf = x.new_empty(self.ntx * self.bh, self.nty, f, self.t2)
        buf.view(self.ntx, self.b, self.h, self.nty, f, self.ty, self.tx).copy_(
            x.reshape(self.b, self.h, self.nty, self.ty, self.ntx, self.tx, f).permute(4, 0, 1, 2, 6, 3, 5))
        return buf

    def far_t(self, kb: torch.Tensor, vt: torch.Tensor, rows: int) -> torch.Tensor:
        """``[v, 1]^T k`` per (batch row, head) from strip buffers of k and of feature-major ``[v, 1]``
        (``rows`` features): ``(B H, rows, M)``."""
        m = kb.shape[-1]
        cols = self.ntx * self.bh
        parts = torch.bmm(vt.view(cols, rows, self.column), kb.view(cols, self.column, m))
        return parts.view(self.ntx, self.bh, rows, m).sum(0)

    def new_tiles_t(self, like: torch.Tensor, f: int) -> torch.Tensor:
        """An uninitialized feature-major tile buffer ``(nty, ntx B H, F, ty tx)``."""
        return like.new_empty(self.nty, self.ntx * self.bh, f, self.t2)

    def divide(self, yt: torch.Tensor, eps: torch.Tensor, out: torch.Tensor, den: torch.Tensor) -> None:
        """Tiles of numerators and denominators ``(nty, ntx B H, D+1, ty tx)`` -> ``den (B, H, N)``
        (plus ``eps (H,)``) and ``out (B, H, N, D)``, written in place."""
        f = yt.shape[2]
        d = f - 1
        y = yt.view(self.nty, self.ntx, self.b, self.h, f, self.ty, self.tx).permute(2, 3, 0, 5, 1, 6, 4)
        if (self.hq, self.wq) == (self.hg, self.wg):
            dv, ov = den.view(self.b, self.h, self.nty, self.ty, self.ntx, self.tx), out.view(*y.shape[:-1], d)
            e = eps.view(1, -1, 1, 1, 1, 1)
        else:
            y = y.reshape(self.b, self.h, self.hq, self.wq, f)[:, :, : self.hg, : self.wg]
            dv, ov = den.view(self.b, self.h, self.hg, self.wg), out.view(self.b, self.h, self.hg, self.wg, d)
            e = eps.view(1, -1, 1, 1)
        torch.add(y[..., d], e, out=dv)
        torch.div(y[..., :d], dv[..., None], out=ov)

    def from_strips(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        """A strip buffer ``(L, F)`` -> ``out (B, H, N, F)``, written in place."""
        f = buf.shape[-1]
        region = buf.view(self.ntx, self.b, self.h, self.hq, self.tx, f)
        og = out.view(self.b, self.h, self.hg, self.wg, f)
        full = self.wg // self.tx
        if full:
            og[:, :, :, : full * self.tx].view(self.b, self.h, self.hg, full, self.tx, f).copy_(
                region[:full, :, :, : self.hg].permute(1, 2, 3, 0, 4, 5))
        if full < self.ntx:
            og[:, :, :, full * self.tx :].copy_(region[full, :, :, : self.hg, : self.wg - full * self.tx])

    def new_tiles(self, like: torch.Tensor, f: int) -> torch.Tensor:
        """A tile buffer ``(nty, ntx B H, ty tx, F)``; uninitialized (offset 0 writes every tile
        first), zeroed when there is no offset."""
        shape = (self.nty, self.ntx * self.bh, self.t2, f)
        return like.new_empty(shape) if self.offsets else like.new_zeros(shape)

    def from_tiles(self, y: torch.Tensor, out: torch.Tensor) -> None:
        """A tile buffer ``(nty, ntx B H, ty tx, F)`` -> ``out (B, H, N, F)``, written in place."""
        f = y.shape[-1]
        y = y.view(self.nty, self.ntx, self.b, self.h, self.ty, self.tx, f).permute(2, 3, 0, 4, 1, 5, 6)
        if (self.hq, self.wq) == (self.hg, self.wg):
            out.view(self.b, self.h, self.nty, self.ty, self.ntx, self.tx, f).copy_(y)
        else:
            out.view(self.b, self.h, self.hg, self.wg, f).copy_(y.reshape(self.b, self.h, self.hq, self.wq, f)[:, :, : self.hg, : self.wg])

    def columns(self, i: int | None, group: tuple[int, int, int, int]) -> tuple[int, int]:
        """The columns ``[c0, c1)`` of ``group`` whose strip at offset ``i`` lies on the grid (empty if
        ``c0 >= c1``); ``i`` None: all."""
        s = 0 if i is None else self.offsets[i][0]
        x0, x1, r0, r1 = group
        a, z = max(x0, -s), min(x1, self.ntx - s)
        if r1 - r0 == self.bh:
            return a * self.bh, z * self.bh
        return (a * self.bh + r0, a * self.bh + r1) if a < z else (0, 0)

    def per_column(self, x: torch.Tensor) -> torch.Tensor:
        """``(B H, ...)`` -> ``(ntx B H, ...)``, repeated per strip."""
        return x.repeat(self.ntx, *([1] * (x.dim() - 1)))


@functools.lru_cache(maxsize=32)
def _plan(b: int, h: int, grid: tuple[int, int], clip: int, tile: tuple[int, int], device: torch.device,
          group_tokens: int) -> TilePlan:
    """The cached :class:`TilePlan` for these shapes: its index tensors are built once per shape."""
    return TilePlan(b, h, grid, clip, tile, device, group_tokens)


class ManhattanAttention(torch.autograd.Function):
    """:func:`manhattan_attention` on :class:`TilePlan` tiles, in chunks of (batch row, head) pairs,
    with a hand-written backward. ``c (H, K+1)``: ``exp(b_d)``; ``eps (H,)``. The backward takes
    each key's tile against its queries' runs (the weights are symmetric: the forward's blocks)."""

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v, c, eps, grid, clip, tile):  # type: ignore[override]
        b, h, n, m = q.shape
        d = v.shape[-1]
        out, den = q.new_empty(b, h, n, d), q.new_empty(b, h, n)
        for (b0, b1, h0, h1), plan in _chunks(q, d, grid, clip, tile):
            part = (slice(b0, b1), slice(h0, h1))
            _near_forward(plan, q[part], k[part], v[part], c[h0:h1], eps[h0:h1], out[part], den[part])
        ctx.save_for_backward(q, k, v, c, out, den)
        ctx.layout = (grid, clip, tile)
        return out

    @staticmethod
    @full_precision
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, c, out, den = ctx.saved_tensors
        d = v.shape[-1]
        need = ctx.needs_input_grad[:4]
        dq, dk, dv = (x.new_empty(x.shape) if flag else None for x, flag in zip((q, k, v), need))  # contiguous
        dc = c.new_zeros(c.shape) if need[3] else None
        for (b0, b1, h0, h1), plan in _chunks(q, d, *ctx.layout):
            part = (slice(b0, b1), slice(h0, h1))
            # the gradient of the numerator and denominator: [g / den, -(g . num) / den^2 = -(g / den) . out]
            g = q.new_empty(b1 - b0, h1 - h0, q.shape[2], d + 1)
            torch.div(dout[part], den[part][..., None], out=g[..., :d])
            g[..., d] = -(g[..., :d] * out[part]).sum(-1)
            grads = [None if x is None else x[part] for x in (dq, dk, dv)]
            dcp = _near_backward(plan, q[part], k[part], v[part], c[h0:h1], g, *grads, need[3])
            if dcp is not None:
                dc[h0:h1] += dcp
        return dq, dk, dv, dc, None, None, None, None


# Floats of a chunk's largest buffer (:func:`_chunks`): 1 MB, one head at 64 x 64.
CHUNK_FLOATS = 1 << 18


def _chunks(q: torch.Tensor, d: int, grid: tuple[int, int], clip: int, tile: tuple[int, int]):
    """``((b0, b1, h0, h1), plan)`` per chunk of (batch row, head) pairs whose numerator tiles hold at
    most :data:`CHUNK_FLOATS` floats (fresh large buffers are page-faulted; the runs stay in cache)."""
    b, h, n, _ = q.shape
    per_row = -(-grid[0] // tile[0]) * tile[0] * -(-grid[1] // tile[1]) * tile[1] * (max(d, q.shape[-1]) + 1)
    rows = max(1, CHUNK_FLOATS // per_row)
    if rows >= b * h:
        spans = [(0, b, 0, h)]
    elif rows >= h:
        step = rows // h
        spans = [(b0, min(b0 + step, b), 0, h) for b0 in range(0, b, step)]
    else:
        spans = [(b0, b0 + 1, h0, min(h0 + rows, h)) for b0 in range(b) for h0 in range(0, h, rows)]
    for b0, b1, h0, h1 in spans:
        yield (b0, b1, h0, h1), _plan(b1 - b0, h1 - h0, grid, clip, tile, q.device, GROUP_TOKENS)


def _near_forward(plan: TilePlan, q, k, v, c, eps, out, den) -> None:
    """A chunk's ``out`` and ``den``, in place: far term plus near sum, over the denominator plus
    ``eps``. Products run feature-major (``(D+1, ty tx)`` tiles, measured faster)."""
    d = v.shape[-1]
    w = plan.weights(c)
    qt, kb, vt = plan.to_tiles_t(q), plan.to_strips(k), plan.to_strips_t(v, ones=True)
    far = plan.per_column(plan.far_t(kb, vt, d + 1) * c[:, plan.clip].repeat(plan.b)[:, None, None])  # c_K [v, 1]^T k
    yt = plan.new_tiles_t(q, d + 1)
    m, f, col, t2 = q.shape[-1], d + 1, plan.column, plan.t2
    ok, ov = kb.storage_offset(), vt.storage_offset()
    steps = plan.steps  # (sets plan.blocks)
    weights = [None] * len(plan.blocks)  # per distinct block: (heads, keys, ty tx)
    for a, z, r, start, items in steps:
        tiles, ytr = qt[a:z, r], yt[r]  # query tiles (M, ty tx); the row's numerators
        torch.bmm(far[a:z], tiles, out=ytr[a:z])  # far: every key with c_K
        for i, c0, c1, run, keys, h0, heads, first, block in items:
            n = c1 - c0
            scores = torch.bmm(kb.as_strided((n, keys, m), (col * m, m, 1), ok + run * m),
                               tiles if c0 == a and c1 == z else tiles[c0 - a : c1 - a])  # (cols, keys, ty tx)
            wb = weights[block]
            if wb is None:
                wb = weights[block] = w[h0 : h0 + heads, i, first : first + keys]
            (scores if heads == 1 else scores.view(-1, heads, keys, t2)).mul_(wb)
            ytr[c0:c1].baddbmm_(vt.as_strided((n, f, keys), (f * col, col, 1), ov + (run // col) * f * col + run % col), scores)
    plan.divide(yt, eps, out, den)


def _near_backward(plan: TilePlan, q, k, v, c, g, dq, dk, dv, need_c: bool):
    """A chunk's ``dq, dk, dv`` (in place, those not None) and ``dc (H, K+1)`` if ``need_c``, from
    ``g (B, H, N, D+1)``, the gradient of numerator and denominator."""
    b, h, n, m = q.shape
    d = v.shape[-1]
    need_q, need_k, need_v = dq is not None, dk is not None, dv is not None
    w = plan.weights(c)
    qb, kb, vb, gb = plan.to_strips(q), plan.to_strips(k), plan.to_strips(v, ones=True), plan.to_strips(g)
    # the far term y = c_K q S, S = k^T [v, 1]: dq = c_K g S^T; dS = c_K q^T g, dk = [v, 1] dS^T, dv = k dS
    kv = _far_sums(k, v)  # (B H, M, D+1)
    qg = q.reshape(b * h, n, m).transpose(1, 2) @ g.reshape(b * h, n, d + 1)  # (B H, M, D+1)
    c_far = c[:, plan.clip].repeat(b)[:, None, None]  # (B H, 1, 1)
    far_k = plan.per_column((qg * c_far).transpose(1, 2)) if need_k else None
    far_v = plan.per_column(qg[:, :, :d] * c_far) if need_v else None
    dqb = q.new_zeros(plan.length, m) if need_q else None  # the near sum of dq, strip by strip
    dkt = plan.new_tiles(q, m) if need_k else None
    dvt = plan.new_tiles(q, d) if need_v else None
    dw = w.new_zeros(w.shape) if need_c else None
    col, t2 = plan.column, plan.t2

    def run_view(buf, run, n, keys, width=None):  # the runs of n columns from token ``run`` of a strip buffer
        ld = buf.stride(0)
        return buf.as_strided((n, keys, width or buf.shape[1]), (col * ld, ld, 1), buf.storage_offset() + run * ld)

    def tile_view(buf, start, n):  # the tiles of n columns from token ``start``: (n, ty tx, F)
        ld = buf.stride(0)
        return buf.as_strided((n, t2, ld), (col * ld, ld, 1), buf.storage_offset() + start * ld)

    steps = plan.steps  # (sets plan.blocks)
    weights = [None] * len(plan.blocks)  # per distinct block: (heads, keys, ty tx)
    for a, z, r, start, items in steps:
        ktiles, vtiles = tile_view(kb, start, z - a), tile_view(vb, start, z - a)
        if need_k:
            torch.bmm(vtiles, far_k[a:z], out=dkt[r, a:z])
        if need_v:
            torch.bmm(ktiles, far_v[a:z], out=dvt[r, a:z])
        for i, c0, c1, run, keys, h0, heads, first, block in items:
            # each key's tile against the runs of its queries (the weights are symmetric)
            nc = c1 - c0
            kt, vt = ktiles[c0 - a : c1 - a], vtiles[c0 - a : c1 - a]
            qr = run_view(qb, run, nc, keys)
            wb = weights[block]
            if wb is None:
                wb = weights[block] = w[h0 : h0 + heads, i, first : first + keys]
            scores = torch.bmm(qr, kt.transpose(1, 2)) if need_v or need_c else None
            if need_q or need_k or need_c:
                dp = torch.bmm(run_view(gb, run, nc, keys), vt.transpose(1, 2))
                if need_c:  # every (query, key) pair once, as in the forward
                    dw[h0 : h0 + heads, i, first : first + keys] += (scores * dp).view(-1, heads, keys, t2).sum(0)
                if need_q or need_k:
                    dp.view(-1, heads, keys, t2).mul_(wb)
                if need_k:
                    dkt[r, c0:c1].baddbmm_(dp.transpose(1, 2), qr)
                if need_q:
                    run_view(dqb, run, nc, keys).baddbmm_(dp, kt)
            if need_v:
                scores.view(-1, heads, keys, t2).mul_(wb)
                dvt[r, c0:c1].baddbmm_(scores.transpose(1, 2), run_view(gb, run, nc, keys, d))
    if need_q:
        plan.from_strips(dqb, dq)
        dq.view(b * h, n, m).baddbmm_(g.reshape(b * h, n, d + 1), (kv * c_far).transpose(1, 2))
    for tiles, out in ((dkt, dk), (dvt, dv)):
        if tiles is not None:
            plan.from_tiles(tiles, out)
    if not need_c:
        return None
    dc = plan.weights_backward(dw)
    # the far term's gradient of c_K: <k^T [v, 1], q^T g> per head
    dc[:, plan.clip] += (kv * qg).sum((1, 2)).view(b, h).sum(0)
    return dc


def _far_sums(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k^T [v, 1]`` per (batch row, head): ``(B H, M, D+1)``."""
    b, h, n, m = k.shape
    kf = k.reshape(b * h, n, m)
    return torch.cat([kf.transpose(1, 2) @ v.reshape(b * h, n, -1), kf.transpose(1, 2) @ kf.new_ones(n, 1)], dim=2)


def tile_shape(grid: tuple[int, int], clip: int) -> tuple[int, int]:
    """``(ty, tx)``: the whole grid when small (one dense block per head), else 8 x 4 (32 queries
    per product; measured fastest here)."""
    hg, wg = grid
    if hg * wg <= WHOLE_GRID_MAX_N:
        return hg, wg
    return min(8, hg), min(4, wg)


def manhattan_offsets_near(q, k, v1, c, grid, clip):
    """The near sum ``sum_{d < K} (c_d - c_K) (q_i . k_{i+delta}) [v_{i+delta}, 1]`` over
    ``2K^2 - 2K + 1`` shifted views (no loop over grid sizes: ``torch.export`` keeps them symbolic).
    ``(B, H, N, E)``."""
    b, h, _, m = q.shape
    e = v1.shape[-1]
    hg, wg = grid
    qg = q.reshape(b, h, hg, wg, m)
    kp = torch.nn.functional.pad(k.reshape(b, h, hg, wg, m), (0, 0, clip, clip, clip, clip))
    vp = torch.nn.functional.pad(v1.reshape(b, h, hg, wg, e), (0, 0, clip, clip, clip, clip))
    near = torch.zeros(b, h, hg, wg, e, dtype=q.dtype, device=q.device)
    for dy in range(-(clip - 1), clip):
        for dx in range(-(clip - 1 - abs(dy)), clip - abs(dy)):
            w = (c[:, abs(dy) + abs(dx)] - c[:, clip])[None, :, None, None, None]  # (1, H, 1, 1, 1)
            ks = kp[:, :, clip + dy : clip + dy + hg, clip + dx : clip + dx + wg]
            vs = vp[:, :, clip + dy : clip + dy + hg, clip + dx : clip + dx + wg]
            near = near + w * (qg * ks).sum(-1, keepdim=True) * vs
    return near.reshape(b, h, hg * wg, e)


def _symbolic(*sizes) -> bool:
    """Sizes traced symbolically (or compiling): the tile plan's loops would fix them."""
    return any(isinstance(x, torch.SymInt) for x in sizes) or torch.compiler.is_compiling()


@full_precision
def manhattan_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rpe_bias: torch.Tensor,
    grid: tuple[int, int],
    rpe_clip: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Non-causal attention on ``grid = (Hg, Wg)`` with a 2D bias ``(H, 2Hg-1, 2Wg-1)`` depending
    only on ``min(|dy| + |dx|, K)``, ``K = rpe_clip``, or its per-distance table ``(H, K+1)``.

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype, padded keys and values zero. Returns
    ``(B, H, N, D)``. Bias gradients land on the entries :func:`manhattan_distances` reads (a
    per-distance table gets the dense form's gradient).
    """
    b, h, n, m = q.shape
    d = v.shape[-1]
    hg, wg = grid
    clip = int(rpe_clip)
    if rpe_bias.dim() == 2:  # per-distance table; unreachable distances take the farthest reachable one's
        dist = rpe_bias[:, torch.arange(clip + 1, device=rpe_bias.device).clamp(max=hg - 1 + wg - 1)]
    else:
        dist = manhattan_distances(rpe_bias, hg, wg, clip)  # (H, K+1)
    dist, eps_h = shifted_bias(dist, clip + 1, False, eps)  # every coefficient <= 1; the shift cancels
    c = torch.exp(dist)
    if _symbolic(hg, wg, n):
        v1 = with_ones_column(v)  # (B, H, N, D+1)
        y = c[None, :, clip, None, None] * (q @ (k.transpose(-1, -2) @ v1))  # far term: every key with c_K
        if clip > 0:
            y = y + manhattan_offsets_near(q, k, v1, c, (hg, wg), clip)
        return y[..., :d] / (y[..., d:] + eps_h[None, :, None, None])
    return ManhattanAttention.apply(q, k, v, c, eps_h, (hg, wg), clip, tile_shape((hg, wg), clip))


register_backend(
    "manhattan", manhattan_attention, takes=("rpe_bias", "grid", "rpe_clip", "eps"), causal=False, noncausal=True,
    rpe_2d=True, needs_rpe_clip=True, symbolic_n=True, keeps_inputs=True, complexity="O(N K^2 (M + D) + N M D)",
    description="exact for a 2D bias of the clipped Manhattan distance: matrix products over tiles near the diagonal, all keys beyond",
)
