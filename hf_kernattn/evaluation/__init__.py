"""Evaluate and compare causal LMs on the same text: loss by token position (``eval context``) and recall of a span at a distance (``eval recall``).

Any causal LM ``AutoModelForCausalLM`` loads (Linear GPT, a converted or linearized model,
stock GPT-2 or Llama; ``trust_remote_code`` models) is scored through one shared tokenizer, in
chunks that carry the model's cache (a recurrent model scores 16k tokens in constant memory; a
softmax model up to its position table). Sliding-window hybrids also report the share of their
attention in the window and in the linear part. Each run writes JSON, CSV and a PNG plot under
``--out`` and prints a short table. See ``docs/evaluation.md``.

CLI::

    hf-kernattn eval context MODEL [MODEL ...] --text FILE --max_length 4096 --out DIR
    hf-kernattn eval recall MODEL [MODEL ...] --text FILE --distances 64 256 1024 --out DIR

Python::

    from hf_kernattn.evaluation import load_models, evaluate_context, write_report
    models, tokenizer = load_models(["path/to/a", "path/to/b"])
    result = evaluate_context(models, tokenizer, [open("book.txt").read()], max_length=4096)
    write_report(result, "eval_results/context")
"""

from .command import add_arguments, run
from .context import bin_means, evaluate_context, log_bins
from .data import context_windows, ordinary_token_ids, read_texts, recall_sequences, token_stream, tokenize
from .hybrid import HybridShares, hybrid_attention_modules, hybrid_shares
from .models import (
    EvalModel,
    check_vocab,
    chunk_bounds,
    load_model,
    load_models,
    load_tokenizer,
    max_positions_of,
    score_tokens,
)
from .recall import DEFAULT_DISTANCES, evaluate_recall, recall_trials
from .report import summary, write_report

__all__ = [
    "DEFAULT_DISTANCES", "EvalModel", "HybridShares", "add_arguments", "bin_means", "check_vocab", "chunk_bounds",
    "context_windows", "evaluate_context", "evaluate_recall", "hybrid_attention_modules", "hybrid_shares", "load_model",
    "load_models", "load_tokenizer", "log_bins", "max_positions_of", "ordinary_token_ids", "read_texts",
    "recall_sequences", "recall_trials", "run", "score_tokens", "summary", "token_stream", "tokenize", "write_report",
]
