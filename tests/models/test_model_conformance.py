"""Both families against what transformers' own common tests expect of an in-tree model
(``ModelTesterMixin`` in tests/test_modeling_common.py and ``GenerationTesterMixin`` in
tests/generation/test_utils.py of huggingface/transformers), item by item, on tiny configs.

Covered elsewhere (not repeated here): padding / batching equivalence (models/nprf_bert/test_model.py),
generate with and without the state for greedy, beam search and sampling, left padding,
continuing from a returned state (models/linear_gpt/test_generate.py); shapes of every head, padding with
non-finite padded slots, save/load and remote-code loading of every head, checkpoints without
(or with some of) the random-feature buffers, a mismatched number of random features, building on
the meta device, ``output_attentions`` refused and ``output_hidden_states`` / ``return_dict=False``
tuples, empty inputs, bad shared config fields, resized token embeddings keeping the tie,
checkpointed layers recomputing with their forward's random features, and ``torch.export``, for
every family (models/<family>/test_family.py through tests/family_mixin.py).

What cannot apply, and how each family declares it:
* attention outputs (``has_attentions``): kernelized attention never forms the N x N attention
  matrix. ``output_attentions=True`` raises ``ValueError`` in every ``forward`` and therefore
  in ``generate``; a config keeps the flag (as every transformers config does) and a model
  built from it returns no attentions; there is no attention backend switch
  (``_supports_attention_backend = False``, no sdpa/flash/flex).
* assisted / prompt-lookup / speculative decoding and cropping the cache: the decoding state is
  an RNN state that cannot forget tokens; Linear GPT is ``_is_stateful`` and ``generate`` refuses.
* static / compiled caches (``test_generate_compile_*``): the state is not compileable
  (``is_compileable = False``); the base models export with ``torch.export`` without a cache.
* NPRF-BERT is an encoder: GenerationTesterMixin does not apply to it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments

from hf_kernattn import (
    LinearGPTCache,
    LinearGPTForCausalLM,
    LinearGPTModel,
    NPRFBertForMaskedLM,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
    kernelized_attention,
)
from hf_kernattn.modeling.feature_maps import FeatureMap

from tests.reference import replaced_backend
from tests.conftest import V_BERT, V_GPT, checkpointing_disable, checkpointing_enable, checkpointing_training_argument
from tests.conftest import tiny_linear_gpt_config as gpt_config
from tests.conftest import tiny_nprf_bert_config as bert_config
from tests.reference import assert_model_outputs_reordered_close, assert_reordered_close

def ids_for(family: str, batch=2, n=9, seed=0) -> torch.Tensor:
    vocab = V_BERT if family == "nprf_bert" else V_GPT
    return torch.randint(1, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def hidden(model, ids, **kw) -> torch.Tensor:
    kw = dict(kw, use_cache=False) if isinstance(model, LinearGPTModel) else kw
    with torch.no_grad():
        return model(ids, **kw).last_hidden_state


def feature_maps(model) -> list[FeatureMap]:
    return [m for m in model.modules() if isinstance(m, FeatureMap)]


# ----------------------------------------------------------------------------- initialisation


# ----------------------------------------------------------------------------- gradient checkpointing


def _count_projection_calls(model) -> list[int]:
    """``[attention runs, q projections]``: how often each layer's feature map saw queries and
    how often its q projection ran (recompute_attention redoes the first, never the second)."""
    calls = [0, 0]

    def feature_hook(_module, args, kwargs, _out):
        calls[0] += bool(kwargs.get("is_query", args[1] if len(args) > 1 else False))

    def projection_hook(*_):
        calls[1] += 1

    for module in model.modules():
        if hasattr(module, "q_proj") and isinstance(module.q_proj, torch.nn.Linear):
            module.feature_map.register_forward_hook(feature_hook, with_kwargs=True)
            module.q_proj.register_forward_hook(projection_hook)
    return calls


@pytest.mark.parametrize("recompute_attention", [True, False])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_nprf_bert_gradient_checkpointing_matches_and_runs_attention_twice(recompute_attention, use_reentrant):
    torch.manual_seed(0)
    # windowed: a backend that keeps intermediates for its backward, so recompute_attention recomputes it
    # (dense, auto's choice at this length, keeps only its inputs and is run once)
    cfg = bert_config(recompute_attention=recompute_attention, hidden_dropout_prob=0.1, num_labels=3,
                      attn_backend="windowed")
    model = NPRFBertForSequenceClassification(cfg).double().train()
    ids = ids_for("nprf_bert")
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = torch.tensor([0, 2])

    def grads():
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks in both runs (checkpointing restores the RNG)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = _count_projection_calls(model)
    plain = grads()
    layers = cfg.num_hidden_layers
    assert calls == [layers * (2 if recompute_attention else 1), layers]  # the projections are not redone
    checkpointing_enable(model, use_reentrant=use_reentrant)
    assert all(layer.gradient_checkpointing for layer in model.nprf_bert.layers)
    calls[:] = [0, 0]
    checkpointed = grads()
    # the layer's recomputation replaces the attention's own: twice per layer, never three times
    assert calls == [2 * layers, 2 * layers]
    assert plain.keys() == checkpointed.keys() and "nprf_bert.rpe.weight" in plain
    for name, g in plain.items():
        # float64, the same operations in the same order: differences are summation-order ulps
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-12, atol=1e-14, msg=name)
    checkpointing_disable(model)
    assert not any(layer.gradient_checkpointing for layer in model.nprf_bert.layers)


@pytest.mark.parametrize("positions", ["absolute", "rotary", "rpe"])
def test_linear_gpt_recompute_attention_in_the_parallel_form_only(positions):
    """Linear GPT honours recompute_attention in its parallel form: a prefill recomputes its
    attention in the backward (the query features twice per layer; with "projections" the q
    projection too), a continuation from the state
    never does, and inside a gradient-checkpointed block it is off (twice per layer, not three
    times). Logits, the decoding state and the gradients equal those without recomputation
    (float64, the same operations in the same order: ulp-level differences at most)."""
    extra = {"absolute": {}, "rotary": {"position_embedding_type": "rotary"},
             "rpe": {"rpe": "learned", "max_relative_position": 4}}[positions]
    ids = ids_for("linear_gpt", n=9)
    layers = 2
    results = []
    for recompute in (False, True, "projections"):
        torch.manual_seed(0)
        cfg = gpt_config(feature_map="prf", num_random_features=16, recompute_attention=recompute, **extra)
        model = LinearGPTForCausalLM(cfg).double().train()
        calls = _count_projection_calls(model)
        first = model(ids[:, :6], labels=ids[:, :6], use_cache=True)
        state = first.past_key_values
        second = model(ids[:, 6:], labels=ids[:, 6:], past_key_values=state, use_cache=True)
        assert calls == [2 * layers, 2 * layers]
        (first.loss + second.loss).backward()
        # the prefill's attention runs again in the backward ("projections": its projections too)
        assert calls == [2 * layers + (layers if recompute else 0), 2 * layers + (layers if recompute == "projections" else 0)]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((first.logits.detach(), second.logits.detach(), state.layers[0].get_state().kv.detach(), grads))

        model.zero_grad()
        checkpointing_enable(model)
        calls[:] = [0, 0]
        model(ids, labels=ids, use_cache=False).loss.backward()
        assert calls == [2 * layers, 2 * layers]
        checkpointing_disable(model)
    (a1, a2, s_a, g_a) = results[0]
    for b1, b2, s_b, g_b in results[1:]:
        for x, y in ((a1, b1), (a2, b2), (s_a, s_b)):
            torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-14)
        assert g_a.keys() == g_b.keys()
        for name, g in g_a.items():
            torch.testing.assert_close(g_b[name], g, rtol=1e-12, atol=1e-14, msg=name)


def test_training_arguments_gradient_checkpointing_trains_nprf_bert(tmp_path):
    torch.manual_seed(0)
    model = NPRFBertForMaskedLM(bert_config())
    ids = ids_for("nprf_bert", batch=4, n=8)
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path), **checkpointing_training_argument(), max_steps=1, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
    )
    before = model.nprf_bert.layers[0].attention.q_proj.weight.detach().clone()
    Trainer(model=model, args=args, train_dataset=data).train()
    assert model.nprf_bert.layers[0].gradient_checkpointing
    assert not torch.equal(before, model.nprf_bert.layers[0].attention.q_proj.weight)


# ----------------------------------------------------------------------------- loss arguments


def _masked_labels(ids: torch.Tensor, seed: int) -> torch.Tensor:
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.4
    keep[:, 0] = True
    return torch.where(keep, ids, torch.full_like(ids, -100))


def same_sum(got, want, msg=None):
    """Two float32 sums of the same positive per-item losses (at most 21: one per token of a test
    batch) in different orders, then rescaled (a division or two): 24 terms' bound."""
    assert_reordered_close(got, want, terms=24, msg=msg)


def test_nprf_bert_losses_honour_num_items_in_batch():
    torch.manual_seed(0)
    ids = ids_for("nprf_bert", batch=3, n=7)
    num = torch.tensor(23)
    # each head: its loss with num_items_in_batch is sum(per-item losses) / num_items_in_batch;
    # float32 sums of at most 21 positive terms in another order (``same_sum``)
    mlm = NPRFBertForMaskedLM(bert_config()).eval()
    labels = _masked_labels(ids, 1)
    out = mlm(ids, labels=labels, num_items_in_batch=num)
    want = F.cross_entropy(out.logits.reshape(-1, V_BERT), labels.reshape(-1), reduction="sum") / num
    same_sum(out.loss, want)
    same_sum(mlm(ids, labels=labels).loss, want * num / (labels != -100).sum())

    tok = NPRFBertForTokenClassification(bert_config(num_labels=4)).eval()
    labels = _masked_labels(torch.randint(0, 4, ids.shape, generator=torch.Generator().manual_seed(2)), 3)
    out = tok(ids, labels=labels, num_items_in_batch=num)
    want = F.cross_entropy(out.logits.reshape(-1, 4), labels.reshape(-1), reduction="sum") / num
    same_sum(out.loss, want)

    cases = {
        "single_label_classification": (3, torch.tensor([0, 2, 1]), lambda lg, y: F.cross_entropy(lg, y, reduction="sum")),
        "regression": (1, torch.tensor([0.5, -1.0, 2.0]), lambda lg, y: F.mse_loss(lg[:, 0], y, reduction="sum")),
        "multi_label_classification": (
            3,
            torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]]),
            lambda lg, y: F.binary_cross_entropy_with_logits(lg, y, reduction="sum"),
        ),
    }
    for problem, (num_labels, labels, summed) in cases.items():
        cls = NPRFBertForSequenceClassification(bert_config(num_labels=num_labels)).eval()
        out = cls(ids, labels=labels, num_items_in_batch=torch.tensor(5))
        assert cls.config.problem_type == problem
        same_sum(out.loss, summed(out.logits, labels) / 5, msg=problem)
        mean = summed(out.logits, labels) / labels.numel()
        same_sum(cls(ids, labels=labels).loss, mean, msg=problem)

    qa = NPRFBertForQuestionAnswering(bert_config(num_labels=2)).eval()
    start, end = torch.tensor([1, 3, 9]), torch.tensor([2, 5, 4])  # 9 is outside the input: ignored
    out = qa(ids, start_positions=start, end_positions=end)
    want = (F.cross_entropy(out.start_logits, start.clamp(0, 7), ignore_index=7)
            + F.cross_entropy(out.end_logits, end, ignore_index=7)) / 2
    same_sum(out.loss, want)


def test_linear_gpt_loss_honours_num_items_in_batch_and_shift_labels():
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt", batch=2, n=8)
    labels = _masked_labels(ids, 4)
    out = model(ids, labels=labels, num_items_in_batch=torch.tensor(11))
    targets = labels[:, 1:].reshape(-1)
    summed = F.cross_entropy(out.logits[:, :-1].reshape(-1, V_GPT), targets, reduction="sum")
    same_sum(out.loss, summed / 11)
    same_sum(model(ids, labels=labels).loss, summed / (targets != -100).sum())
    # shift_labels: targets already aligned with the logits (as context parallelism passes them);
    # aligned with labels[:, 1:] they give the same loss, other targets another one
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    torch.testing.assert_close(model(ids, labels=labels, shift_labels=shifted).loss, out.loss * 11 / (targets != -100).sum())
    other = model(ids, labels=labels, shift_labels=labels).loss
    want = F.cross_entropy(out.logits.reshape(-1, V_GPT), labels.reshape(-1))
    same_sum(other, want)
    with pytest.raises(ValueError, match="shift_labels"):
        model(ids, labels=labels, shift_labels=labels[:, 1:])


def test_trainer_gradient_accumulation_equals_one_big_batch(tmp_path):
    """With ``num_items_in_batch`` reaching the loss, two micro-batches with different numbers of
    labelled tokens give the gradient of the whole batch (the Trainer no longer divides by the
    accumulation steps itself)."""
    ids = ids_for("nprf_bert", batch=4, n=8, seed=5)
    labels = ids.clone()
    labels[:2, 1:] = -100  # micro-batch 1: 2 labelled tokens, micro-batch 2: 16
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]
    weights = []
    for batch, accumulation in ((4, 1), (2, 2)):
        torch.manual_seed(0)
        model = NPRFBertForMaskedLM(bert_config(hidden_dropout_prob=0.0))
        initial = model.nprf_bert.layers[0].attention.q_proj.weight.detach().clone()
        args = TrainingArguments(
            output_dir=str(tmp_path / f"b{batch}"), max_steps=1, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        weights.append(model.nprf_bert.layers[0].attention.q_proj.weight.detach().clone())
    # one SGD step of rate 1 (w - g): float32 gradients of 18 token losses over 32 positions,
    # regrouped, at the magnitude of the step or the weights
    scale = float(torch.maximum(initial.abs().max(), (weights[0] - initial).abs().max()))
    assert_model_outputs_reordered_close(weights[1], weights[0], model.config, ids.numel(), scale=scale)


# ----------------------------------------------------------------------------- output flags


def test_output_attentions_in_generate_raises_before_decoding():
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt")
    with pytest.raises(ValueError, match="no attention weights"):
        model.generate(ids, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True)
    for head in (NPRFBertForMaskedLM(bert_config()), NPRFBertForSequenceClassification(bert_config())):
        with pytest.raises(ValueError, match="no attention weights"):
            head(ids_for("nprf_bert"), output_attentions=True)


def test_generate_dict_outputs_scores_and_hidden_states():
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt", n=5)
    out = model.generate(
        ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True,
        output_logits=True, output_hidden_states=True,
    )
    assert out.sequences.shape == (2, 9) and out.attentions is None
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == 4
    assert out.hidden_states[0][0].shape == (2, 5, 32) and out.hidden_states[1][0].shape == (2, 1, 32)
    assert all(len(step) == model.config.num_hidden_layers + 1 for step in out.hidden_states)
    assert isinstance(out.past_key_values, LinearGPTCache)
    assert out.past_key_values.get_seq_length() == 8  # the last token is not fed back
    # greedy: each new token is the arg max of its step's logits
    assert torch.equal(torch.stack([s.argmax(-1) for s in out.logits], 1), out.sequences[:, 5:])


# ----------------------------------------------------------------------------- generation options


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=True, num_return_sequences=3, top_k=10),
        dict(do_sample=False, num_beams=3, num_return_sequences=2),
    ],
)
def test_num_return_sequences_with_and_without_the_state(options):
    """The state expanded per returned sequence (``batch_repeat_interleave``) and reordered per
    beam gives what recomputing the whole prefix gives."""
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt", n=5)
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        outs.append(model.generate(ids, max_new_tokens=5, use_cache=use_cache, return_dict_in_generate=True,
                                   output_scores=True, **options))
    n = options["num_return_sequences"]
    assert outs[0].sequences.shape == (2 * n, 10) and torch.equal(outs[0].sequences, outs[1].sequences)
    assert isinstance(outs[0].past_key_values, LinearGPTCache) and outs[1].past_key_values is None
    if "num_beams" in options:
        # float32 scores from the same logits up to the state's summation order
        assert_model_outputs_reordered_close(outs[0].sequences_scores, outs[1].sequences_scores, model.config, 10)


def _char_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyz.,!? "
    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def test_generate_with_stop_strings_and_a_tokenizer():
    torch.manual_seed(0)
    tok = _char_tokenizer()
    model = LinearGPTForCausalLM(gpt_config(vocab_size=len(tok), eos_token_id=None)).eval()
    ids = tok(["the cat"], return_tensors="pt").input_ids
    free = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    # stop at the first occurrence of the 4th generated character
    stop_id = int(free[3])
    first = int((free == stop_id).nonzero()[0])
    stop = tok.convert_ids_to_tokens(stop_id)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out[0, ids.shape[1]:], free[: first + 1])


def test_generate_accepts_cache_position_and_inputs_embeds():
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt", n=5)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        got = model(ids, cache_position=torch.arange(5), use_cache=False).logits
    assert torch.equal(got, full)
    want = model.generate(ids, max_new_tokens=4, do_sample=False)[:, 5:]
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_embeds, want)


def test_stateful_model_refuses_assisted_and_prompt_lookup_decoding():
    model = LinearGPTForCausalLM(gpt_config()).eval()
    assistant = LinearGPTForCausalLM(gpt_config(num_hidden_layers=1)).eval()
    ids = ids_for("linear_gpt", batch=1)
    assert model._is_stateful
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(ids, assistant_model=assistant, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(ids, prompt_lookup_num_tokens=2, max_new_tokens=3, do_sample=False)


# ----------------------------------------------------------------------------- embeddings, mismatched heads


def test_sequence_classification_head_with_another_num_labels(tmp_path):
    torch.manual_seed(0)
    NPRFBertForSequenceClassification(bert_config(num_labels=2)).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="size mismatch|mismatch"):
        NPRFBertForSequenceClassification.from_pretrained(tmp_path, num_labels=5)
    model = NPRFBertForSequenceClassification.from_pretrained(tmp_path, num_labels=5, ignore_mismatched_sizes=True)
    assert model(ids_for("nprf_bert")).logits.shape == (2, 5)


# ----------------------------------------------------------------------------- 4D masks (NPRF-BERT)


def test_nprf_bert_accepts_extended_padding_masks():
    torch.manual_seed(0)
    model = NPRFBertModel(bert_config()).eval()
    ids = ids_for("nprf_bert", n=9)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    want = hidden(model, ids, attention_mask=mask)
    keep = mask.bool()
    big_negative = torch.finfo(torch.float32).min
    forms = {
        "bool (B,1,1,N)": keep[:, None, None, :],
        "bool (B,1,N,N)": keep[:, None, None, :].expand(2, 1, 9, 9),
        "additive (B,1,1,N)": (1.0 - mask[:, None, None, :].float()) * big_negative,
        "additive (B,1,N,N)": ((1.0 - mask[:, None, None, :].float()) * big_negative).expand(2, 1, 9, 9),
        "additive -inf": torch.zeros(2, 1, 1, 9).masked_fill(~keep[:, None, None, :], float("-inf")),
        "BERT's -10000": (1.0 - mask[:, None, None, :].float()) * -10000.0,
    }
    for name, extended in forms.items():
        torch.testing.assert_close(hidden(model, ids, attention_mask=extended), want, rtol=0, atol=0, msg=name)


def test_nprf_bert_refuses_4d_masks_that_are_not_padding_masks():
    model = NPRFBertModel(bert_config()).eval()
    ids = ids_for("nprf_bert", n=6)
    causal = torch.ones(6, 6).tril().bool()[None, None].expand(2, 1, 6, 6)
    with pytest.raises(ValueError, match="same keys masked for every query"):
        model(ids, attention_mask=causal)
    with pytest.raises(ValueError, match="soft bias"):
        model(ids, attention_mask=torch.full((2, 1, 1, 6), -0.5))
    with pytest.raises(ValueError, match=r"\(batch, 1, 1, seq\)"):
        model(ids, attention_mask=torch.ones(2, 4, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 1, 6))


# ----------------------------------------------------------------------------- torch.export


def test_torch_export_linear_gpt_with_padding_mask_matches_eager():
    torch.manual_seed(0)
    model = LinearGPTModel(gpt_config()).eval()
    ids = ids_for("linear_gpt", n=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    extra = dict(use_cache=False, return_dict=False)
    with torch.no_grad():
        program = torch.export.export(model, (ids,), kwargs=dict(extra, attention_mask=mask))
        got = program.module()(ids, attention_mask=mask, **extra)[0]
        want = model(ids, attention_mask=mask, **extra)[0]
    # the same operations; the exported graph may sum in another order
    assert_model_outputs_reordered_close(got, want, model.config, ids.shape[1])


def test_torch_export_nprf_bert_with_padding_mask_matches_eager():
    """The core's mask checks (0/1 values, "nothing padded") read the mask: skipped while tracing."""
    torch.manual_seed(0)
    model = NPRFBertModel(bert_config()).eval()
    ids = ids_for("nprf_bert", n=10)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding of the first sequence
    with torch.no_grad():
        program = torch.export.export(model, (ids,), kwargs=dict(attention_mask=mask, return_dict=False))
        got = program.module()(ids, attention_mask=mask, return_dict=False)[0]
        want = model(ids, attention_mask=mask, return_dict=False)[0]
        # the program honours a different mask (no value baked in at export), also an all-ones one
        other = torch.ones_like(ids)
        other[1, 4:] = 0
        for m in (other, torch.ones_like(ids)):
            assert_model_outputs_reordered_close(program.module()(ids, attention_mask=m, return_dict=False)[0],
                                                 model(ids, attention_mask=m, return_dict=False)[0], model.config, 10)
    # the same operations; the exported graph may sum in another order (other kernels elsewhere)
    assert_model_outputs_reordered_close(got, want, model.config, 10)
    # the eager errors are unchanged
    bad = mask.clone()
    bad[1, 0] = 2
    with pytest.raises(ValueError, match="attention_mask must hold only 1"):
        model(ids, attention_mask=bad)


def test_torch_export_nprf_bert_long_input_uses_the_windowed_backend():
    """A traced long input declares the clipped table too (rpe_clip), so ``auto`` picks the O(N K)
    windowed backend as in eager mode (from the shortest length where the calibration table ranks
    it first)."""
    from hf_kernattn.modeling import registry

    k_clip = 8
    n = next(n for n in (2 ** i for i in range(4, 17))
             if registry.choose_backend(n=n, causal=False, rpe="1d", key_mask=True, device="cpu", rpe_clip=k_clip) == "windowed")
    calls = []
    spec = registry.get_backend("windowed")

    def counting(*a, **kw):
        calls.append(kw["rpe_clip"])
        return spec.fn(*a, **kw)

    with replaced_backend("windowed", counting):
        torch.manual_seed(0)
        cfg = bert_config(rpe="learned", max_relative_position=k_clip, max_position_embeddings=n, num_hidden_layers=1)
        model = NPRFBertModel(cfg).eval()
        ids = torch.randint(1, V_BERT, (1, n), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[0, n - 5 :] = 0
        with torch.no_grad():
            want = model(ids, attention_mask=mask, return_dict=False)[0]
            assert calls == [k_clip]  # eager
            program = torch.export.export(model, (ids,), kwargs=dict(attention_mask=mask, return_dict=False))
            assert calls == [k_clip, k_clip]  # traced: the same backend
            got = program.module()(ids, attention_mask=mask, return_dict=False)[0]
        assert_model_outputs_reordered_close(got, want, cfg, n)


def test_rpe_clip_and_mask_checks_keep_their_eager_errors():
    q = torch.rand(1, 2, 6, 4)
    v = torch.randn(1, 2, 6, 3)
    bias = torch.randn(2, 11)
    with pytest.raises(ValueError, match="not constant beyond offsets"):
        kernelized_attention(q, q, v, rpe_bias=bias, rpe_clip=2)
    with pytest.raises(ValueError, match="attention_mask must hold only 1"):
        kernelized_attention(q, q, v, attention_mask=torch.tensor([[1, 1, 0.5, 1, 1, 1]]))


# ----------------------------------------------------------------------------- bad inputs and states


def test_linear_gpt_refuses_mask_values_other_than_0_and_1():
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt", n=5)
    for bad in (2, -1):
        mask = torch.ones_like(ids)
        mask[0, 0] = bad
        with pytest.raises(ValueError, match="attention_mask must hold only 1"):
            model(ids, attention_mask=mask)
        with pytest.raises(ValueError, match="attention_mask must hold only 1"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_decoding_state_of_another_model_is_refused():
    ids = ids_for("linear_gpt", n=4)
    plain = LinearGPTForCausalLM(gpt_config()).eval()
    windowed = LinearGPTForCausalLM(gpt_config(rpe="learned", max_relative_position=4)).eval()
    state_plain = plain(ids).past_key_values
    state_windowed = windowed(ids).past_key_values
    nxt = ids[:, :1]
    with pytest.raises(ValueError, match="relative-position window of 3 keys.*this model has no relative-position"):
        plain(nxt, past_key_values=state_windowed)
    with pytest.raises(ValueError, match="no relative-position window.*this model has a relative-position window"):
        windowed(nxt, past_key_values=state_plain)
    wider = LinearGPTForCausalLM(gpt_config(num_attention_heads=4)).eval()
    with pytest.raises(ValueError, match=r"\(heads, feature size, head size\) = \(2, 16, 16\).*\(4, 8, 8\)"):
        wider(nxt, past_key_values=state_plain)
    deeper = LinearGPTForCausalLM(gpt_config(num_hidden_layers=3)).eval()
    with pytest.raises(ValueError, match="past_key_values has 2 layers, the model 3"):
        deeper(nxt, past_key_values=state_plain)
    with pytest.raises(ValueError, match="window"):
        plain.generate(ids, past_key_values=LinearGPTCache(2, window=3), max_new_tokens=2)
    # the state's own model continues from it
    assert plain(nxt, past_key_values=state_plain).logits.shape == (2, 1, V_GPT)


def test_one_token_decode_steps_do_not_read_tensor_values(monkeypatch):
    """Per-token decoding does not sync with the device for validation: no ``.item()`` /
    ``int()`` / ``bool()`` of a tensor in the model's forward once a state exists."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(gpt_config()).eval()
    ids = ids_for("linear_gpt", n=4)
    mask = torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad():
        state = model(ids, attention_mask=mask[:, :4]).past_key_values
        reads = []
        for name in ("__bool__", "__int__", "item"):
            original = getattr(torch.Tensor, name)

            def spy(self, *a, _original=original, _name=name, **k):
                reads.append(_name)
                return _original(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)
        out = model(ids[:, :1], attention_mask=mask, past_key_values=state)
    monkeypatch.undo()
    assert reads == []
    assert math.isfinite(float(out.logits.abs().max()))
