"""``backend="auto"`` chooses from declared capabilities and a calibration table of measured
crossovers: a loaded table changes the choice, a malformed one is refused naming the problem,
``auto`` never takes a backend that cannot run the call, an approximate backend (declared
``error_bound``) runs only where its bound meets the target, else an exact backend or its float64
variant, whichever the table ranks first; ``hf-kernattn bench calibrate --quick`` writes a table
that loads."""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling import registry
from hf_kernattn.auto_tables import AUTO_TABLE_ENV, load_auto_table
from hf_kernattn.modeling.registry import choose_backend

PLAIN = dict(causal=False, rpe=None, key_mask=False, device="cpu")


def _entry(ranking, mode="fwd", bias="none", causal=False, clip=None, dtype="float32"):
    return dict(mode=mode, bias=bias, causal=causal, clip=clip, dtype=dtype, ranking=ranking)


def _table(*entries):
    return {"format": 1, "entries": list(entries)}


@pytest.fixture(autouse=True)
def shipped_table():
    """Every test starts and ends with the shipped table active."""
    load_auto_table(None)
    yield
    load_auto_table(None)


def _qkv(n=12, b=1, h=2, m=4, d=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, m, generator=g, dtype=dtype) + 0.05
    k = torch.rand(b, h, n, m, generator=g, dtype=dtype) + 0.05
    v = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.fixture
def spy():
    """``spy(*names)``: record which backend runs (and in which dtype), the backends unchanged
    otherwise (registered again as they were at the test's end)."""
    import contextlib

    from tests.reference import replaced_backend

    seen, stack = [], contextlib.ExitStack()

    def start(*names):
        for name in names:
            spec = registry.get_backend(name)

            def fn(q, k, v, _name=name, _fn=spec.fn, **kw):
                seen.append((_name, q.dtype))
                return _fn(q, k, v, **kw)

            stack.enter_context(replaced_backend(name, fn))
        return seen

    with stack:
        yield start


def test_a_loaded_table_changes_the_choice_and_none_restores_the_shipped_one():
    assert choose_backend(n=8192, **PLAIN) == "linear"
    load_auto_table(_table(_entry([[None, ["dense", "linear"]]])))
    assert choose_backend(n=8192, **PLAIN) == "dense"
    assert choose_backend(n=8192, **dict(PLAIN, causal=True)) == "causal_chunked"  # the shipped entry still serves
    load_auto_table(_table(_entry([[100, ["linear", "dense"]], [None, ["dense", "linear"]]])))
    assert choose_backend(n=100, **PLAIN) == "linear" and choose_backend(n=101, **PLAIN) == "dense"
    load_auto_table(None)
    assert choose_backend(n=8192, **PLAIN) == "linear"


def test_the_mode_of_the_call_picks_its_ranking(spy):
    """Forward calls read the ``fwd`` entry; calls autograd records through read ``fwdbwd``."""
    seen = spy("dense", "linear")
    load_auto_table(_table(_entry([[None, ["dense", "linear"]]], mode="fwd"),
                           _entry([[None, ["linear", "dense"]]], mode="fwdbwd")))
    q, k, v = _qkv()
    with torch.no_grad():
        hf_kernattn.kernelized_attention(q, k, v)
    hf_kernattn.kernelized_attention(q.requires_grad_(True), k, v).sum().backward()
    assert [name for name, _ in seen] == ["dense", "linear"]
    assert choose_backend(n=12, **PLAIN) == "dense" and choose_backend(n=12, **PLAIN, backward=True) == "linear"


def test_a_clipped_bias_reads_the_entry_of_the_nearest_measured_k_within_reach():
    one_d = dict(causal=False, rpe="1d", key_mask=False, device="cpu")
    load_auto_table(_table(
        _entry([[None, ["fft", "dense"]]], bias="1d"),
        _entry([[None, ["dense", "windowed"]]], bias="1d", clip=16),
        _entry([[None, ["windowed", "dense"]]], bias="1d", clip=256),
    ), replace=True)
    assert choose_backend(n=4096, rpe_clip=8, **one_d) == "dense"  # nearest: 16
    assert choose_backend(n=4096, rpe_clip=128, **one_d) == "windowed"  # nearest: 256
    assert choose_backend(n=4096, rpe_clip=512, **one_d) == "windowed"  # within 2 x 256
    assert choose_backend(n=4096, rpe_clip=513, **one_d) == "fft"  # beyond: the unclipped entry
    assert choose_backend(n=20, rpe_clip=4096, **one_d) == "dense"  # offsets reach N - 1 = 19 only


@pytest.mark.parametrize("table, problem", [
    (_table(3), r"entries\[0\]: must be an object"),
    ({"format": 2, "entries": []}, "format: must be 1"),
    ({"format": 1}, "entries: must be a list"),
    (_table({"mode": "fwd"}), r"entries\[0\]: must have exactly the keys"),
    (_table(_entry([[None, ["dense"]]], mode="train")), "mode must be one of"),
    (_table(_entry([[None, ["dense"]]], bias="3d")), "bias must be one of"),
    (_table(_entry([[None, ["dense"]]], bias="2d", causal=True)), "causal attention has no 2D bias"),
    (_table(_entry([[None, ["dense"]]], clip=4)), "clip must be null or, with a bias"),
    (_table(_entry([[None, ["dense"]]], dtype="float16")), "dtype must be one of"),
    (_table(_entry([])), "ranking must be a non-empty list"),
    (_table(_entry([[64, ["dense"]]])), "the last segment must have n_max null"),
    (_table(_entry([[64, ["dense"]], [32, ["linear"]], [None, ["linear"]]])), r"ranking\[1\]: n_max must be an int greater"),
    (_table(_entry([[None, []]])), "must rank at least one backend"),
    (_table(_entry([[None, ["dense", "dense"]]])), "ranks a backend twice"),
    (_table(_entry([[None, ["fft@float16"]]])), "after '@' comes the dtype"),
    (_table(_entry([[None, ["no such"]]])), "is not a backend name"),
    (_table(_entry([[None, ["dense"]]]), _entry([[None, ["linear"]]])), r"entries\[1\]: a second entry"),
])
def test_a_malformed_table_is_refused_naming_the_problem_and_changes_nothing(table, problem):
    before = registry.active_auto_table()
    with pytest.raises(ValueError, match=problem):
        load_auto_table(table)
    assert registry.active_auto_table() is before


def test_table_files_and_the_environment_variable(tmp_path, monkeypatch):
    good = tmp_path / "table.json"
    good.write_text(json.dumps(_table(_entry([[None, ["dense", "linear"]]]))))
    load_auto_table(str(good))
    assert choose_backend(n=8192, **PLAIN) == "dense"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_auto_table(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_auto_table(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="source must be a path"):
        load_auto_table(3)
    monkeypatch.setenv(AUTO_TABLE_ENV, str(good))
    registry.forget_auto_table()  # as in a new process: read on the first choice
    assert choose_backend(n=8192, **PLAIN) == "dense"
    monkeypatch.setenv(AUTO_TABLE_ENV, str(bad))
    registry.forget_auto_table()
    with pytest.raises(ValueError, match=f"{AUTO_TABLE_ENV}=.*is not valid JSON"):
        choose_backend(n=8192, **PLAIN)


def _load_in_a_thread(source, seconds=20.0):
    """``load_auto_table(source)``'s exception (None if it returned), or a failure if it has not
    returned within ``seconds`` (a read that blocks)."""
    import threading

    caught = []

    def run():
        try:
            load_auto_table(source)
            caught.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            caught.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"load_auto_table({source!r}) still blocked after {seconds} s"
    return caught[0]


def test_unreadable_table_files_are_refused_naming_the_file(tmp_path, monkeypatch):
    """Bytes that are not UTF-8, JSON nested beyond what a table needs (Python's parser would hit
    its recursion limit), a FIFO (reading one waits for a writer) and a directory: each the
    documented ValueError naming the file, the active table unchanged; through
    ``HF_KERNATTN_AUTO_TABLE`` every later automatic choice says the same."""
    latin = tmp_path / "latin1.json"
    latin.write_bytes(b'{"format": 1, "entries": [], "source": "caf\xe9"}')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    nested = tmp_path / "nested.json"  # parses, then nests beyond any table
    nested.write_text('{"format": 1, "entries": [], "source": ' + "[" * 500 + "]" * 500 + "}")
    cases = [(latin, "is not UTF-8 text"), (deep, "nests deeper than"), (nested, "nests deeper than"),
             (tmp_path, "is not a regular file")]
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "table.fifo"
        os.mkfifo(fifo)
        cases.append((fifo, "is not a regular file"))
    for path, problem in cases:
        before = registry.active_auto_table()
        err = _load_in_a_thread(path)
        assert isinstance(err, ValueError) and problem in str(err) and str(path) in str(err), (path, err)
        assert registry.active_auto_table() is before
        monkeypatch.setenv(AUTO_TABLE_ENV, str(path))
        registry.forget_auto_table()  # as in a new process: read on the first choice
        for _ in range(2):  # every later choice: the same clear error
            with pytest.raises(ValueError, match=f"{AUTO_TABLE_ENV}=.*{problem}"):
                choose_backend(n=8192, **PLAIN)
        monkeypatch.delenv(AUTO_TABLE_ENV)
        load_auto_table(None)
    # a table given as a dict nested beyond any table: the same error, before anything reads it
    value: list = []
    for _ in range(5000):
        value = [value]
    with pytest.raises(ValueError, match="nests deeper than"):
        load_auto_table({"format": 1, "entries": [{"mode": "fwd", "bias": "none", "causal": False, "clip": None,
                                                   "dtype": "float32", "ranking": value}]})


def test_auto_never_takes_a_ranked_backend_that_cannot_run_the_call():
    load_auto_table(_table(
        _entry([[None, ["windowed", "manhattan", "linear", "recurrent", "fft", "dense"]]], causal=True),
        _entry([[None, ["linear", "causal_chunked", "manhattan", "dense"]]], bias="1d", causal=True),
    ))
    # a causal call without a bias: windowed needs a clipped bias, manhattan a 2D one, linear is non-causal,
    # recurrent is a decoding form
    assert choose_backend(n=500, **dict(PLAIN, causal=True)) == "fft"
    # a state: only backends declared state (fft and dense are not)
    assert choose_backend(n=500, **dict(PLAIN, causal=True), state=True) == "causal_chunked"
    assert choose_backend(n=1, **dict(PLAIN, causal=True), state=True) == "recurrent"  # one token: decoding
    assert choose_backend(n=500, causal=True, rpe="1d", key_mask=False, device="cpu") == "dense"
    q, k, v = _qkv(n=20)
    bias = 0.1 * torch.randn(2, 39, generator=torch.Generator().manual_seed(1))
    out = hf_kernattn.kernelized_attention(q, k, v, bias, causal=True)
    torch.testing.assert_close(out, hf_kernattn.kernelized_attention(q, k, v, bias, causal=True, backend="dense"))


def test_a_user_backend_is_chosen_by_its_capabilities_where_the_table_ranks_it(request):
    """A backend registered by a user: usable by name always; ``auto`` takes it only where the
    table ranks it and its declared capabilities cover the call (or nothing ranked can)."""
    def mine(q, k, v, *, eps):
        return hf_kernattn.get_backend("linear").fn(q, k, v, eps=eps)

    hf_kernattn.register_backend("test_mine", mine, causal=False, noncausal=True, key_mask=False, takes=("eps",))
    request.addfinalizer(lambda: hf_kernattn.unregister_backend("test_mine"))
    q, k, v = _qkv()
    assert choose_backend(n=8192, **PLAIN) == "linear"  # not ranked: not considered
    torch.testing.assert_close(hf_kernattn.kernelized_attention(q, k, v, backend="test_mine"),
                               hf_kernattn.kernelized_attention(q, k, v, backend="linear"))
    load_auto_table(_table(_entry([[None, ["test_mine", "linear"]]]), _entry([[None, ["test_mine", "dense"]]], causal=True)))
    assert choose_backend(n=8192, **PLAIN) == "test_mine"
    assert choose_backend(n=8192, **dict(PLAIN, key_mask=True)) == "linear"  # it declared no key masks
    assert choose_backend(n=8192, **dict(PLAIN, causal=True)) == "dense"  # nor causal calls
    assert choose_backend(n=8192, **dict(PLAIN, device="cpu")) == "test_mine"
    # only unranked backends can run it: every able one, whole-sequence forms first
    load_auto_table(_table(_entry([[None, ["manhattan"]]], causal=True)), replace=True)
    assert choose_backend(n=8192, **dict(PLAIN, causal=True)) == "dense"


def test_the_precision_rule_prefers_what_the_table_ranks_first_among_accurate_candidates(spy):
    """A causal 1D bias at N = 2048: the FFT's float32 bound (~N eps) misses 1e-4. ``auto`` then
    runs the next candidate the table ranks: an exact float32 backend if it ranks before the
    float64 FFT, else the float64 FFT; where the bound holds (non-causal) the float32 FFT."""
    seen = spy("dense", "fft")
    n = 2048
    q, k, v = _qkv(n=n, h=1, m=2, d=2)
    bias = 0.1 * torch.randn(1, 2 * n - 1, generator=torch.Generator().manual_seed(3))
    bound = hf_kernattn.get_backend("fft").error_bound
    assert bound(q, k, rpe_bias=bias, causal=True, key_mask=None, dtype=torch.float32) > registry.AUTO_MAX_ERROR
    assert bound(q, k, rpe_bias=bias, causal=False, key_mask=None, dtype=torch.float32) <= registry.AUTO_MAX_ERROR
    ranking = lambda *names: [[None, list(names)]]  # noqa: E731
    with torch.no_grad():
        for causal in (True, False):
            load_auto_table(_table(_entry(ranking("fft", "dense", "fft@float64"), bias="1d", causal=causal)))
            hf_kernattn.kernelized_attention(q, k, v, bias, causal=causal)
        load_auto_table(_table(_entry(ranking("fft", "fft@float64", "dense"), bias="1d", causal=True)))
        out = hf_kernattn.kernelized_attention(q, k, v, bias, causal=True)
    assert seen == [("dense", torch.float32), ("fft", torch.float32), ("fft", torch.float64)]
    ref = hf_kernattn.kernelized_attention(q.double(), k.double(), v.double(), bias.double(), causal=True, backend="dense")
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4 * float(v.abs().max()))


def test_the_accuracy_rule_reads_the_declared_error_bound_not_the_name(request):
    """An approximate backend registered by a user with ``error_bound`` is checked like fft; the
    built-in fft re-registered without one counts as exact."""
    request.addfinalizer(lambda: hf_kernattn.unregister_backend("test_rough"))
    dense = hf_kernattn.get_backend("dense")
    runs = []

    def rough(q, k, v, *, rpe_bias, causal, grid, eps):
        runs.append(q.dtype)
        return dense.fn(q, k, v, rpe_bias=rpe_bias, causal=causal, grid=grid, eps=eps)

    hf_kernattn.register_backend("test_rough", rough, causal=True, rpe_1d=True, takes=("rpe_bias", "causal", "grid", "eps"),
                                 error_bound=lambda q, k, **kw: 1.0 if kw["dtype"] == torch.float32 else 0.0)
    load_auto_table(_table(_entry([[None, ["test_rough", "test_rough@float64", "dense"]]], bias="1d")))
    q, k, v = _qkv()
    bias = torch.zeros(2, 23)
    with torch.no_grad():
        hf_kernattn.kernelized_attention(q, k, v, bias)
    assert runs == [torch.float64]
    with pytest.raises(TypeError, match="error_bound must be None or callable"):
        hf_kernattn.register_backend("test_bad_bound", rough, error_bound=3)
    assert hf_kernattn.get_backend("fft").exact is False and hf_kernattn.get_backend("dense").exact is True


def test_a_symbolic_length_takes_only_backends_declared_symbolic_n():
    """torch.export with a dynamic length: the long-input ranking among backends whose work does
    not loop over N in Python (``symbolic_n``): fft and windowed do, dense does not."""
    load_auto_table(_table(_entry([[None, ["fft", "windowed", "dense"]]], bias="1d", causal=True)))

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, bias):
            return hf_kernattn.kernelized_attention(q, k, v, bias, causal=True)

    q, k, v = _qkv(n=12)
    bias = 0.1 * torch.randn(2, 23, generator=torch.Generator().manual_seed(2))
    n = torch.export.Dim("n", min=2, max=64)
    # the bias (H, 2N - 1) follows N: export the bias length as a derived dimension
    program = torch.export.export(Attend(), (q, k, v, bias),
                                  dynamic_shapes=({2: n}, {2: n}, {2: n}, {1: 2 * n - 1}))
    names = {node.target.__name__ for node in program.graph.nodes if node.op == "call_function"}
    assert not any("fft" in name for name in names)  # dense, not the FFT
    q2, k2, v2 = _qkv(n=30, seed=4)
    bias2 = 0.1 * torch.randn(2, 59, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(program.module()(q2, k2, v2, bias2),
                               hf_kernattn.kernelized_attention(q2, k2, v2, bias2, causal=True, backend="dense"))
    assert hf_kernattn.get_backend("dense").symbolic_n and not hf_kernattn.get_backend("fft").symbolic_n


def test_bench_calibrate_quick_writes_a_table_that_loads(tmp_path):
    from hf_kernattn.cli import main

    out = tmp_path / "cal"
    code = main(["-q", "bench", "calibrate", "--quick", "--ns", "16", "32", "--sides", "4", "--modes", "fwd",
                 "--clips-1d", "4", "--clips-2d", "2", "--rounds", "1", "--min-time", "0", "--out", str(out)])
    assert code == 0
    table = json.loads((out / "auto_table.json").read_text())
    checked = load_auto_table(out / "auto_table.json", replace=True)
    kinds = {(e["bias"], e["causal"], e["clip"]) for e in table["entries"]}
    assert kinds == {("none", False, None), ("none", True, None), ("1d", False, None), ("1d", True, None),
                     ("1d", False, 4), ("1d", True, 4), ("2d", False, None), ("2d", False, 2)}
    assert all(key[0] == "fwd" for key in checked)
    rows = (out / "calibrate.csv").read_text().splitlines()
    assert rows[0].startswith("mode,bias,causal,clip,n,side,backend,round,wall_s,cpu_s,status")
    # every ranking holds only backends that can run its kind of call
    for entry in table["entries"]:
        rpe = None if entry["bias"] == "none" else entry["bias"]
        able = registry.backends_for(causal=entry["causal"], rpe=rpe, rpe_clip=entry["clip"] if rpe else None)
        for _, names in entry["ranking"]:
            assert {x.partition("@")[0] for x in names} <= set(able)
    assert choose_backend(n=16, **PLAIN) in ("dense", "linear", "fft")


def test_bench_calibrate_check_measures_a_point_above_the_limit_again_and_reports_both(tmp_path, capsys):
    import csv

    from hf_kernattn.cli import main

    out = tmp_path / "check"
    # a limit of 0: every point is above it, so every point is measured a second time
    code = main(["-q", "bench", "calibrate", "--quick", "--check", "--ns", "16", "--sides", "4", "--modes", "fwd",
                 "--clips-1d", "4", "--clips-2d", "2", "--rounds", "1", "--min-time", "0", "--check-limit", "0",
                 "--rounds-again", "1", "--out", str(out)])
    assert code == 0
    with open(out / "check_summary.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    assert len(summary) == 8  # one point per kind of call
    for row in summary:
        assert row["best"] and row["best_again"] and float(row["ratio"]) > 0 and float(row["ratio_again"]) > 0
    # the backend auto ran: the one the active table's ranking and the accuracy rule give
    for row in summary:
        rpe = None if row["bias"] == "none" else row["bias"]
        ranked = registry.auto_candidates(n=int(row["n"]), causal=row["causal"] == "True", rpe=rpe, key_mask=False,
                                          device="cpu", rpe_clip=int(row["clip"]) if row["clip"] else None, heads=1)
        assert row["auto_runs"].partition("@")[0] in {name for name, _ in ranked}
    plain = next(r for r in summary if r["bias"] == "none" and r["causal"] == "False")
    assert plain["auto_runs"] == choose_backend(n=16, **PLAIN, heads=1)
    assert (out / "check_again.csv").exists()
    printed = capsys.readouterr().out
    assert "0 of 8 points within 0x" in printed and printed.count("above:") == 8


def test_a_call_reads_the_entry_measured_at_the_nearest_head_count(spy):
    """Crossovers move with the head count (per-call costs weigh more at few heads): a table may
    hold a kind's entry per head count measured, and a call reads the one nearest its own (log
    scale, a tie to the fewer); an entry without ``heads`` was measured at one head."""
    few = _entry([[None, ["dense", "linear"]]])
    many = dict(_entry([[None, ["linear", "dense"]]]), heads=12)
    load_auto_table(_table(few, many))
    assert choose_backend(n=300, **PLAIN) == "dense"  # heads not given: the fewest measured
    assert choose_backend(n=300, **PLAIN, heads=1) == "dense"
    assert choose_backend(n=300, **PLAIN, heads=3) == "dense"  # |log 3| < |log 3/12|
    assert choose_backend(n=300, **PLAIN, heads=4) == "linear"  # |log 4| > |log 4/12|
    assert choose_backend(n=300, **PLAIN, heads=12) == "linear"
    assert choose_backend(n=300, **PLAIN, heads=96) == "linear"
    # kernelized_attention passes the call's head count
    seen = spy("dense", "linear")
    for h, want in ((1, "dense"), (12, "linear"), (2, "dense")):
        seen.clear()
        q, k, v = _qkv(n=16, h=h)
        hf_kernattn.kernelized_attention(q, k, v)
        assert [name for name, _ in seen] == [want]
    # a loaded entry replaces the shipped ones of its kind at every head count
    load_auto_table(_table(many))
    load_auto_table(_table(_entry([[None, ["dense", "linear"]]], causal=True)))
    assert choose_backend(n=300, **PLAIN, heads=12) == "linear"  # another kind: the shipped entries serve it
    load_auto_table(None)
    shipped = registry.active_auto_table()
    load_auto_table(_table(few))
    assert all(key[:5] != ("fwd", "none", False, None, "float32") or key[5] == 1 for key in registry.active_auto_table())
    assert len(registry.active_auto_table()) <= len(shipped)
    with pytest.raises(ValueError, match="heads must be the head count"):
        load_auto_table(_table(dict(few, heads=0)))
    with pytest.raises(ValueError, match=r"entries\[1\]: a second entry .* heads 12"):
        load_auto_table(_table(many, many))


def test_calibration_rows_at_several_head_counts_give_an_entry_per_head_count():
    from hf_kernattn.bench.calibrate import rankings

    def row(n, backend, cpu, heads):
        return dict(mode="fwd", bias="none", causal=False, clip=None, n=n, side=None, backend=backend, round=0,
                    wall_s=cpu, cpu_s=cpu, status="ok", heads=heads)

    rows = [row(128, "dense", 1.0, 1), row(128, "linear", 2.0, 1), row(512, "dense", 3.0, 1), row(512, "linear", 2.0, 1),
            row(128, "dense", 2.0, None), row(128, "linear", 1.0, None)]  # no heads: the given default (12)
    entries = rankings(rows, lambda bias, causal, clip: ["dense", "linear"], heads=12)
    by_heads = {e["heads"]: e["ranking"] for e in entries}
    assert by_heads == {1: [[256, ["dense", "linear"]], [None, ["linear", "dense"]]], 12: [[None, ["linear", "dense"]]]}
    load_auto_table({"format": 1, "entries": entries})  # what it writes loads


def test_shipping_a_partial_calibration_replaces_only_the_entries_it_measured(tmp_path):
    from hf_kernattn.bench.calibrate import merge_tables, write_table_module

    old = _table(_entry([[None, ["dense"]]]), _entry([[None, ["linear"]]], causal=True),
                 dict(_entry([[None, ["linear"]]]), heads=12))
    old["source"] = {"run": "old"}
    new = _table(_entry([[64, ["dense", "linear"]], [None, ["linear", "dense"]]]))
    new["source"] = {"run": "new"}
    merged = merge_tables(new, old)
    assert merged["source"] == {"run": "new", "earlier": {"run": "old"}}
    got = {(e["causal"], e.get("heads", 1)): e["ranking"] for e in merged["entries"]}
    assert got == {(False, 1): new["entries"][0]["ranking"], (True, 1): [[None, ["linear"]]], (False, 12): [[None, ["linear"]]]}
    path = write_table_module(merged, tmp_path / "auto_table.py", "hf-kernattn bench calibrate --kinds none")
    namespace: dict = {}
    exec(path.read_text(), namespace)  # a plain dict literal, as checkpoints carry it
    assert namespace["AUTO_TABLE"]["entries"] == merged["entries"]
    load_auto_table(namespace["AUTO_TABLE"])


def test_calibrate_stops_timing_only_a_backend_that_cannot_overtake():
    """``bench calibrate`` (and ``--check``) stops timing a backend at larger N only where it is far
    behind at two N, its cost growing at least as fast as the fastest's, and never a backend
    cheaper in N than a fastest whose cost grows with N^2 (an FFT behind ``dense``)."""
    from hf_kernattn.bench.calibrate import CHECK_PRUNE, prune_reason

    # times at N and the previous N: 12x behind at both
    far_behind = dict(t=12.0, t_best=1.0, prev=3.0, prev_best=0.25)  # grows 4x, as the fastest
    assert prune_reason("windowed", "linear", **far_behind, prune=3.0, check=False)
    assert prune_reason("fft@float64", "windowed", **far_behind, prune=3.0, check=True)
    # the fastest is quadratic (dense), the other not: whatever the figures, it keeps being timed
    assert prune_reason("fft@float64", "dense", **far_behind, prune=3.0, check=True) is None
    assert prune_reason("fft", "dense", **far_behind, prune=3.0, check=False) is None
    # growing slower than the fastest: it may overtake
    assert prune_reason("fft", "windowed", t=12.0, t_best=1.0, prev=5.0, prev_best=0.25, prune=3.0, check=True) is None
    # behind at only one of the two N
    assert prune_reason("fft", "windowed", t=12.0, t_best=1.0, prev=0.5, prev_best=0.25, prune=3.0, check=False) is None
    # --check prunes at CHECK_PRUNE even with a larger --prune (still only growing as fast)
    assert prune_reason("fft", "windowed", **far_behind, prune=100.0, check=True)
    assert prune_reason("fft", "windowed", **far_behind, prune=100.0, check=False) is None
    assert CHECK_PRUNE <= 12.0


def test_calibrate_check_times_no_float64_variant_where_the_float32_backend_meets_the_target():
    """``--check`` times the float64 variant of an approximate backend only where the backend in
    float32 misses the accuracy target (the same computation in float64 cannot be faster); the
    rows say why a backend was not timed."""
    from hf_kernattn.bench.calibrate import check_candidates, measure_kind

    names = ["dense", "fft", "fft@float64"]
    assert check_candidates(names, lambda c: True) == (
        ["dense", "fft"], {"fft@float64": "not timed: meets the target in float32"})
    assert check_candidates(names, lambda c: c != "fft") == (["dense", "fft@float64"], {"fft": "not accurate"})
    assert check_candidates(names, lambda c: c == "dense") == (
        ["dense"], {"fft": "not accurate", "fft@float64": "not accurate"})
    spec = dict(bias="none", causal=False, clip=None, mode="fwd", ns=[16], sides=[], heads=1, features=4, head_dim=4,
                rounds=1, min_time=0.0, max_call_seconds=100.0, max_nn_mb=1e6, prune=3.0, threads=None, device="cpu",
                check=True, table=None, check_drop=None, skip=[])
    status = {r["backend"]: r["status"] for r in measure_kind(spec)}
    assert status["auto"] == status["fft"] == status["dense"] == "ok"  # fft meets the target at 16 tokens
    assert status["fft@float64"] == "not timed: meets the target in float32"


def test_calibrate_counts_a_long_warm_up_call_as_the_first_rounds_timing(monkeypatch):
    """Each candidate's first call is a warm-up; one taking more than ``WARM_UP_COUNTS_FROM`` CPU
    seconds is the first round's timing instead (long calls are not run twice for nothing)."""
    from hf_kernattn.bench import calibrate

    calls: dict[str, int] = {}
    real = calibrate._runner

    def counting(name, *args):
        run = real(name, *args)

        def counted():
            calls[name] = calls.get(name, 0) + 1
            run()
        return counted

    monkeypatch.setattr(calibrate, "_runner", counting)
    spec = dict(bias="none", causal=False, clip=None, mode="fwd", ns=[16], sides=[], heads=1, features=4, head_dim=4,
                rounds=2, min_time=0.0, max_call_seconds=100.0, max_nn_mb=1e6, prune=3.0, threads=None, device="cpu",
                check=False, table=None, check_drop=None, skip=["fft", "fft@float64"])
    rows = calibrate.measure_kind(spec)
    assert calls == {"dense": 3, "linear": 3}  # a short warm-up, then one call per round
    assert sum(r["status"] == "ok" for r in rows) == 4
    calls.clear()
    monkeypatch.setattr(calibrate, "WARM_UP_COUNTS_FROM", -1.0)  # every warm-up is "long"
    rows = calibrate.measure_kind(spec)
    assert calls == {"dense": 2, "linear": 2}
    assert sum(r["status"] == "ok" for r in rows) == 4  # still a timing per round


def test_the_crossover_sentences_follow_the_active_table(capsys):
    """``bench calibrate --describe``'s sentences read the active table: every change of auto's
    first choice, non-monotone rankings included, and forward and training apart when they differ."""
    from hf_kernattn.bench import calibrate

    load_auto_table(_table(
        _entry([[100, ["dense", "windowed"]], [300, ["windowed", "dense"]], [None, ["dense", "windowed"]]],
               bias="1d", causal=True, clip=64),
        _entry([[None, ["windowed", "dense"]]], mode="fwdbwd", bias="1d", causal=True, clip=64),
    ), replace=True)
    call = dict(causal=True, rpe="1d", rpe_clip=64, heads=1)
    assert calibrate.auto_picks(**call) == [(2, "dense"), (101, "windowed"), (301, "dense")]
    assert calibrate.describe_crossovers(call) == (
        "forward: `dense` up to 100 tokens, `windowed` up to 300, `dense` beyond; training: `windowed` at every length")
    args = calibrate.build_parser().parse_args(["--describe"])
    assert calibrate.run(args) == 0
    assert "linear_gpt_rpe" in capsys.readouterr().out


def test_the_shipped_table_is_a_valid_table_and_read_as_checked():
    """The table checkpoints carry (``auto_table.py``, read without the file format's checks)
    passes every check of a table file and is read in the same form the checks give."""
    from hf_kernattn.auto_tables import check_auto_table
    from hf_kernattn.modeling.auto_table import AUTO_TABLE

    assert registry.shipped_auto_table() == check_auto_table(AUTO_TABLE)
