"""Every registered backend against the dense float64 reference, for every combination it claims."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling.registry import get_backend

from tests.reference import literal_reference

B, H, M, D = 2, 3, 5, 4


def _inputs(n: int, seed: int = 0, grid=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64) + 0.1
    k = torch.rand(B, H, n, M, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    if grid is None:
        bias = 0.5 * torch.randn(H, 2 * n - 1, generator=g, dtype=torch.float64)
    else:
        bias = 0.5 * torch.randn(H, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, :3] = 0  # left padding in one row
    mask[0, -2:] = 0  # right padding in the other
    return q, k, v, bias, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rpe", [None, "1d", "2d"])
def test_dense_matches_literal_formula(causal, rpe):
    if causal and rpe == "2d":
        pytest.skip("causal is 1D only")
    grid = (2, 3) if rpe == "2d" else None
    n = 6
    q, k, v, bias, mask = _inputs(n, grid=grid)
    bias = None if rpe is None else bias
    out = hf_kernattn.kernelized_attention(q, k, v, bias, causal, mask, grid=grid, backend="dense")
    ref = literal_reference(q, k, v, bias, causal, mask, grid)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def _claimed_cases():
    for name in hf_kernattn.available_backends():
        spec = get_backend(name)
        for causal, rpe, padded in itertools.product([False, True], [None, "1d", "2d"], [False, True]):
            if spec.missing(causal=causal, rpe=rpe, key_mask=padded, device="cpu"):
                continue
            if causal and rpe == "2d":
                continue
            yield pytest.param(name, causal, rpe, padded, id=f"{name}-causal{int(causal)}-{rpe}-pad{int(padded)}")


@pytest.mark.parametrize("name,causal,rpe,padded", list(_claimed_cases()))
def test_backend_equals_dense_float64(name, causal, rpe, padded):
    grid = (3, 4) if rpe == "2d" else None
    n = 12 if grid else 11  # 11: not a multiple of any chunk size
    q, k, v, bias, mask = _inputs(n, seed=1, grid=grid)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
    results = []
    for backend in ("dense", name):
        xs = [x.detach().clone().requires_grad_(True) for x in leaves]
        bias_arg = xs[3] if rpe else None
        out = hf_kernattn.kernelized_attention(
            xs[0], xs[1], xs[2], bias_arg, causal, mask if padded else None, grid=grid, backend=backend
        )
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        (out * weights).sum().backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]
        results.append((out.detach(), grads))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-7)
    for g, rg, label in zip(grads, ref_grads, ["q", "k", "v", "rpe_bias"]):
        torch.testing.assert_close(g, rg, rtol=0, atol=1e-7, msg=lambda m: f"grad {label}: {m}")


def test_fft_gradcheck_1d_and_2d():
    from hf_kernattn.modeling.kernels_fft import ToeplitzKernelProduct

    g = torch.Generator().manual_seed(3)
    for spatial, n, cshape in (((5,), 5, (2, 9)), ((2, 3), 6, (2, 3, 5))):
        q = torch.rand(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.rand(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, 2, n, 2, generator=g, dtype=torch.float64, requires_grad=True)
        c = torch.rand(*cshape, generator=g, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda *a: ToeplitzKernelProduct.apply(*a, spatial), (q, k, v, c))


def test_chunked_equals_recurrent_step_by_step():
    from hf_kernattn.modeling.kernels_common import mask_keys
    from hf_kernattn.modeling.kernels_linear import causal_chunked_attention, recurrent_step

    n = 37
    q, k, v, _, mask = _inputs(n, seed=4)
    keep = mask.bool()
    for chunk in (1, 4, 16, 64):
        full = causal_chunked_attention(q, *mask_keys(k, v, keep), chunk_size=chunk)
        state = torch.zeros(B, H, M, D, dtype=torch.float64)
        norm = torch.zeros(B, H, M, dtype=torch.float64)
        for t in range(n):
            kt = k[:, :, t] * keep[:, None, t, None]
            vt = v[:, :, t] * keep[:, None, t, None]
            out_t, state, norm = recurrent_step(q[:, :, t], kt, vt, state, norm)
            torch.testing.assert_close(out_t, full[:, :, t], rtol=0, atol=1e-10)


def test_padding_slots_with_nan_do_not_leak():
    """fla-style poisoning: padded keys and values hold NaN/inf; real tokens must be unaffected."""
    n = 16
    q, k, v, bias, mask = _inputs(n, seed=5)
    clean = {}
    for poison in (False, True):
        kp, vp = k.clone(), v.clone()
        if poison:
            pad = mask == 0
            kp[pad[:, None, :, None].expand_as(kp)] = float("nan")
            vp[pad[:, None, :, None].expand_as(vp)] = float("inf")
        for name, causal, rpe in (
            ("dense", False, True), ("linear", False, False), ("fft", False, True), ("fft", True, True),
            ("causal_chunked", True, False), ("recurrent", True, False), ("recurrent", True, True),
        ):
            out = hf_kernattn.kernelized_attention(
                q, kp, vp, bias if rpe else None, causal, mask, backend=name
            )
            real = out[mask[:, None, :, None].expand_as(out).bool()]
            if not poison:
                clean[(name, causal, rpe)] = real
            else:
                assert torch.isfinite(real).all(), name
                torch.testing.assert_close(real, clean[(name, causal, rpe)], rtol=0, atol=1e-9)


def test_auto_picks_a_valid_backend_and_matches_dense():
    for n, causal, rpe in ((8, False, False), (600, False, False), (600, True, False), (600, False, True), (600, True, True)):
        q, k, v, bias, mask = _inputs(n, seed=6)
        b = bias if rpe else None
        out = hf_kernattn.kernelized_attention(q, k, v, b, causal, mask)
        ref = hf_kernattn.kernelized_attention(q, k, v, b, causal, mask, backend="dense")
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,causal,rpe", [("linear", False, False), ("causal_chunked", True, False), ("fft", False, True), ("fft", True, True)])
def test_half_precision_long_sequence_is_finite(dtype, name, causal, rpe):
    n = 8192
    g = torch.Generator().manual_seed(7)
    fm = hf_kernattn.FeatureMap(head_dim=32, feature_map="prf", num_random_features=16)
    x = (3 * torch.randn(1, 2, n, 32, generator=g)).to(dtype)
    q = fm(x, is_query=True).to(dtype)
    k = fm(x.flip(2), is_query=False).to(dtype)
    v = (10 * torch.randn(1, 2, n, 32, generator=g)).to(dtype)
    bias = torch.randn(2, 2 * n - 1, generator=g).to(dtype) if rpe else None
    out = hf_kernattn.kernelized_attention(q, k, v, bias, causal, backend=name)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,clip", [(1, 1), (7, 1), (40, 3), (100, 10), (100, 33), (30, 200)])
def test_windowed_equals_dense_for_clipped_bias(n, clip, causal):
    """The windowed backend on a bias from a clipped table: outputs and gradients (q, k, v and the
    table) equal the dense float64 reference. Short chunks force a band of several chunks per
    side (s > 1) and the far-region path."""
    from hf_kernattn.modeling.kernels_common import mask_keys
    from hf_kernattn.modeling.kernels_windowed import windowed_attention

    q, k, v, _, mask = _inputs(max(n, 4), seed=8)
    q, k, v, mask = q[:, :, :n], k[:, :, :n], v[:, :, :n], mask[:, :n]
    mask[0, -1:] = 1
    table = hf_kernattn.RelativePositionBias1D(H, clip, init_std=0.5).double()
    results = []
    for fn in ("dense", "windowed", "windowed_small_chunks"):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        table.zero_grad()
        if fn == "windowed_small_chunks":
            kv = mask_keys(xs[1], xs[2], mask.bool())
            out = windowed_attention(xs[0], *kv, rpe_bias=table(n), rpe_clip=clip, causal=causal, chunk_size=2)
        else:
            out = hf_kernattn.kernelized_attention(*xs, table(n), causal, mask, backend=fn, rpe_clip=clip)
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)).sum().backward()
        results.append((out.detach(), [x.grad for x in xs] + [table.weight.grad.clone()]))
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=1e-9)
        for g, rg in zip(grads, results[0][1]):
            torch.testing.assert_close(g, rg, rtol=0, atol=1e-9)


def test_rpe_clip_is_checked_and_auto_uses_windowed():
    from hf_kernattn.modeling.registry import choose_backend

    q, k, v, bias, _ = _inputs(12, seed=9)
    with pytest.raises(ValueError, match=r"not constant beyond offsets \+-3"):
        hf_kernattn.kernelized_attention(q, k, v, bias, rpe_clip=3)
    with pytest.raises(ValueError, match="rpe_clip must be an int >= 0"):
        hf_kernattn.kernelized_attention(q, k, v, bias, rpe_clip=-1)
    with pytest.raises(ValueError, match="rpe_clip needs a 1D rpe_bias"):
        hf_kernattn.kernelized_attention(q, k, v, rpe_clip=3)
    with pytest.raises(ValueError, match="'windowed' cannot do calls without a 1D rpe_bias declared clipped"):
        hf_kernattn.kernelized_attention(q, k, v, bias, backend="windowed")
    assert choose_backend(n=4096, causal=False, rpe="1d", key_mask=False, device="cpu", rpe_clip=512) == "windowed"
    # a clip far beyond the clipped entries' K reads the unclipped entry (whichever backend the shipped table ranks first)
    unclipped = choose_backend(n=4096, causal=True, rpe="1d", key_mask=True, device="cpu")
    assert choose_backend(n=4096, causal=True, rpe="1d", key_mask=True, device="cpu", rpe_clip=4096) == unclipped != "windowed"


def _grads(fn, inputs):
    """Output of ``fn(*inputs)`` and the gradients of a fixed non-uniform loss on it."""
    xs = [None if x is None else x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    live = [x for x in xs if x is not None]
    return out.detach(), torch.autograd.grad((out * weights).sum(), live)


@pytest.mark.parametrize("spatial,causal", [((9,), False), ((9,), True), ((3, 4), False)])
def test_toeplitz_op_equals_its_plain_reference(spatial, causal):
    """ToeplitzKernelProduct (FFT, hand-written backward) against the plain N x N product beside
    it, in float64: outputs and the gradients of q, k, v and the coefficients. Both sum the same
    O(N M) terms of size O(1) (the FFT adds ~log L rounding steps per term), so they agree to
    far below 1e-12."""
    from hf_kernattn.modeling.kernels_fft import ToeplitzKernelProduct, toeplitz_kernel_product_reference

    n = math.prod(spatial)
    g = torch.Generator().manual_seed(31)
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n, D + 1, generator=g, dtype=torch.float64)
    c = torch.rand((H,) + tuple(2 * s - 1 for s in spatial), generator=g, dtype=torch.float64)
    if causal:
        c[:, n:] = 0  # offsets r > 0 carry no weight
    out, grads = _grads(lambda *a: ToeplitzKernelProduct.apply(*a, spatial), (q, k, v, c))
    ref, ref_grads = _grads(lambda *a: toeplitz_kernel_product_reference(*a, spatial), (q, k, v, c))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want, label in zip(grads, ref_grads, ["q", "k", "v", "c"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m: f"grad {label}: {m}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_far", [False, True])
@pytest.mark.parametrize("per_head_eps", [False, True])
def test_banded_op_equals_its_plain_reference(causal, with_far, per_head_eps):
    """BandedKernelProduct (hand-written backward) against the plain chunk-by-chunk product
    beside it, in float64: outputs and the gradients of q, k, v, the band weights and the
    far-region states. Chunks of 4 with a band of 2 chunks per side over 23 tokens (a partial
    last chunk). Both add the same O(W M) terms of size O(1) in different orders: far below
    1e-12."""
    from hf_kernattn.modeling.kernels_windowed import BandedKernelProduct, banded_kernel_product_reference

    n, c, s = 23, 4, 2
    g = torch.Generator().manual_seed(32)
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    v = torch.cat([torch.randn(B, H, n, D, generator=g, dtype=torch.float64), torch.ones(B, H, n, 1, dtype=torch.float64)], -1)
    weight = torch.rand(H, c, (s + 1 if causal else 2 * s + 1) * c, generator=g, dtype=torch.float64)
    far = torch.rand(B, H, -(-n // c), M, D + 1, generator=g, dtype=torch.float64) if with_far else None
    eps = torch.tensor([1e-3, 0.5, 2.0], dtype=torch.float64) if per_head_eps else 0.25
    out, grads = _grads(lambda *a: BandedKernelProduct.apply(*a, c, s, causal, eps), (q, k, v, weight, far))
    ref, ref_grads = _grads(lambda *a: banded_kernel_product_reference(*a, c, s, causal, eps), (q, k, v, weight, far))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert len(grads) == (5 if with_far else 4)
    for got, want, label in zip(grads, ref_grads, ["q", "k", "v", "weight", "far"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m: f"grad {label}: {m}")


def test_kernels_refuse_arguments_they_do_not_take():
    """A kernel called directly with an argument it does not implement raises TypeError instead
    of silently computing something else (e.g. non-causal attention for causal=True); masking
    happens before dispatch, so no kernel takes a key mask."""
    from hf_kernattn.modeling.kernels_dense import dense_attention
    from hf_kernattn.modeling.kernels_fft import fft_attention
    from hf_kernattn.modeling.kernels_linear import causal_chunked_attention, linear_attention, recurrent_attention
    from hf_kernattn.modeling.kernels_windowed import windowed_attention

    q, k, v, bias, mask = _inputs(6, seed=33)
    keep = mask.bool()
    calls = [
        (linear_attention, {"causal": True}),
        (linear_attention, {"rpe_bias": bias}),
        (linear_attention, {"key_mask": keep}),
        (causal_chunked_attention, {"rpe_bias": bias}),
        (causal_chunked_attention, {"causal": False}),
        (recurrent_attention, {"causal": False}),
        (recurrent_attention, {"key_mask": keep}),
        (dense_attention, {"key_mask": keep}),
        (fft_attention, {"key_mask": keep}),
        (fft_attention, {"compute_dtype": torch.float64}),
        (windowed_attention, {"rpe_bias": bias, "rpe_clip": 2, "grid": (2, 3)}),
        (windowed_attention, {"rpe_bias": bias, "rpe_clip": 2, "key_mask": keep}),
    ]
    for fn, kwargs in calls:
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            fn(q, k, v, **kwargs)


@pytest.mark.parametrize("clip", [0, 1, 2, 3, 20])
def test_manhattan_equals_the_literal_formula_with_gradients(clip):
    """The O(N K^2) far/near split of a 2D bias of the clipped Manhattan distance equals the
    literal dense formula (float64), outputs and the gradients of q, k, v and the per-distance
    table, with padding; K = 20 exceeds every distance of the 5 x 7 grid."""
    from hf_kernattn.modeling.kernels_common import manhattan_table

    g = torch.Generator().manual_seed(11 + clip)
    hg, wg = 5, 7
    n = hg * wg
    q, k, v, _, mask = _inputs(n, seed=12 + clip)
    dist = 0.7 * torch.randn(H, clip + 1, generator=g, dtype=torch.float64)
    weight = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    results = []
    for run in ("manhattan", "reference"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, dist)]
        table = manhattan_table(xs[3], hg, wg)
        if run == "manhattan":
            out = hf_kernattn.kernelized_attention(*xs[:3], table, attention_mask=mask, grid=(hg, wg), rpe_clip=clip,
                                                   backend="manhattan")
        else:
            out = literal_reference(*xs[:3], table, False, mask, (hg, wg))
        real = mask.bool()[:, None, :, None]
        results.append((out, torch.autograd.grad((torch.where(real, out, 0.0) * weight).sum(), xs)))
    (out, grads), (ref, ref_grads) = results
    real = mask.bool()[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_manhattan_declaration_is_checked_and_auto_uses_it():
    from hf_kernattn.modeling.kernels_common import manhattan_table
    from hf_kernattn.modeling.registry import choose_backend

    q, k, v, bias, _ = _inputs(6, seed=13, grid=(2, 3))
    with pytest.raises(ValueError, match=r"not a function of the clipped Manhattan distance min\(\|dy\| \+ \|dx\|, 1\)"):
        hf_kernattn.kernelized_attention(q, k, v, bias, grid=(2, 3), rpe_clip=1)
    with pytest.raises(ValueError, match="'manhattan' cannot do calls without a 2D rpe_bias declared clipped"):
        hf_kernattn.kernelized_attention(q, k, v, bias, grid=(2, 3), backend="manhattan")
    table = manhattan_table(torch.zeros(H, 2, dtype=torch.float64), 2, 3)
    assert hf_kernattn.kernelized_attention(q, k, v, table, grid=(2, 3), rpe_clip=1).shape == v.shape
    # the calibration table decides from which grid on (dense stays faster up to a few thousand tokens)
    assert choose_backend(n=65536, causal=False, rpe="2d", key_mask=False, device="cpu", rpe_clip=4) == "manhattan"
    assert choose_backend(n=64, causal=False, rpe="2d", key_mask=False, device="cpu", rpe_clip=4) == "dense"


def test_a_named_fft_warns_once_where_its_error_bound_is_too_large(caplog):
    """``backend="fft"`` asked by name for a bias whose range the transform cannot resolve in
    float32 (a table over [-40, 40]: error bound ~e^80 eps) runs as asked and says so once, naming
    the bound; a bias it resolves says nothing; ``auto`` never takes it there."""
    import logging

    from hf_kernattn.modeling import dispatch

    g = torch.Generator().manual_seed(5)
    n = 64
    q, k, v = torch.rand(1, 2, n, 8, generator=g), torch.rand(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 4, generator=g)
    wide = torch.linspace(-40, 40, 2 * n - 1).repeat(2, 1)
    narrow = torch.linspace(-1, 1, 2 * n - 1).repeat(2, 1)
    dispatch._WARNED.discard("fft")
    with caplog.at_level(logging.WARNING):
        hf_kernattn.kernelized_attention(q, k, v, rpe_bias=narrow, backend="fft")
        assert "error bound" not in caplog.text
        hf_kernattn.kernelized_attention(q, k, v, rpe_bias=wide, backend="fft")
        assert caplog.text.count("backend='fft': its error bound for these inputs is") == 1
        hf_kernattn.kernelized_attention(q, k, v, rpe_bias=wide, backend="fft")
        assert caplog.text.count("error bound") == 1  # once
    want = literal_reference(q.double(), k.double(), v.double(), wide.double())
    torch.testing.assert_close(hf_kernattn.kernelized_attention(q, k, v, rpe_bias=wide).double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_the_fft_error_bound_leaves_its_inputs_untouched(dtype, masked):
    """The bound sums prefixes of the keys in place in float64 slices: of a copy, also where the
    keys already are float64 (a view would be the caller's own tensor)."""
    from hf_kernattn.modeling.kernels_fft import fft_error_bound

    g = torch.Generator().manual_seed(7)
    q, k = torch.rand(2, 2, 9, 4, generator=g, dtype=dtype), torch.rand(2, 2, 9, 4, generator=g, dtype=dtype)
    bias = torch.randn(2, 17, generator=g, dtype=dtype)
    mask = torch.ones(2, 9, dtype=torch.bool) if masked else None
    copies = [x.clone() for x in (q, k, bias)]
    fft_error_bound(q, k, rpe_bias=bias, causal=True, key_mask=mask)
    assert all(torch.equal(a, b) for a, b in zip((q, k, bias), copies))
