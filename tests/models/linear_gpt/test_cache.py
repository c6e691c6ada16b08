"""Linear GPT's decoding state on transformers' own cache layers.

The state of each layer is a ``transformers.cache_utils.LinearAttentionLayer`` whose recurrent
states are S, z and (with the clipped bias) the window's keys and values. What transformers'
caches offer is checked against running the model on the matching batch from scratch: reset
and reuse, reordering for beams, repeating and selecting rows; decoding updates the tensors in
place. Logits are compared in float64 at 1e-10 (the same arithmetic in another order).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from hf_kernattn import LinearGPTForCausalLM
from hf_kernattn.modeling.cache import CACHE_FIELD, LinearGPTCache, LinearGPTCacheLayer

from tests.conftest import V_GPT, tiny_linear_gpt_config
from tests.reference import assert_model_outputs_reordered_close

VARIANTS = {
    "plain": {},
    "rotary": {"position_embedding_type": "rotary"},
    "rpe": {"rpe": "learned", "max_relative_position": 3, "position_embedding_type": "none"},
}


def _model(variant):
    torch.manual_seed(0)
    return LinearGPTForCausalLM(tiny_linear_gpt_config(**VARIANTS[variant])).double().eval()


def _ids(b=3, n=7, seed=1):
    return torch.randint(1, V_GPT, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_state_is_in_transformers_layer_format_and_updated_in_place(variant):
    model = _model(variant)
    ids = _ids()
    with torch.no_grad():
        cache = getattr(model(ids[:, :4], use_cache=True), CACHE_FIELD)
        # transformers' linear-attention layers that also count positions (its Cache.is_linear
        # reports such layers as linear before 5.24 and as not only linear from 5.24)
        assert all(isinstance(layer, LinearAttentionLayer) and isinstance(layer, CacheLayerMixin) for layer in cache.layers)
        layer = cache.layers[0]
        m, d = model.transformer.h[0].attn.feature_map.num_features, 16
        shapes = [(3, 2, m, d), (3, 2, m)] + ([(3, 2, 2, m), (3, 2, 2, d)] if variant == "rpe" else [])
        assert [tuple(layer.recurrent_states[i].shape) for i in range(layer.number_of_states)] == shapes
        pointers = [layer.recurrent_states[i].data_ptr() for i in range(layer.number_of_states)]
        before = layer.recurrent_states[0].clone()
        for t in range(4, 7):
            model(ids[:, t : t + 1], past_key_values=cache)
        assert [layer.recurrent_states[i].data_ptr() for i in range(layer.number_of_states)] == pointers
        assert not torch.equal(layer.recurrent_states[0], before)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reset_then_reuse_equals_a_fresh_cache(variant):
    model = _model(variant)
    first, second = _ids(seed=1), _ids(seed=2)
    with torch.no_grad():
        cache = model(first, use_cache=True).past_key_values
        model(first[:, :1], past_key_values=cache)
        cache.reset()
        assert cache.get_seq_length() == 0 and not cache.is_initialized
        reused = [model(second[:, :5], past_key_values=cache).logits, model(second[:, 5:6], past_key_values=cache).logits]
        fresh_cache = model(second[:, :5], use_cache=True).past_key_values
        fresh = [model(second[:, :5], use_cache=False).logits, model(second[:, 5:6], past_key_values=fresh_cache).logits]
    for a, b in zip(reused, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reorder_repeat_and_select_rows_equal_running_those_rows(variant):
    model = _model(variant)
    ids = _ids()
    nxt = _ids(n=1, seed=5)
    order = torch.tensor([2, 0, 0])
    with torch.no_grad():
        cases = []
        cache = model(ids, use_cache=True).past_key_values
        cache.reorder_cache(order)
        cases.append((cache, order))
        cache = model(ids, use_cache=True).past_key_values
        cache.batch_repeat_interleave(2)
        cases.append((cache, torch.arange(3).repeat_interleave(2)))
        cache = model(ids, use_cache=True).past_key_values
        cache.batch_select_indices(torch.tensor([1, 2]))
        cases.append((cache, torch.tensor([1, 2])))
        for cache, rows in cases:
            got = model(nxt[rows], past_key_values=cache).logits
            want_cache = model(ids[rows], use_cache=True).past_key_values
            want = model(nxt[rows], past_key_values=want_cache).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            assert cache.batch_size == len(rows)


def test_a_copy_is_independent_and_bad_arguments_are_refused():
    model = _model("rpe")
    ids = _ids()
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        copy = cache.copy()
        model(ids[:, :1], past_key_values=cache)
        assert copy.get_seq_length() == 7 and cache.get_seq_length() == 8
        assert not torch.equal(copy.layers[0].recurrent_states[0], cache.layers[0].recurrent_states[0])
    with pytest.raises(ValueError, match="window must be None .* or an int >= 0"):
        LinearGPTCache(2, window=-1)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        LinearGPTCache(0)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(3)
    assert LinearGPTCacheLayer().get_state() is None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_copy_of_a_cache_whose_layers_were_left_unset_continues_like_the_original(variant):
    """A LinearGPTCache whose layers were made with the window left to the first state (as a
    stock Cache of Linear GPT layers has them) copies, before and after its first state; the copy
    continues exactly as the original does."""
    model = _model(variant)
    ids = _ids()
    cache = LinearGPTCache(2)
    cache.layers = [LinearGPTCacheLayer() for _ in range(2)]
    empty = cache.copy()
    assert [layer.window for layer in empty.layers] == [layer.window for layer in cache.layers]
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        copy = cache.copy()
        want = model(ids[:, 5:], past_key_values=cache, use_cache=True).logits
        got = model(ids[:, 5:], past_key_values=copy, use_cache=True).logits
        from_empty = model(ids, past_key_values=empty, use_cache=True).logits[:, 5:]
    assert torch.equal(got, want)
    torch.testing.assert_close(from_empty, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_state_is_a_stock_dynamic_cache_whose_layers_count_the_positions(variant):
    """What forward returns is a transformers DynamicCache: the stock get_seq_length /
    get_mask_sizes answer from the layers' counts (padding included), and a plain stock Cache
    built of Linear GPT layers (window left to the first state) serves the model as well."""
    model = _model(variant)
    ids = _ids()
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # row 0 left-padded
    with torch.no_grad():
        cache = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).past_key_values
        assert type(cache).__mro__[1] is DynamicCache and isinstance(cache, LinearGPTCache)
        assert cache.get_seq_length() == 5 and cache.get_mask_sizes(2, 0) == (7, 0)
        assert [layer.get_seq_length() for layer in cache.layers] == [5, 5]
        stock = Cache(layers=[LinearGPTCacheLayer() for _ in cache.layers])
        got = [model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=stock).logits]
        want = [model(ids[:, :5], attention_mask=mask[:, :5], use_cache=False).logits]
        for t in range(5, 7):
            got.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=stock).logits)
            want.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits)
        assert stock.get_seq_length() == cache.get_seq_length() == 7
        window = 2 if variant == "rpe" else None  # K - 1, taken from the first state
        assert [layer.window for layer in stock.layers] == [window, window]
        assert stock.layers[0].number_of_states == (4 if variant == "rpe" else 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with pytest.raises(NotImplementedError, match="recurrent state"):
        cache.layers[0].update(torch.zeros(1), torch.zeros(1))
    with pytest.raises(TypeError, match="past_key_values must be a LinearGPTCache"):
        model(ids[:, :1], past_key_values=DynamicCache(config=model.config))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_model_cast_between_steps_continues_and_its_state_follows(variant):
    """Cast to float64 between decoding steps: the next step continues from the float32 state
    (not in place: the state's dtype is not the compute dtype) and the cache then holds float64
    states; the logits agree with a float64 run over the whole sequence to the float32 state's
    rounding."""
    model = _model(variant).float()
    ids = _ids(n=10)
    with torch.no_grad():
        cache = model(ids[:, :7], use_cache=True).past_key_values
        assert cache.layers[0].recurrent_states[0].dtype == torch.float32
        model.double()
        got = model(ids[:, 7:8], past_key_values=cache, use_cache=True).logits
        assert got.dtype == torch.float64
        assert all(x.dtype == torch.float64 for layer in cache.layers for x in layer.recurrent_states
                   if isinstance(x, torch.Tensor))
        after = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
        want = model(ids, use_cache=False).logits
    # the float32 state's rounding: within the float32 bound at the logits' magnitude
    assert_model_outputs_reordered_close(got.float(), want[:, 7:8].float(), model.config, 10)
    assert_model_outputs_reordered_close(after.float(), want[:, 8:].float(), model.config, 10)


def test_the_state_is_taken_under_either_name():
    """``cache=`` (transformers' name from 5.24) and ``past_key_values=`` give the same step; the
    output carries the state under the installed version's name; two different states refused."""
    model = _model("plain")
    ids = _ids()
    with torch.no_grad():
        first = getattr(model(ids[:, :5], use_cache=True), CACHE_FIELD)
        second = first.copy()
        by_old = model(ids[:, 5:], past_key_values=first, use_cache=True)
        by_new = model(ids[:, 5:], cache=second, use_cache=True)
        assert torch.equal(by_old.logits, by_new.logits)
        assert getattr(by_new, CACHE_FIELD) is second and getattr(by_old, CACHE_FIELD) is first
        assert model(ids[:, 5:6], past_key_values=first, cache=first, use_cache=True).logits.shape[1] == 1
        with pytest.raises(ValueError, match="cache= or as past_key_values=, not both"):
            model(ids[:, 6:], past_key_values=first, cache=second, use_cache=True)
