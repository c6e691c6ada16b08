"""Shared benchmark machinery: isolated measurements, CSV and plots.

Peak memory on a CPU cannot be read from torch's allocator, so every measurement runs in a
fresh subprocess: it builds its inputs, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), notes its resident memory, runs the workload once and reads the
peak resident set (``VmHWM``) minus that baseline; then it times ``repeats`` runs
(:func:`time_runs`, the one timing routine of every benchmark) and reports the median wall time
(``time_s``) and the median CPU time of the process over the same runs (``cpu_s``,
:func:`time.process_time`: every thread of the measured process, nothing of the others). On a
shared machine other processes stretch the wall time but hardly the CPU time, so every
benchmark reports a CPU-time ratio beside its wall-time ratio; the two agreeing says the machine
did not distort the comparison. (``ru_maxrss`` would not do: Linux carries it over ``exec`` from the parent, so it
never drops below the resident size of the process that launched the measurement.) On CUDA the allocator's own peak is used instead. A case that
fails (out of memory, killed, over its time limit) comes back as a row with ``status`` set,
so one run always produces a whole table.

A workload is named ``"package.module:function"``; the function takes keyword arguments and
returns a zero-argument callable that performs one run (inputs are built before it returns).

Every benchmark module (``hf-kernattn bench NAME``) has the same entry points: ``NAME``,
``add_arguments(parser)`` (its own flags after :func:`add_common_arguments`), ``build_parser()``
and ``run(args) -> int``, and the same common flags: ``--out`` (default ``bench_results/NAME``),
``--quick`` (a short subset), ``--threads`` (torch threads per measured process, default 1: a
figure taken with one thread holds on a busy machine) and ``--device``. The demo writes each
benchmark it runs into ``bench_results/demo/NAME``.

Comparisons alternate (:func:`alternate`): the compared cases run A B A B ... over several rounds,
each in a fresh process, and a ratio is reported per round and as median [min-max]
(:func:`format_spread`), the form the README quotes; :func:`ratio_spreads` gives the wall-time
and the CPU-time ratio side by side.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

_RUNNER = r"""
import gc, importlib, importlib.util, json, resource, sys
if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]  # not the working directory: PYTHONPATH (extra_path first) decides which code is measured
spec = json.loads(sys.argv[1])
# the timing helpers of this file, loaded by path (no package import: no transformers to import)
loader = importlib.util.spec_from_file_location("_bench_common", spec["common"])
common = importlib.util.module_from_spec(loader)
loader.loader.exec_module(common)
import torch
torch.set_num_threads(spec["threads"]) if spec["threads"] else None
mod_name, fn_name = spec["target"].split(":")
fn = getattr(importlib.import_module(mod_name), fn_name)(**spec["kwargs"])
cuda = spec["kwargs"].get("device", "cpu").startswith("cuda")
sync = torch.cuda.synchronize if cuda else None

def status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(key)

gc.collect()
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
else:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark to the current RSS
        base = status_bytes("VmRSS")
        use_hwm = True
    except OSError:  # not Linux: fall back to ru_maxrss (may include the setup)
        base, use_hwm = 0, False
fn()
if cuda:
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
elif use_hwm:
    peak = status_bytes("VmHWM") - base
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
timed = common.time_runs(fn, repeats=spec["repeats"], max_seconds=spec["max_seconds"], synchronize=sync)
print("RESULT " + json.dumps({**timed, "peak_mb": max(peak, 0) / 2**20}))
"""


RESULTS_DIR = "bench_results"
NAN = float("nan")


def time_runs(
    fn,
    *,
    repeats: int = 3,
    max_seconds: float = float("inf"),
    min_seconds: float = 0.0,
    synchronize=None,
) -> dict[str, Any]:
    """Time ``fn()`` (already warmed up) at least ``repeats`` times, and further until
    ``min_seconds`` have passed; stop early once ``max_seconds`` have passed (at least one run).

    Each run is timed on two clocks: the wall clock (:func:`time.perf_counter`) and the CPU time
    of this process (:func:`time.process_time`, all its threads). ``synchronize`` (e.g.
    ``torch.cuda.synchronize``) is called before and after each run. Returns ``{"time_s",
    "cpu_s"}`` (medians of the runs) and ``"runs"``, their count.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    walls: list[float] = []
    cpus: list[float] = []
    start = time.perf_counter()
    while True:
        if synchronize is not None:
            synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        if synchronize is not None:
            synchronize()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        elapsed = time.perf_counter() - start
        if elapsed > max_seconds or (len(walls) >= repeats and elapsed >= min_seconds):
            break
    return {"time_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "runs": len(walls)}


# glibc's malloc moves its mmap threshold up after large frees, so whether a large block comes
# back from the heap or from a fresh mapping (and the peak resident size a run reaches) varies
# between identical processes by tens of percent. A fixed threshold (every block from 128 KiB up
# mapped on allocation, unmapped on free) makes the peak that of the live tensors; it also makes
# large allocations slower, so a process measured this way is for its memory, not its time.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def add_common_arguments(parser: argparse.ArgumentParser, name: str, quick: str) -> None:
    """The flags every benchmark takes; ``quick`` says what ``--quick`` runs."""
    parser.add_argument("--out", default=f"{RESULTS_DIR}/{name}", help=f"folder for the CSV and PNG (default {RESULTS_DIR}/{name})")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per measured process (default 1: figures that hold on a shared machine)")
    parser.add_argument("--device", default="cpu", help="torch device of the measured models (default cpu)")


def add_model_size_arguments(parser: argparse.ArgumentParser, *, hidden: int, heads: int, intermediate: int,
                             features: int, features_help: str) -> None:
    """The size flags of the benchmarks that time whole models: ``--hidden``, ``--heads``,
    ``--intermediate``, ``--features`` and ``--batch``, with these defaults."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--features", type=int, default=features, help=features_help)
    parser.add_argument("--batch", type=int, default=1)


def hidden_state_step(net, inputs: dict[str, Any], backward: bool):
    """The timed step of a model returning ``last_hidden_state``: one forward pass without
    autograd, or (``backward``) forward and backward through the mean square of the last hidden
    state, the gradients dropped afterwards."""
    import torch

    if not backward:
        def run() -> None:
            with torch.no_grad():
                net(**inputs)
        return run

    def run() -> None:
        out = net(**inputs).last_hidden_state
        out.float().pow(2).mean().backward()
        net.zero_grad(set_to_none=True)
    return run


def build_parser(name: str, doc: str, add_arguments) -> argparse.ArgumentParser:
    """The stand-alone parser of benchmark ``name`` (``hf-kernattn bench NAME`` builds the same)."""
    parser = argparse.ArgumentParser(prog=f"hf-kernattn bench {name}", description=doc.strip().splitlines()[0])
    add_arguments(parser)
    return parser


def measure(
    target: str,
    kwargs: dict[str, Any],
    *,
    repeats: int = 3,
    timeout_s: float = 600.0,
    max_seconds: float = 60.0,
    threads: Optional[int] = None,
    extra_path: Sequence[str] = (),
    max_memory_gb: Optional[float] = None,
    extra_env: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Measure one workload in a fresh process.

    ``extra_path`` entries go first on the subprocess's ``PYTHONPATH`` (a workload may import
    a light module layout to keep process start-up short). ``max_memory_gb`` caps the address
    space of the process (``RLIMIT_AS``; where the platform has it), so a case that would take
    more memory fails with an out-of-memory status instead of crowding the machine; ``extra_env``
    sets environment variables of the subprocess (e.g. :data:`FIXED_MMAP_THRESHOLD`). Returns ``{"time_s", "cpu_s",
    "peak_mb", "runs", "status"}`` (wall and CPU time: :func:`time_runs`); ``status`` is ``"ok"``
    or why it failed (then times and memory are ``nan``).
    """
    spec = {"target": target, "kwargs": kwargs, "repeats": repeats, "max_seconds": max_seconds, "threads": threads,
            "common": str(Path(__file__).resolve())}
    env = {**os.environ, **(extra_env or {})}
    root = str(Path(__file__).resolve().parents[2])
    paths = [*extra_path, root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER, json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout_s, env=env,
            preexec_fn=_memory_cap(max_memory_gb),
        )
    except subprocess.TimeoutExpired:
        return {"time_s": NAN, "cpu_s": NAN, "peak_mb": NAN, "runs": 0, "status": f"timeout>{timeout_s:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            out["status"] = "ok"
            return out
    err = (proc.stderr.strip().splitlines() or ["killed (out of memory?)"])[-1]
    if proc.returncode < 0:
        err = f"killed by signal {-proc.returncode} (out of memory?)"
    elif max_memory_gb is not None and "allocate memory" in err:
        err = f"out of memory (over the cap of {max_memory_gb:g} GB): {err}"
    return {"time_s": NAN, "cpu_s": NAN, "peak_mb": NAN, "runs": 0, "status": f"failed: {err[:200]}"}


def _memory_cap(max_memory_gb: Optional[float]):
    """A ``preexec_fn`` limiting the child's address space to ``max_memory_gb`` (None: no cap, or
    no ``resource`` module on this platform)."""
    if max_memory_gb is None:
        return None
    if not max_memory_gb > 0:
        raise ValueError(f"max_memory_gb must be None or > 0, got {max_memory_gb!r}")
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    limit = int(max_memory_gb * 2**30)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return cap


def alternate(
    cases: Sequence[tuple],
    *,
    rounds: int,
    stop_failed: bool = False,
    progress: Optional[Callable[[str, int, dict[str, Any]], None]] = None,
    **measure_kwargs: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Measure every case once per round, each in a fresh process (:func:`measure`), the cases
    alternating: A B C in even rounds, C B A in odd ones, so a slow-down of the machine that lasts
    a while hits every case alike and a ratio taken within a round holds on a busy machine.

    ``cases``: ``(name, target, kwargs)`` or ``(name, target, kwargs, measure_overrides)``.
    ``stop_failed``: a case that failed (timed out, out of memory) is not run again in later
    rounds; its later results repeat the failure. ``progress(name, round, result)``: called after
    each measurement (e.g. to print it). Returns ``{name: [one result per round]}``.
    """
    results: dict[str, list[dict[str, Any]]] = {case[0]: [] for case in cases}
    for rnd in range(rounds):
        for case in (cases if rnd % 2 == 0 else list(reversed(cases))):
            name, target, kwargs = case[:3]
            failed = [r for r in results[name] if r["status"] != "ok"]
            if stop_failed and failed:
                results[name].append(dict(failed[0]))
                continue
            options = {**measure_kwargs, **(case[3] if len(case) > 3 else {})}
            results[name].append(measure(target, kwargs, **options))
            if progress is not None:
                progress(name, rnd, results[name][-1])
    return results


def per_round_ratios(num: Sequence[dict[str, Any]], den: Sequence[dict[str, Any]], key: str = "time_s") -> list[float]:
    """``num[r][key] / den[r][key]`` for every round ``r`` (two cases measured in the same rounds;
    ``nan`` where either lacks the value, e.g. ``cpu_s`` of a result measured without it)."""
    out = []
    for a, b in zip(num, den):
        x, y = a.get(key, NAN), b.get(key, NAN)
        out.append(x / y if y and x == x and y == y else NAN)
    return out


def ratio_spreads(num: Sequence[dict[str, Any]], den: Sequence[dict[str, Any]], digits: int = 2) -> tuple[str, str]:
    """The per-round ratio ``num / den`` as median [min-max] (:func:`format_spread`), of the wall
    time and of the CPU time: the two columns every benchmark's tables show side by side."""
    return (format_spread(per_round_ratios(num, den, "time_s"), digits=digits),
            format_spread(per_round_ratios(num, den, "cpu_s"), digits=digits))


def spread(values: Iterable[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of the finite values (NaNs when there are none)."""
    import statistics

    good = [v for v in values if v == v and v not in (float("inf"), float("-inf"))]
    if not good:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(good), min(good), max(good)


def format_spread(values: Iterable[float], unit: str = "x", digits: int = 2) -> str:
    """``"1.23x [1.10-1.40]"``: median [min-max] of ``values``."""
    med, lo, hi = spread(values)
    if med != med:
        return "nan"
    return f"{med:.{digits}f}{unit} [{lo:.{digits}f}-{hi:.{digits}f}]"


def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write ``rows`` (dicts with the same keys) to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Iterable[str]) -> str:
    """A Markdown table of ``columns`` (floats to 4 significant digits)."""
    columns = list(columns)

    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return "nan" if x != x else f"{x:.4g}"
        return str(x)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_series(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    path: str | os.PathLike,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = True,
    logy: bool = True,
    ax=None,
    colors: dict[str, str] | None = None,
) -> None:
    """Plot named ``(x, y)`` lines (NaNs skipped) to a PNG, or onto ``ax`` if given; ``colors``:
    a colour per name (so one case keeps its colour across panels), else matplotlib's cycle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y == y]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=(colors or {}).get(name))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if own:
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
