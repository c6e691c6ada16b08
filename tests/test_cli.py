"""The hf-kernattn command line and the benchmark machinery, on tiny sizes (no timing asserted)."""

from __future__ import annotations

import csv

import pytest

from hf_kernattn.bench.common import format_table, measure
from hf_kernattn.cli import main


def test_backends_command_lists_every_backend(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("dense", "linear", "causal_chunked", "fft", "recurrent"):
        assert name in out


def test_bench_attention_small_run_writes_csv_and_plot(tmp_path, capsys):
    code = main(["bench", "attention", "--ns", "256", "512", "--cases", "fft_rpe", "causal_chunked", "sdpa",
                 "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    rows = list(csv.DictReader(open(tmp_path / "attention_bench.csv")))
    assert {(r["case"], int(r["n"])) for r in rows} == {
        (c, n) for c in ("fft_rpe", "causal_chunked", "sdpa") for n in (256, 512)
    }
    assert all(r["status"] == "ok" and float(r["time_s"]) > 0 for r in rows)
    assert (tmp_path / "attention_bench.png").stat().st_size > 1000


def test_bench_approx_small_run_error_falls_with_m(tmp_path):
    code = main(["bench", "approx", "--norms", "1", "--features", "4", "256", "--projections", "orthogonal",
                 "--seeds", "2", "--keys", "64", "--queries", "32", "--out", str(tmp_path)])
    assert code == 0
    (csv_path,) = list(tmp_path.glob("*.csv"))
    rows = list(csv.DictReader(open(csv_path)))
    err_col = [k for k in rows[0] if "err" in k][0]
    by_m = {int(r["m"]): float(r[err_col]) for r in rows}
    assert by_m[256] < by_m[4]
    assert list(tmp_path.glob("*.png"))


def test_measure_reports_failures_as_rows():
    res = measure("hf_kernattn.bench.no_such_module:fn", {}, repeats=1, timeout_s=60)
    assert res["status"].startswith("failed") and res["time_s"] != res["time_s"]


def test_unknown_bench_is_a_usage_error():
    with pytest.raises(SystemExit):
        main(["bench", "nope"])


def test_format_table():
    table = format_table([{"a": 1.23456, "b": "x"}, {"a": float("nan"), "b": "y"}], ["a", "b"])
    assert table.splitlines()[2] == "| 1.235 | x |" and "nan" in table
