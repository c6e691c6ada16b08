"""The sliding-window hybrid through ``kernelized_attention(..., softmax_window=...)``: the
``hybrid`` backend equals the dense float64 reference (outputs and gradients, causal and
bidirectional, padding, W in {1, 3, 64, > N}), ``auto`` picks it by capability and every other
backend refuses the keyword, the causal state (six tensors) splits, carries and resumes, the
non-finite guard covers the raw queries and keys, and bad input gets errors naming the parameter."""

import math

import pytest
import torch

from hf_kernattn import kernelized_attention
from hf_kernattn import SoftmaxWindow
from hf_kernattn.modeling.kernels_hybrid import hybrid_attention_reference
from hf_kernattn.modeling.registry import available_backends, get_backend
from hf_kernattn.modeling.state import AttentionState

B, H, N, DK, M, D = 2, 3, 13, 6, 5, 4
F64 = torch.float64
TOL = 64 * N * torch.finfo(F64).eps  # float64 sums of at most N terms, forward and backward


def _inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DK, dtype=F64, generator=g) for _ in range(2))
    qf, kf = (torch.rand(B, H, n, M, dtype=F64, generator=g) + 0.1 for _ in range(2))
    v = torch.randn(B, H, n, D, dtype=F64, generator=g)
    a, b = (torch.rand(H, dtype=F64, generator=g) + 0.5 for _ in range(2))
    return [x.requires_grad_() for x in (q, k, qf, kf, v, a, b)]


def _mask(n=N):
    keep = torch.ones(B, n, dtype=torch.long)
    keep[0, :4] = 0  # left padding
    keep[1, n - 3:] = 0  # right padding
    return keep


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 64, N + 5])
@pytest.mark.parametrize("padded", [False, True])
def test_equals_dense_reference_outputs_and_gradients(causal, window, padded):
    q, k, qf, kf, v, a, b = xs = _inputs()
    mask = _mask() if padded else None
    out = kernelized_attention(qf, kf, v, causal=causal, attention_mask=mask,
                               softmax_window=SoftmaxWindow(q, k, window, None, a, b))
    key_mask = None if mask is None else mask.bool()
    ref = hybrid_attention_reference(q, k, qf, kf, v, window=window, causal=causal, key_mask=key_mask,
                                     window_weight=a, linear_weight=b)
    real = torch.ones(B, 1, N, 1, dtype=torch.bool) if mask is None else mask.bool()[:, None, :, None]
    torch.testing.assert_close(out * real, ref * real, rtol=TOL, atol=TOL)
    g = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(2)) * real
    for got, want in zip(torch.autograd.grad((out * g).sum(), xs), torch.autograd.grad((ref * g).sum(), xs)):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_a_window_beyond_n_is_softmax_of_the_raw_scores():
    """Independent of the kernel's reference: with W > N and weights 1 the result is softmax
    attention over the raw queries and keys with the given scale."""
    q, k, qf, kf, v, _, _ = _inputs()
    for causal in (True, False):
        out = kernelized_attention(qf, kf, v, causal=causal, softmax_window=SoftmaxWindow(q, k, N + 1, 0.7), eps=0.0)
        s = 0.7 * q @ k.transpose(-1, -2)
        if causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -torch.inf)
        torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=TOL, atol=TOL)


def test_auto_picks_the_hybrid_and_every_other_backend_refuses_the_keyword():
    assert get_backend("hybrid").softmax_window and "hybrid" in available_backends()
    q, k, qf, kf, v, a, b = _inputs()
    sw = SoftmaxWindow(q, k, 3, None, a, b)
    for causal in (True, False):
        auto = kernelized_attention(qf, kf, v, causal=causal, softmax_window=sw)
        named = kernelized_attention(qf, kf, v, causal=causal, softmax_window=sw, backend="hybrid")
        torch.testing.assert_close(auto, named, rtol=0, atol=0)
    for name in available_backends():
        if name != "hybrid":
            with pytest.raises(ValueError, match=r"softmax window \(softmax_window\).*\['hybrid'\]"):
                kernelized_attention(qf, kf, v, causal=get_backend(name).causal, softmax_window=sw, backend=name)
    with pytest.raises(ValueError, match="calls without softmax_window"):
        kernelized_attention(qf, kf, v, causal=True, backend="hybrid")


@pytest.mark.parametrize("window", [1, 3, 64])
def test_split_carry_resume_equals_whole(window):
    """Prefill, a continuation of several tokens, then one-token steps in place (decoding):
    what one call over the whole sequence gives; the state keeps six tensors of fixed shapes."""
    q, k, qf, kf, v, a, b = (x.detach() for x in _inputs())
    mask = _mask()
    mask[1] = 1  # a continuation never sees right padding; left padding stays

    def part(lo, hi):
        sl = slice(lo, hi)
        return (qf[:, :, sl], kf[:, :, sl], v[:, :, sl]), SoftmaxWindow(q[:, :, sl], k[:, :, sl], window, None, a, b)

    whole = kernelized_attention(qf, kf, v, causal=True, attention_mask=mask,
                                 softmax_window=SoftmaxWindow(q, k, window, None, a, b))
    args, sw = part(0, 5)
    out, state = kernelized_attention(*args, causal=True, attention_mask=mask[:, :5], softmax_window=sw,
                                      output_final_state=True)
    assert len(state) == 6 and state.kind.softmax_window == window
    assert state.window_raw.shape == (B, H, window - 1, DK) and state.window_valid.dtype == torch.bool
    outs = [out]
    args, sw = part(5, 9)
    out, state = kernelized_attention(*args, causal=True, attention_mask=mask[:, 5:9], softmax_window=sw,
                                      initial_state=state, output_final_state=True)
    outs.append(out)
    shapes = [x.shape for x in state]
    for i in range(9, N):
        args, sw = part(i, i + 1)
        own = state
        out, state = kernelized_attention(*args, causal=True, attention_mask=mask[:, i:i + 1], softmax_window=sw,
                                          initial_state=state, output_final_state=True, in_place=True)
        assert all(x is y for x, y in zip(state, own))  # written into the given tensors
        outs.append(out)
    assert [x.shape for x in state] == shapes
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=TOL, atol=TOL)


def test_a_state_only_continues_a_call_of_its_kind():
    q, k, qf, kf, v, a, b = (x.detach() for x in _inputs())
    _, hybrid = kernelized_attention(qf, kf, v, causal=True, softmax_window=SoftmaxWindow(q, k, 3),
                                     output_final_state=True)
    _, plain = kernelized_attention(qf, kf, v, causal=True, output_final_state=True)
    one = (qf[:, :, :1], kf[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="window_raw"):
        kernelized_attention(*one, causal=True, initial_state=hybrid, output_final_state=True)
    with pytest.raises(ValueError, match="window_k"):
        kernelized_attention(*one, causal=True, initial_state=plain, output_final_state=True,
                             softmax_window=SoftmaxWindow(q[:, :, :1], k[:, :, :1], 3))
    with pytest.raises(ValueError, match="W=3.*W=5|window_k"):
        kernelized_attention(*one, causal=True, initial_state=hybrid, output_final_state=True,
                             softmax_window=SoftmaxWindow(q[:, :, :1], k[:, :, :1], 5))
    rebuilt = AttentionState(*hybrid)  # a state rebuilt from its six tensors continues as well
    assert len(rebuilt) == 6 and rebuilt.window_valid is hybrid.window_valid


def test_non_finite_raw_inputs_reach_only_the_rows_that_see_them():
    q, k, qf, kf, v, a, b = (x.detach().clone() for x in _inputs())
    mask = _mask()
    q[0, 1, 6] = float("nan")  # a raw query: its own row only
    k[1, 2, 2] = float("inf")  # a raw key of a real position: it and the later rows (causal)
    k[0, 0, 1] = float("nan")  # a padded position: nothing
    out = kernelized_attention(qf, kf, v, causal=True, attention_mask=mask, softmax_window=SoftmaxWindow(q, k, 3))
    bad = ~torch.isfinite(out).all(dim=-1)
    want = torch.zeros(B, H, N, dtype=torch.bool)
    want[0, 1, 6] = True
    want[1, 2, 2:] = True
    assert torch.equal(bad, want)


def test_bad_softmax_window_input_is_refused_naming_the_parameter():
    q, k, qf, kf, v, a, b = (x.detach() for x in _inputs())

    def call(sw, **kw):
        return kernelized_attention(qf, kf, v, causal=True, softmax_window=sw, **kw)

    cases = [
        ((q, k, 3), TypeError, "softmax_window must be None or a SoftmaxWindow"),
        (SoftmaxWindow(q, k, 0), ValueError, r"softmax_window.window must be an int >= 1.*got 0"),
        (SoftmaxWindow(q, k, -2), ValueError, r"softmax_window.window must be an int >= 1"),
        (SoftmaxWindow(q, k, 2.0), TypeError, r"softmax_window.window must be an int >= 1"),
        (SoftmaxWindow(q, k, True), TypeError, r"softmax_window.window must be an int >= 1"),
        (SoftmaxWindow(q, k, 3, 0.0), ValueError, r"softmax_window.scale"),
        (SoftmaxWindow(q, k, 3, None, a[:2]), ValueError, r"softmax_window.window_weight must be None or a tensor of shape \(heads,\)"),
        (SoftmaxWindow(q, k, 3, None, None, b[None]), ValueError, r"softmax_window.linear_weight"),
        (SoftmaxWindow(q[:, :, :-1], k, 3), ValueError, r"softmax_window.q \(the raw queries\) must have shape"),
        (SoftmaxWindow(q, k[..., :-1], 3), ValueError, r"one head_dim"),
        (SoftmaxWindow(q.float(), k, 3), ValueError, r"softmax_window.q must have the dtype and device of q"),
    ]
    for sw, err, msg in cases:
        with pytest.raises(err, match=msg):
            call(sw)
    for bad in (-1.0, 0.0, math.nan, math.inf):  # mixing weights must be positive and finite
        w = a.clone()
        w[1] = bad
        with pytest.raises(ValueError, match=r"softmax_window.window_weight must hold positive finite"):
            call(SoftmaxWindow(q, k, 3, None, w))
        with pytest.raises(ValueError, match=r"softmax_window.linear_weight must hold positive finite"):
            call(SoftmaxWindow(q, k, 3, None, None, w))
    bias = torch.zeros(H, 2 * N - 1, dtype=F64)
    with pytest.raises(ValueError, match="softmax_window cannot be combined with rpe_bias"):
        call(SoftmaxWindow(q, k, 3), rpe_bias=bias)
    with pytest.raises(ValueError, match="softmax_window cannot be combined with separate denominator"):
        call(SoftmaxWindow(q, k, 3), q_den=qf, k_den=kf)


def test_an_empty_batch_gives_an_empty_result_and_state():
    q, k, qf, kf, v, a, b = (x.detach()[:0] if x.dim() == 4 else x.detach() for x in _inputs())
    out, state = kernelized_attention(qf, kf, v, causal=True, softmax_window=SoftmaxWindow(q, k, 3, None, a, b),
                                      output_final_state=True)
    assert out.shape == (0, H, N, D) and state.window_raw.shape == (0, H, 2, DK) and state.kv.shape == (0, H, M, D)
