"""Every family trains under torch FSDP2 with two CPU processes (gloo) as a single process does,
and its gathered full state dict saves and reloads equal.

Two processes of ``tests/fsdp_worker.py`` (one launch for all families, on a free port of
127.0.0.1) shard each tiny model as transformers/accelerate do with FSDP2 (``fully_shard`` per
transformer layer, then the root), take 3 AdamW steps with each rank on its half of a fixed
batch, and compare with the same steps in one process. Both run in float64 and compute the same
per-half gradients; they differ only in how the two halves are added and halved (the sharded
run reduce-scatters, the single process accumulates): a few ulp (2^-52 relative). AdamW's update
``lr * m / (sqrt(v) + eps)`` changes by at most about ``lr * |dg| / eps`` for a gradient error
``dg``; with |g| <= ~10, lr = 1e-2 and eps = 1e-8 that is < 1e-6 per step in the worst case
(a gradient at the size of eps), far less for the rest. So the parameters are compared at
atol 1e-9 after 3 steps (in practice they come out bitwise equal) and must have moved by far
more (> 1e-3). The full state dict (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``) is saved with ``save_pretrained`` and must reload bitwise equal, with the
family's own modeling code in the folder (not torch's FSDP files).

The DeepSpeed and ``accelerate launch`` runs of the example scripts are slower and are checked by
hand (docs/training.md, "Sharded training").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["nprf_bert", "linear_gpt", "relative_performer_vit"]
MODELING = {"nprf_bert": "modeling_nprf_bert.py", "linear_gpt": "modeling_linear_gpt.py",
            "relative_performer_vit": "modeling_relative_performer_vit.py"}
TIMEOUT = 240  # seconds; the launch takes ~15 s on 2 shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    """Run the two ranks once for all families; rank 0's per-family results."""
    pytest.importorskip("torch.distributed.fsdp")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("fsdp")
    result_file = tmp / "results.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    procs = []
    for rank in range(2):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(ROOT / "tests" / "fsdp_worker.py"), str(result_file),
                                        str(tmp / "out"), *FAMILIES], cwd=ROOT, env=rank_env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=TIMEOUT) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = "\n".join(f"--- rank {r}\n" + (tmp / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0] and result_file.exists(), f"the FSDP2 ranks failed (exit codes {codes}):\n{logs}"
    return json.loads(result_file.read_text()), tmp / "out"


CASES = ["nprf_bert", "linear_gpt", "relative_performer_vit"]


@pytest.mark.parametrize("name", CASES)
def test_fsdp2_two_processes_train_as_one_and_full_state_dict_reloads_equal(fsdp_results, name):
    results, out = fsdp_results
    r = results[name]
    assert r["ok"], f"{name} failed under FSDP2: {r['error']}\n{r.get('traceback', '')}"
    assert r["keys_equal"], f"{name}: the gathered state dict has other keys than the model"
    assert r["max_change"] > 1e-3, f"{name}: training did not move the parameters ({r['max_change']})"
    assert r["max_param_diff"] <= 1e-9, f"{name}: sharded and single-process runs differ by {r['max_param_diff']}"
    for got, want in zip(r["losses"], r["ref_losses"]):
        # the loss is reduced in float32 by the loss function: compare at float32 precision
        assert got == pytest.approx(want, rel=1e-6), f"{name}: losses {r['losses']} != {r['ref_losses']}"
    assert not r["reload_missing"] and not r["reload_extra"], (r["reload_missing"], r["reload_extra"])
    assert not r["reload_mismatch"], f"{name}: reloaded tensors differ: {r['reload_mismatch']}"
    assert r["max_logit_diff"] == 0.0, f"{name}: the reloaded model's logits differ by {r['max_logit_diff']}"
    # the same tensors as the unsharded model saves (a tied weight gathered twice is saved once)
    assert not r["saved_keys_extra"] and not r["saved_keys_missing"], (r["saved_keys_extra"], r["saved_keys_missing"])
    files = set(r["files"])
    assert {"model.safetensors", "config.json", MODELING[name]} <= files, sorted(files)
    assert not any(f.startswith("_fsdp") for f in files), f"torch's FSDP code was copied: {sorted(files)}"
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files), sorted(files)
    auto_map = json.loads((out / name / "config.json").read_text())["auto_map"]
    assert all(not v.startswith("_fsdp") and "FSDP" not in v for v in auto_map.values()), auto_map


# --------------------------------------------------------------------------------------------
# the end of a worker's process group (tests/process_group_exit.py)

# One gloo process: an all_gather of tensors Python made, then end_process_group(); with "held",
# a reference to the group outlives destroy_process_group() (as torch's own caches do under FSDP2).
EXIT_WORKER = r'''
import sys, torch, torch.distributed as dist
from tests.process_group_exit import end_process_group, gloo_worker_threads
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
out = [torch.empty(3)]
dist.all_gather(out, torch.arange(3.0))
held = dist.group.WORLD if sys.argv[2] == "held" else None
print("threads before", gloo_worker_threads(), flush=True)
end_process_group()
print("threads after", gloo_worker_threads(), flush=True)
'''


@pytest.mark.parametrize("held", [False, True])
def test_end_process_group_ends_the_gloo_threads_or_the_process(held):
    """Destroyed, the group's gloo worker threads end before the interpreter exits (nothing of
    them is left to race with its finalization); when something still holds the group, the
    process ends right there with status 0, without finalizing the interpreter."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if not sys.platform.startswith("linux"):
        pytest.skip("threads are counted from /proc/self/task")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", EXIT_WORKER, f"tcp://127.0.0.1:{free_port()}", "held" if held else "-"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    before = [int(line.split()[-1]) for line in lines if line.startswith("threads before")]
    assert before and before[0] >= 1, proc.stdout  # the group's threads are found (torch starts 2)
    if held:
        assert not any(line.startswith("threads after") for line in lines), proc.stdout
    else:
        assert "threads after 0" in lines, proc.stdout


# --------------------------------------------------------------------------------------------
# the example scripts' Accelerator under a DeepSpeed launch (no DeepSpeed needed for these)


def _script_args(**overrides):
    from types import SimpleNamespace

    base = dict(mixed_precision=None, with_tracking=False, report_to="all", output_dir="out", cpu=True,
                gradient_accumulation_steps=1, checkpointing_steps=None, stop_after_steps=None,
                resume_from_checkpoint=None)
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("flag, value", [("stop_after_steps", 3), ("resume_from_checkpoint", "latest")])
def test_deepspeed_launch_refuses_resumable_checkpoint_flags_by_name(monkeypatch, flag, value):
    """Our checkpoints cannot hold DeepSpeed's partitioned optimizer: a run that would stop for a
    resume, or resume, is refused before anything is built, naming the flag."""
    from hf_kernattn.training import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=f"--{flag}: resumable checkpoints are not supported under DeepSpeed"):
        make_accelerator(_script_args(**{flag: value}))


def test_checkpoint_of_a_sharded_run_is_refused_by_an_unsharded_one_and_back(tmp_path):
    """An FSDP2 checkpoint holds gathered full states keyed by parameter name; a DDP/one-process
    checkpoint holds the optimizer's own state. Resuming one as the other is refused by name."""
    from types import SimpleNamespace

    from hf_kernattn.training import load_checkpoint, write_state_file

    for saved, now in (("fsdp2", False), ("none", True)):
        folder = tmp_path / saved
        folder.mkdir()
        write_state_file(folder, "f" * 16, {}, step=1, num_processes=2, sharding=saved, progress={})
        accelerator = SimpleNamespace(num_processes=2, is_fsdp2=now, process_index=0)
        with pytest.raises(ValueError, match=f"written with sharding '{saved}'"):
            load_checkpoint(accelerator, folder, model=None, optimizer=None, scheduler=None)


# --------------------------------------------------------------------------------------------
# an example script under `accelerate launch` with the FSDP2 configuration of the README


@pytest.mark.slow
def test_run_mlm_under_accelerate_fsdp2_on_cpu_shards_saves_and_resumes_exactly(tmp_path):
    """``accelerate launch --config_file examples/accelerate_configs/fsdp2.yaml examples/run_mlm.py
    --cpu`` (2 gloo processes): the model is really sharded (accelerate alone would fall back to
    DDP on CPU), the checkpoint holds the gathered full state and says so, resuming from it ends
    bitwise where the uninterrupted run ends, and the final folder reloads with the family's code."""
    pytest.importorskip("accelerate")
    from tests.tooling.test_examples_resume import DRIVER, _env, script_args

    args, stop = script_args("run_mlm", tmp_path)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.replace('"STOP"', f'"{stop}"'))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "examples" / "accelerate_configs" / "fsdp2.yaml"), "--main_process_port", str(free_port()),
           str(driver), str(ROOT / "examples" / "run_mlm.py"), json.dumps(args), str(tmp_path / "out"), "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))[len("RESULTS "):])
    assert res["stopped"].get("stopped") is True, res["stopped"]
    assert res["resumed"]["eval_loss"] == res["full"]["eval_loss"], res
    out = tmp_path / "out"
    state = json.loads((out / "resumed" / f"step_{stop}" / "training_state.json").read_text())
    assert state["sharding"] == "fsdp2" and state["num_processes"] == 2, state
    files = {p.name for p in (out / "full").iterdir()}
    assert {"model.safetensors", "config.json", "modeling_nprf_bert.py"} <= files and not any(
        f.startswith("_fsdp") for f in files), sorted(files)

    import safetensors.torch
    import torch

    from hf_kernattn import NPRFBertForMaskedLM

    saved = safetensors.torch.load_file(str(out / "full" / "model.safetensors"))
    model, info = NPRFBertForMaskedLM.from_pretrained(out / "full", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_run_clm_under_fsdp2_launch_flags_keeps_the_feature_maps_buffers(tmp_path):
    """``accelerate launch --use_fsdp --fsdp_version 2`` typed as flags takes accelerate's default
    ``fsdp_cpu_ram_efficient_loading=true``: the model goes to the meta device and the main
    process's state dict is broadcast into the shards. The feature maps' persistent buffers
    (projection, draw and step counters) come through it: the run trains sharded, and the
    checkpoint and the final model hold the buffers a redraw at every step gives (draw k of the
    seeded sequence after k steps), bitwise."""
    pytest.importorskip("accelerate")
    import safetensors.torch
    import torch

    from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM
    from tests.tooling.test_examples_resume import _env, write_text

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(ROOT / "examples" / "run_clm.py"), "--cpu",
           "--train_file", str(write_text(tmp_path / "train.txt", 40, 0)), "--hidden_size", "16",
           "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "32", "--feature_map", "prf",
           "--config_overrides", "num_random_features=8,feature_redraw_interval=1", "--max_train_steps", "2",
           "--per_device_train_batch_size", "2", "--checkpointing_steps", "1", "--output_dir", str(out)]
    env = {k: v for k, v in _env().items() if not k.startswith("FSDP_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads((out / "step_1" / "training_state.json").read_text())["sharding"] == "fsdp2"
    fresh = LinearGPTForCausalLM(LinearGPTConfig.from_pretrained(out)).transformer.h[0].attn.feature_map
    prefix = "transformer.h.0.attn.feature_map."
    for folder, steps in ((out / "step_1", 1), (out, 2)):
        saved = safetensors.torch.load_file(str(folder / "model.safetensors"))
        assert int(saved[prefix + "num_steps"]) == steps and int(saved[prefix + "num_draws"]) == steps, folder
        assert torch.equal(saved[prefix + "projection"], fresh._draw(steps)), folder
