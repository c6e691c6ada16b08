"""One model serves many threads: each generate() keeps its decoding state (and its decoding plan)
in its own cache, so threads generating at once on one model (prompts of different batch sizes,
plain, rope + random features, learned maps, the sliding-window hybrid) get exactly what each
gets alone. Quantized models generate with their decoding state: torchao int8 weight-only with
greedy tokens equal to its own stateless run, torch's dynamic quantization with the module
path's steps bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from hf_kernattn import LinearGPTForCausalLM
from tests.reference import assert_model_outputs_reordered_close
from tests.conftest import V_GPT, tiny_linear_gpt_config

CONFIGS = {
    "plain": {},
    "rope_prf": dict(position_embedding_type="rope", feature_map="prf", num_random_features=8),
    "hedgehog": dict(feature_map="hedgehog"),
    "softmax_window": dict(softmax_window=3),
}


def _model(**overrides) -> LinearGPTForCausalLM:
    torch.manual_seed(0)
    return LinearGPTForCausalLM(tiny_linear_gpt_config(max_position_embeddings=256, **overrides)).eval()


def _prompts(sizes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, V_GPT, (batch, 4 + i), generator=g) for i, batch in enumerate(sizes)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("threads", [2, 4])
def test_threads_generating_on_one_model_get_what_each_gets_alone(name, threads):
    model = _model(**CONFIGS[name])
    prompts = _prompts([1, 2, 3, 1][:threads])
    generate = lambda ids: model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)  # noqa: E731
    alone = [generate(ids) for ids in prompts]
    for _ in range(10):
        out: list = [None] * threads
        start = threading.Barrier(threads)

        def work(i):
            start.wait()
            try:
                out[i] = generate(prompts[i])
            except Exception as error:  # noqa: BLE001  (reported below, with the thread's index)
                out[i] = error

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for i, (got, want) in enumerate(zip(out, alone)):
            assert not isinstance(got, Exception), f"thread {i}: {got!r}"
            assert torch.equal(got, want), f"thread {i}"


def _greedy(model, ids, use_cache):
    return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=use_cache,
                          output_logits=True, return_dict_in_generate=True)


def _assert_state_decoding_matches_stateless(model):
    ids = _prompts([2])[0]
    with_state, stateless = _greedy(model, ids, True), _greedy(model, ids, False)
    assert torch.equal(with_state.sequences, stateless.sequences)
    return with_state, stateless


def test_torchao_int8_weight_only_generates_with_its_state():
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model = _model(initializer_range=0.5)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    assert type(model.transformer.h[0].attn.q_proj.weight) is not nn.Parameter  # a tensor subclass
    with_state, stateless = _assert_state_decoding_matches_stateless(model)
    # the int8 weights are the same in both runs; the float products sum in other orders
    for a, b in zip(with_state.logits, stateless.logits):
        assert_model_outputs_reordered_close(a, b, model.config, 24)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # torch.ao's own deprecation notes
def test_dynamically_quantized_model_generates_with_its_state():
    """``quantize_dynamic`` replaces every ``nn.Linear`` with a module that quantizes its input
    per call (one scale per input tensor): a decoding step quantizes one token's activations, a
    stateless forward the whole sequence's, so the two differ by the activations' quantization and
    are not compared. The decoding plan calls the quantized modules: its steps are the module
    path's, bit for bit, greedy and beam search."""
    model = torch.ao.quantization.quantize_dynamic(_model(initializer_range=0.5), {nn.Linear}, dtype=torch.qint8)
    assert type(model.transformer.h[0].attn.q_proj) is not nn.Linear
    ids = _prompts([2])[0]
    for beams in (1, 2):
        kw = dict(max_new_tokens=10, do_sample=False, num_beams=beams, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
        fast = model.generate(ids, **kw)
        assert fast.past_key_values.decoding_plan.steps > 0
        hook = model.transformer.ln_f.register_forward_hook(lambda module, args, out: None)  # the module path
        modules = model.generate(ids, **kw)
        hook.remove()
        assert torch.equal(fast.sequences, modules.sequences)
        assert all(torch.equal(a, b) for a, b in zip(fast.scores, modules.scores))
