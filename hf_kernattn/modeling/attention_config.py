"""One schema for the config fields: the attention fields every family shares
(:data:`SHARED_ATTENTION_FIELDS`) and the table each family declares its own fields in.

A field is a :class:`ConfigField` row (name, default, documentation, check). A family's
:class:`AttentionSchema` lists its own rows under headings and may override a shared default
(with the reason), narrow a shared choice or accept earlier values. A bad value fails when the
config is built, with ``TypeError`` (:class:`FieldTypeError`) or ``ValueError`` naming the field
and what it allows; checks across fields stay with the family. :meth:`AttentionSchema.declare`
writes the config's docstring from the same rows, so each field is documented once.
"""

from __future__ import annotations

import inspect
import math
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

from transformers.activations import ACT2FN

from .dispatch import get_backend  # the entry point: the built-in backends are registered
from .registry import AUTO_MAX_ERROR
from .feature_maps import FEATURE_MAPS, PROJECTIONS
from .positional import RPE_KINDS

# ----------------------------------------------------------------------------- per-field checks


class FieldTypeError(TypeError, ValueError):
    """A config field of the wrong type; also a ``ValueError``, which the configs raised for
    some wrong types before (code catching it keeps working)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _anything(value: object) -> bool:
    return True


@dataclass(frozen=True)
class Allowed:
    """One field's check: ``check(name, value)`` raises :class:`FieldTypeError` unless
    ``is_type(value)`` and ``ValueError`` unless ``is_value(value)``, saying ``"{name} must be
    {text}, got {value!r}"`` (``type_text``, if given, for the type error)."""

    text: str
    is_type: Callable[[object], bool]
    is_value: Callable[[Any], bool] = _anything
    type_text: Optional[str] = None

    def __call__(self, name: str, value: object) -> None:
        if not self.is_type(value):
            raise FieldTypeError(f"{name} must be {self.type_text or self.text}, got {value!r}")
        if not self.is_value(value):
            raise ValueError(f"{name} must be {self.text}, got {value!r}")


def choice(options: tuple, where: str = "") -> Allowed:
    """One of ``options`` (strings); ``where`` ends the message (e.g. ``" for NPRF-BERT"``)."""
    return Allowed(f"one of {list(options)}{where}", lambda v: isinstance(v, str), lambda v: v in options,
                   type_text=f"a string, one of {list(options)}{where}")


def int_at_least(lo: int, meaning: str = "") -> Allowed:
    return Allowed(f"an int >= {lo}{meaning}", _is_int, lambda v: v >= lo)


def finite_at_least(lo: float) -> Allowed:
    return Allowed(f"a finite number >= {lo}", _real, lambda v: math.isfinite(v) and v >= lo, type_text="a number")


def finite_above(lo: float) -> Allowed:
    return Allowed(f"a finite number > {lo}", _real, lambda v: math.isfinite(v) and v > lo, type_text="a number")


def optional(check: Allowed) -> Allowed:
    """None, or what ``check`` allows."""
    return Allowed(f"None or {check.text}", lambda v: v is None or check.is_type(v),
                   lambda v: v is None or check.is_value(v), type_text=f"None or {check.type_text or check.text}")


boolean = Allowed("a bool (True or False)", lambda v: isinstance(v, bool))
probability = Allowed("a float in [0, 1)", _real, lambda v: 0 <= v < 1)
activation = Allowed(
    f"one of {sorted(ACT2FN)} or a callable", lambda v: isinstance(v, str) or callable(v),
    lambda v: not isinstance(v, str) or v in ACT2FN, type_text="an activation name (a key of ACT2FN) or a callable",
)


def backend_name(name: str, value: object) -> None:
    """``"auto"`` or a registered backend name (the registry's message says which exist)."""
    if not isinstance(value, str):
        raise FieldTypeError(f"{name} must be a string ('auto' or a registered backend name), got {value!r}")
    if value != "auto":
        try:
            get_backend(value)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None


# ----------------------------------------------------------------------------- the schema


@dataclass(frozen=True)
class ConfigField:
    """One config field. ``check(name, value)`` raises ``TypeError`` / ``ValueError`` naming the
    field (None: no check); ``convert`` normalises an accepted value (e.g. ``float``)."""

    name: str
    default: Any
    doc: str
    check: Optional[Callable[[str, object], None]] = None
    convert: Optional[Callable[[Any], Any]] = None


_AUTO_RULE = (
    "``\"auto\"`` picks the fastest backend that can run the call, by a calibration table of "
    "measured times per case and length (``hf-kernattn bench calibrate`` measures one for your "
    "machine, ``hf_kernattn.load_auto_table`` loads it), taking the FFT only where its error "
    f"bound meets {AUTO_MAX_ERROR:g} (else the next ranked: an exact backend, or the FFT in float64)."
)

SHARED_ATTENTION_FIELDS: tuple[ConfigField, ...] = (
    ConfigField(
        "feature_map", "elu",
        "the feature map phi of queries and keys: ``\"elu\"`` (elu(x) + 1, Katharopoulos et al. "
        "2020), ``\"relu\"``, ``\"prf\"`` (positive random features, Choromanski et al. 2021), "
        "``\"trf\"`` (trigonometric random features) or a learned map (Hedgehog, Zhang et al. 2024) "
        "of z = W x, W of shape (d, m) per head for queries and for keys, initialised to I_{d x m} "
        "and trained with the model: ``\"hedgehog\"`` [softmax(z), softmax(-z)] or "
        "``\"hedgehog_exp\"`` [exp(z - c), exp(-z - c)] (c: the query's max |z_m|, 0 for keys), "
        "2m features.",
        choice(FEATURE_MAPS),
    ),
    ConfigField(
        "num_random_features", 64,
        "m, random features per head: feature size m for ``\"prf\"``, 2m for ``\"trf\"``; unused "
        "by the other maps.",
        int_at_least(1),
    ),
    ConfigField(
        "num_learned_features", None,
        "m, the learned projection's width per head of the learned maps (feature size 2m); None: "
        "the head size.",
        optional(int_at_least(1)),
    ),
    ConfigField(
        "feature_projection", "orthogonal",
        "how the random projection rows are drawn: ``\"orthogonal\"`` (blocks of orthogonal rows "
        "with chi(d) norms: unbiased, lower variance), ``\"gaussian\"`` (i.i.d. N(0, 1)) or "
        "``\"sphere\"`` (uniform on the sphere of radius sqrt(d)).",
        choice(PROJECTIONS),
    ),
    ConfigField(
        "normalize_qk", False,
        "l2-normalise queries and keys before the feature map (the \"N\" of NPRF, Luo et al. 2021: "
        "it stabilises random-feature training; every key is then in the maps' valid range).",
        boolean,
    ),
    ConfigField(
        "feature_redraw_interval", 0,
        "redraw the random projections every this many training forwards (0: never, so a saved "
        "model reproduces exactly); the draw counters are saved with the model.",
        int_at_least(0, " (0 = never redraw)"),
    ),
    ConfigField(
        "feature_seed", 0,
        "seed of the random projections (layer l draws from seed ``feature_seed + 1000*l``).",
        int_at_least(0),
    ),
    ConfigField(
        "rpe", "none",
        "relative-position bias b_{j-i} added to the kernel as weights c_{j-i} = exp(b_{j-i}): "
        "``\"none\"`` or ``\"learned\"`` (a learnable per-head table over offsets clipped at "
        "``max_relative_position``; a family may allow fewer kinds).",
        choice(RPE_KINDS),
    ),
    ConfigField(
        "max_relative_position", 64,
        "K, where the bias is clipped: offsets |j - i| > K share the bias of +-K (read when ``rpe`` "
        "is not ``\"none\"``).",
        int_at_least(1),
    ),
    ConfigField(
        "softmax_window", None,
        "W, the sliding-window hybrid (LoLCATs, Zhang et al. 2024): each query weighs the last W keys "
        "(causal, itself included) or those with |j - i| < W (bidirectional) by a_h exp(q . k / "
        "sqrt(d)) of the raw projected queries and keys, every other key by b_h phi(q) . phi(k), in "
        "one numerator and one denominator; a_h, b_h > 0 are learned per head and layer "
        "(``window_log_weight``, ``linear_log_weight``: their logs, initialised to 0). A decoding "
        "state adds the last W - 1 raw keys, features and values: constant size. None: off. No "
        "relative-position bias or rotary features with it; a family may refuse it.",
        optional(int_at_least(1)),
    ),
    ConfigField(
        "attn_backend", "auto",
        "``\"auto\"`` or a registered backend name (``hf_kernattn.available_backends()``) for the "
        "parallel form. " + _AUTO_RULE,
        backend_name,
    ),
    ConfigField(
        "attention_eps", 1e-6,
        "eps added to the attention denominator (a finite number >= 0).",
        finite_at_least(0),
        float,
    ),
    ConfigField(
        "attention_bias", True,
        "biases on the q/k/v/o projections.",
        boolean,
    ),
    ConfigField(
        "recompute_attention", True,
        "with gradients, keep only each attention block's q/k/v projections and recompute its "
        "feature maps and kernel in the backward pass (as flash attention recomputes its scores): "
        "same results, less memory, one more run of the feature maps and kernel per layer. Skipped "
        "inside a layer that gradient checkpointing already recomputes, and for backends whose "
        "backward needs only their inputs (``dense``, ``manhattan``: ``keeps_inputs``). "
        "``\"projections\"``: keep only the block's input and recompute the whole block, for every "
        "backend: about 4 N C fewer values kept per layer for four more N x C x C products in the "
        "backward, for long inputs where activations bound the batch. Applies to forwards without a "
        "decoding state (training, prefill), never to steps from a state.",
        Allowed("True, False or 'projections'", lambda v: isinstance(v, (bool, str)),
                lambda v: isinstance(v, bool) or v == "projections", type_text="a bool or the string 'projections'"),
    ),
)

SHARED_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in SHARED_ATTENTION_FIELDS)
_BY_NAME = {f.name: f for f in SHARED_ATTENTION_FIELDS}

# Every config records the version of the code that saved it and the checkpoint format; a newer
# format than this code reads fails, naming both. A field added later defaults to the behaviour
# of checkpoints written before it.
LIBRARY_VERSION = "0.1.0"  # equals hf_kernattn.__version__ (checked by a test)
CHECKPOINT_FORMAT = 1


def take_version_fields(kwargs: dict) -> dict[str, Any]:
    """Pop ``hf_kernattn_version`` and ``checkpoint_format`` from ``kwargs`` (``ValueError`` for a
    format newer than this code reads); returns this code's version and format, for the config."""
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
FAMILY_DOC_MARKER = "@family-fields@"
_DOC_WIDTH = 96

# Arguments every transformers config takes and passes on to ``PreTrainedConfig``; checked when given.
COMMON_FLAGS = ("use_cache", "output_attentions")

OUTPUT_ATTENTIONS_DOC = (
    "``output_attentions`` is kept, as by every transformers config, but kernelized attention "
    "forms no attention matrix: with ``output_attentions=True`` in the config a model returns no "
    "attention weights (and warns once); ``forward(output_attentions=True)`` raises ``ValueError``."
)


class AttentionSchema:
    """One family's schema: its own fields and its view of the shared ones.

    Args:
        family: the family's name, for messages and the documentation.
        fields: the family's :class:`ConfigField` rows in documentation order, each group after
            its heading (a string); they include ``hidden_size`` and ``num_attention_heads``.
        choices: ``{field: options}``: the options of a shared choice field this family takes.
        aliases: ``{field: {earlier: current}}``: earlier values still accepted, stored as current.
        overrides: ``field=(default, reason)``: the family's default of a shared field and why
            (shown in the documentation).
    """

    def __init__(
        self,
        family: str,
        *,
        fields: tuple = (),
        choices: Optional[dict[str, tuple]] = None,
        aliases: Optional[dict[str, dict[str, str]]] = None,
        **overrides: tuple[Any, str],
    ) -> None:
        self.family = family
        self.groups: list[tuple[str, list[ConfigField]]] = []
        for row in fields:
            if isinstance(row, str):
                self.groups.append((row, []))
            elif isinstance(row, ConfigField) and self.groups:
                self.groups[-1][1].append(row)
            else:
                raise TypeError(f"fields must be headings (str), each followed by its ConfigField rows, got {row!r}")
        self.own_fields: tuple[ConfigField, ...] = tuple(f for _, group in self.groups for f in group)
        self._fields = {f.name: f for f in SHARED_ATTENTION_FIELDS}
        for field in self.own_fields:
            if field.name in self._fields:
                raise ValueError(f"{field.name!r} is declared twice (the shared fields are {list(SHARED_FIELD_NAMES)})")
            self._fields[field.name] = field
        if fields and not {"hidden_size", "num_attention_heads"} <= set(self._fields):
            raise ValueError("a family's fields must include hidden_size and num_attention_heads")
        self.checks = {name: field.check for name, field in self._fields.items()}
        for name, options in (choices or {}).items():
            if name not in _BY_NAME:
                raise ValueError(f"{name!r} is not a shared attention field; they are {list(SHARED_FIELD_NAMES)}")
            for option in options:
                _BY_NAME[name].check(name, option)
            self.checks[name] = choice(tuple(options), f" for {family}")
        self.aliases = {name: dict(table) for name, table in (aliases or {}).items()}
        for name, table in self.aliases.items():
            for current in table.values():
                self.check(name, current)
        self.overrides: dict[str, tuple[Any, str]] = {}
        for name, spec in overrides.items():
            if name not in _BY_NAME:
                raise ValueError(f"{name!r} is not a shared attention field; they are {list(SHARED_FIELD_NAMES)}")
            if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str) and spec[1]):
                raise TypeError(f"override of {name} must be (default, reason), got {spec!r}")
            self.check(name, spec[0])
            self.overrides[name] = spec

    @property
    def field_names(self) -> tuple[str, ...]:
        """Every field of the family: its own, then the shared ones."""
        return tuple(f.name for f in self.own_fields) + SHARED_FIELD_NAMES

    def default(self, name: str) -> Any:
        """This family's default of the field ``name`` (its own or a shared one)."""
        return self.overrides[name][0] if name in self.overrides else self._fields[name].default

    @property
    def defaults(self) -> dict[str, Any]:
        """This family's defaults of the shared fields."""
        return {name: self.default(name) for name in SHARED_FIELD_NAMES}

    def check(self, name: str, value: object) -> None:
        """``TypeError`` / ``ValueError`` naming ``name`` unless this family's field takes ``value``."""
        if self.checks[name] is not None:
            self.checks[name](name, value)

    def take(self, kwargs: dict) -> dict[str, Any]:
        """Pop the family's fields from ``kwargs`` (defaults filled, earlier values replaced),
        check them, the head size and the common flags; returns ``{name: value}`` with the
        version fields."""
        values = {}
        for field in self.own_fields + SHARED_ATTENTION_FIELDS:
            value = kwargs.pop(field.name, self.default(field.name))
            if isinstance(value, str):
                value = self.aliases.get(field.name, {}).get(value, value)
            self.check(field.name, value)
            values[field.name] = field.convert(value) if field.convert is not None else value
        check_head_size(values["hidden_size"], values["num_attention_heads"])
        for name in COMMON_FLAGS:
            if kwargs.get(name) is not None:
                boolean(name, kwargs[name])
        values.update(take_version_fields(kwargs))
        return values

    @staticmethod
    def apply(config: Any, values: dict[str, Any]) -> None:
        """Set the fields ``values`` (from :meth:`take`) on ``config``."""
        for name, value in values.items():
            setattr(config, name, value)

    def configure(self, config: Any, kwargs: dict, check_combinations: Callable[[dict], None]) -> None:
        """A config's ``__init__`` before ``PreTrainedConfig.__init__``: :meth:`take`,
        ``check_combinations(values)`` (checks across fields; may fill derived defaults),
        :meth:`apply`."""
        values = self.take(kwargs)
        check_combinations(values)
        self.apply(config, values)

    def field_doc(self, name: str) -> str:
        """One field's documentation (a shared field's is the same in every family; no default)."""
        return _wrap(f"{name}: {self._fields[name].doc}", "        ", "            ")

    def default_doc(self, name: str) -> str:
        """The line stating this family's default of ``name`` (and the reason of an override)."""
        text = f"Default: ``{self.default(name)!r}``"
        if name in self.overrides:
            text += f" ({self.overrides[name][1]})"
        return _wrap(text + ".", "            ", "            ")

    def _fields_doc(self, heading: list[str], names) -> list[str]:
        lines = heading + [""]
        for name in names:
            lines += [self.field_doc(name), self.default_doc(name)]
        return lines

    def document(self, docstring: Optional[str]) -> Optional[str]:
        """``docstring`` with the :data:`FAMILY_DOC_MARKER` and :data:`DOC_MARKER` lines replaced
        by the documentation of the family's own and the shared fields, with this family's
        defaults. ``ValueError`` without a marker; None stays None (``python -OO``)."""
        if docstring is None or (sys.flags.optimize >= 2 and DOC_MARKER not in docstring):
            return docstring  # -OO: no docstring (or one a dataclass decorator wrote)
        for marker in (DOC_MARKER,) + ((FAMILY_DOC_MARKER,) if self.own_fields else ()):
            if marker not in docstring:
                raise ValueError(f"the docstring of the {self.family} config must hold the line {marker!r}")
        shared = self._fields_doc([
            "    Shared attention fields (same names, meaning and checks in every hf-kernattn family;",
            "    one schema, ``attention_config.py``):",
        ], SHARED_FIELD_NAMES)
        shared += ["", _wrap(OUTPUT_ATTENTIONS_DOC, "    ", "    ")]
        docstring = docstring.replace(f"    {DOC_MARKER}", "\n".join(shared))
        own = []
        for heading, group in self.groups:
            own += ([""] if own else []) + self._fields_doc([_wrap(heading + ":", "    ", "    ")], [f.name for f in group])
        return docstring.replace(f"    {FAMILY_DOC_MARKER}", "\n".join(own))

    def declare(self, config_class: type) -> type:
        """Class decorator of a family config: its docstring (:meth:`document`) and an
        ``__init__`` signature of the fields (keyword-only, with defaults) for ``help()`` and editors."""
        config_class.__doc__ = self.document(config_class.__doc__)
        kw = inspect.Parameter.KEYWORD_ONLY
        config_class.__init__.__signature__ = inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [inspect.Parameter(name, kw, default=self.default(name)) for name in self.field_names]
            + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
        )
        return config_class


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, width=_DOC_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


BASE_ATTENTION_SCHEMA = AttentionSchema("base")


def complete_attention_fields(config: Any) -> Any:
    """``config`` if it carries every shared field, else a namespace of its attributes plus the
    base defaults of the missing ones (a bare namespace, or another model's config)."""
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
    """``ValueError`` (:class:`FieldTypeError` for a wrong type) for the first invalid shared
    field among ``fields`` (the configs' checks) or head size; ``TypeError`` for a name that is
    no shared field."""
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
