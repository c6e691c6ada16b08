"""Attention with a 2D bias of the clipped Manhattan distance (Horn et al. 2021), in O(N K^2).

Formula, on a row-major ``(Hg, Wg)`` token grid with ``d_ij = min(|dy| + |dx|, K)`` for the
offsets ``dy = y_j - y_i``, ``dx = x_j - x_i`` and ``c_d = exp(b_d)``::

    out_i = sum_j c_{d_ij} (q_i . k_j) v_j / (sum_j c_{d_ij} (q_i . k_j) + eps)

Every key at distance ``>= K`` carries ``c_K``, so the sums split into a far term over all keys
and a near sum over the ``2K^2 - 2K + 1`` offsets closer than K::

    Y_i = c_K q_i [S, z] + sum_{|dy|+|dx| < K} (c_d - c_K) (q_i . k_{i+delta}) [v_{i+delta}, 1]

with ``[S, z] = sum_j k_j^T [v_j, 1]``; ``out_i = Y_i[:D] / (Y_i[D] + eps)``.

The near sum is computed from matrix products (:class:`ManhattanNearProduct`). The grid is cut
into tiles of ``Ty x Tx`` tokens and stored strip by strip: strips of ``Tx`` columns, each strip
row-major, so that a tile is ``Ty Tx`` consecutive tokens and, in the strip ``s`` strips to
its side, the rows its diamond reaches (``Ty + 2 h_s``, ``h_s = K - 1 - min |dx|``) are one
consecutive run of ``(Ty + 2 h_s) Tx`` tokens. For each strip offset ``s`` one batched product
over all tiles gives the ``(Ty Tx, (Ty + 2 h_s) Tx)`` score blocks; they are weighed by the
``c_d - c_K`` of each (query, key) pair (0 beyond the diamond: a fixed block per head and
offset, with the rows of runs that leave the grid zeroed in the blocks of the tile rows near its
edges, so one pass weighs a block), and one more product adds them times the values. The blocks cover about 1.3-2x the
``2K^2`` keys of the diamond (the tiles' corners), against ``N`` for the dense form. Tiles
whose strip ``s`` lies off the grid skip that product; rows of a run above or below the grid
(they read a neighbouring strip) get weight 0. A small grid is one tile (the dense form).

Cost: time O(N K^2 (M + D) + N M D); memory O(N (M + D)): for the backward the product keeps
only its inputs q, k, [v, 1] and the coefficients (it rebuilds the strips and recomputes each
score block), the far term and the division their O(N (M + D)) operands; score blocks exist
for one group of strips (a few thousand tokens) at a time. :func:`manhattan_table` turns a per-distance table into the 2D
bias ``(H, 2Hg-1, 2Wg-1)`` the other backends take; :func:`manhattan_distances` reads the
per-distance values back from such a bias (the backend's input). The plain reference is the
dense form (``kernels_dense``) on :func:`manhattan_table`'s bias; :func:`manhattan_offsets_near`
is the same near sum written offset by offset (the form traced by ``torch.export`` with a
dynamic grid, whose sizes are symbolic).
"""

from __future__ import annotations

import torch

from .kernels_common import full_precision, shifted_bias, with_ones_column


def manhattan_index(grid_h: int, grid_w: int, clip: int, device=None) -> torch.Tensor:
    """``(2Hg-1, 2Wg-1)`` long tensor: ``min(|dy| + |dx|, K)`` for every 2D offset."""
    dy = torch.arange(-(grid_h - 1), grid_h, device=device).abs()
    dx = torch.arange(-(grid_w - 1), grid_w, device=device).abs()
    return (dy[:, None] + dx[None, :]).clamp(max=clip)


def manhattan_table(distance_bias: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Per-distance bias ``(H, K+1)`` (entry d holds ``b_d``, the last one every distance >= K)
    -> the 2D bias ``(H, 2Hg-1, 2Wg-1)`` of the clipped Manhattan distance."""
    clip = distance_bias.shape[-1] - 1
    return distance_bias[:, manhattan_index(grid_h, grid_w, clip, distance_bias.device)]


def manhattan_distances(rpe_bias: torch.Tensor, grid_h: int, grid_w: int, clip: int) -> torch.Tensor:
    """The per-distance values ``(H, K+1)`` of a 2D bias of the clipped Manhattan distance, each
    read at one offset of that distance (``dy = min(d, Hg-1)``, ``dx = d - dy``); distances no
    pair of the grid reaches get the farthest reachable one's (no key uses them)."""
    reach = (grid_h - 1) + (grid_w - 1)
    d = torch.arange(clip + 1, device=rpe_bias.device).clamp(max=reach)
    dy = d.clamp(max=grid_h - 1)
    return rpe_bias[:, grid_h - 1 + dy, grid_w - 1 + (d - dy)]


# Grids of at most this many tokens are one tile (see :func:`tile_shape`).
WHOLE_GRID_MAX_N = 400
# Tokens of the strips walked at once: their score blocks and accumulators stay in cache.
GROUP_TOKENS = 4096


class TilePlan:
    """The geometry of :class:`ManhattanNearProduct` for one call: tiles of ``ty x tx`` tokens
    on a ``(hg, wg)`` grid (padded to ``(hq, wq)``), the strip offsets ``s`` with the half-height
    ``h_s`` of their runs, the weight index of every (run position, tile position) pair, the
    masks of runs that leave the grid, and the groups of strips walked at once.

    The strip layout of a ``(B, H, N, F)`` tensor is a flat ``(margin + L + margin, F)`` buffer,
    ``L = ntx B H hq tx`` tokens ordered (strip, batch row, head, row, column in strip), zero
    outside the grid and in the margins. Tile ``t`` is tokens ``[t ty tx, (t + 1) ty tx)``; its
    run of offset ``s`` starts ``s B H hq tx - h_s tx`` tokens from there (strip ``s`` to the
    side, ``h_s`` rows up), so all runs of an offset are one strided view."""

    def __init__(self, b: int, h: int, grid: tuple[int, int], clip: int, tile: tuple[int, int], device,
                 group_tokens: int | None = None) -> None:
        hg, wg = grid
        ty, tx = tile
        self.b, self.h, self.hg, self.wg, self.clip, self.ty, self.tx = b, h, hg, wg, clip, ty, tx
        self.nty, self.ntx = -(-hg // ty), -(-wg // tx)
        self.hq, self.wq = self.nty * ty, self.ntx * tx
        self.t2 = ty * tx
        self.per_strip = b * h * self.nty  # tiles of one strip (every batch row and head)
        reach_y, reach_x = min(clip - 1, hg - 1), min(clip - 1, wg - 1)
        offsets = []
        for s in range(-(self.ntx - 1), self.ntx):
            nearest = 0 if s == 0 else (abs(s) - 1) * tx + 1  # the smallest |dx| between a tile and strip s
            if nearest <= reach_x:
                offsets.append((s, min(clip - 1 - nearest, reach_y, (self.nty - 1) * ty)))
        self.offsets = sorted(offsets, key=lambda o: abs(o[0]))  # s = 0 first: it covers every strip
        offsets = self.offsets
        self.keys = [(ty + 2 * hs) * tx for _, hs in offsets]
        self.max_keys = max(self.keys, default=0)
        self.margin = max((hs * tx for _, hs in offsets), default=0)
        self.length = self.ntx * self.per_strip * self.t2
        group_tokens = group_tokens or GROUP_TOKENS
        if self.per_strip * self.t2 <= group_tokens:  # whole strips (every row and head) at a time
            step = group_tokens // (self.per_strip * self.t2)
            self.groups = [(x, min(x + step, self.ntx), 0, b * h) for x in range(0, self.ntx, step)]
        else:  # one strip, a few (batch row, head) pairs at a time: whole batch rows, or heads of one
            step = max(1, group_tokens // (self.nty * self.t2))
            step = step // h * h if step >= h else max(x for x in range(1, step + 1) if h % x == 0)
            self.groups = [(x, x + 1, r, min(r + step, b * h)) for x in range(self.ntx) for r in range(0, b * h, step)]
        # distance index of every (run position, tile position) pair, per offset; clip = no near weight
        iy = torch.arange(ty, device=device).repeat_interleave(tx)[None, :]
        ix = torch.arange(tx, device=device).repeat(ty)[None, :]
        index = torch.full((len(offsets), self.max_keys, self.t2), clip, dtype=torch.long, device=device)
        self.masks = []
        for i, (s, hs) in enumerate(offsets):
            run = ty + 2 * hs
            ry = torch.arange(run, device=device).repeat_interleave(tx)[:, None]
            rx = torch.arange(tx, device=device).repeat(run)[:, None]
            index[i, : self.keys[i]] = ((ry - hs - iy).abs() + (s * tx + rx - ix).abs()).clamp(max=clip)
            # rows of a run outside the grid read a neighbouring strip: weight 0
            reach = min(-(-hs // ty), self.nty)  # tile rows whose run starts above the grid (as many end below it)
            rows = torch.arange(self.nty, device=device)[:, None] * ty - hs + torch.arange(run, device=device)[None, :]
            inside = ((rows >= 0) & (rows < self.hq)).repeat_interleave(tx, dim=1)[:, :, None]  # (nty, keys, 1)
            if not reach:
                masks = []
            elif 2 * reach >= self.nty:
                masks = [(0, self.nty, inside)]
            else:
                masks = [(0, reach, inside[:reach]), (self.nty - reach, self.nty, inside[self.nty - reach :])]
            self.masks.append(masks)
        self.index = index

    def weights(self, c: torch.Tensor) -> torch.Tensor:
        """Per-distance coefficients ``c (H, K+1)`` -> the near weights ``c_d - c_K`` (0 from
        distance K on) of every (run position, tile position) pair: ``(H, offsets, max keys, ty tx)``."""
        near = torch.cat([c[:, : self.clip] - c[:, self.clip :], torch.zeros_like(c[:, :1])], dim=1)
        return near[:, self.index]

    def row_classes(self, w: torch.Tensor) -> list[list[tuple[int, int, torch.Tensor]]]:
        """The weights ``w (H, offsets, max keys, ty tx)`` per offset and class of tile rows,
        the masks of runs that leave the grid folded in: ``(a, z, block)`` for the tile rows
        ``[a, z)``, ``block (H, z - a or 1, keys, ty tx)`` (one pass weighs a score block)."""
        classes = []
        for i, masks in enumerate(self.masks):
            wi = w[:, i, None, : self.keys[i]]
            rows, start = [], 0
            for a, z, m in masks:
                if a > start:
                    rows.append((start, a, wi))
                rows.append((a, z, wi * m))
                start = z
            if start < self.nty:
                rows.append((start, self.nty, wi))
            classes.append(rows)
        return classes

    def weights_backward(self, dw: torch.Tensor) -> torch.Tensor:
        """The gradient of :meth:`weights`: ``dw (H, offsets, max keys, ty tx)`` -> ``dc (H, K+1)``."""
        dnear = dw.new_zeros(dw.shape[0], self.clip + 1).index_add_(1, self.index.flatten(), dw.flatten(1))
        dc = dnear.clone()
        dc[:, self.clip] = -dnear[:, : self.clip].sum(1)
        return dc

    def to_strips(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, N, F)`` -> the zero-padded strip buffer ``(margin + L + margin, F)``."""
        f = x.shape[-1]
        buf = x.new_empty(2 * self.margin + self.length, f)
        buf[: self.margin].zero_()
        buf[self.margin + self.length :].zero_()
        region = buf[self.margin : self.margin + self.length].view(self.ntx, self.b, self.h, self.hq, self.tx, f)
        xg = x.reshape(self.b, self.h, self.hg, self.wg, f)
        full = self.wg // self.tx
        if self.hq > self.hg:  # the padding rows and columns of the grid
            region[:, :, :, self.hg :].zero_()
        if full < self.ntx:
            region[full].zero_()
        if full:
            region[:full, :, :, : self.hg].copy_(
                xg[:, :, :, : full * self.tx].reshape(self.b, self.h, self.hg, full, self.tx, f).permute(3, 0, 1, 2, 4, 5))
        if full < self.ntx:
            region[full, :, :, : self.hg, : self.wg - full * self.tx].copy_(xg[:, :, :, full * self.tx :])
        return buf

    def from_tiles(self, y: torch.Tensor) -> torch.Tensor:
        """Tiles ``(ntx B H nty, ty tx, F)`` -> ``(B, H, N, F)``."""
        f = y.shape[-1]
        y = y.view(self.ntx, self.b, self.h, self.hq, self.tx, f).permute(1, 2, 3, 0, 4, 5)
        y = y.reshape(self.b, self.h, self.hq, self.wq, f)[:, :, : self.hg, : self.wg]
        return y.reshape(self.b, self.h, self.hg * self.wg, f)

    def tiles(self, buf: torch.Tensor) -> torch.Tensor:
        """The tiles of a strip buffer: ``(ntx B H nty, ty tx, F)``, a view."""
        return buf[self.margin : self.margin + self.length].view(-1, self.t2, buf.shape[-1])

    def span(self, i: int, group: tuple[int, int, int, int]) -> tuple[int, int]:
        """The tiles ``[t0, t1)`` of a group (strips ``[x0, x1)``, rows ``[r0, r1)`` of
        ``B H``) whose strip at offset ``i`` lies on the grid (``t0 >= t1``: none)."""
        s = self.offsets[i][0]
        x0, x1, r0, r1 = group
        a, z = max(x0, -s), min(x1, self.ntx - s)
        if r1 - r0 == self.b * self.h:
            return a * self.per_strip, z * self.per_strip
        return (a * self.per_strip + r0 * self.nty, a * self.per_strip + r1 * self.nty) if a < z else (0, 0)

    def runs(self, buf: torch.Tensor, i: int, t0: int, t1: int) -> torch.Tensor:
        """The runs of offset ``i`` of tiles ``[t0, t1)`` in a strip buffer: ``(tiles, keys, F)``,
        an overlapping view (consecutive tiles' runs share rows)."""
        s, hs = self.offsets[i]
        f = buf.shape[-1]
        start = self.margin + (t0 + s * self.per_strip) * self.t2 - hs * self.tx
        return buf.as_strided((t1 - t0, self.keys[i], f), (self.t2 * f, f, 1), buf.storage_offset() + start * f)

    def by_head(self, scores: torch.Tensor, i: int, group: tuple[int, int, int, int]) -> tuple[torch.Tensor, slice]:
        """Score blocks ``(tiles, keys, ty tx)`` of offset ``i`` and a group as ``(strips, batch
        rows, heads, tile rows, keys, ty tx)``, with the heads they hold (a group holds whole
        batch rows, or some heads of one)."""
        r0, r1 = group[2:]
        heads = min(r1 - r0, self.h)
        view = scores.view(-1, (r1 - r0) // heads, heads, self.nty, self.keys[i], self.t2)
        return view, slice(r0 % self.h, r0 % self.h + heads)

    def weigh(self, scores: torch.Tensor, i: int, group: tuple[int, int, int, int],
              classes: list[list[tuple[int, int, torch.Tensor]]] | None) -> None:
        """In place: transposed scores ``(tiles, keys, ty tx)`` of offset ``i`` and a group
        times their weights (:meth:`row_classes`; None: masks only), 0 for keys off the grid."""
        view, heads = self.by_head(scores, i, group)
        if classes is None:
            for a, z, m in self.masks[i]:
                view[:, :, :, a:z].mul_(m)
        else:
            for a, z, block in classes[i]:
                view[:, :, :, a:z].mul_(block[heads])


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, i: int) -> None:
    """``out = a @ b`` for the first offset (``i = 0``), ``out += a @ b`` after it."""
    if i == 0:
        torch.bmm(a, b, out=out)
    else:
        out.baddbmm_(a, b)


class ManhattanNearProduct(torch.autograd.Function):
    """The near sum of :func:`manhattan_attention`:
    ``Y_i = sum_{d_ij < K} (c_{d_ij} - c_K) (q_i . k_j) [v_j, 1]``, from matrix products over the
    tiles of a :class:`TilePlan` (see the module docstring), with a hand-written backward.

    ``q, k (B, H, N, M)``, ``v1 (B, H, N, E)`` (values with their ones column), ``c (H, K+1)``
    the per-distance coefficients ``exp(b_d)``. Returns ``Y (B, H, N, E)``.
    Saves only its inputs: the backward rebuilds the strips and recomputes the products: the
    gradient of q from each query's tile against its keys' runs, those of k, v and the weights
    from each key's tile against its queries' runs (the weights are symmetric in the two, so the
    blocks and their weights are the same)."""

    @staticmethod
    @full_precision
    def forward(ctx, q, k, v1, c, plan):  # type: ignore[override]
        classes = plan.row_classes(plan.weights(c))
        qb, kb, vb = (plan.to_strips(x) for x in (q, k, v1))
        qt = plan.tiles(qb)
        y = qt.new_empty(qt.shape[0], plan.t2, v1.shape[-1])  # offset 0 (first, every strip) writes it
        for group in plan.groups:
            for i in range(len(plan.offsets)):
                t0, t1 = plan.span(i, group)
                if t0 >= t1:
                    continue
                scores = torch.bmm(plan.runs(kb, i, t0, t1), qt[t0:t1].transpose(1, 2))  # (tiles, keys, ty tx)
                plan.weigh(scores, i, group, classes)
                _accumulate(y[t0:t1], scores.transpose(1, 2), plan.runs(vb, i, t0, t1), i)
        ctx.save_for_backward(q, k, v1, c)
        ctx.plan = plan
        return plan.from_tiles(y)

    @staticmethod
    @full_precision
    def backward(ctx, dy):  # type: ignore[override]
        q, k, v1, c = ctx.saved_tensors
        plan = ctx.plan
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]
        w = plan.weights(c)
        classes = plan.row_classes(w)
        qb, kb, vb, gb = (plan.to_strips(x) for x in (q, k, v1, dy))
        qt, kt, vt, gt = (plan.tiles(x) for x in (qb, kb, vb, gb))
        dq = torch.empty_like(qt) if need_q else None  # offset 0 (first, every strip) writes them
        dk = torch.empty_like(kt) if need_k else None
        dv = torch.empty_like(vt) if need_v else None
        dw = w.new_zeros(plan.b * plan.h, *w.shape[1:]) if need_w else None  # row b H + h like the strips
        t2 = plan.t2
        for group in plan.groups:
            for i in range(len(plan.offsets)):
                t0, t1 = plan.span(i, group)
                if t0 >= t1:
                    continue
                keys = plan.keys[i]
                r0, r1 = group[2:]
                if need_q:  # each query's tile against the runs of its keys
                    kr = plan.runs(kb, i, t0, t1)
                    dp = torch.bmm(plan.runs(vb, i, t0, t1), gt[t0:t1].transpose(1, 2))  # d(weighted scores), transposed
                    plan.weigh(dp, i, group, classes)
                    _accumulate(dq[t0:t1], dp.transpose(1, 2), kr, i)
                if need_k or need_v or need_w:  # each key's tile against the runs of its queries (the same weights)
                    qr, gr = plan.runs(qb, i, t0, t1), plan.runs(gb, i, t0, t1)
                    scores = torch.bmm(qr, kt[t0:t1].transpose(1, 2))
                    if need_k or need_w:
                        dp = torch.bmm(gr, vt[t0:t1].transpose(1, 2))
                        plan.weigh(dp, i, group, None)
                        if need_w:  # every (query, key) pair once, as in the forward
                            dw[r0:r1, i, :keys] += (scores * dp).view(-1, r1 - r0, plan.nty, keys, t2).sum((0, 2))
                        if need_k:
                            view, heads = plan.by_head(dp, i, group)
                            view.mul_(w[heads, i, None, :keys])
                            _accumulate(dk[t0:t1], dp.transpose(1, 2), qr, i)
                    if need_v:
                        plan.weigh(scores, i, group, classes)
                        _accumulate(dv[t0:t1], scores.transpose(1, 2), gr, i)
        grads = [None if x is None else plan.from_tiles(x) for x in (dq, dk, dv)]
        if dw is not None:
            dw = plan.weights_backward(dw.view(plan.b, -1, *dw.shape[1:]).sum(0))
        return (*grads, dw, None)


def tile_shape(grid: tuple[int, int], clip: int) -> tuple[int, int]:
    """Tile ``(ty, tx)`` for a grid and clip: the whole grid when it is small (one block per
    head: the dense form, whose product beats many small ones), else about 16 tokens a tile
    (products of that size run near the machine's matrix rate while the tiles' corners add
    little beyond the diamond)."""
    hg, wg = grid
    if hg * wg <= WHOLE_GRID_MAX_N:
        return hg, wg
    ty = min(4, hg)
    tx = min(max(16 // ty, 4), wg)
    return ty, tx


def manhattan_offsets_near(q, k, v1, c, grid, clip):
    """The near sum ``sum_{d < K} (c_d - c_K) (q_i . k_{i+delta}) [v_{i+delta}, 1]``, offset by
    offset: ``2K^2 - 2K + 1`` shifted views of zero-padded k and v1 (elementwise; no loop over
    the grid's sizes, so ``torch.export`` keeps them symbolic). ``(B, H, N, E)``."""
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
    """Sizes that ``torch.export`` / ``torch.compile`` trace symbolically: the tile plan's Python
    loops would fix them, so the offset-by-offset form runs instead."""
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
    """Non-causal attention on a ``grid = (Hg, Wg)`` with a 2D bias ``(H, 2Hg-1, 2Wg-1)`` that
    depends only on ``min(|dy| + |dx|, K)``, ``K = rpe_clip`` (see the module docstring), or
    with that bias as its per-distance table ``(H, K+1)`` (entry d holds ``b_d``).

    ``q, k (B, H, N, M)``, ``v (B, H, N, D)`` of one dtype (``N = Hg Wg``), padded keys and values
    already zero. Returns ``(B, H, N, D)``. Gradients of the bias land on the entries
    :func:`manhattan_distances` reads (one per distance: the gradient of a per-distance table
    the bias was built from is the same as with the dense form).
    """
    b, h, n, m = q.shape
    d = v.shape[-1]
    hg, wg = grid
    clip = int(rpe_clip)
    if rpe_bias.dim() == 2:  # the per-distance table; distances no pair reaches take the farthest reachable one's
        dist = rpe_bias[:, torch.arange(clip + 1, device=rpe_bias.device).clamp(max=hg - 1 + wg - 1)]
    else:
        dist = manhattan_distances(rpe_bias, hg, wg, clip)  # (H, K+1)
    dist, eps_h = shifted_bias(dist, clip + 1, False, eps)  # every coefficient <= 1; the shift cancels
    c = torch.exp(dist)
    eps_h = eps_h[None, :, None]  # (1, H, 1)
    v1 = with_ones_column(v)  # (B, H, N, D+1)
    # far term: every key with c_K
    y = c[None, :, clip, None, None] * (q @ (k.transpose(-1, -2) @ v1))  # (B, H, N, D+1)
    if clip > 0:
        if _symbolic(hg, wg, n):
            y = y + manhattan_offsets_near(q, k, v1, c, (hg, wg), clip)
        else:
            plan = TilePlan(b, h, (hg, wg), clip, tile_shape((hg, wg), clip), q.device)
            y = y + ManhattanNearProduct.apply(q, k, v1, c, plan)
    return y[..., :d] / (y[..., d:] + eps_h[..., None])
