"""Feature maps phi: kernelized attention replaces ``exp(q . k)`` by ``phi(q) . phi(k)``.

* ``elu``: ``phi(x) = elu(x) + 1`` (Katharopoulos et al. 2020); ``relu``: ``relu(x)``. M = d.
* ``prf`` (Choromanski et al. 2021): ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)``, ``W (m, d)``:
  positive, ``E[phi(q) . phi(k)] = exp(q . k)``. M = m.
* ``trf``: ``phi(x) = exp(|x|^2 / 2) / sqrt(m) [cos(W x), sin(W x)]``: unbiased, signed. M = 2m.
* ``hedgehog`` (Zhang et al. 2024): ``[softmax(z), softmax(-z)]``, ``z = x W_h``, ``W_h (d, m)``
  learned per head (``query_weight (H, d, m)``, ``key_weight (H_kv, d, m)``), initialised to
  ``I_{d x m}`` (as LoLCATs). M = 2m, m = ``num_learned_features`` (default d).
* ``hedgehog_exp``: ``[exp(z - c), exp(-z - c)]``, ``c`` a query's ``max_m |z_m|`` (a constant
  for the gradient), 0 for keys.

Rows of ``W``: ``gaussian`` N(0, 1), ``orthogonal`` (orthogonal blocks with chi(d) norms:
unbiased, lower variance) or ``sphere`` (radius sqrt(d)). ``normalize_qk`` (NPRF, Luo et al.
2021) l2-normalises the inputs (approximating ``exp(q_hat . k_hat)``); otherwise the random
maps scale them by ``d ** -0.25`` (``u = x d^-1/4``) to approximate ``exp(q . k / sqrt(d))``.

Range. A per-query factor cancels in attention (``prf`` subtracts the query's max logit, ``trf``
caps its amplitude at ``exp(TRF_QUERY_MAX_LOG_AMPLITUDE)``); a per-key one does not, and a max
over keys would leak future tokens, so each key's log feature scale must stay within
L = :data:`KEY_MAX_LOG_SCALE`: ``prf``: ``max_m (w_m . u) - |u|^2/2 >= -L`` (at most ``|w|^2/2``;
keys of norm beyond about ``11 d^{1/4}`` fail, and from about ``7 d^{1/4}`` ``eps`` dominates
the denominator: the output fades towards 0); ``trf``: ``|u|^2 / 2 <= L``, i.e.
``|x| <= sqrt(2 L) d^{1/4}``; ``hedgehog_exp``: ``max_m |z_m| <= L``. A key out of range raises
``ValueError`` in eager mode; with ``normalize_qk`` every key is in range.

Projections are buffers drawn from ``seed``, redrawn in training every ``redraw_interval``
steps; a redraw installs a new tensor and recomputation gets its forward's projection, so a
redraw between a forward and its backward changes nothing.
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
    """M of a map: m (prf), 2m (trf; learned maps, m = ``num_learned_features`` or d), d (elu, relu)."""
    if feature_map == "prf":
        return num_random_features
    if feature_map == "trf":
        return 2 * num_random_features
    if feature_map in LEARNED_FEATURE_MAPS:
        return 2 * (num_learned_features or head_dim)
    return head_dim


def identity_like(heads: int, head_dim: int, width: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``(heads, d, m)``: ``I_{d x m}`` per head, the learned maps' initial weights (``dtype``
    None: torch's default)."""
    return torch.eye(head_dim, width, dtype=dtype or torch.get_default_dtype()).expand(heads, head_dim, width).clone()


def learned_feature_map_reference(x: torch.Tensor, weight: torch.Tensor, kind: str, is_query: bool,
                                  normalize_qk: bool = False) -> torch.Tensor:
    """The learned maps per head, plainly (the reference of :class:`FeatureMap`):
    ``x (B, H, N, d)``, ``weight (H or 1, d, m)`` -> ``(B, H, N, 2m)``."""
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
    """An ``(m, d)`` projection of ``kind``, drawn in float64 from a CPU ``generator`` (the same
    on every device)."""
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
            # sign-correct so Q is Haar-distributed (plain QR is not): uniform rows keep it unbiased
            qmat = qmat * torch.sign(torch.diagonal(rmat))[None, :]
            blocks.append(qmat.T[: min(remaining, head_dim)])
            remaining -= head_dim
        w = torch.cat(blocks, dim=0)
        # row norms distributed as Gaussian rows' norms: chi(d)
        norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=-1)
        return (w * norms[:, None]).to(dtype)
    raise ValueError(f"projection must be one of {list(PROJECTIONS)}, got {kind!r}")


_NORM_EPS = 1e-6  # F.normalize's eps: inputs shorter than this are divided by it instead
# L, the largest |log| of a key's feature scale per compute dtype, with margin for attention's
# sums of N * M products (e^60 = 1.1e26, e^-60 = 8.8e-27; float32's max is 3.4e38)
KEY_MAX_LOG_SCALE = {torch.float32: 60.0, torch.float64: 600.0}
TRF_QUERY_MAX_LOG_AMPLITUDE = 10.0


class PositiveRandomFeatures(torch.autograd.Function):
    """The ``prf`` map as one autograd op (not ~10 elementwise ones): ``x (B, H, N, d)``,
    ``w (m, d)`` -> ``(B, H, N, m)``, ``phi(x) = exp(w . u - |u|^2 / 2 - shift) * scale``,
    ``u = x / max(|x|, eps)`` when ``normalize`` else ``prescale * x``; ``shift``: a query's max
    logit (a constant for the gradient), 0 for keys. Saves ``x`` and ``phi``; the backward
    rebuilds ``u`` (O(N d)): ``d logits = d phi * phi``, ``d u = d logits w - u sum(d logits)``,
    then the normalisation's Jacobian ``(I - u u^T) / |x|``.
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
    """Queries or keys ``(B, H, N, d)`` -> features ``(B, H, N, M)``.

    Args:
        head_dim: d.
        feature_map: one of :data:`FEATURE_MAPS`.
        num_random_features: m of ``prf`` (M = m) and ``trf`` (M = 2m).
        projection: one of :data:`PROJECTIONS` (random maps).
        normalize_qk: l2-normalise inputs first (NPRF).
        redraw_interval: redraw every this many training steps; 0 never.
        seed: draw ``t`` uses ``seed + t``.
        num_learned_features: m of the learned maps (M = 2m); None: ``head_dim``.
        num_heads: query heads, each with its own learned weights; None: one shared weight.
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
        # counters as buffers: saved and restored with the weights
        self.register_buffer("num_draws", torch.zeros((), dtype=torch.long), persistent=True)
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long), persistent=True)

    @property
    def is_random(self) -> bool:
        return self.kind in RANDOM_FEATURE_MAPS

    @property
    def is_learned(self) -> bool:
        return self.kind in LEARNED_FEATURE_MAPS

    @property
    def num_features(self) -> int:
        """M, the size of the feature dimension."""
        return feature_size(self.kind, self.num_random_features, self.head_dim, self.num_learned_features)

    def _draw(self, index: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(self.seed + index)
        return draw_projection(self.num_random_features, self.head_dim, self.projection_kind, gen)

    @torch.no_grad()
    def init_features(self) -> None:
        """Draw 0 of ``seed`` and zero counters, written into the existing buffers (device and
        dtype kept: works after ``to_empty()`` from the meta device); a projection of another
        shape is replaced. Learned maps reset their weights to ``I_{d x m}``."""
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
        # a new tensor: a forward whose backward is pending keeps the projection it used
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
            is_query: queries get a per-position shift (keys never).
            projection: the ``(m, d)`` projection to use instead of the buffer (random maps; a
                recomputation passes its forward's).
            key_mask: ``(B, N)``, nonzero for real positions: only those are range-checked.
            sync_free: no host read (decoding): an out-of-range key gets NaN features instead of
                a ``ValueError``.
        Returns:
            ``(B, H, N, M)``, float32 at least (float64 stays float64).
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
        if is_query:  # a per-query factor cancels in attention: cap it
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
        if is_query:  # cancels in attention: the largest feature becomes 1
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
        """``result`` once the real keys' log scales (``log_scale()``, ``(B, H, N)``) are in
        ``[-L, inf)`` (``low``) or ``(-inf, L]``: else ``ValueError`` stating the norm of ``x`` (the
        keys as given), or with ``sync_free`` NaN rows."""
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
    """Advance the redraw counter of every :class:`FeatureMap` in ``model``: once per training
    forward, outside the attention forward (gradient checkpointing reruns that)."""
    if not model.training:
        return
    for module in model.modules():
        if isinstance(module, FeatureMap):
            module.step()
