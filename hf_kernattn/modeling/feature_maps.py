"""Feature maps phi for kernelized attention.

A kernel attention replaces ``exp(q . k)`` by ``phi(q) . phi(k)``. This file holds the maps:

* ``elu``  : ``phi(x) = elu(x) + 1`` (Katharopoulos et al. 2020), M = d.
* ``relu`` : ``phi(x) = relu(x)``, M = d.
* ``prf``  : positive random features (Choromanski et al. 2021),
  ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)`` with ``W`` of shape ``(m, d)``; then
  ``E[phi(q) . phi(k)] = exp(q . k)`` exactly, and every feature is positive.
* ``trf``  : trigonometric random features,
  ``phi(x) = exp(|x|^2 / 2) / sqrt(m) [cos(W x), sin(W x)]``, M = 2m (unbiased, not positive).

Random projections ``W`` come in three flavours: ``gaussian`` (i.i.d. N(0, 1) rows),
``orthogonal`` (blocks of orthogonal rows rescaled by chi(d)-distributed norms, which keeps the
estimator unbiased and lowers its variance), and ``sphere`` (rows uniform on the sphere of
radius sqrt(d)).

Scaling. With ``normalize_qk=True`` (NPRF, Luo et al. 2021) queries and keys are l2-normalised
first, so the map approximates ``exp(q_hat . k_hat)``. Otherwise inputs of the random maps are
scaled by ``d ** -0.25`` so that the map approximates softmax's ``exp(q . k / sqrt(d))``.

Stability and valid range. Queries: any norm. A per-query factor cancels between numerator
and denominator of that query, so ``prf`` subtracts ``max_m`` of the query's logits and ``trf``
caps the query's amplitude ``exp(|x|^2/2)`` at ``exp(TRF_QUERY_MAX_LOG_AMPLITUDE)`` (= e^10: no
change below it). Keys: no statistic over key positions may be used (a max over the key
sequence would leak future tokens into a causal model), and a per-key factor does not cancel,
so every key must be representable on its own. Its log-scale must stay within
:data:`KEY_MAX_LOG_SCALE` (60 in float32, 600 in float64):

* ``prf``: ``max_m (w_m . u) - |u|^2/2 >= -60``. Completing the square bounds it above by
  ``|w|^2/2``; below, it falls like ``-|u|^2/2``: with ``normalize_qk=False`` (``u = x d^-1/4``)
  keys of norm beyond about ``11 d^{1/4}`` (31 for d = 64) leave the range; already from about
  ``7 d^{1/4}`` the key features are so small that the denominator's ``eps`` dominates and the
  output fades towards 0, as the formula says.
* ``trf``: ``|u|^2 / 2 <= 60`` (its amplitude ``exp(|u|^2/2)`` would overflow float32 sums,
  and NaN follows): ``|x| <= sqrt(120) d^{1/4}`` (about 31 for d = 64).

A key outside the range raises ``ValueError`` (checked in eager mode; not while compiling or
exporting, where no data-dependent check runs). ``normalize_qk=True`` puts every input on the
unit sphere, always in range.

Learned maps (Hedgehog, Zhang et al. 2024, "The Hedgehog & the Porcupine"; the form LoLCATs
trains by attention transfer). Per head h a learned projection ``W_h`` of shape ``(d, m)``
(queries and keys have their own: ``query_weight (H, d, m)``, ``key_weight (H_kv, d, m)``),
``z = x W_h`` (after the l2 normalisation of ``normalize_qk``; no bias, no prescale: ``W`` absorbs
any scale), then a positive map of ``z`` and ``-z``, so M = 2m:

* ``hedgehog``     : ``phi(x) = [softmax(z), softmax(-z)]``, each softmax over the m features.
  The same formula for queries and keys: every feature lies in (0, 1] and each half sums to 1,
  so every input is in range. The per-row normalisation is part of the map (for keys it is no
  stabiliser: a per-key factor does not cancel).
* ``hedgehog_exp`` : ``phi(x) = [exp(z - c), exp(-z - c)]``, Hedgehog's exponential form with a
  stabiliser ``c`` that cancels between numerator and denominator. Queries: ``c = max_m |z_m|``
  of that query's row (a per-query factor; a constant for the gradient), so every query feature
  is at most 1. Keys: ``c = 0``, one constant shared by every key of every call and decoding
  step (a per-key max would not cancel, and a max over the keys would read future keys and
  change between decoding steps); a key must then satisfy ``max_m |z_m| <= KEY_MAX_LOG_SCALE``
  (60 in float32, 600 in float64), checked as for the random maps below.

Both are initialised identity-like, as LoLCATs initialises its Hedgehog maps:
``W_h = I_{d x m}`` (ones on the diagonal, zeros elsewhere), so a fresh ``hedgehog`` map with
m = d is ``[softmax(x), softmax(-x)]``. m is ``num_learned_features`` (default: d). The weights
are parameters (saved with the model, trained with it); :func:`learned_feature_map_reference`
is the plain per-head form of the same formulas.

Projections are persistent buffers (saved with the model), drawn from ``seed`` and redrawn
only in training mode, every ``redraw_interval`` calls of :meth:`FeatureMap.step` (0: never).
The draw number is a buffer too, so a reloaded model continues the same sequence of draws.
A redraw installs a new tensor rather than writing into the old one, and recomputation passes
the projection of its own forward explicitly, so a redraw between a forward and its backward
(gradient accumulation, two forwards before one backward) never changes that backward.
:meth:`FeatureMap.init_features` restores the seed's first draw and zero counters in place.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .kernels_common import full_precision

RANDOM_FEATURE_MAPS = ("prf", "trf")
LEARNED_FEATURE_MAPS = ("hedgehog", "hedgehog_exp")
FEATURE_MAPS = ("elu", "relu") + RANDOM_FEATURE_MAPS + LEARNED_FEATURE_MAPS
PROJECTIONS = ("gaussian", "orthogonal", "sphere")
# the parameters of a learned map (beside the random-feature buffers)
LEARNED_WEIGHTS = ("query_weight", "key_weight")


def check_feature_map_args(
    feature_map: str, projection: str, num_random_features: int, head_dim: int, redraw_interval: int,
    num_learned_features: Optional[int] = None,
) -> None:
    """Raise ``ValueError`` naming the bad argument and the allowed values."""
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {list(FEATURE_MAPS)}, got {feature_map!r}")
    if num_learned_features is not None and (
        isinstance(num_learned_features, bool) or not isinstance(num_learned_features, int) or num_learned_features < 1
    ):
        raise ValueError(f"num_learned_features must be None (the head size) or an int >= 1, got {num_learned_features!r}")
    if projection not in PROJECTIONS:
        raise ValueError(f"feature_projection must be one of {list(PROJECTIONS)}, got {projection!r}")
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if feature_map in RANDOM_FEATURE_MAPS and (not isinstance(num_random_features, int) or num_random_features < 1):
        raise ValueError(
            f"num_random_features must be a positive int for feature_map={feature_map!r}, got {num_random_features!r}"
        )
    if not isinstance(redraw_interval, int) or redraw_interval < 0:
        raise ValueError(f"feature_redraw_interval must be an int >= 0 (0 = never redraw), got {redraw_interval!r}")


def feature_size(feature_map: str, num_random_features: int, head_dim: int,
                 num_learned_features: Optional[int] = None) -> int:
    """M, the feature dimension a map produces: m for prf, 2m for trf, 2m for the learned maps
    (m = ``num_learned_features``, None: d), d for elu and relu."""
    if feature_map == "prf":
        return num_random_features
    if feature_map == "trf":
        return 2 * num_random_features
    if feature_map in LEARNED_FEATURE_MAPS:
        return 2 * (num_learned_features or head_dim)
    return head_dim


def identity_like(heads: int, head_dim: int, width: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``(heads, d, m)``: ``I_{d x m}`` per head, the learned maps' initial weights (``dtype``
    None: torch's default dtype, as for the other parameters a model builds)."""
    return torch.eye(head_dim, width, dtype=dtype or torch.get_default_dtype()).expand(heads, head_dim, width).clone()


def learned_feature_map_reference(x: torch.Tensor, weight: torch.Tensor, kind: str, is_query: bool,
                                  normalize_qk: bool = False) -> torch.Tensor:
    """The learned maps written plainly, one head at a time (the reference of
    :class:`FeatureMap`'s batched form): ``x (B, H, N, d)``, ``weight (H or 1, d, m)`` ->
    ``(B, H, N, 2m)``. ``hedgehog``: ``[softmax(z), softmax(-z)]``; ``hedgehog_exp``:
    ``[exp(z - c), exp(-z - c)]`` with ``c = max_m |z_m|`` for queries (detached) and 0 for keys."""
    if normalize_qk:
        x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(_NORM_EPS)
    heads = []
    for h in range(x.shape[1]):
        z = x[:, h] @ weight[h if weight.shape[0] > 1 else 0]
        if kind == "hedgehog":
            pos, neg = torch.exp(z - z.max(-1, keepdim=True).values), torch.exp(-z - (-z).max(-1, keepdim=True).values)
            heads.append(torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], dim=-1))
        elif kind == "hedgehog_exp":
            c = z.detach().abs().max(-1, keepdim=True).values if is_query else torch.zeros_like(z[..., :1])
            heads.append(torch.cat([torch.exp(z - c), torch.exp(-z - c)], dim=-1))
        else:
            raise ValueError(f"kind must be one of {list(LEARNED_FEATURE_MAPS)}, got {kind!r}")
    return torch.stack(heads, dim=1)


def draw_projection(
    num_features: int, head_dim: int, kind: str, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Draw a random projection matrix.

    Args:
        num_features: m, the number of rows.
        head_dim: d, the number of columns.
        kind: ``gaussian`` | ``orthogonal`` | ``sphere``.
        generator: a CPU generator (reproducibility does not depend on the device).
    Returns:
        ``(m, d)`` tensor on the CPU.
    """
    if kind == "gaussian":
        return torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).to(dtype)
    if kind == "sphere":
        w = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
        return (w / w.norm(dim=-1, keepdim=True) * math.sqrt(head_dim)).to(dtype)
    if kind == "orthogonal":
        blocks = []
        remaining = num_features
        while remaining > 0:
            g = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
            qmat, rmat = torch.linalg.qr(g)
            # Sign-correct so Q is Haar-distributed (plain QR output is not): rows are then
            # uniform directions, which keeps the estimator unbiased.
            qmat = qmat * torch.sign(torch.diagonal(rmat))[None, :]
            blocks.append(qmat.T[: min(remaining, head_dim)])
            remaining -= head_dim
        w = torch.cat(blocks, dim=0)
        # Row norms distributed like those of Gaussian rows: chi(d).
        norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=-1)
        return (w * norms[:, None]).to(dtype)
    raise ValueError(f"projection must be one of {list(PROJECTIONS)}, got {kind!r}")


_NORM_EPS = 1e-6  # F.normalize's eps: inputs shorter than this are divided by it instead
# The largest |log| of a key's feature scale each compute dtype represents with margin for the
# sums of attention (N * M products of query and key features times values): see the module
# docstring. e^60 = 1.1e26 and e^-60 = 8.8e-27 in float32 (max 3.4e38); e^600 in float64.
KEY_MAX_LOG_SCALE = {torch.float32: 60.0, torch.float64: 600.0}
TRF_QUERY_MAX_LOG_AMPLITUDE = 10.0


class PositiveRandomFeatures(torch.autograd.Function):
    """The ``prf`` map as one op: ``x (B, H, N, d)``, ``w (m, d)`` -> ``(B, H, N, m)``,

    ``phi(x) = exp(w . u - |u|^2 / 2 - shift) * scale`` with ``u = x / max(|x|, eps)`` when
    ``normalize`` else ``u = prescale * x``; ``shift`` is the per-position max over features
    for queries (``is_query``; a constant for the gradient, it cancels in attention) and 0 for
    keys. Only ``x`` and the output are saved; the backward rebuilds ``u`` (O(N d)) and applies
    ``d logits = d phi * phi``, ``d u = d logits w - u sum(d logits)``, then the normalisation's
    Jacobian ``(I - u u^T) / |x|``. Replaces a chain of ~10 elementwise autograd ops.
    """

    @staticmethod
    def _unit(x: torch.Tensor, normalize: bool, prescale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not normalize:
            return x * prescale, None
        length = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x / length.clamp_min(_NORM_EPS), length

    @staticmethod
    @full_precision
    def forward(ctx, x, w, normalize, prescale, is_query, scale):  # type: ignore[override]
        u, _ = PositiveRandomFeatures._unit(x, normalize, prescale)
        logits = torch.matmul(u, w.T)
        logits -= 0.5 * (u * u).sum(dim=-1, keepdim=True)
        if is_query:
            logits -= logits.amax(dim=-1, keepdim=True)
        phi = logits.exp_().mul_(scale)
        ctx.save_for_backward(x, w, phi)
        ctx.options = (normalize, prescale)
        return phi

    @staticmethod
    @full_precision
    def backward(ctx, dphi):  # type: ignore[override]
        x, w, phi = ctx.saved_tensors
        normalize, prescale = ctx.options
        u, length = PositiveRandomFeatures._unit(x, normalize, prescale)
        g = dphi * phi  # gradient of the logits
        dw = None
        if ctx.needs_input_grad[1]:
            dw = g.reshape(-1, g.shape[-1]).T @ u.reshape(-1, u.shape[-1])
        du = torch.matmul(g, w) - u * g.sum(dim=-1, keepdim=True)
        if normalize:
            radial = (u * du).sum(dim=-1, keepdim=True) * (length > _NORM_EPS)
            dx = (du - u * radial) / length.clamp_min(_NORM_EPS)
        else:
            dx = du * prescale
        return dx, dw, None, None, None, None


class FeatureMap(nn.Module):
    """Map queries or keys ``(B, H, N, d)`` to features ``(B, H, N, M)``.

    Args:
        head_dim: d.
        feature_map: one of :data:`FEATURE_MAPS`.
        num_random_features: m for ``prf``/``trf`` (M = m for prf, 2m for trf); ignored otherwise.
        projection: one of :data:`PROJECTIONS` (random maps only).
        normalize_qk: l2-normalise inputs first (NPRF).
        redraw_interval: redraw the projection every this many training steps; 0 never.
        seed: seed of the first draw; draw ``t`` uses ``seed + t``.
        num_learned_features: m of the learned maps (M = 2m); None: ``head_dim``.
        num_heads: query heads H, each with its own learned weights (learned maps only; None:
            one weight shared by every head).
        num_key_value_heads: key heads (grouped-query attention); None: ``num_heads``.
    """

    def __init__(
        self,
        head_dim: int,
        feature_map: str = "elu",
        num_random_features: int = 64,
        projection: str = "orthogonal",
        normalize_qk: bool = False,
        redraw_interval: int = 0,
        seed: int = 0,
        num_learned_features: Optional[int] = None,
        num_heads: Optional[int] = None,
        num_key_value_heads: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_feature_map_args(feature_map, projection, num_random_features, head_dim, redraw_interval,
                               num_learned_features)
        for name, value in (("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        self.head_dim = head_dim
        self.kind = feature_map
        self.num_random_features = num_random_features
        self.projection_kind = projection
        self.normalize_qk = bool(normalize_qk)
        self.redraw_interval = redraw_interval
        self.seed = int(seed)
        self.num_learned_features = num_learned_features or head_dim
        if self.is_learned:
            q_heads = num_heads or 1
            k_heads = (num_key_value_heads or num_heads or 1) if num_heads else 1
            self.query_weight = nn.Parameter(identity_like(q_heads, head_dim, self.num_learned_features))
            self.key_weight = nn.Parameter(identity_like(k_heads, head_dim, self.num_learned_features))
        if self.is_random:
            self.register_buffer("projection", self._draw(0), persistent=True)
        else:
            self.register_buffer("projection", None, persistent=False)
        # Counters as buffers so they are saved and restored with the weights.
        self.register_buffer("num_draws", torch.zeros((), dtype=torch.long), persistent=True)
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long), persistent=True)

    @property
    def is_random(self) -> bool:
        return self.kind in RANDOM_FEATURE_MAPS

    @property
    def is_learned(self) -> bool:
        return self.kind in LEARNED_FEATURE_MAPS

    @property
    def same_for_queries_and_keys(self) -> bool:
        """Whether queries and keys are mapped alike (``elu``, ``relu``: no query shift, no key
        range, no separate weights), so one call can map them stacked."""
        return self.kind in ("elu", "relu")

    @property
    def num_features(self) -> int:
        """M, the size of the feature dimension."""
        return feature_size(self.kind, self.num_random_features, self.head_dim, self.num_learned_features)

    def _draw(self, index: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(self.seed + index)
        return draw_projection(self.num_random_features, self.head_dim, self.projection_kind, gen)

    @torch.no_grad()
    def init_features(self) -> None:
        """Initialise the random-feature state deterministically: the projection becomes draw 0
        of ``seed`` (what a freshly built map holds) and both counters restart at 0.

        Writes into the existing buffers in place (under ``torch.no_grad``), keeping their
        device and dtype, so it works after ``to_empty()`` on a model built on the meta device
        and on buffers left holding uninitialised memory. A projection buffer of another shape
        (e.g. loaded with mismatched sizes) is replaced by one of the right shape. Learned maps
        set their weights to ``I_{d x m}`` per head (in place). Deterministic maps (``elu``,
        ``relu``) only reset the counters.
        """
        if self.is_learned:
            for weight in (self.query_weight, self.key_weight):
                weight.copy_(identity_like(weight.shape[0], weight.shape[1], weight.shape[2]).to(dtype=weight.dtype))
        if self.is_random:
            w = self._draw(0)
            p = self.projection
            if p is not None and tuple(p.shape) == tuple(w.shape):
                p.copy_(w.to(dtype=p.dtype))  # copies from the CPU onto p's device (a no-op on meta)
            else:
                device = p.device if p is not None else None
                dtype = p.dtype if p is not None and p.is_floating_point() else w.dtype
                self.projection = w.to(device=device, dtype=dtype)
        self.num_draws.zero_()
        self.num_steps.zero_()

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw the next projection of the seeded sequence (random maps only)."""
        if not self.is_random:
            return
        self.num_draws += 1
        w = self._draw(int(self.num_draws))
        # A new tensor, never an in-place write: a forward whose backward is still outstanding
        # (gradient accumulation; recomputation in the backward pass) keeps the projection it used.
        self.projection = w.to(device=self.projection.device, dtype=self.projection.dtype)

    @torch.no_grad()
    def step(self) -> None:
        """Count one training step; redraw when the interval is reached. No-op in eval mode."""
        if not self.training or not self.is_random or self.redraw_interval == 0:
            return
        self.num_steps += 1
        if int(self.num_steps) % self.redraw_interval == 0:
            self.redraw()

    def extra_repr(self) -> str:
        if self.is_learned:
            return (f"kind={self.kind}, head_dim={self.head_dim}, num_features={self.num_features}, "
                    f"heads={self.query_weight.shape[0]}/{self.key_weight.shape[0]}, normalize_qk={self.normalize_qk}")
        return (
            f"kind={self.kind}, head_dim={self.head_dim}, num_features={self.num_features}, "
            f"projection={self.projection_kind if self.is_random else None}, normalize_qk={self.normalize_qk}, "
            f"redraw_interval={self.redraw_interval}"
        )

    @full_precision
    def forward(
        self,
        x: torch.Tensor,
        is_query: bool,
        projection: Optional[torch.Tensor] = None,
        key_mask: Optional[torch.Tensor] = None,
        sync_free: bool = False,
    ) -> torch.Tensor:
        """Args:
            x: ``(B, H, N, d)`` queries or keys.
            is_query: queries get a per-position stabilising shift (keys never do).
            projection: the ``(m, d)`` projection to use instead of the current buffer (random
                maps only). A recomputation in the backward pass passes the tensor its forward
                used, so a redraw in between (which installs a new tensor) cannot change it.
            key_mask: ``(B, N)``, nonzero for real positions: only those keys are checked
                against the valid range (padding may hold anything).
            sync_free: check the keys without reading values on the host (decoding steps): a
                key outside the valid range gets NaN features, so every output that reads it
                is NaN, instead of a ``ValueError`` that would need a host synchronisation.
        Returns:
            ``(B, H, N, M)`` features, in float32 at least (float64 stays float64).
        """
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"feature map expects last dim head_dim={self.head_dim}, got shape {tuple(x.shape)}")
        compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if x.dtype != compute_dtype:
            x = x.to(compute_dtype)
        if projection is None:
            projection = self.projection
        elif self.is_random and tuple(projection.shape) != (self.num_random_features, self.head_dim):
            raise ValueError(
                f"projection must have shape (num_random_features, head_dim) = "
                f"({self.num_random_features}, {self.head_dim}), got {tuple(projection.shape)}"
            )
        if self.kind == "prf":
            w = projection.to(device=x.device, dtype=compute_dtype)
            scale = self.num_random_features ** -0.5
            phi = PositiveRandomFeatures.apply(x, w, self.normalize_qk, self.head_dim ** -0.25, is_query, scale)
            if not is_query:
                # log-scale of each key: its largest logit (-inf where every feature underflowed)
                phi = self._check_key_range(
                    lambda: torch.log(phi.detach().amax(dim=-1) / scale), x, compute_dtype, True, key_mask, phi, sync_free
                )
            return phi
        if self.is_learned:
            return self._learned(x, is_query, compute_dtype, key_mask, sync_free)
        if self.normalize_qk:
            x = F.normalize(x, p=2.0, dim=-1, eps=_NORM_EPS)
        if self.kind == "elu":
            return F.elu(x) + 1.0
        if self.kind == "relu":
            return F.relu(x)
        keys = x  # the keys as given: the range error states their norm, not that of u
        if not self.normalize_qk:
            x = x * self.head_dim ** -0.25
        # trf
        proj = x @ projection.to(device=x.device, dtype=compute_dtype).T  # (B, H, N, m)
        log_amp = 0.5 * (x * x).sum(dim=-1, keepdim=True)
        if is_query:  # a per-query factor cancels in attention: cap it (no change below the cap)
            log_amp = log_amp.clamp(max=TRF_QUERY_MAX_LOG_AMPLITUDE)
        else:
            log_amp = self._check_key_range(lambda: log_amp.detach()[..., 0], keys, compute_dtype, False, key_mask,
                                            log_amp, sync_free)
        amp = torch.exp(log_amp) * self.num_random_features ** -0.5
        return torch.cat([torch.cos(proj), torch.sin(proj)], dim=-1) * amp

    def _learned(self, x: torch.Tensor, is_query: bool, dtype: torch.dtype, key_mask: Optional[torch.Tensor],
                 sync_free: bool) -> torch.Tensor:
        """The learned maps (module docstring): ``x (B, H, N, d)`` -> ``(B, H, N, 2m)``."""
        weight = self.query_weight if is_query else self.key_weight
        if weight.shape[0] not in (1, x.shape[1]):
            raise ValueError(
                f"the learned {'query' if is_query else 'key'} weights of feature_map={self.kind!r} serve "
                f"{weight.shape[0]} heads, the input has {x.shape[1]} (shape {tuple(x.shape)})"
            )
        keys = x
        if self.normalize_qk:
            x = F.normalize(x, p=2.0, dim=-1, eps=_NORM_EPS)
        z = torch.matmul(x, weight.to(device=x.device, dtype=dtype))  # (B, H, N, d) @ (H, d, m)
        if self.kind == "hedgehog":
            return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)
        if is_query:  # a per-query factor cancels in attention: the largest feature becomes 1
            z_pos = z - z.detach().abs().amax(dim=-1, keepdim=True)
            z_neg = -z - z.detach().abs().amax(dim=-1, keepdim=True)
            return torch.cat([torch.exp(z_pos), torch.exp(z_neg)], dim=-1)
        phi = torch.cat([torch.exp(z), torch.exp(-z)], dim=-1)
        return self._check_key_range(lambda: z.detach().abs().amax(dim=-1), keys, dtype, False, key_mask, phi,
                                     sync_free, rule="max_m |(W x)_m| <= {limit:g}")

    def _check_key_range(
        self, log_scale, x: torch.Tensor, dtype: torch.dtype, low: bool, key_mask: Optional[torch.Tensor],
        result: torch.Tensor, sync_free: bool = False, rule: Optional[str] = None,
    ) -> torch.Tensor:
        """``result`` after checking the real keys' log feature scales (``log_scale()``,
        ``(B, H, N)``) against ``[-limit, +inf)`` (``low``, prf) or ``(-inf, limit]`` (trf):
        ``ValueError`` for a key outside (eager mode), or with ``sync_free`` ``result`` with
        NaN in the rows of such keys (no host synchronisation). ``x``: the keys as the caller
        gave them (before any scaling), whose norm the error states."""
        if torch.compiler.is_compiling():
            return result
        limit = KEY_MAX_LOG_SCALE[dtype]
        values = log_scale()
        bad = values < -limit if low else values > limit
        if isinstance(key_mask, torch.Tensor) and key_mask.dim() == 2 and tuple(key_mask.shape) == (x.shape[0], x.shape[2]):
            bad = bad & (key_mask != 0).to(bad.device)[:, None, :]
        if sync_free:
            return torch.where(bad[..., None], torch.full((), math.nan, dtype=result.dtype, device=result.device), result)
        if not bool(bad.any()):
            return result
        worst = float(values.min() if low else values.max())
        norm = float(torch.linalg.vector_norm(x.detach(), dim=-1)[bad].max())
        d = self.head_dim
        if rule is not None:  # a learned map: the range depends on the learned key weights
            raise ValueError(
                f"feature_map={self.kind!r} cannot represent a key of norm {norm:.3g} in "
                f"{str(dtype).replace('torch.', '')}: its log feature scale max_m |(W x)_m| is {worst:.4g} (W: the "
                f"learned key weights), the valid range is {rule.format(limit=limit)}. Use normalize_qk=True, "
                "keep the keys or the learned key weights smaller, or use feature_map='hedgehog' (softmax-normalised "
                "features: every key is in range)."
            )
        rule = (
            f"max_m (w_m . u) - |u|^2/2 >= -{limit:g}" if low else f"|u|^2/2 <= {limit:g}"
        )
        raise ValueError(
            f"feature_map={self.kind!r} cannot represent a key of norm {norm:.3g} in {str(dtype).replace('torch.', '')}: "
            f"its log feature scale is {worst:.4g}{'' if math.isfinite(worst) else ' (every feature underflows)'}, "
            f"the valid range is {rule} with u = x * d**-0.25 "
            f"(normalize_qk=False), i.e. key norms up to about {math.sqrt(2 * limit) * d ** 0.25:.3g} for head_dim={d}. "
            "Use normalize_qk=True, keep the key projections smaller, or use feature_map='elu'."
        )


def feature_maps_step(model: nn.Module) -> None:
    """Advance the redraw counter of every :class:`FeatureMap` inside ``model``.

    Models call this once per forward in training mode (not inside the attention forward:
    gradient checkpointing re-runs that, and a redraw between the two runs would be wrong).
    """
    if not model.training:
        return
    for module in model.modules():
        if isinstance(module, FeatureMap):
            module.step()
