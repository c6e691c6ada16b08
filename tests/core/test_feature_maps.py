"""Feature maps: values, unbiasedness, NPRF approximation of softmax-with-RPE, redraw, save/load."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hf_kernattn
from hf_kernattn.modeling.feature_maps import FEATURE_MAPS, draw_projection, feature_maps_step
from hf_kernattn.modeling.kernels_common import dense_bias_matrix


def test_deterministic_maps_values():
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(hf_kernattn.FeatureMap(8, "elu")(x, True), F.elu(x) + 1)
    torch.testing.assert_close(hf_kernattn.FeatureMap(8, "relu")(x, False), F.relu(x))
    xn = F.normalize(x, dim=-1)
    torch.testing.assert_close(hf_kernattn.FeatureMap(8, "elu", normalize_qk=True)(x, True), F.elu(xn) + 1)


def _sphere_cos_expectation(z: torch.Tensor, d: int) -> torch.Tensor:
    """E[cos(w . z)] for w uniform on the sphere of radius sqrt(d): 0F1(; d/2; -d |z|^2 / 4)."""
    return _sphere_expectation(z, d, sign=-1.0)


def _sphere_expectation(z: torch.Tensor, d: int, sign: float = 1.0) -> torch.Tensor:
    """E[exp(w . z)] for w uniform on the sphere of radius sqrt(d): 0F1(; d/2; d |z|^2 / 4)."""
    a = sign * d * (z * z).sum(-1) / 4
    term = torch.ones_like(a)
    total = torch.ones_like(a)
    for i in range(60):
        term = term * a / ((i + 1) * (d / 2 + i))
        total = total + term
    return total


@pytest.mark.parametrize("kind", ["prf", "trf"])
@pytest.mark.parametrize("projection", ["gaussian", "orthogonal", "sphere"])
def test_random_features_estimate_exp_kernel(kind, projection):
    """E[phi(q) . phi(k)] = exp(q_hat . k_hat) for Gaussian and orthogonal projections.

    Sphere projections (fixed row norm sqrt(d)) estimate a slightly different kernel, computed
    here in closed form: the check is that they are unbiased for *that* kernel.
    """
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, 1, 6, 8, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, 1, 6, 8, generator=g, dtype=torch.float64), dim=-1)
    m = 1 << 16
    fm = hf_kernattn.FeatureMap(8, kind, m, projection, normalize_qk=True, seed=1).double()
    qf, kf = fm(q, is_query=False), fm(k, is_query=False)  # no query shift: compare absolute kernel values
    est = qf @ kf.transpose(-1, -2)
    exact = torch.exp(q @ k.transpose(-1, -2))
    if projection == "sphere":
        sign = 1 if kind == "prf" else -1  # trf: E[cos(w.(x - y))] = E[exp(w.(x-y))] at imaginary z
        z = q[..., :, None, :] + sign * k[..., None, :, :]
        if kind == "prf":
            exact = math.exp(-1.0) * _sphere_expectation(z, 8)
        else:
            exact = math.e * _sphere_cos_expectation(z, 8)
    # relative std of one estimate <= sqrt((e^{|x+y|^2} - 1) / m) <= sqrt((e^4 - 1) / m); 5 sigma.
    tol = 5 * math.sqrt((math.e**4 - 1) / m)
    assert ((est - exact).abs() / exact).max() < tol


def test_prf_features_are_positive_and_query_shift_cancels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 7, 16, generator=g, dtype=torch.float64)
    fm = hf_kernattn.FeatureMap(16, "prf", 32).double()
    assert (fm(4 * x, is_query=False) > 0).all() and (fm(4 * x, is_query=True) > 0).all()
    v = torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64)
    k = fm(x.flip(2), is_query=False)
    a = hf_kernattn.kernelized_attention(fm(x, is_query=True), k, v, backend="dense")
    b = hf_kernattn.kernelized_attention(fm(x, is_query=False), k, v, backend="dense", eps=0.0)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _key_feature_rounding_bound(fm, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on how far two float32 evaluations of the key features of ``x`` may
    differ when only the order of floating-point operations differs (a 1-row and a 9-row matmul
    take different BLAS paths; vectorised and scalar tails of elementwise kernels differ too).

    With unit roundoff u = eps/2, a length-d dot product in any summation order has error at
    most gamma_d * sum_k |w_k| |x_k| with gamma_d <= d u / (1 - d u) < d eps; so does |x|^2.
    * prf: phi = exp(w.x - |x|^2/2) / sqrt(m): relative error <= d eps (|W||x| + |x|^2) + a few eps.
    * trf: phi = exp(|x|^2/2) / sqrt(m) [cos(w.x), sin(w.x)]: the amplitude has relative error
      <= d eps |x|^2 / 2, and cos/sin move by at most the error of w.x, an absolute error that
      becomes a huge *relative* one near a zero of the cosine: the bound is absolute,
      amplitude * (d eps (|W||x| + |x|^2) + a few eps).
    * elu: phi = elu(x) + 1, for x < 0 computed as expm1(x) + 1: expm1 is within a few ulps of
      |expm1(x)| <= 1 (implementations differ, e.g. vectorised or not), and adding 1 rounds to
      the ulp of a number near 1: an *absolute* error of a few eps, however small phi = e^x is.
      For x >= 0, phi = x + 1 rounds relatively. Bound: a few eps times max(phi, 1).
      relu: exact.
    * learned maps: z = x W has the dot-product error above, dz = d eps |x||W| + a few eps;
      hedgehog_exp keys exp(+-z) have relative error dz + a few eps; hedgehog's softmax(+-z)
      (exp(z_i - logsumexp z)) twice that, plus m eps for the sum.
    Everything is doubled for margin.
    """
    eps = torch.finfo(torch.float32).eps
    d = fm.head_dim
    x = x.double()
    if fm.kind == "relu":
        return torch.zeros_like(x)
    if fm.kind == "elu":
        return 8 * eps * (torch.nn.functional.elu(x) + 1).clamp(min=1.0)
    if fm.is_learned:
        w = fm.key_weight.double()
        dz = d * eps * torch.matmul(x.abs(), w.abs()) + 4 * eps
        value = fm(x, is_query=False).double()
        if fm.kind == "hedgehog":
            return 2 * value * (2 * dz.amax(-1, keepdim=True) + w.shape[-1] * eps)
        return 2 * value * torch.cat([dz, dz], dim=-1)
    u = x * d ** -0.25  # the random maps' prescale without normalize_qk
    w = fm.projection.double()
    dot_err = d * eps * (u.abs() @ w.abs().T + (u * u).sum(-1, keepdim=True)) + 4 * eps
    if fm.kind == "prf":
        value = torch.exp(u @ w.T - 0.5 * (u * u).sum(-1, keepdim=True)) / math.sqrt(fm.num_random_features)
        return 2 * value * dot_err
    amp = torch.exp(0.5 * (u * u).sum(-1, keepdim=True)) / math.sqrt(fm.num_random_features)
    return 2 * torch.cat([amp * dot_err, amp * dot_err], dim=-1)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", FEATURE_MAPS)
def test_key_features_depend_only_on_their_own_position(kind, seed):
    """No stabiliser mixes positions: a key's feature is the same alone or inside a sequence,
    up to the rounding of the map itself (:func:`_key_feature_rounding_bound`, not a fixed
    relative tolerance: trf features near a zero of cos/sin have no relative precision)."""
    g = torch.Generator().manual_seed(seed)
    fm = hf_kernattn.FeatureMap(8, kind, 16, normalize_qk=False)
    x = 3 * torch.randn(1, 2, 9, 8, generator=g)  # large, but inside the range where trf is finite
    full = fm(x, is_query=False)
    assert torch.isfinite(full).all()
    bound = _key_feature_rounding_bound(fm, x)
    for j in range(9):
        alone = fm(x[:, :, j : j + 1], is_query=False)[:, :, 0]
        err = (alone.double() - full[:, :, j].double()).abs()
        assert (err <= bound[:, :, j]).all(), (kind, j, (err - bound[:, :, j]).max().item())
    # a stabiliser computed over the sequence (a max over keys) would change features by far more
    # than the bound: shifting every key feature by a factor e^-1 must be detected
    if kind != "relu":
        assert ((full / math.e - full).abs().double() > bound).any()


def test_orthogonal_projection_blocks_are_orthogonal():
    g = torch.Generator().manual_seed(0)
    w = draw_projection(20, 8, "orthogonal", g, dtype=torch.float64)
    block = F.normalize(w[:8], dim=-1)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=torch.float64), atol=1e-10, rtol=0)
    s = draw_projection(5, 8, "sphere", g, dtype=torch.float64)
    torch.testing.assert_close(s.norm(dim=-1), torch.full((5,), math.sqrt(8), dtype=torch.float64))


def test_nprf_large_m_approximates_softmax_with_rpe():
    """NPRF attention with a learned-style bias approaches exact softmax(q_hat.k_hat + b) attention.

    Tolerance: one kernel estimate has relative std sigma <= sqrt((e^4 - 1) / m) on unit vectors;
    the output averages n keys with values of unit variance, so the mean absolute output error is
    of order sigma / sqrt(n); the test allows 4x that, and checks that ignoring the bias (a wrong
    implementation) would exceed the tolerance, so the check can fail.
    """
    g = torch.Generator().manual_seed(0)
    n, d = 64, 16
    x = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    y = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(1, 2 * n - 1, generator=g, dtype=torch.float64)
    cos = F.normalize(x, dim=-1) @ F.normalize(y, dim=-1).transpose(-1, -2)
    ref = torch.softmax(cos + dense_bias_matrix(bias, n, None)[None], dim=-1) @ v
    no_bias = torch.softmax(cos, dim=-1) @ v
    errors = {}
    for m in (256, 16384):
        fm = hf_kernattn.FeatureMap(d, "prf", m, "orthogonal", normalize_qk=True, seed=3).double()
        out = hf_kernattn.kernelized_attention(fm(x, True), fm(y, False), v, bias, backend="fft")
        errors[m] = (out - ref).abs().mean().item()
    tol = 4 * math.sqrt((math.e**4 - 1) / 16384) / math.sqrt(n)
    assert errors[16384] < tol
    assert (no_bias - ref).abs().mean().item() > tol
    assert errors[16384] < errors[256] / 2


def test_redraw_only_in_training_every_interval_and_reproducible():
    fm = hf_kernattn.FeatureMap(8, "prf", 16, redraw_interval=3, seed=7)
    w0 = fm.projection.clone()
    fm.eval()
    for _ in range(5):
        fm.step()
    torch.testing.assert_close(fm.projection, w0)
    fm.train()
    fm.step(), fm.step()
    torch.testing.assert_close(fm.projection, w0)
    fm.step()
    assert not torch.equal(fm.projection, w0)
    twin = hf_kernattn.FeatureMap(8, "prf", 16, redraw_interval=3, seed=7)
    twin.redraw()
    torch.testing.assert_close(fm.projection, twin.projection)
    never = hf_kernattn.FeatureMap(8, "prf", 16, redraw_interval=0).train()
    p = never.projection.clone()
    for _ in range(10):
        never.step()
    torch.testing.assert_close(never.projection, p)


def test_feature_maps_step_walks_a_model():
    model = torch.nn.Sequential(
        hf_kernattn.FeatureMap(8, "prf", 16, redraw_interval=1, seed=1),
        hf_kernattn.FeatureMap(8, "trf", 16, redraw_interval=2, seed=2),
    ).train()
    before = [m.projection.clone() for m in model]
    feature_maps_step(model)
    assert not torch.equal(model[0].projection, before[0]) and torch.equal(model[1].projection, before[1])
    model.eval()
    after = [m.projection.clone() for m in model]
    feature_maps_step(model)
    assert all(torch.equal(a, m.projection) for a, m in zip(after, model))


def test_saved_and_reloaded_feature_map_gives_identical_outputs(tmp_path):
    fm = hf_kernattn.FeatureMap(8, "prf", 16, "gaussian", redraw_interval=2, seed=11).train()
    for _ in range(4):
        fm.step()  # two redraws: the saved projection is not the seed's first draw
    save_file(fm.state_dict(), str(tmp_path / "fm.safetensors"))
    fresh = hf_kernattn.FeatureMap(8, "prf", 16, "gaussian", redraw_interval=2, seed=11)
    fresh.load_state_dict(load_file(str(tmp_path / "fm.safetensors")))
    x = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fresh(x, True), fm(x, True), rtol=0, atol=0)
    assert int(fresh.num_draws) == 2
    fresh.train(), fm.train()
    fresh.step(), fm.step(), fresh.step(), fm.step()  # the draw sequence continues identically
    torch.testing.assert_close(fresh.projection, fm.projection, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(feature_map="softmax"), "feature_map"),
        (dict(feature_map="prf", projection="uniform"), "feature_projection"),
        (dict(feature_map="prf", num_random_features=0), "num_random_features"),
        (dict(redraw_interval=-1), "feature_redraw_interval"),
        (dict(head_dim=0), "head_dim"),
    ],
)
def test_bad_feature_map_arguments(kwargs, match):
    args = dict(head_dim=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        hf_kernattn.FeatureMap(**args)


def test_wrong_head_dim_input():
    with pytest.raises(ValueError, match="head_dim"):
        hf_kernattn.FeatureMap(8, "elu")(torch.zeros(1, 1, 3, 7), True)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("is_query", [True, False])
def test_fused_prf_matches_plain_autograd_formula(normalize, is_query):
    """The one-op PRF map (hand-written backward) against the formula written with plain autograd
    ops, in float64: values, gradients of x and of the projection, and torch.autograd.gradcheck
    for keys (a query's shift is a constant for the gradient by design, so finite differences of
    the map alone differ from it; in attention it cancels). One input row is all zeros (the l2-normalisation divides it by eps, not by its length)."""
    from hf_kernattn.modeling.feature_maps import PositiveRandomFeatures

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    x[0, 1, 2] = 0.0
    w = torch.randn(6, 8, generator=g, dtype=torch.float64)
    prescale, scale = 8 ** -0.25, 6 ** -0.5

    def reference(x, w):
        u = torch.nn.functional.normalize(x, dim=-1, eps=1e-6) if normalize else x * prescale
        logits = u @ w.T - 0.5 * (u * u).sum(-1, keepdim=True)
        if is_query:
            logits = logits - logits.amax(-1, keepdim=True).detach()
        return torch.exp(logits) * scale

    weights = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    grads = []
    for fn in (reference, lambda x, w: PositiveRandomFeatures.apply(x, w, normalize, prescale, is_query, scale)):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xs, ws)
        (out * weights).sum().backward()
        grads.append((out.detach(), xs.grad, ws.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert is_query or torch.autograd.gradcheck(
        lambda x, w: PositiveRandomFeatures.apply(x, w, normalize, prescale, is_query, scale),
        (x[:, :, 3:].clone().requires_grad_(True), w.clone().requires_grad_(True)),  # no zero row: |x| has a kink
    )


@pytest.mark.parametrize("kind", ["prf", "trf"])
def test_init_features_refills_garbage_buffers_deterministically(kind):
    """init_features() writes draw 0 of the seed into the existing buffer (in place, keeping
    dtype) and zeroes the counters, whatever the buffers held (uninitialised memory, NaN, a later
    draw)."""
    reference = hf_kernattn.FeatureMap(8, kind, 16, "orthogonal", redraw_interval=1, seed=5)
    fm = hf_kernattn.FeatureMap(8, kind, 16, "orthogonal", redraw_interval=1, seed=5).double().train()
    for _ in range(3):
        fm.step()  # three redraws: the projection is draw 3 now
    with torch.no_grad():
        fm.projection[0, 0] = float("nan")
        fm.projection[1] = 3e38
        fm.num_steps.fill_(-7)
    buffer = fm.projection
    fm.init_features()
    assert fm.projection is buffer and fm.projection.dtype == torch.float64
    torch.testing.assert_close(fm.projection, reference.projection.double(), rtol=0, atol=0)
    assert int(fm.num_draws) == 0 and int(fm.num_steps) == 0
    fm.step()  # the draw sequence restarts: the next step gives draw 1, as for a fresh map
    reference.redraw()
    torch.testing.assert_close(fm.projection, reference.projection.double(), rtol=0, atol=0)


def test_init_features_after_meta_device_build_and_to_empty():
    """A module built on the meta device and materialised with to_empty() holds uninitialised
    memory; init_features() gives exactly the projection a normal build draws."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=16, num_attention_heads=2, feature_map="prf", num_random_features=8,
                          feature_seed=3)
    normal = hf_kernattn.KernelizedSelfAttention(cfg, layer_idx=1)
    with torch.device("meta"):
        lazy = hf_kernattn.KernelizedSelfAttention(cfg, layer_idx=1)
    assert lazy.feature_map.projection.is_meta
    lazy.feature_map.init_features()  # still on meta: a no-op, not an error
    lazy.to_empty(device="cpu")
    lazy.feature_map.init_features()
    torch.testing.assert_close(lazy.feature_map.projection, normal.feature_map.projection, rtol=0, atol=0)
    assert int(lazy.feature_map.num_draws) == 0 and int(lazy.feature_map.num_steps) == 0
    wrong = hf_kernattn.FeatureMap(8, "prf", 4, seed=2)
    wrong.projection = torch.full((3, 8), float("nan"))  # e.g. loaded with mismatched sizes
    wrong.init_features()
    torch.testing.assert_close(wrong.projection, hf_kernattn.FeatureMap(8, "prf", 4, seed=2).projection, rtol=0, atol=0)
    det = hf_kernattn.FeatureMap(8, "elu")
    det.num_steps.fill_(9)
    det.init_features()
    assert det.projection is None and int(det.num_steps) == 0
