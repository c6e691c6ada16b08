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

Only numpy is needed (Spearman is Pearson of average ranks, ties averaged).
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

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
    """Fraction of exact matches."""
    return float((predictions == references).mean())


def binary_f1(predictions: np.ndarray, references: np.ndarray) -> float:
    """F1 of the positive class 1 (0 when there are no true positives)."""
    tp = float(((predictions == 1) & (references == 1)).sum())
    fp = float(((predictions == 1) & (references != 1)).sum())
    fn = float(((predictions != 1) & (references == 1)).sum())
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews(predictions: np.ndarray, references: np.ndarray) -> float:
    """Matthews correlation coefficient (multiclass form; 0 when undefined)."""
    labels = np.unique(np.concatenate([predictions, references]))
    index = {v: i for i, v in enumerate(labels.tolist())}
    conf = np.zeros((len(labels), len(labels)), dtype=np.float64)
    for p, r in zip(predictions.tolist(), references.tolist()):
        conf[index[r], index[p]] += 1
    t, p = conf.sum(axis=1), conf.sum(axis=0)
    c, s = np.trace(conf), conf.sum()
    den = np.sqrt((s * s - (p * p).sum()) * (s * s - (t * t).sum()))
    return 0.0 if den == 0 else float((c * s - (t * p).sum()) / den)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation (nan when either side is constant)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    xc, yc = x - x.mean(), y - y.mean()
    den = np.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float("nan") if den == 0 else float((xc * yc).sum() / den)


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (ties get average ranks)."""
    return pearson(_ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64)))


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
