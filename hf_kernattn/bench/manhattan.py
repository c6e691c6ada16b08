"""The ``manhattan`` backend against ``dense`` and against its arithmetic floor, time and memory.

One attention layer at ViT-Base width (``--heads`` 12, M = D = 64, the ViT's ``rpe="manhattan"``
bias clipped at ``--clip`` 16) on square grids (default 14, 32, 64, 128 patches a side), batch 1,
the public ``kernelized_attention`` call with the per-distance table ``(H, K+1)``:

* ``manhattan``: the backend (matrix products over tiles of the grid).
* ``offsets``: the same formula summed offset by offset (``2K^2 - 2K + 1`` elementwise passes;
  the form kept for ``torch.export`` with a dynamic grid, and the backend's earlier algorithm).
* ``dense``: the quadratic form, ``N x N`` matrices.
* ``matmul``: a ``1024 x 64`` by ``64 x 1024`` float matrix product, the machine's matrix rate
  at the contraction size of the layer (in cache, one thread): the rate of the floor.

The floor of a call is the arithmetic it must do divided by that rate: ``2 (M + D + 1)`` flops
for every (query, key) pair of the grid closer than K (the near sum), plus ``4 N M (D + 1)``
(the far term ``q (k^T [v, 1])``); forward+backward counts ``2 (4M + 3(D+1))`` per near pair
(scores, their gradient, and the gradients of q, k and v) plus twice the far term.

Each case runs in a fresh process (``common.measure``: peak resident memory above the inputs;
median of a few runs of wall time and of CPU time); the cases of a grid alternate
(``common.alternate``) over ``--rounds`` rounds and ratios are given per round as median [min-max]. Forward by default,
``--backward`` for forward+backward (gradients for q, k, v and the table). Cases whose
estimated memory exceeds ``--max-gb`` are skipped. Writes ``manhattan_bench.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "manhattan"
CASES = ("manhattan", "offsets", "dense", "matmul")
FULL_GRIDS = (14, 32, 64, 128)
QUICK_GRIDS = (14, 32)

TARGET = "hf_kernattn.bench.manhattan:workload"


def near_pairs(grid: int, clip: int) -> int:
    """(query, key) pairs of a ``grid x grid`` grid at Manhattan distance ``< clip``."""
    per_offset = [2 * (grid - d) if d else grid for d in range(grid)]  # pairs of rows (or columns) |dy| = d apart
    return sum(per_offset[a] * per_offset[b] for a in range(min(grid, clip)) for b in range(min(grid, clip)) if a + b < clip)


def floor_flops(grid: int, clip: int, features: int, head_dim: int, heads: int, backward: bool) -> float:
    """The arithmetic of one call (see the module docstring)."""
    n, e = grid * grid, head_dim + 1
    per_pair = 2 * (4 * features + 3 * e) if backward else 2 * (features + e)
    far = 4 * n * features * e * (2 if backward else 1)
    return heads * (near_pairs(grid, clip) * per_pair + far)


def workload(case: str, grid: int = 32, clip: int = 16, heads: int = 12, features: int = 64, head_dim: int = 64,
             backward: bool = False, dtype: str = "float32"):
    """A zero-argument callable running one call of ``case`` (inputs built before it returns)."""
    import torch

    if case == "matmul":
        a = torch.randn(1024, 64, dtype=getattr(torch, dtype))
        b = torch.randn(64, 1024, dtype=getattr(torch, dtype))

        def run_matmul() -> None:
            for _ in range(20):
                a @ b
        return run_matmul

    from hf_kernattn import kernelized_attention
    from hf_kernattn.modeling import kernels_manhattan

    if case == "offsets":  # the offset-by-offset near sum, as for a symbolic grid
        kernels_manhattan._symbolic = lambda *sizes: True
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    n = grid * grid
    q = torch.rand(1, heads, n, features, generator=gen, dtype=dt)
    k = torch.rand(1, heads, n, features, generator=gen, dtype=dt)
    v = torch.randn(1, heads, n, head_dim, generator=gen, dtype=dt)
    table = 0.3 * torch.randn(heads, clip + 1, generator=gen, dtype=dt)
    backend = "dense" if case == "dense" else "manhattan"
    inputs = [x.requires_grad_(backward) for x in (q, k, v, table)]

    def call():
        q, k, v, table = inputs
        bias = table if backend == "manhattan" else kernels_manhattan.manhattan_table(table, grid, grid)
        return kernelized_attention(q, k, v, rpe_bias=bias, grid=(grid, grid), rpe_clip=clip, backend=backend)

    def run() -> None:
        if backward:
            call().sum().backward()
            for x in inputs:
                x.grad = None
        else:
            with torch.no_grad():
                call()
    return run


def _estimated_gb(case: str, grid: int, clip: int, heads: int, backward: bool) -> float:
    n = grid * grid
    if case == "dense":
        return heads * n * n * 4 * (5 if backward else 2) / 2**30
    if case == "offsets":
        return heads * n * 65 * 4 * (2 * clip * clip * 3 if backward else 3) / 2**30
    return 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .common import add_common_arguments

    add_common_arguments(parser, NAME, f"grids {list(QUICK_GRIDS)}, 2 rounds")
    parser.add_argument("--grids", type=int, nargs="+", default=None, help=f"grid sides (default {list(FULL_GRIDS)})")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--features", type=int, default=64, help="M, feature-map size of q and k")
    parser.add_argument("--head-dim", type=int, default=64, help="D, value size")
    parser.add_argument("--clip", type=int, default=16, help="K: distances >= K share one bias (the ViT's max_relative_position)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--backward", action="store_true", help="time forward+backward")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case and round (median)")
    parser.add_argument("--max-gb", type=float, default=6.0, help="skip cases estimated to need more memory")
    parser.add_argument("--timeout", type=float, default=600.0)


def build_parser() -> argparse.ArgumentParser:
    from .common import build_parser as common_parser

    return common_parser(NAME, __doc__, add_arguments)


def run(args: argparse.Namespace) -> int:
    from .common import alternate, format_spread, format_table, write_csv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grids = tuple(args.grids) if args.grids else (QUICK_GRIDS if args.quick else FULL_GRIDS)
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    rows, summary = [], []
    mode = "forward+backward" if args.backward else "forward"
    print(f"manhattan benchmark ({mode}): grids {list(grids)}, H={args.heads}, M={args.features}, D={args.head_dim}, "
          f"K={args.clip}, {args.dtype}, {args.threads} thread(s), {rounds} alternated rounds")
    for grid in grids:
        cases = [c for c in args.cases
                 if _estimated_gb(c, grid, args.clip, args.heads, args.backward) <= args.max_gb]
        specs = [(case, TARGET, dict(case=case, dtype=args.dtype) if case == "matmul" else
                  dict(case=case, grid=grid, clip=args.clip, heads=args.heads, features=args.features,
                       head_dim=args.head_dim, backward=args.backward, dtype=args.dtype))
                 for case in cases]
        results = alternate(specs, rounds=rounds, repeats=args.repeats, timeout_s=args.timeout, threads=args.threads)
        if "matmul" in results:  # 20 products a run -> one product
            results["matmul"] = [{**r, "time_s": r["time_s"] / 20, "cpu_s": r["cpu_s"] / 20} for r in results["matmul"]]
        rows += [{"grid": grid, "mode": mode, "round": rnd, "case": case, **r}
                 for case, per_round in results.items() for rnd, r in enumerate(per_round)]
        flops = floor_flops(grid, args.clip, args.features, args.head_dim, args.heads, args.backward)
        line: dict[str, Any] = {"grid": f"{grid}x{grid}", "N": grid * grid}
        for case in ("manhattan", "offsets", "dense"):
            if case in results:
                ok = [r for r in results[case] if r["status"] == "ok"]
                line[f"{case} cpu s"] = f"{min((r['cpu_s'] for r in ok), default=float('nan')):.4f}"
                line[f"{case} MB"] = f"{max((r['peak_mb'] for r in ok), default=float('nan')):.0f}"
        for other in ("dense", "offsets"):
            if "manhattan" in results and other in results:
                for key, unit in (("cpu_s", "cpu"), ("time_s", "wall")):
                    ratios = [a[key] / b[key] for a, b in zip(results["manhattan"], results[other])]
                    line[f"manhattan/{other} {unit}"] = format_spread(ratios)
        if "manhattan" in results and "matmul" in results:
            floors = [flops / (2 * 1024 * 64 * 1024 / m["cpu_s"]) / a["cpu_s"]
                      for a, m in zip(results["manhattan"], results["matmul"])]
            line["manhattan share of floor (cpu)"] = format_spread(floors, unit="")
        summary.append(line)
        print(format_table([line], list(line)), flush=True)
    write_csv(rows, out / "manhattan_bench.csv")
    print("\n" + format_table(summary, list({k: None for line in summary for k in line})))
    print(f"wrote {out / 'manhattan_bench.csv'}")
    return 0

