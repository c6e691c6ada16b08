"""Validation of the fields every family config shares (same names everywhere).

Configs call :func:`validate_attention_fields` and :func:`validate_model_fields` in
``__init__`` so a bad value fails when the config is built, with a ``ValueError`` (bad value) or
``TypeError`` (bad type) naming the field and what it allows.
"""

from __future__ import annotations

import math

from transformers.activations import ACT2FN

from .backends import get_backend
from .feature_maps import check_feature_map_args
from .positional import check_rpe_args


def validate_attention_fields(
    *,
    hidden_size: int,
    num_attention_heads: int,
    feature_map: str,
    num_random_features: int,
    feature_projection: str,
    normalize_qk: bool,
    feature_redraw_interval: int,
    rpe: str,
    max_relative_position: int,
    attn_backend: str,
) -> None:
    """Raise ``ValueError`` for the first invalid shared attention field."""
    if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
        raise ValueError(f"num_attention_heads must be a positive int, got {num_attention_heads!r}")
    if not isinstance(hidden_size, int) or hidden_size < 1 or hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size must be a positive multiple of num_attention_heads ({num_attention_heads}), got {hidden_size!r}"
        )
    check_feature_map_args(
        feature_map, feature_projection, num_random_features, hidden_size // num_attention_heads, feature_redraw_interval
    )
    if not isinstance(normalize_qk, bool):
        raise ValueError(f"normalize_qk must be a bool, got {normalize_qk!r}")
    check_rpe_args(rpe, max_relative_position)
    if not isinstance(attn_backend, str):
        raise ValueError(f"attn_backend must be a string ('auto' or a registered backend name), got {attn_backend!r}")
    if attn_backend != "auto":
        try:
            get_backend(attn_backend)
        except ValueError as err:
            raise ValueError(f"attn_backend: {err}") from None


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_model_fields(
    *,
    hidden_act: object,
    initializer_range: object,
    layer_norm_eps: tuple[str, object],
    attention_eps: object,
    feature_seed: object,
    use_cache: object = None,
    output_attentions: object = None,
) -> None:
    """Raise for the first invalid model-level field shared by the families.

    Args:
        hidden_act: a key of ``transformers.activations.ACT2FN`` or a callable.
        initializer_range: a finite number >= 0.
        layer_norm_eps: ``(field name, value)``; a finite number > 0 (the families name it differently).
        attention_eps: a finite number >= 0.
        feature_seed: an int >= 0.
        use_cache: a bool, or None where the family has no such field.
        output_attentions: anything but True (kernelized attention forms no attention matrix).
    """
    if isinstance(hidden_act, str):
        if hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act must be one of {sorted(ACT2FN)} or a callable, got {hidden_act!r}")
    elif not callable(hidden_act):
        raise TypeError(f"hidden_act must be an activation name (a key of ACT2FN) or a callable, got {hidden_act!r}")
    if not _real(initializer_range):
        raise TypeError(f"initializer_range must be a number, got {initializer_range!r}")
    if not math.isfinite(initializer_range) or initializer_range < 0:
        raise ValueError(f"initializer_range must be a finite number >= 0, got {initializer_range!r}")
    name, eps = layer_norm_eps
    if not _real(eps):
        raise TypeError(f"{name} must be a number, got {eps!r}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {eps!r}")
    if not _real(attention_eps):
        raise TypeError(f"attention_eps must be a number, got {attention_eps!r}")
    if not math.isfinite(attention_eps) or attention_eps < 0:
        raise ValueError(f"attention_eps must be a finite number >= 0, got {attention_eps!r}")
    if not isinstance(feature_seed, int) or isinstance(feature_seed, bool):
        raise TypeError(f"feature_seed must be an int >= 0, got {feature_seed!r}")
    if feature_seed < 0:
        raise ValueError(f"feature_seed must be an int >= 0, got {feature_seed!r}")
    if use_cache is not None and not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {use_cache!r}")
    if output_attentions:
        raise ValueError(
            "output_attentions=True is not supported: kernelized attention never forms the attention matrix, "
            "so there are no attention weights to return (output_hidden_states=True is supported)"
        )
