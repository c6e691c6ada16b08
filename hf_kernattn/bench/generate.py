"""Decoding speed and memory: Linear GPT with its recurrent state vs recomputing vs GPT-2 with a
KV cache (dynamic and static).

Models of one shape (hidden 512, 6 layers, 8 heads, MLP 2048, byte vocabulary of 256):

* ``linear_state``: Linear GPT decoding with its constant-size state (``past_key_values``).
* ``linear_nostate``: the same model with ``use_cache=False``: every new token re-runs the
  whole (causal, linear-time) forward over the context.
* ``linear_hybrid`` (with ``--softmax-window W``, batch 1 only): the same model with the
  sliding-window hybrid (``softmax_window=W``: exact softmax weights over the last ``W`` keys,
  kernelized beyond) decoding with its state; the summary gives its step over the plain one's
  and over the weights as batch-1 products (which are the same: the hybrid adds no matrices).
* ``gpt2_kv``: ``transformers`` ``GPT2LMHeadModel`` with SDPA attention and a ``DynamicCache``
  (the default of ``generate()``; it grows by concatenation every step).
* ``gpt2_static``: the same GPT-2 with a ``StaticCache`` (preallocated for the whole length,
  written in place: ``generate(..., cache_implementation="static")``), what a user who cares
  about decoding speed picks.
* ``weights``: the time the Linear GPT's weights take as batch-1 matrix products (every linear
  layer once per token, in the layout the model stores them), the bound a decoding step
  approaches; ``weights_row_major``: the same products with ``nn.Linear``'s default row-major
  layout (the layout the model stores them in now: the two agree; an earlier column-major
  storage was compared this way).

Every comparison alternates: the cases of one group run A B C ..., then ... C B A, over
``--rounds`` rounds, each in a fresh process (``bench.common.alternate``), 1 thread by default;
ratios are taken within a round and reported as median [min-max], of the wall time (``value``)
and beside it of the process's CPU time (``cpu_value``; other processes on a shared machine
hardly stretch it).

Per-token latency: each case's setup builds the model and a context of ``L`` tokens (Linear GPT:
a real prefill; GPT-2: a cache of the same shape filled with random keys/values, since a
decoding step's cost depends only on the shapes), then the timed part decodes ``--new-tokens``
tokens one forward call at a time, exactly the calls ``generate()`` makes, starting from the
prefilled state each repeat. Peak memory is the resident-set growth during decoding above the
prefilled state; ``state_mb`` is the size of the state itself (S, z per layer vs. keys and
values per layer).

``generate()`` at batch 1 and a short context (``--short-prompt`` 128 tokens, ``--short-new``
new ones): the whole call, as a user runs it, for Linear GPT and GPT-2 with either cache.

Throughput: ``generate()`` for a batch of sequences of 784 tokens (Katharopoulos et al. 2020,
Table 1: MNIST-sized images as pixel sequences), greedy, from a one-token prompt.

Continuation (``--continuation`` runs only this): Linear GPT with a learned relative-position
bias clipped at K (``--continuation-clips``, default 64 and 512) continuing from a returned state
with ``--continuation-tokens`` (1024) new tokens in one call, against a stateless forward of the
same tokens (``use_cache=False``). The state comes from a prefill of ``--continuation-prompt``
(256) tokens outside the timed part.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from transformers.utils import logging

from .common import alternate, format_spread, format_table, per_round_ratios, plot_series, ratio_spreads, spread, write_csv

logger = logging.get_logger(__name__)

NAME = "generate"
TARGET = "hf_kernattn.bench.generate"
SHAPE = dict(hidden=512, layers=6, heads=8, vocab=256)
MODELS = ("linear_state", "linear_nostate", "gpt2_kv", "gpt2_static")
WEIGHT_LAYOUTS = ("weights", "weights_row_major")
CACHES = {"gpt2_kv": "DynamicCache", "gpt2_static": "StaticCache"}


def _build(model: str, max_positions: int, hidden: int, layers: int, heads: int, vocab: int, clip: int = 0,
           softmax_window: int = 0):
    """The model of one case; ``clip > 0``: Linear GPT with a learned bias clipped at ``clip`` and
    no absolute positions; ``softmax_window > 0`` (``linear_hybrid``): the sliding-window hybrid."""
    import torch

    torch.manual_seed(0)
    if model.startswith("linear"):
        from hf_kernattn import LinearGPTConfig, LinearGPTForCausalLM

        positions = dict(rpe="learned", max_relative_position=clip, position_embedding_type="none") if clip else {}
        if softmax_window:
            positions.update(softmax_window=softmax_window, attn_backend="hybrid")
        cfg = LinearGPTConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=max_positions, **positions,
        )
        return LinearGPTForCausalLM(cfg).eval()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=4 * hidden,
        n_positions=max_positions, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def decode_workload(
    model: str, context: int, new_tokens: int, batch: int = 1, hidden: int = 512, layers: int = 6,
    heads: int = 8, vocab: int = 256, device: str = "cpu", softmax_window: int = 0,
) -> Callable[[], None]:
    """Setup (model + context of ``context`` tokens), then a callable decoding ``new_tokens`` tokens
    (``linear_hybrid``: with ``softmax_window`` W)."""
    import torch

    from ..modeling.cache import CACHE_FIELD

    if (model == "linear_hybrid") != (softmax_window > 0):
        raise ValueError(f"softmax_window > 0 is the linear_hybrid model's (and only its), got {softmax_window!r} "
                         f"for {model!r}")
    net = _build(model, context + new_tokens + 1, hidden, layers, heads, vocab, softmax_window=softmax_window).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
    first = ids[:, -1:]
    torch.set_grad_enabled(False)
    if model in ("linear_state", "linear_hybrid"):
        cache = None
        for s in range(0, context - 1, 1024):  # real prefill, in chunks to bound memory
            cache = net(ids[:, s : min(s + 1024, context - 1)], past_key_values=cache, use_cache=True, logits_to_keep=1)[CACHE_FIELD]

        def run() -> None:
            state = cache.copy() if cache is not None else None
            tok = first
            for _ in range(new_tokens):
                out = net(tok, past_key_values=state, use_cache=True, logits_to_keep=1)
                state = out[CACHE_FIELD]
                tok = out.logits[:, -1:].argmax(-1)

        return run
    if model == "linear_nostate":
        def run() -> None:
            seq = ids
            for _ in range(new_tokens):
                out = net(seq, use_cache=False, logits_to_keep=1)
                seq = torch.cat([seq, out.logits[:, -1:].argmax(-1)], dim=1)

        return run
    if model in ("gpt2_kv", "gpt2_static"):
        from transformers import DynamicCache, StaticCache

        head_dim = hidden // heads
        kv = DynamicCache(config=net.config) if model == "gpt2_kv" else StaticCache(config=net.config, max_cache_len=context + new_tokens)
        for layer in range(layers):
            k = torch.randn(batch, heads, context - 1, head_dim, generator=gen).to(device)
            v = torch.randn(batch, heads, context - 1, head_dim, generator=gen).to(device)
            kv.update(k, v, layer)

        def rewind() -> None:  # back to the prefilled context
            if model == "gpt2_kv":
                extra = kv.get_seq_length() - (context - 1)
                if extra > 0:
                    kv.crop(-extra)
            else:
                for layer in kv.layers:
                    layer.cumulative_length.fill_(context - 1)

        def run() -> None:
            rewind()
            tok = first
            pos = context - 1
            for _ in range(new_tokens):
                out = net(tok, past_key_values=kv, use_cache=True, logits_to_keep=1,
                          position_ids=torch.full((batch, 1), pos, device=device))
                tok = out.logits[:, -1:].argmax(-1)
                pos += 1

        return run
    raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")


def weights_workload(
    layout: str, new_tokens: int, batch: int = 1, hidden: int = 512, layers: int = 6, heads: int = 8, vocab: int = 256,
    device: str = "cpu",
) -> Callable[[], None]:
    """The Linear GPT's weights as batch-1 matrix products: every linear layer (lm head included)
    applied to one input row per token, ``new_tokens`` times; ``layout="weights"`` in the layout
    the model stores them, ``"weights_row_major"`` in ``nn.Linear``'s default layout."""
    import torch

    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"layout must be one of {list(WEIGHT_LAYOUTS)}, got {layout!r}")
    net = _build("linear_state", 2, hidden, layers, heads, vocab).to(device)
    torch.set_grad_enabled(False)
    linears = [(m.weight if layout == "weights" else m.weight.contiguous(), m.bias)
               for m in net.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=device) for w, _ in linears}

    def run() -> None:
        for _ in range(new_tokens):
            for w, b in linears:
                torch.nn.functional.linear(inputs[w.shape[1]], w, b)

    return run


def generate_workload(
    model: str, prompt: int, new_tokens: int, batch: int = 1, hidden: int = 512, layers: int = 6, heads: int = 8,
    vocab: int = 256, device: str = "cpu",
) -> Callable[[], None]:
    """A callable running ``generate()`` as a user does: ``prompt`` tokens in, ``new_tokens``
    greedy tokens out (GPT-2: ``DynamicCache`` for ``gpt2_kv``, ``cache_implementation="static"``
    for ``gpt2_static``)."""
    import torch

    if model not in ("linear_state", "gpt2_kv", "gpt2_static"):
        raise ValueError(f"model must be linear_state, gpt2_kv or gpt2_static, got {model!r}")
    net = _build(model, prompt + new_tokens + 1, hidden, layers, heads, vocab).to(device)
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(3)).to(device)
    extra = {"cache_implementation": "static"} if model == "gpt2_static" else {}

    def run() -> None:
        with torch.no_grad():
            net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None, **extra)

    return run


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

    from ..modeling.cache import CACHE_FIELD

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
    state = net(ids[:, :prompt], use_cache=True, logits_to_keep=1)[CACHE_FIELD]

    def run() -> None:
        net(ids[:, prompt:], past_key_values=state.copy(), use_cache=True, logits_to_keep=1)

    return run


def continuation(args: argparse.Namespace, shape: dict) -> list[dict[str, Any]]:
    """The continuation case (see the module docstring): one row per clip and round, then one
    summary row per clip (``round = "median [min-max]"``)."""
    rows: list[dict[str, Any]] = []
    for clip in args.continuation_clips:
        cases = [(mode, f"{TARGET}:continuation_workload",
                  dict(mode=mode, clip=clip, new_tokens=args.continuation_tokens, prompt=args.continuation_prompt,
                       device=args.device, **shape)) for mode in CONTINUATION_MODES]
        res = alternate(cases, rounds=args.rounds, repeats=args.repeats, threads=args.threads, timeout_s=900, max_seconds=60)
        ratios = per_round_ratios(res["continuation"], res["stateless"])
        cpu_ratios = per_round_ratios(res["continuation"], res["stateless"], "cpu_s")
        for rnd, ratio in enumerate(ratios):
            rows.append({"clip": clip, "round": rnd, "tokens": args.continuation_tokens,
                         "stateless_s": res["stateless"][rnd]["time_s"], "continuation_s": res["continuation"][rnd]["time_s"],
                         "ratio": ratio, "stateless_cpu_s": res["stateless"][rnd].get("cpu_s", float("nan")),
                         "continuation_cpu_s": res["continuation"][rnd].get("cpu_s", float("nan")),
                         "cpu_ratio": cpu_ratios[rnd]})
        rows.append({"clip": clip, "round": "median [min-max]", "tokens": args.continuation_tokens,
                     "stateless_s": float("nan"), "continuation_s": float("nan"), "ratio": format_spread(ratios),
                     "stateless_cpu_s": float("nan"), "continuation_cpu_s": float("nan"),
                     "cpu_ratio": format_spread(cpu_ratios)})
        logger.info(f"  continuation K={clip}: continuation / stateless {format_spread(ratios)}, "
                    f"CPU time {format_spread(cpu_ratios)}")
    return rows


def state_mb(model: str, context: int, batch: int, hidden: int, layers: int, heads: int, new_tokens: int = 0,
             softmax_window: int = 0) -> float:
    """Size of the decoding state in MB (float32): (S, z) per layer (the hybrid's: plus its window
    of ``W - 1`` key features, values and raw keys, and their flags) vs. keys + values per layer
    (the static cache holds the whole length, context + new tokens)."""
    d = hidden // heads
    if model == "linear_state":
        return batch * layers * heads * (d * d + d) * 4 / 2**20
    if model == "linear_hybrid":
        keep = max(softmax_window - 1, 0)
        return batch * layers * (heads * (d * d + d + 3 * keep * d) * 4 + keep) / 2**20
    if model == "gpt2_kv":
        return batch * layers * 2 * context * hidden * 4 / 2**20
    if model == "gpt2_static":
        return batch * layers * 2 * (context + new_tokens) * hidden * 4 / 2**20
    return 0.0


def build_parser() -> argparse.ArgumentParser:
    from .common import build_parser as common_parser

    return common_parser(NAME, __doc__, add_arguments)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .common import add_common_arguments

    add_common_arguments(parser, NAME, "a small subset for the demo (about three minutes; no continuation case)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 16384],
                        help="context lengths L for per-token decoding")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per timed run (state / KV models)")
    parser.add_argument("--nostate-new-tokens", type=int, default=2, help="tokens per timed run without state")
    parser.add_argument("--max-nostate-context", type=int, default=4096,
                        help="largest context for linear_nostate (each token re-runs the whole forward)")
    parser.add_argument("--bound-context", type=int, default=4096,
                        help="the context whose rounds also time the weights as batch-1 products (the decoding bound)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (their median)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of every comparison")
    parser.add_argument("--extra-batch", type=int, default=16,
                        help="also decode a batch of this many sequences (state and KV models; 0 = skip)")
    parser.add_argument("--extra-batch-contexts", type=int, nargs="+", default=[4096],
                        help="contexts for the batched decode series")
    parser.add_argument("--short-prompt", type=int, default=128, help="prompt of the batch-1 generate() case")
    parser.add_argument("--short-new", type=int, default=64, help="new tokens of the batch-1 generate() case")
    parser.add_argument("--throughput-batch", type=int, default=16,
                        help="sequences generated together in the throughput case (default 16)")
    parser.add_argument("--throughput-len", type=int, default=784,
                        help="tokens generated per sequence in the throughput case (default 784)")
    parser.add_argument("--throughput-nostate", action="store_true",
                        help="also run the throughput case without state (slow: quadratic in the length)")
    parser.add_argument("--continuation", action="store_true", help="run only the continuation case")
    parser.add_argument("--continuation-clips", type=int, nargs="+", default=[64, 512],
                        help="K of the learned bias in the continuation case")
    parser.add_argument("--continuation-tokens", type=int, default=1024, help="new tokens continued in one call")
    parser.add_argument("--continuation-prompt", type=int, default=256, help="prefill before the continuation")
    parser.add_argument("--softmax-window", type=int, default=0,
                        help="also decode (batch 1) with the sliding-window hybrid of this W (linear_hybrid; 0 = skip)")
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden"], help="model width (all cases)")
    parser.add_argument("--layers", type=int, default=SHAPE["layers"], help="decoder layers (all cases)")
    parser.add_argument("--heads", type=int, default=SHAPE["heads"], help="attention heads (all cases)")
    parser.add_argument("--replot", metavar="CSV", default=None,
                        help="measure nothing: draw OUT/generate.png again from a decode_latency.csv this command wrote")


def _decode_group(args, shape, ctx: int, batch: int) -> dict[str, list[dict[str, Any]]]:
    """The alternated decoding cases of one context and batch (see the module docstring)."""
    models = ["linear_state", "gpt2_kv", "gpt2_static"]
    if batch == 1 and ctx <= args.max_nostate_context:
        models.append("linear_nostate")
    if batch == 1 and args.softmax_window:
        models.append("linear_hybrid")
    cases = []
    for model in models:
        new = args.nostate_new_tokens if model == "linear_nostate" else args.new_tokens
        slow = model == "linear_nostate" and ctx >= 2048
        hybrid = {"softmax_window": args.softmax_window} if model == "linear_hybrid" else {}
        cases.append((model, f"{TARGET}:decode_workload",
                      dict(model=model, context=ctx, new_tokens=new, batch=batch, device=args.device, **shape, **hybrid),
                      {"repeats": 1 if slow else args.repeats}))
    if ctx == args.bound_context:
        cases += [(layout, f"{TARGET}:weights_workload",
                   dict(layout=layout, new_tokens=args.new_tokens, batch=batch, device=args.device, **shape))
                  for layout in WEIGHT_LAYOUTS]
    return alternate(cases, rounds=args.rounds, repeats=args.repeats, threads=args.threads, timeout_s=900, max_seconds=60)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "replot", None):
        path = replot(args.replot, Path(args.out) / "generate.png")
        print(f"wrote {path} from {args.replot}")
        return 0
    if args.quick:
        args.contexts = [128, 4096]
        args.bound_context = 4096
        args.new_tokens = 16
        args.max_nostate_context = 1024
        args.nostate_new_tokens = 1
        args.repeats = 2
        args.rounds = 2
        args.short_new = 16
        args.throughput_batch, args.throughput_len = 4, 128
        args.extra_batch = 0
    if not isinstance(args.softmax_window, int) or args.softmax_window < 0:
        raise ValueError(f"--softmax-window must be an int >= 0 (0 = no hybrid case), got {args.softmax_window!r}")
    for name in ("new_tokens", "nostate_new_tokens", "repeats", "throughput_batch", "throughput_len", "threads",
                 "continuation_tokens", "continuation_prompt", "rounds", "hidden", "layers", "heads", "short_prompt",
                 "short_new"):
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
        print(format_table(cont_rows, ["clip", "round", "tokens", "stateless_s", "continuation_s", "ratio", "cpu_ratio"]))
    if args.continuation:
        print(f"wrote {out / 'continuation.csv'} in {time.perf_counter() - started:.0f}s")
        return 0

    # per-token decoding, alternated per context (and batch)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    groups = [(ctx, 1) for ctx in args.contexts]
    if args.extra_batch and args.extra_batch > 1:
        groups += [(ctx, args.extra_batch) for ctx in args.extra_batch_contexts]
    for ctx, batch in groups:
        res = _decode_group(args, shape, ctx, batch)
        for model, results in res.items():
            new = args.nostate_new_tokens if model == "linear_nostate" else args.new_tokens
            med, lo, hi = spread(1000 * r["time_s"] / new for r in results)
            rows.append({
                "model": model, "batch": batch, "context": ctx, "ms_per_token": med, "ms_min": lo, "ms_max": hi,
                "cpu_ms_per_token": spread(1000 * r.get("cpu_s", float("nan")) / new for r in results)[0],
                "decode_peak_mb": spread(r["peak_mb"] for r in results)[0],
                "state_mb": state_mb(model, ctx, batch, shape["hidden"], shape["layers"], shape["heads"], new,
                                     args.softmax_window),
                "status": ",".join(sorted({r["status"] for r in results})),
            })
            logger.info(f"  {model:17s} B={batch:3d} L={ctx:6d}  {med:9.2f} ms/token [{lo:.2f}-{hi:.2f}]")
        for other in ("gpt2_kv", "gpt2_static"):
            summary.append({"figure": f"GPT-2 {CACHES[other]} / Linear GPT, ms per token, L={ctx}, batch {batch}",
                            **_ratio_entry(res[other], res["linear_state"])})
        if "weights" in res:
            for layout in WEIGHT_LAYOUTS:
                summary.append({"figure": f"Linear GPT step / its weights as matrix products of {batch} row(s) ({layout}), L={ctx}, batch {batch}",
                                **_ratio_entry(res["linear_state"], res[layout])})
        if "linear_hybrid" in res:
            summary.append({"figure": f"hybrid step (W={args.softmax_window}) / plain step, L={ctx}, batch {batch}",
                            **_ratio_entry(res["linear_hybrid"], res["linear_state"])})
            if "weights" in res:
                summary.append({"figure": f"hybrid step (W={args.softmax_window}) / its weights as matrix products of "
                                          f"{batch} row(s), L={ctx}, batch {batch}",
                                **_ratio_entry(res["linear_hybrid"], res["weights"])})
    write_csv(rows, out / "decode_latency.csv")
    print(format_table(rows, ["model", "batch", "context", "ms_per_token", "ms_min", "ms_max", "cpu_ms_per_token",
                              "decode_peak_mb", "state_mb", "status"]))

    # generate() at batch 1 and a short context, as a user calls it
    gen_models = ("linear_state", "gpt2_kv", "gpt2_static")
    res = alternate([(m, f"{TARGET}:generate_workload",
                      dict(model=m, prompt=args.short_prompt, new_tokens=args.short_new, device=args.device, **shape))
                     for m in gen_models], rounds=args.rounds, repeats=args.repeats, threads=args.threads,
                    timeout_s=900, max_seconds=60)
    short_rows = []
    for m in gen_models:
        med, lo, hi = spread(args.short_new / r["time_s"] for r in res[m])
        short_rows.append({"model": m, "prompt": args.short_prompt, "new_tokens": args.short_new,
                           "tokens_per_s": med, "min": lo, "max": hi})
    for other in ("gpt2_kv", "gpt2_static"):
        summary.append({"figure": f"generate() batch 1, prompt {args.short_prompt}: Linear GPT speed / GPT-2 {CACHES[other]}",
                        **_ratio_entry(res[other], res["linear_state"])})
    write_csv(short_rows, out / "generate_short.csv")
    print(format_table(short_rows, ["model", "prompt", "new_tokens", "tokens_per_s", "min", "max"]))

    # throughput of generate() for a batch of long sequences
    tp_models = ["linear_state", "gpt2_kv"] + (["linear_nostate"] if args.throughput_nostate else [])
    res = alternate([(m, f"{TARGET}:throughput_workload",
                      dict(model=m, batch=args.throughput_batch, seq_len=args.throughput_len, device=args.device, **shape))
                     for m in tp_models], rounds=args.rounds, repeats=1, threads=args.threads, timeout_s=1800, max_seconds=60)
    tokens = args.throughput_batch * (args.throughput_len - 1)
    tp_rows = []
    for m in tp_models:
        med, lo, hi = spread(tokens / r["time_s"] for r in res[m])
        tp_rows.append({"model": m, "batch": args.throughput_batch, "seq_len": args.throughput_len, "tokens_per_s": med,
                        "min": lo, "max": hi, "peak_mb": spread(r["peak_mb"] for r in res[m])[0]})
    summary.append({"figure": f"generate() throughput Linear GPT / GPT-2 (batch {args.throughput_batch} x {args.throughput_len})",
                    **_ratio_entry(res["gpt2_kv"], res["linear_state"])})
    write_csv(tp_rows, out / "generate_throughput.csv")
    print(format_table(tp_rows, ["model", "batch", "seq_len", "tokens_per_s", "min", "max", "peak_mb"]))

    for r in cont_rows:
        if r["round"] == "median [min-max]":
            summary.append({"figure": f"continuation / stateless forward, {r['tokens']} tokens, K={r['clip']}",
                            "value": r["ratio"], "cpu_value": r["cpu_ratio"]})
    write_csv(summary, out / "generate_summary.csv")
    print(format_table(summary, ["figure", "value", "cpu_value"]))
    _plot(rows, out / "generate.png")
    print(f"wrote {out / 'decode_latency.csv'}, {out / 'generate_summary.csv'}, {out / 'generate.png'} "
          f"in {time.perf_counter() - started:.0f}s")
    return 0


def _ratio_entry(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> dict[str, str]:
    """A summary row's ratio ``num / den`` per round as median [min-max]: ``value`` (wall time)
    and ``cpu_value`` (CPU time)."""
    value, cpu_value = ratio_spreads(num, den)
    return {"value": value, "cpu_value": cpu_value}


# the label and colour of each case, the same in every panel
PLOT_LABELS = {"linear_state": "Linear GPT, state", "linear_nostate": "Linear GPT, no state",
               "gpt2_kv": "GPT-2 SDPA + DynamicCache", "gpt2_static": "GPT-2 SDPA + StaticCache"}
PLOT_COLORS = {"linear_state": "C0", "linear_nostate": "C1", "gpt2_kv": "C2", "gpt2_static": "C3"}


def _figure(rows: list[dict[str, Any]]):
    """The decoding figure of ``rows`` (``decode_latency.csv``'s): time per step and state size
    against the context at batch 1, each case in one colour in both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    one = [r for r in rows if int(r["batch"]) == 1 and r["model"] in PLOT_LABELS]
    colors = {PLOT_LABELS[m]: PLOT_COLORS[m] for m in PLOT_LABELS}

    def series(models, field):
        return {PLOT_LABELS[m]: ([float(r["context"]) for r in one if r["model"] == m],
                                 [float(r[field]) for r in one if r["model"] == m]) for m in models}

    plot_series(series(MODELS, "ms_per_token"), None, title="decode latency per token (batch 1, median of rounds)",
                xlabel="context length", ylabel="ms per decoding step", ax=axes[0], colors=colors)
    plot_series(series(("linear_state", "gpt2_kv", "gpt2_static"), "state_mb"), None, title="decoding state (batch 1)",
                xlabel="context length", ylabel="MB", ax=axes[1], colors=colors)
    fig.tight_layout()
    return fig


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = _figure(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(csv_path, png_path) -> Path:
    """Draw the decoding figure again from a ``decode_latency.csv`` this benchmark wrote (e.g.
    ``docs/figures/linear_gpt_decode_latency.csv``), measuring nothing; returns the PNG's path."""
    import csv

    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    need = {"model", "batch", "context", "ms_per_token", "state_mb"}
    if not rows or need - set(rows[0]):
        raise ValueError(f"{csv_path}: not a decode_latency.csv of this benchmark (needs the columns {sorted(need)})")
    _plot(rows, Path(png_path))
    return Path(png_path)


def main() -> int:
    return run(build_parser().parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
