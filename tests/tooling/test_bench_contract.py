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


TINY_VIT = dict(hidden=16, heads=2, intermediate=32, patch=4)


@pytest.mark.parametrize("rpe", ["learned_2d", "rotary_features", "manhattan", "absolute", "none"])
def test_vision_workload_runs_every_position_option_through_auto(rpe):
    """Every ``rpe`` option of the config is measured, with the config's own attention defaults
    (``attn_backend="auto"``, its feature count): the benchmark sets only widths, depth and rpe."""
    from hf_kernattn.bench import vision
    from hf_kernattn.modeling.configuration_relative_performer_vit import POSITION_OPTIONS

    assert vision.RPE_OPTIONS == tuple(POSITION_OPTIONS)
    assert vision.build_parser().parse_args([]).rpe == list(POSITION_OPTIONS)  # all of them by default
    for classifier in (False, True):
        for mode in vision.MODES:
            vision.workload("rpvit", grid=3, rpe=rpe, mode=mode, classifier=classifier, **TINY_VIT)()
    torch.manual_seed(0)


def test_vision_workload_uses_the_config_defaults_and_patches(monkeypatch):
    from hf_kernattn.bench import vision
    from hf_kernattn.modeling import modeling_relative_performer_vit as rp
    from hf_kernattn.modeling.configuration_relative_performer_vit import RelativePerformerViTConfig

    built = []
    real = rp.RelativePerformerViTModel

    def spy(cfg):
        built.append(cfg)
        return real(cfg)

    monkeypatch.setattr(rp, "RelativePerformerViTModel", spy)
    vision.workload("rpvit", grid=3, rpe="manhattan", **TINY_VIT)()
    (cfg,) = built
    default = RelativePerformerViTConfig()
    assert cfg.attn_backend == "auto" and cfg.attn_backend == default.attn_backend
    assert (cfg.num_random_features, cfg.max_relative_position, cfg.feature_map) == (
        default.num_random_features, default.max_relative_position, default.feature_map)
    assert (cfg.image_size, cfg.patch_size, cfg.rpe) == (12, 4, "manhattan")  # a 3 x 3 grid of 4-pixel patches
    with pytest.raises(ValueError, match="model must be one of"):
        vision.workload("bert", grid=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        vision.workload("vit", grid=3, mode="backward")


def _in_process(target, kwargs, **options) -> dict:
    """A stand-in for ``common.measure``: builds the workload ``target`` names (``module:function``)
    from ``kwargs``, runs it once untimed and times it once in this process with the benchmarks'
    own timing routine (wall and CPU time; a process start-up would dominate a test this small)."""
    from hf_kernattn.bench.common import time_runs

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)(**kwargs)
    fn()
    out = time_runs(fn, repeats=1)
    torch.set_grad_enabled(True)
    return {**out, "peak_mb": 1.0, "status": "ok"}


def test_vision_run_alternates_every_option_and_reports_cpu_beside_wall_time(tmp_path, monkeypatch):
    """The whole vision benchmark at toy size, its real workloads run in this process: per group
    ViT and every option alternate (A B C, then C B A), every row carries wall and CPU time, the
    summary gives RP-ViT / ViT of both (and of memory) per round as median [min-max], and the
    JSON holds the same rows."""
    import csv
    import json
    import re

    from hf_kernattn.bench import common, vision

    order = []

    def recording(target, kwargs, **options):
        order.append((kwargs["grid"], kwargs["mode"], kwargs["layers"], kwargs["model"], kwargs.get("rpe"),
                      options["repeats"]))
        return _in_process(target, kwargs, **options)

    monkeypatch.setattr(common, "measure", recording)
    args = vision.build_parser().parse_args([
        "--out", str(tmp_path), "--grids", "2", "--large", "--large-grids", "3", "--rpe", "learned_2d", "manhattan",
        "--hidden", "16", "--heads", "2", "--intermediate", "32", "--patch-size", "16", "--depth", "1",
        "--rounds", "2", "--repeats", "2", "--model-modes", "fwd", "fwdbwd"])
    assert vision.run(args) == 0
    cases = [("vit", None), ("rpvit", "learned_2d"), ("rpvit", "manhattan")]
    expected = []
    for grid, mode, layers, repeats in ((2, "fwdbwd", 1, 2), (3, "fwdbwd", 1, 1), (14, "fwd", 1, 2), (14, "fwdbwd", 1, 2)):
        for rnd in range(2):
            expected += [(grid, mode, layers, m, r, repeats) for m, r in (cases if rnd == 0 else cases[::-1])]
    assert order == expected  # the large grid times one run per round; the 224 px model: 14 x 14 patches
    with open(tmp_path / "vision.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 2 * 3
    assert all(float(r["time_s"]) > 0 and float(r["cpu_s"]) > 0 and r["status"] == "ok" for r in rows)
    with open(tmp_path / "vision_summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [(s["part"], s["grid"], s["mode"], s["rpe"]) for s in summary] == [
        (part, grid, mode, rpe) for part, grid, mode in (("layer", "2x2", "fwdbwd"), ("layer", "3x3", "fwdbwd"),
                                                         ("model", "14x14", "fwd"), ("model", "14x14", "fwdbwd"))
        for rpe in ("learned_2d", "manhattan")]
    spread_re = re.compile(r"^\d+\.\d\dx? \[\d+\.\d\d-\d+\.\d\d\]$")
    for s in summary:
        for column in ("time rpvit/vit", "CPU time rpvit/vit", "memory rpvit/vit"):
            assert spread_re.match(s[column]), (column, s[column])
        assert float(s["rpvit_cpu_s"]) > 0 and float(s["vit_cpu_s"]) > 0
    with open(tmp_path / "vision.json") as f:
        data = json.load(f)
    assert data["settings"]["threads"] == 1 and len(data["rows"]) == len(rows) and len(data["summary"]) == len(summary)
    assert {"time_s", "cpu_s", "peak_mb"} <= set(data["rows"][0])
    assert (tmp_path / "vision.png").exists()


def test_vision_run_rejects_bad_arguments(tmp_path):
    from hf_kernattn.bench import vision

    for argv, message in ((["--rounds", "0"], "--rounds"), (["--depth", "-1"], "--depth"),
                          (["--hidden", "10", "--heads", "3"], "multiple of --heads"),
                          (["--grids", "0"], "--grids"), (["--features", "0"], "--features")):
        with pytest.raises(ValueError, match=message):
            vision.run(vision.build_parser().parse_args(["--out", str(tmp_path), *argv]))


def test_time_runs_reports_wall_and_cpu_time():
    from hf_kernattn.bench.common import time_runs

    calls = []
    out = time_runs(lambda: calls.append(sum(range(1000))), repeats=3)
    assert out["runs"] == len(calls) == 3 and out["time_s"] >= 0 and out["cpu_s"] >= 0
    assert time_runs(lambda: calls.append(0), repeats=2, min_seconds=0.02)["runs"] >= 2
    assert time_runs(lambda: calls.append(0), repeats=1000, max_seconds=0.0)["runs"] == 1  # stops early
    with pytest.raises(ValueError, match="repeats"):
        time_runs(lambda: None, repeats=0)


def test_ratio_spreads_give_wall_and_cpu_ratios_per_round():
    from hf_kernattn.bench.common import per_round_ratios, ratio_spreads

    num = [{"time_s": 2.0, "cpu_s": 1.0}, {"time_s": 6.0, "cpu_s": 1.5}, {"time_s": 3.0, "cpu_s": 1.2}]
    den = [{"time_s": 1.0, "cpu_s": 1.0}, {"time_s": 2.0, "cpu_s": 1.0}, {"time_s": 1.0, "cpu_s": 1.0}]
    assert ratio_spreads(num, den) == ("3.00x [2.00-3.00]", "1.20x [1.00-1.50]")
    # results measured without CPU time (an older stand-in) give nan, not an error
    assert ratio_spreads([{"time_s": 1.0}], [{"time_s": 2.0}]) == ("0.50x [0.50-0.50]", "nan")
    (ratio,) = per_round_ratios([{"time_s": 1.0}], [{"time_s": 0.0}])
    assert ratio != ratio  # nan where the denominator is 0


def test_encoder_run_reports_cpu_beside_wall_speedup(tmp_path, monkeypatch):
    import csv

    from hf_kernattn.bench import common, encoder

    monkeypatch.setattr(common, "measure", _in_process)
    args = encoder.build_parser().parse_args([
        "--out", str(tmp_path), "--lengths", "16", "--layers", "1", "--hidden", "16", "--heads", "2",
        "--intermediate", "32", "--features", "4", "--max-relative-position", "4", "--rounds", "2", "--repeats", "1"])
    assert encoder.run(args) == 0
    with open(tmp_path / "encoder.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["fwd", "fwdbwd"]
    for r in rows:
        assert r["speedup_per_round"].endswith("]") and r["cpu_speedup_per_round"].endswith("]")
        assert float(r["bert_sdpa_cpu_s"]) > 0 and float(r["nprf_cpu_s"]) > 0


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
    assert {"case", "n", "time_s", "cpu_s", "peak_mb", "status"} <= set(rows[0])
    assert [(r["case"], r["n"], r["status"]) for r in rows] == [("fft_rpe", "64", "ok"), ("windowed_rpe", "64", "ok")]
    assert all(float(r["cpu_s"]) > 0 for r in rows)  # the measured process's CPU time, beside the wall time
    assert (tmp_path / "attention_bench.png").exists()


def _run_workload_in_process(target, kwargs) -> dict:
    """A stand-in for ``common.measure``: builds the generate benchmark's workload that ``target``
    names (``module:function``) from ``kwargs``, runs it once in this process and reports its wall
    and CPU time (``common.time_runs``)."""
    from hf_kernattn.bench import generate
    from hf_kernattn.bench.common import time_runs

    fn = getattr(generate, target.split(":")[1])(**kwargs)
    out = time_runs(fn, repeats=1)
    torch.set_grad_enabled(True)
    return {**out, "peak_mb": 0.0, "status": "ok"}


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
    assert list(rows[0]) == ["clip", "round", "tokens", "stateless_s", "continuation_s", "ratio", "stateless_cpu_s",
                             "continuation_cpu_s", "cpu_ratio"]
    assert [(r["clip"], r["round"]) for r in rows] == [
        ("3", "0"), ("3", "1"), ("3", "median [min-max]"), ("8", "0"), ("8", "1"), ("8", "median [min-max]")]
    assert all(float(r["ratio"]) > 0 and float(r["cpu_ratio"]) > 0 for r in rows if r["round"] != "median [min-max]")
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
        summary_rows = list(csv.DictReader(f))
    summary = {r["figure"]: r["value"] for r in summary_rows}
    spread_re = re.compile(r"^\d+\.\d\dx \[\d+\.\d\d-\d+\.\d\d\]$")
    # per context 2 cache ratios, the bound's 2, generate() 2, throughput 1, continuation 1
    assert len(summary) == 10 and all(spread_re.match(v) for v in summary.values()), summary
    assert sum("StaticCache" in figure for figure in summary) == 3
    assert all(spread_re.match(r["cpu_value"]) for r in summary_rows), summary_rows  # CPU time beside wall time
    with open(tmp_path / "decode_latency.csv") as f:
        assert all(float(r["cpu_ms_per_token"]) > 0 for r in csv.DictReader(f))
    for name in ("decode_latency.csv", "generate_short.csv", "generate_throughput.csv", "continuation.csv", "generate.png"):
        assert (tmp_path / name).exists(), name


def test_alternate_does_not_rerun_a_failed_case_when_asked(monkeypatch):
    from hf_kernattn.bench import common

    calls = []

    def fake(target, kwargs, **_):
        calls.append(kwargs["name"])
        ok = kwargs["name"] != "b"
        return {"time_s": 1.0 if ok else float("nan"), "cpu_s": 1.0 if ok else float("nan"), "peak_mb": 0.0,
                "runs": int(ok), "status": "ok" if ok else "timeout>1s"}

    monkeypatch.setattr(common, "measure", fake)
    cases = [(name, "x:y", {"name": name}) for name in "abc"]
    res = common.alternate(cases, rounds=3, stop_failed=True)
    assert calls == ["a", "b", "c", "c", "a", "a", "c"]  # b failed in the first round: not run again
    assert [r["status"] for r in res["b"]] == ["timeout>1s"] * 3
    calls.clear()
    common.alternate(cases, rounds=2)
    assert calls == ["a", "b", "c", "c", "b", "a"]  # by default every case runs every round


def test_measure_caps_the_memory_of_the_measured_process():
    from hf_kernattn.bench.attention import _flat_path
    from hf_kernattn.bench.common import measure

    # at N = 8192 the two int64 offset matrices (512 MB each) and the mask (256 MB) do not fit beside torch
    res = measure("attention:workload", dict(case="softmax_rpe", n=8192), repeats=1, timeout_s=120,
                  extra_path=_flat_path(), max_memory_gb=1.5)
    assert res["status"].startswith("failed: out of memory"), res["status"]
    assert res["time_s"] != res["time_s"] and res["cpu_s"] != res["cpu_s"]
    with pytest.raises(ValueError, match="max_memory_gb"):
        measure("attention:workload", {}, max_memory_gb=0)


def test_measure_imports_the_code_on_its_path_not_the_working_directorys(tmp_path, monkeypatch):
    """The measured process imports from ``extra_path`` (then the project), never from the
    directory it is started in: comparing two versions from inside one of them measures both."""
    from hf_kernattn.bench.common import measure

    here, there = tmp_path / "cwd", tmp_path / "path"
    for folder, body in ((here, "raise RuntimeError('the working directory was imported')"), (there, "")):
        folder.mkdir()
        (folder / "shadowed_workload.py").write_text(body + "\ndef workload():\n    return lambda: None\n")
    monkeypatch.chdir(here)
    res = measure("shadowed_workload:workload", {}, repeats=1, timeout_s=120, extra_path=[str(there)])
    assert res["status"] == "ok", res["status"]


def test_generate_bench_times_the_hybrid_step_with_softmax_window(monkeypatch):
    """``--softmax-window W`` adds the sliding-window hybrid's decoding (batch 1) to each context's
    alternated cases; its workload decodes with the hybrid; W is refused for other models."""
    from hf_kernattn.bench import common, generate

    order = []

    def in_process(target, kwargs, **_):
        order.append((kwargs.get("model", kwargs.get("layout")), kwargs.get("softmax_window")))
        return _run_workload_in_process(target, kwargs)

    monkeypatch.setattr(common, "measure", in_process)
    args = generate.build_parser().parse_args([
        "--hidden", "16", "--layers", "1", "--heads", "2", "--bound-context", "6", "--new-tokens", "2",
        "--nostate-new-tokens", "1", "--rounds", "1", "--repeats", "1", "--softmax-window", "3"])
    shape = dict(generate.SHAPE, hidden=16, layers=1, heads=2)
    res = generate._decode_group(args, shape, 6, 1)
    assert ("linear_hybrid", 3) in order and ("linear_state", None) in order and "weights" in res
    assert all(r["status"] == "ok" for r in res["linear_hybrid"])
    with pytest.raises(ValueError, match="softmax_window"):
        generate.decode_workload("linear_state", context=4, new_tokens=1, hidden=16, layers=1, heads=2, softmax_window=3)
    assert generate.state_mb("linear_hybrid", 4, 1, 16, 1, 2, softmax_window=3) > generate.state_mb(
        "linear_state", 4, 1, 16, 1, 2)


def test_the_decoding_figure_gives_each_case_one_colour_and_replots_from_its_csv(tmp_path):
    """Each case of ``bench generate``'s figure keeps one colour in both panels (GPT-2's two caches
    once took each other's colours in the state panel), and ``--replot`` redraws it from a
    ``decode_latency.csv`` (the committed one of docs/figures) without measuring."""
    import csv
    from pathlib import Path

    import matplotlib.pyplot as plt

    from hf_kernattn.bench import generate

    committed = Path(__file__).resolve().parents[2] / "docs" / "figures" / "linear_gpt_decode_latency.csv"
    with open(committed, newline="") as f:
        rows = list(csv.DictReader(f))
    fig = generate._figure(rows)
    try:
        colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in fig.axes]
    finally:
        plt.close(fig)
    assert len(colours) == 2 and set(colours[1]) <= set(colours[0]) and len(colours[1]) == 3
    assert all(colours[0][label] == colour for label, colour in colours[1].items()), colours
    assert len(set(colours[0].values())) == len(colours[0])  # and no two cases share one
    args = generate.build_parser().parse_args(["--replot", str(committed), "--out", str(tmp_path)])
    assert generate.run(args) == 0
    assert (tmp_path / "generate.png").stat().st_size > 10_000
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a decode_latency.csv"):
        generate.replot(tmp_path / "other.csv", tmp_path / "x.png")


def _fake_attention_measure(target, kwargs, **_):
    """A timing per attention case: the FFT path grows as N log N, softmax with the bias as N^2
    (overtaken at N = 2048), SDPA as N^2 but cheaper; no process is started."""
    import math

    n = kwargs["n"]
    time_s = {"fft_rpe": 3e-5 * n * math.log2(n), "softmax_rpe": 2e-7 * n * n, "sdpa": 5e-8 * n * n}.get(kwargs["case"], 1e-3)
    peak = {"fft_rpe": 50.0, "softmax_rpe": 6e-6 * n * n}.get(kwargs["case"], 10.0)
    return {"time_s": time_s, "cpu_s": time_s, "peak_mb": peak, "runs": 2, "status": "ok"}


def test_the_attention_bench_reports_progress_per_case_and_a_short_table_with_its_reading(tmp_path, monkeypatch,
                                                                                         capsys):
    """What the demo's first step prints: a line per case and round as each is measured, then a
    table of at most six columns and one sentence saying where the FFT path overtakes softmax with
    the same bias (and that SDPA has no bias), and where the plot is."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    from hf_kernattn.bench import attention, common

    monkeypatch.setattr(common, "measure", _fake_attention_measure)
    logger = logging.get_logger("hf_kernattn.bench.attention")
    logger.setLevel(logging.INFO)
    args = attention.build_parser().parse_args(["--quick", "--out", str(tmp_path)])
    with CaptureLogger(logger) as progress:
        assert attention.run(args) == 0
    cases = [c for c in attention.CASES if c != "softmax_rpe_unfold"]
    lines = [line for line in progress.out.splitlines() if " round " in line]
    assert len(lines) == len(attention.QUICK_NS) * len(cases) * 2  # every case, both rounds, as measured
    assert all(any(case in line for case in cases) for line in lines)
    out = capsys.readouterr().out
    tables = [block.strip() for block in out.split("\n\n") if block.strip().startswith("| N |")]
    assert len(tables) == 1 and 4 <= tables[0].splitlines()[0].count("|") - 1 <= 6, out
    reading = [line for line in out.splitlines() if line.startswith("Reading:")]
    assert len(reading) == 1 and "from N = 2,048 on" in reading[0] and "SDPA has no bias" in reading[0], reading
    assert str(tmp_path / "attention_bench.png") in out


def test_the_demo_names_its_plots_before_it_measures(monkeypatch, capsys):
    import argparse

    from hf_kernattn import demo

    order = []
    monkeypatch.setattr(demo, "STEPS", [(title, lambda args, t=title: order.append(t)) for title, _ in demo.STEPS])
    assert demo.run(argparse.Namespace(out="somewhere")) == 0
    out = capsys.readouterr().out
    first_step = out.index("===")
    for path in ("somewhere/attention/attention_bench.png", "somewhere/generate/generate.png"):
        assert f"open {path}" in out[:first_step], out
    assert len(order) == len(demo.STEPS)
