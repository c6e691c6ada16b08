"""The suite's tolerance between two float32 evaluations of one formula in different summation
orders (``tests.reference.reorder_atol``): it holds for real reorderings at any magnitude, and a
wrong formula exceeds it by orders of magnitude."""

from __future__ import annotations

import pytest
import torch

from tests.reference import assert_reordered_close, reorder_atol


def _state_two_ways(n: int, m: int, d: int, scale: float, seed: int):
    """The recurrent state ``S = sum_j phi(k_j) v_j^T`` in float32 as one matrix product and as
    a running sum of outer products (another order of the same n terms)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.rand(n, m, generator=g) * scale
    v = torch.randn(n, d, generator=g) * scale
    whole = k.T @ v
    running = torch.zeros(m, d)
    for j in range(n):
        running = running + torch.outer(k[j], v[j])
    return whole, running, k, v


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
@pytest.mark.parametrize("seed", range(4))
def test_two_orders_of_one_sum_differ_yet_stay_within_the_bound(scale, seed):
    whole, running, _, _ = _state_two_ways(64, 8, 8, scale, seed)
    assert not torch.equal(running, whole)  # bitwise equality would fail: the orders round apart
    assert_reordered_close(running, whole, terms=64)


def test_the_bound_scales_with_the_magnitude_as_measured_on_another_machine():
    """A state of magnitude 72 whose smallest entries are off by 1.24e-5 (1.7e-7 of 72: an exported
    graph summing in another order, measured on an AVX-512 machine) passes, where a fixed
    ``atol=1e-6`` (plus ``rtol`` of each entry's own size) fails."""
    want = torch.tensor([72.0, -40.0, 0.01, 3.0])
    got = want + torch.tensor([0.0, 0.0, 1.24e-5, 0.0])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_reordered_close(got, want, terms=7)


def test_a_wrong_formula_exceeds_the_bound_by_far():
    """One key left out of a sum of 64 moves the state by far more than the bound allows."""
    whole, _, k, v = _state_two_ways(64, 8, 8, 1.0, 0)
    missing = k[1:].T @ v[1:]
    atol = reorder_atol(missing, whole, terms=64)
    assert float((missing - whole).abs().max()) > 20 * atol
    with pytest.raises(AssertionError):
        assert_reordered_close(missing, whole, terms=64)


def test_integer_tensors_are_compared_exactly_and_the_dtype_sets_eps():
    assert_reordered_close(torch.tensor([1, 2]), torch.tensor([1, 2]), terms=10)
    with pytest.raises(AssertionError):
        assert_reordered_close(torch.tensor([1, 2]), torch.tensor([1, 3]), terms=10)
    x = torch.ones(3, dtype=torch.float64)
    assert reorder_atol(x, terms=10) == 10 * torch.finfo(torch.float64).eps
    assert reorder_atol(x.float(), terms=10, layers=2) == 20 * torch.finfo(torch.float32).eps
