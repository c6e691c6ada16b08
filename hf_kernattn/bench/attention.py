"""Attention core: FFT relative positions and causal chunked attention vs exact softmax, time and memory.

For each sequence length N (default 1k ... 64k) four cases, each measured in a fresh process
(``bench.common.measure``: median wall time of a few forward runs, peak resident memory above
the inputs):

* ``fft_rpe``: our ``fft`` backend, non-causal, with a 1D relative-position bias ``(H, 2N-1)``
  (Luo et al. 2021, Algorithm 1), on feature-mapped ``q, k (B, H, N, M)`` and ``v (B, H, N, D)``.
* ``windowed_rpe``: our ``windowed`` backend, non-causal, with a bias from a table clipped at
  ``K = --max-relative-position`` (``rpe_clip=K``, as the models build it): exact in O(N K).
* ``causal_chunked``: our ``causal_chunked`` backend (causal linear attention, no bias).
* ``softmax_rpe``: what a user would otherwise run: exact softmax attention with the same bias,
  ``scaled_dot_product_attention`` with a float ``attn_mask``. The timed part includes building
  the ``N x N`` mask from the ``(H, 2N-1)`` vector the way relative-position code usually does
  it (T5 and most Transformers models): an ``N x N`` matrix of offsets ``j - i`` indexing the
  bias. ``q, k`` have the head size D.
* ``softmax_rpe_unfold``: the same attention with the cheapest mask construction we know
  (``unfold`` + ``flip`` of the bias vector: one ``N x N`` copy, no index matrix), so the
  comparison does not hinge on how the mask is built.
* ``sdpa``: plain ``scaled_dot_product_attention`` without a mask (no positions at all).

Forward passes by default; ``--backward`` times forward+backward (gradients for q, k, v and the
bias). The cases of one N alternate over ``--rounds`` rounds, each in a fresh process, and the
speed-ups are also given per round as median [min-max], of the wall time and of the process's
CPU time (``cpu_s``; other processes on a shared machine hardly stretch it).

Softmax cases whose ``N x N`` matrices would exceed ``--max-nn-gb`` are skipped; a case that
fails or exceeds ``--timeout`` is reported with its status and its larger N are skipped. One run
writes ``attention_bench.csv`` and ``attention_bench.png`` (time and memory vs N, log-log, like
Luo et al. 2021 Fig. 1a) and prints a Markdown table with the fft- and windowed-vs-softmax
ratios and the slope ``time(N) / time(N/2)``.

``--crossover`` instead times, for N in 32 ... 1024 at M = D = 64, the dense (quadratic)
backend against ``linear`` (non-causal), ``causal_chunked`` and ``fft`` (with a bias), and prints
the largest N at which dense is still faster (``hf-kernattn bench calibrate`` measures every
crossover ``backend="auto"`` reads).

``--overhead`` instead measures what the public call adds to the kernel it runs: for
``linear``, ``causal_chunked`` and ``windowed`` (a bias clipped at K), ``kernelized_attention``
against the bare kernel (the registered backend's function called directly on the inputs as
the call prepares them: float32, nothing padded, a clipped bias as its table ``(H, 2K+1)``),
by default at N = 16k and 64k with 8 heads and M = D = 64, batch 1, forward. The two alternate
over ``--rounds`` rounds in fresh processes; the wall-time, CPU-time and peak-memory ratios
public / bare are printed as median [min-max] and written to ``overhead.csv`` (peak memory from
processes with a fixed mmap threshold, which makes it reproducible: see :func:`overhead`).

Workloads run in subprocesses that import this file as a top-level module together with the
flat ``modeling`` folder (the layout a remote-code checkpoint uses), so each measurement pays for
importing torch only, not transformers.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable


def _info(message: str) -> None:
    """Progress through transformers' logging, imported only in the parent process: workloads run
    in subprocesses that import this file with torch only."""
    from transformers.utils import logging

    logging.get_logger("hf_kernattn.bench.attention").info(message)

NAME = "attention"
CASES = ("fft_rpe", "windowed_rpe", "causal_chunked", "softmax_rpe", "softmax_rpe_unfold", "sdpa")
LABELS = {
    "fft_rpe": "fft + RPE (ours, O(N log N))",
    "windowed_rpe": "windowed + RPE clipped at K (ours, O(N K))",
    "causal_chunked": "causal chunked (ours, O(N))",
    "softmax_rpe": "softmax + RPE (SDPA, float mask by index)",
    "softmax_rpe_unfold": "softmax + RPE (SDPA, float mask by unfold)",
    "sdpa": "softmax, no RPE (SDPA)",
}
# how many N x N matrices of the compute dtype (batch * heads * N^2 elements each) a softmax case
# holds at its peak, measured on CPU (SDPA's fused CPU kernel works in tiles even with a mask):
# softmax_rpe: two int64 offset matrices (offsets, offsets + N - 1) and the float mask, 6 GB
# at N = 16384; softmax_rpe_unfold: the mask (1 GB at N = 16384); sdpa: none (8 MB at 16384).
NN_MATRICES = {"softmax_rpe": 6, "softmax_rpe_unfold": 1, "sdpa": 0}
FULL_NS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_NS = (1024, 2048, 4096)
CROSSOVER_NS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# --overhead: backend -> the case calling it through kernelized_attention (its bare form: "bare_" + case)
OVERHEAD_CASES = {"linear": "linear", "causal_chunked": "causal_chunked", "windowed": "windowed_rpe"}
OVERHEAD_NS = (16384, 65536)
QUICK_OVERHEAD_NS = (4096,)
KERNELIZED_CASES = ("fft_rpe", "windowed_rpe", "causal_chunked", "dense_rpe", "dense", "dense_causal", "linear")


def _kernelized_attention() -> Callable[..., Any]:
    """The public entry point, importable both inside the package and from the flat layout."""
    try:
        from ..modeling.dispatch import kernelized_attention
    except ImportError:  # imported as a top-level module by the isolated runner
        from modeling.dispatch import kernelized_attention  # type: ignore[no-redef]
    return kernelized_attention


def workload(
    case: str,
    n: int,
    batch: int = 1,
    heads: int = 1,
    features: int = 32,
    head_dim: int = 64,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    clip: int = 128,
    backward: bool = False,
) -> Callable[[], None]:
    """Build the inputs of one case and return a zero-argument callable running one forward pass.

    Shapes: kernelized cases use ``q, k (batch, heads, n, features)`` (positive, as after a
    PRF/elu map), ``v (batch, heads, n, head_dim)`` and ``rpe_bias (heads, 2n-1)`` (for
    ``windowed_rpe`` made from a table clipped at ``clip``); softmax cases use
    ``q, k, v (batch, heads, n, head_dim)`` and the same bias. ``"bare_" + case`` (a kernelized
    case) runs that case's backend function directly on the same inputs (:func:`_bare_kernel`).
    """
    import torch

    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    kw = dict(dtype=dt, device=device)
    v = torch.randn(batch, heads, n, head_dim, **kw)
    bias = 0.1 * torch.randn(heads, 2 * n - 1, **kw)
    if case == "windowed_rpe":  # the bias of a table clipped at K, as the models build it
        table = 0.1 * torch.randn(heads, 2 * clip + 1, **kw)
        offsets = torch.arange(-(n - 1), n, device=device).clamp(-clip, clip) + clip
        bias = table[:, offsets]
    bare = case.startswith("bare_")
    if bare and case[len("bare_"):] in KERNELIZED_CASES or case in KERNELIZED_CASES:
        case = case[len("bare_"):] if bare else case
        attn = _kernelized_attention()
        q = torch.rand(batch, heads, n, features, **kw) + 0.05
        k = torch.rand(batch, heads, n, features, **kw) + 0.05
        calls = {
            "fft_rpe": dict(rpe_bias=bias, backend="fft"),
            "windowed_rpe": dict(rpe_bias=bias, rpe_clip=clip, backend="windowed"),
            "dense_rpe": dict(rpe_bias=bias, backend="dense"),
            "causal_chunked": dict(causal=True, backend="causal_chunked"),
            "dense_causal": dict(causal=True, backend="dense"),
            "linear": dict(backend="linear"),
            "dense": dict(backend="dense"),
        }[case]
        if bare:
            attn = _bare_kernel(calls, n, clip)

        def run() -> None:
            if backward:
                _forward_backward(lambda: attn(q, k, v, **calls), (q, k, v, bias))
                return
            with torch.inference_mode():
                attn(q, k, v, **calls)

    elif case in ("softmax_rpe", "softmax_rpe_unfold", "sdpa"):
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        q = torch.randn(batch, heads, n, head_dim, **kw)
        k = torch.randn(batch, heads, n, head_dim, **kw)
        if case == "softmax_rpe":

            def forward():
                pos = torch.arange(n, device=device)
                offsets = pos[None, :] - pos[:, None]  # (n, n): j - i
                mask = bias[:, offsets + n - 1]  # (heads, n, n)
                return sdpa(q, k, v, attn_mask=mask[None])

        elif case == "softmax_rpe_unfold":

            def forward():
                # mask[h, i, j] = bias[h, j - i + n - 1]: windows of the bias, flipped (one copy)
                mask = bias.unfold(-1, n, 1).flip(-2)  # (heads, n, n)
                return sdpa(q, k, v, attn_mask=mask[None])

        else:

            def forward():
                return sdpa(q, k, v)

        def run() -> None:
            if backward:
                _forward_backward(forward, (q, k, v, bias))
                return
            with torch.inference_mode():
                forward()

    else:
        raise ValueError(f"unknown case {case!r}")
    return run


def _bare_kernel(calls: dict[str, Any], n: int, clip: int) -> Callable[..., Any]:
    """The registered backend that ``calls`` (keyword arguments of ``kernelized_attention``)
    names, as a function of ``(q, k, v, **calls)`` calling it directly with exactly the keyword
    arguments it takes, as the public call passes them for finite float32 inputs without padding
    (a clipped bias as its table ``(H, 2K+1)``, a view of the full bias): the kernel alone."""
    try:
        from ..modeling.dispatch import get_backend  # the dispatch module registers the built-in backends
    except ImportError:  # imported as a top-level module by the isolated runner
        from modeling.dispatch import get_backend  # type: ignore[no-redef]
    spec = get_backend(calls["backend"])
    bias = calls.get("rpe_bias")
    if bias is not None and calls.get("rpe_clip") is not None and "rpe_clip" in spec.takes:
        bias = bias[:, n - 1 - clip : n + clip]
    given = dict(rpe_bias=bias, causal=calls.get("causal", False), key_mask=None, grid=None, eps=1e-6,
                 rpe_clip=calls.get("rpe_clip"), q_den=None, k_den=None, initial_state=None, output_final_state=False)
    kwargs = {arg: given[arg] for arg in spec.takes}

    def kernel(q, k, v, **_calls):
        return spec.fn(q, k, v, **kwargs)

    return kernel


def _forward_backward(forward: Callable, inputs: tuple) -> None:
    """One forward and backward with gradients for ``inputs`` (set up on first use), a fixed
    output gradient of ones; the gradients are dropped after each run."""
    for x in inputs:
        x.requires_grad_(True)
    out = forward()
    out.backward(out.new_ones(out.shape))
    for x in inputs:
        x.grad = None


def _flat_path() -> list[str]:
    """``PYTHONPATH`` entries under which this file imports as ``attention`` and the core as the
    flat ``modeling`` package, without importing transformers (faster process start-up)."""
    here = Path(__file__).resolve().parent
    return [str(here), str(here.parent)]


def _nn_gb(case: str, n: int, args: argparse.Namespace) -> float:
    itemsize = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}[args.dtype]
    return NN_MATRICES.get(case, 0) * args.batch * args.heads * n * n * itemsize / 2**30


def _measure_all(args: argparse.Namespace, ns: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every case at every N; the cases of one N alternate over ``--rounds`` rounds, each run in
    a fresh process (``bench.common.alternate``). A row holds the median over rounds (time and
    peak memory), the spread of the times and the per-round times (``round_times``) that the
    summary's ratios are taken from."""
    from .common import alternate, spread

    rows = []
    stopped: dict[str, str] = {}
    for n in ns:
        skipped: dict[str, str] = {}
        cases = []
        for case in args.cases:
            if case in stopped:
                skipped[case] = f"skipped ({stopped[case]})"
            elif _nn_gb(case, n, args) > args.max_nn_gb:
                skipped[case] = f"skipped (N x N matrices ~{_nn_gb(case, n, args):.0f} GB > {args.max_nn_gb:g} GB)"
            else:
                kwargs = dict(case=case, n=n, batch=args.batch, heads=args.heads, features=args.features,
                              head_dim=args.head_dim, dtype=args.dtype, device=args.device,
                              clip=args.max_relative_position, backward=args.backward)
                cases.append((case, "attention:workload", kwargs))
        done = [0]

        def progress(case: str, rnd: int, result: dict[str, Any], n=n, count=len(cases)) -> None:
            done[0] += 1
            _info(f"  N={n:6d} round {rnd + 1}/{args.rounds} [{done[0]}/{count * args.rounds}] {case:18s} "
                  f"{1000 * result['time_s']:10.2f} ms  peak {result['peak_mb']:8.1f} MB  {result['status']}")

        measured = alternate(cases, rounds=args.rounds, repeats=args.repeats, timeout_s=args.timeout,
                             max_seconds=args.max_seconds, extra_path=_flat_path(), threads=args.threads,
                             progress=progress)
        for case in args.cases:
            row: dict[str, Any] = {"case": case, "n": n, "batch": args.batch, "heads": args.heads,
                                   "features": args.features, "head_dim": args.head_dim, "dtype": args.dtype}
            if case in skipped:
                row.update(time_s=math.nan, time_min=math.nan, time_max=math.nan, cpu_s=math.nan, peak_mb=math.nan,
                           runs=0, status=skipped[case], round_times=[], round_cpu_times=[])
            else:
                results = measured[case]
                bad = [r["status"] for r in results if r["status"] != "ok"]
                med, lo, hi = spread(r["time_s"] for r in results)
                row.update(time_s=med, time_min=lo, time_max=hi,
                           cpu_s=spread(r.get("cpu_s", math.nan) for r in results)[0],
                           peak_mb=spread(r["peak_mb"] for r in results)[0],
                           runs=sum(r["runs"] for r in results), status=bad[0] if bad else "ok",
                           round_times=[r["time_s"] for r in results],
                           round_cpu_times=[r.get("cpu_s", math.nan) for r in results])
                if bad:
                    stopped[case] = f"N={n} {bad[0].split(':')[0]}"
            rows.append(row)
            _info(f"  N={n:6d} {case:15s} {row['status']:>10s}  time {row['time_s']:.4g} s "
                  f"[{row['time_min']:.4g}-{row['time_max']:.4g}]  peak {row['peak_mb']:.4g} MB")
    return rows


# per-round speed-ups reported as median [min-max]: slower case / faster case, same round; each
# of wall time and, in the column after it, of CPU time (``CPU_SPREADS``)
SPREADS = {
    "fft vs softmax+RPE, per round": ("softmax_rpe", "fft_rpe"),
    "windowed vs softmax+RPE, per round": ("softmax_rpe", "windowed_rpe"),
}
CPU_SPREADS = {name.replace(", per round", ", CPU time, per round"): pair for name, pair in SPREADS.items()}
SPREAD_COLUMNS = [c for pair in zip(SPREADS, CPU_SPREADS) for c in pair]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per N: times, memory, fft-vs-softmax+RPE speed-up and memory ratio, fft slope, and
    the speed-ups of :data:`SPREADS` as median [min-max] of per-round ratios."""
    from .common import format_spread, per_round_ratios

    by = {(r["case"], r["n"]): r for r in rows}
    ns = sorted({r["n"] for r in rows})
    out = []
    for n in ns:
        s: dict[str, Any] = {"N": n}
        for case in CASES:
            r = by.get((case, n))
            s[f"{case} s"] = r["time_s"] if r else math.nan
            s[f"{case} MB"] = r["peak_mb"] if r else math.nan
        fft, soft = by.get(("fft_rpe", n)), by.get(("softmax_rpe", n))
        ok = bool(fft and soft and fft["status"] == "ok" and soft["status"] == "ok")
        s["speed-up fft vs softmax+RPE"] = soft["time_s"] / fft["time_s"] if ok else math.nan
        for spreads, key in ((SPREADS, "round_times"), (CPU_SPREADS, "round_cpu_times")):
            for name, (slow, fast) in spreads.items():
                a_row, b_row = by.get((slow, n)), by.get((fast, n))
                good = bool(a_row and b_row and a_row["status"] == b_row["status"] == "ok")
                s[name] = format_spread(per_round_ratios(
                    [{"t": t} for t in a_row.get(key, [])], [{"t": t} for t in b_row.get(key, [])], "t")) if good else "nan"
        s["memory ratio softmax+RPE / fft"] = (soft["peak_mb"] / fft["peak_mb"]
                                               if ok and fft["peak_mb"] > 0 else math.nan)
        unf = by.get(("softmax_rpe_unfold", n))
        ok_u = bool(fft and unf and fft["status"] == "ok" and unf["status"] == "ok")
        s["speed-up fft vs softmax+RPE (unfold mask)"] = unf["time_s"] / fft["time_s"] if ok_u else math.nan
        s["memory ratio softmax+RPE (unfold mask) / fft"] = (unf["peak_mb"] / fft["peak_mb"]
                                                             if ok_u and fft["peak_mb"] > 0 else math.nan)
        win = by.get(("windowed_rpe", n))
        ok_w = bool(win and soft and win["status"] == "ok" and soft["status"] == "ok")
        s["speed-up windowed vs softmax+RPE"] = soft["time_s"] / win["time_s"] if ok_w else math.nan
        prev = by.get(("fft_rpe", n // 2))
        s["fft time(N)/time(N/2)"] = (fft["time_s"] / prev["time_s"]
                                      if fft and prev and fft["status"] == prev["status"] == "ok" else math.nan)
        out.append(s)
    return out


# the short table every run prints (the CSV holds every column): where the FFT overtakes exact
# softmax with the same bias, and at what memory; SDPA without a bias for scale
BRIEF_COLUMNS = ("N", "fft + RPE ms", "softmax + RPE ms", "fft speed-up", "memory softmax+RPE / fft", "SDPA, no bias ms")


def brief_summary(summary: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """:func:`summarize`'s rows as :data:`BRIEF_COLUMNS` (the speed-up as median [min-max] over
    rounds), and one sentence reading them."""
    def ms(x: float) -> float:
        return 1000 * x

    rows = [{
        "N": s["N"], "fft + RPE ms": ms(s["fft_rpe s"]), "softmax + RPE ms": ms(s["softmax_rpe s"]),
        "fft speed-up": s["fft vs softmax+RPE, per round"], "memory softmax+RPE / fft": s["memory ratio softmax+RPE / fft"],
        "SDPA, no bias ms": ms(s["sdpa s"]),
    } for s in summary]
    speed = "speed-up fft vs softmax+RPE"
    measured = [s["N"] for s in summary if s[speed] == s[speed]]  # NaN: not both measured
    faster = [s["N"] for s in summary if s[speed] > 1]
    if not measured:
        return rows, ("Reading: the FFT path and exact softmax with the bias were not both measured at any N "
                      "(see the statuses below).")
    if not faster:
        where = "at no N measured"
    elif faster == measured:
        where = f"at every N measured ({measured[0]:,} to {measured[-1]:,})"
    elif faster == measured[measured.index(faster[0]):]:
        where = f"from N = {faster[0]:,} on (slower below)"
    else:
        where = "at N = " + ", ".join(f"{n:,}" for n in faster)
    last = next(s for s in reversed(summary) if s["N"] == measured[-1])
    memory = last["memory ratio softmax+RPE / fft"]
    reading = (f"Reading: the FFT path (O(N log N), the same relative-position bias) is faster than exact softmax "
               f"with the bias {where}: {last[speed]:.1f}x at N = {last['N']:,}"
               + (f", with {memory:.1f}x less peak memory" if memory == memory else "")
               + ". SDPA has no bias at all (shown for scale, not a like-for-like comparison).")
    return rows, reading


def plot(rows: list[dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    """Two log-log panels, time and peak memory vs N, one line per case (Luo et al. Fig. 1a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import plot_series

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, ylabel in ((axes[0], "time_s", "time per forward (s)"), (axes[1], "peak_mb", "peak memory (MB)")):
        series = {}
        for case in args.cases:
            pts = sorted((r["n"], r[key]) for r in rows if r["case"] == case)
            series[LABELS[case]] = ([p[0] for p in pts], [p[1] for p in pts])
        plot_series(series, path, title=f"{ylabel.split(' (')[0]} vs N", xlabel="sequence length N",
                    ylabel=ylabel, ax=ax, colors={LABELS[c]: f"C{i}" for i, c in enumerate(CASES)})
    fig.suptitle(f"batch {args.batch}, {args.heads} head(s), M={args.features} features, D={args.head_dim}, "
                 f"{args.dtype}, K={args.max_relative_position} (windowed), {args.threads} thread(s)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- crossover


def _time_inprocess(fn: Callable[[], None], min_time: float = 0.2, min_runs: int = 5) -> dict[str, Any]:
    """Median wall and CPU seconds of ``fn`` (``{"time_s", "cpu_s", "runs"}``) after a warm-up, over at
    least ``min_runs`` runs and ``min_time`` s (:func:`hf_kernattn.bench.common.time_runs`)."""
    from .common import time_runs

    fn()
    return time_runs(fn, repeats=min_runs, min_seconds=min_time)


CROSSOVER_PAIRS = {  # kind of call: (dense case, O(N) case)
    "plain": ("dense", "linear"),
    "causal": ("dense_causal", "causal_chunked"),
    "rpe": ("dense_rpe", "fft_rpe"),
}


def crossover(args: argparse.Namespace) -> dict[str, Any]:
    """Time dense vs the O(N) forms for small N (in-process: microseconds, so no subprocesses).

    Returns ``{key: largest N where dense was faster, followed only by N where it was not}``
    per :data:`CROSSOVER_PAIRS`, plus the raw ``rows``.
    """
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    result: dict[str, Any] = {}
    for key, (dense_case, fast_case) in CROSSOVER_PAIRS.items():
        dense_wins = []
        for n in args.crossover_ns:
            t: dict[str, float] = {}
            cpu: dict[str, float] = {}
            for case in (dense_case, fast_case, dense_case, fast_case):  # interleaved, best of two
                fn = workload(case, n, batch=args.batch, heads=args.heads, features=args.crossover_dim,
                              head_dim=args.crossover_dim, dtype=args.dtype, device=args.device)
                timed = _time_inprocess(fn)
                t[case] = min(t.get(case, math.inf), timed["time_s"])
                cpu[case] = min(cpu.get(case, math.inf), timed["cpu_s"])
            rows.append({"pair": key, "n": n, "dense_s": t[dense_case], "linear_form_s": t[fast_case],
                         "dense/linear_form": t[dense_case] / t[fast_case],
                         "dense_cpu_s": cpu[dense_case], "linear_form_cpu_s": cpu[fast_case],
                         "dense/linear_form CPU time": cpu[dense_case] / cpu[fast_case] if cpu[fast_case] else math.nan})
            dense_wins.append(t[dense_case] < t[fast_case])
            _info(f"  {key:6s} N={n:5d} dense {t[dense_case] * 1e3:8.3f} ms  {fast_case:14s} {t[fast_case] * 1e3:8.3f} ms")
        # largest N at which dense wins such that the O(N) form wins at every larger measured N
        limit = args.crossover_ns[0] // 2
        for n, win in zip(args.crossover_ns, dense_wins):
            if win:
                limit = n
        result[key] = limit
    result["rows"] = rows
    return result


# ----------------------------------------------------------------------------- overhead


def overhead(args: argparse.Namespace, ns: tuple[int, ...]) -> list[dict[str, Any]]:
    """The public call against the bare kernel (:data:`OVERHEAD_CASES`) at every N, alternated
    over ``--rounds`` rounds in fresh processes. One row per (backend, N): median times and peak
    memory of both, and the per-round ratios public / bare (wall time, CPU time, peak memory)
    as median [min-max]. Peak memory comes from two more processes per round with a fixed mmap
    threshold (``common.FIXED_MMAP_THRESHOLD``: the peak of the live tensors, the same in every
    process; with glibc's default the same run's peak varies by +-20%), times from processes
    with the default allocator; their peaks are kept as ``... MB (default allocator)``."""
    from .common import FIXED_MMAP_THRESHOLD, alternate, format_spread, per_round_ratios, spread

    rows = []
    for n in ns:
        for backend, case in OVERHEAD_CASES.items():
            kwargs = dict(n=n, batch=args.batch, heads=args.heads, features=args.features, head_dim=args.head_dim,
                          dtype=args.dtype, device=args.device, clip=args.max_relative_position, backward=args.backward)
            memory = {"extra_env": FIXED_MMAP_THRESHOLD, "repeats": 1}
            cases = [("public", "attention:workload", {**kwargs, "case": case}),
                     ("bare", "attention:workload", {**kwargs, "case": "bare_" + case}),
                     ("public memory", "attention:workload", {**kwargs, "case": case}, memory),
                     ("bare memory", "attention:workload", {**kwargs, "case": "bare_" + case}, memory)]
            measured = alternate(cases, rounds=args.rounds, repeats=args.repeats, timeout_s=args.timeout,
                                 max_seconds=args.max_seconds, extra_path=_flat_path(), threads=args.threads)
            public, bare = measured["public"], measured["bare"]
            bad = [r["status"] for results in measured.values() for r in results if r["status"] != "ok"]
            row: dict[str, Any] = {"backend": backend, "N": n}
            for name in ("public", "bare"):
                row[f"{name} s"] = spread(r["time_s"] for r in measured[name])[0]
                row[f"{name} CPU s"] = spread(r["cpu_s"] for r in measured[name])[0]
                row[f"{name} MB"] = spread(r["peak_mb"] for r in measured[f"{name} memory"])[0]
                row[f"{name} MB (default allocator)"] = spread(r["peak_mb"] for r in measured[name])[0]
            for label, key in (("time", "time_s"), ("CPU time", "cpu_s")):
                row[f"{label} public/bare"] = format_spread(per_round_ratios(public, bare, key))
            row["peak memory public/bare"] = format_spread(
                per_round_ratios(measured["public memory"], measured["bare memory"], "peak_mb"))
            row["status"] = bad[0] if bad else "ok"
            rows.append(row)
            _info(f"  N={n:6d} {backend:15s} time {row['time public/bare']}  CPU {row['CPU time public/bare']}  "
                  f"memory {row['peak memory public/bare']}  {row['status']}")
    return rows


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from .common import build_parser as common_parser

    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .common import add_common_arguments

    add_common_arguments(parser, NAME, f"only N in {QUICK_NS}, 2 repeats, no unfold variant (the demo)")
    parser.add_argument("--ns", type=int, nargs="+", default=None, help=f"sequence lengths (default {FULL_NS})")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="heads (default 1; 8 with --overhead)")
    parser.add_argument("--features", type=int, default=None,
                        help="M, feature-map size of q and k (default 32; 64 with --overhead)")
    parser.add_argument("--head-dim", type=int, default=64, help="D, value (and softmax q/k) size")
    parser.add_argument("--max-relative-position", type=int, default=128, help="K of the windowed case's clipped bias")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case and round (median)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per N (ratios: median [min-max])")
    parser.add_argument("--backward", action="store_true", help="time forward+backward (gradients for q, k, v and the bias)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a case is killed")
    parser.add_argument("--max-seconds", type=float, default=40.0, help="stop repeating a case after this long")
    parser.add_argument("--max-nn-gb", type=float, default=6.0, help="skip softmax cases whose N x N matrices exceed this")
    parser.add_argument("--crossover", action="store_true",
                        help="measure dense vs linear/causal_chunked/fft for small N")
    parser.add_argument("--crossover-ns", type=int, nargs="+", default=list(CROSSOVER_NS))
    parser.add_argument("--crossover-dim", type=int, default=64, help="M = D for the crossover")
    parser.add_argument("--overhead", action="store_true",
                        help="time and peak memory of kernelized_attention against the bare kernel it runs, for "
                             f"{', '.join(OVERHEAD_CASES)} (default N {OVERHEAD_NS}, 8 heads, M = D = 64)")


def run(args: argparse.Namespace) -> int:
    from .common import format_table, write_csv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.heads is None:
        args.heads = 8 if args.overhead else 1
    if args.features is None:
        args.features = 64 if args.overhead else 32
    if args.overhead:
        ns = tuple(args.ns) if args.ns else (QUICK_OVERHEAD_NS if args.quick else OVERHEAD_NS)
        _info(f"public call vs bare kernel: N in {list(ns)}, batch {args.batch}, heads {args.heads}, M={args.features}, "
              f"D={args.head_dim}, K={args.max_relative_position} (windowed), {args.dtype}, "
              f"{'forward+backward' if args.backward else 'forward'}, {args.rounds} rounds, {args.threads} thread(s)")
        rows = overhead(args, ns)
        csv_path = write_csv(rows, out / "overhead.csv")
        print("\n" + format_table(rows, list(rows[0])))
        print(f"\nratios public / bare per round, median [min-max]; wrote {csv_path}")
        return 0
    if args.crossover:
        res = crossover(args)
        write_csv(res["rows"], out / "crossover.csv")
        print("\n" + format_table(res["rows"], ["pair", "n", "dense_s", "linear_form_s", "dense/linear_form",
                                                 "dense/linear_form CPU time"]))
        measured = {k: res[k] for k in CROSSOVER_PAIRS}
        print(f"\nlargest N where dense is faster = {measured}")
        print(f"wrote {out / 'crossover.csv'}")
        return 0
    ns = tuple(args.ns) if args.ns else (QUICK_NS if args.quick else FULL_NS)
    if args.quick:
        args.repeats = min(args.repeats, 2)
        args.rounds = min(args.rounds, 2)
        if list(args.cases) == list(CASES):  # keep the demo short: one softmax+RPE variant
            args.cases = [c for c in CASES if c != "softmax_rpe_unfold"]
    _info(f"attention benchmark: N in {list(ns)}, batch {args.batch}, heads {args.heads}, M={args.features}, "
          f"D={args.head_dim}, K={args.max_relative_position} (windowed), {args.dtype}, {args.threads} thread(s)")
    rows = _measure_all(args, ns)
    summary = summarize(rows)
    csv_path = write_csv(rows, out / "attention_bench.csv")
    png_path = out / "attention_bench.png"
    plot(rows, png_path, args)
    cols = ["N"] + [f"{c} {u}" for c in args.cases for u in ("s", "MB")] + [
        "speed-up fft vs softmax+RPE", *SPREAD_COLUMNS, "memory ratio softmax+RPE / fft", "speed-up windowed vs softmax+RPE",
        "speed-up fft vs softmax+RPE (unfold mask)", "memory ratio softmax+RPE (unfold mask) / fft", "fft time(N)/time(N/2)"]
    if "softmax_rpe_unfold" not in args.cases:
        cols = [c for c in cols if "unfold" not in c]
    if "windowed_rpe" not in args.cases:
        cols = [c for c in cols if "windowed" not in c]
    if not args.quick:  # every column (the CSV holds them too); the demo's quick run prints the short table
        print("\n" + format_table(summary, cols))
    if {"fft_rpe", "softmax_rpe", "sdpa"} <= set(args.cases):
        brief, reading = brief_summary(summary)
        print("\n" + format_table(brief, list(BRIEF_COLUMNS)))
        print("\n" + reading)
    statuses = [f"- {r['case']} N={r['n']}: {r['status']}" for r in rows if r["status"] != "ok"]
    if statuses:
        print("\nnot measured:\n" + "\n".join(statuses))
    print(f"\nwrote {csv_path} and {png_path} (open it: time and peak memory against N, every case)")
    return 0
