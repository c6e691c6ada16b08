"""A state records the kind of call that produced it, and a continuation of another kind is
refused; ``in_place=True`` refuses state tensors that share memory between elements.

A state's tensors do not tell everything apart: with separate denominator features of the
same size (the rotary split, ``M' = M``) a state of a split call and one of a plain call have
the same shapes, and reading one as the other gives wrong outputs without an error. Every
state ``kernelized_attention`` returns carries its :class:`StateKind`; a continuation whose
kind differs raises a ``ValueError`` naming the difference, in both directions and on every
path (several new tokens, one token, the in-place decoding step), while matching continuations
still equal the whole-sequence call (float64, tolerance as in ``test_state_ops.py``).
"""

from __future__ import annotations

import pytest
import torch

import hf_kernattn
from hf_kernattn import LinearGPTForCausalLM
from hf_kernattn.modeling.state import AttentionState, StateKind
from tests.conftest import V_GPT, tiny_linear_gpt_config

B, H, N, M, D = 2, 3, 9, 4, 5
ATOL = 1e-10  # float64 sums of a few dozen O(1) terms: a few ulp; any wrong key moves it by 1e-2


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64) + 0.1  # noqa: E731
    q, k = torch.randn(B, H, N, M, generator=g, dtype=torch.float64), torch.randn(B, H, N, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    return q, k, v, dict(q_den=rand(B, H, N, M), k_den=rand(B, H, N, M))  # M' = M: the rotary split


def _piece(x, a, b):
    return {key: t[:, :, a:b] for key, t in x.items()} if isinstance(x, dict) else x[:, :, a:b]


@pytest.mark.parametrize("produced_split", [True, False])
@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_continuation_of_another_kind_is_refused_naming_the_mismatch(produced_split, new_tokens, in_place):
    q, k, v, den = _inputs()
    first = den if produced_split else {}
    _, state = hf_kernattn.kernelized_attention(
        q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, output_final_state=True, **_piece(first, 0, 5))
    assert state.kind == StateKind(split=produced_split, features=M, den_features=M, values=D, window=None)
    other = {} if produced_split else den
    end = 5 + new_tokens
    want = "without" if not produced_split else "with"
    with pytest.raises(ValueError, match=rf"initial_state .*produced {want} separate denominator features \(q_den, k_den\)"):
        hf_kernattn.kernelized_attention(
            q[:, :, 5:end], k[:, :, 5:end], v[:, :, 5:end], causal=True, initial_state=state,
            output_final_state=True, in_place=in_place, **_piece(other, 5, end))


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_matching_continuations_equal_the_whole_sequence_call(split, in_place):
    q, k, v, den = _inputs(1)
    extra = den if split else {}
    whole = hf_kernattn.kernelized_attention(q, k, v, causal=True, backend="dense", **extra)
    outs, state = [], None
    for a, b in ((0, 4), (4, 5), (5, 6), (6, N)):  # several tokens, one, one, several
        out, state = hf_kernattn.kernelized_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, initial_state=state, output_final_state=True,
            in_place=in_place and state is not None, **_piece(extra, a, b))
        assert state.kind is not None and state.kind.split == split
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=0, atol=ATOL)


def test_a_windowed_state_is_refused_by_a_call_without_the_bias():
    q, k, v, _ = _inputs(2)
    table = torch.randn(H, 2 * 4 + 1, dtype=torch.float64)
    _, windowed = hf_kernattn.kernelized_attention(
        q[:, :, :5], k[:, :, :5], v[:, :, :5], table, True, rpe_clip=4, output_final_state=True)
    assert windowed.kind.window == 3
    with pytest.raises(ValueError, match=r"window of a relative-position bias clipped at K.*only continues a call of the same kind"):
        hf_kernattn.kernelized_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], causal=True, initial_state=windowed)


def test_a_state_built_by_hand_has_no_kind_and_is_trusted():
    q, k, v, _ = _inputs(3)
    plain = AttentionState(torch.zeros(B, H, M, D, dtype=torch.float64), torch.zeros(B, H, M, dtype=torch.float64))
    assert plain.kind is None and len(plain) == 4 and list(plain._asdict()) == ["kv", "z", "window_k", "window_v"]
    out, state = hf_kernattn.kernelized_attention(q, k, v, causal=True, initial_state=plain, output_final_state=True)
    torch.testing.assert_close(out, hf_kernattn.kernelized_attention(q, k, v, causal=True, backend="dense"),
                               rtol=0, atol=ATOL)
    assert state.kind.split is False


def test_the_decoding_cache_keeps_the_kind_so_another_model_cannot_continue_it():
    """A rotary model (split denominator) and an absolute one have states of the same shapes:
    the cache keeps the kind, so the other model refuses to continue it."""
    torch.manual_seed(0)
    rotary = LinearGPTForCausalLM(tiny_linear_gpt_config(position_embedding_type="rotary")).eval()
    plain = LinearGPTForCausalLM(tiny_linear_gpt_config()).eval()
    ids = torch.randint(1, V_GPT, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = rotary(ids).past_key_values
        assert cache.layers[0].get_state().kind.split is True
        rotary(ids[:, :1], past_key_values=cache.copy())  # the model that made it continues it
        assert cache.copy().layers[0].get_state().kind == cache.layers[0].get_state().kind
        for n in (1, 2):
            with pytest.raises(ValueError, match="separate denominator features"):
                plain(ids[:, :n], past_key_values=cache)


# ----------------------------------------------------------------------------- in_place with expanded states


@pytest.mark.parametrize("bias", [False, True])
def test_in_place_refuses_an_expanded_state_and_leaves_it_alone(bias):
    """A batch-expanded state (``expand``: stride 0 over the batch) has one memory location for
    several elements; writing into it cannot be done. It is refused with a message naming the
    tensor and the fix, on the one-token fast path and on the general path."""
    q, k, v, _ = _inputs(4)
    extra = dict(rpe_bias=torch.randn(H, 2 * 3 + 1, dtype=torch.float64), rpe_clip=3) if bias else {}
    _, one = hf_kernattn.kernelized_attention(
        q[:1, :, :4], k[:1, :, :4], v[:1, :, :4], causal=True, output_final_state=True, **extra)
    expanded = AttentionState(*(None if x is None else x.expand(B, *x.shape[1:]) for x in one), kind=one.kind)
    before = [None if x is None else x.clone() for x in expanded]
    for n in (1, 3):
        with pytest.raises(ValueError, match=r"in_place=True .*initial_state\.kv .*expanded"):
            hf_kernattn.kernelized_attention(q[:, :, 4:4 + n], k[:, :, 4:4 + n], v[:, :, 4:4 + n], causal=True,
                                             initial_state=expanded, output_final_state=True, in_place=True, **extra)
    assert all(a is None or torch.equal(a, b) for a, b in zip(before, expanded))
    # out of place, the expanded state is fine, and so is a contiguous copy in place
    out, _ = hf_kernattn.kernelized_attention(q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5], causal=True,
                                              initial_state=expanded, output_final_state=True, **extra)
    own = AttentionState(*(None if x is None else x.contiguous() for x in expanded), kind=one.kind)
    again, _ = hf_kernattn.kernelized_attention(q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5], causal=True,
                                                initial_state=own, output_final_state=True, in_place=True, **extra)
    torch.testing.assert_close(again, out, rtol=0, atol=ATOL)
