"""Decoding speed and memory: Linear GPT with its recurrent state vs recomputing vs GPT-2 + KV cache.

Three models of one shape (hidden 512, 6 layers, 8 heads, MLP 2048, byte vocabulary of 256):

* ``linear_state``: Linear GPT decoding with its constant-size state (``past_key_values``).
* ``linear_nostate``: the same model with ``use_cache=False``: every new token re-runs the
  whole (causal, linear-time) forward over the context.
* ``gpt2_kv``: ``transformers`` ``GPT2LMHeadModel`` with SDPA attention and a ``DynamicCache``.

Per-token latency: each case runs in a fresh process (``bench.common.measure``); its setup
builds the model and a context of ``L`` tokens (Linear GPT: a real prefill; GPT-2: a KV cache of
the same shape filled with random keys/values, since a decoding step's cost depends only on the
shapes), then the timed part decodes ``--new-tokens`` tokens one forward call at a time, exactly
the calls ``generate()`` makes, starting from a copy of the prefilled state each repeat. Peak
memory is the resident-set growth during decoding above the prefilled state; ``state_mb`` is the
size of the state itself (S, z per layer vs. keys and values per layer).

Throughput: ``generate()`` for a batch of sequences of 784 tokens (Katharopoulos et al. 2020,
Table 1: MNIST-sized images as pixel sequences), greedy, from a one-token prompt.

Continuation (``--continuation`` runs only this): Linear GPT with a learned relative-position
bias clipped at K (``--continuation-clips``, default 64 and 512) continuing from a returned state
with ``--continuation-tokens`` (1024) new tokens in one call, against a stateless forward of the
same tokens (``use_cache=False``). The state comes from a prefill of ``--continuation-prompt``
(256) tokens outside the timed part. The two cases alternate (stateless, continuation,
stateless, ...) over ``--rounds`` rounds, each in a fresh process; the ratio continuation /
stateless is reported per round and as median [min-max].
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from transformers.utils import logging

from .common import format_table, measure, plot_series, write_csv

logger = logging.get_logger(__name__)

NAME = "generate"
TARGET = "hf_kernattn.bench.generate"
SHAPE = dict(hidden=512, layers=6, heads=8, vocab=256)
MODELS = ("linear_state", "linear_nostate", "gpt2_kv")


def _build(model: str, max_positions: int, hidden: int, layers: int, heads: int, vocab: int, clip: int = 0):
    """The model of one case; ``clip > 0``: Linear GPT with a learned bias clipped at ``clip`` and
    no absolute positions."""
    import torch

    torch.manual_seed(0)
    if model.startswith("linear"):
        from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM

        positions = dict(rpe="learned", max_relative_position=clip, position_embedding_type="none") if clip else {}
        cfg = LinearGPTConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=max_positions, **positions,
        )
        return LinearGPTForCausalLM(cfg).eval()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=4 * hidden,
        n_positions=max_positions, attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(cfg).eval()


def decode_workload(
    model: str, context: int, new_tokens: int, batch: int = 1, hidden: int = 512, layers: int = 6,
    heads: int = 8, vocab: int = 256, device: str = "cpu",
) -> Callable[[], None]:
    """Setup (model + context of ``context`` tokens), then a callable decoding ``new_tokens`` tokens."""
    import torch

    net = _build(model, context + new_tokens + 1, hidden, layers, heads, vocab).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
    first = ids[:, -1:]
    torch.set_grad_enabled(False)
    if model == "linear_state":
        cache = None
        for s in range(0, context - 1, 1024):  # real prefill, in chunks to bound memory
            cache = net(ids[:, s : min(s + 1024, context - 1)], past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values

        def run() -> None:
            state = cache.copy() if cache is not None else None
            tok = first
            for _ in range(new_tokens):
                out = net(tok, past_key_values=state, use_cache=True, logits_to_keep=1)
                state = out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)

        return run
    if model == "linear_nostate":
        def run() -> None:
            seq = ids
            for _ in range(new_tokens):
                out = net(seq, use_cache=False, logits_to_keep=1)
                seq = torch.cat([seq, out.logits[:, -1:].argmax(-1)], dim=1)

        return run
    if model == "gpt2_kv":
        from transformers import DynamicCache

        head_dim = hidden // heads
        kv = DynamicCache(config=net.config)
        for layer in range(layers):
            k = torch.randn(batch, heads, context - 1, head_dim, generator=gen).to(device)
            v = torch.randn(batch, heads, context - 1, head_dim, generator=gen).to(device)
            kv.update(k, v, layer)

        def run() -> None:
            extra = kv.get_seq_length() - (context - 1)
            if extra > 0:
                kv.crop(-extra)
            tok = first
            pos = context - 1
            for _ in range(new_tokens):
                out = net(tok, past_key_values=kv, use_cache=True, logits_to_keep=1,
                          position_ids=torch.full((batch, 1), pos, device=device))
                tok = out.logits[:, -1:].argmax(-1)
                pos += 1

        return run
    raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")


def throughput_workload(
    model: str, batch: int, seq_len: int, hidden: int = 512, layers: int = 6, heads: int = 8, vocab: int = 256,
    device: str = "cpu",
) -> Callable[[], None]:
    """A callable that runs ``generate()`` for ``batch`` sequences of ``seq_len`` tokens."""
    import torch

    net = _build(model, seq_len + 1, hidden, layers, heads, vocab).to(device)
    prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)
    new = seq_len - 1
    use_cache = model != "linear_nostate"

    def run() -> None:
        with torch.no_grad():
            net.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, use_cache=use_cache, pad_token_id=0, eos_token_id=None,
            )

    return run


CONTINUATION_MODES = ("stateless", "continuation")


def continuation_workload(
    mode: str, clip: int, new_tokens: int = 1024, prompt: int = 256, hidden: int = 512, layers: int = 6,
    heads: int = 8, vocab: int = 256, device: str = "cpu",
) -> Callable[[], None]:
    """Linear GPT with a bias clipped at ``clip``: a callable running ``new_tokens`` tokens either
    as a stateless forward (``mode="stateless"``) or in one call continuing from the state after
    a ``prompt``-token prefill (``mode="continuation"``; the prefill is set-up, not timed)."""
    import torch

    if mode not in CONTINUATION_MODES:
        raise ValueError(f"mode must be one of {list(CONTINUATION_MODES)}, got {mode!r}")
    net = _build("linear_state", prompt + new_tokens + 1, hidden, layers, heads, vocab, clip=clip).to(device)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (1, prompt + new_tokens), generator=gen).to(device)
    torch.set_grad_enabled(False)
    if mode == "stateless":
        def run() -> None:
            net(ids[:, prompt:], use_cache=False, logits_to_keep=1)

        return run
    state = net(ids[:, :prompt], use_cache=True, logits_to_keep=1).past_key_values

    def run() -> None:
        net(ids[:, prompt:], past_key_values=state.copy(), use_cache=True, logits_to_keep=1)

    return run


def continuation(args: argparse.Namespace, shape: dict) -> list[dict[str, Any]]:
    """The continuation case (see the module docstring): one row per clip and round, then one
    summary row per clip (``round = "median [min-max]"``)."""
    import statistics

    rows: list[dict[str, Any]] = []
    for clip in args.continuation_clips:
        ratios = []
        for rnd in range(args.rounds):
            times = {}
            for mode in CONTINUATION_MODES:  # alternated within each round, each in a fresh process
                res = measure(
                    f"{TARGET}:continuation_workload",
                    dict(mode=mode, clip=clip, new_tokens=args.continuation_tokens, prompt=args.continuation_prompt,
                         device=args.device, **shape),
                    repeats=args.repeats, threads=args.threads, timeout_s=900, max_seconds=60,
                )
                times[mode] = res["time_s"]
            ratio = times["continuation"] / times["stateless"]
            ratios.append(ratio)
            rows.append({"clip": clip, "round": rnd, "tokens": args.continuation_tokens, "stateless_s": times["stateless"],
                         "continuation_s": times["continuation"], "ratio": ratio})
            logger.info(f"  continuation K={clip:4d} round {rnd}: stateless {times['stateless']:.3f} s, "
                        f"continuation {times['continuation']:.3f} s, ratio {ratio:.2f}")
        good = [r for r in ratios if r == r]
        spread = (f"{statistics.median(good):.2f} [{min(good):.2f}-{max(good):.2f}]" if good else "nan")
        rows.append({"clip": clip, "round": "median [min-max]", "tokens": args.continuation_tokens,
                     "stateless_s": float("nan"), "continuation_s": float("nan"), "ratio": spread})
    return rows


def state_mb(model: str, context: int, batch: int, hidden: int, layers: int, heads: int) -> float:
    """Size of the decoding state in MB (float32): (S, z) per layer vs. keys + values per layer."""
    d = hidden // heads
    if model == "linear_state":
        return batch * layers * heads * (d * d + d) * 4 / 2**20
    if model == "gpt2_kv":
        return batch * layers * 2 * context * hidden * 4 / 2**20
    return 0.0


def build_parser() -> argparse.ArgumentParser:
    from .common import build_parser as common_parser

    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .common import add_common_arguments

    add_common_arguments(parser, NAME, "a small subset for the demo (about a minute; no continuation case)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192, 16384],
                        help="context lengths L for per-token decoding")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per timed run (state / KV models)")
    parser.add_argument("--nostate-new-tokens", type=int, default=2, help="tokens per timed run without state")
    parser.add_argument("--max-nostate-context", type=int, default=4096,
                        help="largest context for linear_nostate (each token re-runs the whole forward)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra-batch", type=int, default=16,
                        help="also decode a batch of this many sequences (state and KV models; 0 = skip)")
    parser.add_argument("--extra-batch-contexts", type=int, nargs="+", default=[128, 1024, 4096],
                        help="contexts for the batched decode series")
    parser.add_argument("--throughput-batch", type=int, default=16)
    parser.add_argument("--throughput-len", type=int, default=784)
    parser.add_argument("--throughput-nostate", action="store_true",
                        help="also run the throughput case without state (slow: quadratic in the length)")
    parser.add_argument("--continuation", action="store_true", help="run only the continuation case")
    parser.add_argument("--continuation-clips", type=int, nargs="+", default=[64, 512],
                        help="K of the learned bias in the continuation case")
    parser.add_argument("--continuation-tokens", type=int, default=1024, help="new tokens continued in one call")
    parser.add_argument("--continuation-prompt", type=int, default=256, help="prefill before the continuation")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of the continuation case")
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden"], help="model width (all cases)")
    parser.add_argument("--layers", type=int, default=SHAPE["layers"], help="decoder layers (all cases)")
    parser.add_argument("--heads", type=int, default=SHAPE["heads"], help="attention heads (all cases)")


def _ratio(rows: list[dict[str, Any]], model: str, context: int, batch: int = 1) -> float:
    for r in rows:
        if r["model"] == model and r["context"] == context and r["batch"] == batch:
            return r["ms_per_token"]
    return float("nan")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.contexts = [128, 4096]
        args.new_tokens = 16
        args.max_nostate_context = 1024
        args.nostate_new_tokens = 1
        args.repeats = 2
        args.throughput_batch, args.throughput_len = 4, 128
        args.extra_batch = 0
    for name in ("new_tokens", "nostate_new_tokens", "repeats", "throughput_batch", "throughput_len", "threads",
                 "continuation_tokens", "continuation_prompt", "rounds", "hidden", "layers", "heads"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if any(c < 2 for c in args.contexts):
        raise ValueError(f"--contexts must all be >= 2, got {args.contexts}")
    if any(c < 1 for c in args.continuation_clips):
        raise ValueError(f"--continuation-clips must all be >= 1, got {args.continuation_clips}")
    out = Path(args.out)
    shape = dict(SHAPE, hidden=args.hidden, layers=args.layers, heads=args.heads)
    started = time.perf_counter()
    cont_rows = [] if args.quick else continuation(args, shape)
    if cont_rows:
        write_csv(cont_rows, out / "continuation.csv")
        print(format_table(cont_rows, ["clip", "round", "tokens", "stateless_s", "continuation_s", "ratio"]))
    if args.continuation:
        print(f"wrote {out / 'continuation.csv'} in {time.perf_counter() - started:.0f}s")
        return 0
    rows: list[dict[str, Any]] = []
    plan = []
    for model in MODELS:
        contexts = [c for c in args.contexts if model != "linear_nostate" or c <= args.max_nostate_context]
        if model == "linear_nostate" and args.quick:
            contexts = [128, 1024]
        plan += [(model, ctx, 1) for ctx in contexts]
    if args.extra_batch and args.extra_batch > 1:
        plan += [(m, c, args.extra_batch) for m in ("linear_state", "gpt2_kv") for c in args.extra_batch_contexts]
    for model, ctx, batch in plan:
        new = args.nostate_new_tokens if model == "linear_nostate" else args.new_tokens
        res = measure(
            f"{TARGET}:decode_workload",
            dict(model=model, context=ctx, new_tokens=new, batch=batch, device=args.device, **shape),
            repeats=1 if (model == "linear_nostate" and ctx >= 2048) else args.repeats,
            threads=args.threads, timeout_s=900, max_seconds=60,
        )
        row = {
            "model": model, "batch": batch, "context": ctx, "ms_per_token": 1000 * res["time_s"] / new,
            "decode_peak_mb": res["peak_mb"],
            "state_mb": state_mb(model, ctx, batch, shape["hidden"], shape["layers"], shape["heads"]),
            "runs": res["runs"], "status": res["status"],
        }
        rows.append(row)
        logger.info(f"  {model:15s} B={batch:3d} L={ctx:6d}  {row['ms_per_token']:9.2f} ms/step  decode peak "
                    f"{row['decode_peak_mb']:7.1f} MB  state {row['state_mb']:8.2f} MB  [{res['status']}]")
    write_csv(rows, out / "decode_latency.csv")
    print(format_table(rows, ["model", "batch", "context", "ms_per_token", "decode_peak_mb", "state_mb", "status"]))

    tp_rows: list[dict[str, Any]] = []
    tp_models = ["linear_state", "gpt2_kv"] + (["linear_nostate"] if args.throughput_nostate else [])
    for model in tp_models:
        res = measure(
            f"{TARGET}:throughput_workload",
            dict(model=model, batch=args.throughput_batch, seq_len=args.throughput_len, device=args.device, **shape),
            repeats=1, threads=args.threads, timeout_s=1800, max_seconds=60,
        )
        tokens = args.throughput_batch * (args.throughput_len - 1)
        tp_rows.append({
            "model": model, "batch": args.throughput_batch, "seq_len": args.throughput_len,
            "seconds": res["time_s"], "tokens_per_s": tokens / res["time_s"] if res["time_s"] == res["time_s"] else float("nan"),
            "peak_mb": res["peak_mb"], "status": res["status"],
        })
    write_csv(tp_rows, out / "generate_throughput.csv")
    print(format_table(tp_rows, ["model", "batch", "seq_len", "seconds", "tokens_per_s", "peak_mb", "status"]))

    # The headline figures of this run.
    lin = {r["context"]: r for r in rows if r["model"] == "linear_state" and r["batch"] == 1}
    ctx_hi = 4096 if 4096 in lin else max(lin)
    ctx_lo = min(lin)
    speedup = _ratio(rows, "gpt2_kv", ctx_hi) / _ratio(rows, "linear_state", ctx_hi)
    flatness = lin[ctx_hi]["ms_per_token"] / lin[ctx_lo]["ms_per_token"]
    summary = [
        {"figure": f"decode speedup vs GPT-2+KV at L={ctx_hi}", "value": speedup},
        {"figure": f"linear latency L={ctx_hi} / L={ctx_lo}", "value": flatness},
        {"figure": f"linear decode peak MB at L={max(lin)} (L={ctx_lo}: {lin[ctx_lo]['decode_peak_mb']:.1f})",
         "value": lin[max(lin)]["decode_peak_mb"]},
    ]
    if args.extra_batch and args.extra_batch > 1 and ctx_hi in args.extra_batch_contexts:
        b = args.extra_batch
        summary.append({"figure": f"decode speedup vs GPT-2+KV at L={ctx_hi}, batch {b}",
                        "value": _ratio(rows, "gpt2_kv", ctx_hi, b) / _ratio(rows, "linear_state", ctx_hi, b)})
    for r in cont_rows:
        if r["round"] == "median [min-max]":
            summary.append({"figure": f"continuation / stateless forward, {r['tokens']} tokens, K={r['clip']}",
                            "value": r["ratio"]})
    if len(tp_rows) >= 2 and tp_rows[1]["tokens_per_s"] == tp_rows[1]["tokens_per_s"]:
        summary.append({"figure": f"throughput ratio linear/GPT-2 (batch {args.throughput_batch} x {args.throughput_len})",
                        "value": tp_rows[0]["tokens_per_s"] / tp_rows[1]["tokens_per_s"]})
    write_csv(summary, out / "generate_summary.csv")
    print(format_table(summary, ["figure", "value"]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {"linear_state": "Linear GPT, state", "linear_nostate": "Linear GPT, no state", "gpt2_kv": "GPT-2 SDPA + KV cache"}
    one = [r for r in rows if r["batch"] == 1]
    series = {labels[m]: ([r["context"] for r in one if r["model"] == m], [r["ms_per_token"] for r in one if r["model"] == m]) for m in MODELS}
    if args.extra_batch and args.extra_batch > 1:
        for m in ("linear_state", "gpt2_kv"):
            sel = [r for r in rows if r["model"] == m and r["batch"] == args.extra_batch]
            series[f"{labels[m]}, batch {args.extra_batch}"] = ([r["context"] for r in sel], [r["ms_per_token"] for r in sel])
    plot_series(series, None, title="decode latency per step (batch 1 unless noted)", xlabel="context length", ylabel="ms per decoding step", ax=axes[0])
    mem = {labels[m]: ([r["context"] for r in one if r["model"] == m],
                       [r["state_mb"] + max(r["decode_peak_mb"], 0.0) if r["decode_peak_mb"] == r["decode_peak_mb"] else float("nan")
                        for r in one if r["model"] == m]) for m in ("linear_state", "gpt2_kv")}
    plot_series(mem, None, title="decode memory (batch 1): state + peak growth", xlabel="context length", ylabel="MB", ax=axes[1])
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "generate.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'decode_latency.csv'}, {out / 'generate_throughput.csv'}, {out / 'generate.png'} "
          f"in {time.perf_counter() - started:.0f}s")
    return 0


def main() -> int:
    return run(build_parser().parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
