"""The non-finite check after the kernel, for backends declared ``propagates_non_finite``.

Such a backend runs before any check of its inputs; one sum of its output (and of separate
denominator features, which it does not cover) tells whether anything was not finite, and only
then does the guard isolate the non-finite rows and the backend run again. Two things are shown
here: the declaration itself (every NaN/inf entry of q, k or v at a real position makes some
output entry of the bare kernel non-finite, also where the rest of the data are zeros, where
0 * inf is the only way the entry can show), and that the public call then gives exactly what
the guard before the kernel gives (the same backend declared without the capability): the same
NaN rows, bit-identical finite rows and gradients, the same final state, NaN in padding staying
there, the first run's autograd graph dropped.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.utils.checkpoint

import hf_kernattn
from hf_kernattn.modeling.state import AttentionState

DECLARED = sorted(name for name in hf_kernattn.available_backends() if hf_kernattn.get_backend(name).propagates_non_finite)
POISONS = [math.nan, math.inf, -math.inf]


def test_the_fast_kernels_declare_the_capability():
    assert {"linear", "causal_chunked"} <= set(DECLARED)
    for name in DECLARED:  # the tests below call them without a bias: a declaring backend must allow that
        spec = hf_kernattn.get_backend(name)
        assert not spec.needs_rpe_clip and not spec.error_bound, name


def _causal(name: str) -> bool:
    return not hf_kernattn.get_backend(name).noncausal


def _inputs(seed, b=2, h=2, n=11, m=4, d=3, dtype=torch.float64, signed=False, split=False):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64) if signed else \
            torch.rand(*shape, generator=g, dtype=torch.float64) + 0.1
        return x.to(dtype)

    q, k = draw(b, h, n, m), draw(b, h, n, m)
    v = torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(dtype)
    den = (draw(b, h, n, m + 1).abs(), draw(b, h, n, m + 1).abs()) if split else (None, None)
    return q, k, v, *den


def _bare(name, q, k, v, q_den=None, k_den=None, state=None):
    """The registered function itself, with the arguments the entry point would give it."""
    spec = hf_kernattn.get_backend(name)
    given = dict(eps=1e-6, causal=_causal(name), key_mask=None, rpe_bias=None, grid=None, q_den=q_den, k_den=k_den,
                 initial_state=state, output_final_state=state is not None)
    out = spec.fn(q, k, v, **{a: given[a] for a in spec.takes})
    return out[0] if state is not None else out


@pytest.mark.parametrize("name", DECLARED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
def test_every_non_finite_input_entry_shows_in_the_output(name, dtype, signed, split, zeros):
    """The declaration: a NaN/+inf/-inf in q, k or v at any position, any feature, makes at least
    one output entry of the bare kernel non-finite (when causal: in the row of that position).
    With ``zeros`` the poisoned position's other entries, the other tensors at that position
    and, for a key, every query are zeros: the entry can only show as 0 * inf = NaN. With a
    state (a backend declared ``state``) too."""
    spec = hf_kernattn.get_backend(name)
    if split and not spec.split_denominator:
        pytest.skip("no separate denominator features")
    gen = torch.Generator().manual_seed(40)
    states = [None]
    if spec.state:
        states.append(AttentionState(torch.rand(2, 2, 4, 3, dtype=dtype), torch.rand(2, 2, 5 if split else 4, dtype=dtype)))
    for trial in range(12):
        q, k, v, q_den, k_den = _inputs(41 + trial, dtype=dtype, signed=signed, split=split)
        b, h, n = int(torch.randint(2, (1,), generator=gen)), int(torch.randint(2, (1,), generator=gen)), \
            int(torch.randint(11, (1,), generator=gen))
        for target in ("q", "k", "v"):
            for poison in POISONS:
                xs = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
                x = xs[target]
                f = int(torch.randint(x.shape[-1], (1,), generator=gen))
                if zeros:
                    for t in xs.values():
                        t[b, h, n] = 0
                    if target == "k":
                        xs["q"][b, h] = 0
                x[b, h, n, f] = poison
                for state in states:
                    out = _bare(name, xs["q"], xs["k"], xs["v"], q_den, k_den, state)
                    seen = out[b, h, n] if _causal(name) else out[b, h]
                    assert not torch.isfinite(seen).all(), (trial, target, poison, state is not None)


def _register(spec, fn=None, **overrides):
    """Register ``spec`` again (public ``register_backend(..., overwrite=True)``), with ``fn`` and
    the declarations in ``overrides`` instead of its own where given."""
    declared = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("name", "fn")}
    hf_kernattn.register_backend(spec.name, spec.fn if fn is None else fn, overwrite=True, **{**declared, **overrides})


def _spied(name, calls, capable=True):
    """Register ``name`` with a function that counts its calls, declared with or without the capability."""
    spec = hf_kernattn.get_backend(name)

    def fn(*args, **kwargs):
        calls.append(args)
        return spec.fn(*args, **kwargs)

    _register(spec, fn, propagates_non_finite=capable)


def _public(name, capable, q, k, v, q_den, k_den, mask, state, calls=None, in_place=False):
    """The public call through ``name`` declared with or without the capability: outputs (and
    the final state) and the gradients of a loss on the finite output entries."""
    spec = hf_kernattn.get_backend(name)
    calls = [] if calls is None else calls
    _spied(name, calls, capable)
    try:
        grad = not in_place
        xs = [None if x is None else x.clone().requires_grad_(grad) for x in (q, k, v, q_den, k_den)]
        kw = dict(attention_mask=mask, backend=name, q_den=xs[3], k_den=xs[4])
        if state is not None:
            own = AttentionState(*(x.clone() for x in state[:2]))
            kw.update(initial_state=own, output_final_state=True, in_place=in_place)
        result = hf_kernattn.kernelized_attention(*xs[:3], causal=_causal(name), **kw)
        out, final = result if state is not None else (result, None)
        if in_place:
            assert final.kv is own.kv
        grads = []
        if grad:
            loss = torch.where(torch.isfinite(out), out, 0).pow(2).sum()
            if final is not None:
                loss = loss + torch.where(torch.isfinite(final.kv), final.kv, 0).sum()
            grads = torch.autograd.grad(loss, [x for x in xs if x is not None])
        return out.detach(), None if final is None else tuple(x.detach() for x in final[:2]), grads
    finally:
        _register(spec)


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", DECLARED)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("target", ["q", "k", "v", "q_den", "k_den", "none", "padding"])
@pytest.mark.parametrize("with_state", [False, True])
def test_the_public_call_gives_what_the_guard_before_the_kernel_gives(name, poison, target, with_state):
    """Random real positions of one input set to NaN/+inf/-inf (NaN in padded keys and values
    too): outputs, final state and gradients equal, bit for bit, those of the same backend
    declared without the capability (the guard before the kernel); the rows that see no
    non-finite input are finite. The kernel runs once when every real input is finite (also
    when only padding holds NaN) and twice otherwise."""
    spec = hf_kernattn.get_backend(name)
    split = target in ("q_den", "k_den")
    if split and not spec.split_denominator:
        pytest.skip("no separate denominator features")
    if with_state and not spec.state:
        pytest.skip("no state")
    gen = torch.Generator().manual_seed(50)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, -3:] = 0
    mask[1, :2] = 0
    for trial in range(3):
        q, k, v, q_den, k_den = _inputs(51 + trial, split=split or trial == 2 and spec.split_denominator)
        pad = (mask == 0)[:, None, :, None]
        k, v = torch.where(pad, math.nan, k), torch.where(pad, math.nan, v)
        if k_den is not None:
            k_den = torch.where(pad, math.nan, k_den)
        xs = {"q": q, "k": k, "v": v, "q_den": q_den, "k_den": k_den}
        if target not in ("none", "padding"):
            x = xs[target]
            for _ in range(1 + trial):  # 1 to 3 entries at real positions
                b, h = int(torch.randint(2, (1,), generator=gen)), int(torch.randint(2, (1,), generator=gen))
                real = mask[b].nonzero()[:, 0]
                n = int(real[torch.randint(len(real), (1,), generator=gen)])
                x[b, h, n, int(torch.randint(x.shape[-1], (1,), generator=gen))] = poison
        if target == "padding":
            q = torch.where(pad, poison, q)  # a padded position's query: its own row only
        state = None
        if with_state:
            state = AttentionState(torch.rand(2, 2, 4, 3, dtype=torch.float64, generator=gen),
                                   torch.rand(2, 2, q_den.shape[-1] if q_den is not None else 4, dtype=torch.float64,
                                              generator=gen))
        args = (q, k, v, q_den, k_den, mask, state)
        calls = []
        out, final, grads = _public(name, True, *args, calls=calls)
        want_out, want_final, want_grads = _public(name, False, *args)
        _same(out, want_out)
        if final is not None:
            for a, w in zip(final, want_final):
                _same(a, w)
        assert len(grads) == len(want_grads)
        for g, w in zip(grads, want_grads):
            assert torch.isfinite(g).all()
            _same(g, w)
        if target == "none":  # NaN in padded keys and values only
            assert torch.isfinite(out).all() and len(calls) == 1
        else:
            assert not torch.isfinite(out).all() and len(calls) == 2
        if target == "padding":  # a padded position's query: its own row only
            assert torch.isfinite(out[~pad.expand_as(out)]).all()


@pytest.mark.parametrize("name", [n for n in DECLARED if hf_kernattn.get_backend(n).state])
@pytest.mark.parametrize("target", ["none", "k", "v"])
def test_in_place_writes_the_state_of_the_guard_before_the_kernel(name, target):
    """``in_place=True`` (no autograd): the state written into the given tensors is the guard's
    (the discarded first run writes nothing)."""
    q, k, v, _, _ = _inputs(60)
    state = AttentionState(torch.rand(2, 2, 4, 3, dtype=torch.float64), torch.rand(2, 2, 4, dtype=torch.float64))
    if target != "none":
        {"k": k, "v": v}[target][1, 0, 4, 1] = math.inf
    with torch.no_grad():
        calls = []
        out, final, _ = _public(name, True, q, k, v, None, None, None, state, calls=calls, in_place=True)
        want_out, want_final, _ = _public(name, False, q, k, v, None, None, None, state, in_place=True)
    _same(out, want_out)
    for a, w in zip(final, want_final):
        _same(a, w)
    assert len(calls) == (1 if target == "none" else 2)


def _record_host_reads(monkeypatch, reads):
    """Append the name of every host read (``bool()`` of a tensor, ``.item()``, ``.tolist()``) to ``reads``."""
    for attr in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, attr)
        monkeypatch.setattr(torch.Tensor, attr,
                            lambda self, *a, _r=real, _n=attr, **kw: reads.append(_n) or _r(self, *a, **kw))


@pytest.mark.parametrize("name", DECLARED)
def test_finite_inputs_reach_the_kernel_once_uncopied_with_one_host_read(monkeypatch, name):
    """Every input finite: the backend runs once on the caller's tensors (float32, nothing
    padded), the result and gradients are the bare kernel's exactly, and the call reads the host
    once (``tolist`` of the flags), as the guard before the kernel does."""
    q, k, v, _, _ = _inputs(61, dtype=torch.float32)
    xs = [x.requires_grad_(True) for x in (q, k, v)]
    calls, reads = [], []
    spec = hf_kernattn.get_backend(name)
    _spied(name, calls)
    try:
        _record_host_reads(monkeypatch, reads)
        out = hf_kernattn.kernelized_attention(*xs, causal=_causal(name), backend=name)
        monkeypatch.undo()
    finally:
        _register(spec)
    assert reads == ["tolist"]
    assert len(calls) == 1 and [x.data_ptr() for x in calls[0]] == [x.data_ptr() for x in xs]
    bare = _bare(name, *xs)
    assert torch.equal(out, bare)
    grads = torch.autograd.grad(out.pow(2).sum(), xs)
    bare_grads = torch.autograd.grad(bare.pow(2).sum(), xs)
    assert all(torch.equal(g, w) for g, w in zip(grads, bare_grads))


@pytest.mark.parametrize("name", DECLARED)
def test_a_non_finite_output_of_finite_inputs_is_returned_as_run(name):
    """Finite inputs whose output is not finite (q = 0 and eps = 0: 0 / 0): nothing to isolate,
    so the first run is the result (the kernel runs once), as the guard before the kernel gives."""
    q, k, v, _, _ = _inputs(62)
    q[0, 1, 3] = 0
    spec = hf_kernattn.get_backend(name)
    results = []
    for capable in (True, False):
        calls = []
        _spied(name, calls, capable)
        try:
            results.append(hf_kernattn.kernelized_attention(q, k, v, causal=_causal(name), backend=name, eps=0.0))
        finally:
            _register(spec)
        assert len(calls) == 1
    _same(*results)
    assert torch.isnan(results[0][0, 1, 3]).all() and int(results[0].isnan().sum()) == v.shape[-1]


@pytest.mark.parametrize("name", [n for n in DECLARED if hf_kernattn.get_backend(n).state])
def test_a_one_token_step_from_a_state_reads_nothing_on_the_host(monkeypatch, name):
    """A one-token step from a state (not the in-place decoding path) runs the backend once and
    reads nothing on the host: its only row sees all it reads, nothing is checked."""
    q, k, v, _, _ = _inputs(63, n=1)
    state = AttentionState(torch.rand(2, 2, 4, 3, dtype=torch.float64), torch.rand(2, 2, 4, dtype=torch.float64))
    calls, reads = [], []
    spec = hf_kernattn.get_backend(name)
    _spied(name, calls)
    try:
        _record_host_reads(monkeypatch, reads)
        hf_kernattn.kernelized_attention(q, k, v, causal=True, backend=name, initial_state=state, output_final_state=True)
        monkeypatch.undo()
    finally:
        _register(spec)
    assert reads == [] and len(calls) == 1


@pytest.mark.parametrize("name", DECLARED)
def test_a_checkpointed_call_recomputes_the_same_path(name):
    """Under non-reentrant activation checkpointing (as ``recompute_attention`` runs it) a call
    with an inf value runs the kernel twice in the forward and again in the recomputation: the
    gradients equal those of the guard before the kernel."""
    q, k, v, _, _ = _inputs(64)
    v[1, 0, 3, 1] = math.inf
    spec = hf_kernattn.get_backend(name)
    results = []
    for capable in (True, False):
        _spied(name, [], capable)
        try:
            xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = torch.utils.checkpoint.checkpoint(
                lambda *a: hf_kernattn.kernelized_attention(*a, causal=_causal(name), backend=name), *xs, use_reentrant=False)
            grads = torch.autograd.grad(torch.where(torch.isfinite(out), out, 0).pow(2).sum(), xs)
        finally:
            _register(spec)
        results.append((out.detach(), grads))
    _same(results[0][0], results[1][0])
    for g, w in zip(results[0][1], results[1][1]):
        _same(g, w)
