"""``hf-kernattn eval context`` and ``hf-kernattn eval recall``: arguments and the run."""

from __future__ import annotations

import argparse

from .models import DTYPES
from .recall import DEFAULT_DISTANCES

TASKS = ("context", "recall")


def _add_common(p: argparse.ArgumentParser, task: str, batch_size: int) -> None:
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="causal LMs to compare: folders written by save_pretrained, or Hub model ids")
    what = "windows are cut from each" if task == "context" else "the text between the copies is read from them"
    p.add_argument("--text", nargs="+", required=True, metavar="FILE",
                   help=f"UTF-8 text files, each one document ({what})")
    p.add_argument("--out", default=f"eval_results/{task}",
                   help=f"folder for {task}.json, {task}.csv and {task}.png (default: %(default)s)")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer every model reads (a folder or Hub id; default: the first model's)")
    p.add_argument("--chunk_size", type=int, default=1024,
                   help="tokens per forward call; longer sequences continue from the cache the model returned, "
                        "so a recurrent model scores any length in constant memory (default: %(default)s)")
    p.add_argument("--batch_size", type=int, default=batch_size,
                   help="sequences per forward call (default: %(default)s)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights' dtype (default: %(default)s)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--trust_remote_code", action="store_true",
                   help="allow models and tokenizers whose code comes with the checkpoint")
    p.add_argument("--revision", default=None, help="branch, tag or commit of Hub model ids")
    p.add_argument("--allow-pickle", dest="allow_pickle", action="store_true",
                   help="read pickled weights of a model without safetensors ones (only for sources you trust)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    p = sub.add_parser("context", help="mean next-token loss by position, in log-spaced bins",
                       description="Mean next-token loss by token position, in log-spaced bins up to --max_length, "
                                   "on windows of the text; a sliding-window hybrid also reports the share of its "
                                   "attention in the window and in the linear part, per layer.")
    _add_common(p, "context", 1)
    p.add_argument("--max_length", type=int, required=True, help="tokens per window (positions scored: 1 .. N - 1)")
    p.add_argument("--max_windows", type=int, default=8,
                   help="windows averaged, the first ones of the text in order (default: %(default)s)")
    p.add_argument("--bins_per_octave", type=int, default=1,
                   help="position bins per doubling (default: %(default)s: 1, 2-3, 4-7, ...)")
    p.add_argument("--prepend_bos", action="store_true",
                   help="start every window with the tokenizer's BOS token (models trained with one expect it)")
    p = sub.add_parser("recall", help="recall of a random span after d tokens of text",
                       description="Recall at a distance: a random span of tokens, d tokens of the text, the span "
                                   "again; loss and top-1 accuracy on the repeated copy against the first, per "
                                   "distance.")
    _add_common(p, "recall", 8)
    p.add_argument("--distances", type=int, nargs="+", default=list(DEFAULT_DISTANCES),
                   help="tokens of text between the copies (default: %(default)s)")
    p.add_argument("--span_length", type=int, default=16, help="tokens in the random span (default: %(default)s)")
    p.add_argument("--trials", type=int, default=8, help="spans per distance (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the spans and text positions (default: %(default)s)")


def _check_settings(args: argparse.Namespace) -> None:
    """Settings checked before any model loads."""
    for name in ("chunk_size", "batch_size"):
        low = 2 if name == "chunk_size" else 1
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.eval_task == "context":
        if args.max_length < 2:
            raise ValueError(f"--max_length must be >= 2 (one token of context and one to predict), got {args.max_length}")
        if args.max_windows < 1:
            raise ValueError(f"--max_windows must be >= 1, got {args.max_windows}")
        if args.bins_per_octave < 1:
            raise ValueError(f"--bins_per_octave must be >= 1, got {args.bins_per_octave}")
    else:
        if min(args.distances) < 0:
            raise ValueError(f"--distances must be >= 0, got {args.distances}")
        if args.span_length < 2:
            raise ValueError(f"--span_length must be >= 2, got {args.span_length}")
        if args.trials < 1:
            raise ValueError(f"--trials must be >= 1, got {args.trials}")


def run(args: argparse.Namespace) -> int:
    """Run the evaluation, write the report, print the table."""
    from .context import evaluate_context
    from .data import context_windows, read_texts, tokenize
    from .models import check_source, load_models, load_tokenizer
    from .recall import evaluate_recall, recall_trials
    from .report import summary, write_report

    _check_settings(args)
    texts = read_texts(args.text)
    for source in args.models:  # every name checked before anything loads
        check_source(source, "model")
    tokenizer = load_tokenizer(args.tokenizer or args.models[0], trust_remote_code=args.trust_remote_code,
                               revision=None if args.tokenizer else args.revision)
    texts = tokenize(tokenizer, texts)
    if args.eval_task == "context":  # a text too short is refused before the models load
        bos = tokenizer.bos_token_id if args.prepend_bos else None
        if args.prepend_bos and bos is None:
            raise ValueError("--prepend_bos: the tokenizer has no BOS token")
        context_windows(texts, args.max_length, max_windows=1, bos_token_id=bos)
    else:
        recall_trials(tokenizer, texts, args.distances, span_length=args.span_length, trials=1)
    models, tokenizer = load_models(args.models, tokenizer=tokenizer, dtype=args.dtype, device=args.device,
                                    trust_remote_code=args.trust_remote_code, revision=args.revision,
                                    allow_pickle=args.allow_pickle)
    progress = not getattr(args, "quiet", False)
    common = dict(chunk_size=args.chunk_size, batch_size=args.batch_size, progress=progress)
    if args.eval_task == "context":
        result = evaluate_context(models, tokenizer, texts, args.max_length, max_windows=args.max_windows,
                                  bins_per_octave=args.bins_per_octave, prepend_bos=args.prepend_bos, **common)
    else:
        result = evaluate_recall(models, tokenizer, texts, args.distances, span_length=args.span_length,
                                 trials=args.trials, seed=args.seed, **common)
    result["settings"].update(models=[str(m) for m in args.models], text=[str(t) for t in args.text],
                              tokenizer=args.tokenizer or str(args.models[0]), dtype=args.dtype)
    paths = write_report(result, args.out)
    print(summary(result))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
