#!/usr/bin/env python
"""Compare four ways of linearizing a softmax GPT-2 on one teacher, one text and one step budget.

The teacher, the text and the evaluation are those of ``finetune_converted.py`` (a small GPT-2
trained here with ``Trainer`` on the Python standard library's sources, offline, or
``--model_name_or_path``; byte tokens; one evaluation function for every model). Every recipe
gets the same budget of ``--steps`` optimizer steps of ``--batch_size`` blocks:

(a) today's recipe: ``convert`` with positive random features (``prf``), then every weight
    fine-tuned with ``Trainer`` for ``--steps`` steps;
(b) attention transfer only: ``hf_kernattn.convert.linearize.linearize`` with a learned feature
    map (``--feature_map``, ``hedgehog``) trained for ``--at_steps`` steps so that each layer
    reproduces the teacher's attention output; evaluated right after it;
(c) (b) then LoRA (``hf_kernattn.lora_config`` through PEFT) fine-tuned with ``Trainer`` for the
    rest of the budget; the adapter is saved, merged, and the merged model saved Hub-ready;
(d) as (c) with the sliding-window hybrid (``softmax_window=--softmax_window``): exact softmax
    over the last W keys, the learned map beyond them.

Decoding is measured for the teacher (its key/value cache) and every recipe: the bytes of the
decoding state after ``--contexts`` tokens of context (1k and 8k by default), and the time per
generated token at the longest context (the model's forward with ``past_key_values``, one token
at a time; wall and CPU time; the models take turns, ``--latency_rounds`` rounds). GPT-2's
absolute position table bounds the trained models to ``--block_size`` positions, so the
decoding measurements use the same architectures built with a position table long enough for
the context: the trained weights, and random rows for the positions beyond the trained ones
(they do not change the cost; the output says which).

Written to ``--output_dir``: ``results.json``, ``results.md`` (the table), ``linearize_compare.png``
(validation loss over the budget with the teacher's loss as the reference line; state size
against context) and the models (``gpt2``, ``a_prf_finetuned``, ``b_attention_transfer``,
``c_lora_adapter``/``c_lora_merged``, ``d_hybrid_attention_transfer``, ``d_lora_adapter``/
``d_lora_merged``).

    python examples/research/linearize_compare.py --output_dir out/linearize_compare
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import Trainer, set_seed
from transformers.utils import logging

from hf_kernattn_cli import docstring_summary  # (the command line's text helpers, without importing the package)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import finetune_converted as fc  # noqa: E402  (the text, teacher and evaluation of the fine-tuning example)

from hf_kernattn.training import NUM_THREADS_HELP, configure_threads  # noqa: E402

logger = logging.get_logger("linearize_compare")

RECIPES = {
    "a": "(a) convert (PRF) + full fine-tuning",
    "b": "(b) attention transfer only",
    "c": "(c) attention transfer + LoRA",
    "d": "(d) sliding-window hybrid + attention transfer + LoRA",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=docstring_summary(__doc__),
                                epilog="example: python examples/research/linearize_compare.py --output_dir out/linearize_compare")
    fc.add_source_arguments(p)
    p.add_argument("--steps", type=int, default=200,
                   help="optimizer steps every recipe may take: (a) fine-tunes for all of them, (c) and (d) split them "
                        "into --at_steps of attention transfer and the rest of LoRA")
    p.add_argument("--at_steps", type=int, default=100, help="attention-transfer steps of (b), (c) and (d)")
    p.add_argument("--batch_size", type=int, default=16, help="blocks per optimizer step (every training)")
    p.add_argument("--learning_rate", type=float, default=2e-3, help="learning rate of the GPT-2 trained here")
    p.add_argument("--finetune_learning_rate", type=float, default=3e-4, help="learning rate of (a)'s full fine-tuning")
    p.add_argument("--at_learning_rate", type=float, default=3e-2, help="learning rate of attention transfer")
    p.add_argument("--lora_learning_rate", type=float, default=3e-3, help="learning rate of the LoRA fine-tuning")
    p.add_argument("--lora_r", type=int, default=8, help="LoRA rank (lora_alpha = 2 r)")
    p.add_argument("--num_random_features", type=int, default=128, help="PRF features per head of (a)")
    p.add_argument("--feature_seed", type=int, default=0, help="seed of (a)'s random feature projections")
    p.add_argument("--feature_map", default="hedgehog", choices=("hedgehog", "hedgehog_exp"),
                   help="the learned feature map of (b), (c) and (d)")
    p.add_argument("--softmax_window", type=int, default=64, help="W of (d): exact softmax over the last W keys")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192],
                   help="context lengths (tokens) at which the decoding state is measured; the longest is where the "
                        "time per token is measured")
    p.add_argument("--latency_tokens", type=int, default=16, help="tokens decoded per model and round")
    p.add_argument("--latency_rounds", type=int, default=5, help="rounds of the decoding measurement (models alternate)")
    p.add_argument("--eval_steps", type=int, default=50, help="evaluate every this many steps (the plot's points)")
    p.add_argument("--max_eval_blocks", type=int, default=128, help="validation blocks evaluated")
    p.add_argument("--seed", type=int, default=0, help="seed of data order and initialisation")
    p.add_argument("--num_threads", type=int, default=None, help=NUM_THREADS_HELP)
    args = p.parse_args(argv)
    fc.check_source_arguments(p, args, ("steps", "at_steps", "batch_size", "lora_r", "num_random_features",
                                        "softmax_window", "latency_tokens", "latency_rounds", "eval_steps",
                                        "max_eval_blocks"),
                              ("learning_rate", "finetune_learning_rate", "at_learning_rate", "lora_learning_rate"))
    if args.at_steps >= args.steps:
        p.error(f"--at_steps ({args.at_steps}) must be smaller than --steps ({args.steps}): (c) and (d) spend the rest "
                "of the budget on LoRA")
    if any(n < 1 for n in args.contexts) or len(set(args.contexts)) != len(args.contexts):
        p.error(f"--contexts must be distinct lengths >= 1, got {args.contexts}")
    args.contexts = sorted(args.contexts)
    return args


# ----------------------------------------------------------------------------- training


class Clock:
    """Wall and CPU time (this process) of a ``with`` block, added to ``wall`` and ``cpu``."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def full_finetune(linear, data: fc.SourceData, args, scratch: Path, clock: Clock):
    """(a): every weight of ``linear`` trained with Trainer for the whole budget."""
    set_seed(args.seed)
    trainer = Trainer(model=linear, args=fc.training_args(scratch / "a_run", args.steps, args.finetune_learning_rate, args),
                      train_dataset=data.train_set, eval_dataset=data.eval_set)
    with clock:
        trainer.train()
    linear.eval()
    return fc.curve(trainer)


def attention_transfer(gpt2_dir: str, train_file: Path, folder: Path, args, clock: Clock, **overrides):
    """(b), and the first part of (c)/(d): convert with the learned map and train it by attention transfer."""
    from hf_kernattn.convert.linearize import linearize

    with clock:
        model = linearize(gpt2_dir, folder, train_files=[str(train_file)], feature_map=args.feature_map,
                          steps=args.at_steps, batch_size=args.batch_size, block_size=args.block_size,
                          learning_rate=args.at_learning_rate, seed=args.seed, progress=False, **overrides)
    model.eval()
    return model


def lora_finetune(model, tokenizer, data: fc.SourceData, args, scratch: Path, out: Path, prefix: str, base: str,
                  clock: Clock):
    """The LoRA part of (c)/(d): adapters on the attention and MLP projections trained with
    Trainer for the rest of the budget; the adapter saved in ``out/{prefix}_lora_adapter``, then
    merged and the merged model saved Hub-ready in ``out/{prefix}_lora_merged``. Returns
    ``(merged model, curve, adapter parameters)``."""
    import peft

    from hf_kernattn.cards import save_model_card
    from hf_kernattn.lora import lora_config

    steps = args.steps - args.at_steps
    model.requires_grad_(False)
    model.train()
    set_seed(args.seed)
    wrapped = peft.get_peft_model(model, lora_config(model, r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0))
    adapters = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    trainer = Trainer(model=wrapped, args=fc.training_args(scratch / f"{prefix}_run", steps, args.lora_learning_rate, args),
                      train_dataset=data.train_set, eval_dataset=data.eval_set)
    with clock:
        trainer.train()
    wrapped.save_pretrained(out / f"{prefix}_lora_adapter")
    merged = wrapped.merge_and_unload()
    merged.eval()
    folder = out / f"{prefix}_lora_merged"
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_model_card(merged, folder, base_model=base, training={
        "method": "attention transfer, then LoRA fine-tuning (adapters merged into the weights)",
        "attention-transfer steps": args.at_steps, "LoRA steps": steps, "LoRA rank": args.lora_r,
        "LoRA learning rate": args.lora_learning_rate})
    return merged, fc.curve(trainer), adapters


# ----------------------------------------------------------------------------- decoding


def with_positions(model, n_positions: int, seed: int, **kwargs):
    """``model``'s architecture with room for ``n_positions`` positions: its weights, and (for an
    absolute position table shorter than that) the table's trained rows followed by random ones.
    Returns ``(model, names of the tensors extended)``."""
    config = copy.deepcopy(model.config)
    field = "n_positions" if config.model_type == "gpt2" else "max_position_embeddings"
    setattr(config, field, max(n_positions, getattr(config, field)))
    torch.manual_seed(seed)
    long = type(model)._from_config(config, **kwargs)
    state, extended = long.state_dict(), []
    for name, value in model.state_dict().items():
        target = state[name]
        if target.shape == value.shape:
            target.copy_(value)
        elif target.shape[1:] == value.shape[1:] and target.shape[0] > value.shape[0]:
            target[: value.shape[0]].copy_(value)
            extended.append(name)
        else:
            raise ValueError(f"{name}: {tuple(value.shape)} does not fit {tuple(target.shape)}")
    long.load_state_dict(state)
    return long.eval(), extended


def cache_bytes(cache) -> int:
    """Bytes of every tensor a decoding state holds: the recurrent state of a Linear GPT, the keys
    and values of a key/value cache."""
    total = 0
    for layer in cache.layers:
        tensors = layer.get_state() if hasattr(layer, "get_state") else (layer.keys, layer.values)
        total += sum(x.numel() * x.element_size() for x in tensors if torch.is_tensor(x))
    return total


@torch.no_grad()
def prefill(model, ids: torch.Tensor, contexts: list[int], chunk: int = 1024):
    """Feed ``ids`` (1, >= max(contexts)) in chunks, measuring the decoding state's bytes at each
    context length. Returns ``(cache, next token (1, 1), {context: bytes})``."""
    cache, pos, sizes, logits = None, 0, {}, None
    for end in contexts:
        while pos < end:
            step = min(chunk, end - pos)
            result = model(input_ids=ids[:, pos:pos + step], past_key_values=cache, use_cache=True)
            cache, logits, pos = result.past_key_values, result.logits, pos + step
        sizes[end] = cache_bytes(cache)
    return cache, logits[:, -1:].argmax(-1), sizes


@torch.no_grad()
def decode(model, cache, token: torch.Tensor, n: int):
    """``n`` greedy tokens, one forward with ``past_key_values`` each. Returns ``(cache, last
    token, wall seconds per token, CPU seconds per token)``."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        result = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
    return cache, token, (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure_decoding(models: dict, ids: torch.Tensor, args) -> dict:
    """State bytes at ``--contexts`` and time per token at the longest, for every model in
    ``models`` (name -> model built by :func:`with_positions`; ``"teacher"`` among them). The
    models take turns in each round; ratios to the teacher are per round."""
    states, sizes = {}, {}
    for name, model in models.items():
        cache, token, sizes[name] = prefill(model, ids, args.contexts)
        cache, token, _, _ = decode(model, cache, token, 2)  # warm-up
        states[name] = (cache, token)
    times = {name: {"wall": [], "cpu": []} for name in models}
    for _ in range(args.latency_rounds):
        for name, model in models.items():
            cache, token, wall, cpu = decode(model, *states[name], args.latency_tokens)
            states[name] = (cache, token)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
    result = {}
    for name in models:
        entry = {"state_bytes": {str(c): b for c, b in sizes[name].items()},
                 "seconds_per_token": {k: summary(v) for k, v in times[name].items()}}
        if name != "teacher":
            entry["vs_teacher"] = {k: summary([a / b for a, b in zip(times[name][k], times["teacher"][k])])
                                   for k in ("wall", "cpu")}
        result[name] = entry
    return result


# ----------------------------------------------------------------------------- the run


def check_requirements() -> None:
    """Before any training: PEFT for (c) and (d), and a Linear GPT with the sliding-window hybrid for (d)."""
    from hf_kernattn.modeling.configuration_linear_gpt import LinearGPTConfig

    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ImportError("recipes (c) and (d) need PEFT: pip install 'hf-kernattn[peft]'") from err
    if "softmax_window" not in LinearGPTConfig().to_dict():
        raise ValueError("recipe (d) needs the sliding-window hybrid (the Linear GPT config field softmax_window), "
                         "which this version of hf_kernattn does not have")


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.set_verbosity_info()
    logger.info(f"CPU threads: {configure_threads(args.num_threads)}")
    set_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="linearize_compare_"))  # the Trainers' output folders (nothing saved)
    try:
        return _run(args, out, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, out: Path, scratch: Path) -> dict:
    from hf_kernattn.convert import convert_to_linear_gpt

    started = time.perf_counter()
    check_requirements()
    tokenizer, gpt2 = fc.load_source(args)
    data = fc.load_data(args, tokenizer)
    teacher_clock = Clock()
    with teacher_clock:
        gpt2_dir, gpt2, gpt2_curve = fc.prepare_teacher(args, tokenizer, gpt2, data, out, scratch)
    evaluate = lambda model: fc.evaluate(model, data.eval_set, scratch / "eval", args)  # noqa: E731
    teacher_loss = evaluate(gpt2)
    train_file = scratch / "train.txt"  # attention transfer reads text files: the same training text
    train_file.write_text(data.train_text, encoding="utf-8")
    recipes: dict[str, dict] = {}
    final: dict[str, torch.nn.Module] = {}

    # (a) PRF conversion + full fine-tuning
    clock = Clock()
    linear = convert_to_linear_gpt(gpt2_dir, None, num_random_features=args.num_random_features,
                                   feature_seed=args.feature_seed)
    converted_loss = evaluate(linear)
    a_curve = full_finetune(linear, data, args, scratch, clock)
    linear.save_pretrained(out / "a_prf_finetuned")
    tokenizer.save_pretrained(out / "a_prf_finetuned")
    recipes["a"] = dict(start_loss=converted_loss, curve=[(0, converted_loss)] + a_curve, loss=evaluate(linear),
                        trainable_parameters=sum(p.numel() for p in linear.parameters()), clock=clock,
                        steps={"full fine-tuning": args.steps})
    final["a"] = linear

    # (b) attention transfer; (c) then LoRA
    from hf_kernattn.convert import convert

    for key, overrides in (("b", {}), ("d", {"softmax_window": args.softmax_window})):
        clock = Clock()
        start_loss = evaluate(convert(gpt2_dir, None, feature_map=args.feature_map, **overrides))
        folder = out / ("b_attention_transfer" if key == "b" else "d_hybrid_attention_transfer")
        model = attention_transfer(gpt2_dir, train_file, folder, args, clock, **overrides)
        at_loss = evaluate(model)
        at_params = model.linearize_report["trainable_parameter_count"]
        if key == "b":
            recipes["b"] = dict(start_loss=start_loss, curve=[(0, start_loss), (args.at_steps, at_loss)], loss=at_loss,
                                trainable_parameters=at_params, clock=copy.copy(clock),
                                steps={"attention transfer": args.at_steps})
            final["b"] = copy.deepcopy(model)
            key = "c"
        merged, curve, adapters = lora_finetune(model, tokenizer, data, args, scratch, out, key, str(folder), clock)
        recipes[key] = dict(start_loss=start_loss, at_loss=at_loss,
                            curve=[(0, start_loss), (args.at_steps, at_loss)] + [(args.at_steps + s, x) for s, x in curve],
                            loss=evaluate(merged), trainable_parameters=at_params + adapters, clock=clock,
                            trainable_split={"attention transfer": at_params, "LoRA": adapters},
                            steps={"attention transfer": args.at_steps, "LoRA": args.steps - args.at_steps})
        final[key] = merged

    # decoding: state bytes at every context, time per token at the longest
    n_positions = args.contexts[-1] + 2 + args.latency_tokens * args.latency_rounds + 1
    long_models, extended = {}, set()
    long_models["teacher"], names = with_positions(gpt2, n_positions, args.seed, attn_implementation="sdpa")
    extended.update(names)
    for key in final:
        long_models[key], names = with_positions(final[key], n_positions, args.seed)
        extended.update(names)
    ids = torch.tensor([(data.valid_ids + data.train_ids)[:args.contexts[-1]]])
    if ids.shape[1] < args.contexts[-1]:
        raise ValueError(f"--contexts {args.contexts[-1]}: the text holds only {ids.shape[1]} tokens")
    decoding = measure_decoding(long_models, ids, args)
    trained_positions = getattr(gpt2.config, "n_positions", None) or gpt2.config.max_position_embeddings
    weights_note = (f"trained weights; the position table extended from {trained_positions} to {n_positions} rows with "
                    f"random rows beyond the trained ones ({', '.join(sorted(extended))})" if extended
                    else "trained weights (the position table already covers the context)")

    gap = converted_loss - teacher_loss
    results = {
        "unit": "nats/byte" if gpt2.config.vocab_size == 257 else "nats/token",
        "teacher": {"name": "GPT-2 (softmax, key/value cache)", "folder": gpt2_dir, "loss": teacher_loss,
                    "perplexity": math.exp(teacher_loss), "parameters": sum(p.numel() for p in gpt2.parameters()),
                    "training_seconds": {"wall": teacher_clock.wall, "cpu": teacher_clock.cpu} if gpt2_curve else None,
                    "curve": gpt2_curve, "decoding": decoding["teacher"]},
        "converted_prf_loss": converted_loss,
        "recipes": {},
        "checks": {
            "d_within_2_percent_of_teacher": recipes["d"]["loss"] <= 1.02 * teacher_loss,
            "d_relative_gap": recipes["d"]["loss"] / teacher_loss - 1,
            "b_closes_half_the_conversion_gap": recipes["b"]["loss"] <= converted_loss - gap / 2,
            "b_fraction_of_gap_closed": (converted_loss - recipes["b"]["loss"]) / gap if gap > 0 else None,
            "linear_states_constant": all(len(set(decoding[k]["state_bytes"].values())) == 1 for k in final),
        },
        "decoding_setup": {"contexts": args.contexts, "tokens_per_round": args.latency_tokens,
                           "rounds": args.latency_rounds, "weights": weights_note,
                           "method": "the model's forward with past_key_values, one token at a time, greedy; "
                                     "the models take turns in each round; teacher: attn_implementation='sdpa'"},
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    for key, r in recipes.items():
        clock = r.pop("clock")
        results["recipes"][key] = {"name": RECIPES[key], **r, "perplexity": math.exp(r["loss"]),
                                   "relative_to_teacher": r["loss"] / teacher_loss - 1,
                                   "training_seconds": {"wall": clock.wall, "cpu": clock.cpu},
                                   "decoding": decoding[key]}
    results["seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = results_table(results)
    (out / "results.md").write_text(table)
    plot(results, out / "linearize_compare.png")
    print(table)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {out / 'linearize_compare.png'} "
          f"in {results['seconds']:.0f} s")
    return results


def _bytes(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.0f} KiB"


def results_table(results: dict) -> str:
    """The comparison as a Markdown table, with the notes a reader needs beneath it."""
    contexts = results["decoding_setup"]["contexts"]
    unit, t = results["unit"], results["teacher"]
    longest = f"{contexts[-1] // 1024}k" if contexts[-1] % 1024 == 0 else str(contexts[-1])

    def ctx(c):
        return f"{c // 1024}k" if c % 1024 == 0 else str(c)

    head = (f"| recipe | validation loss ({unit}) | perplexity | vs teacher | trainable parameters | training time "
            f"(wall / CPU s) | " + " | ".join(f"decode state at {ctx(c)}" for c in contexts)
            + f" | ms per token at {longest} (wall / CPU) | vs teacher (wall / CPU) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]

    def decode_cells(d, ratio):
        s = d["seconds_per_token"]
        cells = [_bytes(d["state_bytes"][str(c)]) for c in contexts]
        cells.append(f"{1e3 * s['wall']['median']:.2f} / {1e3 * s['cpu']['median']:.2f}")
        if ratio:
            v = d["vs_teacher"]
            cells.append(f"{v['wall']['median']:.2f} [{v['wall']['min']:.2f}-{v['wall']['max']:.2f}] / "
                         f"{v['cpu']['median']:.2f} [{v['cpu']['min']:.2f}-{v['cpu']['max']:.2f}]")
        else:
            cells.append("1")
        return cells

    ts = t["training_seconds"]
    rows.append("| " + " | ".join([f"teacher: {t['name']}", f"{t['loss']:.4f}", f"{t['perplexity']:.3f}", "0%",
                                  f"{t['parameters']:,} (all)",
                                  f"{ts['wall']:.0f} / {ts['cpu']:.0f}" if ts else "given", *decode_cells(t["decoding"], False)])
                + " |")
    for r in results["recipes"].values():
        s = r["training_seconds"]
        rows.append("| " + " | ".join([r["name"], f"{r['loss']:.4f}", f"{r['perplexity']:.3f}",
                                      f"{100 * r['relative_to_teacher']:+.1f}%", f"{r['trainable_parameters']:,}",
                                      f"{s['wall']:.0f} / {s['cpu']:.0f}", *decode_cells(r["decoding"], True)]) + " |")
    c = results["checks"]
    b = results["recipes"]["b"]
    notes = [
        "",
        f"Right after conversion with random features (before any training): {results['converted_prf_loss']:.4f}; "
        f"with the learned map before attention transfer: {b['start_loss']:.4f}; "
        f"(d) before attention transfer: {results['recipes']['d']['start_loss']:.4f}.",
        f"(b) closes {100 * c['b_fraction_of_gap_closed']:.0f}% of the gap between the converted model and the teacher; "
        f"(d) ends {100 * c['d_relative_gap']:+.2f}% from the teacher's loss." if c["b_fraction_of_gap_closed"] is not None
        else "",
        f"Steps: {', '.join(f'{k} {v}' for k, v in results['recipes']['c']['steps'].items())} for (c) and (d); "
        f"{results['recipes']['a']['steps']['full fine-tuning']} of full fine-tuning for (a); "
        f"{results['settings']['batch_size']} blocks of {results['settings']['block_size']} tokens per step. "
        "Trainable parameters of (c) and (d): those attention transfer trains (the feature maps; for (d) also the "
        "window's mixing weights) plus the LoRA adapters.",
        f"Decoding: {results['decoding_setup']['method']}; median of {results['decoding_setup']['rounds']} rounds of "
        f"{results['decoding_setup']['tokens_per_round']} tokens, ratios per round median [min-max]; "
        f"{results['decoding_setup']['weights']}.",
    ]
    return "\n".join(rows + notes) + "\n"


def plot(results: dict, path: Path) -> None:
    """Left: validation loss over the step budget for every recipe, the teacher's loss (and 2%
    above it) as reference lines. Right: decoding-state bytes against context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    teacher = results["teacher"]["loss"]
    colors = dict(zip("abcd", ("tab:red", "tab:orange", "tab:blue", "tab:green")))
    for key, r in results["recipes"].items():  # (b) is where (c) starts: drawn on top, larger
        steps, losses = zip(*r["curve"])
        style = dict(marker="s", ms=7, ls=":", lw=2, zorder=3) if key == "b" else dict(marker="o", ms=3)
        ax.plot(steps, losses, color=colors[key], label=r["name"], **style)
    ax.axhline(results["converted_prf_loss"], color="gray", ls=":", lw=1, label="right after conversion (PRF)")
    ax.axhline(teacher, color="black", ls="--", lw=1, label="teacher (softmax GPT-2)")
    ax.axhspan(teacher, 1.02 * teacher, color="black", alpha=0.08, lw=0, label="within 2% of the teacher")
    ax.set_xlabel("optimizer steps of the budget")
    ax.set_ylabel(f"validation loss ({results['unit']})")
    ax.set_title("Linearizing GPT-2: one teacher, one budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    contexts = results["decoding_setup"]["contexts"]
    entries = [("teacher (key/value cache)", results["teacher"]["decoding"], "black")]
    entries += [(r["name"].split(" ", 1)[0], r["decoding"], colors[k]) for k, r in results["recipes"].items()]
    for i, (label, d, color) in enumerate(entries):
        ms = 1e3 * d["seconds_per_token"]["cpu"]["median"]
        bx.plot(contexts, [d["state_bytes"][str(c)] for c in contexts], marker="o", ms=9 - 1.5 * i, color=color,
                lw=1.5, label=f"{label}: {ms:.2f} ms/token (CPU) at {contexts[-1]}")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.xaxis.set_minor_locator(NullLocator())
    bx.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
    bx.set_xlabel("context (tokens)")
    bx.set_ylabel("decoding state (bytes)")
    bx.set_title("Decoding state and time per token")
    bx.grid(alpha=0.3, which="both")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
