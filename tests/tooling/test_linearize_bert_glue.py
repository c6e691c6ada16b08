"""examples/research/linearize_bert_glue.py at toy size: the local sentence-pair task, a BERT
trained and fine-tuned here, today's conversion and attention transfer + LoRA, evaluated with
scikit-learn; the table and the JSON written; bad data refused before anything is written."""

from __future__ import annotations

import csv
import json

import pytest

from tests.tooling.test_examples_data import load_script

pytest.importorskip("peft")

TOY = ["--max_sentences", "400", "--vocab_size", "300", "--hidden_size", "32", "--num_layers", "2", "--num_heads", "2",
       "--max_seq_length", "48", "--mlm_steps", "4", "--finetune_steps", "4", "--transfer_steps", "4",
       "--batch_size", "8", "--lora_r", "2", "--max_train_samples", "64", "--max_eval_samples", "12"]


def test_local_task_end_to_end(tmp_path):
    script = load_script("linearize_bert_glue")
    out = tmp_path / "out"
    results = script.main(["--output_dir", str(out), *TOY, "--softmax_window", "4"])
    rows = results["rows"]
    assert [r["model"].split(" ")[0] for r in rows] == ["BERT", "(i)", "(i)", "(ii)", "(ii)", "(iii)", "(iii)"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["f1"] <= 1.0 for r in rows)
    assert rows[3]["trainable_parameters"] == 2 * 2 * 2 * 16 * 16  # layers x (query, key) x heads x d x m
    assert rows[5]["trainable_parameters"] == rows[3]["trainable_parameters"] + 2 * 2 * 2  # + mixing weights
    assert 0 < rows[4]["trainable_parameters"] < rows[2]["trainable_parameters"]  # LoRA + classifier only
    assert results["examples"] == {"train": 64, "validation": 12}
    assert json.loads((out / "results.json").read_text())["rows"] == rows
    table = (out / "results.md").read_text().splitlines()
    assert table[2].startswith("| model | trained |") and len(table) == 4 + len(rows) + 1
    assert script.render_table(results) == table
    assert f"{rows[4]['accuracy']:.4f}" in table[4 + 4] and "majority class" in table[-1]
    # the local task: GLUE-style CSV files, labels from the sentence's origin, validation documents apart
    with open(out / "data" / "train.csv", newline="") as f:
        train = list(csv.DictReader(f))
    with open(out / "data" / "validation.csv", newline="") as f:
        valid = list(csv.DictReader(f))
    assert {r["label"] for r in train} == {r["label"] for r in valid} == {"0", "1"}
    assert not {r["sentence"] for r in train} & {r["sentence"] for r in valid}
    # the models are saved Hub-ready; the attention-transferred ones with the recipe
    for name in ("teacher", "converted_finetuned", "linearized", "linearized_finetuned", "linearized_window4_finetuned"):
        assert (out / name / "config.json").is_file() and (out / name / "model.safetensors").is_file(), name
    report = json.loads((out / "linearized" / "linearize_report.json").read_text())
    assert report["recipe"]["text_column"] == "sentence" and report["recipe"]["line_by_line"]
    assert json.loads((out / "linearized_finetuned" / "config.json").read_text())["feature_map"] == "hedgehog"
    assert json.loads((out / "linearized_window4_finetuned" / "config.json").read_text())["softmax_window"] == 4


def test_local_pair_task(tmp_path):
    script = load_script("linearize_bert_glue")
    train_file, valid_file, text = script.write_local_task(tmp_path, "pairs", 400, seed=0)
    with open(train_file, newline="") as f:
        train = list(csv.DictReader(f))
    with open(valid_file, newline="") as f:
        valid = list(csv.DictReader(f))
    assert {r["label"] for r in train} == {"0", "1"} and len(text) == len(train)
    assert not {r["sentence1"] for r in train} & {r["sentence1"] for r in valid}
    for r in train:  # an edited copy keeps sentence 1's words in order but for the edits
        a, b = r["sentence1"].split(), r["sentence2"].split()
        assert len(b) == len(a) - 1 if r["label"] == "1" else True
    assert script.write_local_task(tmp_path / "again", "pairs", 400, seed=0)[2] == text


def test_bad_data_is_refused_before_anything_is_written(tmp_path):
    script = load_script("linearize_bert_glue")
    good = tmp_path / "good.csv"
    good.write_text("sentence1,sentence2,label\nw a,w b,1\nw c,w d,0\n")
    bad = tmp_path / "bad.csv"
    bad.write_text("sentence1,sentence2,label\nw a,w b\n")
    with pytest.raises(ValueError, match=r"bad\.csv, line 2: 2 fields, but the header has 3"):
        script.main(["--output_dir", str(tmp_path / "out"), "--train_file", str(bad), "--validation_file", str(good)])
    with pytest.raises(ValueError, match="no such file"):
        script.main(["--output_dir", str(tmp_path / "out"), "--train_file", str(good),
                     "--validation_file", str(tmp_path / "missing.csv")])
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="cannot convert model_type='gpt2'"):
        script.main(["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(gpt2)])
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        script.main(["--output_dir", str(tmp_path / "out"), "--train_file", str(good)])  # no validation file
    assert not (tmp_path / "out").exists()
