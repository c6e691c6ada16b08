"""Relative-position parameterisations producing the Toeplitz log-coefficients ``rpe_bias``.

A learnable per-head scalar ``b_r`` for each offset ``r = j - i`` in
``[-max_relative_position, max_relative_position]`` (Luo et al. 2021 use one such table shared
by all layers; :class:`RelativePositionBias1D` can equally be built once per layer). Offsets
beyond the table are clipped to its last entry (Shaw et al. 2018), which defines the bias for
any sequence length: a model trained on short sequences runs on longer ones with the far
offsets sharing one weight. The 2D table does the same per axis on a token grid.

The attention kernels consume the bias as ``(H, 2N-1)`` (1D) or ``(H, 2Hg-1, 2Wg-1)`` (2D):
entry ``r + N - 1`` holds ``b_r`` (see DESIGN.md).
"""

from __future__ import annotations

import torch
from torch import nn

RPE_KINDS = ("none", "learned", "learned_2d")


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
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        return self.weight[:, clipped_offsets(seq_len, self.max_relative_position, self.weight.device)]

    def offset_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """Bias for arbitrary offsets ``r = j - i`` (any shape ``S``): ``(H, *S)``. Used in decoding."""
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
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        iy = clipped_offsets(grid_height, self.max_relative_position, self.weight.device)
        ix = clipped_offsets(grid_width, self.max_relative_position, self.weight.device)
        return self.weight[:, iy[:, None], ix[None, :]]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_relative_position={self.max_relative_position}"
