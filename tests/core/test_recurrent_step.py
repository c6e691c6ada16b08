"""The recurrent step in place (decoding: the state's own tensors written) and out of place run
the same operations: the same bits, for contiguous and non-contiguous states, float32 and
float64, with and without separate denominator features; and both equal the formula."""

from __future__ import annotations

import pytest
import torch

from hf_kernattn.modeling.kernels_linear import recurrent_step

B, H, M, D = 2, 3, 5, 4


def _inputs(dtype, split, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = rand(B, H, 1, M), rand(B, H, 1, M), torch.randn(B, H, 1, D, generator=g, dtype=torch.float64).to(dtype)
    den = (rand(B, H, 1, M + 1), rand(B, H, 1, M + 1)) if split else (None, None)
    return q, k, v, den, rand(B, H, M, D), rand(B, H, M + 1 if split else M)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("split", [False, True])
def test_in_place_gives_the_out_of_place_results_bitwise(dtype, split):
    q, k, v, den, kv, z = _inputs(dtype, split)
    a_kv, a_z, b_kv, b_z = kv.clone(), z.clone(), kv.clone(), z.clone()
    for t in range(3):
        q_t, k_t, v_t = q * (t + 1), k + t, v - t
        got = recurrent_step(q_t, k_t, v_t, a_kv, a_z, 1e-6, *den, in_place=True)
        want = recurrent_step(q_t, k_t, v_t, b_kv, b_z, 1e-6, *den)
        assert got[1] is a_kv and got[2] is a_z
        b_kv, b_z = want[1], want[2]
        assert torch.equal(got[0], want[0]) and torch.equal(a_kv, b_kv) and torch.equal(a_z, b_z)
    if den[0] is None:  # and the formula, in float64
        ref_kv, ref_z = kv.double(), z.double()
        for t in range(3):
            q_t, k_t, v_t = (q * (t + 1)).double(), (k + t).double(), (v - t).double()
            ref_kv = ref_kv + k_t.transpose(-1, -2) @ v_t
            ref_z = ref_z + k_t[:, :, 0]
            out = (q_t @ ref_kv) / ((q_t * ref_z[:, :, None]).sum(-1, keepdim=True) + 1e-6)
        tol = 1e-5 if dtype == torch.float32 else 1e-12  # a few roundings of O(1) values
        torch.testing.assert_close(got[0].double(), out, rtol=tol, atol=tol)


def test_a_non_contiguous_state_is_updated_in_place():
    q, k, v, _, kv, z = _inputs(torch.float64, False, seed=1)
    strided = kv.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    assert not strided.is_contiguous()
    a_z, b_kv, b_z = z.clone(), kv.clone(), z.clone()
    got = recurrent_step(q, k, v, strided, a_z, 1e-6, in_place=True)
    want = recurrent_step(q, k, v, b_kv, b_z, 1e-6, in_place=True)
    assert got[1] is strided
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(strided, b_kv) and torch.equal(a_z, b_z)
