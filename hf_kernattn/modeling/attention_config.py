"""Validation of the attention fields every family config shares (same names everywhere).

Configs call :func:`validate_attention_fields` in ``__init__`` so a bad value fails when the
config is built, with a ``ValueError`` naming the field and what it allows.
"""

from __future__ import annotations

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
