"""Linear GPT forward: stateful decoding equals the parallel form; rotary / RPE against dense references; gradients."""

from __future__ import annotations

import pytest
import torch

from hf_kernattn import LinearGPTCache, LinearGPTForCausalLM
from hf_kernattn.modeling.kernels_dense import dense_attention
from hf_kernattn.modeling.modeling_linear_gpt import apply_rotary, rotary_cos_sin
from tests.conftest import checkpointing_enable, tiny_linear_gpt_config
from tests.reference import assert_model_outputs_reordered_close

VARIANTS = {
    "elu_absolute": dict(),
    "elu_rotary": dict(position_embedding_type="rotary"),
    "rpe_learned": dict(rpe="learned", max_relative_position=4, position_embedding_type="none"),
    "rpe_absolute": dict(rpe="learned", max_relative_position=3),
    "prf_absolute": dict(feature_map="prf", num_random_features=16),
}


def tiny(**kw) -> LinearGPTForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_linear_gpt_config(vocab_size=61, pad_token_id=None, initializer_range=0.02, **kw)
    model = LinearGPTForCausalLM(cfg).eval()
    for block in model.transformer.h:  # a non-trivial bias, so RPE paths are really exercised
        if block.attn.rpe is not None:
            torch.nn.init.normal_(block.attn.rpe.weight, std=0.7)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_steps_equal_full_forward(variant):
    model = tiny(**VARIANTS[variant])
    ids = torch.randint(0, 61, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6])
        cache = out.past_key_values
        assert isinstance(cache, LinearGPTCache) and cache.get_seq_length() == 6
        pieces = [out.logits]
        out = model(ids[:, 6:11], past_key_values=cache)  # a multi-token chunk on top of a state
        pieces.append(out.logits)
        for t in range(11, 21):
            out = model(ids[:, t : t + 1], past_key_values=cache, logits_to_keep=1)
            assert out.logits.shape == (2, 1, 61)
            pieces.append(out.logits)
    assert cache.get_seq_length() == 21
    # float32, the same formula summed in another order (a state, then steps)
    assert_model_outputs_reordered_close(torch.cat(pieces, dim=1), full, model.config, 21)
    # logits_to_keep on a full forward keeps the last positions only (another matmul shape)
    with torch.no_grad():
        last3 = model(ids, use_cache=False, logits_to_keep=3).logits
    assert_model_outputs_reordered_close(last3, full[:, -3:], model.config, 21)


def test_state_size_does_not_grow_with_context():
    model = tiny()
    with torch.no_grad():
        short = model(torch.randint(0, 61, (1, 8))).past_key_values
        long = model(torch.randint(0, 61, (1, 60))).past_key_values
    sizes = lambda c: [x.shape for l in c.layers for x in l.get_state() if x is not None]  # noqa: E731
    assert sizes(short) == sizes(long)


def _layer_inputs(model, n=12):
    torch.manual_seed(3)
    attn = model.transformer.h[0].attn
    h = torch.randn(2, n, model.config.hidden_size, dtype=torch.float64)
    return attn.double(), h


def test_rotary_attention_matches_dense_reference():
    model = tiny(position_embedding_type="rotary")
    attn, h = _layer_inputs(model)
    n = h.shape[1]
    pos = torch.arange(n)[None].expand(2, n)
    cos, sin = rotary_cos_sin(pos, attn.feature_map.num_features, model.config.rotary_base, torch.float64)
    with torch.no_grad():
        got = attn(h, rotary=(cos, sin))
        q, k, v = attn.project(h)
        qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        tri = torch.ones(n, n, dtype=torch.bool).tril()
        num = (qr @ kr.transpose(-1, -2)) * tri
        den = ((q @ k.transpose(-1, -2)) * tri).sum(-1, keepdim=True)
        want = attn.output(num @ v / (den + attn.eps), h.dtype)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    # relative: shifting every position by the same amount leaves the output unchanged
    cos2, sin2 = rotary_cos_sin(pos + 7, attn.feature_map.num_features, model.config.rotary_base, torch.float64)
    with torch.no_grad():
        shifted = attn(h, rotary=(cos2, sin2))
    torch.testing.assert_close(shifted, got, atol=1e-9, rtol=1e-8)


def test_rpe_attention_matches_dense_reference_and_decoding():
    model = tiny(rpe="learned", max_relative_position=4, position_embedding_type="none")
    attn, h = _layer_inputs(model, n=13)
    n = h.shape[1]
    with torch.no_grad():
        got = attn(h)  # parallel form (fft / auto backend)
        q, k, v = attn.project(h)
        want = attn.output(dense_attention(q, k, v, rpe_bias=attn.rpe(n).double(), causal=True, eps=attn.eps), h.dtype)
        # and the constant-size decoding (old state weighted c_{-K} + window of K - 1 keys)
        from hf_kernattn.modeling.cache import LinearGPTCacheLayer

        state = LinearGPTCacheLayer(window=3)
        steps = [attn(h[:, :1], past_key_values=state)]
        steps += [attn(h[:, t : t + 1], past_key_values=state) for t in range(1, n)]
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=1e-10, rtol=1e-8)
    assert state.get_state().window_k.shape[2] == 3  # K - 1, whatever the context length


@pytest.mark.parametrize("variant", ["elu_absolute", "elu_rotary", "rpe_learned"])
def test_gradients_flow_and_checkpointing_matches(variant):
    model = tiny(**VARIANTS[variant]).train()
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())]
    assert not missing, missing
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "rpe" in n or "q_proj.weight" in n)
    model.zero_grad()
    checkpointing_enable(model)
    out = model(ids, labels=ids, use_cache=True)
    assert out.past_key_values is None  # no state under gradient checkpointing
    out.loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype,base,spike",
    [
        (torch.float32, 90.0, 0.0),  # exp(90) overflows float32
        (torch.float32, 10.0, 80.0),
        (torch.float64, 800.0, 0.0),  # exp(800) overflows float64
        (torch.float64, 730.0, 80.0),
    ],
)
def test_decoding_with_a_large_bias_equals_the_parallel_form(dtype, base, spike):
    """A learned bias far from 0: decoding from the state (a multi-token chunk, then one token at
    a time) exponentiates the table shifted by its maximum, as the parallel form does, so no
    coefficient overflows; the shift cancels (eps scaled by exp(-shift) as in the core) and the
    logits equal the stateless full forward."""
    model = tiny(rpe="learned", max_relative_position=4, position_embedding_type="none").to(dtype)
    with torch.no_grad():
        for block in model.transformer.h:
            w = block.attn.rpe.weight  # (H, 2K+1), entry r + K; causal offsets -4..0 are entries 0..4
            w.add_(base)
            w[0, 0] += spike  # offset -K: the keys folded into (S, z)
            w[1, 2] += spike  # offset -2: a key of the window
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5])
        cache = out.past_key_values
        pieces = [out.logits, model(ids[:, 5:8], past_key_values=cache).logits]
        pieces += [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(8, 14)]
    got = torch.cat(pieces, dim=1)
    assert torch.isfinite(full).all() and torch.isfinite(got).all()
    # both paths compute the same formula with coefficients <= 1 in `dtype`, summing in a
    # different order: within the bound of reordered sums in `dtype`
    assert_model_outputs_reordered_close(got, full, model.config, 14)


@pytest.mark.parametrize("variant", ["elu_absolute", "elu_rotary", "rpe_learned", "prf_absolute"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_padding_does_not_reach_real_rows_or_the_state(variant, poison):
    """Left padding holding NaN/inf in the prompt, run as a prefill that builds the state (its
    first two positions: one row is padding only) and a continuation that still holds padding,
    then new tokens (a multi-token chunk, then one token at a time): every real row's logits
    equal the row run alone, and the state (S, z and the RPE window) stays finite. Padded keys
    and values are replaced with `where` before anything sums them, so nothing of a padded slot
    enters; a padded query only makes its own (padded) row non-finite."""
    model = tiny(**VARIANTS[variant])
    c = model.config.hidden_size
    g = torch.Generator().manual_seed(9)
    lengths, width = [7, 4], 7
    rows = [torch.randn(n, c, generator=g) for n in lengths]
    embeds = torch.full((2, width, c), poison)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        embeds[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    nxt = torch.randint(0, 61, (2, 6), generator=g)
    with torch.no_grad():
        out = model(inputs_embeds=embeds[:, :2], attention_mask=mask[:, :2])
        cache = out.past_key_values
        rest = model(inputs_embeds=embeds[:, 2:], attention_mask=mask, past_key_values=cache)
        prefill = torch.cat([out.logits, rest.logits], dim=1)
        mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
        chunk = model(nxt[:, :3], attention_mask=mask, past_key_values=cache).logits
        steps = []
        for t in range(3, 6):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            steps.append(model(nxt[:, t : t + 1], attention_mask=mask, past_key_values=cache).logits)
        for layer in cache.layers:
            for name, x in layer.get_state()._asdict().items():
                assert x is None or torch.isfinite(x).all(), name
        for i, r in enumerate(rows):
            alone = model(inputs_embeds=r[None])
            state = alone.past_key_values
            want = [alone.logits[0], model(nxt[i : i + 1, :3], past_key_values=state).logits[0]]
            want += [model(nxt[i : i + 1, t : t + 1], past_key_values=state).logits[0] for t in range(3, 6)]
            got = [prefill[i, width - len(r) :], chunk[i]] + [s[i] for s in steps]
            # the same operations on the same real tokens, float32: rounding of other batch shapes
            assert_model_outputs_reordered_close(torch.cat(got), torch.cat(want), model.config, width + 6)
