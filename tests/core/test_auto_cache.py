"""``auto`` caches its candidates per kind of call, head count and N: the cached answer is the uncached one for
every kind the table tells apart, and it is dropped when another table becomes active
(``load_auto_table``, ``HF_KERNATTN_AUTO_TABLE``) or the registered backends change
(``register_backend``, a replaced or removed backend)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import hf_kernattn
from hf_kernattn.modeling import registry
from hf_kernattn.auto_tables import AUTO_TABLE_ENV, load_auto_table
from hf_kernattn.modeling.registry import auto_candidates, choose_backend

PLAIN = dict(causal=False, rpe=None, key_mask=False, device="cpu")


def _table(*entries):
    return {"format": 1, "entries": [dict(mode="fwd", bias="none", causal=causal, clip=None, dtype="float32", ranking=r)
                                     for r, causal in entries]}


@pytest.fixture(autouse=True)
def shipped_table():
    load_auto_table(None)
    yield
    load_auto_table(None)


def _kinds():
    """Every kind of call the shipped table tells apart (and some it does not), with options."""
    for bias, causal, clip in [("none", False, None), ("none", True, None), ("1d", False, None), ("1d", True, None),
                               ("1d", False, 64), ("1d", True, 64), ("1d", False, 512), ("1d", True, 512),
                               ("1d", False, 3000), ("2d", False, None), ("2d", False, 16), ("2d", False, 40)]:
        for backward, dtype, key_mask in itertools.product((False, True), (torch.float32, torch.float64), (False, True)):
            yield dict(causal=causal, rpe=None if bias == "none" else bias, rpe_clip=clip, key_mask=key_mask,
                       device="cpu", backward=backward, dtype=dtype)
    for state, n_split in itertools.product((False, True), (False, True)):  # stateful / split-denominator calls
        yield dict(causal=True, rpe=None, rpe_clip=None, key_mask=False, device="cpu", state=state, split=n_split)


NS = (1, 2, 64, 181, 182, 256, 362, 363, 576, 1024, 2896, 2897, 4096, 5792, 5793, 16384, 65536)


class _Length(int):
    """An int ``auto`` does not cache by (it caches calls whose length is exactly an ``int``)."""


def _uncached(n, **kind):
    return auto_candidates(n=_Length(n), **kind)


def test_the_cached_candidates_are_the_uncached_ones_for_every_kind_and_n():
    registry._AUTO_CACHE.clear()
    for kind, heads in itertools.product(_kinds(), (None, 1, 4, 12)):
        kind = dict(kind, heads=heads)
        for n in NS:
            want = _uncached(n, **kind)
            first = auto_candidates(n=n, **kind)  # computed and stored
            again = auto_candidates(n=n, **kind)  # read from the cache
            assert first == want and again == want, (n, kind)
    assert len(registry._AUTO_CACHE) > 0
    # the caller's list is its own: changing it does not change the cache
    got = auto_candidates(n=256, **PLAIN)
    got.clear()
    assert auto_candidates(n=256, **PLAIN) == _uncached(256, **PLAIN)


def test_a_loaded_table_replaces_the_cached_choice():
    assert choose_backend(n=8192, **PLAIN) == "linear"
    load_auto_table(_table(([[None, ["dense", "linear"]]], False)))
    assert choose_backend(n=8192, **PLAIN) == "dense"
    load_auto_table(None)
    assert choose_backend(n=8192, **PLAIN) == "linear"


def test_the_environment_variable_table_replaces_the_cached_choice(tmp_path, monkeypatch):
    assert choose_backend(n=8192, **PLAIN) == "linear"
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(([[None, ["dense", "linear"]]], False))))
    monkeypatch.setenv(AUTO_TABLE_ENV, str(path))
    registry.forget_auto_table()  # as in a new process: read on the first choice
    assert choose_backend(n=8192, **PLAIN) == "dense"


def test_registering_replacing_or_removing_a_backend_replaces_the_cached_choice(request):
    request.addfinalizer(lambda: hf_kernattn.unregister_backend("test_cached"))
    load_auto_table(_table(([[None, ["test_cached", "linear"]]], False), ([[None, ["test_cached", "dense"]]], True)))
    assert choose_backend(n=8192, **PLAIN) == "linear"  # ranked but not registered

    def mine(q, k, v, *, eps, causal=False):
        return hf_kernattn.get_backend("linear").fn(q, k, v, eps=eps)

    hf_kernattn.register_backend("test_cached", mine, key_mask=False, takes=("eps",))
    assert choose_backend(n=8192, **PLAIN) == "test_cached"
    assert choose_backend(n=8192, **dict(PLAIN, causal=True)) == "dense"  # declared non-causal only
    hf_kernattn.register_backend("test_cached", mine, causal=True, noncausal=False, key_mask=False,
                                 takes=("eps", "causal"), overwrite=True)
    assert choose_backend(n=8192, **dict(PLAIN, causal=True)) == "test_cached"
    assert choose_backend(n=8192, **PLAIN) == "linear"
    hf_kernattn.unregister_backend("test_cached")
    assert choose_backend(n=8192, **dict(PLAIN, causal=True)) == "dense"


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(registry, "AUTO_CACHE_SIZE", 8)
    for n in range(1, 40):
        assert auto_candidates(n=n, **PLAIN) == _uncached(n, **PLAIN)
        assert len(registry._AUTO_CACHE) <= 8
