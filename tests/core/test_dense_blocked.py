"""The ``dense`` backend computed in blocks of queries with a hand-written backward: equal to the
literal float64 formula (outputs and the gradients of q, k, v and the bias table) for 1D and 2D
biases, causal and not, with padding, separate denominator features, every way of cutting the
work into blocks (remainders, groups of heads, groups of batch rows, one table shared by every
head); the unblocked form agrees; memory kept for the backward is linear in N; the meta device."""

from __future__ import annotations

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling import kernels_dense
from hf_kernattn.modeling.kernels_dense import (DenseBlockProduct, DensePlan, dense_attention,
                                                dense_attention_unblocked)

from tests.reference import assert_float32_matches_float64, bytes_saved_for_backward, literal_reference

B, H, M, D = 2, 3, 4, 5


@pytest.fixture(autouse=True)
def blocked_at_every_size(monkeypatch):
    """The small calls of these tests take the blocked form too (by default a forward+backward of
    a few thousand scores runs unblocked)."""
    monkeypatch.setattr(kernels_dense, "DENSE_UNBLOCKED_SCORES", 0)
    monkeypatch.setattr(kernels_dense, "DENSE_UNBLOCKED_TOKENS", 0)


def _inputs(n, grid, seed, bias=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, n, M, generator=g, dtype=dtype) + 0.1
    k = torch.rand(B, H, n, M, generator=g, dtype=dtype) + 0.1
    v = torch.randn(B, H, n, D, generator=g, dtype=dtype)
    shape = (H, 2 * n - 1) if grid is None else (H, 2 * grid[0] - 1, 2 * grid[1] - 1)
    table = 0.7 * torch.randn(*shape, generator=g, dtype=dtype) if bias else None
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, : min(3, n - 1)] = 0
    return q, k, v, table, mask


def _compare(n, grid, causal, seed, bias=True, split=False, atol=1e-12):
    """Outputs and gradients of q, k, v (and the table, or q_den, k_den) through
    ``kernelized_attention(backend="dense")`` against the literal formula."""
    q, k, v, table, mask = _inputs(n, grid, seed, bias)
    weight = torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    real = mask.bool()[:, None, :, None]
    inputs = [q, k, v] + ([table] if bias else []) + ([q.flip(-1) + 0.05, k.flip(-1) + 0.05] if split else [])
    results = []
    for run in ("dense", "reference"):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        tb = xs[3] if bias else None
        den = dict(q_den=xs[-2], k_den=xs[-1]) if split else {}
        if run == "dense":
            out = hf_kernattn.kernelized_attention(xs[0], xs[1], xs[2], tb, causal=causal, attention_mask=mask,
                                                   grid=grid, backend="dense", **den)
        else:
            out = literal_reference(xs[0], xs[1], xs[2], tb, causal, mask, grid, **den)
        results.append((out, torch.autograd.grad((torch.where(real, out, 0.0) * weight).sum(), xs)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out[real.expand_as(out)], ref[real.expand_as(ref)], rtol=0, atol=atol)
    for a, b in zip(grads, ref_grads):
        # sums of at most N^2 products of O(1) values in float64
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


BLOCKINGS = [None, 1, 40, 100, 250]  # scores per block: the default, one row of one head, ... whole heads


@pytest.mark.parametrize("blocking", BLOCKINGS)
@pytest.mark.parametrize("n,causal", [(1, False), (1, True), (7, False), (7, True), (10, True), (13, False)])
def test_1d_bias_equals_the_literal_formula(monkeypatch, blocking, n, causal):
    monkeypatch.setattr(kernels_dense, "DENSE_MIN_ROWS", 2)
    if blocking:
        monkeypatch.setattr(kernels_dense, "DENSE_BLOCK_SCORES", blocking)
    _compare(n, None, causal, seed=n + 10 * causal + (blocking or 0))


@pytest.mark.parametrize("blocking", BLOCKINGS)
@pytest.mark.parametrize("grid", [(3, 4), (4, 3), (1, 6), (6, 1), (5, 5)])
def test_2d_bias_equals_the_literal_formula(monkeypatch, blocking, grid):
    if blocking:
        monkeypatch.setattr(kernels_dense, "DENSE_BLOCK_SCORES", blocking)
    _compare(grid[0] * grid[1], grid, False, seed=sum(grid) + (blocking or 0))


@pytest.mark.parametrize("blocking", [None, 1, 100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_without_a_bias_and_with_separate_denominator_features(monkeypatch, blocking, causal, split):
    monkeypatch.setattr(kernels_dense, "DENSE_MIN_ROWS", 2)
    if blocking:
        monkeypatch.setattr(kernels_dense, "DENSE_BLOCK_SCORES", blocking)
    _compare(9, None, causal, seed=3 + causal + 2 * split, bias=False, split=split)


@pytest.mark.parametrize("n,grid,causal", [(11, None, False), (11, None, True), (12, (3, 4), False)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("blocking", [1, 30, 100, 250, 10**6])
def test_block_product_with_its_own_or_a_shared_table(n, grid, causal, shared, blocking):
    """``(S * C) W`` of :class:`DenseBlockProduct` directly, a table per head or one for every
    head, for groups of heads of one batch row and groups of whole batch rows."""
    g = torch.Generator().manual_seed(n + blocking + shared)
    b, h = 3, 3
    q, k = (torch.rand(b, h, n, M, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(b, h, n, D, generator=g, dtype=torch.float64, requires_grad=True)
    shape = (2 * n - 1,) if grid is None else (2 * grid[0] - 1, 2 * grid[1] - 1)
    table = torch.rand(1 if shared else h, *shape, generator=g, dtype=torch.float64)
    if causal:  # the causal contract: no coefficient for keys after the query (offsets > 0)
        table[:, n:] = 0
    table.requires_grad_(True)
    plan = DensePlan(b, h, n, grid, causal, block_scores=blocking)
    y = DenseBlockProduct.apply(q, k, w, table.reshape(table.shape[0], -1), plan)
    coef = torch.stack([torch.stack([_offset_entry(table, i, j, n, grid) for j in range(n)], -1) for i in range(n)], -2)
    ref = ((q @ k.transpose(-1, -2)) * coef) @ w
    up = torch.randn(b, h, n, D, generator=g, dtype=torch.float64)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    for a, r in zip(torch.autograd.grad(y, (q, k, w, table), up), torch.autograd.grad(ref, (q, k, w, table), up)):
        torch.testing.assert_close(a[..., :n] if causal and a.shape == table.shape else a,
                                   r[..., :n] if causal and r.shape == table.shape else r, rtol=0, atol=1e-12)


def _offset_entry(table, i, j, n, grid):
    """``table[:, offset(i, j)]`` written out per pair: ``(Ht,)``."""
    if grid is None:
        return table[:, j - i + n - 1]
    (yi, xi), (yj, xj) = divmod(i, grid[1]), divmod(j, grid[1])
    return table[:, yj - yi + grid[0] - 1, xj - xi + grid[1] - 1]


def test_plan_blocks_cover_every_query_once_with_its_keys(monkeypatch):
    """Groups are some heads of one batch row or all heads of whole batch rows; blocks tile the
    queries (whole grid rows in 2D) and, when causal, reach the keys up to their last query."""
    for b, h, n, grid, causal, budget in ((2, 3, 12, (3, 4), False, 40), (3, 4, 10, None, True, 200),
                                          (4, 2, 6, None, False, 10**6), (1, 5, 20, (4, 5), False, 1)):
        monkeypatch.setattr(kernels_dense, "DENSE_MIN_ROWS", 2)
        plan = DensePlan(b, h, n, grid, causal, block_scores=budget)
        seen = torch.zeros(b, h, n, dtype=torch.long)
        for b0, b1, h0, h1, s, e, kend in plan.blocks():
            assert (b1 - b0 == 1) or (h0, h1) == (0, h)
            assert grid is None or (s % grid[1] == 0 and (e - s) % grid[1] == 0)
            assert kend == (n - s if causal else n)
            seen[b0:b1, h0:h1, s:e] += 1
        assert torch.equal(seen, torch.ones_like(seen))


def test_float32_matches_the_float64_formula():
    """float32 in, float32 out: within float32 rounding (relative 1e-5 is ~100 ulps) of sums of a
    few hundred positive terms of the float64 formula, outputs and gradients."""
    grid = (9, 11)
    n = grid[0] * grid[1]
    q, k, v, table, mask = _inputs(n, grid, seed=4, dtype=torch.float32)
    xs32 = [x.clone().requires_grad_(True) for x in (q, k, v, table)]
    xs64 = [x.double().requires_grad_(True) for x in (q, k, v, table)]
    out32 = hf_kernattn.kernelized_attention(*xs32[:3], xs32[3], attention_mask=mask, grid=grid, backend="dense")
    out64 = literal_reference(*xs64[:3], xs64[3], False, mask, grid)
    assert_float32_matches_float64(out32, out64, xs32, xs64, mask)


@pytest.mark.parametrize("n,grid,causal", [(9, None, False), (9, None, True), (12, (3, 4), False)])
def test_the_unblocked_form_for_traced_calls_agrees(monkeypatch, n, grid, causal):
    """The form ``torch.export`` traces (the whole matrix, plain operations) gives the same
    result, and runs when sizes are symbolic or a trace is under way."""
    q, k, v, table, _ = _inputs(n, grid, seed=6)
    blocked = dense_attention(q, k, v, rpe_bias=table, causal=causal, grid=grid)
    unblocked = dense_attention_unblocked(q, k, v, rpe_bias=table, causal=causal, grid=grid)
    torch.testing.assert_close(blocked, unblocked, rtol=0, atol=1e-13)
    monkeypatch.setattr(kernels_dense, "_traced", lambda *sizes: True)
    monkeypatch.setattr(kernels_dense, "DenseBlockProduct", None)  # not reached
    torch.testing.assert_close(dense_attention(q, k, v, rpe_bias=table, causal=causal, grid=grid), unblocked,
                               rtol=0, atol=0)


@pytest.mark.parametrize("grid,causal", [(None, True), ((16, 16), False)])
def test_memory_kept_for_backward_is_linear_in_n(grid, causal):
    """What autograd keeps for the backward: the inputs, the bias table and O(N (M + D)) for the
    division, never an N x N matrix (256 x 256 scores per head would be 256 values per token)."""
    n = 256
    q, k, v, table, _ = _inputs(n, grid, seed=2)
    xs = [x.requires_grad_(True) for x in (q, k, v, table)]
    out, saved = bytes_saved_for_backward(lambda: dense_attention(*xs[:3], rpe_bias=xs[3], causal=causal, grid=grid))
    assert saved <= 12 * B * H * n * (M + D + 1) * 8 + 8 * table.numel() * 8
    out.sum().backward()  # and the backward runs from that


def test_runs_on_the_meta_device():
    """Forward and backward on the meta device (shapes only): no tensor made on the CPU inside."""
    n, grid = 12, (3, 4)
    q, k = (torch.empty(2, 3, n, 4, device="meta", requires_grad=True) for _ in range(2))
    v = torch.empty(2, 3, n, 5, device="meta", requires_grad=True)
    table = torch.empty(3, 5, 7, device="meta", requires_grad=True)
    out = dense_attention(q, k, v, rpe_bias=table, grid=grid)
    assert out.device.type == "meta" and out.shape == (2, 3, n, 5)
    out.sum().backward()
    assert q.grad.device.type == "meta" and table.grad.shape == (3, 5, 7)
    causal = dense_attention(q, k, v, rpe_bias=torch.empty(3, 2 * n - 1, device="meta"), causal=True)
    assert causal.shape == (2, 3, n, 5)


def test_small_calls_with_a_backward_run_unblocked(monkeypatch):
    """A forward+backward runs the unblocked form where ``runs_unblocked`` says so: with a bias
    (or causal) up to DENSE_UNBLOCKED_TOKENS tokens whatever the head count, without one up to
    DENSE_UNBLOCKED_SCORES scores in all; a forward without autograd, or a larger call, blocked."""
    monkeypatch.setattr(kernels_dense, "DENSE_UNBLOCKED_SCORES", B * H * 12 * 12)
    monkeypatch.setattr(kernels_dense, "DENSE_UNBLOCKED_TOKENS", 12)
    calls = []
    monkeypatch.setattr(kernels_dense, "dense_attention_unblocked", lambda *a, **kw: calls.append("unblocked"))

    def form(n, grid=None, bias=True, causal=False, grad=True, heads=H, batch=B):
        calls.clear()
        q, k, v, table, _ = _inputs(n, grid, seed=0, bias=bias)
        q, k, v = (x[:batch, :heads] for x in (q, k, v))
        table = None if table is None else table[:heads]
        with torch.set_grad_enabled(grad):
            dense_attention(q, k, v.requires_grad_(grad), rpe_bias=table, grid=grid, causal=causal)
        return "unblocked" if calls else "blocked"

    # with a table: by tokens, at every head count
    assert form(12, (3, 4)) == "unblocked"
    assert form(12, causal=True, bias=False) == "unblocked"
    assert form(12, heads=1, batch=1) == "unblocked"
    assert form(13) == "blocked"
    assert form(16, (4, 4), heads=1, batch=1) == "blocked"
    # without one: by scores in all (batch x heads x N^2)
    assert form(12, bias=False) == "unblocked"
    assert form(13, bias=False) == "blocked"
    assert form(20, bias=False, heads=1, batch=1) == "unblocked"  # 400 <= 864 scores
    assert form(30, bias=False, heads=1, batch=1) == "blocked"  # 900 > 864
    # no autograd: blocked
    assert form(12, (3, 4), grad=False) == "blocked"
    assert form(12, bias=False, grad=False) == "blocked"


def test_unblocked_rule_as_shipped(monkeypatch):
    """The shipped thresholds (from fwd+bwd timings of both forms, 1 / 4 / 12 heads): with a bias or
    causal, unblocked to 196 tokens (14 x 14) at any head count and blocked from 256 (16 x 16) up;
    without one, by scores in all: 1 head to 1,448 tokens, 12 heads to 418."""
    monkeypatch.undo()  # the shipped values, not this file's blocked-at-every-size ones
    ru = kernels_dense.runs_unblocked
    for heads in (1, 4, 12):
        assert ru(1, heads, 196, True) and not ru(1, heads, 256, True)
    assert not ru(1, 1, 1024, True)  # was unblocked (at most 2^20 scores) before the rule followed the heads
    assert ru(1, 1, 1448, False) and not ru(1, 1, 1449, False)
    assert ru(1, 12, 418, False) and not ru(1, 12, 419, False)
    assert ru(2, 12, 256, False) and not ru(2, 12, 512, False)


def test_causal_with_a_grid_is_refused():
    q, k, v, table, _ = _inputs(12, (3, 4), seed=0)
    with pytest.raises(ValueError, match="causal"):
        dense_attention(q, k, v, rpe_bias=table, causal=True, grid=(3, 4))
