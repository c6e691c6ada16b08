"""The example scripts' data checks, flags and outputs: bad files fail up front with the file,
line and problem named; GLUE's -1 "no label" is unlabeled; one weight-decay rule; documented,
switchable defaults; outputs where they belong."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tooling.test_examples_resume import (
    ROOT,
    bert_tokenizer_dir,
    load_script,
    tiny_nprf_classifier,
    write_pairs_csv,
    write_text,
)


@pytest.fixture(scope="module")
def glue():
    return load_script("run_glue")


def glue_args(model, tmp_path, train, dev, *extra):
    return ["--model_name_or_path", str(model), "--train_file", str(train), "--validation_file", str(dev),
            "--do_train", "--do_eval", "--cpu", "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(tmp_path / "out"), *extra]


# --------------------------------------------------------------------------------------------
# run_glue.py: bad files are refused before anything runs


def _csv(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "train_text, message",
    [
        ("", r"train\.csv: the file is empty"),
        ("sentence1,sentence2,label\n", r"train\.csv: only a header, no data rows"),
        ("sentence1,sentence2,label\na b,c d,1\na b,c d\n", r"train\.csv, line 3: 2 fields, but the header has 3"),
        ("sentence1,sentence2,label\na b,c d,1\na b,c d,\n", r"train\.csv, line 3: empty label"),
        ("sentence1,sentence2,label\na b,c d,1\na b,c d,-1\n", r"train\.csv, line 3: label -1 means 'no label'"),
        ("sentence1,sentence2,label\na b,,1\n", r"train\.csv, line 2: empty text in column 'sentence2'"),
        ("sentence1,sentence2,label\n\"a b,c d,1\n", r"train\.csv"),
        ("sentence1,label\na b,1\n", r"dev\.csv has the columns .*, but .*train\.csv has \['sentence1', 'label'\]"),
    ],
    ids=["empty", "header-only", "fields", "empty-label", "no-label", "empty-text", "quote", "columns"],
)
def test_glue_refuses_bad_csv(glue, tmp_path, train_text, message):
    train = _csv(tmp_path / "train.csv", train_text)
    dev = write_pairs_csv(tmp_path / "dev.csv", 4, 1)
    with pytest.raises(ValueError, match=message):
        glue.main(glue_args(tmp_path / "no-model-needed", tmp_path, train, dev))


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"sentence": "a b", "label": 1}\n{"sentence": "a b", "label": 1\n', r"train\.jsonl, line 2: not valid JSON"),
        ('{"sentence": "a b", "label": 1}\n{"sentence": "a b"}\n', r"train\.jsonl, line 2: fields \['sentence'\] differ"),
        ('{"sentence": "a b", "label": 1}\n{"sentence": "c", "label": null}\n', r"train\.jsonl, line 2: empty label"),
        ("\n\n", r"train\.jsonl: the file is empty"),
        ('[1, 2]', r"train\.jsonl, item 1: expected an object"),
    ],
    ids=["bad-json", "fields", "null-label", "blank", "not-objects"],
)
def test_glue_refuses_bad_json(glue, tmp_path, text, message):
    train = _csv(tmp_path / "train.jsonl", text)
    dev = _csv(tmp_path / "dev.jsonl", '{"sentence": "a b", "label": 1}\n{"sentence": "c d", "label": 0}\n')
    with pytest.raises(ValueError, match=message):
        glue.main(glue_args(tmp_path / "no-model-needed", tmp_path, train, dev))


@pytest.mark.slow
def test_glue_test_file_labelled_minus_one_is_unlabeled(glue, tmp_path):
    """GLUE test files carry label -1 ("no label"): no third class, predictions among the two real ones."""
    model = tiny_nprf_classifier(tmp_path)
    train, dev = write_pairs_csv(tmp_path / "train.csv", 16, 0), write_pairs_csv(tmp_path / "dev.csv", 8, 1)
    test = _csv(tmp_path / "test.csv", "sentence1,sentence2,label\n" + "the fox,a dog,-1\n" * 5)
    glue.main(glue_args(model, tmp_path, train, dev, "--test_file", str(test), "--do_predict"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert sorted(config["id2label"].values()) == ["0", "1"]
    lines = (tmp_path / "out" / "predict_results.txt").read_text().splitlines()
    assert len(lines) == 6 and all(line.split("\t")[1] in ("0", "1") for line in lines[1:])
    # The results JSON has each metric once, with a single prefix.
    results = json.loads((tmp_path / "out" / "run_glue_results.json").read_text())
    assert "train_runtime" in results and "eval_loss" in results
    assert not [k for k in results if k.startswith(("train_train_", "eval_eval_"))], sorted(results)


@pytest.mark.slow
def test_glue_best_model_loading_is_a_default_that_can_be_switched_off(glue, tmp_path):
    model = tiny_nprf_classifier(tmp_path)
    train, dev = write_pairs_csv(tmp_path / "train.csv", 16, 0), write_pairs_csv(tmp_path / "dev.csv", 8, 1)
    common = ["--eval_strategy", "steps", "--eval_steps", "1", "--save_strategy", "steps", "--save_steps", "1"]
    glue.main(glue_args(model, tmp_path / "on", train, dev, *common))
    glue.main(glue_args(model, tmp_path / "off", train, dev, *common, "--no_load_best_model_at_end",
                        "--early_stopping_patience", "0", "--mixed_precision", "no"))
    on = json.loads((tmp_path / "on" / "out" / "trainer_state.json").read_text())
    off = json.loads((tmp_path / "off" / "out" / "trainer_state.json").read_text())
    assert on["best_model_checkpoint"] is not None and on["best_metric"] is not None
    assert off["best_model_checkpoint"] is None
    assert "EarlyStoppingCallback" in on["stateful_callbacks"]
    assert "EarlyStoppingCallback" not in off["stateful_callbacks"]


def _help(script: str, capsys) -> str:
    with pytest.raises(SystemExit):
        load_script(script).main(["--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_documents_defaults_and_shared_flags(capsys):
    helps = {s: _help(s, capsys) for s in ("run_clm", "run_mlm", "run_glue")}
    glue_help = helps["run_glue"]
    for text in ("--no_load_best_model_at_end", "--early_stopping_patience", "0 switches early stopping off",
                 "--mixed_precision", "'no' switches mixed precision off", "--cpu"):
        assert text in glue_help, text
    shared = ["--lr_scheduler_type", "--resume_from_checkpoint", "--seed", "--cpu", "--output_dir", "--report_to",
              "--weight_decay", "--learning_rate", "--gradient_accumulation_steps", "--stop_after_steps"]
    for script, text in helps.items():
        # The Trainer's names where it has its own: --save_steps, --warmup_steps.
        for flag in shared + (["--with_tracking", "--num_warmup_steps", "--warmup_ratio", "--checkpointing_steps"]
                              if script != "run_glue" else ["--warmup_steps", "--save_steps"]):
            assert flag in text, (script, flag)
    for script in ("run_clm", "run_mlm"):
        assert "relative-position bias tables" in helps[script]


# --------------------------------------------------------------------------------------------
# run_mlm.py / run_clm.py data checks


@pytest.mark.parametrize("extra, message", [
    (["--max_seq_length", "2"], r"--max_seq_length must be >= 3"),
    (["--train_file", "EMPTY"], r"--train_file: .*empty\.txt holds no text"),
    (["--train_file", "MISSING"], r"--train_file: .*missing\.txt is not a file"),
])
def test_mlm_refuses_bad_data(tmp_path, extra, message, capsys):
    mlm = load_script("run_mlm")
    (tmp_path / "empty.txt").write_text("\n  \n")
    extra = [{"EMPTY": str(tmp_path / "empty.txt"), "MISSING": str(tmp_path / "missing.txt")}.get(a, a) for a in extra]
    args = ["--train_file", str(write_text(tmp_path / "train.txt", 10, 0)), "--tokenizer_name",
            str(bert_tokenizer_dir(tmp_path)), "--config_overrides", "hidden_size=16", "--output_dir",
            str(tmp_path / "out"), "--cpu"] + extra
    try:
        mlm.main(args)
    except SystemExit:  # argparse: the message is on stderr
        err = capsys.readouterr().err
        assert __import__("re").search(message, err), err
    except ValueError as err:
        assert __import__("re").search(message, str(err)), str(err)
    else:
        pytest.fail("bad data accepted")


@pytest.mark.slow
def test_clm_saves_tokenizer_once_with_a_max_length(tmp_path):
    clm = load_script("run_clm")
    out = tmp_path / "out"
    clm.main(["--train_file", str(write_text(tmp_path / "train.txt", 60, 0)), "--validation_file",
              str(write_text(tmp_path / "valid.txt", 20, 1)), "--hidden_size", "16", "--num_hidden_layers", "1",
              "--num_attention_heads", "2", "--block_size", "32", "--max_train_steps", "2", "--cpu",
              "--output_dir", str(out)])
    assert not (out / "tokenizer").exists(), "a stray tokenizer/ folder was left"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert tok_config["model_max_length"] == config["max_position_embeddings"] == 1024


def test_clm_config_overrides_set_any_config_field_of_a_model_from_scratch(tmp_path):
    """``--config_overrides`` reaches fields the flags do not (the sliding-window hybrid, Llama's
    norm and gated MLP, grouped-query attention): the saved model has them."""
    clm = load_script("run_clm")
    out = tmp_path / "out"
    clm.main(["--train_file", str(write_text(tmp_path / "train.txt", 40, 0)), "--hidden_size", "16",
              "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "32", "--max_train_steps", "1",
              "--config_overrides", "softmax_window=4,norm_type=rmsnorm,mlp_type=gated,num_key_value_heads=1,"
                                    "hidden_act=silu", "--cpu", "--output_dir", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert (config["softmax_window"], config["norm_type"], config["mlp_type"], config["num_key_value_heads"],
            config["hidden_act"], config["hidden_size"]) == (4, "rmsnorm", "gated", 1, "silu", 16)


@pytest.mark.parametrize("overrides, extra, message", [
    ("softmax_window=-1", [], r"--config_overrides: softmax_window must be None or an int >= 1, got -1"),
    ("norm_type=rms", [], r"--config_overrides: norm_type must be one of \['layernorm', 'rmsnorm'\], got 'rms'"),
    ("n_embd=10", [], r"--config_overrides: 'n_embd' is not a LinearGPTConfig field; the fields: hidden_size, "),
    ("vocab_size=10", [], r"--config_overrides: vocab_size is set from the tokenizer"),
    ("softmax_window", [], r"--config_overrides items must be key=value, got 'softmax_window'"),
    ("max_position_embeddings=16", [], r"max_position_embeddings=16 is less than --block_size=32"),
    ("softmax_window=4", ["--model_name_or_path", "somewhere"], r"cannot be combined with --model_name_or_path"),
])
def test_clm_refuses_bad_config_overrides_before_any_work(tmp_path, overrides, extra, message, capsys):
    clm = load_script("run_clm")
    with pytest.raises(SystemExit):
        clm.main(["--train_file", str(tmp_path / "none.txt"), "--block_size", "32", "--config_overrides", overrides,
                  "--cpu", "--output_dir", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# one weight-decay rule


def test_weight_decay_rule_is_shared_and_excludes_biases_norms_and_position_bias():
    import hf_kernattn
    from hf_kernattn.training import decay_parameter_names, optimizer_grouped_parameters

    gpt = hf_kernattn.LinearGPTForCausalLM(hf_kernattn.LinearGPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, rpe="learned"))
    llama_style = hf_kernattn.LinearGPTForCausalLM(hf_kernattn.LinearGPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, norm_type="rmsnorm",
        mlp_type="gated", rpe="learned"))
    bert = hf_kernattn.NPRFBertForMaskedLM(hf_kernattn.NPRFBertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    for model in (gpt, llama_style, bert):
        decay = set(decay_parameter_names(model))
        for name, p in model.named_parameters():
            no_decay = name.endswith("bias") or "norm" in name.lower() or ".ln_" in name or "rpe" in name
            assert (name not in decay) == no_decay, name
        groups = optimizer_grouped_parameters(model, 0.1)
        assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
        assert groups[1]["weight_decay"] == 0.0
        assert any(".rpe." in n for n, _ in model.named_parameters() if n not in decay)
    # Embeddings are decayed, as transformers does.
    assert "transformer.wte.weight" in decay_parameter_names(gpt)
    assert "nprf_bert.embeddings.word_embeddings.weight" in decay_parameter_names(bert)

    # The Trainer of run_glue.py uses the same rule.
    glue = load_script("run_glue")
    assert glue.NPRFBertTrainer.get_decay_parameter_names(None, bert) == decay_parameter_names(bert)


# --------------------------------------------------------------------------------------------
# research/copy_task.py keeps the committed figure


def test_copy_task_writes_to_outputs_by_default(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "research" / "copy_task.py"), "--steps", "2", "--log-every", "1", "--hidden", "8",
         "--heads", "2", "--layers", "1", "--min-len", "2", "--max-len", "3", "--symbols", "3"],
        capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr  # 1: not converged in 2 steps, as expected
    assert (tmp_path / "outputs" / "copy_task" / "copy_task.png").exists()
    assert (tmp_path / "outputs" / "copy_task" / "copy_task.csv").exists()
    assert not (tmp_path / "docs").exists(), "the committed figure folder was written"


def test_shift_robustness_small_run_writes_its_table_and_plot(tmp_path):
    """The shift experiment at toy size: every output is written, and with no positions at all
    (and mean pooling) a shift by a whole patch permutes identical background patches, so the
    accuracy is exactly the centred one."""
    import csv

    from tests.tooling.test_examples_resume import load_script

    mod = load_script("shift_robustness")
    rows = mod.main(["--output_dir", str(tmp_path), "--options", "none", "absolute", "--seeds", "1", "--epochs", "1",
                     "--hidden_size", "16", "--num_attention_heads", "2", "--num_random_features", "8",
                     "--canvas", "24", "--max_shift", "4", "--threads", "1"])
    acc = {(r["option"], r["shift"]): r["accuracy"] for r in rows}
    assert acc[("none", 4)] == acc[("none", 0)] == acc[("none", -4)]
    for name in ("shift_robustness.csv", "shift_robustness.png", "shift_robustness.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert len(list(csv.DictReader(open(tmp_path / "shift_robustness.csv")))) == 2 * 9


# --------------------------------------------------------------------------------------------
# run_glue.py (Trainer) under an FSDP or DeepSpeed launch on CPU


@pytest.mark.slow
@pytest.mark.parametrize("launch", [None, "ACCELERATE_USE_FSDP"])
def test_glue_says_when_an_fsdp_launch_trains_unsharded_on_cpu(glue, tmp_path, monkeypatch, caplog, launch):
    """accelerate's Trainer applies an FSDP or DeepSpeed launch configuration only on GPUs: on CPU
    processes the run is plain data parallel, and the script says so instead of keeping quiet."""
    if launch:
        monkeypatch.setenv(launch, "true")
    model = tiny_nprf_classifier(tmp_path)
    train, dev = write_pairs_csv(tmp_path / "train.csv", 8, 0), write_pairs_csv(tmp_path / "dev.csv", 4, 1)
    with caplog.at_level("WARNING"):
        glue.main(glue_args(model, tmp_path, train, dev, "--max_steps", "1"))
    said = [r.getMessage() for r in caplog.records if "was asked for" in r.getMessage()]
    if launch is None:
        assert not said
    else:
        assert said == ["FSDP was asked for, but the Trainer applies FSDP and DeepSpeed only on GPUs: these 1 cpu "
                        "process(es) train unsharded (plain DDP: each holds the whole model and optimizer). The "
                        "Accelerate scripts (run_mlm.py, run_clm.py, run_image_classification.py) shard on CPU too"]


# --------------------------------------------------------------------------------------------
# refusals as commands: one line, no traceback


@pytest.mark.parametrize("script, case, message", [
    ("run_glue", "fields", r"^run_glue\.py: error: .*train\.csv, line 3: 2 fields, but the header has 3"),
    ("run_glue", "missing", r"^run_glue\.py: error: .*nope\.csv: no such file$"),
    ("run_glue", "max_seq_length", r"^run_glue\.py: error: --max_seq_length must be >= 2, got 1$"),
    ("run_glue", "stop_after_steps", r"^run_glue\.py: error: --stop_after_steps must be an int >= 1, got 0$"),
    ("run_mlm", "empty", r"^run_mlm\.py: error: --train_file: .*empty\.txt holds no text"),
])
def test_data_errors_end_the_command_with_one_line(tmp_path, monkeypatch, capsys, script, case, message):
    from hf_kernattn.training import run_main

    mod = load_script(script)
    if script == "run_glue":
        train = _csv(tmp_path / "train.csv", "sentence1,sentence2,label\na b,c d,1\na b,c d\n")
        dev = write_pairs_csv(tmp_path / "dev.csv", 4, 1)
        argv = glue_args(tmp_path / "no-model-needed", tmp_path, tmp_path / "nope.csv" if case == "missing" else train,
                         dev, *({"max_seq_length": ["--max_seq_length", "1"],
                                 "stop_after_steps": ["--stop_after_steps", "0"]}.get(case, [])))
    else:
        (tmp_path / "empty.txt").write_text("\n \n")
        argv = ["--train_file", str(tmp_path / "empty.txt"), "--tokenizer_name", str(bert_tokenizer_dir(tmp_path)),
                "--config_overrides", "hidden_size=16", "--output_dir", str(tmp_path / "out"), "--cpu"]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_main(mod.main)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert __import__("re").search(message, line), line
