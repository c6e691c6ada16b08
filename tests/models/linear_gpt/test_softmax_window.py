"""Linear GPT with the sliding-window hybrid (``softmax_window=W``): the attention layer equals an
independent dense float64 reference (outputs and gradients, padding, W in {1, 3, 64, > N}), a
prefill carried on by continuations and one-token steps equals the whole forward, greedy and beam
``generate()`` equal ``use_cache=False`` (left-padded batch), the mixing weights are initialised,
saved and reloaded, the decoding state does not grow with the context, and bad configurations
are refused naming the field."""

import pytest
import torch

from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM
from hf_kernattn.modeling.cache import LinearGPTCache

from tests.conftest import tiny_linear_gpt_config
from tests.reference import hybrid_layer_reference

F64 = torch.float64
N = 11


def _model(window=3, dtype=F64, seed=0, **kw):
    torch.manual_seed(seed)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config(softmax_window=window, **kw)).to(dtype).eval()
    with torch.no_grad():  # mixing weights away from 1, so that a swapped or missing weight shows
        for i, block in enumerate(model.transformer.h):
            block.attn.window_log_weight.copy_(torch.tensor([0.3, -0.5]) * (i + 1))
            block.attn.linear_log_weight.copy_(torch.tensor([-0.2, 0.4]) * (i + 1))
    return model


@pytest.mark.parametrize("window", [1, 3, 64, N + 4])
@pytest.mark.parametrize("feature_map", ["elu", "hedgehog"])
def test_attention_layer_equals_dense_reference_outputs_and_gradients(window, feature_map):
    model = _model(window, feature_map=feature_map)
    attn = model.transformer.h[1].attn
    x = torch.randn(2, N, 32, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, :3] = 0
    out = attn(x, attention_mask=mask)
    ref = hybrid_layer_reference(attn, x, window, mask.bool(), causal=True)
    real = mask.bool()[..., None]
    tol = 1e-10
    torch.testing.assert_close(out * real, ref * real, rtol=tol, atol=tol)
    params = [x, attn.window_log_weight, attn.linear_log_weight, attn.q_proj.weight, attn.k_proj.weight]
    params += list(attn.feature_map.parameters())
    g = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(2)) * real
    got = torch.autograd.grad((out * g).sum(), params)
    want = torch.autograd.grad((ref * g).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [1, 3, 64])
def test_prefill_continuation_and_steps_equal_the_whole_forward(window):
    model = _model(window)
    ids = torch.randint(1, 53, (2, N), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
        out = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        out = model(ids[:, 5:8], attention_mask=mask[:, :8], past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        for i in range(8, N):
            out = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[real], whole[real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [1, 4])
def test_greedy_and_beam_generate_equal_use_cache_false(window):
    model = _model(window, dtype=torch.float32)
    ids = torch.randint(1, 53, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 0
    with torch.no_grad():
        for kw in (dict(), dict(num_beams=3)):
            cached = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **kw)
            plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   use_cache=False, **kw)
            assert torch.equal(cached, plain), kw


def test_decode_state_does_not_grow_with_the_context():
    model = _model(8, dtype=torch.float32, position_embedding_type="none")
    g = torch.Generator().manual_seed(5)

    def state_bytes(cache):
        return sum(x.numel() * x.element_size() for layer in cache.layers for x in layer.get_state())

    sizes = {}
    with torch.no_grad():
        cache = model(torch.randint(1, 53, (1, 100), generator=g), use_cache=True).past_key_values
        sizes[100] = state_bytes(cache)
        for _ in range(9):
            cache = model(torch.randint(1, 53, (1, 100), generator=g), past_key_values=cache,
                          use_cache=True).past_key_values
        sizes[cache.get_seq_length()] = state_bytes(cache)
    assert set(sizes) == {100, 1000}
    assert sizes[100] == sizes[1000]
    assert isinstance(cache, LinearGPTCache) and cache.softmax_window == 8
    assert [len(layer.get_state()) for layer in cache.layers] == [6, 6]


def test_mixing_weights_initialised_saved_and_reloaded(tmp_path):
    with torch.device("meta"):
        meta = LinearGPTForCausalLM(tiny_linear_gpt_config(softmax_window=5))
    meta.to_empty(device="cpu")
    meta.init_weights()
    for block in meta.transformer.h:
        assert torch.equal(block.attn.window_log_weight, torch.zeros(2))
        assert torch.equal(block.attn.linear_log_weight, torch.zeros(2))
    model = _model(5, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = LinearGPTForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.softmax_window == 5
    for mine, theirs in zip(model.transformer.h, loaded.transformer.h):
        assert torch.equal(mine.attn.window_log_weight, theirs.attn.window_log_weight)
    ids = torch.randint(1, 53, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # a model without the window has no mixing weights and its config.json no value for the field
    plain = LinearGPTForCausalLM(tiny_linear_gpt_config())
    assert not any("log_weight" in name for name, _ in plain.named_parameters())


def test_bad_configurations_and_foreign_states_are_refused():
    for bad, err in ((0, ValueError), (-1, ValueError), (2.0, TypeError), ("8", TypeError), (True, TypeError)):
        with pytest.raises(err, match="softmax_window must be None or an int >= 1"):
            tiny_linear_gpt_config(softmax_window=bad)
    with pytest.raises(ValueError, match="softmax_window=4 cannot be combined with rpe='learned'"):
        tiny_linear_gpt_config(softmax_window=4, rpe="learned", position_embedding_type="none")
    with pytest.raises(ValueError, match="position_embedding_type='rotary'"):
        tiny_linear_gpt_config(softmax_window=4, position_embedding_type="rotary")
    with pytest.raises(ValueError, match=r"attn_backend='causal_chunked' cannot serve.*softmax window.*\['hybrid'\]"):
        tiny_linear_gpt_config(softmax_window=4, attn_backend="causal_chunked")
    with pytest.raises(ValueError, match="attn_backend='hybrid' cannot serve.*calls without softmax_window"):
        tiny_linear_gpt_config(attn_backend="hybrid")
    assert LinearGPTConfig(softmax_window=4, attn_backend="hybrid", position_embedding_type="rope").softmax_window == 4
    hybrid, plain = _model(3, dtype=torch.float32), LinearGPTForCausalLM(tiny_linear_gpt_config()).eval()
    ids = torch.randint(1, 53, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = plain(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="no softmax window; this model has a softmax window of W=3"):
            hybrid(ids[:, :1], past_key_values=cache, use_cache=True)
        cache = hybrid(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="softmax window of W=3 keys; this model has no softmax window"):
            plain(ids[:, :1], past_key_values=cache, use_cache=True)


def test_checkpoint_with_a_window_loads_and_generates_without_the_package(tmp_path):
    """Saved with the window, loaded with trust_remote_code in a process that cannot import
    hf_kernattn: the same logits, and greedy generate() from the state equals use_cache=False
    and the tokens generated here."""
    import json

    from tests.remote import run_without_package

    model = _model(4, dtype=torch.float32)
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(1, 53, (2, 6), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    ids[0, :2] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    code = f"""
import json, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained("ckpt", trust_remote_code=True).eval()
ids, mask = torch.tensor({ids.tolist()}), torch.tensor({mask.tolist()})
with torch.no_grad():
    logits = m(ids, attention_mask=mask).logits
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached, plain = m.generate(ids, **kw), m.generate(ids, use_cache=False, **kw)
print(json.dumps(dict(logits=logits.tolist(), cached=cached.tolist(), plain=plain.tolist(),
                      cls=type(m).__module__, window=m.config.softmax_window)))
"""
    got = json.loads(run_without_package(code, cwd=str(tmp_path)).strip().splitlines()[-1])
    assert "hf_kernattn" not in got["cls"] and got["window"] == 4
    torch.testing.assert_close(torch.tensor(got["logits"]), logits, rtol=0, atol=0)
    assert got["cached"] == got["plain"] == tokens.tolist()


def test_cache_operations_carry_the_window():
    """copy, batch_repeat_interleave, batch_select_indices, reorder_cache and reset act on all six
    tensors of each layer: a continued row equals that row continued from the original state."""
    model = _model(4)
    ids = torch.randint(1, 53, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        want = model(ids[:, 6:], past_key_values=cache.copy(), use_cache=True).logits
        copied = cache.copy()
        copied.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
        copied.batch_select_indices(torch.tensor([3, 0]))  # rows 1, 0
        copied.reorder_cache(torch.tensor([1, 0]))  # rows 0, 1
        assert [len(layer.get_state()) for layer in copied.layers] == [6, 6]
        got = model(ids[:, 6:], past_key_values=copied, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cache.reset()
    state = cache.layers[0].get_state()
    assert state is None and cache.get_seq_length() == 0
    assert not cache.layers[0].recurrent_states[5].any() and cache.layers[0].recurrent_states[5].dtype == torch.bool
