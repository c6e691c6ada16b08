"""One-token decoding steps project q, k and v with one fused weight (made from the three
projections, which the checkpoint keeps as they are) and map q and k in one feature-map call:
the same logits as the unfused step, a fused weight that follows every change of the
parameters, and no fusing for projections that are not plain ``nn.Linear`` modules (adapters
such as LoRA, hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_kernattn import LinearGPTForCausalLM
from hf_kernattn.modeling.attention import KernelizedSelfAttention
from tests.conftest import V_GPT, tiny_linear_gpt_config

CONFIGS = {
    "elu": {},
    "prf_rotary": dict(feature_map="prf", num_random_features=8, position_embedding_type="rotary"),
    "rope_gqa_gated": dict(position_embedding_type="rope", num_attention_heads=4, num_key_value_heads=2,
                           mlp_type="gated", norm_type="rmsnorm", attention_bias=True),
    "relu_clipped_bias": dict(feature_map="relu", rpe="learned", max_relative_position=3,
                              position_embedding_type="none"),
}


def _model(**overrides) -> LinearGPTForCausalLM:
    torch.manual_seed(0)
    return LinearGPTForCausalLM(tiny_linear_gpt_config(eos_token_id=None, **overrides)).eval().double()


def _decode(model, ids, prompt: int = 4, mask=None) -> torch.Tensor:
    """The logits of a prefill of ``prompt`` tokens, then one-token steps over the rest."""
    with torch.no_grad():
        kw = {} if mask is None else dict(attention_mask=mask[:, :prompt])
        out = model(ids[:, :prompt], use_cache=True, **kw)
        logits = [out.logits]
        for t in range(prompt, ids.shape[1]):
            kw = {} if mask is None else dict(attention_mask=mask[:, : t + 1])
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True, **kw)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _ids(seed: int = 1, batch: int = 2, n: int = 9) -> torch.Tensor:
    return torch.randint(1, V_GPT, (batch, n), generator=torch.Generator().manual_seed(seed))


def _fused_calls(monkeypatch) -> list:
    """Count the steps that used a fused weight."""
    calls = []
    real = KernelizedSelfAttention.fused_projection

    def counting(self):
        fused = real(self)
        calls.append(fused is not None)
        return fused

    monkeypatch.setattr(KernelizedSelfAttention, "fused_projection", counting)
    return calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_step_gives_the_unfused_logits(name, monkeypatch):
    """float64: the fused product sums the same terms per output (only the blocking of the
    matrix product may differ), so the logits agree to a few roundings of O(1) values."""
    model = _model(**CONFIGS[name])
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row
    calls = _fused_calls(monkeypatch)
    fused = _decode(model, ids, mask=mask)
    assert calls and all(calls)  # every step fused
    monkeypatch.setattr(KernelizedSelfAttention, "fused_projection", lambda self: None)
    unfused = _decode(model, ids, mask=mask)
    torch.testing.assert_close(fused, unfused, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # and both are the parallel forward's
        full = model(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(fused[real], full[real], rtol=1e-10, atol=1e-10)


def _assert_steps_follow_the_parameters(model, ids):
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    torch.testing.assert_close(_decode(model, ids), full, rtol=1e-10, atol=1e-10)


def test_fused_weight_follows_optimizer_steps_and_loaded_weights():
    model = _model()
    ids = _ids(2)
    _assert_steps_follow_the_parameters(model, ids)  # the fused weight is made here
    attn = model.transformer.h[0].attn
    made = attn._fused[1]
    # an optimizer step writes into the parameters in place
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    _assert_steps_follow_the_parameters(model, ids)
    assert attn._fused[1] is not made
    # load_state_dict copies other weights in
    torch.manual_seed(5)
    other = LinearGPTForCausalLM(tiny_linear_gpt_config(eos_token_id=None, initializer_range=0.5)).double()
    model.load_state_dict(other.state_dict())
    _assert_steps_follow_the_parameters(model, ids)
    # a parameter's data swapped (no version bump) and a parameter replaced
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5
        attn.v_proj.weight = nn.Parameter(attn.v_proj.weight * -1.0)
    _assert_steps_follow_the_parameters(model, ids)
    # a dtype cast and back
    model.float()
    assert attn._fused is None
    with torch.no_grad():
        torch.testing.assert_close(_decode(model, ids), model(ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    model.double()
    _assert_steps_follow_the_parameters(model, ids)


class _LoRALinear(nn.Module):
    """A LoRA-like wrapper around a projection (as PEFT wraps ``nn.Linear`` modules):
    ``base(x) + scale * up(down(x))``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.5)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.up(self.down(x))


class _LoRASubclass(nn.Linear):
    """An adapter written as a subclass of ``nn.Linear`` (its ``weight`` alone is not what it computes)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        self.delta = nn.Parameter(torch.randn(base.out_features, base.in_features) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + nn.functional.linear(x, self.delta)


@pytest.mark.parametrize("wrap", ["wrapper", "subclass", "hook"])
def test_adapted_projections_are_not_fused_and_stay_exact(wrap, monkeypatch):
    model = _model()
    ids = _ids(3)
    _decode(model, ids)  # a fused weight exists from before the adapter came
    attn = model.transformer.h[1].attn
    if wrap == "wrapper":
        attn.q_proj = _LoRALinear(attn.q_proj).double()
    elif wrap == "subclass":
        attn.v_proj = _LoRASubclass(attn.v_proj).double()
    else:
        attn.k_proj.register_forward_hook(lambda module, args, out: out * 1.25)
    calls = _fused_calls(monkeypatch)
    _assert_steps_follow_the_parameters(model, ids)
    assert calls and not all(calls) and any(calls)  # layer 0 still fused, layer 1 not


def test_a_new_generation_fuses_afresh_after_writes_through_data():
    """Merging an adapter writes ``weight.data += delta`` (no version bump): the next generate()
    (its prefill ends the earlier decoding session) must decode with the new weights."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config()).double().eval()
    ids = torch.randint(1, V_GPT, (2, 5), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=4, do_sample=False)  # fuses the projections of the old weights
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for block in model.transformer.h:
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                proj.weight.data += 0.5 * torch.randn(proj.weight.shape, dtype=torch.float64, generator=g)
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got, want = model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):  # float64: the state and the parallel form agree to rounding
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
