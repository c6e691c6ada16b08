"""Exact resume of the example training scripts, atomic checkpoints, and no pickle on resume.

Each script runs three times in one process (or one process per rank under ``torchrun``): the
whole run, the same run stopped mid-way with ``--stop_after_steps`` (its checkpoint is where a
killed job would resume), and that run resumed with ``--resume_from_checkpoint latest``. The
uninterrupted runs are bitwise deterministic, so the resumed run must end with exactly the same
evaluation loss (compared with ``==``, no tolerance) and keep the evaluation history from before the
checkpoint. Models, data and tokenizers are tiny and built here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import unpickling_forbidden

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the quick brown fox jumps over a lazy dog and then runs far away".split()

# Runs main() of one example script three times and prints the results as JSON.
DRIVER = r'''
import importlib.util, json, os, shutil, sys
from pathlib import Path
script, common, out, plant = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
spec = importlib.util.spec_from_file_location("script_under_test", script)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
rank = int(os.environ.get("RANK", "0"))
from accelerate.state import AcceleratorState, PartialState

# The three runs share this process: keep its process group (end_training() would close it, and
# opening a new one in the same process is not reliable with gloo).
AcceleratorState.destroy_process_group = PartialState.destroy_process_group = lambda self, group=None: None


def main(extra):
    return mod.main(common + extra)


full = main(["--output_dir", str(out / "full")])
stopped = main(["--output_dir", str(out / "resumed"), "--stop_after_steps", "STOP"])
if plant and rank == 0:
    # A newer checkpoint half-written by a kill: it must be skipped by "latest".
    prefix = "checkpoint-" if "glue" in script else "step_"
    half = out / "resumed" / f"{prefix}999"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"truncated")
    (out / "resumed" / f"{prefix}1000.tmp").mkdir()
import torch.distributed as dist
if dist.is_available() and dist.is_initialized():
    dist.barrier()
resumed = main(["--output_dir", str(out / "resumed"), "--resume_from_checkpoint", "latest"])
if rank == 0:
    print("RESULTS " + json.dumps({"full": full, "stopped": stopped, "resumed": resumed}), flush=True)
# The process group kept above is closed last, before the interpreter exits (left to exit, a gloo
# worker thread can abort the finished process: tests/process_group_exit.py).
from tests.process_group_exit import end_process_group
end_process_group()
'''


def load_script(name: str):
    """Import examples/{name}.py (a task script) or examples/research/{name}.py (an experiment) as a module."""
    path = ROOT / "examples" / f"{name}.py"
    if not path.is_file():
        path = ROOT / "examples" / "research" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT), HF_DATASETS_CACHE=env.get("HF_DATASETS_CACHE", ""), WANDB_DISABLED="true")
    if not env["HF_DATASETS_CACHE"]:
        env.pop("HF_DATASETS_CACHE")
    return env


def write_text(path: Path, lines: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(lines)) + "\n")
    return path


def bert_tokenizer_dir(tmp: Path) -> Path:
    from transformers import BertTokenizer

    (tmp / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    BertTokenizer(str(tmp / "vocab.txt")).save_pretrained(str(tmp / "tok"))
    return tmp / "tok"


def tiny_nprf_classifier(tmp: Path) -> Path:
    import hf_kernattn
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(str(bert_tokenizer_dir(tmp)))
    config = hf_kernattn.NPRFBertConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_random_features=8, max_position_embeddings=64, num_labels=2)
    model = hf_kernattn.NPRFBertForSequenceClassification(config)
    model.save_pretrained(str(tmp / "nprf"))
    tok.save_pretrained(str(tmp / "nprf"))
    return tmp / "nprf"


def write_pairs_csv(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = ["sentence1,sentence2,label"] + [
        f"{' '.join(rng.choice(WORDS) for _ in range(4))},{' '.join(rng.choice(WORDS) for _ in range(3))},{rng.randint(0, 1)}"
        for _ in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return path


def image_folders(tmp: Path) -> tuple[Path, Path]:
    """Two tiny image folders (train: 12 images per class, validation: 4), two classes whose
    images differ in brightness, written as PNG files."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    dirs = []
    for split, count in (("train", 12), ("validation", 4)):
        for label, base in (("dark", 40), ("light", 200)):
            folder = tmp / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(base + rng.normal(0, 30, (12 + i % 3, 12, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels, mode="RGB").save(folder / f"{i}.png")
        dirs.append(tmp / "images" / split)
    return dirs[0], dirs[1]


def script_args(script: str, tmp: Path) -> tuple[list[str], int]:
    """Arguments of a tiny run crossing an epoch boundary after the stop, and the stop step."""
    if script == "run_clm":
        # 120 lines -> ~60 blocks of 32 bytes; 4 per batch and 2 accumulation steps: ~8 steps/epoch.
        return ["--train_file", str(write_text(tmp / "train.txt", 120, 0)),
                "--validation_file", str(write_text(tmp / "valid.txt", 30, 1)),
                "--hidden_size", "16", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "32",
                "--max_train_steps", "12", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                "--eval_steps", "3", "--checkpointing_steps", "100", "--cpu"], 5
    if script == "run_mlm":
        # Dropout 0.1 (the default) and random masking: both random streams must be restored.
        return ["--train_file", str(write_text(tmp / "train.txt", 120, 0)),
                "--validation_file", str(write_text(tmp / "valid.txt", 30, 1)),
                "--tokenizer_name", str(bert_tokenizer_dir(tmp)),
                "--config_overrides", "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32,"
                                      "num_random_features=8,max_position_embeddings=64",
                "--max_seq_length", "16", "--max_train_steps", "12", "--per_device_train_batch_size", "4",
                "--gradient_accumulation_steps", "2", "--eval_steps", "3", "--checkpointing_steps", "100", "--cpu",
                "--learning_rate", "1e-3", "--num_warmup_steps", "2"], 5
    if script == "run_image_classification":
        # 24 images, 4 per batch: 6 steps per epoch (3 with 2 processes); crop and flip draws.
        train, validation = image_folders(tmp)
        return ["--train_dir", str(train), "--validation_dir", str(validation),
                "--config_overrides", "image_size=8,patch_size=2,hidden_size=16,num_hidden_layers=1,num_attention_heads=2,"
                                      "intermediate_size=32,num_random_features=8,max_relative_position=3,"
                                      "hidden_dropout_prob=0.1",
                "--max_train_steps", "12", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                "--eval_steps", "3", "--checkpointing_steps", "100", "--cpu", "--learning_rate", "1e-3"], 5
    return ["--model_name_or_path", str(tiny_nprf_classifier(tmp)),
            "--train_file", str(write_pairs_csv(tmp / "train.csv", 40, 0)),
            "--validation_file", str(write_pairs_csv(tmp / "dev.csv", 16, 1)),
            "--do_train", "--do_eval", "--cpu", "--max_steps", "12", "--per_device_train_batch_size", "4",
            "--eval_strategy", "steps", "--eval_steps", "3", "--save_strategy", "steps", "--save_steps", "3",
            "--report_to", "none", "--disable_tqdm", "true", "--learning_rate", "1e-3", "--seed", "0"], 5


def run_three_times(script: str, tmp: Path, nproc: int, plant_half_written: bool = True) -> dict:
    args, stop = script_args(script, tmp)
    driver = tmp / "driver.py"
    driver.write_text(DRIVER.replace('"STOP"', f'"{stop}"'))
    cmd = [str(ROOT / "examples" / f"{script}.py"), json.dumps(args), str(tmp / "out"), "1" if plant_half_written else "0"]
    if nproc == 1:
        cmd = [sys.executable, str(driver)] + cmd
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(29500 + random.Random(os.getpid()).randrange(2000)), str(driver)] + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp), env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def eval_history(script: str, folder: Path) -> list:
    if script == "run_clm":
        return json.loads((folder / "eval_results.json").read_text())["history"]
    if script == "run_mlm":
        return json.loads((folder / "mlm_results.json").read_text())["history"]
    if script == "run_image_classification":
        return json.loads((folder / "eval_results.json").read_text())["history"]
    state = json.loads((folder / "trainer_state.json").read_text())
    return [{k: v for k, v in e.items() if not k.endswith(("runtime", "per_second"))}
            for e in state["log_history"] if "eval_loss" in e]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("script", ["run_clm", "run_mlm", "run_glue", "run_image_classification"])
def test_resume_is_exact(script, nproc, tmp_path):
    res = run_three_times(script, tmp_path, nproc)
    assert res["stopped"].get("stopped") is True, res["stopped"]
    full, resumed = res["full"], res["resumed"]
    # Bitwise: JSON keeps every float digit; no tolerance.
    assert resumed["eval_loss"] == full["eval_loss"], (full, resumed)
    out = tmp_path / "out"
    history_full, history_resumed = eval_history(script, out / "full"), eval_history(script, out / "resumed")
    assert len(history_full) >= 3 and history_resumed == history_full
    if script == "run_image_classification":
        # the final folder is Hub-ready: weights, config with auto_map, code, image processor, card
        from huggingface_hub import ModelCard

        folder = out / "full"
        files = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "config.json", "preprocessor_config.json", "README.md",
                "modeling_relative_performer_vit.py"} <= files
        assert "AutoModelForImageClassification" in json.loads((folder / "config.json").read_text())["auto_map"]
        (result,) = ModelCard.load(folder / "README.md").data.eval_results
        assert (result.task_type, result.metric_type, result.metric_value) == (
            "image-classification", "accuracy", full["eval_accuracy"])
    if script != "run_glue":
        # Our checkpoints: JSON and safetensors only, one random-state file per process.
        files = {p.name for p in (out / "resumed" / "step_5").iterdir()}
        assert {f"rng_state_{r}.safetensors" for r in range(nproc)} <= files
        assert all(name.endswith((".json", ".safetensors")) for name in files), files


# --------------------------------------------------------------------------------------------
# pickle payloads are never executed


class _Payload:
    """Unpickling this object writes a marker file (it runs code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def plant_payloads(folder: Path, marker: Path, names) -> None:
    import torch

    for name in names:
        with open(folder / name, "wb") as f:
            if name.endswith((".bin", ".pt", ".pth")):
                torch.save({"state": _Payload(str(marker))}, f)
            else:
                pickle.dump(_Payload(str(marker)), f)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["run_clm", "run_mlm"])
def test_resume_never_unpickles(script, tmp_path):
    """A crafted checkpoint holding pickles under every name accelerate and torch use: resuming
    reads only JSON and safetensors, so no payload runs, and the run still ends exactly."""
    mod = load_script(script)
    args, stop = script_args(script, tmp_path)
    full = mod.main(args + ["--output_dir", str(tmp_path / "full")])
    mod.main(args + ["--output_dir", str(tmp_path / "run"), "--stop_after_steps", str(stop)])
    marker = tmp_path / "PWNED"
    plant_payloads(tmp_path / "run" / f"step_{stop}", marker, [
        "custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin", "pytorch_model.bin",
        "sampler.bin", "dl_state_dict.bin", "scaler.pt"])
    # The payload works: unpickling it does write the marker (then remove it again).
    with open(tmp_path / "run" / f"step_{stop}" / "custom_checkpoint_0.pkl", "rb") as f:
        pickle.load(f)
    assert marker.exists()
    marker.unlink()
    resumed = mod.main(args + ["--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "latest"])
    assert not marker.exists(), "a pickle in the checkpoint was executed"
    assert resumed["eval_loss"] == full["eval_loss"]


def test_load_checkpoint_uses_no_pickle(tmp_path):
    """Round trip of a training state while pickle and torch.load are booby-trapped."""
    import numpy as np
    import torch
    from accelerate import Accelerator

    from hf_kernattn.training import load_checkpoint, save_checkpoint

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    gen = torch.Generator().manual_seed(5)
    gen_state = gen.get_state()
    np_state = np.random.get_state()
    path = save_checkpoint(acc, tmp_path, 1, model, opt, sched, "abc", {"lr": 0.1}, {"step": 1, "history": [1.5]},
                           {"masking": gen})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    torch.randn(10, generator=gen)
    np.random.rand(3)
    with torch.no_grad():
        model.weight.zero_()
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))

    with unpickling_forbidden("pickle used while loading a checkpoint"):
        progress = load_checkpoint(acc, path, model, opt2, sched2, {"masking": gen})
    assert progress == {"step": 1, "history": [1.5]}
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k])
    loaded = opt2.state_dict()
    assert loaded["param_groups"] == opt_state["param_groups"]
    assert isinstance(loaded["param_groups"][0]["betas"], tuple)
    for i, s in opt_state["state"].items():
        for k, v in s.items():
            assert torch.equal(loaded["state"][i][k], v)
    assert sched2.state_dict()["last_epoch"] == 1
    assert torch.equal(gen.get_state(), gen_state)
    restored = np.random.get_state()
    assert restored[0] == np_state[0] and np.array_equal(restored[1], np_state[1]) and restored[2:] == np_state[2:]


# --------------------------------------------------------------------------------------------
# which checkpoint "latest" picks


def test_latest_skips_half_written_and_refuses_other_runs(tmp_path):
    from hf_kernattn.training import resolve_checkpoint, write_state_file

    def checkpoint(name, fingerprint, complete=True):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        if complete:
            write_state_file(folder, fingerprint, {"learning_rate": 0.1 if fingerprint == "this" else 0.2})
        return folder

    assert resolve_checkpoint("latest", tmp_path, "this") is None  # nothing yet: start fresh
    older_run = checkpoint("step_8", "other")
    with pytest.raises(ValueError, match="other settings.*learning_rate"):
        resolve_checkpoint("latest", tmp_path, "this")
    mine = checkpoint("step_4", "this")
    checkpoint("step_12", "this", complete=False)       # killed while being written
    (tmp_path / "step_16.tmp").mkdir()                   # the temporary folder of a killed save
    (tmp_path / "step_20").mkdir()
    (tmp_path / "step_20" / "training_state.json").write_text('{"complete": tr')  # torn state file
    assert resolve_checkpoint("latest", tmp_path, "this") == mine
    with pytest.raises(ValueError, match="other settings"):
        resolve_checkpoint(str(older_run), tmp_path, "this")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_checkpoint(str(tmp_path / "step_12"), tmp_path, "this")
    assert resolve_checkpoint(str(mine), tmp_path, "this") == mine


def test_save_checkpoint_is_atomic(tmp_path, monkeypatch):
    """A save that dies half-way leaves only a temporary folder, which "latest" ignores."""
    import torch
    from accelerate import Accelerator

    from hf_kernattn.training import checkpoints as training

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    training.save_checkpoint(acc, tmp_path, 2, model, opt, sched, "fp", {}, {"step": 2})
    real = training.save_tree

    def dies_on_scheduler(folder, name, tree):
        if name == "scheduler":
            raise KeyboardInterrupt("killed")
        return real(folder, name, tree)

    monkeypatch.setattr(training, "save_tree", dies_on_scheduler)
    with pytest.raises(KeyboardInterrupt):
        training.save_checkpoint(acc, tmp_path, 4, model, opt, sched, "fp", {}, {"step": 4})
    assert not (tmp_path / "step_4").exists() and (tmp_path / "step_4.tmp").exists()
    assert training.resolve_checkpoint("latest", tmp_path, "fp") == tmp_path / "step_2"


@pytest.mark.slow
def test_run_clm_refuses_a_checkpoint_of_other_settings(tmp_path):
    mod = load_script("run_clm")
    args, stop = script_args("run_clm", tmp_path)
    mod.main(args + ["--output_dir", str(tmp_path / "run"), "--stop_after_steps", str(stop)])
    other = [a if a != "1e-3" else "5e-4" for a in args] + ["--learning_rate", "5e-4"]
    with pytest.raises(ValueError, match="other settings"):
        mod.main(other + ["--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "latest"])
