"""Every benchmark command has the same entry points, common flags and output-folder rule; the
windowed attention case and the continuation case of ``bench generate`` run (tiny sizes, no
timing asserted)."""

from __future__ import annotations

import importlib

import pytest
import torch

import hf_kernattn_cli as cli


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_bench_module_has_the_same_entry_points_and_common_flags(name):
    module = importlib.import_module(f"hf_kernattn.bench.{cli.BENCHMARKS[name]}")
    assert module.NAME == name
    assert callable(module.add_arguments) and callable(module.run)
    parser = module.build_parser()
    assert parser.prog == f"hf-kernattn bench {name}"
    args = parser.parse_args([])
    assert (args.out, args.threads, args.quick, args.device) == (f"bench_results/{name}", 1, False, "cpu")
    # the command line builds the same parser
    assert cli.build_parser().parse_args(["bench", name]).out == f"bench_results/{name}"


def test_windowed_case_computes_the_clipped_bias_attention(monkeypatch):
    from hf_kernattn.bench import attention

    from hf_kernattn import kernelized_attention

    seen = {}

    def recording(q, k, v, **kwargs):
        seen.update(q=q, k=k, v=v, **kwargs)
        return kernelized_attention(q, k, v, **kwargs)

    n, clip = 48, 5
    monkeypatch.setattr(attention, "_kernelized_attention", lambda: recording)
    attention.workload("windowed_rpe", n=n, heads=2, features=8, head_dim=4, clip=clip, dtype="float64")()
    assert (seen["backend"], seen["rpe_clip"]) == ("windowed", clip)
    bias = seen["rpe_bias"]  # (H, 2n-1), offset j - i = index - (n - 1)
    assert bias.shape == (2, 2 * n - 1)
    # clipped at K: every offset beyond +-K carries the value at +-K, offsets inside differ
    assert torch.equal(bias[:, : n - 1 - clip], bias[:, n - 1 - clip : n - clip].expand(2, n - 1 - clip))
    assert torch.equal(bias[:, n + clip :], bias[:, n - 1 + clip : n + clip].expand(2, n - 1 - clip))
    assert len(torch.unique(bias[0, n - 1 - clip : n + clip])) == 2 * clip + 1
    # and the windowed backend computes that attention exactly (float64: rounding only, ~1e-15)
    dense = kernelized_attention(seen["q"], seen["k"], seen["v"], rpe_bias=bias, backend="dense")
    torch.testing.assert_close(
        kernelized_attention(seen["q"], seen["k"], seen["v"], rpe_bias=bias, rpe_clip=clip, backend="windowed"),
        dense, rtol=1e-10, atol=1e-12)


def test_continuation_case_runs_both_modes_and_alternates(monkeypatch):
    from hf_kernattn.bench import common, generate

    shape = dict(hidden=16, layers=1, heads=2, vocab=256)
    for mode in generate.CONTINUATION_MODES:
        generate.continuation_workload(mode, clip=3, new_tokens=12, prompt=5, **{k: v for k, v in shape.items()})()
    torch.set_grad_enabled(True)  # the workload switches autograd off for its (separate) process
    calls = []

    def fake_measure(target, kwargs, **_):
        calls.append(kwargs["mode"])
        return {"time_s": 2.0 if kwargs["mode"] == "continuation" else 1.0, "peak_mb": 0.0, "runs": 1, "status": "ok"}

    monkeypatch.setattr(common, "measure", fake_measure)
    args = generate.build_parser().parse_args(["--continuation", "--continuation-clips", "3", "--rounds", "2"])
    rows = generate.continuation(args, shape)
    assert calls == ["stateless", "continuation", "continuation", "stateless"]  # A B, then B A
    assert [r["ratio"] for r in rows] == [2.0, 2.0, "2.00x [2.00-2.00]"]


def test_vision_case_runs_both_models_on_a_small_grid():
    from hf_kernattn.bench import vision

    for model in vision.MODELS:
        vision.workload(model, grid=8, hidden=16, heads=2, intermediate=32, features=8)()


def test_attention_run_writes_the_windowed_case_to_its_csv(tmp_path):
    # a real (tiny) run: each case measured in its own process, as the full benchmark does
    import csv

    from hf_kernattn.bench import attention

    args = attention.build_parser().parse_args([
        "--out", str(tmp_path), "--ns", "64", "--cases", "fft_rpe", "windowed_rpe", "--features", "8",
        "--head-dim", "4", "--max-relative-position", "5", "--repeats", "1", "--max-seconds", "1"])
    assert attention.run(args) == 0
    with open(tmp_path / "attention_bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"case", "n", "time_s", "peak_mb", "status"} <= set(rows[0])
    assert [(r["case"], r["n"], r["status"]) for r in rows] == [("fft_rpe", "64", "ok"), ("windowed_rpe", "64", "ok")]
    assert (tmp_path / "attention_bench.png").exists()


def _run_workload_in_process(target, kwargs) -> dict:
    """A stand-in for ``common.measure``: builds the generate benchmark's workload that ``target``
    names (``module:function``) from ``kwargs``, runs it once in this process and reports its time."""
    import time

    from hf_kernattn.bench import generate

    fn = getattr(generate, target.split(":")[1])(**kwargs)
    t0 = time.perf_counter()
    fn()
    torch.set_grad_enabled(True)
    return {"time_s": time.perf_counter() - t0, "peak_mb": 0.0, "runs": 1, "status": "ok"}


def test_generate_continuation_only_writes_its_csv(tmp_path, monkeypatch):
    # the real continuation workloads at toy sizes, run in this process instead of a fresh one
    # (start-up of a process importing transformers would dominate a test this small)
    import csv

    from hf_kernattn.bench import common, generate

    def in_process(target, kwargs, **_):
        assert target.endswith(":continuation_workload")
        return _run_workload_in_process(target, kwargs)

    monkeypatch.setattr(common, "measure", in_process)
    args = generate.build_parser().parse_args([
        "--continuation", "--out", str(tmp_path), "--hidden", "16", "--layers", "1", "--heads", "2",
        "--continuation-clips", "3", "8", "--continuation-tokens", "12", "--continuation-prompt", "5",
        "--rounds", "2", "--repeats", "1"])
    assert generate.run(args) == 0
    with open(tmp_path / "continuation.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["clip", "round", "tokens", "stateless_s", "continuation_s", "ratio"]
    assert [(r["clip"], r["round"]) for r in rows] == [
        ("3", "0"), ("3", "1"), ("3", "median [min-max]"), ("8", "0"), ("8", "1"), ("8", "median [min-max]")]
    assert all(float(r["ratio"]) > 0 for r in rows if r["round"] != "median [min-max]")
    assert not (tmp_path / "decode_latency.csv").exists()  # --continuation runs only this case


def test_generate_bench_alternates_every_case_and_reports_spreads(tmp_path, monkeypatch):
    """The whole generate benchmark at toy size, its real workloads run in this process: every
    comparison's cases alternate (A B C, then C B A) for each round, and the summary gives each
    ratio as median [min-max] of the per-round ratios."""
    import csv
    import re

    from hf_kernattn.bench import common, generate

    order = []

    def in_process(target, kwargs, **_):
        name = target.split(":")[1]
        order.append((name, kwargs.get("model", kwargs.get("layout", kwargs.get("mode")))))
        return _run_workload_in_process(target, kwargs)

    monkeypatch.setattr(common, "measure", in_process)
    args = generate.build_parser().parse_args([
        "--out", str(tmp_path), "--hidden", "16", "--layers", "1", "--heads", "2", "--contexts", "4", "9",
        "--bound-context", "9", "--new-tokens", "2", "--nostate-new-tokens", "1", "--rounds", "2", "--repeats", "1",
        "--extra-batch", "0", "--short-prompt", "5", "--short-new", "3", "--throughput-batch", "2",
        "--throughput-len", "6", "--continuation-clips", "3", "--continuation-tokens", "4", "--continuation-prompt", "3"])
    assert generate.run(args) == 0
    decode = [m for name, m in order if name in ("decode_workload", "weights_workload")]
    first = ["linear_state", "gpt2_kv", "gpt2_static", "linear_nostate"]
    assert decode[:8] == first + first[::-1]  # context 4: two rounds, reversed in the second
    bound = first + ["weights", "weights_row_major"]
    assert decode[8:] == bound + bound[::-1]  # the bound context also times the weights
    with open(tmp_path / "generate_summary.csv") as f:
        summary = {r["figure"]: r["value"] for r in csv.DictReader(f)}
    spread_re = re.compile(r"^\d+\.\d\dx \[\d+\.\d\d-\d+\.\d\d\]$")
    # per context 2 cache ratios, the bound's 2, generate() 2, throughput 1, continuation 1
    assert len(summary) == 10 and all(spread_re.match(v) for v in summary.values()), summary
    assert sum("StaticCache" in figure for figure in summary) == 3
    for name in ("decode_latency.csv", "generate_short.csv", "generate_throughput.csv", "continuation.csv", "generate.png"):
        assert (tmp_path / name).exists(), name
