"""examples/finetune_converted.py at toy size: GPT-2 trained with Trainer, converted (weights
copied exactly), fine-tuned with Trainer, evaluated the same way at every stage, and generating
with a state that does not grow."""

from __future__ import annotations

import json
import math

from safetensors.torch import load_file

from tests.test_examples_data import load_script


def test_finetune_converted_runs_end_to_end(tmp_path):
    train = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
    valid = "".join(f"def g{i}(y):\n    return y - {i}\n\n" for i in range(60))
    (tmp_path / "train.txt").write_text(train)
    (tmp_path / "valid.txt").write_text(valid)
    out = tmp_path / "out"
    script = load_script("finetune_converted")
    results = script.main([
        "--output_dir", str(out), "--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "valid.txt"),
        "--block_size", "48", "--n_embd", "16", "--n_layer", "1", "--n_head", "2", "--gpt2_steps", "30",
        "--finetune_steps", "6", "--eval_steps", "10", "--max_eval_blocks", "6", "--generate_tokens", "5",
        "--num_random_features", "16", "--batch_size", "4", "--learning_rate", "3e-3"])
    losses = [s["loss"] for s in results["stages"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # 30 steps of GPT-2 on repetitive code already beat a uniform guess over 257 tokens (ln 257 = 5.55)
    assert losses[0] < math.log(257) - 0.5
    assert [p["perplexity"] for p in results["stages"]] == [math.exp(x) for x in losses]
    assert len(results["gpt2_curve"]) == 3 and len(results["finetune_curve"]) == 1
    # every GPT-2 tensor was copied (exactness per tensor: test_convert_gpt2), only features are new
    assert results["conversion"]["copied"] == 4 + 16 * 1
    assert all(".feature_map." in k for k in results["conversion"]["initialised"])
    # the state is the same size after 5 and 10 new tokens
    assert len(set(results["state_bytes"].values())) == 1
    table = (out / "results.md").read_text().splitlines()
    assert len(table) == 5 and "right after conversion" in table[3]
    assert (out / "finetune_converted.png").stat().st_size > 0
    saved = json.loads((out / "linear_gpt" / "config.json").read_text())
    assert saved["model_type"] == "linear_gpt" and saved["num_random_features"] == 16
    gpt2 = load_file(out / "gpt2" / "model.safetensors")
    assert gpt2["transformer.wte.weight"].shape == (257, 16)
    assert "base_model:" in (out / "linear_gpt" / "README.md").read_text()

