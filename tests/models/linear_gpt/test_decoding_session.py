"""One-token decoding steps after the first from a cache run by the cache's decoding plan (flat
torch calls) with logits and states bitwise those of the module path, which a forward hook forces
(the plan refuses hooked modules): every supported configuration, left padding with a mask,
generate() greedy and beam search; parameters and modules changed between steps, caches copied
or reordered, and calls the plan does not cover all give what the modules give; no host read per
step. Which steps the plan ran is read from the cache (``cache.decoding_plan.steps``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_kernattn import LinearGPTForCausalLM
from hf_kernattn.modeling.cache import CACHE_FIELD
from tests.conftest import V_GPT, tiny_linear_gpt_config
from tests.reference import assert_model_outputs_reordered_close, host_reads

CONFIGS = {
    "elu_absolute": {},
    "relu_none": dict(feature_map="relu", position_embedding_type="none"),
    "prf_rotary": dict(feature_map="prf", num_random_features=8, position_embedding_type="rotary"),
    "rope_gqa_gated_rmsnorm": dict(position_embedding_type="rope", num_attention_heads=4, num_key_value_heads=2,
                                   mlp_type="gated", norm_type="rmsnorm", attention_bias=True, hidden_act="silu"),
    "elu_normalized_none": dict(normalize_qk=True, position_embedding_type="none"),
    "hedgehog_gqa": dict(feature_map="hedgehog", num_attention_heads=4, num_key_value_heads=2),
    # the plain layer's inlined step (map in place, no rotation, no grouping) with the gated MLP and RMSNorm
    "relu_gated_rmsnorm": dict(feature_map="relu", position_embedding_type="none", mlp_type="gated",
                               norm_type="rmsnorm", hidden_act="silu", attention_bias=True),
}


def _model(dtype=torch.float32, **overrides) -> LinearGPTForCausalLM:
    torch.manual_seed(0)
    return LinearGPTForCausalLM(tiny_linear_gpt_config(eos_token_id=None, **overrides)).eval().to(dtype)


def _force_modules(model: LinearGPTForCausalLM):
    """A forward hook that changes nothing: the session refuses hooked modules, so every step of
    this model runs the module path."""
    return model.transformer.ln_f.register_forward_hook(lambda module, args, out: None)


def plan_steps(cache) -> tuple:
    """The cache's decoding plan and how many steps it has run (None, 0 without one)."""
    plan = getattr(cache, "decoding_plan", None)
    return (plan, plan.steps) if plan else (None, 0)


@pytest.fixture
def fast_steps(monkeypatch) -> list:
    """One entry per one-token call from a cache that had a plan: True where the plan ran it."""
    served = []
    real = LinearGPTForCausalLM.forward

    def observed(self, input_ids=None, *args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        one = cache is not None and input_ids is not None and input_ids.shape[-1] == 1
        before = plan_steps(cache)
        out = real(self, input_ids, *args, **kwargs)
        if one and before[0] is not None:
            after = plan_steps(cache)
            served.append(after[0] is before[0] and after[1] == before[1] + 1)
        return out

    monkeypatch.setattr(LinearGPTForCausalLM, "forward", observed)
    return served


def _ids(batch: int = 2, n: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V_GPT, (batch, n), generator=torch.Generator().manual_seed(seed))


def _padded_mask(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    return mask


def _decode(model, ids, mask=None, prompt: int = 4, between=None):
    """Prefill ``prompt`` tokens, then one-token steps (``between(t)`` before step t): the logits
    of every call and the final states."""
    with torch.no_grad():
        kw = {} if mask is None else dict(attention_mask=mask[:, :prompt])
        out = model(ids[:, :prompt], use_cache=True, **kw)
        logits, cache = [out.logits], out.past_key_values
        for t in range(prompt, ids.shape[1]):
            if between is not None:
                between(t)
            kw = {} if mask is None else dict(attention_mask=mask[:, : t + 1])
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kw)
            logits.append(out.logits)
            cache = out.past_key_values
    states = [layer.recurrent_states[i].clone() for layer in cache.layers for i in range(layer.number_of_states)]
    return torch.cat(logits, 1), states


def _assert_bitwise(a, b):
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("masked", [False, True])
def test_fast_steps_equal_the_module_path_bitwise(name, masked, fast_steps):
    model = _model(**CONFIGS[name])
    ids = _ids()
    _assert_fast_steps_equal_modules_and_forward(model, ids, _padded_mask(ids) if masked else None, fast_steps, 5)


def _assert_fast_steps_equal_modules_and_forward(model, ids, mask, fast_steps, n_fast):
    """Decode ``ids`` step by step: all but the first of the steps (``n_fast``) take the session,
    the logits are bitwise those of the forced module path and match the parallel forward's."""
    fast = _decode(model, ids, mask)
    assert fast_steps == [True] * n_fast  # the first step runs the modules and starts the session
    hook = _force_modules(model)
    fast_steps.clear()
    modules = _decode(model, ids, mask)
    hook.remove()
    assert not any(fast_steps)
    _assert_bitwise(fast, modules)
    with torch.no_grad():  # and both are the parallel forward's
        full = model(ids, attention_mask=mask, use_cache=False).logits
    real = slice(None) if mask is None else mask.bool()
    assert_model_outputs_reordered_close(fast[0][real], full[real], model.config, ids.shape[1])


@pytest.mark.parametrize("name", ["rope_gqa_gated_rmsnorm", "elu_absolute", "relu_gated_rmsnorm"])
def test_float64_steps_equal_the_module_path_bitwise(name, fast_steps):
    """Float64, padded: the session's steps (rotary and grouped heads, and the plain layers'
    inlined step) bitwise the module path."""
    model = _model(torch.float64, **CONFIGS[name])
    ids = _ids()
    fast = _decode(model, ids, _padded_mask(ids))
    assert all(fast_steps) and fast_steps
    hook = _force_modules(model)
    _assert_bitwise(fast, _decode(model, ids, _padded_mask(ids)))
    hook.remove()


def test_batch_one_steps_equal_the_module_path_bitwise(fast_steps):
    """Batch 1 (what a single generation runs), every configuration, float32 and float64: the
    session's products over (B, C) rows are bitwise the module path's over (B, 1, C)."""
    for name, config in CONFIGS.items():
        for dtype in (torch.float32, torch.float64):
            model = _model(dtype, **config)
            ids = _ids(batch=1, n=8)
            fast_steps.clear()
            fast = _decode(model, ids)
            assert fast_steps == [True] * 3, name
            hook = _force_modules(model)
            _assert_bitwise(fast, _decode(model, ids))
            hook.remove()


@pytest.mark.parametrize("use_cache", [True, False])
def test_fast_step_output_is_the_constructed_output(use_cache, fast_steps):
    """The session's output object has the items, order, attributes and tuple of
    ``CausalLMOutputWithPast(logits=..., <cache field>=...)``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from hf_kernattn.modeling.cache import CACHE_FIELD

    model = _model()
    ids = _ids()
    with torch.no_grad():
        cache = model(ids[:, :4], use_cache=True).past_key_values
        model(ids[:, 4:5], past_key_values=cache, use_cache=True)
        out = model(ids[:, 5:6], past_key_values=cache, use_cache=use_cache)
    assert fast_steps == [True]
    made = CausalLMOutputWithPast(logits=out.logits, **{CACHE_FIELD: cache if use_cache else None})
    assert type(out) is CausalLMOutputWithPast and vars(out) == vars(made)
    assert list(out.keys()) == list(made.keys()) and out.to_tuple() == made.to_tuple()
    assert out[0] is out.logits and out["logits"] is out.logits and repr(out) == repr(made)
    assert (out[CACHE_FIELD] is cache) if use_cache else (CACHE_FIELD not in out and out.loss is None)


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=False, num_beams=3)])
def test_generate_equals_the_module_path(mode, fast_steps):
    """Greedy and beam search (which reorders the states every step: checked again, kept fast)."""
    model = _model()
    ids = _ids(n=5)
    mask = _padded_mask(ids)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True, **mode)
    fast = model.generate(ids, **kw)
    assert fast_steps and all(fast_steps)
    hook = _force_modules(model)
    modules = model.generate(ids, **kw)
    hook.remove()
    assert torch.equal(fast.sequences, modules.sequences)
    for a, b in zip(fast.scores, modules.scores):
        assert torch.equal(a, b)


def _twins(**overrides):
    """Two identical models: the first decodes with its session, the second through the modules."""
    model = _model(**overrides)
    twin = copy.deepcopy(model)
    _force_modules(twin)
    return model, twin


def test_parameters_changed_between_steps_are_used(fast_steps):
    """In-place writes (an optimizer step: the fused projection is made again), data swapped in
    through ``.data``, a parameter replaced, ``load_state_dict``: each step sees the parameters
    as they are, as the modules do."""
    other = _model(initializer_range=0.5).state_dict()

    def changes(model):
        g = torch.Generator().manual_seed(3)

        def between(t):
            block = model.transformer.h[t % 2]
            if t == 5:
                block.attn.q_proj.weight.add_(0.1 * torch.randn(block.attn.q_proj.weight.shape, generator=g))
            elif t == 6:
                block.attn.k_proj.weight.data = block.attn.k_proj.weight.data * 1.5
            elif t == 7:
                block.attn.o_proj.weight = nn.Parameter(-block.attn.o_proj.weight.detach())
                block.mlp.c_fc.bias.mul_(2.0)
            elif t == 8:
                model.load_state_dict(other)
        return between

    model, twin = _twins()
    ids = _ids()
    fast = _decode(model, ids, _padded_mask(ids), between=changes(model))
    assert fast_steps == [True] * 5  # the fused projections made again where they changed
    _assert_bitwise(fast, _decode(twin, ids, _padded_mask(ids), between=changes(twin)))


class _Halved(nn.Module):
    """A wrapper around a projection, as an adapter wraps one."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x) * 0.5


CHANGES = {
    "hook": lambda model: model.transformer.h[0].register_forward_hook(lambda module, args, out: out * 1.25),
    "pre_hook": lambda model: model.transformer.h[1].mlp.c_fc.register_forward_pre_hook(lambda module, args: args[0] * 2),
    "wrapped": lambda model: setattr(model.transformer.h[1].attn, "v_proj", _Halved(model.transformer.h[1].attn.v_proj)),
    "forward_of_its_own": lambda model: setattr(model.transformer.ln_f, "forward", lambda x: x * 3.0),
    "training": lambda model: model.train(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_modules_changed_between_steps_are_honoured(change, fast_steps):
    """A hook registered, a projection wrapped (as an adapter does), a forward replaced (as
    accelerate's hooks do), training mode switched on (dropout): the modules run from that step
    on (a hooked or wrapped projection is called as a module by the plan made again), with what
    they compute."""

    def changes(model):
        def between(t):
            torch.manual_seed(t)  # the same dropout masks in training mode
            if t == 6:
                CHANGES[change](model)
        return between

    model, twin = _twins(resid_pdrop=0.2)
    ids = _ids()
    fast = _decode(model, ids, between=changes(model))
    if change in ("pre_hook", "wrapped"):
        # a hooked or wrapped projection: the plan, made again after one step of the modules, calls it
        assert fast_steps == [True, False, True, True, True]
    else:  # the plan's steps end (the later ones are not asked: no plan for this cache)
        assert fast_steps == [True, False]
    _assert_bitwise(fast, _decode(twin, ids, between=changes(twin)))


def test_copied_reordered_and_replaced_states_are_checked_again(fast_steps):
    """A cache copy and states reordered into new tensors (beam search) are taken over by the
    session after the checks a first step makes; a state it cannot update in place (not
    contiguous) runs the modules."""

    def changes(holder):
        def between(t):
            cache = holder["cache"]
            if t == 6:
                for layer in cache.layers:
                    layer.reorder_cache(torch.tensor([1, 0]))
            elif t == 8:
                s = cache.layers[1].recurrent_states[0]
                cache.layers[1].recurrent_states[0] = s.transpose(-1, -2).contiguous().transpose(-1, -2)
        return between

    results = []
    for hooked in (False, True):
        model = _model()
        if hooked:
            _force_modules(model)
        ids = _ids()
        with torch.no_grad():
            cache = model(ids[:, :4], use_cache=True).past_key_values
            holder = {"cache": cache}
            logits = []
            for t in range(4, 10):
                changes(holder)(t)
                if t == 7:  # continue from a copy
                    holder["cache"] = holder["cache"].copy()
                logits.append(model(ids[:, t : t + 1], past_key_values=holder["cache"], use_cache=True).logits)
        results.append((torch.cat(logits, 1), [x.clone() for layer in holder["cache"].layers
                                                for x in layer.recurrent_states.values()]))
        if not hooked:
            # a copy starts without a plan (made after its first step); the non-contiguous state: the modules,
            # then no plan for this cache
            assert fast_steps == [True, True, False]
    _assert_bitwise(*results)


def test_calls_the_plan_does_not_cover_run_the_modules(fast_steps):
    model = _model()
    ids = _ids()
    with torch.no_grad():
        out = model(ids[:, :4], use_cache=True)
        cache = out.past_key_values
        assert cache.decoding_plan is None
        model(ids[:, 4:5], past_key_values=cache, use_cache=True)  # the modules; the plan is made
        plan = cache.decoding_plan
        assert plan and plan.steps == 0
        hidden = model(ids[:, 5:6], past_key_values=cache, use_cache=True, output_hidden_states=True)
        assert hidden.hidden_states is not None and len(hidden.hidden_states) == 3
        kept = model(ids[:, 6:7], past_key_values=cache, use_cache=True, logits_to_keep=torch.tensor([0]))
        assert kept.logits.shape == (2, 1, V_GPT)
        plain = model(ids[:, 7:8], past_key_values=cache, use_cache=True, return_dict=False)
        assert isinstance(plain, tuple) and plain[1] is cache
        assert fast_steps == [False, False, True]
        assert cache.decoding_plan is plan  # per-call arguments keep the plan
        model(ids[:, :3], use_cache=False)  # a call from no cache leaves it
        assert cache.decoding_plan is plan
        model(ids[:, 8:10], past_key_values=cache, use_cache=True)  # a call from the cache that is not a step drops it
        assert cache.decoding_plan is None
    hook = _force_modules(model)
    fast_steps.clear()
    with torch.no_grad():
        cache = model(ids[:, :4], use_cache=True).past_key_values
        for t in range(4, 7):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    hook.remove()
    # a model the plan cannot serve is not asked again per step (until the next call that is not a step)
    assert cache.decoding_plan is False and fast_steps == []


@pytest.mark.parametrize("name", ["elu_absolute", "prf_rotary"])
def test_fast_steps_read_nothing_on_the_host(name, monkeypatch):
    model = _model(**CONFIGS[name])
    ids = _ids()
    mask = _padded_mask(ids)
    with torch.no_grad():
        cache = model(ids[:, :4], attention_mask=mask[:, :4], use_cache=True).past_key_values
        model(ids[:, 4:5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)

        def steps():
            return [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True)
                    for t in range(5, 9)]

        outs, reads = host_reads(monkeypatch, steps)
    assert reads == []
    assert cache.decoding_plan.steps == 4
    assert all(torch.isfinite(out.logits).all() for out in outs)
