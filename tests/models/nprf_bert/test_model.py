"""NPRF-BERT model classes: padding invariance, heads and losses, Auto classes, config and
input validation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import BertTokenizer

import hf_kernattn
from hf_kernattn import (
    NPRFBertConfig,
    NPRFBertForMaskedLM,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
)
from tests.conftest import V_BERT
from tests.conftest import tiny_nprf_bert_config as tiny
from tests.reference import assert_model_outputs_reordered_close


def padded_batch(lengths, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 40, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    types = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
        types[i, length // 2 : length] = 1
    return ids * mask, mask, types  # padding positions hold [PAD] = 0


@pytest.mark.parametrize(
    "backend,dtype,n",
    [("auto", torch.float32, 13), ("fft", torch.float32, 13), ("fft", torch.float64, 13), ("auto", torch.float32, 400)],
)
@pytest.mark.parametrize("shared", [True, False])
def test_padded_batch_equals_unpadded_examples(backend, dtype, n, shared):
    torch.manual_seed(0)
    model = NPRFBertModel(tiny(attn_backend=backend, rpe_shared_across_layers=shared, max_position_embeddings=512))
    model = model.to(dtype).eval()
    lengths = [n, n - 5, 3, 1]
    ids, mask, types = padded_batch(lengths, n)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        for i, length in enumerate(lengths):
            single = model(ids[i : i + 1, :length], token_type_ids=types[i : i + 1, :length]).last_hidden_state
            assert_model_outputs_reordered_close(batch[i, :length], single[0], model.config, n)


def test_heads_shapes_losses_and_backward():
    torch.manual_seed(0)
    ids, mask, types = padded_batch([10, 7], 10)
    common = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)

    mlm = NPRFBertForMaskedLM(tiny())
    assert mlm.lm_head.decoder.weight is mlm.nprf_bert.embeddings.word_embeddings.weight
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    out = mlm(**common, labels=labels)
    assert out.logits.shape == (2, 10, 40) and out.loss.ndim == 0
    out.loss.backward()
    assert mlm.nprf_bert.rpe.weight.grad is not None and mlm.nprf_bert.rpe.weight.grad.abs().sum() > 0

    cls = NPRFBertForSequenceClassification(tiny(num_labels=3))
    out = cls(**common, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and cls.config.problem_type == "single_label_classification"
    manual = torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 2]))
    torch.testing.assert_close(out.loss, manual)

    reg = NPRFBertForSequenceClassification(tiny(num_labels=1))
    target = torch.tensor([0.5, 3.0])
    out = reg(**common, labels=target)
    assert reg.config.problem_type == "regression"
    torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), target))

    multi = NPRFBertForSequenceClassification(tiny(num_labels=4, problem_type="multi_label_classification"))
    target = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    out = multi(**common, labels=target)
    torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, target))

    tok = NPRFBertForTokenClassification(tiny(num_labels=5))
    labels = torch.randint(0, 5, (2, 10)).masked_fill(mask == 0, -100)
    out = tok(**common, labels=labels)
    assert out.logits.shape == (2, 10, 5) and torch.isfinite(out.loss)

    qa = NPRFBertForQuestionAnswering(tiny())
    out = qa(**common, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    assert out.start_logits.shape == (2, 10) and out.end_logits.shape == (2, 10) and torch.isfinite(out.loss)
    out.loss.backward()


def test_rpe_shared_or_per_layer():
    shared = NPRFBertModel(tiny(rpe_shared_across_layers=True))
    per_layer = NPRFBertModel(tiny(rpe_shared_across_layers=False))
    n_shared = [n for n, _ in shared.named_parameters() if "rpe" in n]
    n_per = [n for n, _ in per_layer.named_parameters() if "rpe" in n]
    assert n_shared == ["rpe.weight"]
    assert n_per == ["layers.0.rpe.weight", "layers.1.rpe.weight"]
    none = NPRFBertModel(tiny(rpe="none"))
    assert not [n for n, _ in none.named_parameters() if "rpe" in n]


def test_relative_bias_changes_output_and_no_position_model_is_length_free():
    torch.manual_seed(0)
    model = NPRFBertModel(tiny(position_embedding_type="none", rpe_init_std=0.0)).eval()
    ids = torch.randint(5, 40, (1, 100))  # longer than max_position_embeddings is fine without absolute positions
    with torch.no_grad():
        before = model(ids[:, :70]).last_hidden_state
        model.rpe.weight.normal_(std=1.0)
        after = model(ids[:, :70]).last_hidden_state
    assert (before - after).abs().max() > 1e-3
    with pytest.raises(ValueError, match="max_position_embeddings"):
        NPRFBertModel(tiny(max_position_embeddings=16))(ids[:, :20])


def test_feature_redraw_counts_one_step_per_training_forward():
    model = NPRFBertForSequenceClassification(tiny(feature_redraw_interval=2)).train()
    fm = model.nprf_bert.layers[0].attention.feature_map
    w0 = fm.projection.clone()
    ids = torch.randint(5, 40, (2, 6))
    model(ids)
    assert int(fm.num_steps) == 1 and torch.equal(fm.projection, w0)
    model(ids)
    assert int(fm.num_steps) == 2 and not torch.equal(fm.projection, w0)
    model.eval()
    model(ids)
    assert int(fm.num_steps) == 2


def test_auto_classes_and_bert_tokenizer(tmp_path):
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"])}
    tok = BertTokenizer(vocab=vocab)
    config = tiny(vocab_size=len(vocab))
    for auto, cls in (
        (transformers.AutoModel, NPRFBertModel),
        (transformers.AutoModelForMaskedLM, NPRFBertForMaskedLM),
        (transformers.AutoModelForSequenceClassification, NPRFBertForSequenceClassification),
        (transformers.AutoModelForTokenClassification, NPRFBertForTokenClassification),
        (transformers.AutoModelForQuestionAnswering, NPRFBertForQuestionAnswering),
    ):
        assert type(auto.from_config(config)) is cls
    assert isinstance(transformers.AutoConfig.for_model("nprf_bert"), NPRFBertConfig)
    model = NPRFBertForSequenceClassification(config).eval()
    enc = tok(["hello worlds", "hello"], ["world", "hello hello"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**enc).logits, logits, rtol=0, atol=0)
    auto_map = loaded.config.auto_map
    for name in ("AutoConfig", "AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                 "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"):
        assert name in auto_map, f"{name} missing from auto_map {auto_map}"


@pytest.mark.parametrize(
    "field,value",
    [
        ("feature_map", "softmax"),
        ("num_random_features", 0),
        ("feature_projection", "random"),
        ("normalize_qk", "yes"),
        ("feature_redraw_interval", -1),
        ("rpe", "learned_2d"),
        ("rpe", "sinusoidal"),
        ("max_relative_position", 0),
        ("attn_backend", "no_such_backend"),
        ("hidden_size", 30),
        ("num_attention_heads", 0),
        ("vocab_size", 0),
        ("num_hidden_layers", 0),
        ("hidden_dropout_prob", 1.5),
        ("position_embedding_type", "rotary"),
        ("rpe_shared_across_layers", "yes"),
        ("rpe_init_std", -1.0),
        ("pad_token_id", 1000),
        ("classifier_dropout", 2.0),
    ],
)
def test_bad_config_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_bad_inputs_raise():
    model = NPRFBertModel(tiny())
    ids = torch.randint(5, 40, (2, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.full((2, 6), 2))
    with pytest.raises(TypeError, match="attention_mask"):
        model(ids, attention_mask=[[1] * 6] * 2)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.full((2, 6), 40))
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[0])
    with pytest.raises(ValueError, match="token_type_ids"):
        model(ids, token_type_ids=torch.full((2, 6), 2))
    with pytest.raises(ValueError, match="input_ids"):
        model()
    with pytest.raises(ValueError, match="num_labels"):
        NPRFBertForQuestionAnswering(tiny(num_labels=3))
    with pytest.raises(ValueError, match="labels"):
        NPRFBertForMaskedLM(tiny())(ids, labels=ids[:, :3])


def _host_reads(monkeypatch, model, ids) -> list[str]:
    """Names of the host reads (.item(), bool() of a tensor, torch.equal, ...) in one forward."""
    reads = []
    with torch.no_grad():
        model(ids)  # the first call may build buffers
        for name in ("__bool__", "item", "__int__", "__float__", "__index__", "tolist"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
        real_equal = torch.equal
        monkeypatch.setattr(torch, "equal", lambda *a, **k: reads.append("equal") or real_equal(*a, **k))
        try:
            model(ids)
        finally:
            monkeypatch.undo()
    return reads


@pytest.mark.parametrize("shared", [True, False])
def test_a_forward_reads_nothing_on_the_host_per_layer_for_the_bias(monkeypatch, shared):
    """The bias clipped at K travels as its table (H, 2K+1) with rpe_clip: nothing verifies an
    expanded bias (torch.equal, .item(), bool() of a tensor, ...) per layer per forward. With a
    deterministic feature map and no padding, a forward reads on the host only what the model
    checks once (the token ids' range) and, per attention call, the non-finite guard's one read
    of its flags (``tolist``): as many other reads with 1 or 3 layers, with the bias or without.
    The outputs equal those of the bias expanded by hand to (H, 2N-1)."""
    ids = torch.randint(1, V_BERT, (2, 11), generator=torch.Generator().manual_seed(1))
    counts = {}
    for layers in (1, 3):
        for rpe in ("learned", "none"):
            torch.manual_seed(0)
            cfg = tiny(feature_map="elu", rpe=rpe, rpe_shared_across_layers=shared, max_relative_position=3,
                       num_hidden_layers=layers)
            counts[layers, rpe] = _host_reads(monkeypatch, NPRFBertModel(cfg).eval().double(), ids)
    assert all(reads.count("tolist") == layers for (layers, _), reads in counts.items()), counts
    counts = {key: [r for r in reads if r != "tolist"] for key, reads in counts.items()}
    assert counts[3, "learned"] == counts[1, "learned"] == counts[1, "none"] == counts[3, "none"], counts
    torch.manual_seed(0)
    model = NPRFBertModel(tiny(feature_map="elu", rpe_shared_across_layers=True, max_relative_position=3)).eval().double()
    with torch.no_grad():
        out = model(ids).last_hidden_state
        hidden = model.embeddings(ids, None, None, None)
        for layer in model.layers:
            hidden = layer(hidden, None, model.rpe(ids.shape[1]))
    torch.testing.assert_close(out, hidden, rtol=0, atol=1e-12)
