"""The ``hf-kernattn`` command line.

* ``hf-kernattn backends``: the registered attention backends and what each supports.
* ``hf-kernattn bench NAME [...]``: a benchmark; each lives in ``hf_kernattn/bench/NAME.py`` and
  exposes ``add_arguments(parser)`` and ``run(args) -> int``.
* ``hf-kernattn demo``: the README's main demo (``hf_kernattn/demo.py``).
* ``hf-kernattn convert``: softmax checkpoint -> kernelized one (``hf_kernattn/convert.py``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# bench name -> module under hf_kernattn.bench
BENCHMARKS = {
    "attention": "attention",
    "generate": "generate",
    "encoder": "encoder",
    "approx": "approximation",
}


def _cmd_backends(_args: argparse.Namespace) -> int:
    from .modeling.backends import _REGISTRY

    for spec in _REGISTRY.values():
        caps = [c for c in ("causal", "noncausal", "rpe_1d", "rpe_2d", "key_mask", "decoding") if getattr(spec, c)]
        print(f"{spec.name:16s} {spec.complexity:38s} {','.join(caps):45s} {spec.description}")
    return 0


def _add_command(subparsers, name: str, module: str) -> None:
    """Add the sub-command ``name`` served by ``hf_kernattn.<module>`` (its ``add_arguments``
    and ``run``; help from the first docstring line). Skipped when that module is not in this
    install; any other import error propagates."""
    try:
        mod = importlib.import_module(f"hf_kernattn.{module}")
    except ModuleNotFoundError as err:
        if err.name != f"hf_kernattn.{module}":
            raise
        return
    p = subparsers.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kernattn", description="kernelized attention for Hugging Face Transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list the registered attention backends and what each supports")
    p.set_defaults(func=_cmd_backends)

    bench = sub.add_parser("bench", help="run a benchmark (CSV + PNG)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module in BENCHMARKS.items():
        _add_command(bench_sub, name, f"bench.{module}")
    for name in ("demo", "convert"):
        _add_command(sub, name, name)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
