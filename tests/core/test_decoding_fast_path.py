"""The decoding step at the memory bound: the core's in-place state update equals the general
out-of-place step, the decoding cache is updated in its own tensors, the
blocks' weights stay contiguous through saving, loading and generate(), and generate() inspects
nothing per step."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kernattn import LinearGPTForCausalLM, kernelized_attention
from hf_kernattn.modeling.state import AttentionState
from tests.conftest import V_GPT, tiny_linear_gpt_config

from tests.reference import host_reads
from tests.remote import run_without_package

B, H, M, D = 2, 3, 5, 4


def _step_inputs(seed: int, split: bool = False):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(B, H, 1, M), rand(B, H, 1, M), torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    den = dict(q_den=rand(B, H, 1, M + 1), k_den=rand(B, H, 1, M + 1)) if split else {}
    state = AttentionState(rand(B, H, M, D), rand(B, H, M + 1 if split else M))
    return q, k, v, den, state


def _literal_step(q, k, v, state, mask=None, q_den=None, k_den=None, eps=1e-6):
    """out = q (S + k v^T) / (q_den . (z + k_den) + eps), with a padded key contributing nothing."""
    keep = torch.ones(B, 1, 1, 1, dtype=torch.float64) if mask is None else mask.to(torch.float64)[:, None, :, None]
    q_den, k_den = (q, k) if q_den is None else (q_den, k_den)
    kv = state.kv + (k * keep).transpose(-1, -2) @ (v * keep)
    z = state.z + (k_den * keep)[:, :, 0]
    return (q @ kv) / ((q_den * z[:, :, None]).sum(-1, keepdim=True) + eps), kv, z


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_in_place_step_equals_the_formula_and_writes_the_given_tensors(split, masked):
    q, k, v, den, state = _step_inputs(0, split)
    mask = torch.tensor([[1], [0]]) if masked else None
    want, want_kv, want_z = _literal_step(q, k, v, state, mask, **den)
    general_out, general_state = kernelized_attention(
        q, k, v, causal=True, attention_mask=mask, initial_state=state, output_final_state=True, **den)
    own = AttentionState(state.kv.clone(), state.z.clone())
    out, new = kernelized_attention(q, k, v, causal=True, attention_mask=mask, initial_state=own,
                                    output_final_state=True, in_place=True, **den)
    assert new.kv is own.kv and new.z is own.z  # the caller's tensors, updated
    for got in (out, general_out):  # float64: a few roundings of O(1) values
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got in (new, general_state):
        torch.testing.assert_close(got.kv, want_kv, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.z, want_z, rtol=1e-12, atol=1e-12)


def test_in_place_outside_the_fast_path_copies_into_the_given_tensors():
    """Several tokens, a bias clipped at K, or autocast: the general path runs and the state it
    computes is written into the given tensors (same values as without in_place)."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.rand(B, H, 4, M, generator=g, dtype=torch.float64), torch.rand(B, H, 4, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, 4, D, generator=g, dtype=torch.float64)
    bias = torch.randn(H, 7, generator=g, dtype=torch.float64)  # clipped table, K = 3
    _, start = kernelized_attention(q, k, v, rpe_bias=bias, rpe_clip=3, causal=True, output_final_state=True)
    want_out, want = kernelized_attention(q, k, v, rpe_bias=bias, rpe_clip=3, causal=True, initial_state=start,
                                          output_final_state=True)
    own = AttentionState(*(x.clone() for x in start))
    out, new = kernelized_attention(q, k, v, rpe_bias=bias, rpe_clip=3, causal=True, initial_state=own,
                                    output_final_state=True, in_place=True)
    assert all(a is b for a, b in zip(new, own))
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for a, b in zip(new, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_in_place_refuses_what_it_cannot_honour():
    q, k, v, _, state = _step_inputs(2)
    with pytest.raises(ValueError, match="in_place=True needs initial_state and output_final_state=True"):
        kernelized_attention(q, k, v, causal=True, initial_state=state, in_place=True)
    with pytest.raises(ValueError, match="in_place=True needs initial_state in the compute dtype torch.float64"):
        kernelized_attention(q, k, v, causal=True, initial_state=AttentionState(state.kv.float(), state.z.float()),
                             output_final_state=True, in_place=True)
    with pytest.raises(ValueError, match="in_place=True cannot be used while autograd records"):
        kernelized_attention(q.requires_grad_(), k, v, causal=True, initial_state=state, output_final_state=True,
                             in_place=True)
    with pytest.raises(TypeError, match="in_place must be a bool"):
        kernelized_attention(q.detach(), k, v, causal=True, initial_state=state, output_final_state=True, in_place=1)
    # a shape error still gets the general path's message, not one from inside torch
    with pytest.raises(ValueError, match="initial_state.kv must have shape"):
        kernelized_attention(q.detach(), k, v, causal=True, initial_state=AttentionState(state.kv[:, :, :2], state.z),
                             output_final_state=True, in_place=True)


def _model(**overrides):
    torch.manual_seed(0)
    return LinearGPTForCausalLM(tiny_linear_gpt_config(eos_token_id=None, **overrides)).eval()


def test_decoding_updates_the_cache_in_its_own_tensors_and_equals_the_parallel_form():
    model = _model().double()
    ids = torch.randint(1, V_GPT, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        cache = out.past_key_values
        layer = cache.layers[0]
        pointers = [layer.recurrent_states[i].data_ptr() for i in range(layer.number_of_states)]
        steps = [out.logits]
        for t in range(5, 9):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert [layer.recurrent_states[i].data_ptr() for i in range(layer.number_of_states)] == pointers
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


def test_block_weights_stay_contiguous_through_saving_loading_and_generate(tmp_path):
    """nn.Linear's own (out, in) layout everywhere: a column-major copy measured no faster per
    decoding step on this CPU, and FSDP / DeepSpeed need contiguous parameters
    (``tests/models/test_contiguous_parameters.py`` checks every family)."""
    model = _model(mlp_type="gated", norm_type="rmsnorm", position_embedding_type="rope")
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.is_contiguous() for m in linears)
    model.save_pretrained(tmp_path)
    loaded = LinearGPTForCausalLM.from_pretrained(tmp_path).eval()
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert a.shape == b.shape and torch.equal(a, b), name
    ids = torch.randint(1, V_GPT, (1, 6), generator=torch.Generator().manual_seed(5))
    loaded.generate(ids, max_new_tokens=2, do_sample=False)
    assert all(p.is_contiguous() for p in loaded.parameters())
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)  # the same weights, the same operations


def test_generate_inspects_no_signature_per_step_with_remote_code(tmp_path):
    """transformers inspects a remote-code model's forward signature in every step unless the
    model prepares its own inputs; Linear GPT does, so the count does not grow with the tokens."""
    model = _model()
    model.save_pretrained(tmp_path / "m")
    code = """
import inspect, json, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained("m", trust_remote_code=True).eval()
real, count = inspect.signature, [0]
def counting(obj, *a, **kw):
    count[0] += 1
    return real(obj, *a, **kw)
inspect.signature = counting
ids = torch.tensor([[3, 4, 5]])
counts, seqs = [], []
for n in (2, 12):
    count[0] = 0
    seqs.append(m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0).tolist())
    counts.append(count[0])
print(json.dumps([counts, seqs]))
"""
    counts, seqs = json.loads(run_without_package(code, cwd=str(tmp_path)).strip().splitlines()[-1])
    assert counts[0] == counts[1], counts
    assert len(seqs[1][0]) == 15 and seqs[1][0][:5] == seqs[0][0]


def test_a_decoding_step_reads_nothing_on_the_host(monkeypatch):
    """No host synchronisation per decoded token (value checks, .item(), bool() of a tensor) with
    random features, whose key range is checked on every other call; a key outside the range
    then gives NaN, where a prefill raises."""
    model = _model(feature_map="prf", num_random_features=8, position_embedding_type="rotary")
    ids = torch.randint(1, V_GPT, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask[:, :6], use_cache=True).past_key_values
        out, reads = host_reads(monkeypatch, lambda: model(ids[:, :1], attention_mask=mask, past_key_values=cache, use_cache=True))
    assert reads == [] and torch.isfinite(out.logits).all()
    with torch.no_grad():  # a key the features cannot represent: NaN in a step, an error in a prefill
        model.transformer.h[0].attn.k_proj.weight.mul_(1e4)
        step = model(ids[:, :1], attention_mask=torch.ones(2, 8, dtype=torch.long), past_key_values=cache, use_cache=True)
        assert torch.isnan(step.logits).all()
        with pytest.raises(ValueError, match="cannot represent a key"):
            model(ids, use_cache=False)


@pytest.mark.parametrize("positions", ["absolute", "rotary"])
def test_a_step_with_the_position_ids_generate_passes_reads_nothing_on_the_host(monkeypatch, positions):
    """generate() passes ``position_ids`` at every step: with a learned position table they are not
    read on the host in a one-token step (a prefill still checks them against the table)."""
    model = _model(position_embedding_type=positions).double()
    ids = torch.randint(1, V_GPT, (2, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask[:, :6], use_cache=True).past_key_values
        step = lambda: model(ids[:, :1], attention_mask=mask, position_ids=torch.full((2, 1), 6),
                             past_key_values=cache, use_cache=True)
        out, reads = host_reads(monkeypatch, step)
        want = model(torch.cat([ids, ids[:, :1]], 1), attention_mask=mask, use_cache=False).logits[:, -1:]
    assert reads == []
    torch.testing.assert_close(out.logits, want, rtol=1e-10, atol=1e-10)
    if positions == "absolute":
        with pytest.raises(ValueError, match="beyond max_position_embeddings"):
            model(ids, position_ids=torch.full((2, 6), model.config.max_position_embeddings))


def test_in_place_steps_equal_the_general_steps_bitwise():
    """Steps in place on a state's own tensors (as decoding runs them) and the general steps that
    make new tensors run the same operations: the same bits, step after step, padding included."""
    q, k, v, _, state = _step_inputs(7)
    mask = torch.tensor([[1], [0]])
    own = AttentionState(state.kv.clone(), state.z.clone())
    general = state
    for t in range(3):
        q_t, k_t, v_t = q * (t + 1), k + t, v - t
        out, own = kernelized_attention(q_t, k_t, v_t, causal=True, attention_mask=mask, initial_state=own,
                                        output_final_state=True, in_place=True)
        want, general = kernelized_attention(q_t, k_t, v_t, causal=True, attention_mask=mask, initial_state=general,
                                             output_final_state=True)
        assert torch.equal(out, want) and torch.equal(own.kv, general.kv) and torch.equal(own.z, general.z)


def test_a_state_updated_in_place_still_refuses_what_the_general_path_refuses():
    q, k, v, _, state = _step_inputs(8)
    own = AttentionState(state.kv.clone(), state.z.clone())
    _, own = kernelized_attention(q, k, v, causal=True, initial_state=own, output_final_state=True, in_place=True)
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        kernelized_attention(q, k[..., :2], v, causal=True, initial_state=own, output_final_state=True, in_place=True)
    with pytest.raises(ValueError, match="initial_state.kv must have shape"):
        kernelized_attention(q[:1], k[:1], v[:1], causal=True, initial_state=own, output_final_state=True, in_place=True)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        kernelized_attention(q, k, v, causal=True, attention_mask=torch.ones(B, 2), initial_state=own,
                             output_final_state=True, in_place=True)
    with pytest.raises(ValueError, match="eps must be a number"):
        kernelized_attention(q, k, v, causal=True, initial_state=own, output_final_state=True, in_place=True, eps=-1.0)
    with pytest.raises(ValueError, match="in_place=True cannot be used while autograd records"):
        kernelized_attention(q.clone().requires_grad_(), k, v, causal=True, initial_state=own, output_final_state=True,
                             in_place=True)
    with pytest.raises(ValueError, match="initial_state was produced by a call of another kind"):
        kernelized_attention(q, k, v, causal=True, initial_state=own, output_final_state=True, in_place=True,
                             q_den=q, k_den=k)
