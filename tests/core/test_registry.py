"""The backend registry and the ValueErrors of malformed or impossible calls."""

from __future__ import annotations

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling import registry
from hf_kernattn.modeling.kernels_linear import linear_attention


def _qkv(b=1, h=2, n=6, m=3, d=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, h, n, m, generator=g, dtype=dtype), torch.rand(b, h, n, m, generator=g, dtype=dtype),
            torch.randn(b, h, n, d, generator=g, dtype=dtype))


def test_builtin_backends_and_their_capabilities():
    names = hf_kernattn.available_backends()
    for required in ("dense", "linear", "causal_chunked", "fft", "recurrent"):
        assert required in names
    assert hf_kernattn.get_backend("fft").rpe_2d and hf_kernattn.get_backend("recurrent").decoding
    assert not hf_kernattn.get_backend("linear").causal


def test_unknown_backend_lists_known_ones():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*fft"):
        hf_kernattn.kernelized_attention(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="known backends"):
        hf_kernattn.get_backend("nope")


def test_rpe_on_backend_without_rpe_names_capable_backends():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"'linear' cannot do a 1D rpe_bias; backends that can: \['dense', 'fft'\]"):
        hf_kernattn.kernelized_attention(q, k, v, rpe_bias=torch.zeros(2, 11), backend="linear")
    with pytest.raises(ValueError, match=r"'linear' cannot do causal=True"):
        hf_kernattn.kernelized_attention(q, k, v, causal=True, backend="linear")
    with pytest.raises(ValueError, match=r"'causal_chunked' cannot do causal=False"):
        hf_kernattn.kernelized_attention(q, k, v, backend="causal_chunked")
    q, k, v = _qkv(n=6)
    with pytest.raises(ValueError, match=r"'recurrent' cannot do causal=False, a 2D rpe_bias"):
        hf_kernattn.kernelized_attention(q, k, v, rpe_bias=torch.zeros(2, 3, 5), grid=(2, 3), backend="recurrent")


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(q=torch.ones(2, 6, 3)), ValueError, r"q must have shape \(batch, heads, seq, features\)"),
        (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
        (dict(k=torch.ones(1, 2, 5, 3)), ValueError, "q and k must have the same shape"),
        (dict(v=torch.ones(1, 2, 5, 4)), ValueError, r"v must match q in \(batch, heads, seq\)"),
        (dict(v=torch.ones(1, 2, 6, 4, dtype=torch.float64)), ValueError, "share one dtype"),
        (dict(q=torch.ones(1, 2, 6, 3, dtype=torch.long)), ValueError, "floating-point"),
        (dict(rpe_bias=torch.zeros(2, 10)), ValueError, r"rpe_bias must have shape \(heads, 2\*seq-1\) = \(2, 11\)"),
        (dict(rpe_bias=torch.zeros(2, 3, 5)), ValueError, "a 3D bias needs grid"),
        (dict(rpe_bias=torch.zeros(2, 3, 5), grid=(2, 4)), ValueError, r"grid \(2, 4\) has 8 cells but the sequence has N=6"),
        (dict(rpe_bias=torch.zeros(2, 3, 3), grid=(2, 3)), ValueError, r"\(heads, 2\*grid_h-1, 2\*grid_w-1\) = \(2, 3, 5\)"),
        (dict(grid=(2, "3")), ValueError, "grid must be a pair of positive ints"),
        (dict(rpe_bias=torch.zeros(2, 3, 5), grid=(2, 3), causal=True), ValueError, "causal=True is only defined for 1D"),
        (dict(attention_mask=torch.ones(1, 5)), ValueError, r"attention_mask must have shape \(batch, seq\) = \(1, 6\)"),
        (dict(attention_mask=torch.full((1, 6), 2)), ValueError, "only 1 \\(keep\\) and 0 \\(padding\\)"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(backend=3), TypeError, "backend must be a string"),
        (dict(eps=-1.0), ValueError, "eps must be a number >= 0"),
        (dict(eps=float("nan")), ValueError, r"eps must be a number >= 0 \(finite, not NaN\), got nan"),
        (dict(eps=float("inf")), ValueError, "eps must be a number >= 0"),
        (dict(eps=True), ValueError, "eps must be a number >= 0"),
        (dict(q=torch.ones(1, 2, 0, 3), k=torch.ones(1, 2, 0, 3), v=torch.ones(1, 2, 0, 4)), ValueError,
         r"at least one token \(seq >= 1\)"),
        (dict(q=torch.ones(1, 2, 6, 0), k=torch.ones(1, 2, 6, 0)), ValueError, r"at least one feature \(features >= 1\)"),
        (dict(v=torch.ones(1, 2, 6, 0)), ValueError, "v must have head_dim >= 1"),
    ],
)
def test_malformed_calls(kwargs, exc, match):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        hf_kernattn.kernelized_attention(**args)


def test_register_custom_backend_is_used_and_checked():
    calls = []

    def scaled_linear(q, k, v, *, rpe_bias=None, causal=False, key_mask=None, grid=None, eps=1e-6):
        calls.append(q.shape)
        return linear_attention(q, k, v, eps=eps)  # keys arrive masked

    try:
        spec = hf_kernattn.register_backend("test_custom", scaled_linear, description="test")
        assert "test_custom" in hf_kernattn.available_backends() and spec.noncausal and not spec.causal
        q, k, v = _qkv()
        out = hf_kernattn.kernelized_attention(q, k, v, backend="test_custom")
        torch.testing.assert_close(out, hf_kernattn.kernelized_attention(q, k, v, backend="dense"))
        assert calls
        with pytest.raises(ValueError, match="already registered"):
            hf_kernattn.register_backend("test_custom", scaled_linear)
        with pytest.raises(ValueError, match=r"'test_custom' cannot do causal=True"):
            hf_kernattn.kernelized_attention(q, k, v, causal=True, backend="test_custom")
    finally:
        hf_kernattn.unregister_backend("test_custom")
    with pytest.raises(TypeError, match="fn must be callable"):
        hf_kernattn.register_backend("x", 3)
    with pytest.raises(ValueError, match="other than 'auto'"):
        hf_kernattn.register_backend("auto", scaled_linear)
    with pytest.raises(ValueError, match="devices must be among"):
        hf_kernattn.register_backend("x", scaled_linear, devices=("tpu",))


def test_auto_choice_follows_the_shipped_table():
    """``auto`` takes, for each kind of call, the first backend the shipped calibration table
    ranks at that length (it holds measured crossovers, not a hand rule)."""
    from hf_kernattn.modeling.auto_table import AUTO_TABLE

    choose = registry.choose_backend
    for entry in AUTO_TABLE["entries"]:
        rpe = None if entry["bias"] == "none" else entry["bias"]
        bounds = [n_max for n_max, _ in entry["ranking"][:-1]]
        for n_max, names in entry["ranking"]:
            n = n_max if n_max is not None else (bounds[-1] + 1 if bounds else 4096)
            first = names[0].partition("@")[0]
            got = choose(n=n, causal=entry["causal"], rpe=rpe, key_mask=False, device="cpu", rpe_clip=entry["clip"],
                         backward=entry["mode"] == "fwdbwd", dtype=getattr(torch, entry["dtype"]),
                         heads=entry.get("heads", 1))  # an entry serves the head count it was measured at
            if entry["clip"] is None or entry["bias"] == "2d" or entry["clip"] < n:
                assert got == first, (entry, n)


@pytest.mark.parametrize("name", ["dense", "linear", "causal_chunked", "fft", "windowed", "recurrent"])
@pytest.mark.parametrize("empty", ["batch", "heads"])
def test_empty_batch_or_heads_give_an_empty_result(name, empty):
    """0 sequences (or 0 heads): every backend returns the empty (B, H, N, D) result, attached
    to the graph (a loss on it back-propagates zeros); the call is still validated."""
    spec = hf_kernattn.get_backend(name)
    causal = not spec.noncausal
    b, h = (0, 2) if empty == "batch" else (1, 0)
    q, k, v = _qkv(b=b, h=h)
    q.requires_grad_(True)
    bias = torch.zeros(h, 11) if spec.rpe_1d else None
    out = hf_kernattn.kernelized_attention(q, k, v, bias, causal, backend=name, rpe_clip=2 if spec.needs_rpe_clip else None)
    assert out.shape == (b, h, 6, 4) and out.dtype == v.dtype
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    with pytest.raises(ValueError, match="cannot do"):
        hf_kernattn.kernelized_attention(q, k, v, causal=True, backend="linear")


def test_each_backend_receives_exactly_what_it_declares():
    """The registry declares the keyword arguments of every backend; kernelized_attention passes
    those and nothing else (a strict signature works), after casting to the compute dtype and
    zeroing padded keys and values."""
    assert hf_kernattn.get_backend("linear").takes == ("eps", "q_den", "k_den")
    assert hf_kernattn.get_backend("causal_chunked").takes == ("eps", "q_den", "k_den", "initial_state", "output_final_state")
    assert "key_mask" not in hf_kernattn.get_backend("dense").takes
    assert "rpe_clip" in hf_kernattn.get_backend("windowed").takes
    seen = {}

    def strict(q, k, v, *, key_mask, eps):
        seen.update(dtype=q.dtype, k=k, v=v, key_mask=key_mask)
        return linear_attention(q, k, v, eps=eps)

    q, k, v = _qkv(dtype=torch.bfloat16)
    k[0, :, -1] = float("inf")  # a padded slot may hold anything
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, -1] = 0
    try:
        hf_kernattn.register_backend("test_strict", strict, takes=("key_mask", "eps"))
        out = hf_kernattn.kernelized_attention(q, k, v, attention_mask=mask, backend="test_strict")
    finally:
        hf_kernattn.unregister_backend("test_strict")
    assert seen["dtype"] == torch.float32 and out.dtype == torch.bfloat16
    assert torch.equal(seen["key_mask"], mask.bool())
    assert (seen["k"][0, :, -1] == 0).all() and (seen["v"][0, :, -1] == 0).all()
    torch.testing.assert_close(out, hf_kernattn.kernelized_attention(q, k, v, attention_mask=mask, backend="dense"))


def test_register_backend_checks_what_it_takes():
    def fn(q, k, v, **kwargs):
        return v

    with pytest.raises(ValueError, match=r"takes must name arguments among .*'mask'"):
        hf_kernattn.register_backend("test_bad", fn, takes=("mask",))
    with pytest.raises(ValueError, match=r"takes must include \['causal'\]"):
        hf_kernattn.register_backend("test_bad", fn, causal=True, noncausal=True, takes=("eps",))
    with pytest.raises(ValueError, match=r"takes must include \['rpe_bias', 'grid'\]"):
        hf_kernattn.register_backend("test_bad", fn, rpe_2d=True, takes=("eps",))
    with pytest.raises(ValueError, match=r"takes must include \['rpe_clip'\]"):
        hf_kernattn.register_backend("test_bad", fn, rpe_1d=True, needs_rpe_clip=True, takes=("rpe_bias",))
    assert "test_bad" not in hf_kernattn.available_backends()
    try:
        spec = hf_kernattn.register_backend("test_default", fn, rpe_1d=True, needs_rpe_clip=True)
        assert spec.takes == ("rpe_bias", "causal", "key_mask", "grid", "eps", "rpe_clip")
    finally:
        hf_kernattn.unregister_backend("test_default")


def test_auto_never_picks_a_decoding_backend(monkeypatch):
    """``decoding=True`` marks a step-by-step form: auto skips it for a whole sequence even when
    it is registered first and could run the call."""
    monkeypatch.setattr(registry, "_REGISTRY", {})  # a registry holding only the two backends below

    def fn(q, k, v, *, eps):
        return v

    hf_kernattn.register_backend("test_step", fn, causal=True, noncausal=False, decoding=True, takes=("eps",))
    hf_kernattn.register_backend("test_whole", fn, causal=True, noncausal=False, takes=("eps",))
    assert registry.choose_backend(n=4096, causal=True, rpe=None, key_mask=False, device="cpu") == "test_whole"
