"""PRF approximation error of softmax attention vs feature dimension (Luo et al. 2021, Fig. 1b).

Setting: head size ``d = 64``; ``--keys`` keys and ``--queries`` queries drawn uniformly on the
unit sphere and scaled to norm ``R`` (``R`` in 1, 2, 4). The exact attention is
``A = softmax_j(q_i . k_j)`` (no ``1/sqrt(d)``); the approximation is
``A_hat_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')`` with our
:class:`~hf_kernattn.modeling.feature_maps.FeatureMap` (``feature_map="prf"``,
``normalize_qk=False``, orthogonal or gaussian projections, ``m`` random features).

Scaling, so that the reference is exactly what the map estimates: with ``normalize_qk=False``
``FeatureMap`` multiplies its input by ``d ** -0.25`` and so estimates
``exp(q . k / sqrt(d))``. We feed it ``d ** 0.25 * q`` and ``d ** 0.25 * k``, so it estimates
``exp(q . k)`` for the vectors of norm ``R`` themselves, and compare with ``softmax(q . k)``.
(The query-side stabilising shift of the map cancels in the row normalisation.)

The error is ``||A - A_hat||_1`` as in the paper: the L1 distance between the exact and the
approximated attention row, averaged over query rows, then over ``--seeds`` draws (each seed
draws new queries, keys and projection). Computed in float64. Writes ``prf_approximation.csv``
and ``prf_approximation.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from transformers.utils import logging

logger = logging.get_logger(__name__)

NAME = "approx"
NORMS = (1.0, 2.0, 4.0)
FEATURES = tuple(2**i for i in range(2, 11))  # 4 ... 1024
PROJECTIONS = ("orthogonal", "gaussian")


def _sphere(n: int, d: int, radius: float, generator) -> "torch.Tensor":  # noqa: F821
    """``(n, d)`` float64 points uniform on the sphere of the given radius."""
    import torch

    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    return radius * x / x.norm(dim=-1, keepdim=True)


def approximation_error(
    radius: float, num_features: int, projection: str, seed: int, head_dim: int = 64,
    num_keys: int = 1024, num_queries: int = 1024, device: str = "cpu",
) -> float:
    """Mean over queries of ``sum_j |A_ij - A_hat_ij|`` for one draw (see the module docstring).

    Queries ``(num_queries, d)`` and keys ``(num_keys, d)`` have norm ``radius``; ``A`` and
    ``A_hat`` are ``(num_queries, num_keys)`` row-stochastic matrices.
    """
    import torch

    from ..modeling.feature_maps import FeatureMap

    gen = torch.Generator().manual_seed(10_000 + seed)
    q = _sphere(num_queries, head_dim, radius, gen).to(device)
    k = _sphere(num_keys, head_dim, radius, gen).to(device)
    fmap = FeatureMap(head_dim, feature_map="prf", num_random_features=num_features, projection=projection,
                      normalize_qk=False, seed=seed).double().eval().to(device)
    scale = head_dim**0.25  # cancels the map's d ** -0.25: it then estimates exp(q . k)
    with torch.no_grad():
        exact = torch.softmax(q @ k.T, dim=-1)
        fq = fmap((q * scale)[None, None], is_query=True)[0, 0]  # (num_queries, m)
        fk = fmap((k * scale)[None, None], is_query=False)[0, 0]  # (num_keys, m)
        approx = fq @ fk.T
        approx = approx / approx.sum(dim=-1, keepdim=True)
    return float((exact - approx).abs().sum(dim=-1).mean())


def build_parser() -> argparse.ArgumentParser:
    from .common import build_parser as common_parser

    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .common import add_common_arguments

    add_common_arguments(parser, NAME, "2 seeds, 256 queries")
    parser.add_argument("--norms", type=float, nargs="+", default=list(NORMS), help="R, the norm of queries and keys")
    parser.add_argument("--features", type=int, nargs="+", default=list(FEATURES), help="m values")
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=["orthogonal", "gaussian", "sphere"])
    parser.add_argument("--seeds", type=int, default=5, help="draws averaged per point")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=1024)


def run(args: argparse.Namespace) -> int:
    import torch

    from .common import format_table, plot_series, write_csv

    torch.set_num_threads(args.threads)
    if args.quick:
        args.seeds, args.queries = min(args.seeds, 2), min(args.queries, 256)
    rows: list[dict[str, Any]] = []
    for projection in args.projections:
        for radius in args.norms:
            for m in args.features:
                errs = [approximation_error(radius, m, projection, s, args.head_dim, args.keys, args.queries, args.device)
                        for s in range(args.seeds)]
                mean = sum(errs) / len(errs)
                std = math.sqrt(sum((e - mean) ** 2 for e in errs) / max(len(errs) - 1, 1))
                rows.append({"projection": projection, "R": radius, "m": m, "l1_error": mean, "l1_error_std": std,
                             "seeds": len(errs)})
            logger.info(f"  {projection:10s} R={radius:g}: " + "  ".join(
                f"m={r['m']}:{r['l1_error']:.3g}" for r in rows[-len(args.features):]))
    out = Path(args.out)
    csv_path = write_csv(rows, out / "prf_approximation.csv")
    png_path = out / "prf_approximation.png"
    series = {f"R={r:g}, {p}": ([x["m"] for x in rows if x["R"] == r and x["projection"] == p],
                                [x["l1_error"] for x in rows if x["R"] == r and x["projection"] == p])
              for p in args.projections for r in args.norms}
    plot_series(series, png_path, title=f"PRF approximation error (d={args.head_dim}, {args.keys} keys)",
                xlabel="number of random features m", ylabel="mean_i ||A_i - A_hat_i||_1")
    table = []
    for p in args.projections:
        for r in args.norms:
            row: dict[str, Any] = {"projection": p, "R": r}
            row.update({f"m={x['m']}": x["l1_error"] for x in rows if x["R"] == r and x["projection"] == p})
            table.append(row)
    print("\n" + format_table(table, ["projection", "R"] + [f"m={m}" for m in args.features]))
    falls = all(
        (lambda e: e[-1] < e[0])([x["l1_error"] for x in rows if x["R"] == r and x["projection"] == p])
        for p in args.projections for r in args.norms
    )
    print(f"\nerror falls from the smallest to the largest m for every (R, projection): {falls}")
    print(f"wrote {csv_path} and {png_path}")
    return 0
