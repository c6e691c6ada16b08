"""Split the sequence, carry the state, resume: equals one call over the whole sequence.

For every form that carries a state (``causal_chunked``, ``recurrent``, ``windowed`` and what
``auto`` picks), with and without a relative-position bias clipped at K and with separate
denominator features (the rotary split), the outputs of a sequence cut into pieces of several
tokens and of one token, each call continuing from the state the previous one returned, equal
the literal float64 formula over the whole sequence; so do the gradients of every input, which
reach the earlier pieces only through the states. Tolerance: float64 sums of a few dozen terms of
size O(1) differ by a few ulp (1e-16 relative); 1e-10 leaves orders of magnitude of margin and
still fails on any wrong weight or missing key.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling.registry import choose_backend
from hf_kernattn.modeling.state import AttentionState
from hf_kernattn.modeling.kernels_windowed import BandedKernelProduct, banded_kernel_product_reference

from tests.reference import literal_reference

B, H, M, D = 2, 3, 5, 4
N = 23
CUTS = (0, 6, 7, 8, 17, N)  # pieces of 6, 1, 1, 9 and 6 tokens
ATOL = 1e-10


def _inputs(seed: int, signed_q: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, N, M, generator=g, dtype=torch.float64) + 0.1
    k = torch.rand(B, H, N, M, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    q_den = k_den = None
    if signed_q:  # numerator features signed (rotated), denominator ones positive
        q_den, k_den = q, k
        q = torch.randn(B, H, N, M, generator=g, dtype=torch.float64)
        k = torch.randn(B, H, N, M, generator=g, dtype=torch.float64)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, :4] = 0  # left padding reaching into the second piece
    mask[0, 10] = 0  # a hole in the middle
    return q, k, v, q_den, k_den, mask


def _split_run(tensors, mask, backend, table=None, clip=None, cuts=CUTS):
    """Outputs of the pieces concatenated, each call continuing from the previous state."""
    q, k, v, q_den, k_den = tensors
    state, outs = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        extra = {} if q_den is None else dict(q_den=q_den[:, :, a:b], k_den=k_den[:, :, a:b])
        out, state = hf_kernattn.kernelized_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], table, True, mask[:, a:b], backend=backend, rpe_clip=clip,
            initial_state=state, output_final_state=True, **extra,
        )
        outs.append(out)
    return torch.cat(outs, dim=2), state


CASES = [
    # (backend, clip or None, split denominator)
    ("causal_chunked", None, False), ("recurrent", None, False), ("auto", None, False),
    ("causal_chunked", None, True), ("recurrent", None, True), ("auto", None, True),
    ("windowed", 1, False), ("windowed", 3, False), ("windowed", 8, False), ("windowed", 40, False),
    ("recurrent", 1, False), ("recurrent", 3, False), ("recurrent", 8, False), ("auto", 3, False), ("auto", 0, False),
]


@pytest.mark.parametrize("backend,clip,split", CASES)
def test_split_carry_resume_equals_whole(backend, clip, split):
    q, k, v, q_den, k_den, mask = _inputs(seed=1 if clip is None else clip + 2, signed_q=split)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v) + ((q_den, k_den) if split else ())]
    full = None
    if clip is not None:  # a table (H, 2K+1) and the full bias (H, 2N-1) it makes
        g = torch.Generator().manual_seed(clip)
        leaves.append((0.7 * torch.randn(H, 2 * clip + 1, generator=g, dtype=torch.float64)).requires_grad_(True))
        r = torch.arange(-(N - 1), N)
        full = lambda: leaves[-1][:, r.clamp(-clip, clip) + clip]  # noqa: E731
    weight = torch.linspace(-1, 1, B * H * N * D, dtype=torch.float64).reshape(B, H, N, D)

    def grads(run):
        for x in leaves:
            x.grad = None
        out = run()
        (out * weight).sum().backward()
        return out.detach(), [x.grad.clone() for x in leaves]

    den = dict(q_den=leaves[3], k_den=leaves[4]) if split else {}
    want, want_grads = grads(lambda: literal_reference(*leaves[:3], None if full is None else full(), True, mask, **den))
    tensors = tuple(leaves[:5]) if split else tuple(leaves[:3]) + (None, None)
    got, got_grads = grads(lambda: _split_run(tensors, mask, backend, None if full is None else leaves[-1], clip)[0])
    real = mask.bool()[:, None, :, None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=ATOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


@pytest.mark.parametrize("backend,clip", [("causal_chunked", None), ("recurrent", None), ("windowed", 4), ("recurrent", 4)])
def test_final_state_is_the_same_however_the_sequence_was_cut(backend, clip):
    """The state after the whole sequence in one call equals the state after the pieces; the
    state of a bias clipped at K holds the last K - 1 keys and values in its window."""
    q, k, v, _, _, mask = _inputs(seed=11)
    table = None if clip is None else 0.3 * torch.randn(H, 2 * clip + 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, whole = _split_run((q, k, v, None, None), mask, backend, table, clip, cuts=(0, N))
    _, pieces = _split_run((q, k, v, None, None), mask, backend, table, clip)
    for a, b in zip(whole, pieces):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    keep = mask.bool()[:, None, :, None]
    km, vm = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    if clip is None:
        torch.testing.assert_close(whole.kv, km.transpose(-1, -2) @ vm, rtol=0, atol=ATOL)
        torch.testing.assert_close(whole.z, km.sum(2), rtol=0, atol=ATOL)
    else:
        w = clip - 1
        torch.testing.assert_close(whole.window_k, km[:, :, N - w :], rtol=0, atol=0)
        torch.testing.assert_close(whole.window_v, vm[:, :, N - w :], rtol=0, atol=0)
        torch.testing.assert_close(whole.kv, km[:, :, : N - w].transpose(-1, -2) @ vm[:, :, : N - w], rtol=0, atol=ATOL)


def test_a_short_first_call_keeps_a_full_window():
    """Fewer tokens than the window: the window is zero-filled in front (zero keys add nothing),
    so the state has one shape from the first token on."""
    q, k, v, _, _, _ = _inputs(seed=3)
    table = torch.zeros(H, 2 * 8 + 1, dtype=torch.float64)
    out, state = hf_kernattn.kernelized_attention(
        q[:, :, :2], k[:, :, :2], v[:, :, :2], table, True, rpe_clip=8, output_final_state=True
    )
    assert state.window_k.shape == (B, H, 7, M) and state.window_v.shape == (B, H, 7, D)
    assert torch.equal(state.window_k[:, :, :5], torch.zeros(B, H, 5, M, dtype=torch.float64))
    assert torch.equal(state.window_k[:, :, 5:], k[:, :, :2]) and not state.kv.any()


def test_a_non_finite_key_poisons_later_calls_through_the_state():
    """A NaN/inf in a real key or value makes its own row, the later rows of that call and every
    row of later calls (they see it) non-finite, never an earlier row, another head or another
    sequence; a non-finite padded slot reaches nothing. Once in a piece of several tokens (its
    rows are NaN exactly), once in a one-token step (which reads no mask values and isolates
    nothing: its only row sees it, and an inf value stays inf)."""
    for backend, clip in (("causal_chunked", None), ("windowed", 3), ("recurrent", 3), ("recurrent", None), ("auto", 3)):
        q, k, v, _, _, mask = _inputs(seed=5)
        k[0, 1, 3] = math.nan  # real key, sequence 0, head 1, in the first piece (6 tokens)
        v[0, 2, 6] = math.inf  # real value, sequence 0, head 2, the one-token piece
        k[1, :, 2] = math.inf  # padded slot of sequence 1
        v[1, :, 1] = math.nan  # and another
        table = None if clip is None else torch.zeros(H, 2 * clip + 1, dtype=torch.float64)
        out, state = _split_run((q, k, v, None, None), mask, backend, table, clip)
        assert torch.isnan(out[0, 1, 3:]).all() and not torch.isfinite(out[0, 2, 6:]).any(), backend
        assert torch.isfinite(out[0, 1, :3]).all() and torch.isfinite(out[0, 2, :6]).all(), backend
        assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[1]).all(), backend
        assert not torch.isfinite(state.kv[0, 1:]).any() and torch.isfinite(state.kv[0, 0]).all()
        assert torch.isfinite(state.kv[1]).all()


def test_banded_op_with_earlier_context_equals_its_plain_reference():
    """The hand-written backward of the windowed op, with queries starting after ``start`` keys of
    earlier context (a state's window), against the same product written plainly."""
    g = torch.Generator().manual_seed(7)
    c, s, start, n = 3, 2, 6, 8
    q = torch.rand(B, H, n, M, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, start + n, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, start + n, D + 1, generator=g, dtype=torch.float64)
    weight = torch.rand(H, c, (s + 1) * c, generator=g, dtype=torch.float64)
    far = torch.rand(B, H, -(-n // c), M, D + 1, generator=g, dtype=torch.float64)
    args = [x.requires_grad_(True) for x in (q, k, v, weight, far)]
    out = BandedKernelProduct.apply(*args, c, s, True, 0.5, start)
    grads = torch.autograd.grad(out.square().sum(), args)
    ref = banded_kernel_product_reference(*args, c, s, True, 0.5, start)
    ref_grads = torch.autograd.grad(ref.square().sum(), args)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):  # sums of O(1e4) terms: relative float64 rounding
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_auto_steps_one_token_recurrently_and_runs_many_in_blocks():
    req = dict(causal=True, key_mask=False, device="cpu", state=True)
    assert choose_backend(n=1, rpe=None, **req) == "recurrent"
    assert choose_backend(n=1, rpe="1d", rpe_clip=4, **req) == "recurrent"
    assert choose_backend(n=50, rpe=None, **req) == "causal_chunked"
    assert choose_backend(n=50, rpe="1d", rpe_clip=4, **req) == "windowed"
    assert choose_backend(n=500, rpe=None, split=True, **dict(req, state=False)) == "causal_chunked"
    assert choose_backend(n=8, rpe=None, split=True, **dict(req, state=False)) == "dense"


def test_state_calls_refuse_what_they_cannot_do():
    q, k, v, q_den, k_den, mask = _inputs(seed=9, signed_q=True)
    x = (q[:, :, :4], k[:, :, :4], v[:, :, :4])
    table = torch.zeros(H, 2 * 6 + 1, dtype=torch.float64)
    ka = hf_kernattn.kernelized_attention
    _, plain = ka(*x, causal=True, output_final_state=True)
    _, windowed = ka(*x, table, True, rpe_clip=6, output_final_state=True)
    with pytest.raises(ValueError, match="need causal=True"):
        ka(*x, output_final_state=True)
    with pytest.raises(ValueError, match="needs rpe_clip"):
        ka(*x, torch.zeros(H, 7, dtype=torch.float64), True, output_final_state=True)
    with pytest.raises(ValueError, match=r"backend 'dense' cannot do a state .*backends that can: \['causal_chunked', "):
        ka(*x, causal=True, backend="dense", initial_state=plain)
    with pytest.raises(ValueError, match=r"initial_state.kv must have shape \(2, 3, 5, 4\)"):
        ka(*x, causal=True, initial_state=AttentionState(plain.kv[:1], plain.z[:1]))
    with pytest.raises(ValueError, match="initial_state.window_k must be a tensor of shape"):
        ka(*x, table, True, rpe_clip=6, initial_state=plain)
    with pytest.raises(ValueError, match="has no clipped bias"):
        ka(*x, causal=True, initial_state=windowed)
    with pytest.raises(ValueError, match=r"must reach offset -rpe_clip=-6: pass the clipped table \(heads, 2\*rpe_clip\+1\) = \(3, 13\)"):
        ka(*x, torch.zeros(H, 7, dtype=torch.float64), True, rpe_clip=6, initial_state=windowed)
    with pytest.raises(TypeError, match="initial_state must be an AttentionState"):
        ka(*x, causal=True, initial_state=plain.kv)
    with pytest.raises(TypeError, match="output_final_state must be a bool"):
        ka(*x, causal=True, output_final_state=1)
    with pytest.raises(ValueError, match="pass both q_den and k_den"):
        ka(*x, causal=True, q_den=q_den[:, :, :4])
    with pytest.raises(ValueError, match="cannot be combined with rpe_bias"):
        ka(*x, table, True, rpe_clip=6, q_den=q_den[:, :, :4], k_den=k_den[:, :, :4])
    with pytest.raises(ValueError, match=r"backend 'fft' cannot do separate denominator features"):
        ka(*x, causal=True, backend="fft", q_den=q_den[:, :, :4], k_den=k_den[:, :, :4])


def test_kernels_called_directly_refuse_a_state_or_split_they_cannot_honour():
    """No kernel ignores an argument: a state without causality, a state with an unclipped bias,
    or denominator features with a bias raise instead of being dropped."""
    from hf_kernattn.modeling.kernels_linear import recurrent_attention
    from hf_kernattn.modeling.kernels_windowed import windowed_attention

    q, k, v, q_den, k_den, _ = _inputs(seed=4, signed_q=True)
    table = torch.zeros(H, 2 * 3 + 1, dtype=torch.float64)
    full = torch.zeros(H, 2 * N - 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="need causal=True"):
        windowed_attention(q, k, v, rpe_bias=table, rpe_clip=3, output_final_state=True)
    with pytest.raises(ValueError, match="unclipped 1D bias"):
        recurrent_attention(q, k, v, rpe_bias=full, output_final_state=True)
    with pytest.raises(ValueError, match="cannot be combined with rpe_bias"):
        recurrent_attention(q, k, v, rpe_bias=table, rpe_clip=3, q_den=q_den, k_den=k_den)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_chunked_hand_written_backward_passes_gradcheck(split, with_state):
    """The chunked causal form's backward is written by hand (it recomputes the chunk products):
    torch's finite-difference gradcheck in float64, with a last chunk cut short (N = 7, C = 3),
    separate denominator features and gradients into the initial state."""
    from hf_kernattn.modeling.kernels_linear import _CausalChunked

    g = torch.Generator().manual_seed(0)
    rand = lambda *s: (torch.rand(*s, generator=g, dtype=torch.float64) + 0.1).requires_grad_()  # noqa: E731
    q, k, v = rand(2, 2, 7, 4), rand(2, 2, 7, 4), rand(2, 2, 7, 3)
    q_den, k_den = (rand(2, 2, 7, 5), rand(2, 2, 7, 5)) if split else (None, None)
    m_den = 5 if split else 4
    s0, z0 = (rand(2, 2, 4, 3), rand(2, 2, m_den)) if with_state else (None, None)
    torch.autograd.gradcheck(lambda *x: _CausalChunked.apply(*x, 1e-6, 3), (q, k, v, q_den, k_den, s0, z0))


@pytest.mark.parametrize("split", [False, True])
def test_linear_hand_written_backward_passes_gradcheck(split):
    """The non-causal linear form's backward is written by hand: float64 gradcheck, with and
    without separate denominator features."""
    from hf_kernattn.modeling.kernels_linear import _Linear

    g = torch.Generator().manual_seed(1)
    rand = lambda *s: (torch.rand(*s, generator=g, dtype=torch.float64) + 0.1).requires_grad_()  # noqa: E731
    q, k, v = rand(2, 2, 5, 4), rand(2, 2, 5, 4), rand(2, 2, 5, 3)
    q_den, k_den = (rand(2, 2, 5, 6), rand(2, 2, 5, 6)) if split else (None, None)
    torch.autograd.gradcheck(lambda *x: _Linear.apply(*x, 1e-6), (q, k, v, q_den, k_den))
