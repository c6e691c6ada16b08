"""The decoding plan reads the projections' parameters at every step, so its steps follow every
change of the parameters (optimizer steps, ``load_state_dict``, writes through ``.data``,
replaced parameters, dtype casts), and calls projections that are not plain ``nn.Linear``
modules (adapters such as LoRA, subclasses, hooked ones) as modules: the logits of the parallel
forward in every case."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_kernattn import LinearGPTForCausalLM
from tests.reference import assert_model_outputs_reordered_close
from tests.conftest import V_GPT, tiny_linear_gpt_config
from tests.models.linear_gpt.test_decoding_session import fast_steps  # noqa: F401  (a fixture)

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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_give_the_parallel_logits(name, fast_steps):
    """float64, left padding: every step (by the plan where the model has one; a clipped bias
    runs the modules) gives the parallel forward's logits to rounding."""
    model = _model(**CONFIGS[name])
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row
    steps = _decode(model, ids, mask=mask)
    assert fast_steps == ([] if name == "relu_clipped_bias" else [True] * 4)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(steps[real], full[real], rtol=1e-10, atol=1e-10)


def _assert_steps_follow_the_parameters(model, ids):
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    torch.testing.assert_close(_decode(model, ids), full, rtol=1e-10, atol=1e-10)


def test_steps_follow_optimizer_steps_loaded_weights_and_casts(fast_steps):
    model = _model()
    ids = _ids(2)
    _assert_steps_follow_the_parameters(model, ids)
    # an optimizer step writes into the parameters in place
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    _assert_steps_follow_the_parameters(model, ids)
    # load_state_dict copies other weights in
    torch.manual_seed(5)
    other = LinearGPTForCausalLM(tiny_linear_gpt_config(eos_token_id=None, initializer_range=0.5)).double()
    model.load_state_dict(other.state_dict())
    _assert_steps_follow_the_parameters(model, ids)
    # a parameter's data swapped (no version bump) and a parameter replaced
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5
        attn.v_proj.weight = nn.Parameter(attn.v_proj.weight * -1.0)
    _assert_steps_follow_the_parameters(model, ids)
    # a dtype cast and back
    model.float()
    with torch.no_grad():
        assert_model_outputs_reordered_close(_decode(model, ids), model(ids, use_cache=False).logits, model.config,
                                             ids.shape[1])
    model.double()
    _assert_steps_follow_the_parameters(model, ids)
    assert fast_steps and all(fast_steps)


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
def test_adapted_projections_are_called_and_stay_exact(wrap, fast_steps):
    model = _model()
    ids = _ids(3)
    _decode(model, ids)
    attn = model.transformer.h[1].attn
    if wrap == "wrapper":
        attn.q_proj = _LoRALinear(attn.q_proj).double()
    elif wrap == "subclass":
        attn.v_proj = _LoRASubclass(attn.v_proj).double()
    else:
        attn.k_proj.register_forward_hook(lambda module, args, out: out * 1.25)
    fast_steps.clear()
    _assert_steps_follow_the_parameters(model, ids)
    assert fast_steps == [True] * 4  # the plan calls the adapted projection


def test_a_new_generation_follows_writes_through_data():
    """Merging an adapter writes ``weight.data += delta`` (no version bump): the next generate()
    decodes with the new weights."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config()).double().eval()
    ids = torch.randint(1, V_GPT, (2, 5), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=4, do_sample=False)
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
