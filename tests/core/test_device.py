"""The attention core on an accelerator (the ``accelerator`` fixture of tests/conftest.py: CUDA
where torch sees it, ``--device`` to choose; skipped without one): every backend that declares
the device against the literal float64 formula on the CPU, outputs and gradients, in float64 and
in float32; a causal state split, carried and resumed on the device equals the whole sequence.
``scripts/gpu_check.sh`` runs these."""

from __future__ import annotations

import itertools

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling.registry import get_backend

from tests.reference import assert_float32_matches_float64, literal_reference

B, H, M, D = 2, 3, 5, 4


def _inputs(n: int, seed: int, grid=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64) + 0.1
    k = torch.rand(B, H, n, M, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    if grid is None:
        bias = 0.5 * torch.randn(H, 2 * n - 1, generator=g, dtype=torch.float64)
    else:
        bias = 0.5 * torch.randn(H, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, :3] = 0
    mask[0, -2:] = 0
    return q, k, v, bias, mask


def _cases(device_type: str = "cuda"):
    """Every combination a backend claims on ``device_type`` (decoding-only backends aside: the
    state test covers them)."""
    for name in hf_kernattn.available_backends():
        spec = get_backend(name)
        for causal, rpe, padded in itertools.product([False, True], [None, "1d", "2d"], [False, True]):
            if (causal and rpe == "2d") or spec.missing(causal=causal, rpe=rpe, key_mask=padded, device=device_type):
                continue
            yield pytest.param(name, causal, rpe, padded, id=f"{name}-causal{int(causal)}-{rpe}-pad{int(padded)}")


def _run(name, causal, rpe, padded, device, dtype):
    """The backend's output and the gradients of a weighted sum of it (q, k, v, bias) on
    ``device`` in ``dtype``; inputs drawn on the CPU in float64 and moved."""
    grid = (3, 4) if rpe == "2d" else None
    n = 12 if grid else 11  # 11: not a multiple of any chunk size
    q, k, v, bias, mask = _inputs(n, seed=1, grid=grid)
    xs = [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (q, k, v, bias)]
    out = hf_kernattn.kernelized_attention(xs[0], xs[1], xs[2], xs[3] if rpe else None, causal,
                                           mask.to(device) if padded else None, grid=grid, backend=name)
    return out, xs, (q, k, v, bias, mask, grid)


@pytest.mark.parametrize("name,causal,rpe,padded", list(_cases()))
def test_backend_on_the_device_equals_the_float64_formula(accelerator, name, causal, rpe, padded):
    """float64 on the device: outputs and gradients within 1e-9 of the literal formula on the CPU
    (sums of at most a few dozen O(1) terms; any wrong key moves them by 1e-2)."""
    out, xs, (q, k, v, bias, mask, grid) = _run(name, causal, rpe, padded, accelerator, torch.float64)
    assert out.device.type == accelerator.type
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, bias)]
    ref = literal_reference(leaves[0], leaves[1], leaves[2], leaves[3] if rpe else None, causal,
                            mask if padded else None, grid)
    weights = torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).reshape(ref.shape)
    got = torch.autograd.grad((out * weights.to(accelerator)).sum(), xs[: 4 if rpe else 3], allow_unused=True)
    want = torch.autograd.grad((ref * weights).sum(), leaves[: 4 if rpe else 3], allow_unused=True)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-9)
    for g, w, label in zip(got, want, ["q", "k", "v", "rpe_bias"]):
        g = torch.zeros_like(xs[0].cpu()) if g is None else g.cpu()
        w = torch.zeros_like(g) if w is None else w
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9, msg=lambda m, label=label: f"grad {label}: {m}")


@pytest.mark.parametrize("name,causal,rpe,padded", [p for p in _cases() if p.values[3]])
def test_backend_on_the_device_in_float32_meets_the_float32_bound(accelerator, name, causal, rpe, padded):
    """float32 on the device (products in float32: no TF32) against the float64 formula: the
    tolerance of every float32 comparison of the suite, at the real query positions."""
    out, xs, (q, k, v, bias, mask, grid) = _run(name, causal, rpe, padded, accelerator, torch.float32)
    xs64 = [x.to(accelerator).requires_grad_(True) for x in (q, k, v)]
    b64 = bias.to(accelerator) if rpe else None
    ref = literal_reference(*xs64, b64, causal, mask.to(accelerator), grid)
    assert_float32_matches_float64(out, ref, xs[:3], xs64, mask.to(accelerator))


@pytest.mark.parametrize("rpe", [None, "1d"])
def test_a_causal_state_split_carried_and_resumed_on_the_device_equals_the_whole(accelerator, rpe):
    """Prefill, a chunk, then one-token steps from the state (``backend="auto"``: decoding takes
    the recurrent form) on the device equal one call over the whole sequence, and the CPU's."""
    n, clip = 13, 3
    q, k, v, bias, _ = _inputs(n, seed=5)
    table = bias[:, n - 1 - clip: n + clip] if rpe else None  # a table clipped at K
    kw = dict(rpe_bias=table.to(accelerator), rpe_clip=clip) if rpe else {}
    qd, kd, vd = (x.to(accelerator) for x in (q, k, v))
    whole = hf_kernattn.kernelized_attention(qd, kd, vd, causal=True, **kw)
    outs, state, p = [], None, 0
    for size in (5, 3, 1, 1, 1, 1, 1):
        out, state = hf_kernattn.kernelized_attention(qd[:, :, p:p + size], kd[:, :, p:p + size], vd[:, :, p:p + size],
                                                      causal=True, initial_state=state, output_final_state=True, **kw)
        assert all(x.device.type == accelerator.type for x in state[:2])
        outs.append(out)
        p += size
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=0, atol=1e-10)
    cpu_kw = dict(rpe_bias=table, rpe_clip=clip) if rpe else {}
    torch.testing.assert_close(whole.cpu(), hf_kernattn.kernelized_attention(q, k, v, causal=True, **cpu_kw),
                               rtol=0, atol=1e-10)
