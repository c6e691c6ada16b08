"""Measure the crossovers of the attention backends on this machine: the table ``backend="auto"`` ranks by.

For every kind of call ``auto`` tells apart (forward / forward+backward; no bias, a 1D bias, a 2D
bias on a square grid; a bias clipped at K or not; causal or not) and every N of a grid, each
registered backend that can run the call (and the float64 variant of an approximate one, e.g.
``fft@float64``: what ``auto`` runs when the float32 error bound fails) is timed through
``kernelized_attention`` on feature-mapped inputs ``q, k (1, H, N, M)`` (positive, as after a
PRF/elu map), ``v (1, H, N, D)``. The candidates of one N alternate over ``--rounds`` rounds
(A B C, C B A, ...); each kind of call runs in a fresh process with ``--threads`` threads (default
1). Every timing records wall and CPU time; the ranking follows the median CPU time over rounds
(with one thread the time a call takes on an idle machine, which a shared machine's load does
not lengthen). Each candidate's first call is a warm-up, not counted, unless it took more than
:data:`WARM_UP_COUNTS_FROM` CPU seconds (then it is the first round's timing).

What bounds a full run (about 15 minutes on one thread of a 2-core CPU): a backend that would
hold a ``B H N^2`` matrix of more than ``--max-nn-mb`` is skipped (one whose declared
``complexity`` grows with N^2, except the built-in ``dense``, which holds one only where it runs
unblocked: small forward+backward calls; it works in blocks of queries otherwise); a backend is no longer timed at larger N once one call took more
than ``--max-call-seconds`` of CPU time, or once it was ``--prune``-times slower than the fastest at two consecutive N (from N = 2048)
while growing at least as fast (never a backend cheaper in N than a fastest whose cost grows with N^2); a float64 variant is timed only while an exact
backend is (otherwise it simply ranks after the same backend in float32). Backends not timed at
an N keep the order of the previous N, after the timed ones (those whose cost grows with N^2 last).
Time limits count CPU time, so a busy machine does not cut the grid short.

Writes ``auto_table.json`` (load it with ``hf_kernattn.load_auto_table(path)`` or the
``HF_KERNATTN_AUTO_TABLE`` environment variable), ``calibrate.csv`` (every timing) and, with
``--ship``, the table shipped with the package (``hf_kernattn/modeling/auto_table.py``).

``--check`` instead times ``backend="auto"`` (with the active table: the shipped one, or
``--table PATH``) against every backend that meets the accuracy target on the same inputs (an
approximate backend only where its error bound in the dtype it runs in is at most 1e-4) over
the same grid (a float64 variant not where the backend meets the target in float32: it cannot be
the fastest), alternated as above, and reports per grid point auto's CPU time / the fastest
accurate backend's (the fastest by median CPU time), per round median [min-max], with wall-time
ratios beside, and the backend auto ran (``auto_runs``; ``check.csv``, ``check_summary.csv``).
A backend more than ``--check-drop`` times slower than the fastest in the first round cannot be
the fastest and is not timed again at that point; one 10 times slower at two N, its cost growing at least as fast (and not slower in N than
a quadratic fastest), is not timed at larger N. A point above ``--check-limit`` (1.15x) is measured again in a fresh process
(``--rounds-again`` rounds) before it counts as above: both measurements are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import pprint
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

NAME = "calibrate"
MODES = ("fwd", "fwdbwd")
FULL_NS = tuple(2 ** i for i in range(6, 17))  # 64 .. 65536
FULL_SIDES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # 2D grids side x side: 64 .. 65536 tokens
QUICK_NS = (64, 256, 1024)
QUICK_SIDES = (8, 16, 32)
FULL_CLIPS_1D = (64, 512)
FULL_CLIPS_2D = (16,)
CHECK = "auto"
CHECK_LIMIT = 1.15  # auto / the fastest accurate backend a check point may reach
CHECK_PRUNE = 10.0  # --check: a backend this many times slower than the fastest at two N (from 2048), growing as fast, is not timed further
PRUNE_FROM_N = 2048  # below, timings of a few milliseconds are too noisy to stop timing a backend on
# A warm-up call that took more CPU seconds than this is the first round's timing (its one-time
# costs, plans and first allocations, are a negligible share of it): long calls are not run twice.
WARM_UP_COUNTS_FROM = 1.0


def _info(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- worker side


def _modeling():
    """The flat ``modeling`` package (a checkpoint's layout) or the installed one."""
    try:
        from ..modeling import dispatch, kernels_hybrid, kernels_manhattan, registry  # noqa: F401  (registered)
    except ImportError:  # imported as a top-level module by the isolated worker
        from modeling import dispatch, kernels_hybrid, kernels_manhattan, registry  # type: ignore[no-redef]  # noqa: F401
    return dispatch, registry


def kinds(clips_1d=FULL_CLIPS_1D, clips_2d=FULL_CLIPS_2D) -> list[dict[str, Any]]:
    """The kinds of call a table has entries for (without the mode)."""
    out = [dict(bias="none", causal=False, clip=None), dict(bias="none", causal=True, clip=None)]
    for causal in (False, True):
        out.append(dict(bias="1d", causal=causal, clip=None))
        out += [dict(bias="1d", causal=causal, clip=k) for k in clips_1d]
    out.append(dict(bias="2d", causal=False, clip=None))
    out += [dict(bias="2d", causal=False, clip=k) for k in clips_2d]
    return out


def parse_kind(text: str) -> dict[str, Any]:
    """``"none"``, ``"1d-causal"``, ``"1d@64"``, ``"2d@16"``... -> ``dict(bias, causal, clip)``
    (``-causal``: causal; ``@K``: a bias clipped at K)."""
    head, _, clip = text.partition("@")
    bias, _, causal = head.partition("-")
    if bias not in ("none", "1d", "2d") or causal not in ("", "causal") or (clip and not clip.isdigit()) \
            or (clip and bias == "none") or (causal and bias == "2d"):
        raise ValueError(f"--kinds: {text!r} is not a kind of call: none|1d|2d, then -causal (not 2d), then @K "
                         f"(a clipped bias), e.g. none-causal, 1d@64, 2d@16")
    return dict(bias=bias, causal=bool(causal), clip=int(clip) if clip else None)


def candidates(bias: str, causal: bool, clip: Optional[int], device: str = "cpu") -> list[str]:
    """Every registered whole-sequence backend that can run this kind of call, plus the float64
    variant of each approximate one (``name@float64``)."""
    _, registry = _modeling()
    rpe = None if bias == "none" else bias
    request = dict(causal=causal, rpe=rpe, key_mask=False, device=device, rpe_clip=clip if rpe else None)
    out = []
    for name, spec in registry._REGISTRY.items():
        if spec.decoding or spec.missing(**request):
            continue
        out.append(name)
        if spec.error_bound is not None and device != "mps":
            out.append(f"{name}@float64")
    return out


def _inputs(n: int, side: Optional[int], bias: str, clip: Optional[int], heads: int, features: int, head_dim: int,
            device: str, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    kw = dict(dtype=torch.float32)
    q = (torch.rand(1, heads, n, features, generator=g, **kw) + 0.05).to(device)
    k = (torch.rand(1, heads, n, features, generator=g, **kw) + 0.05).to(device)
    v = torch.randn(1, heads, n, head_dim, generator=g, **kw).to(device)
    extra: dict[str, Any] = {}
    b = None
    if bias == "1d":
        width = 2 * clip + 1 if clip is not None else 2 * n - 1  # a clipped bias travels as its table
        b = 0.1 * torch.randn(heads, width, generator=g, **kw)
    elif bias == "2d":
        extra["grid"] = (side, side)
        b = 0.1 * torch.randn(heads, *((clip + 1,) if clip is not None else (2 * side - 1, 2 * side - 1)), generator=g, **kw)
    if clip is not None:
        extra["rpe_clip"] = clip
    return q, k, v, (None if b is None else b.to(device)), extra


def _runner(name: str, q, k, v, b, extra: dict, causal: bool, backward: bool):
    """A zero-argument callable running one call of ``name`` (``auto``, a backend, or
    ``backend@float64``: the inputs in float64)."""
    import torch

    dispatch, _ = _modeling()
    backend, _, dtype = name.partition("@")
    if dtype:
        q, k, v = (x.to(getattr(torch, dtype)) for x in (q, k, v))
        b = None if b is None else b.to(getattr(torch, dtype))
    inputs = [x for x in (q, k, v, b) if x is not None]
    if backward:
        inputs = [x.detach().requires_grad_(True) for x in inputs]
    q, k, v = inputs[:3]
    b = inputs[3] if len(inputs) > 3 else None

    def run() -> None:
        if backward:
            out = dispatch.kernelized_attention(q, k, v, b, causal, backend=backend, **extra)
            out.backward(torch.ones_like(out))
            for x in inputs:
                x.grad = None
        else:
            with torch.no_grad():
                dispatch.kernelized_attention(q, k, v, b, causal, backend=backend, **extra)
    return run


def _time(run, min_time: float) -> tuple[float, float, float]:
    """``(median wall s, median CPU s, longest CPU s)`` of repeated calls, at least one and
    at least ``min_time`` seconds in all."""
    walls, cpus = [], []
    start = time.perf_counter()
    while not walls or time.perf_counter() - start < min_time:
        w0, c0 = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), max(cpus)


def _quadratic(name: str) -> bool:
    _, registry = _modeling()
    spec = registry._REGISTRY.get(name.partition("@")[0])
    return spec is not None and "N^2" in spec.complexity


def _nn_mb(name: str, n: int, heads: int, table: bool, backward: bool) -> float:
    """MB of the ``(1, H, N, N)`` matrix candidate ``name`` holds for a call (float32 values; float64
    for an ``@float64`` variant): the built-in dense only where it runs unblocked
    (``kernels_dense.materialized_scores``; ``table``: a bias or causal), another backend whose
    declared complexity grows with N^2 always (what it holds is not declared), 0 otherwise."""
    dispatch, registry = _modeling()
    base, _, variant = name.partition("@")
    spec = registry._REGISTRY.get(base)
    if spec is None or "N^2" not in spec.complexity:
        return 0.0
    if spec.fn is dispatch.dense_attention:
        scores = dispatch.materialized_scores(1, heads, n, table=table, backward=backward)
    else:
        scores = heads * n * n
    return scores * (8 if variant == "float64" else 4) / 2 ** 20


def _approximate(name: str) -> bool:
    _, registry = _modeling()
    spec = registry._REGISTRY.get(name.partition("@")[0])
    return spec is not None and spec.error_bound is not None


def _accurate(name: str, q, k, b, extra, causal: bool) -> bool:
    """Whether backend ``name`` meets ``auto``'s accuracy target on these inputs (exact, or its
    error bound in the dtype it runs in at most ``AUTO_MAX_ERROR``)."""
    import torch

    dispatch, registry = _modeling()
    backend, _, dtype = name.partition("@")
    spec = registry.get_backend(backend)
    if spec.error_bound is None:
        return True
    full = None
    if b is not None:
        grid = extra.get("grid")
        full = dispatch._full_bias(b, "2d" if grid else "1d", q.shape[2], grid, extra.get("rpe_clip"))
    dt = getattr(torch, dtype) if dtype else torch.float32
    return spec.error_bound(q, k, rpe_bias=full, causal=causal, key_mask=None, dtype=dt) <= registry.AUTO_MAX_ERROR


def check_candidates(names: list[str], accurate) -> tuple[list[str], dict[str, str]]:
    """``--check``: the backends to time at a point, of ``names``, and why each other is not timed:
    those meeting the accuracy target (``accurate(name)``), without a float64 variant
    (``name@float64``) where the same backend in float32 meets it (the same computation in
    float64 is slower: it cannot be the fastest)."""
    ok = [c for c in names if accurate(c)]
    why = {c: "not accurate" for c in names if c not in ok}
    why.update({c: "not timed: meets the target in float32" for c in ok
                if c.endswith("@float64") and c.partition("@")[0] in ok})
    return [c for c in ok if c not in why], why


class _ChoiceRecorder:
    """While entered, records the backend (``name`` or ``name@float64``) each call of
    ``kernelized_attention`` chose (``auto``'s choice for ``--check``)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __enter__(self):
        import torch

        dispatch, _ = _modeling()
        real = self.real = dispatch._choose

        def spy(call, backend, q, *args, **kwargs):
            found = real(call, backend, q, *args, **kwargs)
            spec, dt = found[:2]
            self.seen.append(spec.name + ("@float64" if dt == torch.float64 and q.dtype != torch.float64 else ""))
            return found
        dispatch._choose = spy
        return self

    def __exit__(self, *exc) -> None:
        dispatch, _ = _modeling()
        dispatch._choose = self.real


def prune_reason(c: str, best: str, t: float, t_best: float, prev: float, prev_best: float, prune: float,
                 check: bool) -> Optional[str]:
    """Why backend ``c`` need not be timed at larger N (None: it must be), from its median CPU
    time ``t`` and the fastest's ``t_best`` at this N and at the previous N (``prev``,
    ``prev_best``). Only a backend that cannot overtake: ``prune``-times slower (``--check``:
    :data:`CHECK_PRUNE`-times) at both N, its cost growing at least as fast as the fastest's between
    them, and not declared cheaper in N than it (never a backend whose cost grows slower than
    N^2 against one whose cost grows with N^2, e.g. an FFT behind ``dense``: ``dense``'s cost
    overtakes it at some N however far ahead it is at small N)."""
    if _quadratic(best) and not _quadratic(c):
        return None
    if t / prev < t_best / prev_best:  # growing slower than the fastest: it may overtake
        return None
    for factor in ([prune] + ([CHECK_PRUNE] if check else [])):
        if t >= factor * t_best and prev >= factor * prev_best:
            return f"{t / t_best:.1f}x the fastest and growing as fast"
    return None


def measure_kind(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Worker: every N of one kind of call and mode; its candidates alternate over the rounds.
    Returns one row per (N, candidate, round) measured or skipped."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if spec.get("table"):  # the table the parent checked and merged: [[key, ranking], ...]
        _, registry = _modeling()
        registry.activate_auto_table({tuple(key): tuple((n, tuple(tuple(r) for r in ranked)) for n, ranked in ranking)
                                      for key, ranking in spec["table"]})
    bias, causal, clip, mode = spec["bias"], spec["causal"], spec["clip"], spec["mode"]
    backward = mode == "fwdbwd"
    names = candidates(bias, causal, clip, spec["device"])
    check = spec.get("check", False)
    stopped: dict[str, str] = {}
    prev: dict[str, float] = {}
    drop = spec.get("check_drop") if check else None
    rows = []
    points = [(s * s, s) for s in spec["sides"]] if bias == "2d" else [(n, None) for n in spec["ns"]]
    for n, side in points:
        if check and CHECK in stopped:
            rows += [dict(mode=mode, bias=bias, causal=causal, clip=clip, n=n, side=side, backend=CHECK, round=-1,
                          wall_s=math.nan, cpu_s=math.nan, status=stopped[CHECK], heads=spec["heads"])]
            continue
        q, k, v, b, extra = _inputs(n, side, bias, clip, spec["heads"], spec["features"], spec["head_dim"], spec["device"])
        live = [c for c in names if c not in stopped and c not in spec.get("skip", ())]
        untimed: dict[str, str] = {}  # --check: why a backend is not timed at this N
        if check:
            live, untimed = check_candidates(live, lambda c: _accurate(c, q, k, b, extra, causal))
            live = ([CHECK] if CHECK not in stopped else []) + live
        table = bias != "none" or causal
        skipped = {c: f"skipped: N x N > {spec['max_nn_mb']:g} MB" for c in live
                   if c != CHECK and _nn_mb(c, n, spec["heads"], table, backward) > spec["max_nn_mb"]}
        exact_timed = [c for c in live if c != CHECK and c not in skipped and not _approximate(c)]
        if not check and not exact_timed:
            skipped.update({c: "skipped: no exact backend timed" for c in live if c.endswith("@float64")})
        live = [c for c in live if c not in skipped]
        runs = {c: _runner(c, q, k, v, b, extra, causal, backward) for c in live}
        times: dict[str, list[tuple[float, float]]] = {c: [] for c in live}
        slow: set[str] = set()  # --check: too slow in the first round to be the fastest at this N
        choice = ""  # --check: the backend auto ran
        for rnd in range(spec["rounds"]):
            order = live if rnd % 2 == 0 else live[::-1]
            if drop and rnd == 1:
                first = {c: times[c][0][1] for c in live if times[c]}
                fastest = min(first.values(), default=math.inf)
                slow = {c for c, t in first.items() if c != CHECK and t > drop * fastest}
            for c in order:
                if c in stopped or c in slow:
                    continue
                try:
                    warm = None
                    if rnd == 0 and c == CHECK:  # warm-up, recording auto's choice
                        with _ChoiceRecorder() as recorder:
                            warm = _time(runs[c], 0.0)
                        choice = recorder.seen[0] if recorder.seen else ""
                    elif rnd == 0:  # warm-up
                        warm = _time(runs[c], 0.0)
                    if warm is not None and warm[1] > WARM_UP_COUNTS_FROM:
                        wall, cpu, longest = warm  # a long call: the warm-up is this round's timing
                    else:
                        wall, cpu, longest = _time(runs[c], spec["min_time"])
                except (RuntimeError, MemoryError) as err:  # out of memory and the like
                    stopped[c] = f"failed at N={n}: {str(err).splitlines()[0][:80]}"
                    continue
                times[c].append((wall, cpu))
                if longest > spec["max_call_seconds"]:
                    stopped[c] = f"one call > {spec['max_call_seconds']:g} s at N={n}"
        medians = {c: statistics.median(cpu for _, cpu in t) for c, t in times.items() if t}
        if medians and n >= PRUNE_FROM_N:
            best = min(medians, key=medians.get)
            for c, t in medians.items():
                if c == CHECK or c == best or c not in prev or best not in prev:
                    continue
                why = prune_reason(c, best, t, medians[best], prev[c], prev[best], spec["prune"], check)
                if why:
                    stopped.setdefault(c, f"pruned at N={n}: {why}")
        prev = medians
        for c in names + ([CHECK] if check else []):
            base = dict(mode=mode, bias=bias, causal=causal, clip=clip, n=n, side=side, backend=c)
            if check:
                base["choice"] = choice if c == CHECK else ""
            if c in times and times[c]:
                for rnd, (wall, cpu) in enumerate(times[c]):
                    rows.append(dict(base, round=rnd, wall_s=wall, cpu_s=cpu, status="ok", heads=spec["heads"]))
            else:
                why = skipped.get(c) or stopped.get(c) or untimed.get(c) or "not timed"
                rows.append(dict(base, round=-1, wall_s=math.nan, cpu_s=math.nan, status=why, heads=spec["heads"]))
        _info(f"  {mode:6s} bias={bias:4s} causal={causal!s:5s} clip={clip!s:4s} N={n:6d}  CPU " +
              "  ".join(f"{c} {medians[c] * 1e3:.3g}ms" for c in sorted(medians, key=medians.get)))
    return rows


_WORKER = r"""
import json, sys
spec = json.loads(sys.argv[1])
import calibrate
print("ROWS " + json.dumps(calibrate.measure_kind(spec)))
"""


def _flat_path() -> list[str]:
    """``PYTHONPATH`` entries under which this file imports as ``calibrate`` and the core as the
    flat ``modeling`` package (no transformers import: a short process start-up)."""
    here = Path(__file__).resolve().parent
    return [str(here), str(here.parent)]


def _run_worker(spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(_flat_path() + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if spec.get("threads"):
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"calibration worker for {spec['mode']} {spec['bias']} timed out after {timeout:.0f} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS "):
            sys.stderr.write(proc.stderr)
            _info(f"  ({spec['mode']} bias={spec['bias']} causal={spec['causal']} clip={spec['clip']}: "
                  f"{time.perf_counter() - start:.0f} s)")
            return json.loads(line[5:])
    raise RuntimeError(f"calibration worker failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")


# ----------------------------------------------------------------------------- the table


def rankings(rows: list[dict[str, Any]], names_of, heads: int = 1) -> list[dict[str, Any]]:
    """Table entries from the timing rows: per kind of call, at each N the timed backends by
    median CPU time (one thread: the wall time a call takes on an idle machine; a busy machine
    lengthens wall times at random), then the others in the previous N's order (a backend whose
    cost grows with N^2 last); consecutive N with the same order merge into one segment whose bound
    lies at the geometric mean of the last N of one order and the first N of the next. One entry
    per kind of call and head count (a row without ``heads``: ``heads``)."""
    from itertools import groupby

    def key(r):
        return (r["mode"], r["bias"], r["causal"], r["clip"] if r["clip"] is not None else -1,
                int(r.get("heads") or heads))

    entries = []
    for (mode, bias, causal, clip, h), group in groupby(sorted(rows, key=key), key=key):
        group = list(group)
        clip = None if clip == -1 else clip
        names = names_of(bias, causal, clip)
        order: list[str] = list(names)
        points = []
        for n in sorted({r["n"] for r in group}):
            at = [r for r in group if r["n"] == n]
            walls = {}
            for c in names:
                ok = [r["cpu_s"] for r in at if r["backend"] == c and r["status"] == "ok"]
                if ok:
                    walls[c] = statistics.median(ok)
            timed = sorted(walls, key=walls.get)
            # the untimed after the timed, in the previous order, those whose cost grows with N^2 last
            rest = [c for c in order if c not in timed]
            order = timed + [c for c in rest if not _quadratic(c)] + [c for c in rest if _quadratic(c)]
            order += [c for c in names if c not in order]
            points.append((n, list(order)))
        segments: list[list[Any]] = []
        for i, (n, ranked) in enumerate(points):
            if segments and segments[-1][1] == ranked:
                continue
            if segments:
                segments[-1][0] = int(math.sqrt(points[i - 1][0] * n))
            segments.append([None, ranked])
        entries.append(dict(mode=mode, bias=bias, causal=causal, clip=clip, dtype="float32", heads=h, ranking=segments))
    return entries


def read_rows(path) -> list[dict[str, Any]]:
    """The timing rows of a ``calibrate.csv``."""
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update(causal=r["causal"] == "True", clip=int(r["clip"]) if r["clip"] else None, n=int(r["n"]),
                 wall_s=float(r["wall_s"]), cpu_s=float(r["cpu_s"]), heads=int(r["heads"]) if r.get("heads") else None)
    return rows


def table_from_rows(rows: list[dict[str, Any]], source: dict[str, Any], names_of, heads: int = 1) -> dict[str, Any]:
    return {"format": 1, "source": source, "entries": rankings(rows, names_of, heads)}


def _table_literal(table: dict[str, Any]) -> str:
    """``table`` as a Python dict literal: an entry per line, a ranking segment per line, the
    source record's items one per line."""
    source = pprint.pformat(table.get("source", {}), width=112, sort_dicts=False).replace("\n", "\n    ")
    lines = ["{", f'    "format": {table["format"]!r},', f'    "source": {source},', '    "entries": [']
    for e in table["entries"]:
        head = ", ".join(f"{json.dumps(k)}: {e[k]!r}" if not isinstance(e[k], str) else f"{json.dumps(k)}: {json.dumps(e[k])}"
                         for k in ("mode", "bias", "causal", "clip", "dtype", "heads") if k in e)
        lines.append(f'        {{{head}, "ranking": [')
        lines += [f"            [{n_max!r}, {json.dumps(names)}]," for n_max, names in e["ranking"]]
        lines.append("        ]},")
    lines += ["    ],", "}"]
    return "\n".join(lines)


def _entry_key(e: dict[str, Any]) -> tuple:
    return (e["mode"], e["bias"], e["causal"], e["clip"], e["dtype"], e.get("heads", 1))


def merge_tables(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``new``'s entries, and ``old``'s of the kinds and head counts ``new`` did not measure (e.g.
    one kind re-measured, or another head count); the sources of both kept."""
    measured = {_entry_key(e) for e in new["entries"]}
    kept = [e for e in old["entries"] if _entry_key(e) not in measured]
    if not kept:
        return new
    source = dict(new.get("source", {}), earlier=old.get("source", {}))
    entries = sorted(new["entries"] + kept, key=lambda e: tuple(str(x) for x in _entry_key(e)))
    return {"format": new["format"], "source": source, "entries": entries}


def write_table_module(table: dict[str, Any], path: Path, command: str) -> Path:
    """The table as ``modeling/auto_table.py``: a dict literal (a checkpoint carries it; the
    modeling folder imports only torch, transformers and the standard library)."""
    text = (
        '"""The calibration table ``backend="auto"`` ranks backends by (data; format: ``hf_kernattn.auto_tables``).\n\n'
        "Measured as ``AUTO_TABLE[\"source\"]`` says; re-measure entries with\n"
        f"``{command} --ship`` (``--kinds``,\n"
        "``--heads``: only those). A table of another machine: ``hf_kernattn.load_auto_table(path)`` or\n"
        "``HF_KERNATTN_AUTO_TABLE``.\n"
        '"""\n\n'
        f"AUTO_TABLE = {_table_literal(table)}\n"
    )
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from .common import build_parser as common_parser

    return common_parser(NAME, __doc__, add_arguments)


# ----------------------------------------------------------------------------- crossovers as the docs state them

# The longest input the crossover sentences describe (the table's last segment runs beyond).
DESCRIBE_N_MAX = 65536
# The calls whose crossovers the docs quote: name -> the call (choose_backend's keywords, the
# mode aside). ``state``: the call returns its final state (Linear GPT with ``use_cache``).
DOC_CALLS = {
    "nprf_bert": dict(causal=False, rpe="1d", rpe_clip=512, heads=12),  # NPRF-BERT's defaults, BERT-base's heads
    "nprf_bert_one_head": dict(causal=False, rpe="1d", rpe_clip=512, heads=1),
    "linear_gpt_rpe": dict(causal=True, rpe="1d", rpe_clip=64, heads=8),  # Linear GPT's default K and heads
    "linear_gpt_rpe_state": dict(causal=True, rpe="1d", rpe_clip=64, heads=8, state=True),
}


def auto_picks(*, causal: bool, rpe: Optional[str], rpe_clip: Optional[int] = None, heads: Optional[int] = None,
               backward: bool = False, state: bool = False, key_mask: bool = False, device: str = "cpu",
               n_max: int = DESCRIBE_N_MAX) -> list[tuple[int, str]]:
    """``[(first N, backend), ...]``: where ``backend="auto"``'s first choice changes for N from 2 to
    ``n_max`` tokens, read from the active table (``registry.choose_backend``) before any accuracy
    check of the data. The choice changes only where a table segment ends or, below ``2K + 2``, where
    the offsets a clipped bias reaches grow; those N and every N below ``2K + 2`` are asked."""
    from ..modeling import registry

    bounds = {n for ranking in registry.active_auto_table().values() for n, _ in ranking if n is not None}
    ns = set(range(2, min(n_max, 2 * (rpe_clip or 0) + 2) + 1)) | {n + d for n in bounds for d in (0, 1)}
    picks: list[tuple[int, str]] = []
    for n in sorted(n for n in ns if 2 <= n <= n_max):
        name = registry.choose_backend(n=n, causal=causal, rpe=rpe, key_mask=key_mask, device=device, rpe_clip=rpe_clip,
                                       state=state, backward=backward, heads=heads)
        if not picks or picks[-1][1] != name:
            picks.append((n, name))
    return picks


def crossover_phrase(picks: list[tuple[int, str]]) -> str:
    """``[(2, "dense"), (1723, "windowed")]`` -> ``"`dense` up to 1,722 tokens, `windowed` beyond"``."""
    if len(picks) == 1:
        return f"`{picks[0][1]}` at every length"
    parts = []
    for i, (_, name) in enumerate(picks):
        if i + 1 < len(picks):
            last = picks[i + 1][0] - 1
            parts.append(f"`{name}` up to {last:,}" + (" tokens" if i == 0 else ""))
        else:
            parts.append(f"`{name}` beyond")
    return ", ".join(parts)


def describe_crossovers(call: dict[str, Any]) -> str:
    """The sentence the docs give for ``auto`` on ``call`` (``DOC_CALLS``' form): forward and
    training (forward+backward) together when they agree."""
    forward, training = (crossover_phrase(auto_picks(**call, backward=b)) for b in (False, True))
    if forward == training:
        return f"{forward} (forward and training)"
    return f"forward: {forward}; training: {training}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .common import add_common_arguments

    add_common_arguments(parser, NAME, f"a short grid (N in {QUICK_NS}, grids {QUICK_SIDES}, K 16), one round, "
                                       "all kinds in one process: seconds to a minute")
    parser.add_argument("--ns", type=int, nargs="+", default=None, help=f"1D lengths (default {FULL_NS})")
    parser.add_argument("--sides", type=int, nargs="+", default=None, help=f"2D grid sides (default {FULL_SIDES})")
    parser.add_argument("--clips-1d", type=int, nargs="+", default=None, help=f"K of the clipped 1D biases (default {FULL_CLIPS_1D})")
    parser.add_argument("--clips-2d", type=int, nargs="+", default=None, help=f"K of the clipped Manhattan biases (default {FULL_CLIPS_2D})")
    parser.add_argument("--kinds", nargs="+", default=None,
                        help="only these kinds of call, e.g. none none-causal 1d 1d-causal 1d@64 1d-causal@512 2d 2d@16 "
                             "(default: every kind, with the --clips-1d / --clips-2d given)")
    parser.add_argument("--skip-backends", nargs="+", default=(),
                        help="do not time these candidates (e.g. fft fft@float64 where they are far behind); a table "
                             "ranks them after the timed ones")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="fwd, fwdbwd (forward+backward)")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--features", type=int, default=64, help="M, feature size of q and k")
    parser.add_argument("--head-dim", type=int, default=64, help="D, value size")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per N")
    parser.add_argument("--min-time", type=float, default=0.02, help="seconds of repeated calls per candidate and round")
    parser.add_argument("--max-call-seconds", type=float, default=4.0, help="stop timing a backend at larger N after a call took this much CPU time")
    parser.add_argument("--max-nn-mb", type=float, default=1024.0,
                        help="skip a backend where the N x N matrix it holds exceeds this many MB (a backend "
                        "declared O(N^2); the built-in dense only where it runs unblocked, in small "
                        "forward+backward calls: it works in blocks otherwise)")
    parser.add_argument("--prune", type=float, default=3.0, help="stop timing a backend this many times slower than the fastest")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a kind's worker is stopped")
    parser.add_argument("--ship", action="store_true", help="also write the table into hf_kernattn/modeling/auto_table.py")
    parser.add_argument("--check", action="store_true", help="time auto against the fastest accurate backend instead")
    parser.add_argument("--table", default=None, help="with --check: a table (JSON) to load instead of the shipped one")
    parser.add_argument("--check-limit", type=float, default=CHECK_LIMIT,
                        help="with --check: a point above this ratio is measured again before it counts as above")
    parser.add_argument("--rounds-again", type=int, default=5, help="with --check: rounds of a point measured again (0: none)")
    parser.add_argument("--check-drop", type=float, default=2.0,
                        help="with --check: a backend this many times slower than the fastest in the first round is not timed again at that N")
    parser.add_argument("--describe", action="store_true",
                        help="measure nothing: print the crossovers of the active table (the shipped one, or "
                             "HF_KERNATTN_AUTO_TABLE's) for the calls the docs describe")
    parser.add_argument("--from-csv", nargs="+", default=None,
                        help="measure nothing: derive the table from the calibrate.csv of earlier runs (rows measured "
                             "at several head counts give an entry per head count; rows without heads count as --heads)")


def _specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    ns = tuple(args.ns or (QUICK_NS if args.quick else FULL_NS))
    sides = tuple(args.sides or (QUICK_SIDES if args.quick else FULL_SIDES))
    clips_1d = tuple(args.clips_1d or ((16,) if args.quick else FULL_CLIPS_1D))
    clips_2d = tuple(args.clips_2d or FULL_CLIPS_2D)
    table = None
    if args.table:  # checked and merged here, handed to the workers as [[key, ranking], ...]
        from ..auto_tables import merged_table

        table = [[list(key), ranking] for key, ranking in merged_table(str(Path(args.table).resolve())).items()]
    common = dict(ns=ns, sides=sides, heads=args.heads, features=args.features, head_dim=args.head_dim, rounds=args.rounds,
                  min_time=args.min_time, max_call_seconds=args.max_call_seconds, max_nn_mb=args.max_nn_mb,
                  prune=args.prune, threads=args.threads, device=args.device, check=args.check, table=table,
                  check_drop=args.check_drop, skip=list(args.skip_backends))
    chosen = [parse_kind(k) for k in args.kinds] if args.kinds else kinds(clips_1d, clips_2d)
    return [dict(common, mode=mode, **kind) for mode in args.modes for kind in chosen]


def _point(r: dict[str, Any]) -> tuple:
    """A check point's key: ``(mode, bias, causal, clip, n)``."""
    return (r["mode"], r["bias"], str(r["causal"]), r["clip"] if r["clip"] is not None else -1, int(r["n"]))


def _check_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per grid point: auto / the fastest accurate backend (by median CPU time over rounds), per
    round, median [min-max], CPU and wall; ``ratio`` is the median CPU ratio."""
    from itertools import groupby

    from .common import format_spread

    out = []
    for (mode, bias, causal, clip, n), group in groupby(sorted(rows, key=_point), key=_point):
        group = [r for r in group if r["status"] == "ok"]
        per = {}
        for r in group:
            per.setdefault(r["backend"], {})[r["round"]] = r
        side = next((r.get("side") for r in group if r.get("side") not in (None, "")), None)
        row = dict(mode=mode, bias=bias, causal=causal, clip=None if clip == -1 else clip, n=n,
                   side=None if side is None else int(side))
        others = {c: t for c, t in per.items() if c != CHECK}
        if CHECK not in per or not others:
            out.append(dict(row, auto_runs="", best="", auto_ms=math.nan, best_ms=math.nan, cpu="not measured", wall="", ratio=math.nan))
            continue
        best = min(others, key=lambda c: statistics.median(r["cpu_s"] for r in others[c].values()))
        row["auto_runs"] = next((r.get("choice") for r in per[CHECK].values() if r.get("choice")), "")
        rounds = sorted(set(per[CHECK]) & set(per[best]))
        wall = [per[CHECK][i]["wall_s"] / per[best][i]["wall_s"] for i in rounds]
        cpu = [per[CHECK][i]["cpu_s"] / per[best][i]["cpu_s"] for i in rounds if per[best][i]["cpu_s"] > 0]
        out.append(dict(row, best=best, auto_ms=1e3 * statistics.median(r["cpu_s"] for r in per[CHECK].values()),
                        best_ms=1e3 * statistics.median(r["cpu_s"] for r in others[best].values()),
                        cpu=format_spread(cpu), wall=format_spread(wall),
                        ratio=statistics.median(cpu) if cpu else math.nan))
    return out


def _again_specs(summary: list[dict[str, Any]], specs: list[dict[str, Any]], limit: float, rounds: int):
    """One spec per check point above ``limit``: that point alone, ``rounds`` rounds."""
    out = []
    for r in summary:
        if not r["ratio"] > limit:
            continue
        for s in specs:
            if _point(dict(s, n=r["n"])) == _point(r):
                size = dict(sides=[r["side"]]) if r["bias"] == "2d" else dict(ns=[r["n"]])
                out.append(dict(s, **size, rounds=max(rounds, 1)))
    return out


def _merge_again(summary: list[dict[str, Any]], again: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first measurement with the second beside (``cpu_again``, ``ratio_again``, ``best_again``)."""
    second = {_point(r): r for r in again}
    out = []
    for r in summary:
        a = second.get(_point(r))
        out.append(dict(r, best_again=a["best"] if a else "", cpu_again=a["cpu"] if a else "",
                        ratio_again=a["ratio"] if a else math.nan))
    return out


def _verdict(r: dict[str, Any], limit: float = CHECK_LIMIT) -> float:
    """A point's ratio: the re-measured one where the first was above ``limit``."""
    return r["ratio_again"] if r.get("ratio_again") == r.get("ratio_again") and r["ratio"] > limit else r["ratio"]


def _report_check(args: argparse.Namespace, specs, rows, out: Path, start: float) -> int:
    """``--check``: the summary, the points above the limit measured again, the counts."""
    from .common import format_table, write_csv

    path = write_csv(rows, out / "check.csv")
    summary = _check_summary(rows)
    again_rows: list[dict[str, Any]] = []
    again = [] if args.from_csv else _again_specs(summary, specs, args.check_limit, args.rounds_again)
    if again and args.rounds_again > 0:
        _info(f"measuring again {len(again)} point(s) above {args.check_limit:g}x")
        for spec in again:
            again_rows += measure_kind(spec) if args.quick else _run_worker(spec, args.timeout)
        write_csv(again_rows, out / "check_again.csv")
    summary = _merge_again(summary, _check_summary(again_rows) if again_rows else [])
    write_csv(summary, out / "check_summary.csv")
    shown = [dict(r, auto_ms=f"{r['auto_ms']:.3g}", best_ms=f"{r['best_ms']:.3g}") for r in summary]
    print(format_table(shown, ["mode", "bias", "causal", "clip", "n", "auto_runs", "best", "auto_ms", "best_ms", "cpu", "wall",
                               "best_again", "cpu_again"]))
    measured = [r for r in summary if r["ratio"] == r["ratio"]]
    final = [_verdict(r, args.check_limit) for r in measured]
    above = [r for r in measured if _verdict(r, args.check_limit) > args.check_limit]
    if final:
        print(f"\nauto / the fastest accurate backend (CPU time, median over rounds): {len(final) - len(above)} of "
              f"{len(final)} points within {args.check_limit:g}x (a point above measured again before it counts), "
              f"median {statistics.median(final):.3f}x, max {max(final):.3f}x")
    for r in above:
        print(f"  above: {r['mode']} bias {r['bias']} causal {r['causal']} clip {r['clip']} N {r['n']}: "
              f"{r['cpu']} vs {r['best']}, again {r['cpu_again']} vs {r['best_again']}")
    print(f"({time.perf_counter() - start:.0f} s; wrote {path} and {out / 'check_summary.csv'})")
    return 0


def run(args: argparse.Namespace) -> int:
    from .common import format_table, write_csv

    if getattr(args, "describe", False):
        for name, call in DOC_CALLS.items():
            shown = ", ".join(f"{k}={v}" for k, v in call.items())
            print(f"{name} ({shown}): {describe_crossovers(call)}")
        return 0

    for name in ("heads", "features", "head_dim", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(args, name)!r}")
    if args.check and args.skip_backends:
        raise ValueError("--skip-backends cannot be combined with --check: auto is checked against every accurate backend")
    if args.table and not args.check:
        raise ValueError("--table is read by --check only (load a table for your runs with hf_kernattn.load_auto_table)")
    if args.quick:
        args.rounds = 1 if args.rounds == 3 else args.rounds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = _specs(args)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if args.from_csv:
        rows = [r for path in args.from_csv for r in read_rows(path)]
    elif args.quick:  # one process for every kind: seconds, not a process start-up per kind
        for spec in specs:
            rows += measure_kind(spec)
    else:
        for spec in specs:
            rows += _run_worker(spec, args.timeout)
    elapsed = time.perf_counter() - start
    if args.check:
        return _report_check(args, specs, rows, out, start)
    command = ("hf-kernattn bench calibrate" + (" --quick" if args.quick else "") +
               f" --threads {args.threads} --heads {args.heads} --features {args.features} --head-dim {args.head_dim}" +
               (f" --kinds {' '.join(args.kinds)}" if args.kinds else ""))
    source = dict(command=command, threads=args.threads, heads=args.heads, features=args.features,
                  head_dim=args.head_dim, batch=1, device=args.device, rounds=args.rounds,
                  cpus=os.cpu_count(), seconds=round(elapsed), date=time.strftime("%Y-%m-%d"))
    if args.from_csv:  # the timings are an earlier run's
        source.update(seconds=None, from_csv=[str(p) for p in args.from_csv])
    table = table_from_rows(rows, source, lambda bias, causal, clip: candidates(bias, causal, clip, args.device),
                            args.heads)
    from ..auto_tables import check_auto_table

    check_auto_table(table)  # what we write loads
    csv_path = write_csv(rows, out / "calibrate.csv")
    json_path = out / "auto_table.json"
    json_path.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    for entry in table["entries"]:
        segs = "; ".join(f"<= {n_max}: {' > '.join(names[:3])}" if n_max else f"beyond: {' > '.join(names[:3])}"
                         for n_max, names in entry["ranking"])
        print(f"{entry['mode']:6s} bias {entry['bias']:4s} causal {entry['causal']!s:5s} clip {entry['clip']!s:4s}  {segs}")
    print(f"\n{elapsed:.0f} s; wrote {json_path} (load it with hf_kernattn.load_auto_table) and {csv_path}")
    if args.ship:  # the entries measured replace those of their kind and head count; the others stay
        shipped = Path(__file__).resolve().parents[1] / "modeling" / "auto_table.py"
        from ..modeling.auto_table import AUTO_TABLE

        write_table_module(merge_tables(table, AUTO_TABLE), shipped, command)
        print(f"wrote {shipped}")
    return 0
