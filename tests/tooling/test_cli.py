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
    code = main(["bench", "attention", "--ns", "256", "512", "--cases", "fft_rpe", "windowed_rpe", "causal_chunked",
                 "softmax_rpe", "--max-relative-position", "16", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    rows = list(csv.DictReader(open(tmp_path / "attention_bench.csv")))
    assert {(r["case"], int(r["n"])) for r in rows} == {
        (c, n) for c in ("fft_rpe", "windowed_rpe", "causal_chunked", "softmax_rpe") for n in (256, 512)
    }
    assert "speed-up windowed vs softmax+RPE" in capsys.readouterr().out
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


# --- the command line as a user meets it: fast help, --version, one-line errors -------------

def test_help_and_version_import_neither_the_package_nor_torch():
    """`hf-kernattn --help`, `hf-kernattn bench --help` and `--version` list every command without
    importing any of them, nor hf_kernattn, torch or transformers (seconds of imports): checked in a
    fresh interpreter through the console script's own entry point."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="hf-kernattn")
    module, func = script.value.split(":")
    code = (
        "import sys, contextlib, io\n"
        f"from {module} import {func} as main\n"
        "for argv in (['--help'], ['bench', '--help'], ['--version']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, e.code\n"
        "    print(out.getvalue())\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('hf_kernattn', 'torch', 'transformers')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "LOADED []" in res.stdout
    for name in ("backends", "bench", "demo", "convert", "attention", "generate", "encoder", "approx"):
        assert name in res.stdout
    assert "Convert a softmax checkpoint" in res.stdout  # help from the module docstring
    import hf_kernattn

    assert f"hf-kernattn {hf_kernattn.__version__}" in res.stdout


def test_subcommand_help_is_the_module_docstring():
    import importlib

    from hf_kernattn import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "bench")
    for choices, table, prefix in ((sub.choices, cli.COMMANDS, ""), (bench.choices, cli.BENCHMARKS, "bench.")):
        for name, module in table.items():
            doc = importlib.import_module(f"hf_kernattn.{prefix}{module}").__doc__
            assert choices[name].description == cli.docstring_summary(doc)
            assert choices[name].description.endswith("."), choices[name].description  # the whole first paragraph


def test_version(capsys):
    import hf_kernattn

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-kernattn {hf_kernattn.__version__}"


def test_user_errors_are_one_line_and_exit_nonzero(tmp_path, capsys):
    # A missing checkpoint directory: the library's ValueError becomes one line, no traceback.
    rc = main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and err.startswith("hf-kernattn: error: checkpoint_dir ")
    assert "Traceback" not in err and str(tmp_path / "missing") in err
    # A directory that is no checkpoint (OSError/ValueError from reading it): the same.
    (tmp_path / "empty").mkdir()
    rc = main(["convert", str(tmp_path / "empty"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "has no config.json" in err
    # Usage errors stay argparse's (usage line + error line, exit status 2).
    with pytest.raises(SystemExit) as exc:
        main(["convert"])
    assert exc.value.code == 2
    assert "hf-kernattn convert: error: the following arguments are required" in capsys.readouterr().err


def test_bench_reports_progress_through_logging_and_quiet_silences_it(tmp_path, capsys):
    args = ["bench", "approx", "--norms", "1", "--features", "4", "--projections", "orthogonal",
            "--seeds", "1", "--keys", "8", "--queries", "4", "--out", str(tmp_path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "orthogonal" in err and "R=1" in err  # the progress line, on stderr via the logger
    assert "wrote" in out  # the result stays on stdout
    assert main(["-q"] + args) == 0
    out, err = capsys.readouterr()
    assert "R=1:" not in err and "wrote" in out


def test_backends_table_columns_align(capsys):
    """Every column of `hf-kernattn backends` starts at the same place on every line (the
    widest cell sets the width), under a header."""
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    header, rows = lines[0], lines[1:]
    starts = [header.index(title) for title in ("cost", "supports", "what it is")]
    assert header.startswith("backend") and len(rows) >= 5
    for row in rows:
        for start in starts:
            assert row[start - 2:start] == "  " and row[start] != " ", (row, start)


def _help_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


MARKUP = ("``", ":func:", ":class:", ":mod:", ":data:", ":meth:")


def _check_help(text: str, parser) -> None:
    """No reStructuredText markup, a description that ends a sentence, and help for every option."""
    assert not any(m in text for m in MARKUP), text
    assert parser.description and parser.description.rstrip().endswith("."), parser.description
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not missing, missing


@pytest.mark.parametrize("argv", [["push"], ["bench", "generate"], ["demo"], ["convert"], ["bench", "attention"],
                                  ["bench", "encoder"], ["bench", "approx"], ["bench", "vision"]])
def test_command_help_is_plain_text_in_whole_sentences(argv, capsys):
    text = _help_of([*argv, "--help"], capsys)
    from hf_kernattn.cli import build_parser

    parser = build_parser()
    for word in argv:  # the sub-parser argparse used, with its arguments added
        parser = next(a for a in parser._actions if a.dest in ("command", "bench")).choices[word]
    assert not any(m in text for m in MARKUP), text
    assert parser.description.rstrip().endswith("."), parser.description
    assert parser.description.split()[-1] in " ".join(text.split())  # printed whole, not cut
    if argv in (["push"], ["bench", "generate"]):
        parser.parse_known_args(["x"] * (2 if argv == ["push"] else 0))  # adds the command's arguments
        _check_help(text, parser)


def test_finetune_converted_help_is_plain_text_in_whole_sentences(monkeypatch, capsys):
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "research" / "finetune_converted.py"
    spec = importlib.util.spec_from_file_location("finetune_converted_help", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seen = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help",
                        lambda self, file=None: (seen.append(self), print(self.format_help())))
    with pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    text = capsys.readouterr().out
    _check_help(text, seen[0])
    assert "with the constant-size state." in " ".join(text.split())
