"""examples/research/linearize_compare.py at toy size: the four linearization recipes run end to end
on one teacher, write the JSON, the table and the plot, and the linear recipes decode with a state
that does not grow with the context."""

from __future__ import annotations

import json
import math

import pytest

from tests.tooling.test_examples_data import load_script

pytest.importorskip("peft")

CONTEXTS = (1024, 8192)
TOY = ["--block_size", "48", "--n_embd", "32", "--n_layer", "2", "--n_head", "2", "--gpt2_steps", "100",
       "--steps", "20", "--at_steps", "10", "--eval_steps", "10", "--max_eval_blocks", "6", "--batch_size", "8",
       "--learning_rate", "1e-2", "--finetune_learning_rate", "1e-3", "--num_random_features", "32",
       "--softmax_window", "8", "--contexts", *map(str, CONTEXTS), "--latency_tokens", "3", "--latency_rounds", "2"]


def _hybrid_available() -> bool:
    from hf_kernattn.modeling.configuration_linear_gpt import LinearGPTConfig

    return "softmax_window" in LinearGPTConfig().to_dict()


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    if not _hybrid_available():
        pytest.skip("recipe (d) needs the sliding-window hybrid (softmax_window)")
    tmp = tmp_path_factory.mktemp("linearize_compare")
    (tmp / "train.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300)))
    (tmp / "valid.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300, 360)))
    data = ["--train_file", str(tmp / "train.txt"), "--validation_file", str(tmp / "valid.txt")]
    script = load_script("linearize_compare")
    return script, tmp / "out", data, script.main(["--output_dir", str(tmp / "out"), *data, *TOY])


def test_every_recipe_and_the_files(toy_run):
    script, out, _, results = toy_run
    assert list(results["recipes"]) == ["a", "b", "c", "d"]
    teacher = results["teacher"]["loss"]
    for key, r in results["recipes"].items():
        assert math.isfinite(r["loss"]) and r["perplexity"] == math.exp(r["loss"]), key
        assert r["relative_to_teacher"] == r["loss"] / teacher - 1
        assert r["trainable_parameters"] > 0 and r["training_seconds"]["wall"] > 0 and r["training_seconds"]["cpu"] > 0
        assert tuple(r["curve"][0]) == (0, r["start_loss"])
    # one step budget: (a) fine-tunes for all 20 steps; (c), (d): 10 of attention transfer, 10 of LoRA
    assert results["recipes"]["a"]["steps"] == {"full fine-tuning": 20}
    assert results["recipes"]["c"]["steps"] == results["recipes"]["d"]["steps"] == {"attention transfer": 10, "LoRA": 10}
    assert results["recipes"]["a"]["start_loss"] == results["converted_prf_loss"]
    # what trains: hedgehog maps, per layer and head a query and a key matrix of head size x head size
    b, c = results["recipes"]["b"], results["recipes"]["c"]
    assert b["trainable_parameters"] == 2 * 2 * 2 * 16 * 16
    assert c["trainable_split"]["attention transfer"] == b["trainable_parameters"]
    assert c["trainable_parameters"] == b["trainable_parameters"] + c["trainable_split"]["LoRA"]
    assert c["curve"][:2] == b["curve"]  # (c) continues from (b)'s model
    # attention transfer improves on the identity-initialised map (measured 1.39 -> 1.20 nats/byte)
    assert b["loss"] < b["start_loss"] - 0.05

    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("| recipe |") and table[2].startswith("| teacher")
    for i, name in enumerate(script.RECIPES.values()):
        assert table[3 + i].startswith(f"| {name} |")
        assert f"{results['recipes'][name[1]]['loss']:.4f}" in table[3 + i]
    assert (out / "linearize_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for prefix in ("c", "d"):
        assert (out / f"{prefix}_lora_adapter" / "adapter_config.json").is_file()
        saved = json.loads((out / f"{prefix}_lora_merged" / "config.json").read_text())
        assert saved["model_type"] == "linear_gpt" and saved["feature_map"] == "hedgehog"
        assert saved.get("softmax_window") == (8 if prefix == "d" else None)
        assert (out / f"{prefix}_lora_merged" / "tokenizer.json").is_file()
        assert "base_model:" in (out / f"{prefix}_lora_merged" / "README.md").read_text()


def test_linear_states_do_not_grow(toy_run):
    """The decoding state of every linear recipe holds the same bytes after 1k and after 8k tokens
    of context; the teacher's key/value cache grows with the context (2 layers x keys and values x
    32 floats per token)."""
    _, _, _, results = toy_run
    for key, r in results["recipes"].items():
        sizes = r["decoding"]["state_bytes"]
        assert sizes[str(CONTEXTS[0])] == sizes[str(CONTEXTS[1])] > 0, key
    assert results["checks"]["linear_states_constant"]
    teacher = results["teacher"]["decoding"]["state_bytes"]
    assert [teacher[str(n)] for n in CONTEXTS] == [2 * 2 * 32 * 4 * n for n in CONTEXTS]
    for entry in [results["teacher"], *results["recipes"].values()]:
        per_token = entry["decoding"]["seconds_per_token"]
        assert all(per_token[k]["min"] <= per_token[k]["median"] <= per_token[k]["max"] for k in ("wall", "cpu"))
    assert "random rows" in results["decoding_setup"]["weights"]  # 48 trained positions, 8k + measured tokens needed


def test_merged_model_reloads_with_its_loss(toy_run):
    """The merged (c) and (d) models saved Hub-ready evaluate, reloaded, to the loss in the results."""
    from transformers import AutoModelForCausalLM

    script, out, data_args, results = toy_run
    args = script.parse_args(["--output_dir", str(out), *data_args, *TOY])
    data = script.fc.load_data(args, script.fc.build_tokenizer("byte", [], 0, args.block_size))
    for prefix in ("c", "d"):
        model = AutoModelForCausalLM.from_pretrained(out / f"{prefix}_lora_merged", trust_remote_code=True)
        loss = script.fc.evaluate(model.eval(), data.eval_set, out.parent / "eval", args)
        assert loss == pytest.approx(results["recipes"][prefix]["loss"], rel=1e-5), prefix


def test_linearized_window_model_with_merged_lora_generates_the_same_without_the_package(toy_run):
    """(d): attention transfer with a softmax window, LoRA merged, saved Hub-ready: in a process that
    cannot import hf_kernattn it gives the same logits and greedy tokens (and the same decoding state
    size) as in this one."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.remote import run_without_package

    _, out, _, _ = toy_run
    model = AutoModelForCausalLM.from_pretrained(out / "d_lora_merged", trust_remote_code=True).eval()
    assert model.config.softmax_window == 8
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
    with torch.no_grad():
        want = {"logits": model(ids, use_cache=False).logits.tolist(),
                "tokens": model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0).tolist()}
    code = f"""
import json, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained("d_lora_merged", trust_remote_code=True).eval()
assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
ids = torch.tensor({ids.tolist()})
with torch.no_grad():
    print(json.dumps({{"logits": m(ids, use_cache=False).logits.tolist(),
                      "tokens": m.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0).tolist()}}))
"""
    got = json.loads(run_without_package(code, cwd=str(out)).strip().splitlines()[-1])
    assert got == want


@pytest.mark.parametrize("argv, message", [
    (["--steps", "10", "--at_steps", "10"], "--at_steps"),
    (["--softmax_window", "0"], "--softmax_window"),
    (["--contexts", "0", "64"], "--contexts"),
    (["--contexts", "64", "64"], "--contexts"),
    (["--lora_r", "0"], "--lora_r"),
    (["--at_learning_rate", "0"], "--at_learning_rate"),
    (["--feature_map", "prf"], "--feature_map"),
])
def test_bad_arguments(argv, message, capsys):
    script = load_script("linearize_compare")
    with pytest.raises(SystemExit):
        script.parse_args(["--output_dir", "x", *argv])
    assert message in capsys.readouterr().err


def test_help_is_plain_text_in_whole_sentences(monkeypatch, capsys):
    import argparse

    from tests.tooling.test_cli import _check_help

    script = load_script("linearize_compare")
    seen = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help",
                        lambda self, file=None: (seen.append(self), print(self.format_help())))
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = capsys.readouterr().out
    _check_help(text, seen[0])
    assert "one text and one step budget." in " ".join(text.split())
