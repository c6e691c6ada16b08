"""The ``manhattan`` backend built from matrix products over tiles of the grid: equal to the dense
form (float64, outputs and the gradients of q, k, v and the per-distance table) for every tile
shape and grouping, odd and one-row grids, clips from 0 to beyond the grid and padding; linear
memory; any device (no tensor made on the CPU inside)."""

from __future__ import annotations

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling import kernels_manhattan
from hf_kernattn.modeling.kernels_common import manhattan_table
from hf_kernattn.modeling.kernels_manhattan import ManhattanAttention, TilePlan, manhattan_attention

from tests.reference import assert_float32_matches_float64, bytes_saved_for_backward, literal_reference

B, H, M, D = 2, 3, 4, 5


def _inputs(grid, clip, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    q = torch.rand(B, H, n, M, generator=g, dtype=dtype) + 0.1
    k = torch.rand(B, H, n, M, generator=g, dtype=dtype) + 0.1
    v = torch.randn(B, H, n, D, generator=g, dtype=dtype)
    table = 0.7 * torch.randn(H, clip + 1, generator=g, dtype=dtype)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, : min(3, n - 1)] = 0
    return q, k, v, table, mask


def _run(xs, grid, clip, mask, backend):
    q, k, v, table = xs
    bias = table if backend == "manhattan" else manhattan_table(table, *grid)
    return hf_kernattn.kernelized_attention(q, k, v, bias, attention_mask=mask, grid=grid, rpe_clip=clip, backend=backend)


def _compare(grid, clip, seed, atol=1e-11):
    q, k, v, table, mask = _inputs(grid, clip, seed)
    weight = torch.randn(B, H, grid[0] * grid[1], D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    real = mask.bool()[:, None, :, None]
    results = []
    for run in ("manhattan", "reference"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, table)]
        if run == "manhattan":
            out = _run(xs, grid, clip, mask, "manhattan")
        else:
            out = literal_reference(*xs[:3], manhattan_table(xs[3], *grid), False, mask, grid)
        results.append((out, torch.autograd.grad((torch.where(real, out, 0.0) * weight).sum(), xs)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out[real.expand_as(out)], ref[real.expand_as(ref)], rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize("grid", [(5, 7), (1, 9), (9, 1), (6, 10), (3, 3)])
@pytest.mark.parametrize("clip", [0, 1, 2, 4, 30])
@pytest.mark.parametrize("tile", [None, (1, 1), (2, 3), (4, 4), (1, 8), (8, 2)])
def test_tiled_products_equal_the_literal_formula(monkeypatch, grid, clip, tile):
    """Every tile shape (tiles larger than the grid, one-row tiles, tiles that do not divide the
    grid) and the default one (the whole small grid as one tile), outputs and gradients."""
    monkeypatch.setattr(kernels_manhattan, "WHOLE_GRID_MAX_N", 0 if tile else 400)
    if tile:
        monkeypatch.setattr(kernels_manhattan, "tile_shape", lambda g, c: (min(tile[0], g[0]), min(tile[1], g[1])))
    _compare(grid, clip, seed=len(grid) + clip + sum(tile or ()))


@pytest.mark.parametrize("group_tokens", [1, 16, 100])
def test_groups_of_strips_and_of_heads_give_the_same_result(monkeypatch, group_tokens):
    """The walk in groups (whole strips, or one strip a few heads at a time) changes nothing."""
    monkeypatch.setattr(kernels_manhattan, "WHOLE_GRID_MAX_N", 0)
    monkeypatch.setattr(kernels_manhattan, "GROUP_TOKENS", group_tokens)
    _compare((7, 6), 3, seed=5)


@pytest.mark.parametrize("chunk_floats", [1, 1008])
def test_chunks_of_heads_or_batch_rows_give_the_same_result(monkeypatch, chunk_floats):
    """The call in chunks (one head at a time, or one batch row at a time) changes nothing."""
    monkeypatch.setattr(kernels_manhattan, "WHOLE_GRID_MAX_N", 0)
    monkeypatch.setattr(kernels_manhattan, "CHUNK_FLOATS", chunk_floats)
    _compare((7, 6), 3, seed=7)


def test_float32_matches_the_float64_formula():
    """float32 in, float32 out: within float32 rounding of sums of a few dozen positive terms
    (relative 1e-5 is ~100 ulps) of the float64 formula, outputs and gradients."""
    grid, clip = (9, 11), 4
    q, k, v, table, mask = _inputs(grid, clip, seed=3, dtype=torch.float32)
    xs32 = [x.clone().requires_grad_(True) for x in (q, k, v, table)]
    xs64 = [x.double().requires_grad_(True) for x in (q, k, v, table)]
    out32 = _run(xs32, grid, clip, mask, "manhattan")
    out64 = literal_reference(*xs64[:3], manhattan_table(xs64[3], *grid), False, mask, grid)
    assert_float32_matches_float64(out32, out64, xs32, xs64, mask)


def test_the_offset_by_offset_form_for_symbolic_grids_agrees(monkeypatch):
    """The form traced by torch.export with a dynamic grid gives the same result."""
    grid, clip = (6, 5), 3
    q, k, v, table, _ = _inputs(grid, clip, seed=9)
    tiled = manhattan_attention(q, k, v, rpe_bias=table, grid=grid, rpe_clip=clip)
    monkeypatch.setattr(kernels_manhattan, "_symbolic", lambda *sizes: True)
    torch.testing.assert_close(manhattan_attention(q, k, v, rpe_bias=table, grid=grid, rpe_clip=clip), tiled,
                               rtol=0, atol=1e-13)


def test_memory_kept_for_backward_is_linear_in_n(monkeypatch):
    """What autograd keeps for the backward: the inputs and O(N (M + D)) for the far term and
    the output, never the O(N K^2) score blocks: at most 12 tensors of N (M + D + 1) values per
    head (the blocks of K = 8 alone would be 2K^2 = 128 values per token and head)."""
    monkeypatch.setattr(kernels_manhattan, "WHOLE_GRID_MAX_N", 0)
    grid, clip = (16, 16), 8
    q, k, v, table, _ = _inputs(grid, clip, seed=1)
    xs = [x.requires_grad_(True) for x in (q, k, v, table)]
    out, saved = bytes_saved_for_backward(lambda: manhattan_attention(*xs[:3], rpe_bias=xs[3], grid=grid, rpe_clip=clip))
    n = grid[0] * grid[1]
    assert saved <= 12 * B * H * n * (M + D + 1) * 8
    out.sum().backward()  # and the backward runs from that


def test_plan_has_one_product_per_strip_offset():
    """Tiles of 4 x 4 on a 32 x 32 grid, K = 16: strips 4 apart at most (|dx| <= 15), the run
    of offset 0 spans the tile's rows and 15 rows each side."""
    plan = TilePlan(1, 2, (32, 32), 16, (4, 4), "cpu")
    assert sorted(s for s, _ in plan.offsets) == list(range(-4, 5))
    assert dict(plan.offsets)[0] == 15 and plan.keys[0] == (4 + 30) * 4


def test_runs_on_any_device_without_cpu_tensors():
    """Forward and backward on the meta device: a tensor made on the CPU inside the kernel
    would meet the inputs' device and fail."""
    q, k, v, table = (torch.empty(2, 3, 35, 4, device="meta", requires_grad=True),
                      torch.empty(2, 3, 35, 4, device="meta", requires_grad=True),
                      torch.empty(2, 3, 35, 5, device="meta", requires_grad=True),
                      torch.empty(3, 4, device="meta", requires_grad=True))
    out = ManhattanAttention.apply(q, k, v, table.exp(), torch.ones(3, device="meta"), (5, 7), 3, (2, 3))
    assert out.device.type == "meta" and out.shape == (2, 3, 35, 5)
    out.sum().backward()
    out = manhattan_attention(q, k, v, rpe_bias=table, grid=(5, 7), rpe_clip=3)
    out.sum().backward()
    assert q.grad.device.type == "meta" and table.grad.shape == (3, 4)


@pytest.mark.parametrize("group_tokens", [64, 128, 200])
def test_groups_hold_whole_batch_rows_or_heads_of_one(monkeypatch, group_tokens):
    """A group of (batch row, head) pairs is whole batch rows or some heads of one batch row (the
    weights are per head), whatever the group size; the result is the same."""
    plan = TilePlan(B, H, (7, 6), 3, (4, 4), "cpu", group_tokens=group_tokens)
    for _, _, r0, r1 in plan.groups:
        assert (r0 % H == 0 and (r1 - r0) % H == 0) or r0 // H == (r1 - 1) // H
    monkeypatch.setattr(kernels_manhattan, "WHOLE_GRID_MAX_N", 0)
    monkeypatch.setattr(kernels_manhattan, "GROUP_TOKENS", group_tokens)
    _compare((7, 6), 3, seed=6)


def test_inputs_laid_out_token_major_give_the_same_result(monkeypatch):
    """q, k, v as the attention module passes them ((B, N, H, F) transposed to (B, H, N, F):
    not contiguous): the same outputs and gradients as from contiguous copies."""
    monkeypatch.setattr(kernels_manhattan, "WHOLE_GRID_MAX_N", 0)
    grid, clip = (7, 6), 3
    q, k, v, table, _ = _inputs(grid, clip, seed=11)
    results = []
    for strided in (False, True):
        xs = [x.transpose(1, 2).contiguous().transpose(1, 2) if strided else x.clone() for x in (q, k, v)]
        xs = [x.requires_grad_(True) for x in xs] + [table.clone().requires_grad_(True)]
        assert all(x.is_contiguous() != strided for x in xs[:3])
        out = manhattan_attention(*xs[:3], rpe_bias=xs[3], grid=grid, rpe_clip=clip)
        results.append((out, torch.autograd.grad((out * out.detach()).sum(), xs)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
