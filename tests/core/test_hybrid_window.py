"""The sliding-window hybrid kernel (exact softmax over a window, kernelized beyond) against its
dense float64 reference: outputs and gradients, causal and bidirectional, padding, every window
size from 1 to beyond the sequence, chunkings, and split/carry/resume of the causal state."""

import math

import pytest
import torch

from hf_kernattn.modeling.kernels_hybrid import (
    empty_hybrid_state,
    hybrid_attention_reference,
    hybrid_window_attention,
)

B, H, N, DK, M, D = 2, 3, 37, 8, 6, 5
F64 = torch.float64
# float64 sums of at most N terms of magnitude O(1) relative to the denominator, forward and backward
TOL = 64 * N * torch.finfo(F64).eps


def _inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DK, dtype=F64, generator=g) for _ in range(2))
    qf, kf = (torch.rand(B, H, n, M, dtype=F64, generator=g) for _ in range(2))
    v = torch.randn(B, H, n, D, dtype=F64, generator=g)
    return [x.requires_grad_() for x in (q, k, qf, kf, v)]


def _mask(n=N):
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, :5] = False  # left padding
    keep[1, n - 7:] = False  # right padding
    return keep


def _weights(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(H, dtype=F64, generator=g) + 0.5, torch.rand(H, dtype=F64, generator=g) + 0.5


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 16, 64])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk", [4, 64])
def test_equals_dense_reference_outputs_and_gradients(causal, window, padded, chunk):
    xs = _inputs()
    key_mask = _mask() if padded else None
    a_w, b_l = _weights()
    kw = dict(window=window, causal=causal, key_mask=key_mask, window_weight=a_w, linear_weight=b_l)
    out = hybrid_window_attention(*xs, chunk_size=chunk, **kw)
    ref = hybrid_attention_reference(*xs, **kw)
    real = torch.ones(B, 1, N, 1, dtype=torch.bool) if key_mask is None else key_mask[:, None, :, None]
    torch.testing.assert_close(out * real, ref * real, rtol=TOL, atol=TOL)
    g = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(2)) * real
    for got, want in zip(torch.autograd.grad((out * g).sum(), xs), torch.autograd.grad((ref * g).sum(), xs)):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_window_one_is_kernelized_except_the_diagonal_and_a_window_beyond_n_is_softmax():
    q, k, qf, kf, v = (x.detach() for x in _inputs())
    # W > N: every allowed key is in the window: plain (causal) softmax attention
    for causal in (True, False):
        out = hybrid_window_attention(q, k, qf, kf, v, window=N + 5, causal=causal, eps=0.0)
        s = q @ k.transpose(-1, -2) / math.sqrt(DK)
        if causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
        torch.testing.assert_close(out, torch.softmax(s, dim=-1) @ v, rtol=TOL, atol=TOL)
    # W = 1 and a vanishing softmax weight: causal linear attention with the feature maps
    out = hybrid_window_attention(q, k, qf, kf, v, window=1, causal=True, eps=0.0,
                                  window_weight=torch.zeros(H, dtype=F64))
    a = (qf @ kf.transpose(-1, -2)).tril(-1)
    lin = (a @ v) / a.sum(-1, keepdim=True)
    torch.testing.assert_close(out[:, :, 1:], lin[:, :, 1:], rtol=TOL, atol=TOL)


def test_non_finite_values_in_padded_slots_stay_there():
    # (non-finite padded queries are the attention core's to isolate, as for every backend)
    xs = [x.detach() for x in _inputs()]
    key_mask = _mask()
    clean = hybrid_window_attention(*xs, window=3, causal=True, key_mask=key_mask)
    dirty = [x.clone() for x in xs]
    for x in (dirty[1], dirty[3], dirty[4]):  # keys, key features and values of padded positions
        x[0, :, :5] = math.nan
        x[1, :, N - 7:] = math.inf
    dirty = [x.requires_grad_() for x in dirty]
    out = hybrid_window_attention(*dirty, window=3, causal=True, key_mask=key_mask)
    real = key_mask[:, None, :, None]
    assert torch.equal(torch.where(real, out, 0), torch.where(real, clean, 0))
    grads = torch.autograd.grad(torch.where(real, out, 0).sum(), dirty)
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_large_scores_are_stabilised():
    q, k, qf, kf, v = (x.detach() for x in _inputs())
    # scores up to 300: exp(s) overflows float32 (above ~88) but not float64 (the reference)
    f = math.sqrt(300 / float((q @ k.transpose(-1, -2)).abs().max() / math.sqrt(DK)))
    q, k = q * f, k * f
    out = hybrid_window_attention(q, k, qf, kf, v, window=4, causal=True)
    ref = hybrid_attention_reference(q, k, qf, kf, v, window=4, causal=True)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    out32 = hybrid_window_attention(*(x.float() for x in (q, k, qf, kf, v)), window=4, causal=True)
    assert bool(torch.isfinite(out32).all())
    # float32: scores of magnitude 300 carry a relative error of 300 * 2^-24 into exp
    torch.testing.assert_close(out32.double(), ref, rtol=0, atol=4 * 300 * torch.finfo(torch.float32).eps * float(v.abs().max()))


@pytest.mark.parametrize("window", [1, 3, 16, 64])
@pytest.mark.parametrize("split", [[N], [10, 27], [5, 1, 1, 30], [1] * N])
def test_split_carry_resume_equals_whole(window, split):
    xs = [x.detach() for x in _inputs(seed=3)]
    key_mask = _mask()
    whole, final = hybrid_window_attention(*xs, window=window, causal=True, key_mask=key_mask, chunk_size=8,
                                           output_final_state=True)
    state = empty_hybrid_state(B, H, window, DK, M, D, F64, "cpu") if len(split) % 2 else None
    outs, p = [], 0
    for s in split:
        part = [x[:, :, p:p + s] for x in xs]
        out, state = hybrid_window_attention(*part, window=window, causal=True, key_mask=key_mask[:, p:p + s],
                                             chunk_size=8, initial_state=state, output_final_state=True)
        outs.append(out)
        p += s
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=TOL, atol=TOL)
    for got, want in zip(state, final):
        if got.dtype == torch.bool:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert state.window_raw.shape == (B, H, window - 1, DK)  # constant size, whatever the context


@pytest.mark.parametrize("window", [1, 4])
def test_gradients_through_a_state_carried_into_one_token_chunks(window):
    """Training across calls: a state carried into chunks of exactly one token, then one backward
    through all of them, gives the whole sequence's gradients (the one-token step's in-place
    arithmetic is for decoding only, where nothing is recorded)."""
    xs = [x.detach().requires_grad_(True) for x in _inputs(seed=6)]
    weights = torch.linspace(-1, 1, B * H * N * D, dtype=F64).reshape(B, H, N, D)
    whole = hybrid_window_attention(*xs, window=window, causal=True, chunk_size=8)
    want = torch.autograd.grad((whole * weights).sum(), xs)
    outs, state, p = [], None, 0
    for s in [7, 1, 1, 3, 1] + [1] * (N - 13):
        part = [x[:, :, p:p + s] for x in xs]
        out, state = hybrid_window_attention(*part, window=window, causal=True, chunk_size=8, initial_state=state,
                                             output_final_state=True)
        outs.append(out)
        p += s
    got = torch.autograd.grad((torch.cat(outs, dim=2) * weights).sum(), xs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)
