"""The ``hf-kernattn`` command line: ``bench``, ``backends``, ``demo`` (more added per family)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _cmd_backends(_args: argparse.Namespace) -> int:
    from .modeling.backends import _REGISTRY

    for spec in _REGISTRY.values():
        caps = [c for c in ("causal", "noncausal", "rpe_1d", "rpe_2d", "key_mask", "decoding") if getattr(spec, c)]
        print(f"{spec.name:16s} {spec.complexity:28s} {','.join(caps):45s} {spec.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kernattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list the registered attention backends and what each supports")
    p.set_defaults(func=_cmd_backends)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
