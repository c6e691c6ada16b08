"""NPRF-BERT vs BertModel with SDPA: forward and forward+backward time and peak memory over N.

Both models have the same shape (BERT-base widths by default: hidden 768, 12 heads,
intermediate 3072, ``--layers`` encoder layers, batch 1) and the same absolute position table;
NPRF-BERT adds PRF features (``--features`` per head) and a shared relative-position bias
clipped at ``--max-relative-position`` (default 512, the config default), evaluated by the
backend ``--backend`` (default ``auto``: what the calibration table ranks first, e.g. ``dense``
and then the O(N K) ``windowed`` backend, ``hf-kernattn bench calibrate --describe``; ``fft``
forces the O(N log N) Toeplitz FFT), and by default
recomputing its attention blocks in the backward pass (``recompute_attention``;
``--no-recompute`` keeps them, as BertModel does). Each (model, N, mode) case runs in its own process
(:func:`hf_kernattn.bench.common.measure`), the two models alternating over ``--rounds``
rounds (:func:`hf_kernattn.bench.common.alternate`): peak memory is the peak resident set over the
process's baseline after the model and inputs exist; time is the median of ``--repeats`` runs
after one warm-up, then the median over rounds; the speed-up is also given per round as median
[min-max], of the wall time and of the process's CPU time (which other processes on a shared
machine hardly stretch). Cases that fail (out of memory, over the time limit) are reported as such.
Writes ``encoder.csv`` and ``encoder.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from transformers.utils import logging

from .common import (
    add_common_arguments,
    add_model_size_arguments,
    alternate,
    build_parser as common_parser,
    format_table,
    hidden_state_step,
    plot_series,
    ratio_spreads,
    spread,
    write_csv,
)

logger = logging.get_logger(__name__)

NAME = "encoder"
FULL_NS = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_NS = [512, 1024, 2048]


def workload(
    model: str,
    n: int,
    mode: str,
    layers: int = 2,
    hidden: int = 768,
    heads: int = 12,
    intermediate: int = 3072,
    features: int = 64,
    batch: int = 1,
    device: str = "cpu",
    backend: str = "auto",
    max_relative_position: int = 512,
    recompute_attention: bool = True,
) -> Callable[[], None]:
    """Build one model and its inputs; return a callable doing one forward (``mode="fwd"``,
    under ``torch.no_grad``) or one forward+backward (``mode="fwdbwd"``) on ``(batch, n)`` ids.

    ``model``: ``"nprf"`` (NPRF-BERT with ``attn_backend=backend``) or ``"bert"`` (``transformers.BertModel``,
    ``attn_implementation="sdpa"``). Dropout is 0 in both so they do the same work every run.
    """
    import torch

    if model not in ("nprf", "bert"):
        raise ValueError(f"model must be 'nprf' or 'bert', got {model!r}")
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")
    torch.manual_seed(0)
    common = dict(
        vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=max(n, 512), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if model == "nprf":
        from hf_kernattn.modeling.configuration_nprf_bert import NPRFBertConfig
        from hf_kernattn.modeling.modeling_nprf_bert import NPRFBertModel

        cfg = NPRFBertConfig(**common, num_random_features=features, attn_backend=backend, rpe_init_std=0.02,
                             max_relative_position=max_relative_position,
                             recompute_attention=recompute_attention)
        net = NPRFBertModel(cfg)
    else:
        from transformers import BertConfig, BertModel

        bcfg = BertConfig(**common)
        bcfg._attn_implementation = "sdpa"
        net = BertModel(bcfg)
        if net.config._attn_implementation != "sdpa":
            raise RuntimeError(f"BertModel did not select SDPA (got {net.config._attn_implementation!r})")
    net = net.to(device)
    ids = torch.randint(1, 30522, (batch, n), device=device)
    mask = torch.ones(batch, n, dtype=torch.long, device=device)
    net.train(mode != "fwd")
    return hidden_state_step(net, {"input_ids": ids, "attention_mask": mask}, backward=mode != "fwd")


def build_parser() -> argparse.ArgumentParser:
    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, NAME, f"N in {QUICK_NS}, one layer, one timed run")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help=f"sequence lengths (default {FULL_NS})")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="NPRF-BERT attn_backend (auto, fft, windowed, ...)")
    parser.add_argument("--max-relative-position", type=int, default=512, help="K, where the bias is clipped")
    parser.add_argument("--no-recompute", action="store_true",
                        help="NPRF-BERT keeps its attention intermediates (recompute_attention=False)")
    add_model_size_arguments(parser, hidden=768, heads=12, intermediate=3072, features=64,
                             features_help="PRF random features per head")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per case and round (median); one warm-up before")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternated rounds (BertModel, NPRF-BERT, ...) in fresh processes; speed-up per round as median [min-max]")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a case is reported as timed out")


def _ratio(a: float, b: float) -> float:
    return b / a if a == a and b == b and a > 0 else float("nan")


def run(args: argparse.Namespace) -> int:
    """Run every case, print a Markdown table, write CSV + PNG. Returns 0."""
    for name in ("layers", "hidden", "heads", "intermediate", "features", "batch", "repeats", "rounds"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive int, got {value!r}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    lengths = args.lengths or (QUICK_NS if args.quick else FULL_NS)
    if any(n < 1 for n in lengths):
        raise ValueError(f"--lengths must be positive, got {lengths}")
    layers = 1 if args.quick else args.layers
    repeats = 1 if args.quick else args.repeats
    shape = dict(layers=layers, hidden=args.hidden, heads=args.heads, intermediate=args.intermediate,
                 features=args.features, batch=args.batch, device=args.device)
    nprf_only = dict(backend=args.backend, max_relative_position=args.max_relative_position,
                     recompute_attention=not args.no_recompute)
    rows: list[dict[str, Any]] = []
    rounds = 1 if args.quick else args.rounds
    for n in lengths:
        for mode in ("fwd", "fwdbwd"):
            cases = [(model, "hf_kernattn.bench.encoder:workload",
                      dict(model=model, n=n, mode=mode, **shape, **(nprf_only if model == "nprf" else {})))
                     for model in ("bert", "nprf")]
            runs = alternate(cases, rounds=rounds, repeats=repeats, timeout_s=args.timeout,
                             max_seconds=args.timeout / 2, threads=args.threads)
            res = {}
            for model, results in runs.items():
                bad = [r["status"] for r in results if r["status"] != "ok"]
                res[model] = {"time_s": spread(r["time_s"] for r in results)[0],
                              "cpu_s": spread(r.get("cpu_s", float("nan")) for r in results)[0],
                              "peak_mb": spread(r["peak_mb"] for r in results)[0], "status": bad[0] if bad else "ok"}
                logger.info(f"N={n:6d} {mode:7s} {model:5s} time={res[model]['time_s']:.4g}s "
                            f"peak={res[model]['peak_mb']:.4g}MB {res[model]['status']}")
            wall_spread, cpu_spread = ratio_spreads(runs["bert"], runs["nprf"])
            rows.append({
                "n": n, "mode": mode,
                "bert_sdpa_time_s": res["bert"]["time_s"], "nprf_time_s": res["nprf"]["time_s"],
                "speedup": _ratio(res["nprf"]["time_s"], res["bert"]["time_s"]),
                "speedup_per_round": wall_spread, "cpu_speedup_per_round": cpu_spread,
                "bert_sdpa_cpu_s": res["bert"]["cpu_s"], "nprf_cpu_s": res["nprf"]["cpu_s"],
                "bert_sdpa_peak_mb": res["bert"]["peak_mb"], "nprf_peak_mb": res["nprf"]["peak_mb"],
                "memory_ratio": _ratio(res["nprf"]["peak_mb"], res["bert"]["peak_mb"]),
                "bert_status": res["bert"]["status"], "nprf_status": res["nprf"]["status"],
                **shape, **nprf_only,
            })
    out = Path(args.out)
    write_csv(rows, out / "encoder.csv")
    cols = ["n", "mode", "bert_sdpa_time_s", "nprf_time_s", "speedup", "speedup_per_round", "cpu_speedup_per_round",
            "bert_sdpa_peak_mb", "nprf_peak_mb",
            "memory_ratio", "bert_status", "nprf_status"]
    print(format_table(rows, cols))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for mode, style in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        sel = [r for r in rows if r["mode"] == mode]
        xs = [r["n"] for r in sel]
        plot_series({f"BertModel+SDPA {style}": (xs, [r["bert_sdpa_time_s"] for r in sel]),
                     f"NPRF-BERT {style}": (xs, [r["nprf_time_s"] for r in sel])},
                    None, title="time per step", xlabel="sequence length N", ylabel="seconds", ax=axes[0])
        plot_series({f"BertModel+SDPA {style}": (xs, [r["bert_sdpa_peak_mb"] for r in sel]),
                     f"NPRF-BERT {style}": (xs, [r["nprf_peak_mb"] for r in sel])},
                    None, title="peak memory over baseline", xlabel="sequence length N", ylabel="MiB", ax=axes[1])
        plot_series({f"speedup {style}": (xs, [r["speedup"] for r in sel])},
                    None, title="speedup of NPRF-BERT (BERT time / NPRF time)", xlabel="sequence length N",
                    ylabel="x", logy=False, ax=axes[2])
    axes[2].axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"NPRF-BERT vs BertModel+SDPA, {layers} layers, hidden {args.hidden}, {args.heads} heads, "
                 f"m={args.features}, K={args.max_relative_position}, backend {args.backend}, "
                 f"recompute {'off' if args.no_recompute else 'on'}, batch {args.batch}, "
                 f"{args.device}, {args.threads} thread(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "encoder.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'encoder.csv'} and {out / 'encoder.png'}")
    return 0
