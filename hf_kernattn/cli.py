"""The ``hf-kernattn`` command line; ``python -m hf_kernattn.cli`` runs it.

It is implemented in the top-level module :mod:`hf_kernattn_cli`, installed with this package,
so that ``hf-kernattn --help`` and ``--version`` answer without importing ``hf_kernattn``
(which imports torch and transformers). This module re-exports its names.
"""

import sys

from hf_kernattn_cli import BENCHMARKS, COMMANDS, PROG, build_parser, docstring_summary, format_columns, main, plain_text

__all__ = ["BENCHMARKS", "COMMANDS", "PROG", "build_parser", "docstring_summary", "format_columns", "main", "plain_text"]

if __name__ == "__main__":
    sys.exit(main())
