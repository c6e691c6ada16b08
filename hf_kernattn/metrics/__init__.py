"""Offline ``evaluate`` metric modules shipped with hf-kernattn (load them by path)."""

from pathlib import Path

GLUE_METRIC_PATH = str(Path(__file__).with_name("glue_metric.py"))

__all__ = ["GLUE_METRIC_PATH"]
