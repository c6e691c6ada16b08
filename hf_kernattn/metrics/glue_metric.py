"""GLUE metrics as an ``evaluate`` module that loads offline by path.

``evaluate.load("glue", ...)`` needs the Hub; this file is the same computation as a local
module (shipped as package data)::

    import evaluate, hf_kernattn.metrics
    path = hf_kernattn.metrics.GLUE_METRIC_PATH          # this file
    metric = evaluate.load(path, config_name="mrpc")
    metric.compute(predictions=[1, 0, 1], references=[1, 1, 1])
    # {'accuracy': 0.666..., 'f1': 0.8}

Per task (config name):

* ``cola``: Matthews correlation (``matthews_correlation``).
* ``sst2``, ``mnli``, ``mnli_matched``, ``mnli_mismatched``, ``qnli``, ``rte``, ``wnli``, ``hans``:
  ``accuracy``.
* ``mrpc``, ``qqp``: ``accuracy`` and binary ``f1`` (positive class 1).
* ``stsb``: ``pearson`` and ``spearmanr`` (float predictions and references).

The numbers come from scikit-learn (accuracy, F1, Matthews) and SciPy (Pearson, Spearman), as in
``evaluate``'s own GLUE metric.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
from scipy import stats
from sklearn import metrics as skm

TASKS = (
    "cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "mnli_mismatched", "mnli_matched", "qnli", "rte", "wnli", "hans",
)

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={ICLR}, year={2019}
}
"""

_KWARGS = """
Args:
    predictions: predicted labels (ints), or scores (floats) for stsb.
    references: gold labels (ints), or scores (floats) for stsb.
Returns: see the module docstring (one float per metric name).
"""


def accuracy(predictions: np.ndarray, references: np.ndarray) -> float:
    """Fraction of exact matches (``sklearn.metrics.accuracy_score``)."""
    return float(skm.accuracy_score(references, predictions))


def binary_f1(predictions: np.ndarray, references: np.ndarray) -> float:
    """F1 of the positive class 1 (``sklearn.metrics.f1_score``; 0 when there are no true positives)."""
    return float(skm.f1_score(references, predictions, pos_label=1, average="binary", zero_division=0.0))


def matthews(predictions: np.ndarray, references: np.ndarray) -> float:
    """Matthews correlation coefficient (``sklearn.metrics.matthews_corrcoef``, multiclass; 0 when undefined)."""
    return float(skm.matthews_corrcoef(references, predictions))


def _constant(x: np.ndarray) -> bool:
    return bool(np.all(x == x[0]))


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation (``scipy.stats.pearsonr``; nan when either side is constant)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or _constant(x) or _constant(y):
        return float("nan")
    return float(stats.pearsonr(x, y)[0])


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (``scipy.stats.spearmanr``; ties get average ranks; nan when
    either side is constant)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or _constant(x) or _constant(y):
        return float("nan")
    return float(stats.spearmanr(x, y)[0])


class Glue(evaluate.Metric):
    """GLUE metric; ``config_name`` is the task (see :data:`TASKS`)."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in TASKS:
            raise ValueError(f"config_name must be a GLUE task, one of {list(TASKS)}, got {self.config_name!r}")
        dtype = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description="GLUE task metrics (offline module shipped with hf-kernattn)",
            citation=_CITATION,
            inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}),
            format="numpy",
        )

    def _compute(self, predictions, references):
        preds, refs = np.asarray(predictions), np.asarray(references)
        if preds.shape != refs.shape:
            raise ValueError(f"predictions and references must have the same length, got {preds.shape} and {refs.shape}")
        if len(preds) == 0:
            raise ValueError("predictions must not be empty")
        task = self.config_name
        if task == "cola":
            return {"matthews_correlation": matthews(preds, refs)}
        if task == "stsb":
            return {"pearson": pearson(preds, refs), "spearmanr": spearman(preds, refs)}
        if task in ("mrpc", "qqp"):
            return {"accuracy": accuracy(preds, refs), "f1": binary_f1(preds, refs)}
        return {"accuracy": accuracy(preds, refs)}
