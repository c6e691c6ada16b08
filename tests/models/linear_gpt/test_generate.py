"""Linear GPT generate(): the recurrent state gives the same tokens as recomputing, for every
decoding mode; padding, continuation and input validation (remote-code loading with generate:
tests/models/linear_gpt/test_family.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kernattn import LinearGPTCache, LinearGPTConfig, LinearGPTForCausalLM
from tests.conftest import V_GPT, tiny_linear_gpt_config
from tests.reference import assert_model_outputs_reordered_close, reorder_atol

VARIANTS = {
    "absolute": dict(),
    "rotary": dict(position_embedding_type="rotary"),
    "rpe": dict(rpe="learned", max_relative_position=3, position_embedding_type="none"),
}


def tiny(**kw) -> LinearGPTForCausalLM:
    torch.manual_seed(0)
    # the shared tiny config's large init makes the next token depend strongly on the context,
    # so a wrong state (e.g. beams not reordered, padding leaking in) changes the generated tokens
    cfg = tiny_linear_gpt_config(eos_token_id=None, **kw)
    model = LinearGPTForCausalLM(cfg).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            if block.attn.rpe is not None:
                torch.nn.init.normal_(block.attn.rpe.weight, std=0.7)
    return model


def prompt(batch=2, n=6, seed=1):
    return torch.randint(1, 53, (batch, n), generator=torch.Generator().manual_seed(seed))


MODES = {
    "greedy": dict(do_sample=False),
    "beam3": dict(do_sample=False, num_beams=3),
    "sample": dict(do_sample=True, top_k=20, temperature=1.3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_with_state_equals_recompute(variant, mode):
    model = tiny(**VARIANTS[variant])
    ids = prompt()
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(model.generate(ids, max_new_tokens=10, use_cache=use_cache, **MODES[mode]))
    assert outs[0].shape == (2, 16)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_left_padded_batch_equals_rows_alone(variant):
    model = tiny(**VARIANTS[variant])
    rows = [prompt(1, 7, seed=4)[0], prompt(1, 4, seed=5)[0], prompt(1, 5, seed=6)[0]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=8, do_sample=False)
        assert torch.equal(batched[i, width:], alone[0, len(r):]), f"row {i}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_continuation_from_returned_state_equals_one_long_generate(variant):
    model = tiny(**VARIANTS[variant])
    ids = prompt()
    long = model.generate(ids, max_new_tokens=12, do_sample=False)
    first = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    state = first.past_key_values
    assert isinstance(state, LinearGPTCache)
    assert state.get_seq_length() == first.sequences.shape[1] - 1  # the last token is not in the state yet
    rest = model.generate(first.sequences, past_key_values=state, max_new_tokens=7, do_sample=False)
    assert torch.equal(rest, long)


def test_streamer_receives_the_generated_tokens():
    model = tiny()
    got = []

    class Collect:
        def put(self, value):
            got.append(value.reshape(-1).tolist())

        def end(self):
            got.append("end")

    out = model.generate(prompt(1), max_new_tokens=5, do_sample=False, streamer=Collect())
    assert got[0] == out[0, :6].tolist() and got[-1] == "end"
    assert [t for chunk in got[1:-1] for t in chunk] == out[0, 6:].tolist()


def test_invalid_generation_inputs_raise_clear_errors():
    model = tiny()
    ids = prompt()
    with pytest.raises(TypeError, match="past_key_values"):
        model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=2)
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="input_ids"):
        model(ids + 100)
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(ids, attention_mask=torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(ids, max_new_tokens=70, do_sample=False)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
    state = model(ids).past_key_values
    with pytest.raises(ValueError, match="past_key_values"):
        model(prompt(3, 1), past_key_values=state)
    with pytest.raises(NotImplementedError, match="cropped"):
        state.crop(2)
    with pytest.raises(ValueError, match="feature_map"):
        LinearGPTConfig(feature_map="softmax")
    with pytest.raises(ValueError, match="position_embedding_type"):
        LinearGPTConfig(position_embedding_type="alibi")


@pytest.mark.parametrize("variant", ["absolute", "rpe"])
def test_padded_keys_outside_the_feature_range_are_not_refused(variant):
    """prf features refuse a *real* key whose norm leaves their representable range, but a
    padded key is never used: left padding whose embeddings give huge keys must run (forward
    and generate) and equal each row alone. Layer 0's key projection gets a large rank-1 part
    along a direction e that the real embeddings (and the token and position tables) do not contain, so
    only the padded slots, which hold 1e4 * e, have huge keys (LayerNorm maps them to sqrt(C) e)."""
    model = tiny(feature_map="prf", num_random_features=16, **VARIANTS[variant])
    c = model.config.hidden_size
    g = torch.Generator().manual_seed(7)

    def centred_unit(x):  # LayerNorm removes the mean: keep every direction orthogonal to ones
        x = x - x.mean(-1, keepdim=True)
        return x / x.norm(dim=-1, keepdim=True)

    e = centred_unit(torch.randn(c, generator=g))
    out_dir = torch.randn(c, generator=g)
    with torch.no_grad():
        model.transformer.h[0].attn.k_proj.weight.add_(50.0 * torch.outer(out_dir / out_dir.norm(), e))
        for table in (model.transformer.wte, model.transformer.wpe):  # generated tokens stay real
            if table is not None:
                table.weight.sub_(torch.outer(table.weight @ e, e))
    lengths = [6, 3]
    width = max(lengths)
    rows = [torch.randn(n, c, generator=g) for n in lengths]
    rows = [r - r.mean(-1, keepdim=True) for r in rows]
    rows = [r - torch.outer(r @ e, e) for r in rows]  # orthogonal to e
    embeds = torch.zeros(len(rows), width, c)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        embeds[i] = 1e4 * e  # padded slots
        embeds[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    with torch.no_grad():
        # a real key like the padded ones is refused (the check this test keeps away from padding)
        with pytest.raises(ValueError, match="feature_map='prf' cannot represent a key"):
            model(inputs_embeds=embeds, use_cache=False)
        batched = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
        generated = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=5, do_sample=False)
        for i, r in enumerate(rows):
            alone = model(inputs_embeds=r[None], use_cache=False).logits
            # the same operations on the same real tokens: float32 rounding of different batch shapes
            assert_model_outputs_reordered_close(batched[i, width - len(r) :], alone[0], model.config, width)
            assert torch.equal(generated[i], model.generate(inputs_embeds=r[None], max_new_tokens=5, do_sample=False)[0])


def test_generate_continues_from_a_state_given_under_either_name():
    """``cache=`` (transformers' name from 5.24) and ``past_key_values=`` (before) continue the
    same state on every supported transformers release: the scores equal recomputing from scratch."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config(eos_token_id=None)).eval().double()
    ids = torch.randint(1, V_GPT, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(do_sample=False, pad_token_id=V_GPT, return_dict_in_generate=True, output_scores=True)
    first = model.generate(ids, max_new_tokens=3, **kw)
    want = model.generate(first.sequences, max_new_tokens=4, use_cache=False, **kw)
    for name in ("cache", "past_key_values"):
        state = model.generate(ids, max_new_tokens=3, **kw).past_key_values
        got = model.generate(first.sequences, max_new_tokens=4, **{name: state}, **kw)
        assert torch.equal(got.sequences, want.sequences), name
        for a, b in zip(got.scores, want.scores):  # float32 scores: the float64 logits to half an ulp, twice
            atol = reorder_atol(b.double(), terms=64, layers=4 * model.config.num_hidden_layers)
            torch.testing.assert_close(a.double(), b.double(), rtol=2 ** -23, atol=atol)
