"""What conversion reads from a source folder, the same for every source type (BERT, RoBERTa,
GPT-2, Llama, ViT): missing tensors and a layer count the weights do not hold are refused by
name (never reported as copied), a sharded set is read through its index (a stale single file
beside it is ignored), pickled weights are read only when asked for (with a warning), and
damaged files are one clear error naming the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    ViTConfig,
    ViTForImageClassification,
)

from hf_kernattn.cli import main as cli_main
from hf_kernattn.convert import convert

from tests.conftest import unpickling_forbidden

ENC = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)


def _build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "bert":
        return BertForMaskedLM(BertConfig(**ENC, max_position_embeddings=40))
    if kind == "roberta":
        return RobertaForMaskedLM(RobertaConfig(**ENC, max_position_embeddings=42, pad_token_id=1, type_vocab_size=1))
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                          bos_token_id=0, eos_token_id=0))
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                               num_labels=3))


KINDS = ("bert", "roberta", "gpt2", "llama", "vit")
LAYERS_FIELD = {"gpt2": "n_layer"}
# A tensor of layer 1 as the source file stores it, and the name conversion reports it under
# (transformers' own layout for the sources it loads: Llama's names are unchanged, ViT's renamed).
LAYER_1_TENSOR = {
    "bert": ("bert.encoder.layer.1.output.dense.weight",) * 2,
    "roberta": ("roberta.encoder.layer.1.output.dense.weight",) * 2,
    "gpt2": ("transformer.h.1.mlp.c_fc.weight",) * 2,
    "llama": ("model.layers.1.mlp.up_proj.weight",) * 2,
    "vit": ("vit.encoder.layer.1.output.dense.weight", "vit.layers.1.mlp.fc2.weight"),
}
# (converted key, source key as the source model's state_dict names it): a tensor compared after conversion
EMBEDDING = {
    "bert": ("nprf_bert.embeddings.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
    "roberta": ("nprf_bert.embeddings.word_embeddings.weight", "roberta.embeddings.word_embeddings.weight"),
    "gpt2": ("transformer.wte.weight", "transformer.wte.weight"),
    "llama": ("transformer.wte.weight", "model.embed_tokens.weight"),
    "vit": ("vit.embeddings.patch_embeddings.weight", "vit.embeddings.patch_embeddings.projection.weight"),
}


def _saved(kind: str, folder, seed: int = 0, **save_kwargs):
    model = _build(kind, seed).eval()
    model.save_pretrained(folder, **save_kwargs)
    return model


def _rewrite_weights(folder, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _set_layers(folder, kind: str, n: int) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg[LAYERS_FIELD.get(kind, "num_hidden_layers")] = n
    (folder / "config.json").write_text(json.dumps(cfg))


# --- missing tensors and layer counts ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_tensor_is_refused_by_name(kind, tmp_path, capsys):
    _saved(kind, tmp_path / "src")
    on_disk, reported = LAYER_1_TENSOR[kind]
    _rewrite_weights(tmp_path / "src", lambda state: state.pop(on_disk))
    with pytest.raises(ValueError, match=f"checkpoint has no .*'{reported}'"):
        convert(tmp_path / "src")
    capsys.readouterr()  # what saving the source printed
    rc = cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err and reported in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_claiming_more_layers_than_the_weights_hold_is_refused(kind, tmp_path, capsys):
    _saved(kind, tmp_path / "src")
    _set_layers(tmp_path / "src", kind, 3)
    field = LAYERS_FIELD.get(kind, "num_hidden_layers")
    with pytest.raises(ValueError, match=rf"config.json has {field}=3 but the weights hold 2 layers \(0-1\); missing: "
                                         r"every tensor of layer 2, e.g. '[^']*\b2\.[^']*'"):
        convert(tmp_path / "src")
    capsys.readouterr()  # what saving the source printed
    rc = cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and f"{field}=3" in err


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_claiming_fewer_layers_than_the_weights_hold_is_refused(kind, tmp_path):
    _saved(kind, tmp_path / "src")
    _set_layers(tmp_path / "src", kind, 1)
    field = LAYERS_FIELD.get(kind, "num_hidden_layers")
    with pytest.raises(ValueError, match=rf"config.json has {field}=1 but the weights hold 2 layers \(0-1\)"):
        convert(tmp_path / "src")


def test_a_head_the_source_lacks_is_reported_initialised_not_copied(tmp_path):
    """A ViT saved as an image classifier without its classifier tensors: the backbone converts,
    the classifier is new (initialised), and the report says so."""
    _saved("vit", tmp_path / "src")
    _rewrite_weights(tmp_path / "src", lambda state: [state.pop(k) for k in ("classifier.weight", "classifier.bias")])
    report = convert(tmp_path / "src").conversion_report
    assert {"classifier.weight", "classifier.bias"} <= set(report["initialised"])
    assert not {"classifier.weight", "classifier.bias"} & set(report["copied"])


def test_a_llama_without_its_lm_head_is_refused(tmp_path):
    """An untied Llama whose lm_head is missing: transformers would initialise it at random."""
    _saved("llama", tmp_path / "src")
    _rewrite_weights(tmp_path / "src", lambda state: state.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="checkpoint has no 'lm_head.weight'"):
        convert(tmp_path / "src")


# --- sharded weights ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_sharded_source_is_read_through_its_index_not_a_stale_single_file(kind, tmp_path, caplog):
    current = _saved(kind, tmp_path / "src", seed=0, max_shard_size="20KB")
    assert len(list((tmp_path / "src").glob("model-*-of-*.safetensors"))) > 1
    _saved(kind, tmp_path / "old", seed=1)
    shutil.copy2(tmp_path / "old" / "model.safetensors", tmp_path / "src" / "model.safetensors")  # stale
    with caplog.at_level("WARNING"):
        model = convert(tmp_path / "src")
    dst, src = EMBEDDING[kind]
    assert torch.equal(model.state_dict()[dst], current.state_dict()[src])
    assert "model.safetensors.index.json" in caplog.text and "ignor" in caplog.text
    # The index names a shard that is not there: refused naming it.
    next((tmp_path / "src").glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-\d+\.safetensors"):
        convert(tmp_path / "src")


@pytest.mark.parametrize("where", ["../outside/x.safetensors", "ABSOLUTE"])
def test_a_sharded_index_naming_a_file_outside_the_folder_is_refused(where, tmp_path, capsys):
    """The index names files of its own folder: a name that leaves it (``..``, absolute) is
    refused naming it, even when that file exists and holds the right tensors."""
    _saved("gpt2", tmp_path / "src", max_shard_size="20KB")
    index_path = tmp_path / "src" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "outside").mkdir()
    shutil.move(tmp_path / "src" / shard, tmp_path / "outside" / "x.safetensors")
    name = str(tmp_path / "outside" / "x.safetensors") if where == "ABSOLUTE" else where
    index["weight_map"] = {k: (name if f == shard else f) for k, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"weights index .* names '{name}', which leaves the folder"):
        convert(tmp_path / "src")
    capsys.readouterr()
    assert cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "leaves the folder" in err and not (tmp_path / "out").exists()


# --- where the result goes ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ("bert", "gpt2", "vit"))
def test_the_output_dir_is_never_the_source_and_other_files_are_not_overwritten_unasked(kind, tmp_path, capsys):
    _saved(kind, tmp_path / "src")
    source_files = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()}
    for out, what in ((tmp_path / "src", "is the source folder"), (tmp_path / "src" / "sub", "is inside the source"),
                      (tmp_path, "holds the source folder")):
        with pytest.raises(ValueError, match=f"output_dir .* {what}"):
            convert(tmp_path / "src", out, overwrite_output_dir=True)
    capsys.readouterr()
    assert cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "src")]) == 1
    assert "is the source folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()} == source_files
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match=r"already holds other files \('config.json'\).*overwrite_output_dir=True"):
        convert(tmp_path / "src", mine)
    assert cli_main(["-q", "convert", str(tmp_path / "src"), str(mine)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite_output_dir" in err
    assert json.loads((mine / "config.json").read_text()) == {"mine": True}
    assert cli_main(["-q", "convert", str(tmp_path / "src"), str(mine), "--overwrite_output_dir"]) == 0
    assert json.loads((mine / "config.json").read_text())["model_type"] != kind


# --- pickled weights -----------------------------------------------------------------------


def _pickle_only(kind: str, folder) -> None:
    """The same model with its weights in pytorch_model.bin (the file layout of safetensors)."""
    _saved(kind, folder)
    state = load_file(str(folder / "model.safetensors"))
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("kind", KINDS)
def test_pickled_weights_are_refused_unless_asked_for(kind, tmp_path, caplog, capsys):
    _pickle_only(kind, tmp_path / "src")

    with unpickling_forbidden():
        with pytest.raises(ValueError, match=r"only pickled weights \(pytorch_model.bin\).*allow_pickle=True"):
            convert(tmp_path / "src")
        capsys.readouterr()  # what saving the source printed
        rc = cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "--allow-pickle" in err
    with caplog.at_level("WARNING"):
        model = convert(tmp_path / "src", allow_pickle=True)
    # the warning model loading gives for pickled weights
    assert "the weights may be loaded from a pickle file (pytorch_model.bin)" in caplog.text
    assert "allow_pickle=True" in caplog.text and "trust" in caplog.text
    dst, src = EMBEDDING[kind]
    assert torch.equal(model.state_dict()[dst], _build(kind).state_dict()[src])
    assert cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out"), "--allow-pickle"]) == 0


# --- damaged files -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ("bert", "llama"))
def test_a_damaged_safetensors_file_is_one_error_line_naming_it(kind, tmp_path, capsys):
    _saved(kind, tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors"):
        convert(tmp_path / "src")
    capsys.readouterr()  # what saving the source printed
    rc = cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err and str(path) in err


def test_a_damaged_index_or_pickle_file_is_an_error_naming_it(tmp_path):
    _saved("gpt2", tmp_path / "sharded", max_shard_size="20KB")
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match=r"weights index '.*model.safetensors.index.json' must hold a JSON object"):
        convert(tmp_path / "sharded")
    _pickle_only("gpt2", tmp_path / "pickled")
    path = tmp_path / "pickled" / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"cannot read weights file '{path}'"):
        convert(tmp_path / "pickled", allow_pickle=True)


@pytest.mark.parametrize("text, what", [("{not json", "not valid JSON"), ("[1, 2]", "a JSON object")])
def test_a_malformed_config_is_one_error_line_naming_it(text, what, tmp_path, capsys):
    _saved("bert", tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(text)
    with pytest.raises(ValueError, match=what):
        convert(tmp_path / "src")
    capsys.readouterr()  # what saving the source printed
    rc = cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert str(tmp_path / "src" / "config.json") in err and what in err


# --- the command's help ------------------------------------------------------------------


def _convert_parser():
    from hf_kernattn import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    conv = sub.choices["convert"]
    conv.parse_known_args(["x", "y"])  # the lazy parser adds its arguments on first use
    return conv


def test_help_states_the_defaults_conversion_uses(tmp_path):
    """``--num-random-features``'s help quotes per source the number a conversion without the
    flag gives; every help sentence is whole and shows no markup."""
    import re

    conv = _convert_parser()
    helps = {a.dest: a.help for a in conv._actions}
    m = re.fullmatch(r"random features per attention head \(default: (\d+) for BERT and RoBERTa, (\d+) for GPT-2, "
                     r"Llama and ViT\)", helps["num_random_features"])
    assert m, helps["num_random_features"]
    for kind, stated in (("bert", m.group(1)), ("gpt2", m.group(2)), ("vit", m.group(2))):
        _saved(kind, tmp_path / kind)
        assert convert(tmp_path / kind).config.num_random_features == int(stated), kind
    assert re.search(r"\(default: (\w+)\)", helps["feature_map"]).group(1) == convert(tmp_path / "bert").config.feature_map
    texts = [conv.description] + [h for h in helps.values() if h]
    for text in texts:
        assert "``" not in text and ":func:" not in text, text
    assert conv.description.endswith(".") and "\n" not in conv.description
    assert "pytorch_model*.bin" in helps["allow_pickle"] and "trust" in helps["allow_pickle"]


def test_the_example_scripts_pass_allow_pickle_to_conversion(tmp_path):
    """run_mlm.py and run_glue.py convert a BERT source themselves: a pickle-only source is
    refused as by `convert`, and their --allow_pickle flag reads it."""
    from tests.tooling.test_examples_resume import load_script

    _pickle_only("bert", tmp_path / "pickled")
    src = str(tmp_path / "pickled")
    mlm, glue = load_script("run_mlm"), load_script("run_glue")
    base = ["--model_name_or_path", src, "--train_file", "x.txt", "--output_dir", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="allow_pickle"):
        mlm.build_model(mlm.parse_args(base), tokenizer=None)
    assert type(mlm.build_model(mlm.parse_args(base + ["--allow_pickle"]), tokenizer=None)).__name__ == "NPRFBertForMaskedLM"
    with pytest.raises(ValueError, match="allow_pickle"):
        glue.build_model(glue.ModelArguments(model_name_or_path=src), 2, False, None)
    model = glue.build_model(glue.ModelArguments(model_name_or_path=src, allow_pickle=True), 2, False, None)
    assert type(model).__name__ == "NPRFBertForSequenceClassification"
