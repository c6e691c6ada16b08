"""Checkpoints of the example scripts under damage and changed settings: a damaged newest
checkpoint is skipped for the newest intact one (and the run still ends bitwise where the
uninterrupted run ends), a named damaged checkpoint or changed settings stop with one line naming
the file or the settings, ``--stop_after_steps`` counts from where an invocation starts,
``--checkpoints_total_limit`` keeps that many, the Trainer script writes no pickle, threads are
set, and progress lines are never written onto the progress bar."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

from tests.conftest import unpickling_forbidden
from tests.tooling.test_examples_resume import ROOT, eval_history, load_script, script_args

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle")


def _training_logger():
    return hf_logging.get_logger("hf_kernattn.training")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _tiny_checkpoints(tmp_path, steps=(2, 4), fingerprint="fp", settings=None):
    from accelerate import Accelerator

    from hf_kernattn.training import save_checkpoint

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return [save_checkpoint(acc, tmp_path, s, model, opt, sched, fingerprint, settings or {"lr": 0.1}, {"step": s})
            for s in steps]


# --------------------------------------------------------------------------------------------
# damaged checkpoints (unit level)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_latest_skips_a_damaged_checkpoint_with_a_warning(tmp_path, damage):
    from hf_kernattn.training import resolve_checkpoint

    older, newest = _tiny_checkpoints(tmp_path)
    state = json.loads((newest / "training_state.json").read_text())
    target = newest / "model.safetensors"
    {"truncate": _truncate, "flip": _flip_last_byte, "delete": Path.unlink}[damage](target)
    with CaptureLogger(_training_logger()) as cl:
        assert resolve_checkpoint("latest", tmp_path, "fp") == older
    assert f"skipping the damaged checkpoint {newest}: model.safetensors" in cl.out
    assert "resuming from" in cl.out and str(older) in cl.out
    from hf_kernattn.training import CheckpointError, verify_checkpoint

    # every file is recorded with its size and SHA-256
    assert set(state["files"]) == {p.name for p in newest.iterdir()} - {"training_state.json"} | {"model.safetensors"}
    assert all(len(v["sha256"]) == 64 and v["size"] > 0 for v in state["files"].values())
    assert verify_checkpoint(older) == []
    # named explicitly: a one-line error naming the file
    with pytest.raises(CheckpointError, match=r"step_4 is damaged: model\.safetensors") as err:
        resolve_checkpoint(str(newest), tmp_path, "fp")
    assert "\n" not in str(err.value)
    # nothing intact left: refuse rather than start afresh over the run's checkpoints
    _truncate(older / "optimizer.safetensors")
    with pytest.raises(CheckpointError, match="every checkpoint of this run .* is damaged"):
        resolve_checkpoint("latest", tmp_path, "fp")


@pytest.mark.parametrize("listed", ["../outside.bin", "ABSOLUTE", "sub/../../outside.bin"])
def test_a_state_file_naming_a_file_outside_the_checkpoint_is_refused_without_opening_it(tmp_path, monkeypatch,
                                                                                         listed):
    """The checksums vouch for the checkpoint's own files: a state file listing an absolute or
    ``..`` name is a damaged checkpoint (skipped by "latest", refused by name), and the file it
    names is never statted or hashed."""
    from hf_kernattn.training import CheckpointError, checkpoints, resolve_checkpoint, verify_checkpoint

    older, newest = _tiny_checkpoints(tmp_path / "run")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the checkpoint's")
    listed = str(outside) if listed == "ABSOLUTE" else listed
    if listed.startswith("sub/"):
        (newest / "sub").mkdir()
    state = json.loads((newest / "training_state.json").read_text())
    state["files"][listed] = {"size": outside.stat().st_size, "sha256": checkpoints._sha256(outside)}
    (newest / "training_state.json").write_text(json.dumps(state))
    hashed, statted = [], []
    real_sha, real_stat = checkpoints._sha256, Path.stat
    monkeypatch.setattr(checkpoints, "_sha256", lambda path: hashed.append(Path(path)) or real_sha(path))
    monkeypatch.setattr(Path, "stat", lambda self, **kw: statted.append(self) or real_stat(self, **kw))
    problems = verify_checkpoint(newest)
    assert problems == [f"training_state.json lists {listed!r}, a name that leaves the checkpoint folder (only the "
                        "checkpoint's own files are checked and read)"]
    touched = {p.resolve() for p in hashed + statted}
    assert outside.resolve() not in touched and all(newest.resolve() in p.parents for p in touched), touched
    with CaptureLogger(_training_logger()) as cl:
        assert resolve_checkpoint("latest", tmp_path / "run", "fp") == older
    assert "leaves the checkpoint folder" in cl.out
    with pytest.raises(CheckpointError, match="step_4 is damaged: .*leaves the checkpoint folder"):
        resolve_checkpoint(str(newest), tmp_path / "run", "fp")


def test_checkpoints_without_checksums_get_header_checks(tmp_path):
    """A checkpoint written before sizes and checksums were recorded: a truncated safetensors file
    is still found from its header."""
    from hf_kernattn.training import resolve_checkpoint, verify_checkpoint

    older, newest = _tiny_checkpoints(tmp_path)
    for folder in (older, newest):
        state = json.loads((folder / "training_state.json").read_text())
        del state["files"]
        (folder / "training_state.json").write_text(json.dumps(state))
    assert verify_checkpoint(newest) == []
    _truncate(newest / "model.safetensors")
    assert "model.safetensors" in verify_checkpoint(newest)[0]
    assert resolve_checkpoint("latest", tmp_path, "fp") == older


def test_state_file_is_written_after_the_data_is_flushed(tmp_path, monkeypatch):
    """Every data file (and the folder) is fsynced before the state file marking the checkpoint
    complete is written."""
    from hf_kernattn.training import checkpoints as training

    events = []
    real_fsync, real_replace = training.os.fsync, training.os.replace

    def fsync(fd):
        events.append(("fsync", Path(f"/proc/self/fd/{fd}").resolve().name))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", Path(b).name))
        return real_replace(a, b)

    monkeypatch.setattr(training.os, "fsync", fsync)
    monkeypatch.setattr(training.os, "replace", replace)
    _tiny_checkpoints(tmp_path, steps=(2,))
    state_at = events.index(("replace", "training_state.json"))
    synced = {name for kind, name in events[:state_at] if kind == "fsync"}
    assert {"model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
            "rng_state_0.safetensors", "step_2.tmp"} <= synced


def test_prune_keeps_the_newest_checkpoints_of_this_run(tmp_path):
    from hf_kernattn.training import prune_checkpoints, write_state_file

    _tiny_checkpoints(tmp_path, steps=(2, 4, 6, 8))
    other = tmp_path / "step_1"
    other.mkdir()
    write_state_file(other, "another-run", {})
    (tmp_path / "step_10").mkdir()  # half-written: no state file
    removed = prune_checkpoints(tmp_path, 2, "fp")
    assert sorted(p.name for p in removed) == ["step_2", "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_10", "step_6", "step_8"]
    assert prune_checkpoints(tmp_path, None, "fp") == []


# --------------------------------------------------------------------------------------------
# changed settings


def test_changed_settings_are_named_old_to_new(tmp_path):
    from hf_kernattn.training import CheckpointError, resolve_checkpoint, run_fingerprint

    old = {"learning_rate": 0.001, "seed": 42, "data": {"train_file": "a.txt"}}
    (ckpt,) = _tiny_checkpoints(tmp_path, steps=(3,), fingerprint=run_fingerprint(old), settings=old)
    new = {"learning_rate": 0.0005, "seed": 42, "data": {"train_file": "b.txt"}, "block_size": 64}
    for spec in ("latest", str(ckpt)):
        with pytest.raises(CheckpointError) as err:
            resolve_checkpoint(spec, tmp_path, run_fingerprint(new), settings=new)
        message = str(err.value)
        assert "\n" not in message and "other settings" in message
        assert "block_size: (absent) -> 64" in message
        assert 'data.train_file: "a.txt" -> "b.txt"' in message
        assert "learning_rate: 0.001 -> 0.0005" in message
        assert "seed" not in message


def _run_as_command(mod, argv: list[str], monkeypatch, capsys) -> str:
    """Run a script as its ``__main__`` block does (``run_main(main)``, argv from the command line);
    returns what it wrote to stderr, asserting exit status 1."""
    from hf_kernattn.training import run_main

    monkeypatch.setattr(sys, "argv", ["run_clm.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_main(mod.main)
    assert exit_.value.code == 1
    return capsys.readouterr().err


@pytest.mark.parametrize("script", ["run_clm", "run_mlm", "run_image_classification", "run_glue"])
def test_scripts_run_main_through_the_one_line_error_handler(script):
    assert 'if __name__ == "__main__":\n    run_main(main)' in (ROOT / "examples" / f"{script}.py").read_text()


@pytest.mark.slow
def test_refusals_are_one_line_naming_the_setting_or_the_file(tmp_path, monkeypatch, capsys):
    mod = load_script("run_clm")
    args, _ = script_args("run_clm", tmp_path)
    out = ["--output_dir", str(tmp_path / "run")]
    mod.main(args + out + ["--stop_after_steps", "3"])
    other = [a if a != "32" else "16" for a in args]  # --block_size 32 -> 16
    err = _run_as_command(mod, other + out + ["--resume_from_checkpoint", "latest"], monkeypatch, capsys)
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith("run_clm.py: error: ") and "other settings (block_size: 32 -> 16)" in line
    _truncate(tmp_path / "run" / "step_3" / "model.safetensors")
    err = _run_as_command(mod, args + out + ["--resume_from_checkpoint", str(tmp_path / "run" / "step_3")],
                          monkeypatch, capsys)
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert "step_3 is damaged: model.safetensors has" in line


# --------------------------------------------------------------------------------------------
# whole scripts: fallback, --stop_after_steps per invocation, --checkpoints_total_limit


def _steps(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir() if p.name.startswith("step_")), key=lambda n: int(n[5:]))


@pytest.mark.slow
def test_clm_stop_after_steps_counts_per_invocation_and_falls_back_on_damage(tmp_path):
    mod = load_script("run_clm")
    args, _ = script_args("run_clm", tmp_path)
    full = mod.main(args + ["--output_dir", str(tmp_path / "full")])
    run = args + ["--output_dir", str(tmp_path / "run"), "--checkpointing_steps", "2"]
    first = mod.main(run + ["--stop_after_steps", "3"])
    assert first == {"step": 3, "stopped": True}
    # the same command again, resuming: the next 3 steps (not a stop at once)
    second = mod.main(run + ["--stop_after_steps", "3", "--resume_from_checkpoint", "latest"])
    assert second == {"step": 6, "stopped": True}
    assert _steps(tmp_path / "run") == ["step_2", "step_3", "step_4", "step_6"]
    _truncate(tmp_path / "run" / "step_6" / "model.safetensors")
    with CaptureLogger(_training_logger()) as cl:
        resumed = mod.main(run + ["--resume_from_checkpoint", "latest"])
    assert "skipping the damaged checkpoint" in cl.out and "step_6: model.safetensors" in cl.out
    assert resumed["eval_loss"] == full["eval_loss"]
    assert eval_history("run_clm", tmp_path / "run") == eval_history("run_clm", tmp_path / "full")


@pytest.mark.slow
@pytest.mark.parametrize("script, damage", [("run_mlm", ("optimizer.safetensors", _flip_last_byte)),
                                            ("run_image_classification", ("model.safetensors", _truncate))])
def test_fallback_on_damage_with_a_total_limit_ends_exactly(script, damage, tmp_path):
    mod = load_script(script)
    args, stop = script_args(script, tmp_path)
    full = mod.main(args + ["--output_dir", str(tmp_path / "full")])
    run = args + ["--output_dir", str(tmp_path / "run"), "--checkpointing_steps", "2", "--checkpoints_total_limit", "2"]
    mod.main(run + ["--stop_after_steps", str(stop)])
    assert _steps(tmp_path / "run") == ["step_4", f"step_{stop}"]  # step_2 deleted by the limit
    name, how = damage
    how(tmp_path / "run" / f"step_{stop}" / name)
    with CaptureLogger(_training_logger()) as cl:
        resumed = mod.main(run + ["--resume_from_checkpoint", "latest"])
    assert f"step_{stop}: {name}" in cl.out
    assert resumed["eval_loss"] == full["eval_loss"]
    assert eval_history(script, tmp_path / "run") == eval_history(script, tmp_path / "full")
    assert _steps(tmp_path / "run") == ["step_10", "step_12"]


# --------------------------------------------------------------------------------------------
# run_glue.py (Trainer): no pickle written or read, per-invocation stop, exact resume


@pytest.mark.slow
def test_glue_writes_no_pickle_and_resumes_exactly(tmp_path):
    mod = load_script("run_glue")
    args, _ = script_args("run_glue", tmp_path)
    args += ["--num_threads", "1"]
    full = mod.main(args + ["--output_dir", str(tmp_path / "full")])
    run = args + ["--output_dir", str(tmp_path / "run")]
    assert mod.main(run + ["--stop_after_steps", "4"]) == {"stopped": True, "step": 4}
    pickles = [p for p in (tmp_path / "run").rglob("*") if p.suffix in PICKLE_SUFFIXES]
    assert not pickles, pickles
    assert mod.main(run + ["--stop_after_steps", "4", "--resume_from_checkpoint", "latest"]) == \
        {"stopped": True, "step": 8}
    checkpoint = tmp_path / "run" / "checkpoint-8"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"optimizer.safetensors", "optimizer.json", "scheduler.json", "rng_state_0.safetensors",
            "training_args.json", "model.safetensors"} <= files

    with unpickling_forbidden("pickle used while resuming"), CaptureLogger(_training_logger()) as cl:
        resumed = mod.main(run + ["--resume_from_checkpoint", "latest"])
    assert "damaged" not in cl.out and "ignoring" not in cl.out, cl.out
    assert resumed["eval_loss"] == full["eval_loss"]
    from hf_kernattn.training import verify_checkpoint

    # the Trainer changes nothing in a checkpoint after it is marked complete
    remaining = sorted((tmp_path / "run").glob("checkpoint-*"))
    assert remaining and all(verify_checkpoint(c, mod.RUN_STATE_FILE) == [] for c in remaining)
    assert eval_history("run_glue", tmp_path / "run") == eval_history("run_glue", tmp_path / "full")
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.relative_to(tmp_path).parts[0] in ("full", "run")]
    assert written and not [p for p in written if p.suffix in PICKLE_SUFFIXES], written


# --------------------------------------------------------------------------------------------
# threads


def test_configure_threads(monkeypatch):
    import psutil

    from hf_kernattn.training import configure_threads

    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert configure_threads() == 3 and torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if not logical else 16)
        assert configure_threads(local_processes=2) == 4
        assert configure_threads(local_processes=16) == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert configure_threads() == 2
        for bad in (0, -1, 1.5, "2"):
            with pytest.raises(ValueError, match="num_threads"):
                configure_threads(bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("script", ["run_clm", "run_mlm", "run_image_classification"])
def test_accelerate_scripts_take_threads_and_a_checkpoint_limit(script, tmp_path, capsys):
    mod = load_script(script)
    args, _ = script_args(script, tmp_path)
    parsed = mod.parse_args(args + ["--output_dir", "o", "--num_threads", "1", "--checkpoints_total_limit", "3"])
    assert (parsed.num_threads, parsed.checkpoints_total_limit) == (1, 3)
    for flag in ("--num_threads", "--checkpoints_total_limit"):
        with pytest.raises(SystemExit):
            mod.parse_args(args + ["--output_dir", "o", flag, "0"])
        assert f"{flag} must be an int >= 1, got 0" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# progress lines above the progress bar


@pytest.mark.slow
def test_evaluation_lines_are_not_written_onto_the_progress_bar(tmp_path, monkeypatch):
    """stdout and stderr into one stream, as in a terminal: each evaluation's JSON starts its own
    line (the bar is cleared before it is written and drawn again after)."""
    mod = load_script("run_clm")
    args, _ = script_args("run_clm", tmp_path)
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)
    before = torch.get_num_threads()
    try:
        mod.main(args + ["--output_dir", str(tmp_path / "out"), "--num_threads", "2"])
        assert torch.get_num_threads() == 2  # --num_threads is applied
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    text = stream.getvalue()
    assert "threads per process: 2" in text
    assert "train:" in text  # the bar was drawn into this stream
    lines = [line for line in text.split("\n") if '{"eval_loss"' in line and "final {" not in line]
    assert len(lines) == 4
    for line in lines:
        assert line.split("\r")[-1].startswith('{"eval_loss"'), repr(line)


def test_an_unreadable_checkpoint_file_is_named(tmp_path):
    """Past the checks (say, damaged after it was chosen), reading a file still fails naming it."""
    from accelerate import Accelerator

    from hf_kernattn.training import load_checkpoint, load_tree

    (ckpt,) = _tiny_checkpoints(tmp_path, steps=(2,))
    _truncate(ckpt / "optimizer.safetensors")
    with pytest.raises(ValueError, match=r"cannot read .*step_2/optimizer\.safetensors"):
        load_tree(ckpt, "optimizer")
    _truncate(ckpt / "model.safetensors")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match=r"cannot read .*step_2/model\.safetensors"):
        load_checkpoint(Accelerator(cpu=True), ckpt, model, opt, sched)
