"""Calibration tables for ``backend="auto"``: their file format, checks and loading.

``hf-kernattn bench calibrate`` measures on a machine which backend is fastest for each kind of
call and length and writes a table (JSON). :func:`load_auto_table` (or the ``HF_KERNATTN_AUTO_TABLE``
environment variable, read on the first automatic choice) makes it active; the table shipped with
the package (``modeling/auto_table.py``, which checkpoints carry) serves every kind it does not
measure. Checkpoints loaded without the package use the shipped table only.

A table is ``{"format": 1, "entries": [...], ...}`` (other top-level keys, e.g. ``"source"``, are a
record and not read). Each entry is ``{"mode": "fwd" | "fwdbwd", "bias": "none" | "1d" | "2d",
"causal": bool, "clip": null | K, "dtype": "float32" | "float64", "ranking": [[n_max, [backend,
...]], ..., [null, [backend, ...]]]}`` and optionally ``"heads": H`` (default 1): for inputs of at
most ``n_max`` tokens (the first segment that holds them) the backends fastest first;
``"name@float64"`` ranks backend ``name`` computed in float64. A call reads the entry of its kind
measured nearest to its own head count.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Optional

from .modeling import registry
from .modeling.registry import TABLE_BIASES, TABLE_DTYPES, TABLE_MODES

TABLE_FORMAT = 1
# the environment variable naming a user's table (JSON), loaded on the first automatic choice
AUTO_TABLE_ENV = "HF_KERNATTN_AUTO_TABLE"
_ENTRY_KEYS = ("mode", "bias", "causal", "clip", "dtype", "ranking")
_OPTIONAL_KEYS = ("heads",)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
# How deep a table's JSON may nest: a table nests 6 levels (object, entries, entry, ranking,
# segment, names) and its "source" record one more per merged calibration; far below the depth
# where parsing or printing a value would exhaust Python's recursion limit.
_MAX_TABLE_DEPTH = 100


def _table_error(where: str, problem: str) -> ValueError:
    return ValueError(f"auto table: {where}: {problem}")


def _check_ranked_name(where: str, item: object) -> tuple[str, Optional[str]]:
    """``"name"`` or ``"name@float64"`` -> ``(name, dtype or None)``."""
    if not isinstance(item, str) or not item:
        raise _table_error(where, f"a ranked backend must be a non-empty string, got {item!r}")
    name, _, dtype = item.partition("@")
    if not name or set(name) - _NAME_CHARS:
        raise _table_error(where, f"{item!r} is not a backend name (letters, digits, '_', '-', '.')")
    if "@" in item and dtype not in TABLE_DTYPES:
        raise _table_error(where, f"{item!r}: after '@' comes the dtype to compute in, one of {list(TABLE_DTYPES)}")
    return name, (dtype or None)


def _check_entry(i: int, entry: object) -> tuple[tuple, tuple]:
    """One entry -> ``(key, ranking)``; ``ValueError`` naming the entry and the problem."""
    where = f"entries[{i}]"
    if not isinstance(entry, dict):
        raise _table_error(where, f"must be an object with keys {list(_ENTRY_KEYS)}, got {type(entry).__name__}")
    if set(entry) - set(_OPTIONAL_KEYS) != set(_ENTRY_KEYS):
        raise _table_error(where, f"must have exactly the keys {list(_ENTRY_KEYS)} (and optionally {list(_OPTIONAL_KEYS)}); "
                                  f"missing {sorted(set(_ENTRY_KEYS) - set(entry))}, "
                                  f"unknown {sorted(set(entry) - set(_ENTRY_KEYS) - set(_OPTIONAL_KEYS))}")
    mode, bias, causal, clip, dtype = (entry[k] for k in _ENTRY_KEYS[:5])
    heads = entry.get("heads", 1)
    where = f"{where} ({mode}, bias {bias}, causal {causal}, clip {clip}, {dtype}, heads {heads})"
    if type(heads) is not int or heads < 1:
        raise _table_error(where, f"heads must be the head count it was measured at (an int >= 1), got {heads!r}")
    if mode not in TABLE_MODES:
        raise _table_error(where, f"mode must be one of {list(TABLE_MODES)}, got {mode!r}")
    if bias not in TABLE_BIASES:
        raise _table_error(where, f"bias must be one of {list(TABLE_BIASES)}, got {bias!r}")
    if type(causal) is not bool:
        raise _table_error(where, f"causal must be true or false, got {causal!r}")
    if causal and bias == "2d":
        raise _table_error(where, "causal attention has no 2D bias")
    if clip is not None and (type(clip) is not int or clip < 0 or bias == "none"):
        raise _table_error(where, f"clip must be null or, with a bias, the K it was measured at (an int >= 0), got {clip!r}")
    if dtype not in TABLE_DTYPES:
        raise _table_error(where, f"dtype must be one of {list(TABLE_DTYPES)}, got {dtype!r}")
    ranking = entry["ranking"]
    if not isinstance(ranking, list) or not ranking:
        raise _table_error(where, "ranking must be a non-empty list of [n_max, [backend, ...]] (n_max null for the last)")
    segments, previous = [], 0
    for j, segment in enumerate(ranking):
        at = f"{where}: ranking[{j}]"
        if not isinstance(segment, (list, tuple)) or len(segment) != 2:
            raise _table_error(at, f"must be a pair [n_max, [backend, ...]], got {segment!r}")
        n_max, names = segment
        last = j == len(ranking) - 1
        if last and n_max is not None:
            raise _table_error(at, f"the last segment must have n_max null (every longer input), got {n_max!r}")
        if not last and (type(n_max) is not int or n_max <= previous):
            raise _table_error(at, f"n_max must be an int greater than the previous segment's ({previous}), got {n_max!r}")
        if not isinstance(names, (list, tuple)) or not names:
            raise _table_error(at, f"must rank at least one backend, got {names!r}")
        ranked = tuple(_check_ranked_name(at, item) for item in names)
        if len(set(ranked)) != len(ranked):
            raise _table_error(at, f"ranks a backend twice: {list(names)}")
        segments.append((n_max, ranked))
        previous = n_max if n_max is not None else previous
    return (mode, bias, causal, clip, dtype, heads), tuple(segments)


def _depth_error(table: object) -> Optional[str]:
    """None, or the problem with a table that nests beyond ``_MAX_TABLE_DEPTH`` (walked without
    recursion, so any depth is measured)."""
    stack = [(table, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if depth > _MAX_TABLE_DEPTH:
                return f"nests deeper than {_MAX_TABLE_DEPTH} levels (a table nests 6)"
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
    return None


def check_auto_table(table: object) -> dict[tuple, tuple]:
    """Validate a calibration table (the dict a JSON table file holds: see the module docstring)
    and return it in the form ``auto`` reads, ``{(mode, bias, causal, clip, dtype, heads):
    ((n_max, ((name, dtype or None), ...)), ...)}``. ``ValueError`` naming the entry and what is
    wrong. Backend names are not looked up (a table may rank a backend registered later)."""
    if not isinstance(table, dict):
        raise _table_error("the table", f"must be an object {{'format': {TABLE_FORMAT}, 'entries': [...]}}, "
                                        f"got {type(table).__name__}")
    problem = _depth_error(table)
    if problem:
        raise _table_error("the table", problem)
    if table.get("format") != TABLE_FORMAT:
        raise _table_error("format", f"must be {TABLE_FORMAT}, got {table.get('format')!r}")
    entries = table.get("entries")
    if not isinstance(entries, list):
        raise _table_error("entries", f"must be a list of entries, got {type(entries).__name__}")
    checked: dict[tuple, tuple] = {}
    for i, entry in enumerate(entries):
        key, ranking = _check_entry(i, entry)
        if key in checked:
            raise _table_error(f"entries[{i}]", f"a second entry for mode {key[0]}, bias {key[1]}, causal {key[2]}, "
                                                f"clip {key[3]}, dtype {key[4]}, heads {key[5]}")
        checked[key] = ranking
    return checked


def read_table_file(path) -> object:
    """The JSON a table file holds; ``ValueError`` naming the file for anything but a readable
    regular file of UTF-8 JSON (a FIFO or device is refused before a read could block)."""
    shown = repr(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else repr(str(path))
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as err:
        raise ValueError(f"auto table: cannot read {shown}: {err.strerror or err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"auto table: {shown} is not a regular file (a JSON table file is needed)")
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read()
    except OSError as err:
        raise ValueError(f"auto table: cannot read {shown}: {err.strerror or err}") from None
    finally:
        if fd is not None:
            os.close(fd)
    try:
        table = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"auto table: {shown} is not UTF-8 text (byte {err.start}): a table file is UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"auto table: {shown} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"auto table: {shown} nests deeper than {_MAX_TABLE_DEPTH} levels (a table nests 6)") from None
    problem = _depth_error(table)
    if problem:
        raise ValueError(f"auto table: {shown} {problem}")
    return table


def load_auto_table(source=None, *, replace: bool = False) -> dict:
    """Make a calibration table active for ``backend="auto"`` (e.g. the ``auto_table.json`` that
    ``hf-kernattn bench calibrate`` wrote on this machine): a path to a JSON file or the table as
    a dict. Its entries replace the shipped table's entries of the same kind of call (measured at
    any head count); the shipped table keeps serving the others (``replace=True``: only the given
    table is used). ``source=None`` restores the shipped table. ``ValueError`` naming the problem
    for a table that cannot be read or is malformed (the active table is then unchanged). Returns
    the active table in the checked form."""
    return dict(registry.activate_auto_table(merged_table(source, replace=replace)))


def merged_table(source=None, *, replace: bool = False) -> dict[tuple, tuple]:
    """The checked table :func:`load_auto_table` would make active, without making it so."""
    shipped = registry.shipped_auto_table()
    if source is None:
        return shipped
    if isinstance(source, dict):
        table = source
    elif isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        table = read_table_file(source)
    else:
        raise TypeError(f"source must be a path to a JSON table, a dict or None, got {type(source).__name__}")
    checked = check_auto_table(table)
    if not replace:  # the given entries replace the shipped ones of their kind, at every head count
        given = {key[:5] for key in checked}
        checked = {**{key: r for key, r in shipped.items() if key[:5] not in given}, **checked}
    return checked


def environment_table() -> Optional[dict]:
    """The table ``HF_KERNATTN_AUTO_TABLE`` names, loaded as :func:`load_auto_table` loads it
    (None without the variable); ``ValueError`` naming the variable for a bad table. What
    ``auto`` calls on its first choice (and after ``registry.forget_auto_table()``)."""
    path = os.environ.get(AUTO_TABLE_ENV)
    if not path:
        return None
    try:
        return load_auto_table(path)
    except ValueError as err:
        raise ValueError(f"{AUTO_TABLE_ENV}={path!r}: {err}") from None
