"""Linear GPT runs the configured ``attn_backend`` on every path, and refuses one that cannot
serve a causal model.

Spy backends (registered for the test, removed after) count their calls: a backend that carries
no state runs every call that starts without one (training with ``use_cache`` on, the default,
or off; prefill), the state being folded from the call's keys; a backend that carries a state
also runs every continuation and decoding step. Backends that cannot do causal attention (or the
model's bias / rotary split) are refused when the config is built, when the model is built, and
at forward time with and without a state.
"""

from __future__ import annotations

import pytest
import torch

from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM, register_backend, unregister_backend
from hf_kernattn.modeling.kernels_dense import dense_attention
from hf_kernattn.modeling.kernels_linear import causal_chunked_attention, linear_attention
from hf_kernattn.modeling.kernels_windowed import windowed_attention
from tests.conftest import V_GPT, tiny_linear_gpt_config
from tests.reference import assert_model_outputs_reordered_close

SPLIT = ("q_den", "k_den")
STATE = ("initial_state", "output_final_state")


class Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies():
    made = {
        "spy_dense": (Spy(dense_attention), dict(
            takes=("rpe_bias", "causal", "grid", "eps") + SPLIT, causal=True, noncausal=True, rpe_1d=True,
            split_denominator=True)),
        "spy_chunked": (Spy(causal_chunked_attention), dict(
            takes=("eps",) + SPLIT + STATE, causal=True, noncausal=False, split_denominator=True, state=True)),
        "spy_windowed": (Spy(windowed_attention), dict(
            takes=("rpe_bias", "rpe_clip", "causal", "eps") + STATE, causal=True, noncausal=True, rpe_1d=True,
            needs_rpe_clip=True, state=True)),
    }
    for name, (fn, caps) in made.items():
        register_backend(name, fn, **caps)
    yield {name: fn for name, (fn, _) in made.items()}
    for name in made:
        unregister_backend(name)


def _ids(n=7, seed=1):
    return torch.randint(1, V_GPT, (2, n), generator=torch.Generator().manual_seed(seed))


def _model(**kw):
    torch.manual_seed(0)
    return LinearGPTForCausalLM(tiny_linear_gpt_config(**kw))


@pytest.mark.parametrize("kw", [{}, dict(position_embedding_type="rotary")])
def test_a_backend_without_a_state_runs_training_and_prefill_whatever_use_cache(spies, kw):
    spy = spies["spy_dense"]
    model = _model(attn_backend="spy_dense", **kw)
    reference = _model(**kw)  # the same weights with attn_backend="auto"
    layers = model.config.num_hidden_layers
    ids = _ids()
    model.train()
    for use_cache in (None, True, False):  # None: config.use_cache (True), as the Trainer calls it
        spy.calls = 0
        out = model(ids, labels=ids, use_cache=use_cache)
        out.loss.backward()
        assert spy.calls == layers, use_cache
    model.eval()
    reference.eval()
    with torch.no_grad():
        spy.calls = 0
        out = model(ids[:, :4])
        assert spy.calls == layers  # the prefill of a state
        want = reference(ids).logits
        # the state folded from the prefill's keys continues exactly: several tokens, then one
        rest = [model(ids[:, 4:6], past_key_values=out.past_key_values).logits,
                model(ids[:, 6:], past_key_values=out.past_key_values).logits]
        assert spy.calls == layers  # continuing needs a backend that reads a state: auto's choice
        # float32: dense vs the chunked sums of auto, the same terms in another order
        assert_model_outputs_reordered_close(torch.cat([out.logits] + rest, dim=1), want, model.config, ids.shape[1])
        spy.calls = 0
        got = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
        assert spy.calls == layers
        assert torch.equal(got, reference.generate(ids[:, :4], max_new_tokens=3, do_sample=False))


def test_a_backend_with_a_state_runs_every_call_decoding_included(spies):
    spy = spies["spy_chunked"]
    model = _model(attn_backend="spy_chunked").eval()
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        model.generate(_ids()[:, :4], max_new_tokens=4, do_sample=False)
    assert spy.calls == layers * 4  # the prefill and three one-token steps (the fourth token needs no step)
    model.train()
    spy.calls = 0
    model(_ids(), labels=_ids()).loss.backward()
    assert spy.calls == layers


def test_a_clipped_bias_backend_runs_every_call_with_rpe_learned(spies):
    spy = spies["spy_windowed"]
    model = _model(attn_backend="spy_windowed", rpe="learned", max_relative_position=3,
                   position_embedding_type="none").eval()
    with torch.no_grad():
        model.generate(_ids()[:, :5], max_new_tokens=3, do_sample=False)
    assert spy.calls == model.config.num_hidden_layers * 3


@pytest.mark.parametrize(
    "backend,kw,lacks",
    [
        ("linear", {}, "causal=True"),
        ("windowed", {}, "calls without a 1D rpe_bias declared clipped by rpe_clip"),
        ("causal_chunked", dict(rpe="learned", position_embedding_type="none"), "a 1D rpe_bias"),
        ("fft", dict(position_embedding_type="rotary"), r"separate denominator features \(q_den, k_den\)"),
        ("windowed", dict(position_embedding_type="rotary", rpe="none"), "separate denominator features"),
    ],
)
def test_a_backend_that_cannot_serve_the_model_is_refused_by_the_config(backend, kw, lacks):
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' cannot serve Linear GPT.*{lacks}.*"
                                         r"attn_backend must be 'auto' or one of \[.*'dense'"):
        tiny_linear_gpt_config(attn_backend=backend, **kw)


def test_the_refusal_lists_the_backends_that_can():
    with pytest.raises(ValueError) as err:
        LinearGPTConfig(attn_backend="linear")
    able = str(err.value).split("one of ")[-1]
    assert all(f"'{name}'" in able for name in ("dense", "causal_chunked", "fft", "recurrent"))
    assert "'linear'" not in able and "'windowed'" not in able and "'manhattan'" not in able
    for ok in ("auto", "dense", "causal_chunked", "fft", "recurrent"):
        assert LinearGPTConfig(attn_backend=ok).attn_backend == ok


def test_a_config_changed_after_validation_is_refused_when_the_model_is_built():
    config = tiny_linear_gpt_config()
    config.attn_backend = "linear"
    with pytest.raises(ValueError, match="attn_backend='linear' cannot serve Linear GPT"):
        LinearGPTForCausalLM(config)


def test_a_backend_re_registered_without_causal_is_refused_at_forward_time_with_and_without_a_state(spies):
    model = _model(attn_backend="spy_chunked").eval()
    ids = _ids()
    with torch.no_grad():
        cache = model(ids[:, :3]).past_key_values
        register_backend("spy_chunked", linear_attention, takes=("eps",), causal=False, noncausal=True, overwrite=True)
        for call in (lambda: model(ids, use_cache=False), lambda: model(ids), lambda: model(ids[:, 3:4], past_key_values=cache)):
            with pytest.raises(ValueError, match="attn_backend='spy_chunked' cannot serve Linear GPT.*causal=True"):
                call()
