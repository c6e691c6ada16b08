"""Every family on an accelerator (the ``accelerator`` fixture of tests/conftest.py: CUDA where
torch sees it, ``--device`` to choose; skipped without one): a training step's loss, logits and
gradients equal the same model's on the CPU, and Linear GPT generates on the device what it
generates on the CPU, its state staying there. float64 (the device's reductions may sum in
another order: the bound of reordered sums, ``tests.reference``), and float32 against the
float64 run where the model has no convolution (CUDA may run those in TF32).
``scripts/gpu_check.sh`` runs these."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_kernattn import LinearGPTForCausalLM, NPRFBertForMaskedLM, RelativePerformerViTForImageClassification
from hf_kernattn.modeling.cache import CACHE_FIELD

from tests.conftest import V_BERT, V_GPT, tiny_linear_gpt_config, tiny_nprf_bert_config, tiny_relative_performer_vit_config
from tests.reference import assert_model_outputs_reordered_close

B, N = 2, 12


def _text_batch(vocab: int, left: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.long)
    if left:
        mask[1, :4] = 0
    else:
        mask[1, -4:] = 0
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _image_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, 4, 4, dtype=torch.long)
    mask[1, 3:] = 0  # the second image's last grid row is padding
    return dict(pixel_values=torch.randn(B, 1, 16, 16, generator=g), patch_mask=mask, labels=torch.tensor([0, 2]))


FAMILIES = {
    "nprf_bert": (lambda **kw: NPRFBertForMaskedLM(tiny_nprf_bert_config(**kw)), lambda: _text_batch(V_BERT, False), N),
    "linear_gpt": (lambda **kw: LinearGPTForCausalLM(tiny_linear_gpt_config(**kw)), lambda: _text_batch(V_GPT, True), N),
    "linear_gpt_window": (lambda **kw: LinearGPTForCausalLM(tiny_linear_gpt_config(softmax_window=3, **kw)),
                          lambda: _text_batch(V_GPT, True), N),
    "relative_performer_vit": (lambda **kw: RelativePerformerViTForImageClassification(tiny_relative_performer_vit_config(**kw)),
                               _image_batch, 16),
}
CONVOLUTIONS = {"relative_performer_vit"}  # the patch embedding


def _step(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Loss, logits and every parameter's gradient of one training step (dropout off) on ``device``."""
    model = model.to(device).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.zero_grad()
    out = model(**{k: v.to(device) if k != "pixel_values" else v.to(device, next(model.parameters()).dtype)
                   for k, v in batch.items()})
    out.loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().cpu(), out.logits.detach().cpu(), grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_training_step_on_the_device_equals_the_cpus(accelerator, family):
    build, batch, n = FAMILIES[family]
    torch.manual_seed(0)
    model = build().double()
    cpu = _step(copy.deepcopy(model), batch(), "cpu")
    dev = _step(copy.deepcopy(model), batch(), accelerator)
    terms = B * n  # gradients of weights sum over every token of the batch
    for name, got, want in (("loss", dev[0], cpu[0]), ("logits", dev[1], cpu[1])):
        assert_model_outputs_reordered_close(got, want, model.config, terms, msg=name)
    assert dev[2].keys() == cpu[2].keys() and len(cpu[2]) > 10
    for name in cpu[2]:
        assert_model_outputs_reordered_close(dev[2][name], cpu[2][name], model.config, terms, msg=name)
    if family not in CONVOLUTIONS:  # float32 on the device against the float64 step
        f32 = _step(copy.deepcopy(model).float(), batch(), accelerator)
        assert_model_outputs_reordered_close(f32[1], cpu[1].float(), model.config, terms, msg="float32 logits")


@pytest.mark.parametrize("variant", [{}, {"rpe": "learned", "max_relative_position": 3, "position_embedding_type": "none"},
                                     {"softmax_window": 3}, {"feature_map": "hedgehog"},
                                     {"position_embedding_type": "rope", "norm_type": "rmsnorm", "mlp_type": "gated",
                                      "num_key_value_heads": 1, "hidden_act": "silu"}],
                         ids=["plain", "rpe", "window", "hedgehog", "llama"])
def test_linear_gpt_generates_on_the_device_what_it_generates_on_the_cpu(accelerator, variant):
    """Greedy and beam ``generate()`` on a left-padded batch (float64): the same tokens as on the
    CPU, the state on the device; continuing from the returned state equals one long call."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(tiny_linear_gpt_config(**variant)).double().eval()
    batch = _text_batch(V_GPT, True, seed=3)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ids = ids * mask  # padding holds the pad token 0
    on_device = copy.deepcopy(model).to(accelerator)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3)):
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **options)
        got = on_device.generate(ids.to(accelerator), attention_mask=mask.to(accelerator), max_new_tokens=6,
                                 pad_token_id=0, **options)
        assert got.device.type == accelerator.type
        assert torch.equal(got.cpu(), want), options
    first = on_device.generate(ids.to(accelerator), attention_mask=mask.to(accelerator), max_new_tokens=3,
                               pad_token_id=0, do_sample=False, return_dict_in_generate=True)
    state = getattr(first, CACHE_FIELD)
    assert all(x.device.type == accelerator.type for layer in state.layers for x in layer.get_state()
               if isinstance(x, torch.Tensor))
    more = torch.ones(B, 3, dtype=torch.long, device=accelerator)
    rest = on_device.generate(first.sequences, attention_mask=torch.cat([mask.to(accelerator), more], 1),
                              **{CACHE_FIELD: state}, max_new_tokens=3, pad_token_id=0, do_sample=False)
    long = on_device.generate(ids.to(accelerator), attention_mask=mask.to(accelerator), max_new_tokens=6,
                              pad_token_id=0, do_sample=False)
    assert torch.equal(rest, long)
