"""``linearize`` refuses before any work what would go wrong later or silently: an output folder
that is (or is inside, or holds) the source model, or holds the user's own files; run settings
the example scripts refuse too (one shared check); a block longer than the source's positions;
and a resume whose training text changed with the same length. Its output says what it means:
no tokenizer warning about lengths it cuts itself, per-layer losses to 4 significant digits."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hf_kernattn.convert.linearize import linearize, source_positions
from tests.tooling.test_linearize import V, _tokenizer

KW = dict(feature_map="elu", train="attention", steps=2, batch_size=2, block_size=8, progress=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny GPT-2 (64 positions) whose tokenizer states 64 as its longest input, and a text of
    3000 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=1,
                               eos_token_id=1)).save_pretrained(folder)
    tok = _tokenizer(folder)
    tok.model_max_length = 64
    tok.save_pretrained(folder)
    text = folder.parent / f"{folder.name}-train.txt"
    text.write_text(_words(3000, seed=1))
    return folder, text


def _words(n, seed):
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(2, V, (n,), generator=g))


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# the output folder


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_the_output_dir_is_never_the_source_nor_inside_it_nor_holding_it(source, where, tmp_path):
    folder, text = source
    before = _snapshot(folder.parent)
    out = {"same": folder, "inside": folder / "linear", "holding": folder.parent}[where]
    what = {"same": "is the source folder", "inside": "is inside the source folder",
            "holding": "holds the source folder"}[where]
    for overwrite in (False, True):  # no flag allows it
        with pytest.raises(ValueError, match=f"output_dir .* {what} .*would overwrite or mix with the source model"):
            linearize(folder, out, train_files=[str(text)], overwrite_output_dir=overwrite, **KW)
    assert _snapshot(folder.parent) == before
    # the same folder spelled otherwise (a relative path with "..") is the same folder
    with pytest.raises(ValueError, match="is the source folder"):
        linearize(folder, folder / ".." / folder.name, train_files=[str(text)], **KW)


def test_an_output_dir_holding_other_files_is_refused_unless_asked_to_overwrite(source, tmp_path, capsys):
    from hf_kernattn.cli import main

    folder, text = source
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"output_dir .*mine' already holds other files \('config.json', "
                                         r"'notes.txt'\).*overwrite_output_dir=True"):
        linearize(folder, out, train_files=[str(text)], **KW)
    args = ["-q", "linearize", str(folder), str(out), "--train_file", str(text), "--feature_map", "elu", "--train",
            "attention", "--steps", "2", "--batch_size", "2", "--block_size", "8"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite_output_dir" in err
    assert json.loads((out / "config.json").read_text()) == {"mine": True}
    # asked for: written into it (the result's config replaces the user's; other files stay)
    assert main(args + ["--overwrite_output_dir"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "linear_gpt"
    assert (out / "notes.txt").read_text() == "keep"


def test_its_own_checkpoints_and_earlier_result_are_not_other_files(source, tmp_path):
    """A stopped run resumes into its folder, and a finished one can run again there."""
    folder, text = source
    out = tmp_path / "run"
    kw = {**KW, "steps": 3, "checkpointing_steps": 1}
    assert getattr(linearize(folder, out, train_files=[str(text)], stop_after_steps=1, **kw), "linearize_report",
                   None) is None
    (out / "step_9.tmp").mkdir()  # a checkpoint half-written by a kill
    first = linearize(folder, out, train_files=[str(text)], resume_from_checkpoint="latest", **kw)
    assert (out / "linearize_report.json").is_file()
    again = linearize(folder, out, train_files=[str(text)], **kw)
    assert again.linearize_report["history"] == first.linearize_report["history"]


# --------------------------------------------------------------------------------------------
# settings


@pytest.mark.parametrize("name, value, message", [
    ("checkpoints_total_limit", 0, "checkpoints_total_limit must be an int >= 1, got 0"),
    ("checkpoints_total_limit", -1, "checkpoints_total_limit must be an int >= 1, got -1"),
    ("stop_after_steps", 0, "stop_after_steps must be an int >= 1, got 0"),
    ("stop_after_steps", -1, "stop_after_steps must be an int >= 1, got -1"),
    ("checkpointing_steps", -2, "checkpointing_steps must be an int >= 1, got -2"),
    ("checkpointing_steps", 0, "checkpointing_steps must be an int >= 1, got 0"),
    ("checkpointing_steps", "epoch", "checkpointing_steps must be an int >= 1, got 'epoch'"),
    ("learning_rate", float("inf"), "learning_rate must be a finite number > 0, got inf"),
    ("learning_rate", float("nan"), "learning_rate must be a finite number > 0, got nan"),
    ("learning_rate", 0.0, "learning_rate must be a finite number > 0, got 0.0"),
    ("warmup_steps", -1, "warmup_steps must be an int >= 0, got -1"),
    ("warmup_steps", 1.5, "warmup_steps must be an int >= 0, got 1.5"),
])
def test_run_settings_are_refused_before_any_work(source, tmp_path, name, value, message):
    folder, text = source
    with pytest.raises(ValueError, match=re.escape(message)):
        linearize(folder, tmp_path / "out", train_files=[str(text)], **{**KW, name: value})
    assert not any(tmp_path.iterdir())


def test_the_example_scripts_refuse_the_same_values_through_the_same_check(tmp_path, capsys):
    """One check for both: the scripts' flags are refused with the same words (and ``epoch``)."""
    from hf_kernattn.training import check_training_values
    from tests.tooling.test_examples_resume import load_script, script_args

    clm = load_script("run_clm")
    args, _ = script_args("run_clm", tmp_path)
    for flag, value, message in (("--learning_rate", "inf", "a finite number > 0, got inf"),
                                 ("--checkpoints_total_limit", "-1", "an int >= 1, got -1"),
                                 ("--stop_after_steps", "0", "an int >= 1, got 0"),
                                 ("--checkpointing_steps", "-2", "a positive integer or 'epoch', got '-2'"),
                                 ("--num_warmup_steps", "-1", "an int >= 0, got -1"),
                                 ("--max_grad_norm", "-1", "a finite number >= 0 (0: no clipping), got -1.0")):
        with pytest.raises(SystemExit):
            clm.parse_args(args + ["--output_dir", str(tmp_path / "o"), flag, value])
        assert f"{flag} must be {message}" in capsys.readouterr().err
    assert clm.parse_args(args + ["--output_dir", "o", "--checkpointing_steps", "epoch"]).checkpointing_steps == "epoch"
    with pytest.raises(ValueError, match="give warmup_steps or warmup_ratio, not both"):
        check_training_values({"num_warmup_steps": 1, "warmup_ratio": 0.1}, {"num_warmup_steps": "warmup_steps"})


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "gpt2", "n_positions": 64}, 64),
    ({"model_type": "llama", "max_position_embeddings": 96}, 96),
    ({"model_type": "bert", "max_position_embeddings": 40}, 40),
    ({"model_type": "roberta", "max_position_embeddings": 42, "pad_token_id": 1}, 40),
])
def test_source_positions_are_the_longest_input_the_source_takes(config, expected):
    assert source_positions(config)[0] == expected
    if config["model_type"] == "roberta":  # positions start after the padding index: 40 fit, 41 do not
        from transformers import RobertaConfig, RobertaModel

        model = RobertaModel(RobertaConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=16, max_position_embeddings=42, pad_token_id=1)).eval()
        with torch.no_grad():
            model(torch.full((1, expected), 5))
            with pytest.raises((IndexError, RuntimeError)):  # (an out-of-range position index)
                model(torch.full((1, expected + 1), 5))


def test_a_block_longer_than_the_sources_positions_is_refused_before_any_work(source, tmp_path, capsys):
    from hf_kernattn.cli import main

    folder, text = source
    with pytest.raises(ValueError, match=r"block_size=65 is more than the source's 64 positions \(n_positions"):
        linearize(folder, tmp_path / "out", train_files=[str(text)], **{**KW, "block_size": 65})
    assert main(["-q", "linearize", str(folder), str(tmp_path / "out"), "--train_file", str(text), "--block_size",
                 "65"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "block_size=65" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())
    # the longest block the source takes works
    linearize(folder, tmp_path / "out", train_files=[str(text)], **{**KW, "block_size": 64})


def test_resuming_after_the_text_changed_with_the_same_length_is_refused(source, tmp_path):
    folder, text = source
    mine = tmp_path / "train.txt"
    mine.write_text(text.read_text())
    kw = {**KW, "steps": 3, "checkpointing_steps": 1}
    linearize(folder, tmp_path / "out", train_files=[str(mine)], stop_after_steps=1, **kw)
    words = mine.read_text().split()
    words[0], words[1] = words[1], words[0]  # the same tokens, counts and blocks; other contents
    assert words != mine.read_text().split()
    mine.write_text(" ".join(words))
    with pytest.raises(ValueError, match="other settings .*data_sha256"):
        linearize(folder, tmp_path / "out", train_files=[str(mine)], resume_from_checkpoint="latest", **kw)


# --------------------------------------------------------------------------------------------
# what it prints


def test_no_tokenizer_length_warning_and_losses_to_four_digits(source, tmp_path, capfd):
    from hf_kernattn.cli import main

    folder, text = source
    assert main(["linearize", str(folder), str(tmp_path / "out"), "--train_file", str(text), "--feature_map", "elu",
                 "--train", "attention", "--steps", "2", "--batch_size", "2", "--block_size", "8"]) == 0
    out, err = capfd.readouterr()
    assert "indexing errors" not in err and "longer than the specified maximum" not in err, err
    line = next(x for x in out.splitlines() if x.startswith("attention transfer:"))
    numbers = re.findall(r"\d[\d.e+-]*", line.split(":", 1)[1])
    assert len(numbers) == 2 * 2 + 2, line  # two layers before and after, and the two means
    assert all(len(re.sub(r"e.*|\D", "", n).lstrip("0")) <= 4 for n in numbers), line
    report = json.loads((tmp_path / "out" / "linearize_report.json").read_text())
    assert line == (f"attention transfer: per-layer loss {', '.join(f'{x:.4g}' for x in report['layer_loss_before'])}"
                    f" -> {', '.join(f'{x:.4g}' for x in report['layer_loss_after'])} (mean "
                    f"{sum(report['layer_loss_before']) / 2:.4g} -> {sum(report['layer_loss_after']) / 2:.4g})")
