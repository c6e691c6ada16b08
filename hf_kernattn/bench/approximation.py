"""The former name of :mod:`hf_kernattn.bench.approx` (the ``hf-kernattn bench approx``
benchmark); its names are re-exported here so that old imports keep working."""

from .approx import FEATURES, NAME, NORMS, PROJECTIONS, add_arguments, approximation_error, build_parser, run

__all__ = ["FEATURES", "NAME", "NORMS", "PROJECTIONS", "add_arguments", "approximation_error", "build_parser", "run"]
