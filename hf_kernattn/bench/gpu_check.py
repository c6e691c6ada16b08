"""One prepared check on an accelerator (``bash scripts/gpu_check.sh``; at most 8 minutes).

1. The device tests (``tests/core/test_device.py``: every backend the device runs against the
   float64 formula, outputs and gradients; ``tests/models/test_device.py``: each family's
   training step against the CPU's, Linear GPT's ``generate()`` and state on the device), run by
   pytest with ``--device``.
2. Three side-by-side benchmarks through the ``hf-kernattn bench`` commands with ``--device``,
   at small settings: attention (the FFT and windowed paths with a relative-position bias against
   softmax with the bias and plain SDPA, N = 4k-64k), ``generate()`` (Linear GPT with its state
   against GPT-2 with a ``DynamicCache`` and a ``StaticCache``), and a training step of NPRF-BERT
   against ``BertModel`` with SDPA.
3. The ratios of the three, read from their CSVs.

Each step runs with its own time limit (:data:`STEPS`, 480 s in all); a step that fails or runs
out of time is reported and the next one runs. ``--dry-run`` prints the commands and limits and
runs nothing; without the accelerator (``--device``, default ``cuda``) it stops at once, saying so.
Exit status: 0 when every step succeeded, 1 otherwise, 2 when there is no accelerator.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# (name, seconds): the steps in order and the time each may take (480 s in all)
STEPS = (("tests", 150), ("attention", 110), ("generate", 130), ("encoder", 90))


def commands(device: str, out: Path, python: str = sys.executable) -> dict[str, list[str]]:
    """The command of each step (run from the repository root)."""
    bench = [python, "-m", "hf_kernattn.cli", "bench"]
    pytest = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        pytest += ["-n", "0"]
    return {
        "tests": pytest + ["--device", device, "tests/core/test_device.py", "tests/models/test_device.py"],
        "attention": bench + ["attention", "--device", device, "--out", str(out / "attention"), "--ns", "4096", "16384",
                              "65536", "--cases", "fft_rpe", "windowed_rpe", "softmax_rpe", "sdpa", "--rounds", "1",
                              "--repeats", "3", "--max-nn-gb", "40", "--timeout", "60"],
        # one context, one round; no stateless case (--max-nostate-context 1), no bound of the weights
        "generate": bench + ["generate", "--device", device, "--out", str(out / "generate"), "--contexts", "4096",
                             "--new-tokens", "32", "--max-nostate-context", "1", "--bound-context", "1",
                             "--rounds", "1", "--repeats", "2", "--extra-batch", "0", "--short-prompt", "128",
                             "--short-new", "32", "--throughput-batch", "8", "--throughput-len", "256",
                             "--continuation-clips", "64", "--continuation-tokens", "256", "--continuation-prompt",
                             "128"],
        "encoder": bench + ["encoder", "--device", device, "--out", str(out / "encoder"), "--quick", "--lengths",
                            "4096", "16384"],
    }


def _number(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _read(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def ratios(out: Path) -> list[str]:
    """The lines of ratios read from the benchmarks' CSVs under ``out`` (a missing CSV: one line
    saying so)."""
    lines = ["attention (time; peak memory), per N:"]
    rows = _read(out / "attention" / "attention_bench.csv")
    by = {(r["case"], int(r["n"])): r for r in rows}
    for n in sorted({int(r["n"]) for r in rows}):
        def t(case: str, key: str = "time_s") -> float:
            r = by.get((case, n))
            return _number(r[key]) if r and r.get("status") == "ok" else math.nan

        lines.append(f"  N={n:6d}: softmax+RPE / fft {t('softmax_rpe') / t('fft_rpe'):.2f}x "
                     f"({t('softmax_rpe', 'peak_mb') / t('fft_rpe', 'peak_mb'):.2f}x memory), "
                     f"softmax+RPE / windowed {t('softmax_rpe') / t('windowed_rpe'):.2f}x, "
                     f"SDPA without a bias / fft {t('sdpa') / t('fft_rpe'):.2f}x")
    if not rows:
        lines.append("  (no attention_bench.csv)")
    lines.append("generate() (wall time; GPT-2 / Linear GPT, above 1: Linear GPT faster):")
    summary = _read(out / "generate" / "generate_summary.csv")
    lines += [f"  {r['figure']}: {r['value']}" for r in summary
              if "GPT-2" in r["figure"] or "throughput" in r["figure"] or "continuation" in r["figure"]]
    if not summary:
        lines.append("  (no generate_summary.csv)")
    lines.append("NPRF-BERT against BertModel + SDPA (BertModel time / NPRF-BERT time; NPRF-BERT memory / BertModel's):")
    encoder = _read(out / "encoder" / "encoder.csv")
    for r in encoder:
        status = "" if r["bert_status"] == r["nprf_status"] == "ok" else f"  [{r['bert_status']}, {r['nprf_status']}]"
        lines.append(f"  N={int(r['n']):6d} {r['mode']:7s}: {r['speedup_per_round']} "
                     f"(memory {_number(r['memory_ratio']):.2f}x){status}")
    if not encoder:
        lines.append("  (no encoder.csv)")
    return lines


def accelerator_problem(device: str) -> Optional[str]:
    """None if torch can use ``device`` (an accelerator), else why not."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        return f"--device {device!r} is not a torch device ({err})"
    if dev.type == "cpu":
        return "--device cpu: this check is for an accelerator (the CPU runs the whole suite: bash scripts/run.sh test)"
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as err:
        return f"torch cannot use {device!r} here: {' '.join(str(err).split())[:200]}"
    return None


def _run(command: list[str], env: dict, seconds: float) -> object:
    """The command's exit status, or ``"timed out"`` after ``seconds`` (its whole process group
    stopped: the benchmarks measure in processes of their own)."""
    import signal

    proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timed out"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the accelerator (default cuda; e.g. cuda:1)")
    parser.add_argument("--out", default="bench_results/gpu_check", help="folder of the benchmarks' CSVs and plots")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and their time limits, run nothing")
    parser.add_argument("--only", nargs="+", choices=[name for name, _ in STEPS], default=None,
                        help="run only these steps")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).resolve()  # the steps run from the repository root
    steps = [(name, seconds) for name, seconds in STEPS if args.only is None or name in args.only]
    plan = commands(args.device, out)
    if args.dry_run:
        for name, seconds in steps:
            print(f"[{name}, at most {seconds} s] {' '.join(plan[name])}")
        return 0
    problem = accelerator_problem(args.device)
    if problem:
        print(f"gpu_check: {problem}; nothing was run", file=sys.stderr)
        return 2
    import torch

    dev = torch.device(args.device)
    backend = getattr(torch, dev.type, None)  # torch.cuda, torch.xpu, ...
    named = backend.get_device_name(dev) if hasattr(backend, "get_device_name") else str(dev)
    print(f"gpu_check: {dev} ({named}), torch {torch.__version__}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    failed = []
    start = time.perf_counter()
    for name, seconds in steps:
        print(f"\n=== {name} (at most {seconds} s) ===\n+ {' '.join(plan[name])}", flush=True)
        began = time.perf_counter()
        code = _run(plan[name], env, seconds)
        print(f"[{name}: {'ok' if code == 0 else f'failed ({code})'}, {time.perf_counter() - began:.0f} s]", flush=True)
        if code != 0:
            failed.append(name)
    print("\n=== ratios ===")
    print("\n".join(ratios(out)))
    print(f"\n{time.perf_counter() - start:.0f} s; " + (f"failed: {', '.join(failed)}" if failed else "every step passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
