"""The compared models, one shared tokenizer, and per-token scoring in chunks that carry each model's cache.

:func:`score_tokens` feeds a ``(B, N)`` batch to a causal LM ``chunk_size`` tokens at a time with
``use_cache=True``, handing the cache each call returns (``past_key_values``; ``cache`` from
transformers 5.24) to the next. For Linear GPT that cache is its constant-size recurrent state, so
memory does not grow with N; for a softmax model it is the usual KV cache. Either way the result
is the one full forward's (the cache is exact), computed in pieces.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

logger = logging.get_logger(__name__)

# the name transformers gives a forward's cache argument and output field (``cache`` from 5.24)
CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EvalModel:
    """One compared model.

    Attributes:
        name: the label of its rows, lines and columns (the folder's name, or the whole source
            where two folders share a name).
        source: the folder or Hub id it was loaded from (or what the caller named it).
        model: the causal LM, in eval mode.
        max_positions: the longest sequence it is scored on (its position table's size), None
            when it has no such limit (Linear GPT with rotary, ``rope`` or no absolute positions).
    """

    name: str
    source: str
    model: torch.nn.Module
    max_positions: Optional[int]


def max_positions_of(model: torch.nn.Module) -> Optional[int]:
    """The positions a model supports: Linear GPT's learned table when it has one (else None:
    a recurrent state has no end), else the first of the usual config fields (GPT-2's
    ``n_positions``, Llama's ``max_position_embeddings``, ...), None when it declares none."""
    cfg = model.config
    if getattr(cfg, "model_type", None) == "linear_gpt":
        return int(cfg.max_position_embeddings) if cfg.position_embedding_type == "absolute" else None
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_source(source: Union[str, os.PathLike], what: str) -> str:
    """``source`` as ``from_pretrained`` takes it: an existing folder, or a well-formed Hub id
    (``ValueError`` for anything else, e.g. a path that does not exist)."""
    from huggingface_hub.utils import validate_repo_id

    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ValueError(f"{what} {str(source)!r} is a file; expected a folder written by save_pretrained or a Hub model id")
    try:
        validate_repo_id(str(source))
    except ValueError:
        raise ValueError(f"{what} {str(source)!r} is neither an existing folder nor a Hub model id "
                         "(like 'openai-community/gpt2')") from None
    return str(source)


def load_tokenizer(source: Union[str, os.PathLike], *, trust_remote_code: bool = False, revision: Optional[str] = None):
    """``AutoTokenizer.from_pretrained(source)``, with a ``ValueError`` naming ``source`` when
    it holds no tokenizer."""
    from transformers import AutoTokenizer

    from .data import ordinary_token_ids

    src = check_source(source, "tokenizer")
    advice = "pass one with --tokenizer (Python: tokenizer=)"
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"no tokenizer could be loaded from {str(source)!r} ({' '.join(str(err).split())[:200]}); "
                         f"{advice}") from None
    if not len(ordinary_token_ids(tokenizer)):  # e.g. a model folder without tokenizer files: an empty vocabulary
        raise ValueError(f"no tokenizer in {str(source)!r}: what loads from it has no vocabulary besides special "
                         f"tokens; {advice}")
    return tokenizer


def load_model(source: Union[str, os.PathLike], *, dtype: Union[str, torch.dtype] = "float32", device: Optional[str] = None,
               trust_remote_code: bool = False, revision: Optional[str] = None, allow_pickle: bool = False):
    """``AutoModelForCausalLM.from_pretrained(source)`` in eval mode on ``device`` (None: CUDA when
    available, else CPU). Weights are read from safetensors only unless ``allow_pickle``
    (unpickling a file can run code from it)."""
    from transformers import AutoModelForCausalLM

    import hf_kernattn  # noqa: F401  (registers the Linear GPT family with the Auto classes)

    src = check_source(source, "model")
    torch_dtype = _dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch_dtype, trust_remote_code=trust_remote_code, revision=revision,
        use_safetensors=None if allow_pickle else True,
    )
    return model.to(resolve_device(device)).eval()


def _dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: Optional[str]) -> torch.device:
    """``device``, or CUDA when available and CPU otherwise."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _names(sources: Sequence[str]) -> list[str]:
    """Folder names, or the whole sources where two folders share a name."""
    short = [Path(str(s).rstrip("/\\")).name or str(s) for s in sources]
    return [s if short.count(n) > 1 else n for s, n in zip(sources, short)]


def as_eval_models(models: Sequence[Union[EvalModel, torch.nn.Module]]) -> list[EvalModel]:
    """Models given as :class:`EvalModel` or as bare modules (named by their config's
    ``_name_or_path``, else ``model0``, ``model1`` ...)."""
    if not models:
        raise ValueError("models must name at least one model")
    out, sources = [], []
    for i, m in enumerate(models):
        if isinstance(m, EvalModel):
            out.append(m)
            continue
        if not isinstance(m, torch.nn.Module) or not hasattr(m, "config"):
            raise TypeError(f"models[{i}] must be an EvalModel or a transformers causal LM, got {type(m).__name__}")
        sources.append(getattr(m.config, "_name_or_path", "") or f"model{i}")
        out.append(EvalModel("", sources[-1], m.eval(), max_positions_of(m)))
    names = iter(_names(sources))
    out = [m if m.name else EvalModel(next(names), m.source, m.model, m.max_positions) for m in out]
    seen = [m.name for m in out]
    if len(set(seen)) != len(seen):
        raise ValueError(f"the compared models need distinct names, got {seen}")
    return out


def vocab_size_of(model: torch.nn.Module) -> int:
    """The token ids a model's embedding holds."""
    emb = model.get_input_embeddings()
    return int(getattr(emb, "num_embeddings", None) or model.config.vocab_size)


def check_vocab(models: Sequence[EvalModel], tokenizer) -> None:
    """``ValueError`` naming a model whose embedding cannot hold every id of ``tokenizer``."""
    n = len(tokenizer)
    for m in models:
        v = vocab_size_of(m.model)
        if v < n:
            raise ValueError(f"model {m.name!r} has vocab_size={v}, fewer than the tokenizer's {n} ids: the models "
                             "compared must share one tokenizer (pass the right one with --tokenizer)")


def load_models(sources: Sequence[Union[str, os.PathLike]], *, tokenizer: Union[None, str, os.PathLike, object] = None,
                dtype: Union[str, torch.dtype] = "float32", device: Optional[str] = None, trust_remote_code: bool = False,
                revision: Optional[str] = None, allow_pickle: bool = False) -> tuple[list[EvalModel], object]:
    """Load every model of ``sources`` (folders or Hub ids) and the one tokenizer they share:
    ``tokenizer`` (a tokenizer, or where to load one from), by default the first model's.
    Returns ``([EvalModel, ...], tokenizer)``; ``ValueError`` when a model's vocabulary cannot
    hold the tokenizer's ids."""
    if not sources:
        raise ValueError("name at least one model to evaluate")
    for s in sources:  # every source is checked before anything loads
        check_source(s, "model")
    _dtype(dtype)
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(sources[0] if tokenizer is None else tokenizer, trust_remote_code=trust_remote_code,
                                   revision=revision if tokenizer is None else None)
    n_ids = len(tokenizer)
    for src in sources:  # the vocabularies checked from the configs, before any weights load
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(check_source(src, "model"), trust_remote_code=trust_remote_code,
                                         revision=revision)
        v = getattr(cfg, "vocab_size", None)
        if isinstance(v, int) and v < n_ids:
            raise ValueError(f"model {str(src)!r} has vocab_size={v}, fewer than the tokenizer's {n_ids} ids: the "
                             "models compared must share one tokenizer (pass the right one with --tokenizer)")
    names = _names([str(s) for s in sources])
    models = []
    for name, src in zip(names, sources):
        logger.info(f"loading {src}")
        model = load_model(src, dtype=dtype, device=device, trust_remote_code=trust_remote_code, revision=revision,
                           allow_pickle=allow_pickle)
        models.append(EvalModel(name, str(src), model, max_positions_of(model)))
    check_vocab(models, tokenizer)
    return models, tokenizer


def _cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache under."""
    params = inspect.signature(model.forward).parameters
    for name in (CACHE_FIELD, "past_key_values", "cache"):
        if name in params:
            return name
    return CACHE_FIELD


def _returned_cache(out) -> object:
    for name in (CACHE_FIELD, "past_key_values", "cache"):
        value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if value is not None:
            return value
    return None


def chunk_bounds(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of consecutive chunks of at most ``chunk_size`` tokens covering ``n``; a
    last chunk of one token joins the one before (a one-token call from a state is a decoding
    step, which some models run through a fast path that skips module hooks)."""
    if chunk_size < 2:
        raise ValueError(f"chunk_size must be >= 2, got {chunk_size}")
    bounds = [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def num_chunks(n: int, chunk_size: int, max_positions: Optional[int]) -> int:
    """How many forward calls :func:`score_tokens` makes for a sequence of ``n`` tokens."""
    usable = n if max_positions is None else min(n, max_positions)
    return len(chunk_bounds(usable, chunk_size)) if usable >= 2 else 0


@torch.no_grad()
def score_tokens(model: torch.nn.Module, input_ids: torch.Tensor, *, chunk_size: int = 1024,
                 max_positions: Optional[int] = None, on_chunk: Optional[Callable[[], None]] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss and top-1 hits of every position of ``input_ids (B, N)``.

    Returns ``loss (B, N)`` float64, ``loss[b, i] = -log p(x_i | x_<i)``, NaN at ``i = 0`` and at
    positions ``i >= max_positions`` (not scored), and ``correct (B, N)`` bool (argmax of the
    logits at ``i - 1`` equals ``x_i``). The model sees ``chunk_size`` tokens per call and
    continues from the cache the previous call returned; a model that returns none is given the
    whole sequence in one call. Log-probabilities are taken in float32 (float64 for a float64
    model). ``on_chunk``: called after each forward call (a progress bar)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, seq) tensor of token ids")
    b, n = input_ids.shape
    loss = torch.full((b, n), math.nan, dtype=torch.float64)
    correct = torch.zeros(b, n, dtype=torch.bool)
    usable = n if max_positions is None else min(n, int(max_positions))
    if usable < 2:
        return loss, correct
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    argument = _cache_argument(model)
    bounds = chunk_bounds(usable, chunk_size)
    cache, i = None, 0
    while i < len(bounds):
        start, stop = bounds[i]
        kwargs = {"use_cache": True}
        if cache is not None:
            kwargs[argument] = cache
        out = model(input_ids=ids[:, start:stop], **kwargs)
        cache = _returned_cache(out)
        if cache is None and stop < usable:
            logger.info(f"{type(model).__name__} returned no cache: scoring {usable} tokens in one call")
            bounds, i = [(0, usable)], 0
            continue
        last = min(stop, usable - 1)  # logits at start .. last - 1 predict tokens start + 1 .. last
        logits = out.logits[:, : last - start]
        logits = logits.double() if logits.dtype == torch.float64 else logits.float()
        target = ids[:, start + 1 : last + 1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        loss[:, start + 1 : last + 1] = nll.view(b, -1).double().cpu()
        correct[:, start + 1 : last + 1] = (logits.argmax(-1) == target).cpu()
        if on_chunk is not None:
            on_chunk()
        i += 1
    return loss, correct
