"""Conversion and attention transfer with the sliding-window hybrid (``softmax_window``): a window
longer than the input reproduces the softmax source exactly, linearize trains the mixing weights
with the feature maps and records W in its card and report, the command line passes
``--softmax_window``, and the result decodes through ``generate()`` as without a cache."""

import json

import torch

from hf_kernattn.convert.linearize import linearize, select_trainable

from tests.tooling.test_linearize import V, source  # noqa: F401  (the module's fixture: a tiny GPT-2 and its text)


def test_converted_gpt2_with_a_window_beyond_the_input_is_the_softmax_source(source):  # noqa: F811
    from transformers import GPT2LMHeadModel

    from hf_kernattn.convert import convert

    folder, _ = source
    teacher = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").to(torch.float64).eval()
    student = convert(folder, None, softmax_window=64, attention_eps=0.0).to(torch.float64).eval()
    assert student.config.softmax_window == 64
    ids = torch.randint(2, V, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # the window holds every key and the mixing weights start at 1: exactly softmax attention
        # (with eps = 0; float64 rounding)
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-10, atol=1e-10)


def test_linearize_trains_the_mixing_weights_and_records_the_window(source, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    folder, text = source
    out = tmp_path / "out"
    model = linearize(folder, out, train_files=[str(text)], steps=3, batch_size=2, block_size=16, softmax_window=6,
                      learning_rate=5e-2, progress=False)
    trained = model.linearize_report["trained_parameters"]
    assert {n for n in trained if "log_weight" in n} == {
        f"transformer.h.{i}.attn.{w}" for i in range(2) for w in ("window_log_weight", "linear_log_weight")}
    assert all("feature_map" in n or "log_weight" in n for n in trained)
    assert not torch.equal(model.transformer.h[0].attn.window_log_weight, torch.zeros(4))  # it moved
    report = json.loads((out / "linearize_report.json").read_text())
    assert report["recipe"]["overrides"] == {"softmax_window": 6}
    assert "| softmax window | W = 6" in (out / "README.md").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.softmax_window == 6
    ids = torch.randint(2, V, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        cached = loaded.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        plain = loaded.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(cached, plain)
    # without the window nothing but the feature maps trains (unchanged)
    from hf_kernattn.convert import convert

    assert all("feature_map" in n for n in select_trainable(convert(folder, None, feature_map="hedgehog"), "feature_maps"))


def test_cli_passes_the_window(source, tmp_path):  # noqa: F811
    from hf_kernattn.cli import main

    folder, text = source
    out = tmp_path / "cli"
    assert main(["linearize", str(folder), str(out), "--train_file", str(text), "--steps", "1", "--batch_size", "1",
                 "--block_size", "8", "--softmax_window", "4"]) == 0
    assert json.loads((out / "config.json").read_text())["softmax_window"] == 4
    converted = tmp_path / "converted"
    assert main(["convert", str(folder), str(converted), "--softmax-window", "5"]) == 0
    assert json.loads((converted / "config.json").read_text())["softmax_window"] == 5
