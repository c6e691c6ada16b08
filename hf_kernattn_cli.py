"""The ``hf-kernattn`` command line (also ``python -m hf_kernattn.cli``).

* ``hf-kernattn backends``: the registered attention backends and what each supports.
* ``hf-kernattn bench NAME [...]``: a benchmark; each lives in ``hf_kernattn/bench/NAME.py`` and
  exposes ``add_arguments(parser)`` and ``run(args) -> int``.
* ``hf-kernattn demo``: the README's main demo (``hf_kernattn/demo.py``).
* ``hf-kernattn convert``: softmax checkpoint -> kernelized one (``hf_kernattn/convert/``).
* ``hf-kernattn linearize``: convert, then train the feature maps by attention transfer
  (``hf_kernattn/convert/linearize.py``).
* ``hf-kernattn eval context|recall MODEL [...]``: compare causal LMs on the same text
  (``hf_kernattn/evaluation/``).
* ``hf-kernattn push CHECKPOINT REPO_ID``: publish a saved checkpoint on the Hub (``hf_kernattn/push.py``).

This module lives next to the ``hf_kernattn`` package, not inside it: importing the package
imports torch and transformers and registers every model family with the Auto classes (seconds),
and ``hf-kernattn --help``, ``hf-kernattn bench --help`` and ``--version`` need none of that. A
sub-command's module (and with it the package) is imported only when that sub-command runs or
its own ``--help`` is asked for. Errors a user can fix (a bad argument, a missing checkpoint, an unknown model id)
are reported as one ``hf-kernattn: error: ...`` line with exit status 1; progress goes through
the ``hf_kernattn`` logger (``-q`` shows warnings only).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import logging
import os
import re
import sys
from typing import Optional, Sequence

PROG = "hf-kernattn"

# bench name -> module under hf_kernattn.bench
BENCHMARKS = {
    "attention": "attention",
    "generate": "generate",
    "encoder": "encoder",
    "approx": "approx",
    "vision": "vision",
    "manhattan": "manhattan",
    "calibrate": "calibrate",
}
# top-level command -> module under hf_kernattn
COMMANDS = {"demo": "demo", "convert": "convert", "linearize": "convert.linearize", "push": "push", "eval": "evaluation"}


def _package_file(module: str) -> Optional[str]:
    """Path of ``hf_kernattn/<module>.py`` or, for a sub-package, ``hf_kernattn/<module>/__init__.py``
    (dots for sub-packages), found without importing the package (``find_spec`` of a top-level
    name does not run its ``__init__``)."""
    spec = importlib.util.find_spec("hf_kernattn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        base = os.path.join(root, *module.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _read_docstring(path: Optional[str]) -> str:
    if path is None:
        return ""
    with open(path, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-kernattn")
    except PackageNotFoundError:  # a source tree that is not installed: read __version__ without importing
        path = _package_file("__init__")
        if path is not None:
            with open(path, encoding="utf-8") as f:
                for node in ast.parse(f.read()).body:
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
                        return ast.literal_eval(node.value)
        return "unknown"


def format_columns(rows: Sequence[Sequence[str]], gap: int = 2) -> str:
    """``rows`` (the first one the header) as text columns, each as wide as its widest cell;
    the last column is not padded."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths)] + [str(row[-1])]
        lines.append((" " * gap).join(cells).rstrip())
    return "\n".join(lines)


def _cmd_backends(_args: argparse.Namespace) -> int:
    from hf_kernattn import available_backends, get_backend

    rows = [("backend", "cost", "supports", "what it is")]
    for spec in map(get_backend, available_backends()):
        caps = [c for c in ("causal", "noncausal", "rpe_1d", "rpe_2d", "key_mask", "state", "split_denominator",
                            "decoding") if getattr(spec, c)]
        rows.append((spec.name, spec.complexity, ",".join(caps), spec.description))
    print(format_columns(rows))
    return 0


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")  # Sphinx roles: :func:`x`, :class:`~a.B`
_LITERAL = re.compile(r"``([^`]+)``")
_XREF = re.compile(r"\s*\(:[a-z]+:`[^`]+`[^()]*\)")  # "(:func:`f`...)": a pointer into the code


def plain_text(text: str) -> str:
    """``text`` (reStructuredText from a docstring) as a terminal shows it: roles and double
    backquotes reduced to their content (``:func:`~a.b``` -> ``b``, ````x```` -> ``x``)."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else m.group(1), text)
    return _LITERAL.sub(r"\1", text)


def docstring_summary(doc: str) -> str:
    """The first paragraph of a docstring on one line, in plain text, without parenthesised
    pointers into the code: a command's description (the first line alone may stop
    mid-sentence)."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return plain_text(_XREF.sub("", " ".join(first.split())))


def _module_summary(module: str) -> str:
    """The summary (:func:`docstring_summary`) of ``hf_kernattn.<module>``'s docstring, read
    from its source without importing it."""
    return docstring_summary(_read_docstring(_package_file(module)))


class _LazyCommandParser(argparse.ArgumentParser):
    """A sub-command parser that imports its module (``add_arguments`` + ``run``) only when it
    is the one selected, i.e. when argparse hands it the remaining arguments."""

    module: Optional[str] = None

    def parse_known_args(self, args=None, namespace=None):
        if self.module is not None:
            module, self.module = self.module, None
            mod = importlib.import_module(f"hf_kernattn.{module}")
            mod.add_arguments(self)
            self.set_defaults(func=mod.run)
        return super().parse_known_args(args, namespace)


def _add_command(subparsers, name: str, module: str) -> None:
    """Add the sub-command ``name`` served by ``hf_kernattn.<module>``, imported on use."""
    summary = _module_summary(module)
    p = subparsers.add_parser(name, help=summary, description=summary)
    p.module = module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="kernelized attention for Hugging Face Transformers")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="report warnings and errors only, no progress")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_LazyCommandParser)
    p = sub.add_parser("backends", help="list the registered attention backends and what each supports")
    p.set_defaults(func=_cmd_backends)

    bench = sub.add_parser("bench", help="run a benchmark (CSV + PNG)", description="run a benchmark (CSV + PNG)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="NAME", parser_class=_LazyCommandParser)
    for name, module in BENCHMARKS.items():
        _add_command(bench_sub, name, f"bench.{module}")
    for name, module in COMMANDS.items():
        _add_command(sub, name, module)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the message."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _setup_logging(quiet: bool) -> None:
    """Show the package's progress messages (INFO) on stderr; ``quiet``: warnings only."""
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("hf_kernattn")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.quiet)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as err:
        # What a user can fix: bad values (ValueError, the library's convention) and files or
        # model ids that cannot be found or read (OSError, as transformers and huggingface_hub
        # raise). Anything else is a bug and keeps its traceback.
        print(f"{PROG}: error: {_one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
