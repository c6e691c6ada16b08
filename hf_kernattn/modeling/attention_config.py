"""The one schema of the attention fields every hf-kernattn family shares.

Every family config (NPRF-BERT, Linear GPT, ...) carries the fields of
:data:`SHARED_ATTENTION_FIELDS` under the same names, with the same meaning, documentation and
checks; each config declares only its own fields on top. A family states its
:class:`AttentionSchema`, which may override a default explicitly (with the reason), and calls
:meth:`AttentionSchema.take` in ``__init__``: the shared fields are taken from the keyword
arguments, missing ones get the family's default, and a bad value fails when the config is
built, with a ``TypeError`` (wrong type: :class:`FieldTypeError`, also a ``ValueError``) or
``ValueError`` (bad value) naming the field and what it allows. :meth:`AttentionSchema.document` writes the shared part of the config's docstring
from the same text, so the documentation exists once.

:class:`~hf_kernattn.KernelizedSelfAttention` reads these fields from the config directly.
:func:`complete_attention_fields` gives a bare namespace (a standalone module, a config of a
model that is not an hf-kernattn family) the schema's base defaults for the fields it lacks.
"""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

from transformers.activations import ACT2FN

from .dispatch import get_backend  # the entry point: the built-in backends are registered
from .registry import AUTO_DENSE_MAX_N, AUTO_FFT_MAX_ERROR, AUTO_WINDOWED_MIN_N, AUTO_WINDOWED_MIN_RATIO
from .feature_maps import FEATURE_MAPS, PROJECTIONS
from .positional import RPE_KINDS

# ----------------------------------------------------------------------------- per-field checks


class FieldTypeError(TypeError, ValueError):
    """A shared field given a value of the wrong type. A ``TypeError``, and a ``ValueError`` too:
    the configs refused some wrong types (``normalize_qk="yes"``) with ``ValueError`` before
    the schema existed, and code catching that keeps working."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(options: tuple) -> Callable[[str, object], None]:
    def check(name: str, value: object) -> None:
        if not isinstance(value, str):
            raise FieldTypeError(f"{name} must be a string, one of {list(options)}, got {value!r}")
        if value not in options:
            raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")

    return check


def _int_at_least(lo: int, meaning: str = "") -> Callable[[str, object], None]:
    def check(name: str, value: object) -> None:
        if not _is_int(value):
            raise FieldTypeError(f"{name} must be an int >= {lo}{meaning}, got {value!r}")
        if value < lo:
            raise ValueError(f"{name} must be an int >= {lo}{meaning}, got {value!r}")

    return check


def _boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise FieldTypeError(f"{name} must be a bool (True or False), got {value!r}")


def _finite_at_least_zero(name: str, value: object) -> None:
    if not _real(value):
        raise FieldTypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _backend_name(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise FieldTypeError(f"{name} must be a string ('auto' or a registered backend name), got {value!r}")
    if value != "auto":
        try:
            get_backend(value)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None


# ----------------------------------------------------------------------------- the schema


@dataclass(frozen=True)
class SharedField:
    """One shared attention field: its name, base default, documentation and check.

    ``check(name, value)`` raises ``TypeError`` / ``ValueError`` naming the field; ``convert``
    (optional) normalises an accepted value before it is stored (e.g. ``float``)."""

    name: str
    default: Any
    doc: str
    check: Callable[[str, object], None]
    convert: Optional[Callable[[Any], Any]] = None


_AUTO_RULE = (
    "``\"auto\"`` picks the fastest backend valid for the call: with a relative-position bias "
    f"clipped at K (``rpe=\"learned\"``), the exact O(N K) ``windowed`` backend once "
    f"N >= max({AUTO_WINDOWED_MIN_N}, {AUTO_WINDOWED_MIN_RATIO} K); otherwise, with a bias, "
    f"``dense`` up to N = {AUTO_DENSE_MAX_N['rpe']} and ``fft`` beyond it (``windowed``, or the FFT "
    "in float64, where the FFT's error bound in the input's precision exceeds "
    f"{AUTO_FFT_MAX_ERROR:g}); without a bias, ``dense`` for short inputs (N <= "
    f"{AUTO_DENSE_MAX_N['causal']} causal, {AUTO_DENSE_MAX_N['plain']} otherwise), then "
    "``causal_chunked`` (causal) or ``linear``."
)

SHARED_ATTENTION_FIELDS: tuple[SharedField, ...] = (
    SharedField(
        "feature_map", "elu",
        "the feature map phi applied to queries and keys (``feature_maps.py``): ``\"elu\"`` "
        "(elu(x) + 1, Katharopoulos et al. 2020), ``\"relu\"``, ``\"prf\"`` (positive random "
        "features, Choromanski et al. 2021) or ``\"trf\"`` (trigonometric random features).",
        _choice(FEATURE_MAPS),
    ),
    SharedField(
        "num_random_features", 64,
        "m, random features per head of ``\"prf\"`` (feature size m) and ``\"trf\"`` (2m); an int "
        ">= 1, unused by the deterministic maps.",
        _int_at_least(1),
    ),
    SharedField(
        "feature_projection", "orthogonal",
        "how the random projection rows are drawn: ``\"orthogonal\"`` (blocks of orthogonal rows "
        "with chi(d) norms: unbiased, lower variance), ``\"gaussian\"`` (i.i.d. N(0, 1)) or "
        "``\"sphere\"`` (uniform on the sphere of radius sqrt(d)).",
        _choice(PROJECTIONS),
    ),
    SharedField(
        "normalize_qk", False,
        "l2-normalise queries and keys before the feature map (the \"N\" of NPRF: Luo et al. 2021 "
        "show it is what makes random-feature training stable; every key is then in the maps' "
        "valid range).",
        _boolean,
    ),
    SharedField(
        "feature_redraw_interval", 0,
        "redraw the random projections every this many training forwards; 0 never redraws, so a "
        "saved model is exactly reproducible. The draw counters are saved with the model.",
        _int_at_least(0, " (0 = never redraw)"),
    ),
    SharedField(
        "feature_seed", 0,
        "seed of the random projections (layer l draws from seed ``feature_seed + 1000*l``).",
        _int_at_least(0),
    ),
    SharedField(
        "rpe", "none",
        "relative-position bias b_{j-i} added to the kernel as weights c_{j-i} = exp(b_{j-i}): "
        "``\"none\"`` or ``\"learned\"`` (a learnable per-head table over offsets clipped at "
        "``max_relative_position``; a family may allow fewer kinds).",
        _choice(RPE_KINDS),
    ),
    SharedField(
        "max_relative_position", 64,
        "K, where the bias is clipped: offsets |j - i| > K share the bias of +-K (an int >= 1; "
        "read when ``rpe`` is not ``\"none\"``).",
        _int_at_least(1),
    ),
    SharedField(
        "attn_backend", "auto",
        "``\"auto\"`` or a registered backend name (``hf_kernattn.available_backends()``) for the "
        "parallel form. " + _AUTO_RULE,
        _backend_name,
    ),
    SharedField(
        "attention_eps", 1e-6,
        "eps added to the attention denominator (a finite number >= 0).",
        _finite_at_least_zero,
        float,
    ),
    SharedField(
        "attention_bias", True,
        "biases on the q/k/v/o projections.",
        _boolean,
    ),
    SharedField(
        "recompute_attention", True,
        "when gradients are needed, keep only each attention block's q/k/v projections and "
        "recompute its feature maps and kernel intermediates in the backward pass (flash "
        "attention recomputes its scores the same way): same outputs and gradients, less memory, "
        "one more run of the feature maps and kernel per layer (the projections are not redone). Off inside a layer that transformers' "
        "gradient checkpointing already recomputes. A causal LM applies it to forwards that start "
        "without a decoding state (training, prefill); steps that continue from a state never "
        "recompute.",
        _boolean,
    ),
)

SHARED_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in SHARED_ATTENTION_FIELDS)
_BY_NAME = {f.name: f for f in SHARED_ATTENTION_FIELDS}

# Which code wrote a checkpoint. Every config records the version of the code holding it (the
# code that saves it) and the checkpoint format; loading a config of a newer format than this
# code reads fails with a message naming both versions. A field added later gets a default that
# reproduces the behaviour of checkpoints written before it existed.
LIBRARY_VERSION = "0.1.0"  # equals hf_kernattn.__version__ (checked by a test)
CHECKPOINT_FORMAT = 1


def take_version_fields(kwargs: dict) -> dict[str, Any]:
    """Remove ``hf_kernattn_version`` and ``checkpoint_format`` (as a loaded ``config.json``
    holds them) from ``kwargs``; ``ValueError`` naming both versions when the checkpoint's format
    is newer than this code reads. Returns the values this code records: its own version and
    format (a checkpoint saved again records the code that saved it)."""
    written_by = kwargs.pop("hf_kernattn_version", None)
    fmt = kwargs.pop("checkpoint_format", CHECKPOINT_FORMAT)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise ValueError(f"checkpoint_format must be an int >= 1, got {fmt!r}")
    if fmt > CHECKPOINT_FORMAT:
        raise ValueError(
            f"this checkpoint was written by hf-kernattn {written_by or 'unknown'} in checkpoint format {fmt}; "
            f"this code is hf-kernattn {LIBRARY_VERSION} and reads formats up to {CHECKPOINT_FORMAT}: upgrade "
            "hf-kernattn, or load the checkpoint with its own code (trust_remote_code=True, without hf_kernattn "
            "registered for this model type)"
        )
    return {"hf_kernattn_version": LIBRARY_VERSION, "checkpoint_format": CHECKPOINT_FORMAT}


DOC_MARKER = "@shared-attention-fields@"
_DOC_WIDTH = 96


class AttentionSchema:
    """One family's view of the shared fields: the base schema plus explicit default overrides.

    Args:
        family: the family's name, used in the generated documentation.
        overrides: ``field=(default, reason)``: the family's own default for a shared field and
            why it differs (shown in the documentation). The default must pass the field's check.
    """

    def __init__(self, family: str, **overrides: tuple[Any, str]) -> None:
        self.family = family
        self.overrides: dict[str, tuple[Any, str]] = {}
        for name, spec in overrides.items():
            if name not in _BY_NAME:
                raise ValueError(f"{name!r} is not a shared attention field; they are {list(SHARED_FIELD_NAMES)}")
            if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str) and spec[1]):
                raise TypeError(f"override of {name} must be (default, reason), got {spec!r}")
            _BY_NAME[name].check(name, spec[0])
            self.overrides[name] = spec

    def default(self, name: str) -> Any:
        """This family's default of the shared field ``name``."""
        return self.overrides[name][0] if name in self.overrides else _BY_NAME[name].default

    @property
    def defaults(self) -> dict[str, Any]:
        return {name: self.default(name) for name in SHARED_FIELD_NAMES}

    def take(self, kwargs: dict, *, hidden_size: int, num_attention_heads: int) -> dict[str, Any]:
        """Remove the shared fields from ``kwargs`` (a config's ``**kwargs``), fill the family's
        defaults, check every value (each field once, then the head size the fields are used
        with), and return ``{name: value}`` for the config to set, with the version fields of
        :func:`take_version_fields`."""
        values = {}
        for field in SHARED_ATTENTION_FIELDS:
            value = kwargs.pop(field.name, self.default(field.name))
            field.check(field.name, value)
            values[field.name] = field.convert(value) if field.convert is not None else value
        check_head_size(hidden_size, num_attention_heads)
        values.update(take_version_fields(kwargs))
        return values

    @staticmethod
    def apply(config: Any, values: dict[str, Any]) -> None:
        """Set the shared fields ``values`` (from :meth:`take`) on ``config``."""
        for name, value in values.items():
            setattr(config, name, value)

    def field_doc(self, name: str) -> str:
        """The documentation of one shared field, identical in every family (no default in it)."""
        return _wrap(f"{name}: {_BY_NAME[name].doc}", "        ", "            ")

    def default_doc(self, name: str) -> str:
        """The line stating this family's default of ``name`` (and the reason of an override)."""
        text = f"Default: ``{self.default(name)!r}``"
        if name in self.overrides:
            text += f" ({self.overrides[name][1]})"
        return _wrap(text + ".", "            ", "            ")

    def document(self, docstring: Optional[str]) -> Optional[str]:
        """``docstring`` with :data:`DOC_MARKER` (on a line of its own) replaced by the shared
        fields' documentation and this family's defaults. ``ValueError`` without the marker;
        None stays None (``python -OO`` strips docstrings)."""
        if docstring is None or (sys.flags.optimize >= 2 and DOC_MARKER not in docstring):
            return docstring  # -OO: no docstring (or one a dataclass decorator wrote)
        if DOC_MARKER not in docstring:
            raise ValueError(f"the docstring of the {self.family} config must hold the line {DOC_MARKER!r}")
        lines = [
            "    Shared attention fields (same names, meaning and checks in every hf-kernattn family;",
            "    one schema, ``attention_config.py``):",
            "",
        ]
        for name in SHARED_FIELD_NAMES:
            lines.append(self.field_doc(name))
            lines.append(self.default_doc(name))
        return docstring.replace(f"    {DOC_MARKER}", "\n".join(lines))


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, width=_DOC_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


BASE_ATTENTION_SCHEMA = AttentionSchema("base")


def complete_attention_fields(config: Any) -> Any:
    """``config`` itself when it carries every shared field; otherwise a namespace with its
    attributes plus the base schema's defaults for the missing shared fields (the values it
    does carry are kept as they are). For modules built from a bare namespace or from a config
    of a model that is not an hf-kernattn family; family configs always carry every field."""
    missing = [name for name in SHARED_FIELD_NAMES if not hasattr(config, name)]
    if not missing:
        return config
    values = dict(vars(config)) if hasattr(config, "__dict__") else {}
    for name in ("hidden_size", "num_attention_heads"):
        values[name] = getattr(config, name)
    for name in missing:
        values[name] = BASE_ATTENTION_SCHEMA.default(name)
    return SimpleNamespace(**values)


# ----------------------------------------------------------------------------- combined checks


def check_head_size(hidden_size: object, num_attention_heads: object) -> None:
    """``ValueError`` unless ``hidden_size`` is a positive multiple of a positive
    ``num_attention_heads`` (the head size every shared field is used with)."""
    if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
        raise ValueError(f"num_attention_heads must be a positive int, got {num_attention_heads!r}")
    if not isinstance(hidden_size, int) or hidden_size < 1 or hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size must be a positive multiple of num_attention_heads ({num_attention_heads}), got {hidden_size!r}"
        )


def validate_attention_fields(*, hidden_size: int, num_attention_heads: int, **fields: Any) -> None:
    """Raise ``ValueError`` (:class:`FieldTypeError` for a wrong type, also a ``ValueError``) for
    the first invalid shared attention field among ``fields`` (each by its schema check, the same
    the configs run) or an invalid head size. ``TypeError`` for a name that is no shared field."""
    for name, value in fields.items():
        if name not in _BY_NAME:
            raise TypeError(f"{name!r} is not a shared attention field; they are {list(SHARED_FIELD_NAMES)}")
        _BY_NAME[name].check(name, value)
    check_head_size(hidden_size, num_attention_heads)


NO_ATTENTION_WEIGHTS = (
    "{name} has no attention weights to return: kernelized attention never forms the N x N attention "
    "matrix, so output_attentions=True is not supported (output_hidden_states=True is)"
)

CONFIG_ATTENTIONS_IGNORED = (
    "{name}: the config has output_attentions=True, but there are no attention weights to return "
    "(kernelized attention never forms the N x N attention matrix); the outputs carry none. Set "
    "config.output_attentions = False to silence this."
)


def validate_model_fields(
    *,
    family: str,
    hidden_act: object,
    initializer_range: object,
    layer_norm_eps: tuple[str, object],
    use_cache: object = None,
    output_attentions: object = None,
) -> None:
    """Raise for the first invalid model-level field the families share (not attention fields).

    Args:
        family: the family's name, for messages.
        hidden_act: a key of ``transformers.activations.ACT2FN`` or a callable.
        initializer_range: a finite number >= 0.
        layer_norm_eps: ``(field name, value)``; a finite number > 0 (the families name it differently).
        use_cache: a bool, or None where the family has no such field.
        output_attentions: a bool, or None when not given. ``True`` is accepted and kept, as
            transformers' models without attention weights keep it (it is one of the arguments
            every transformers config takes); the models return no attention weights, and a
            ``forward`` that asks for them explicitly raises.
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
    if use_cache is not None and not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {use_cache!r}")
    if output_attentions is not None and not isinstance(output_attentions, bool):
        raise TypeError(f"output_attentions must be a bool, got {output_attentions!r}")
