"""NPRF-BERT with the bidirectional sliding-window hybrid (``softmax_window=W``, ``rpe="none"``):
the attention layer equals an independent dense float64 reference (outputs and gradients,
padding, W in {1, 3, 64, > N}), the mixing weights are initialised, saved and reloaded, a BERT
converted with a window longer than its input is the softmax source, and bad configurations are
refused naming the field."""

import pytest
import torch

from hf_kernattn import NPRFBertForMaskedLM

from tests.conftest import tiny_nprf_bert_config
from tests.reference import hybrid_layer_reference

F64 = torch.float64
N = 10


def _model(window, seed=0, **kw):
    torch.manual_seed(seed)
    model = NPRFBertForMaskedLM(tiny_nprf_bert_config(softmax_window=window, rpe="none", **kw)).to(F64).eval()
    with torch.no_grad():  # mixing weights away from 1, so that a swapped or missing weight shows
        for i, layer in enumerate(model.nprf_bert.layers):
            layer.attention.window_log_weight.copy_(torch.tensor([0.3, -0.5, 0.1, 0.7]) * (i + 1))
            layer.attention.linear_log_weight.copy_(torch.tensor([-0.2, 0.4, 0.6, -0.1]) * (i + 1))
    return model


@pytest.mark.parametrize("window", [1, 3, 64, N + 3])
def test_attention_layer_equals_dense_reference_outputs_and_gradients(window):
    model = _model(window)
    attn = model.nprf_bert.layers[1].attention
    x = torch.randn(2, N, 32, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, -3:] = 0
    out = attn(x, attention_mask=mask)
    ref = hybrid_layer_reference(attn, x, window, mask.bool(), causal=False)
    real = mask.bool()[..., None]
    tol = 1e-10
    torch.testing.assert_close(out * real, ref * real, rtol=tol, atol=tol)
    params = [x, attn.window_log_weight, attn.linear_log_weight, attn.q_proj.weight, attn.k_proj.weight]
    g = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(2)) * real
    for a, b in zip(torch.autograd.grad((out * g).sum(), params), torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_padding_does_not_change_the_real_tokens_and_the_model_trains():
    model = _model(3)
    ids = torch.randint(1, 40, (1, 7), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 3)], dim=1).long()
    with torch.no_grad():
        alone = model(ids).logits
        with_pad = model(padded, attention_mask=mask).logits[:, :7]
    torch.testing.assert_close(with_pad, alone, rtol=1e-10, atol=1e-10)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(layer.attention.window_log_weight.grad.abs().sum() > 0 for layer in model.nprf_bert.layers)


def test_mixing_weights_initialised_saved_and_reloaded(tmp_path):
    with torch.device("meta"):
        meta = NPRFBertForMaskedLM(tiny_nprf_bert_config(softmax_window=4, rpe="none"))
    meta.to_empty(device="cpu")
    meta.init_weights()
    for layer in meta.nprf_bert.layers:
        assert torch.equal(layer.attention.window_log_weight, torch.zeros(4))
        assert torch.equal(layer.attention.linear_log_weight, torch.zeros(4))
    model = _model(4).float()
    model.save_pretrained(tmp_path)
    loaded = NPRFBertForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.softmax_window == 4
    ids = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_converted_bert_with_a_window_beyond_the_input_is_the_softmax_source(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from hf_kernattn.convert import convert_to_nprf_bert

    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=48, max_position_embeddings=40)).save_pretrained(tmp_path / "bert")
    teacher = BertForMaskedLM.from_pretrained(tmp_path / "bert", attn_implementation="eager").to(F64).eval()
    student = convert_to_nprf_bert(tmp_path / "bert", softmax_window=64, attention_eps=0.0).to(F64).eval()
    assert student.config.softmax_window == 64 and student.config.rpe == "none"
    ids = torch.randint(1, 60, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -4:] = 0
    with torch.no_grad():
        want = teacher(ids, attention_mask=mask).logits
        got = student(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-10)


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="softmax_window=3 cannot be combined with rpe='learned'"):
        tiny_nprf_bert_config(softmax_window=3)
    with pytest.raises(ValueError, match=r"attn_backend='fft' cannot serve.*softmax window.*\['hybrid'\]"):
        tiny_nprf_bert_config(softmax_window=3, rpe="none", attn_backend="fft")
    with pytest.raises(ValueError, match="attn_backend='hybrid' cannot serve.*calls without softmax_window"):
        tiny_nprf_bert_config(attn_backend="hybrid")
    with pytest.raises(ValueError, match="softmax_window must be None or an int >= 1"):
        tiny_nprf_bert_config(softmax_window=0, rpe="none")
    assert tiny_nprf_bert_config(softmax_window=3, rpe="none", attn_backend="hybrid").softmax_window == 3

