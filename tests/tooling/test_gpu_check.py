"""``scripts/gpu_check.sh`` (``hf_kernattn/bench/gpu_check.py``) as far as a machine without an
accelerator can check it: its plan fits 8 minutes, every command it would run parses with the
command's own parser and names files that exist, it refuses clearly without the accelerator, and
it reads the ratios from the benchmarks' CSVs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_kernattn_cli as cli
from hf_kernattn.bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_dry_run_prints_every_step_within_eight_minutes():
    run = _script("--dry-run", "--device", "cuda:1")
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert [line.split(",")[0][1:] for line in lines] == [name for name, _ in gpu_check.STEPS]
    assert sum(seconds for _, seconds in gpu_check.STEPS) <= 8 * 60
    assert all("--device cuda:1" in line for line in lines)


def test_every_command_parses_with_its_own_parser_and_names_existing_files(tmp_path):
    plan = gpu_check.commands("cuda", tmp_path)
    for name in ("attention", "generate", "encoder"):
        argv = plan[name]
        assert argv[1:4] == ["-m", "hf_kernattn.cli", "bench"] and argv[4] == name
        args = cli.build_parser().parse_args(argv[4 - 1:])  # "bench NAME ..." as the command line takes it
        assert args.device == "cuda" and Path(args.out) == tmp_path / name
    tests = [a for a in plan["tests"] if a.startswith("tests/")]
    assert tests and all((ROOT / t).is_file() for t in tests)
    assert "--device" in plan["tests"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_the_accelerator_it_stops_at_once_saying_so(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "_run", lambda *a: pytest.fail("a step ran without the accelerator"))
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "nothing was run" in err and "'cuda'" in err
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert "for an accelerator" in capsys.readouterr().err


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_the_ratios_are_read_from_the_benchmarks_csvs(tmp_path):
    times = {"fft_rpe": (0.01, 100.0), "windowed_rpe": (0.002, 50.0), "softmax_rpe": (0.05, 800.0), "sdpa": (0.02, 10.0)}
    _write(tmp_path / "attention" / "attention_bench.csv",
           [dict(case=c, n=4096, time_s=t, peak_mb=m, status="ok") for c, (t, m) in times.items()])
    _write(tmp_path / "generate" / "generate_summary.csv", [
        dict(figure="GPT-2 StaticCache / Linear GPT, ms per token, L=4096, batch 1", value="2.00x [1.90-2.10]", cpu_value=""),
        dict(figure="hybrid step (W=4) / plain step, L=4096, batch 1", value="1.40x [1.40-1.40]", cpu_value="")])
    _write(tmp_path / "encoder" / "encoder.csv", [
        dict(n=4096, mode="fwdbwd", speedup_per_round="1.50x [1.50-1.50]", memory_ratio=0.5, bert_status="ok",
             nprf_status="ok")])
    text = "\n".join(gpu_check.ratios(tmp_path))
    assert "softmax+RPE / fft 5.00x (8.00x memory), softmax+RPE / windowed 25.00x, SDPA without a bias / fft 2.00x" in text
    assert "GPT-2 StaticCache / Linear GPT, ms per token, L=4096, batch 1: 2.00x [1.90-2.10]" in text
    assert "hybrid" not in text
    assert "N=  4096 fwdbwd : 1.50x [1.50-1.50] (memory 0.50x)" in text
    missing = "\n".join(gpu_check.ratios(tmp_path / "nothing"))
    assert missing.count("(no ") == 3
