"""Conversion of softmax BERT / RoBERTa checkpoints into NPRF-BERT."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
)

from hf_kernattn.cli import main as cli_main
from hf_kernattn.convert import convert_to_nprf_bert

SIZES = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)


def _layer_pairs(i: int, src: str, dst: str) -> list[tuple[str, str]]:
    s, d = f"{src}encoder.layer.{i}.", f"{dst}layers.{i}."
    pairs = [
        ("attention.self.query", "attention.q_proj"), ("attention.self.key", "attention.k_proj"),
        ("attention.self.value", "attention.v_proj"), ("attention.output.dense", "attention.o_proj"),
        ("attention.output.LayerNorm", "attention_norm"), ("intermediate.dense", "intermediate"),
        ("output.dense", "output"), ("output.LayerNorm", "output_norm"),
    ]
    return [(s + a + "." + p, d + b + "." + p) for a, b in pairs for p in ("weight", "bias")]


def _expected_pairs(src: str, dst: str, layers: int) -> list[tuple[str, str]]:
    pairs = [(f"{src}embeddings.{n}", f"{dst}embeddings.{n}") for n in (
        "word_embeddings.weight", "token_type_embeddings.weight", "position_embeddings.weight",
        "LayerNorm.weight", "LayerNorm.bias")]
    for i in range(layers):
        pairs += _layer_pairs(i, src, dst)
    return pairs


def _check_pairs(src_state, dst_state, pairs, position_offset=0):
    assert pairs
    for s, d in pairs:
        value = src_state[s][position_offset:] if "position_embeddings" in s else src_state[s]
        assert torch.equal(dst_state[d], value), f"{d} != {s}"


def test_bert_sequence_classification_copies_every_weight_exactly(tmp_path):
    torch.manual_seed(0)
    src = BertForSequenceClassification(BertConfig(**SIZES, max_position_embeddings=40, num_labels=3))
    src.save_pretrained(tmp_path / "bert")
    model = convert_to_nprf_bert(tmp_path / "bert", tmp_path / "out")
    s, d = src.state_dict(), model.state_dict()
    pairs = _expected_pairs("bert.", "nprf_bert.", 2)
    pairs += [("bert.pooler.dense.weight", "nprf_bert.pooler.dense.weight"),
              ("bert.pooler.dense.bias", "nprf_bert.pooler.dense.bias"),
              ("classifier.weight", "classifier.weight"), ("classifier.bias", "classifier.bias")]
    _check_pairs(s, d, pairs)
    assert len(model.conversion_report["copied"]) == len(pairs)
    assert model.conversion_report["unused_source_keys"] == []
    assert torch.count_nonzero(d["nprf_bert.rpe.weight"]) == 0
    assert model.config.num_labels == 3 and model.config.max_position_embeddings == 40
    # The saved checkpoint reloads into the same weights.
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, d[k]), k


def test_bert_mlm_and_base_model(tmp_path):
    torch.manual_seed(0)
    cfg = BertConfig(**SIZES, max_position_embeddings=40)
    src = BertForMaskedLM(cfg)
    with torch.no_grad():
        src.cls.predictions.bias.normal_()
    src.save_pretrained(tmp_path / "mlm")
    model = convert_to_nprf_bert(tmp_path / "mlm")
    s, d = src.state_dict(), model.state_dict()
    pairs = _expected_pairs("bert.", "nprf_bert.", 2) + [
        ("cls.predictions.transform.dense.weight", "lm_head.dense.weight"),
        ("cls.predictions.transform.dense.bias", "lm_head.dense.bias"),
        ("cls.predictions.transform.LayerNorm.weight", "lm_head.LayerNorm.weight"),
        ("cls.predictions.transform.LayerNorm.bias", "lm_head.LayerNorm.bias"),
        ("cls.predictions.bias", "lm_head.decoder.bias"),
    ]
    _check_pairs(s, d, pairs)
    assert torch.equal(d["lm_head.decoder.weight"], s["bert.embeddings.word_embeddings.weight"])

    base = BertModel(cfg)
    base.save_pretrained(tmp_path / "base")
    model = convert_to_nprf_bert(tmp_path / "base")
    pairs = _expected_pairs("", "", 2) + [("pooler.dense.weight", "pooler.dense.weight"), ("pooler.dense.bias", "pooler.dense.bias")]
    _check_pairs(base.state_dict(), model.state_dict(), pairs)

    # A pre-trained MLM checkpoint turned into a classifier: encoder copied, new head initialised.
    cls = convert_to_nprf_bert(tmp_path / "mlm", head="sequence_classification", num_labels=2)
    _check_pairs(s, cls.state_dict(), _expected_pairs("bert.", "nprf_bert.", 2))
    assert "classifier.weight" in cls.conversion_report["initialised"]


def test_roberta_positions_are_shifted_and_heads_mapped(tmp_path):
    torch.manual_seed(0)
    cfg = RobertaConfig(**SIZES, max_position_embeddings=42, pad_token_id=1, type_vocab_size=1, num_labels=2)
    src = RobertaForSequenceClassification(cfg)
    src.save_pretrained(tmp_path / "rob")
    model = convert_to_nprf_bert(tmp_path / "rob")
    s, d = src.state_dict(), model.state_dict()
    pairs = _expected_pairs("roberta.", "nprf_bert.", 2) + [
        ("classifier.dense.weight", "nprf_bert.pooler.dense.weight"), ("classifier.dense.bias", "nprf_bert.pooler.dense.bias"),
        ("classifier.out_proj.weight", "classifier.weight"), ("classifier.out_proj.bias", "classifier.bias"),
    ]
    _check_pairs(s, d, pairs, position_offset=2)
    assert model.config.max_position_embeddings == 40 and model.config.pad_token_id == 1

    mlm = RobertaForMaskedLM(cfg)
    mlm.save_pretrained(tmp_path / "rmlm")
    model = convert_to_nprf_bert(tmp_path / "rmlm")
    _check_pairs(mlm.state_dict(), model.state_dict(), [
        ("lm_head.dense.weight", "lm_head.dense.weight"), ("lm_head.layer_norm.weight", "lm_head.LayerNorm.weight"),
        ("lm_head.layer_norm.bias", "lm_head.LayerNorm.bias"), ("lm_head.bias", "lm_head.decoder.bias"),
    ])


def test_unknown_architecture_and_bad_arguments_fail_clearly(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type='gpt2'.*bert.*roberta"):
        convert_to_nprf_bert(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="checkpoint_dir"):
        convert_to_nprf_bert(tmp_path / "missing")
    BertModel(BertConfig(**SIZES)).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="head"):
        convert_to_nprf_bert(tmp_path / "bert", head="decoder")
    with pytest.raises(ValueError, match="not_a_field"):
        convert_to_nprf_bert(tmp_path / "bert", not_a_field=1)
    with pytest.raises(ValueError, match="num_random_features"):
        convert_to_nprf_bert(tmp_path / "bert", num_random_features=0)


def test_cli_convert(tmp_path, capsys):
    torch.manual_seed(0)
    src = BertForSequenceClassification(BertConfig(**SIZES, num_labels=2))
    src.save_pretrained(tmp_path / "bert")
    (tmp_path / "bert" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    rc = cli_main(["convert", str(tmp_path / "bert"), str(tmp_path / "out"), "--num-random-features", "8"])
    assert rc == 0
    assert "copied 41 tensors" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "nprf_bert" and cfg["num_random_features"] == 8
    assert (tmp_path / "out" / "vocab.txt").is_file() and (tmp_path / "out" / "modeling_nprf_bert.py").is_file()


# --- Hub model ids: resolved as from_pretrained does (a stand-in for the download offline) ---


def _fake_hub(remote_root, calls):
    """A stand-in for huggingface_hub.snapshot_download: serves the folder remote_root/<repo_id>,
    copying only the files that match allow_patterns into a fresh snapshot folder, as the Hub
    client does."""
    import fnmatch
    import shutil

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, **kwargs):
        calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": list(allow_patterns)})
        remote = remote_root / repo_id
        if not remote.is_dir():
            from huggingface_hub.errors import LocalEntryNotFoundError  # an OSError, like every "not found" of the client

            raise LocalEntryNotFoundError(f"Repository Not Found: {repo_id}")
        snap = remote_root.parent / "cache" / repo_id.replace("/", "--") / f"snap{len(calls)}"
        snap.mkdir(parents=True)
        for f in remote.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy2(f, snap / f.name)
        return str(snap)

    return snapshot_download


def test_hub_model_id_is_downloaded_and_converted(tmp_path, monkeypatch, capsys):
    import hf_kernattn.convert.common as convert_mod

    torch.manual_seed(0)
    src = BertForSequenceClassification(BertConfig(**SIZES, num_labels=2))
    remote = tmp_path / "hub" / "some-org" / "tiny-bert"
    src.save_pretrained(remote)
    (remote / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    (remote / "README.md").write_text("not needed for conversion")
    calls: list = []
    monkeypatch.setattr(convert_mod, "snapshot_download", _fake_hub(tmp_path / "hub", calls))

    rc = cli_main(["convert", "some-org/tiny-bert", str(tmp_path / "out"), "--revision", "v1", "--num-random-features", "8"])
    assert rc == 0 and "copied 41 tensors" in capsys.readouterr().out
    # One download (safetensors present), pinned to the revision, of what conversion reads only.
    assert [(c["repo_id"], c["revision"]) for c in calls] == [("some-org/tiny-bert", "v1")]
    assert "config.json" in calls[0]["allow_patterns"] and "*.safetensors" in calls[0]["allow_patterns"]
    assert not any("README" in p or p == "*" for p in calls[0]["allow_patterns"])
    model = convert_to_nprf_bert(str(remote))  # the same checkpoint as a local directory
    from transformers import AutoModelForSequenceClassification

    from_hub = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    for k, v in model.state_dict().items():
        if "feature_map" not in k:  # random projections follow the requested feature count
            assert torch.equal(from_hub.state_dict()[k], v), k
    assert (tmp_path / "out" / "vocab.txt").is_file()

    # A repository without safetensors: pickled weights are not even downloaded unless asked for;
    # with allow_pickle=True a second request fetches them.
    remote2 = tmp_path / "hub" / "some-org" / "config-only"
    remote2.mkdir(parents=True)
    (remote2 / "config.json").write_text((remote / "config.json").read_text())
    calls.clear()
    with pytest.raises(ValueError, match="has no safetensors weights; pickled weights .* only with allow_pickle=True"):
        convert_to_nprf_bert("some-org/config-only")
    assert len(calls) == 1
    with pytest.raises(ValueError, match="no \\*.safetensors or pytorch_model\\*.bin"):
        convert_to_nprf_bert("some-org/config-only", allow_pickle=True)
    assert len(calls) == 3 and "pytorch_model*.bin" in calls[2]["allow_patterns"]

    # An unknown id: one error line naming it.
    capsys.readouterr()
    rc = cli_main(["-q", "convert", "some-org/no-such-model", str(tmp_path / "out2")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith("hf-kernattn: error: checkpoint_dir 'some-org/no-such-model' is not a local directory")
    # Neither a directory nor a possible model id.
    with pytest.raises(ValueError, match="neither a local directory nor a Hub model id"):
        convert_to_nprf_bert("not//an id")


def test_unknown_hub_id_offline_is_one_error_line(tmp_path, monkeypatch, capsys):
    """The real huggingface_hub client, offline with an empty cache: one line, exit status 1."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    rc = cli_main(["-q", "convert", "some-org/never-downloaded", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert "'some-org/never-downloaded' is not a local directory and could not be fetched" in err
    assert not (tmp_path / "out").exists()
