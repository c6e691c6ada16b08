"""The offline GLUE metric module, loaded through ``evaluate.load(path, config_name=task)``,
against values computed by hand."""

from __future__ import annotations

import math

import evaluate
import pytest

from hf_kernattn.metrics import GLUE_METRIC_PATH

PRED = [1, 0, 1, 1, 0, 0, 1, 0]
REF = [1, 1, 1, 0, 0, 0, 1, 1]
# By hand: TP=3 (idx 0,2,6), FP=1 (idx 3), FN=2 (idx 1,7), TN=2 (idx 4,5).
ACC = 5 / 8
F1 = 2 * 3 / (2 * 3 + 1 + 2)
MCC = (3 * 2 - 1 * 2) / math.sqrt((3 + 1) * (3 + 2) * (2 + 1) * (2 + 2))


def load(task):
    return evaluate.load(GLUE_METRIC_PATH, config_name=task)


@pytest.mark.parametrize("task", ["sst2", "qnli", "rte", "wnli", "mnli", "mnli_matched", "mnli_mismatched", "hans"])
def test_accuracy_tasks(task):
    assert load(task).compute(predictions=PRED, references=REF) == pytest.approx({"accuracy": ACC})


def test_mnli_three_classes():
    out = load("mnli").compute(predictions=[0, 1, 2, 2, 1], references=[0, 2, 2, 1, 1])
    assert out == pytest.approx({"accuracy": 3 / 5})


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_accuracy_and_f1_tasks(task):
    assert load(task).compute(predictions=PRED, references=REF) == pytest.approx({"accuracy": ACC, "f1": F1})


def test_cola_matthews():
    assert load("cola").compute(predictions=PRED, references=REF) == pytest.approx({"matthews_correlation": MCC})
    # Constant predictions: the correlation is undefined and reported as 0, as sklearn does.
    assert load("cola").compute(predictions=[1, 1, 1], references=[0, 1, 1]) == {"matthews_correlation": 0.0}


def test_stsb_pearson_spearman():
    pred = [1.0, 2.0, 3.0, 5.0]
    ref = [1.0, 3.0, 2.0, 5.0]
    # Pearson by hand: means 2.75; deviations p=(-1.75,-.75,.25,2.25), r=(-1.75,.25,-.75,2.25)
    sxy = 1.75 * 1.75 - 0.75 * 0.25 - 0.25 * 0.75 + 2.25 * 2.25
    sxx = 1.75**2 + 0.75**2 + 0.25**2 + 2.25**2
    pearson = sxy / sxx  # both sides have the same spread
    # Spearman: ranks (1,2,3,4) vs (1,3,2,4): 1 - 6*sum(d^2)/(n(n^2-1)) = 1 - 6*2/60
    spearman = 1 - 6 * 2 / (4 * 15)
    out = load("stsb").compute(predictions=pred, references=ref)
    assert out == pytest.approx({"pearson": pearson, "spearmanr": spearman}, abs=1e-6)
    # Ties get average ranks: (1, 2.5, 2.5, 4) vs (1, 2, 3, 4)
    tied = load("stsb").compute(predictions=[0.0, 1.0, 1.0, 2.0], references=[0.0, 1.0, 2.0, 3.0])
    r = [1, 2.5, 2.5, 4]
    mr = sum(r) / 4
    exp = sum((a - mr) * (b - 2.5) for a, b in zip(r, [1, 2, 3, 4])) / math.sqrt(
        sum((a - mr) ** 2 for a in r) * sum((b - 2.5) ** 2 for b in [1, 2, 3, 4]))
    assert tied["spearmanr"] == pytest.approx(exp, abs=1e-6)


def test_matches_sklearn_and_scipy_on_random_data():
    import numpy as np
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    rng = np.random.default_rng(0)
    p, r = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    assert load("mrpc").compute(predictions=p, references=r)["f1"] == pytest.approx(f1_score(r, p))
    assert load("cola").compute(predictions=p, references=r)["matthews_correlation"] == pytest.approx(matthews_corrcoef(r, p))
    x, y = rng.normal(size=100).round(1), rng.normal(size=100).round(1)
    out = load("stsb").compute(predictions=x, references=y)
    assert out["pearson"] == pytest.approx(pearsonr(x, y)[0], abs=1e-6)
    assert out["spearmanr"] == pytest.approx(spearmanr(x, y)[0], abs=1e-6)


def test_bad_task_and_lengths():
    with pytest.raises(ValueError, match="config_name"):
        load("squad")
    with pytest.raises(ValueError):
        load("sst2").compute(predictions=[1, 0], references=[1])


def test_metrics_come_from_sklearn_and_scipy(monkeypatch):
    """Each number is computed by the library function (spied on), not re-implemented."""
    import numpy as np
    import scipy.stats
    import sklearn.metrics

    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("accuracy_score", "f1_score", "matthews_corrcoef"):
        spy(sklearn.metrics, name)
    for name in ("pearsonr", "spearmanr"):
        spy(scipy.stats, name)
    load("mrpc").compute(predictions=PRED, references=REF)
    load("cola").compute(predictions=PRED, references=REF)
    load("stsb").compute(predictions=np.arange(5.0), references=np.array([0.0, 2.0, 1.0, 4.0, 3.0]))
    assert sorted(set(calls)) == ["accuracy_score", "f1_score", "matthews_corrcoef", "pearsonr", "spearmanr"]


def test_constant_side_gives_nan_correlations():
    out = load("stsb").compute(predictions=[1.0, 1.0, 1.0], references=[0.0, 1.0, 2.0])
    assert math.isnan(out["pearson"]) and math.isnan(out["spearmanr"])
