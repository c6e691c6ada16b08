"""The sliding-window hybrid's decoding step (``softmax_window=W``): the window is a ring (the
new key written over the one that leaves, ``AttentionState.window_start`` the slot of the oldest),
one-token steps after the first of a session run as flat torch calls bitwise equal to the module
path (configurations x padding, float64, greedy and beam generate()), a window that wraps many
times equals the dense float64 reference, and states copied, reordered or read after wraps
(oldest first from ``get_state()``) continue as the modules do."""

from __future__ import annotations

import pytest
import torch

from hf_kernattn.modeling.cache import LinearGPTCacheLayer
from hf_kernattn.modeling.dispatch import kernelized_attention
from hf_kernattn import SoftmaxWindow
from hf_kernattn.modeling.state import AttentionState
from tests.models.linear_gpt.test_decoding_session import (  # noqa: F401  (fast_steps: a fixture)
    _assert_bitwise, _assert_fast_steps_equal_modules_and_forward, _decode, _force_modules, _ids, _model,
    _padded_mask, fast_steps,
)
from tests.reference import hybrid_layer_reference, reorder_atol

F64 = torch.float64
CONFIGS = {
    "w1": dict(softmax_window=1),
    "w3_elu_absolute": dict(softmax_window=3),
    "w4_rope_gqa_gated_rmsnorm": dict(softmax_window=4, position_embedding_type="rope", num_attention_heads=4,
                                      num_key_value_heads=2, mlp_type="gated", norm_type="rmsnorm",
                                      attention_bias=True, hidden_act="silu"),
    "w2_hedgehog_none": dict(softmax_window=2, feature_map="hedgehog", position_embedding_type="none"),
}


def _weights_away_from_one(model):
    with torch.no_grad():  # mixing weights away from 1, so that a swapped or missing weight shows
        for i, block in enumerate(model.transformer.h):
            heads = block.attn.num_heads
            block.attn.window_log_weight.copy_(torch.linspace(-0.5, 0.3, heads) * (i + 1))
            block.attn.linear_log_weight.copy_(torch.linspace(0.4, -0.2, heads) * (i + 1))
    return model


def _hybrid(dtype=torch.float32, **config):
    return _weights_away_from_one(_model(dtype, **config))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("masked", [False, True])
def test_hybrid_fast_steps_equal_the_module_path_bitwise(name, masked, fast_steps):
    model = _hybrid(**CONFIGS[name])
    ids = _ids(n=16)  # 12 steps
    _assert_fast_steps_equal_modules_and_forward(model, ids, _padded_mask(ids) if masked else None, fast_steps, 11)

def test_hybrid_float64_steps_equal_the_module_path_bitwise_and_the_whole_forward(fast_steps):
    model = _hybrid(F64, **CONFIGS["w4_rope_gqa_gated_rmsnorm"])
    ids = _ids(n=30)  # the window of 3 keys wraps 9 times
    mask = _padded_mask(ids)
    fast = _decode(model, ids, mask)
    assert all(fast_steps) and fast_steps
    hook = _force_modules(model)
    _assert_bitwise(fast, _decode(model, ids, mask))
    hook.remove()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(fast[0][mask.bool()], full[mask.bool()], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("beams", [1, 3])
def test_hybrid_generate_equals_the_module_path(beams, fast_steps):
    model = _hybrid(**CONFIGS["w3_elu_absolute"])
    ids = _ids(n=6)
    mask = _padded_mask(ids)
    ids[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, num_beams=beams, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        fast = model.generate(ids, **kw)
        assert any(fast_steps)
        hook = _force_modules(model)
        modules = model.generate(ids, **kw)
        hook.remove()
    assert torch.equal(fast.sequences, modules.sequences)
    assert all(torch.equal(a, b) for a, b in zip(fast.scores, modules.scores))


@pytest.mark.parametrize("window", [1, 2, 4])
def test_a_window_that_wraps_many_times_equals_the_dense_reference(window):
    model = _hybrid(F64, softmax_window=window)
    attn = model.transformer.h[1].attn
    n = 12 * window + 5
    x = torch.randn(2, n, 32, dtype=F64, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 7] = False  # a padded slot inside the window as it wraps
    layer = LinearGPTCacheLayer()
    starts, outs = [], []
    with torch.no_grad():
        outs.append(attn(x[:, :2], attention_mask=mask[:, :2].long(), past_key_values=layer))
        for t in range(2, n):
            outs.append(attn(x[:, t:t + 1], attention_mask=mask[:, t:t + 1].long(), past_key_values=layer))
            starts.append(layer.window_start)
        ref = hybrid_layer_reference(attn, x, window, mask, causal=True)
    assert len(set(starts)) == max(window - 1, 1)  # every slot of the ring was the start
    real = mask[..., None]
    torch.testing.assert_close(torch.cat(outs, 1) * real, ref * real, rtol=1e-10, atol=1e-10)


def _prefill_and_steps(model, ids, mask, steps_from: int):
    with torch.no_grad():
        out = model(ids[:, :steps_from], attention_mask=mask[:, :steps_from], use_cache=True)
        cache = out.past_key_values
        for t in range(steps_from, ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
    return out.logits, cache


def test_states_after_wraps_read_oldest_first_copy_and_reorder(fast_steps):
    model = _hybrid(F64, softmax_window=4)
    ids = _ids(n=24, seed=7)
    mask = _padded_mask(ids)
    _, stepped = _prefill_and_steps(model, ids[:, :-4], mask[:, :-4], 3)
    assert stepped.layers[0].window_start != 0  # (19 keys through a ring of 3 slots)
    with torch.no_grad():  # one prefill of the same tokens: its window is oldest first
        whole = model(ids[:, :-4], attention_mask=mask[:, :-4], use_cache=True).past_key_values
    for mine, theirs in zip(stepped.layers, whole.layers):
        ordered, want = mine.get_state(), theirs.get_state()
        assert ordered.window_start == 0 and want.window_start == 0
        for a, b in zip(ordered, want):
            if a.dtype == torch.bool:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        ring = mine.get_state(ordered=False)
        assert ring.window_start == mine.window_start and ring[4] is mine.recurrent_states[4]

    def carry_on(cache, rows):
        with torch.no_grad():
            out = None
            for t in range(ids.shape[1] - 4, ids.shape[1]):
                out = model(ids[rows, t:t + 1], attention_mask=mask[rows, :t + 1], past_key_values=cache,
                            use_cache=True)
        return out.logits

    copied = stepped.copy()  # oldest first, start 0
    assert all(layer.window_start == 0 for layer in copied.layers)
    reordered = stepped.copy()
    for a, b in zip(reordered.layers, stepped.layers):  # the ring as it was, rows swapped
        a.set_state(b.get_state(ordered=False))
    reordered.reorder_cache(torch.tensor([1, 0]))
    assert [layer.window_start for layer in reordered.layers] == [layer.window_start for layer in stepped.layers]
    from_copy = carry_on(copied, [0, 1])
    swapped = carry_on(reordered, [1, 0])
    original = carry_on(stepped, [0, 1])
    torch.testing.assert_close(from_copy, original, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(swapped, original[[1, 0]], rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1:]
    torch.testing.assert_close(original, full, rtol=1e-10, atol=1e-10)


def _core_inputs(b=2, h=2, n=1, d=4, m=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, x, dtype=F64, generator=g) for x in (d, d, m, m, d)]


def test_a_ring_state_continues_as_the_same_state_in_order():
    window = 5
    q, k, qf, kf, v = _core_inputs(n=9)
    sw = SoftmaxWindow(q[:, :, :8], k[:, :, :8], window)
    _, state = kernelized_attention(qf[:, :, :8].exp(), kf[:, :, :8].exp(), v[:, :, :8], causal=True,
                                    backend="hybrid", softmax_window=sw, output_final_state=True)
    assert state.window_start == 0
    ring = AttentionState(*state[:2], *(torch.roll(x, 1, dims=2) for x in state[2:]), kind=state.kind,
                          window_start=1)
    assert all(torch.equal(a, b) for a, b in zip(ring.ordered(), state))
    step = dict(causal=True, backend="hybrid", output_final_state=True,
                softmax_window=SoftmaxWindow(q[:, :, 8:], k[:, :, 8:], window))
    want_out, want = kernelized_attention(qf[:, :, 8:].exp(), kf[:, :, 8:].exp(), v[:, :, 8:], initial_state=state,
                                          **step)
    out, got = kernelized_attention(qf[:, :, 8:].exp(), kf[:, :, 8:].exp(), v[:, :, 8:], initial_state=ring, **step)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert want.window_start == 1 and got.window_start == 2
    for a, b in zip(got.ordered(), want.ordered()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # a continuation of several tokens from a ring reads it in order: its final window is oldest first
    more = dict(step, softmax_window=SoftmaxWindow(q, k, window))
    out_ring, from_ring = kernelized_attention(qf.exp(), kf.exp(), v, initial_state=ring, **more)
    out_ord, from_ord = kernelized_attention(qf.exp(), kf.exp(), v, initial_state=state, **more)
    assert from_ring.window_start == 0
    assert torch.equal(out_ring, out_ord) and all(torch.equal(a, b) for a, b in zip(from_ring, from_ord))


def test_window_start_is_checked():
    kv, z = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5)
    window = (torch.zeros(1, 2, 3, 5), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4),
              torch.zeros(1, 1, 3, dtype=torch.bool))
    assert AttentionState(kv, z, *window, window_start=2).window_start == 2
    with pytest.raises(ValueError, match="window_start must lie in"):
        AttentionState(kv, z, *window, window_start=3)
    with pytest.raises(ValueError, match="window_start must lie in"):
        AttentionState(kv, z, window_start=1)  # no hybrid window
    with pytest.raises(TypeError, match="window_start must be an int"):
        AttentionState(kv, z, *window, window_start=True)
    assert "window_start=2" in repr(AttentionState(kv, z, *window, window_start=2))


def test_a_table_or_a_backend_made_active_between_steps_makes_the_plan_again(fast_steps):
    """Under ``backend="auto"`` a table loaded or a backend registered between steps (what auto
    picks may change) drops the cache's plan; one step runs the modules, which ask auto, and the
    plan made again serves the next: bitwise the module path."""
    import hf_kernattn

    def mine(q, k, v, *, eps):
        return hf_kernattn.get_backend("linear").fn(q, k, v, eps=eps)

    def between(t):
        if t == 8:
            hf_kernattn.load_auto_table(None)  # a table made active (the shipped one again)
        elif t == 10:
            hf_kernattn.register_backend("test_auto_version", mine, key_mask=False, takes=("eps",))

    model = _hybrid(**CONFIGS["w3_elu_absolute"])
    assert model.config.attn_backend == "auto"
    ids = _ids(n=12)
    try:
        fast = _decode(model, ids, between=between)
    finally:
        hf_kernattn.unregister_backend("test_auto_version")
        hf_kernattn.load_auto_table(None)
    assert fast_steps == [True, True, True, False, True, False, True]
    hook = _force_modules(model)
    _assert_bitwise(fast, _decode(model, ids))
    hook.remove()


def test_mixing_weights_changed_between_steps_are_used(fast_steps):
    """The session keeps each layer's mixing weights as made from the parameters and makes them
    again after an in-place write (version) or a replaced tensor (``.data``): bitwise the module path."""

    def run(force):
        model = _hybrid(**CONFIGS["w3_elu_absolute"])
        attn = model.transformer.h[1].attn

        def between(t):
            with torch.no_grad():
                if t == 7:
                    attn.window_log_weight.add_(0.25)
                elif t == 9:
                    attn.linear_log_weight.data = attn.linear_log_weight.data - 0.5
                elif t == 11:
                    attn.window_log_weight.data = attn.window_log_weight.data.clone()  # same values, other memory

        hook = _force_modules(model) if force else None
        got = _decode(model, _ids(n=14), between=between)
        if hook is not None:
            hook.remove()
        return got

    fast = run(False)
    assert fast_steps == [True] * 9
    fast_steps.clear()
    _assert_bitwise(fast, run(True))
    assert not any(fast_steps)


@pytest.mark.parametrize("config", [dict(softmax_window=4), dict(softmax_window=1, feature_map="hedgehog_exp"), {}])
def test_generate_continued_from_its_cache_without_a_mask_equals_the_whole_forward(config):
    """``generate(seq, cache=...)`` with no attention_mask after a first generate(): the next
    token's scores are the whole sequence's forward (generate hands scores over in float32). The
    pad id lies outside the vocabulary: generate() reads a pad id inside the sequence as padding
    (as for GPT-2), which a mask of ones overrides."""
    model = _weights_away_from_one(_model(F64, max_position_embeddings=128, **config)) if config else \
        _model(F64, max_position_embeddings=128)
    ids = torch.randint(1, 53, (1, 6), generator=torch.Generator().manual_seed(6)) % model.config.vocab_size
    kw = dict(do_sample=False, pad_token_id=model.config.vocab_size, return_dict_in_generate=True)
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=8, **kw)
        more = model.generate(first.sequences, past_key_values=first.past_key_values, max_new_tokens=1,
                              output_scores=True, **kw)
        whole = model(first.sequences, use_cache=False).logits[:, -1]
    # generate() hands scores over in float32: the float64 logits rounded to float32 (half an ulp), besides
    # the float64 sums of the step and the whole forward in other orders
    atol = reorder_atol(whole, terms=max(model.config.hidden_size, model.config.intermediate_size, 24),
                        layers=4 * model.config.num_hidden_layers)
    torch.testing.assert_close(more.scores[0].double(), whole, rtol=2 ** -24, atol=atol)
