"""Kernelized attention for stock transformers models: ``attn_implementation="kernelized"``.

Importing ``hf_kernattn`` registers the attention function :func:`kernelized_attention_forward`
with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`, and a matching
``AttentionMaskInterface`` entry that hands it the plain ``(batch, keys)`` padding mask, so that

    model = AutoModel.from_pretrained(name, attn_implementation="kernelized")
    model.set_attn_implementation("kernelized")          # or on a model already built

runs BERT, RoBERTa, GPT-2, Llama-family models (grouped-query attention: key/value heads are
repeated) and ViT with kernelized attention: ``softmax(s q k^T)`` becomes
``phi(q) phi(k)^T / (phi(q) . sum phi(k))`` with positive random features ``phi`` estimating the
same exponential kernel ``exp(s q . k)`` (``s`` the module's ``scaling``). Causal masks
(``module.is_causal``) and padding are honoured, the attention output gets the module's dropout
in training, and the features of each layer are drawn from ``seed + 1000 * layer index``, so
outputs are deterministic.

Options: ``feature_map`` (``"prf"``, ``"trf"``, ``"elu"``, ``"relu"``, or ``"exact"``: the
exponential kernel evaluated densely, i.e. softmax attention itself, the reference the random
features approach), ``num_random_features``, ``feature_projection``, ``seed``. :func:`enable`
sets them for one model and records them in its config (``config.kernelized_attention``), so
they are saved with it and a reloaded model draws the same features;
:func:`configure` sets the defaults for models without recorded options.

Saving and loading: a model that runs kernelized attention (after :func:`enable`, or loaded or
switched with ``attn_implementation="kernelized"`` and run once) records the implementation in
its config (``config.attn_implementation``), so ``save_pretrained`` writes
``"attn_implementation": "kernelized"`` into ``config.json`` and a plain
``from_pretrained(path)`` loads it with kernelized attention again, as long as ``hf_kernattn``
is imported first. Without it transformers refuses the unknown implementation with a
``ValueError``; ``attn_implementation="sdpa"`` (or ``"eager"``) loads it as softmax on purpose.
:func:`disable` switches a model back to softmax and drops both records.

Decoding cost: with a stock model's own key/value cache, every new token still reads all
cached keys (the cache is the model's, and its keys are what this function receives), so the
per-token cost stays that of the cache. Constant-time decoding comes from converting the model
to Linear GPT, whose state replaces the cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from .modeling.dispatch import kernelized_attention
from .modeling.feature_maps import FEATURE_MAPS, LEARNED_FEATURE_MAPS, PROJECTIONS, FeatureMap

ATTENTION_NAME = "kernelized"


@dataclass
class DropInOptions:
    """The drop-in's settings (see the module docstring)."""

    feature_map: str = "prf"
    num_random_features: int = 64
    feature_projection: str = "orthogonal"
    seed: int = 0

    def check(self) -> None:
        maps = tuple(m for m in FEATURE_MAPS if m not in LEARNED_FEATURE_MAPS) + ("exact",)
        if self.feature_map in LEARNED_FEATURE_MAPS:
            raise ValueError(
                f"feature_map={self.feature_map!r} is a learned map: its weights are parameters of a model's "
                f"attention layers, which the drop-in does not add to a stock model; use one of {list(maps)}, or "
                "convert the model to an hf-kernattn family (hf-kernattn convert) and set feature_map there"
            )
        if self.feature_map not in maps:
            raise ValueError(f"feature_map must be one of {list(maps)}, got {self.feature_map!r}")
        if isinstance(self.num_random_features, bool) or not isinstance(self.num_random_features, int) \
                or self.num_random_features < 1:
            raise ValueError(f"num_random_features must be a positive int, got {self.num_random_features!r}")
        if self.feature_projection not in PROJECTIONS:
            raise ValueError(f"feature_projection must be one of {list(PROJECTIONS)}, got {self.feature_projection!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


OPTIONS = DropInOptions()


def _refuse_softmax_window(options: dict) -> None:
    """``ValueError`` for ``softmax_window``: the drop-in has no place for the hybrid's learned weights."""
    if "softmax_window" in options:
        raise ValueError(
            "softmax_window: the drop-in does not run the sliding-window hybrid: its learned per-head mixing weights "
            "are parameters of a model's attention layers, which the drop-in does not add to a stock model; convert "
            "the model to an hf-kernattn family (hf-kernattn convert --softmax-window W) instead"
        )


def configure(**options) -> DropInOptions:
    """Set the options for layers that have no features yet (``ValueError`` for a bad one);
    returns the current options."""
    global OPTIONS
    _refuse_softmax_window(options)
    candidate = DropInOptions(**{**asdict(OPTIONS), **options})
    candidate.check()
    OPTIONS = candidate
    return OPTIONS


def _record(config) -> None:
    """Record the implementation in ``config`` so that ``save_pretrained`` writes it into
    ``config.json`` and ``from_pretrained`` selects it again (transformers reads
    ``attn_implementation`` from a saved config, and consumes it on loading)."""
    if config is not None and getattr(config, "__dict__", {}).get("attn_implementation") != ATTENTION_NAME:
        config.attn_implementation = ATTENTION_NAME


def enable(model: nn.Module, **options) -> nn.Module:
    """Switch ``model`` to kernelized attention (``set_attn_implementation``) with ``options``
    (for the rest: the options already recorded in its config, e.g. by a saved checkpoint, else
    the defaults of :func:`configure`), recorded in ``model.config`` with the implementation, so
    that ``save_pretrained`` keeps them and ``from_pretrained`` restores them (``hf_kernattn``
    imported). Returns the model."""
    _refuse_softmax_window(options)
    recorded = getattr(model.config, "kernelized_attention", None)
    base = asdict(_options(model)) if recorded is not None else asdict(OPTIONS)
    opts = DropInOptions(**{**base, **options})
    opts.check()
    model.config.kernelized_attention = asdict(opts)
    model.set_attn_implementation(ATTENTION_NAME)
    _record(model.config)
    return model


def disable(model: nn.Module, attn_implementation: str = "sdpa") -> nn.Module:
    """Switch ``model`` back to softmax attention (``attn_implementation``: ``"sdpa"`` or
    ``"eager"``) and drop the kernelized records from its config, so that a saved copy loads
    as softmax too. Returns the model."""
    if attn_implementation == ATTENTION_NAME or not isinstance(attn_implementation, str):
        raise ValueError(f"attn_implementation must name a softmax implementation such as 'sdpa' or 'eager', "
                         f"got {attn_implementation!r}")
    model.set_attn_implementation(attn_implementation)
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        for name in ("kernelized_attention", "attn_implementation"):
            config.__dict__.pop(name, None)
    return model


def _options(module: nn.Module) -> DropInOptions:
    """The options recorded in the module's config by :func:`enable`, else the defaults;
    ``TypeError``/``ValueError`` naming ``config.kernelized_attention`` when it is not a dict
    of known options with valid values."""
    config = getattr(module, "config", None)
    recorded = getattr(config, "kernelized_attention", None)
    _record(config)
    if recorded is None:
        return OPTIONS
    fields = list(DropInOptions.__dataclass_fields__)
    if not isinstance(recorded, dict):
        raise TypeError(f"config.kernelized_attention must be a dict of drop-in options {fields} (as "
                        f"hf_kernattn.drop_in.enable records it) or None, got {type(recorded).__name__} {recorded!r}")
    unknown = sorted(set(recorded) - set(fields), key=str)
    if unknown:
        raise ValueError(f"config.kernelized_attention has unknown options {unknown}; allowed: {fields}")
    opts = DropInOptions(**recorded)
    try:
        opts.check()
    except ValueError as err:
        raise ValueError(f"config.kernelized_attention: {err}") from None
    return opts


def _feature_map(module: nn.Module, head_dim: int, opts: DropInOptions, device) -> Optional[FeatureMap]:
    """The layer's feature map for ``opts``, drawn on first use from ``seed + 1000 * layer`` and
    cached on the module outside its state (a function of the options: nothing to save)."""
    if opts.feature_map == "exact":
        return None
    layer = getattr(module, "layer_idx", None)
    layer = int(layer) if isinstance(layer, int) else 0
    key = (head_dim, opts.feature_map, opts.num_random_features, opts.feature_projection, opts.seed + 1000 * layer)
    cached = module.__dict__.get("_kernel_feature_map")
    if cached is None or cached[0] != key:
        fm = FeatureMap(head_dim=head_dim, feature_map=opts.feature_map, num_random_features=opts.num_random_features,
                        projection=opts.feature_projection, normalize_qk=False, redraw_interval=0, seed=key[-1])
        cached = (key, fm)
        module.__dict__["_kernel_feature_map"] = cached  # not a submodule: not in the state dict
    fm = cached[1]
    if fm.projection is not None and fm.projection.device != torch.device(device):
        fm.to(device)
    return fm


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: ``(B, H_kv, N, D)`` -> ``(B, heads, N, D)``."""
    if x.shape[1] == heads:
        return x
    if heads % x.shape[1]:
        raise ValueError(f"{heads} query heads cannot share {x.shape[1]} key/value heads evenly")
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _exact(q, k, v, scaling, causal, mask):
    """The exponential kernel evaluated densely: ``softmax(s q k^T)`` with the masks (the
    reference the random features estimate). ``q (B, H, Tq, D)``, ``k, v (B, H, Tk, D)``."""
    scores = (q @ k.transpose(-1, -2)) * scaling
    tq, tk = q.shape[2], k.shape[2]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tk - tq, tk, device=q.device)[:, None]
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys gives 0
    if mask is not None:  # whatever a padded value holds never enters
        v = torch.where(mask.bool()[:, None, :, None], v, torch.zeros((), dtype=v.dtype, device=v.device))
    return weights @ v


def kernelized_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' attention-function signature: ``query (B, H, Tq, D)``, ``key, value
    (B, H_kv, Tk, D)`` (cache-extended), ``attention_mask`` ``(B, Tk)`` 1/0 or None (from the
    mask entry registered with it) -> ``(output (B, Tq, H, D), None)``: kernelized attention
    forms no attention weights."""
    b, h, tq, d = query.shape
    key, value = _repeat_heads(key, h), _repeat_heads(value, h)
    tk = key.shape[2]
    scaling = d ** -0.5 if scaling is None else float(scaling)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("the kernelized attention function takes a (batch, keys) padding mask; register it with "
                         f"its mask entry (attn_implementation={ATTENTION_NAME!r} does)")
    if tq != tk and not causal:
        raise ValueError(f"kernelized attention needs as many queries as keys unless causal (decoding); got {tq} "
                         f"queries and {tk} keys (cross-attention is not supported)")
    fm = _feature_map(module, d, _options(module), query.device)
    if fm is None:
        out = _exact(query, key, value, scaling, causal, attention_mask)
    else:
        # the map estimates exp(x . y / sqrt(d)) for inputs x, y: feed it sqrt(s sqrt(d)) q, k
        factor = math.sqrt(scaling * math.sqrt(d))
        q = fm(query * factor, is_query=True)
        k = fm(key * factor, is_query=False, key_mask=attention_mask)
        if tq < tk:  # decoding with the model's cache: the new queries are the last Tq positions
            q = nn.functional.pad(q, (0, 0, tk - tq, 0))
        out = kernelized_attention(q, k, value.to(q.dtype), causal=causal, attention_mask=attention_mask)[:, :, tk - tq:]
    out = out.to(query.dtype).transpose(1, 2).contiguous()
    if dropout and module.training:
        out = nn.functional.dropout(out, p=dropout, training=True)
    return out, None


def register() -> None:
    """Register :data:`ATTENTION_NAME` with transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION_NAME, kernelized_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)  # hands over the 2D padding mask


__all__ = ["ATTENTION_NAME", "DropInOptions", "configure", "disable", "enable", "kernelized_attention_forward", "register"]
