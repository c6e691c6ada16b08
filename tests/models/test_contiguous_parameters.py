"""Every parameter of every family is contiguous: after ``__init__``, after ``from_pretrained``
and after ``generate()``. Tools that flatten or shard parameters need it (torch FSDP2's
``fully_shard`` refuses non-contiguous ones, DeepSpeed ZeRO reshapes gradients with views), and
transformers' loading initialises missing weights in memory order, so a seeded init equals
between ``__init__`` and ``from_pretrained`` only when the layouts agree (transformers'
``test_can_init_all_missing_weights``, mirrored here). Old checkpoints keep loading identically
(``test_fixture_checkpoints.py``)."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
from transformers import PreTrainedModel, set_seed

from hf_kernattn import (
    LinearGPTForCausalLM,
    LinearGPTModel,
    NPRFBertForMaskedLM,
    NPRFBertModel,
    RelativePerformerViTForImageClassification,
    RelativePerformerViTModel,
)
from tests.conftest import V_GPT, tiny_linear_gpt_config, tiny_nprf_bert_config, tiny_relative_performer_vit_config

CASES = [
    (LinearGPTForCausalLM, tiny_linear_gpt_config, {}),
    (LinearGPTForCausalLM, tiny_linear_gpt_config,
     dict(mlp_type="gated", norm_type="rmsnorm", position_embedding_type="rope", num_key_value_heads=1)),
    (LinearGPTForCausalLM, tiny_linear_gpt_config, dict(rpe="learned", max_relative_position=4,
                                                        position_embedding_type="none")),
    (LinearGPTModel, tiny_linear_gpt_config, {}),
    (NPRFBertForMaskedLM, tiny_nprf_bert_config, {}),
    (NPRFBertModel, tiny_nprf_bert_config, {}),
    (RelativePerformerViTForImageClassification, tiny_relative_performer_vit_config, {}),
    (RelativePerformerViTModel, tiny_relative_performer_vit_config, {}),
]
IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for cls, _, kw in CASES]


def _not_contiguous(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not p.is_contiguous()]


@pytest.mark.parametrize("cls,make,kw", CASES, ids=IDS)
def test_every_parameter_is_contiguous_after_init_loading_and_generate(cls, make, kw, tmp_path):
    torch.manual_seed(0)
    model = cls(make(**kw))
    assert _not_contiguous(model) == []
    model.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path)
    assert _not_contiguous(loaded) == []
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    if hasattr(loaded, "generate"):
        ids = torch.randint(1, V_GPT, (1, 5), generator=torch.Generator().manual_seed(1))
        loaded.eval().generate(ids, max_new_tokens=3, do_sample=False)
        assert _not_contiguous(loaded) == []


@pytest.mark.parametrize("cls,make,kw", CASES, ids=IDS)
def test_seeded_init_equals_between_init_and_from_pretrained_of_missing_weights(cls, make, kw, monkeypatch):
    """transformers' check: with the weight init seeded, a model built by ``__init__`` and one
    loaded from an empty state dict (every weight missing, initialised by ``_init_weights``
    after the meta-device construction) hold exactly the same values."""
    original = PreTrainedModel._initialize_weights

    def seeded(*args, **kwargs):
        set_seed(42)
        return original(*args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_initialize_weights", seeded)
    config = make(**kw)
    from_init = cls(copy.deepcopy(config))
    from_pretrained = cls.from_pretrained(None, config=copy.deepcopy(config), state_dict={})
    a, b = from_init.state_dict(), from_pretrained.state_dict()
    assert sorted(a) == sorted(b)
    assert [k for k, v in b.items() if v.device.type == "meta"] == []
    assert sorted(k for k in a if not torch.equal(a[k], b[k])) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_fully_shard_accepts_linear_gpt_and_trains():
    """torch FSDP2 (one gloo process: the parameter checks and the sharded step run as with
    several) shards every block and the root, and a training step gives the unsharded one's loss
    and gradients."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config())
    reference = copy.deepcopy(model)
    ids = torch.randint(1, V_GPT, (2, 6), generator=torch.Generator().manual_seed(2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        for block in model.transformer.h:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        want = reference(ids, labels=ids, use_cache=False).loss
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-6)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        for name, p in reference.named_parameters():
            if name in grads:
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
        assert grads
    finally:
        dist.destroy_process_group()
