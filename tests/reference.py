"""The literal reference formula of docs/architecture.md, once, for every test that needs ground truth.

``out_i = sum_j c_{j-i} (q_i . k_j) v_j / (sum_j c_{j-i} (q_i . k_j) + eps)`` over the allowed
j (not masked; ``j <= i`` when causal), in float64, with ``c = exp(b)`` taken literally (no shift:
float64 holds exp(+-90)). The bias is 1D, ``(H, 2N - 1)`` indexed by ``j - i + N - 1``, or 2D,
``(H, 2 Hg - 1, 2 Wg - 1)`` on a row-major ``grid = (Hg, Wg)`` indexed by the row and column
offsets. Keys that are not allowed are selected away
(``torch.where``), so whatever they hold (even inf or nan) never enters. Written from scratch: it uses nothing of the package.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def literal_reference(q, k, v, bias=None, causal=False, mask=None, grid=None, eps=1e-6, q_den=None, k_den=None):
    """float64 ``(B, H, N, D)`` output of the formula above for ``q, k: (B, H, N, M)`` (features
    already applied), ``v: (B, H, N, D)``, ``mask: (B, N)`` with 1 = real key. With ``q_den,
    k_den`` the denominator sums ``q_den_i . k_den_j`` instead (no bias)."""
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    a = q @ k.transpose(-1, -2)  # (B, H, N, N): q_i . k_j
    if bias is not None:
        bias = bias.double()
        if grid is None:
            c = torch.exp(bias[:, j - i + n - 1])
        else:
            wg = grid[1]
            c = torch.exp(bias[:, j // wg - i // wg + grid[0] - 1, j % wg - i % wg + wg - 1])
        a = a * c[None]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed = j <= i
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
        # a masked key's value never enters, whatever it holds
        v = torch.where(mask.bool()[:, None, :, None], v, torch.zeros((), dtype=v.dtype))
    a = torch.where(allowed, a, torch.zeros((), dtype=a.dtype))
    den = a
    if q_den is not None:
        den = torch.where(allowed, q_den.double() @ k_den.double().transpose(-1, -2), torch.zeros((), dtype=a.dtype))
    return (a @ v) / (den.sum(-1, keepdim=True) + eps)


def reorder_atol(*tensors, terms: int, layers: int = 1, scale: float | None = None) -> float:
    """The absolute tolerance between two evaluations of one formula in the same floating-point
    dtype whose sums run in different orders (an exported, compiled, fused, chunked or batched
    evaluation against the eager or whole one; BLAS kernels differ by machine).

    A sum of ``n`` terms in any order is within ``gamma_n sum |x| < n eps sum |x|`` of its exact
    value (unit roundoff ``u = eps / 2``, ``gamma_n = n u / (1 - n u)``), so two orders differ by
    less than ``n eps sum |x|``; each of ``layers`` chained reductions adds its own. ``terms``: the
    longest sum a compared value passes through (a width, a length, a number of items);
    ``sum |x|`` is taken at the magnitude of the compared values, the largest finite entry of
    ``tensors`` (``scale``: a larger one, e.g. of the terms before a normalisation). ``eps`` is
    the machine epsilon of the tensors' dtype (float32: 2^-23). Any error of the formula itself
    (a wrong key, a lost state) moves values by far more than this at these scales."""
    dtype = next(t.dtype for t in tensors if t.is_floating_point())
    magnitudes = [float(t.detach()[t.detach().isfinite()].abs().max()) for t in tensors if t.isfinite().any()]
    if scale is None:
        scale = max(magnitudes, default=0.0)
    return layers * terms * torch.finfo(dtype).eps * scale


def assert_reordered_close(got, want, *, terms: int, layers: int = 1, scale: float | None = None, msg=None) -> None:
    """``got`` equals ``want`` within :func:`reorder_atol` of both (``rtol=0``: the bound is
    absolute, at the magnitude of the largest entry, as summation errors are). Integer and bool
    tensors (positions, validity) are compared exactly."""
    if not (got.is_floating_point() or want.is_floating_point()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=msg)
        return
    atol = reorder_atol(got, want, terms=terms, layers=layers, scale=scale)
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=msg)


def assert_model_outputs_reordered_close(got, want, config, n: int, *, scale: float | None = None, msg=None) -> None:
    """A model's outputs (hidden states, logits, a state, gradients) from two evaluations that
    differ in the order of their sums (another batch shape, chunks or steps against the whole
    sequence, an exported or checkpointed graph): :func:`assert_reordered_close` with the
    longest sum the widest projection or the attention over ``n`` tokens, about four reductions
    chained per layer of ``config`` (projections, attention, output, MLP)."""
    terms = max(config.hidden_size, getattr(config, "intermediate_size", None) or 0, n)
    assert_reordered_close(got, want, terms=terms, layers=4 * config.num_hidden_layers, scale=scale, msg=msg)


def bytes_saved_for_backward(fn):
    """``(result of fn(), bytes of the tensors autograd saved for the backward while it ran)``,
    counted on their storages (what a kernel keeps alive between its forward and backward)."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved)


def hybrid_layer_reference(attn, x, window, key_mask, causal):
    """A sliding-window hybrid attention layer written out from its weights: raw q, k, v by the
    projections, features by the layer's feature map, the band (the last ``window`` keys when
    ``causal``, else ``|j - i| < window``) weighted by ``a_h exp(q . k / sqrt(d))``, every other
    allowed key by ``b_h phi(q) . phi(k)``, one numerator and denominator, then ``o_proj``.
    ``key_mask``: ``(B, N)`` bool, True for real keys."""
    b, n, _ = x.shape
    h, d = attn.num_heads, attn.head_dim

    def heads(t):
        return t.view(b, n, h, d).transpose(1, 2)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))
    qf, kf = attn.feature_map(q, is_query=True), attn.feature_map(k, is_query=False)
    i = torch.arange(n)
    r = i[None, :] - i[:, None]  # key minus query position
    allowed = key_mask[:, None, None, :] & ((r <= 0) if causal else torch.ones_like(r, dtype=torch.bool))
    inside = allowed & ((r > -window) if causal else (r.abs() < window))
    a = attn.window_log_weight.exp()[:, None, None]
    c = attn.linear_log_weight.exp()[:, None, None]
    exact = a * torch.exp(q @ k.transpose(-1, -2) / d ** 0.5)
    kernel = c * (qf @ kf.transpose(-1, -2))
    w = torch.where(inside, exact, torch.where(allowed, kernel, torch.zeros((), dtype=x.dtype)))
    out = (w @ v) / (w.sum(-1, keepdim=True) + attn.eps)
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, h * d))


def assert_float32_matches_float64(out32, out64, xs32, xs64, mask):
    """A float32 call's outputs and gradients (with respect to ``xs32``) equal the float64
    reference's (``xs64``) at the real query positions of ``mask`` ``(B, N)``."""
    real = mask.bool()[:, None, :, None]
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32[real.expand_as(out32)].double(), out64[real.expand_as(out64)], rtol=1e-5, atol=1e-5)
    g32 = torch.autograd.grad(torch.where(real, out32, 0.0).sum(), xs32)
    g64 = torch.autograd.grad(torch.where(real, out64, 0.0).sum(), xs64)
    for a, b in zip(g32, g64):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def host_reads(monkeypatch, call):
    """``(call(), the host reads it made)``: ``.item()``, ``bool()`` / ``int()`` / ``float()`` of a
    tensor, ``tolist()`` (each a device synchronisation), recorded by name."""
    reads = []
    for name in ("__bool__", "item", "__int__", "__float__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    try:
        return call(), reads
    finally:
        monkeypatch.undo()


@contextlib.contextmanager
def replaced_backend(name: str, fn):
    """Backend ``name`` served by ``fn`` with the capabilities it declares now (public
    ``register_backend(..., overwrite=True)``), the original registered again on exit."""
    import hf_kernattn

    spec = hf_kernattn.get_backend(name)
    declared = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("name", "fn")}
    hf_kernattn.register_backend(name, fn, overwrite=True, **declared)
    try:
        yield spec
    finally:
        hf_kernattn.register_backend(name, spec.fn, overwrite=True, **declared)


class WholeHeadAllocations(TorchDispatchMode):
    """A dispatch mode that counts the tensors ops allocate (not views or aliases of an argument)
    that span all ``heads`` (dim 1, at least 3 dims) with at least ``min_numel`` values: outputs,
    gradients and any whole copy. ``count`` after the ``with`` block."""

    def __init__(self, heads: int, min_numel: int):
        super().__init__()
        self.heads, self.min_numel, self.count = heads, min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given and t.dim() >= 3 \
                    and t.shape[1] == self.heads and t.numel() >= self.min_numel:
                self.count += 1
        return out
