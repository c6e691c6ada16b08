"""Relative positions: the kernels' log-coefficients ``rpe_bias`` (``c_r = exp(b_r)``, ``r = j - i``)
and position features.

* :class:`RelativePositionBias1D`: a learnable ``b_r`` per head for ``|r| <= K``
  (``max_relative_position``); further offsets are clipped to ``+-K`` (Shaw et al. 2018), which
  defines the bias at any length. One table per model (Luo et al. 2021) or per layer.
  :class:`RelativePositionBias2D`: the same per grid axis.
* :class:`ManhattanDistanceBias`: ``b_{min(|dy| + |dx|, K)}`` on some heads (Horn et al. 2021,
  strategy 2).
* :class:`RotaryPositionFeatures`: their strategy 1, position features whose dot product depends
  only on the offset.

The kernels take ``(H, 2N-1)`` (1D, entry ``r + N - 1`` holds ``b_r``) or ``(H, 2Hg-1, 2Wg-1)`` (2D).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .kernels_common import is_size, manhattan_table


def rotary_cos_sin(position_ids: torch.Tensor, dim: int, base: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(B, 1, N, dim // 2)`` for positions ``(B, N)``: angles
    ``position * base ** (-2i / dim)`` (RoFormer / Llama frequencies), computed in float64."""
    inv_freq = base ** (-torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float64) / dim)
    angles = position_ids.to(torch.float64)[..., None] * inv_freq  # (B, N, dim/2)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + M/2])`` of ``x (B, H, N, M)`` by the angles
    (the half-split pairing of Llama's ``rotate_half``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# named for what is learned: "learned" is the 1D table (NPRF-BERT, Linear GPT); the rest are the ViT's options
RPE_KINDS = ("none", "learned", "learned_2d", "manhattan", "rotary_features", "absolute")


def check_rpe_args(rpe: str, max_relative_position: int) -> None:
    """``ValueError`` naming the bad argument and what is allowed."""
    if rpe not in RPE_KINDS:
        raise ValueError(f"rpe must be one of {list(RPE_KINDS)}, got {rpe!r}")
    if rpe != "none" and (
        not isinstance(max_relative_position, int) or isinstance(max_relative_position, bool) or max_relative_position < 1
    ):
        raise ValueError(f"max_relative_position must be a positive int when rpe={rpe!r}, got {max_relative_position!r}")


def clipped_offsets(n: int, max_relative_position: int, device=None) -> torch.Tensor:
    """Table indices for offsets ``-(n-1) .. n-1``: ``clamp(r, -K, K) + K``, shape ``(2n-1,)``."""
    r = torch.arange(-(n - 1), n, device=device)
    return r.clamp(-max_relative_position, max_relative_position) + max_relative_position


class RelativePositionBias1D(nn.Module):
    """Learnable per-head bias over clipped 1D offsets.

    Args:
        num_heads: H.
        max_relative_position: K; the table has ``2K + 1`` entries per head.
        init_std: std of the normal init (0 gives an all-zero bias: plain kernel attention).
    """

    def __init__(self, num_heads: int, max_relative_position: int, init_std: float = 0.0) -> None:
        super().__init__()
        check_rpe_args("learned", max_relative_position)
        self.num_heads = num_heads
        self.max_relative_position = max_relative_position
        self.weight = nn.Parameter(torch.zeros(num_heads, 2 * max_relative_position + 1))
        if init_std > 0:
            nn.init.normal_(self.weight, std=init_std)

    def forward(self, seq_len: int) -> torch.Tensor:
        """Returns ``rpe_bias`` of shape ``(H, 2 * seq_len - 1)``."""
        if not is_size(seq_len) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        return self.weight[:, clipped_offsets(seq_len, self.max_relative_position, self.weight.device)]

    def offset_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """Bias for arbitrary offsets ``r = j - i`` (any shape ``S``): ``(H, *S)``."""
        k = self.max_relative_position
        return self.weight[:, offsets.clamp(-k, k) + k]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_relative_position={self.max_relative_position}"


class RelativePositionBias2D(nn.Module):
    """Learnable per-head bias over clipped 2D offsets ``(dy, dx)`` on a token grid.

    Args:
        num_heads: H.
        max_relative_position: K per axis; the table is ``(H, 2K + 1, 2K + 1)``.
        init_std: std of the normal init.
    """

    def __init__(self, num_heads: int, max_relative_position: int, init_std: float = 0.0) -> None:
        super().__init__()
        check_rpe_args("learned_2d", max_relative_position)
        self.num_heads = num_heads
        self.max_relative_position = max_relative_position
        size = 2 * max_relative_position + 1
        self.weight = nn.Parameter(torch.zeros(num_heads, size, size))
        if init_std > 0:
            nn.init.normal_(self.weight, std=init_std)

    def forward(self, grid_height: int, grid_width: int) -> torch.Tensor:
        """Returns ``rpe_bias`` of shape ``(H, 2 * grid_height - 1, 2 * grid_width - 1)``."""
        for name, value in (("grid_height", grid_height), ("grid_width", grid_width)):
            if not is_size(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        iy = clipped_offsets(grid_height, self.max_relative_position, self.weight.device)
        ix = clipped_offsets(grid_width, self.max_relative_position, self.weight.device)
        return self.weight[:, iy[:, None], ix[None, :]]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_relative_position={self.max_relative_position}"


class ManhattanDistanceBias(nn.Module):
    """Learnable bias ``b_{min(|dy| + |dx|, K)}`` per head on a token grid, on the first
    ``relative_heads`` heads; the other heads get no bias (content only).

    Args:
        num_heads: H.
        max_distance: K; distances >= K share the last entry.
        relative_heads: heads with the bias (default: half of them, at least one).
    """

    def __init__(self, num_heads: int, max_distance: int, relative_heads: Optional[int] = None) -> None:
        super().__init__()
        relative_heads = max(1, num_heads // 2) if relative_heads is None else relative_heads
        if not isinstance(max_distance, int) or isinstance(max_distance, bool) or max_distance < 0:
            raise ValueError(f"max_distance must be an int >= 0, got {max_distance!r}")
        if not isinstance(relative_heads, int) or not 1 <= relative_heads <= num_heads:
            raise ValueError(f"relative_heads must be an int in [1, num_heads={num_heads}], got {relative_heads!r}")
        self.num_heads, self.max_distance, self.relative_heads = num_heads, max_distance, relative_heads
        self.weight = nn.Parameter(torch.zeros(relative_heads, max_distance + 1))

    def distances(self) -> torch.Tensor:
        """``(H, K+1)``: the learned rows, then zeros for the content-only heads."""
        rest = self.weight.new_zeros(self.num_heads - self.relative_heads, self.max_distance + 1)
        return torch.cat([self.weight, rest], dim=0)

    def forward(self, grid_height: int, grid_width: int) -> torch.Tensor:
        """Returns ``rpe_bias`` of shape ``(H, 2 * grid_height - 1, 2 * grid_width - 1)``."""
        return manhattan_table(self.distances(), grid_height, grid_width)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_distance={self.max_distance}, relative_heads={self.relative_heads}"


class RotaryPositionFeatures(nn.Module):
    """Position features whose query-key dot product depends only on the offset.

    For grid coordinate ``p`` (y or x) and learned length scale ``s`` the key side is
    ``u = [cos(p / s), sin(p / s)]``, the query side ``R u`` with a learned
    ``R = [[a, b], [-b, a]]`` per head, axis and scale: ``R u_i . u_j = a cos((p_i - p_j) / s) +
    b sin((p_i - p_j) / s)``, and the norms ``|u| = 1``, ``|R u|^2 = a^2 + b^2`` do not depend on
    the position.

    Args:
        num_heads: H.
        num_scales: L length scales per axis; the features have ``4 L`` entries.
        max_scale: the scales start log-spaced from 1 to ``max_scale`` patches.
    """

    def __init__(self, num_heads: int, num_scales: int, max_scale: float = 16.0) -> None:
        super().__init__()
        if not isinstance(num_scales, int) or isinstance(num_scales, bool) or num_scales < 1:
            raise ValueError(f"num_scales must be a positive int, got {num_scales!r}")
        self.num_heads, self.num_scales, self.max_scale = num_heads, num_scales, float(max_scale)
        self.log_scales = nn.Parameter(torch.zeros(2, num_scales))  # (axis, scale)
        self.rotation = nn.Parameter(torch.zeros(num_heads, 2, num_scales, 2))  # (a, b) per head, axis, scale
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Scales log-spaced over ``[1, max_scale]``; rotations the identity (a = 1, b = 0)."""
        steps = torch.linspace(0.0, math.log(self.max_scale), self.num_scales)
        self.log_scales.copy_(steps.expand(2, -1))
        self.rotation.zero_()
        self.rotation[..., 0] = 1.0

    @property
    def num_features(self) -> int:
        return 4 * self.num_scales

    def forward(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``coords (N, 2)`` float grid positions (y, x) -> query features ``(H, N, 4L)`` and key
        features ``(1, N, 4L)``."""
        angles = coords[:, :, None] / torch.exp(self.log_scales)[None]  # (N, axis, L)
        cos, sin = angles.cos(), angles.sin()
        a, b = self.rotation[..., 0], self.rotation[..., 1]  # (H, axis, L)
        key = torch.stack([cos, sin], dim=-1)  # (N, axis, L, 2)
        query = torch.stack([a[:, None] * cos + b[:, None] * sin, -b[:, None] * cos + a[:, None] * sin], dim=-1)
        n = coords.shape[0]
        return query.reshape(self.num_heads, n, -1), key.reshape(1, n, -1)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_scales={self.num_scales}"
