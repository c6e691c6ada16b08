"""The relative-performer ViT: a Vision Transformer with kernelized attention and relative positions.

Patches become tokens on an ``(Hg, Wg)`` grid; pre-LN layers use :class:`KernelizedSelfAttention`
with the positions ``config.rpe`` names (a 2D bias, rotary features, an absolute table or none;
see the config). The relative options take any image size that is a multiple of ``patch_size``
and, with mean pooling, predict the same for content moved by whole patches (up to border
effects; ``"rotary_features"`` in expectation over its random features). With ``pooling="cls"``
and a grid bias the class token sits on an extra row above the grid's first column (the rest of
the row is padding), so the bias keeps a grid.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from .kernels_manhattan import manhattan_attention  # noqa: F401  (registers the manhattan backend)
from .attention import KernelizedSelfAttention
from .configuration_relative_performer_vit import RelativePerformerViTConfig
from .feature_maps import FeatureMap, feature_maps_step
from .positional import ManhattanDistanceBias, RelativePositionBias2D, RotaryPositionFeatures
from .pretrained import HiddenStates, KernelizedPreTrainedModel, classification_loss, eager_checks, refuse_output_attentions

GRID_BIASES = ("learned_2d", "manhattan")


def check_pixel_values(pixel_values: object, config: RelativePerformerViTConfig) -> tuple[int, int]:
    """The patch grid ``(Hg, Wg)`` of a float ``(batch, num_channels, height, width)`` tensor with
    sides multiples of the patch size; ``TypeError`` / ``ValueError`` otherwise."""
    c, p = config.num_channels, config.patch_size
    want = f"(batch, num_channels={c}, height, width) with height and width multiples of patch_size={p}"
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"pixel_values must be a torch.Tensor of shape {want}, got {type(pixel_values).__name__}")
    if pixel_values.dim() != 4:
        raise ValueError(f"pixel_values must have shape {want}, got {tuple(pixel_values.shape)}")
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be a floating-point tensor (as image processors return) of shape {want}, "
                         f"got {pixel_values.dtype}")
    b, channels, h, w = pixel_values.shape
    if b < 1:
        raise ValueError(f"pixel_values must hold at least one image, got shape {tuple(pixel_values.shape)}")
    if channels != c:
        raise ValueError(f"pixel_values must have shape {want}: got {channels} channels")
    if h < p or w < p or h % p or w % p:
        raise ValueError(f"pixel_values must have shape {want}: got {h} x {w}")
    return h // p, w // p


def hide_padded_pixels(pixel_values: torch.Tensor, keep: Optional[torch.Tensor], grid: tuple[int, int]) -> torch.Tensor:
    """``pixel_values`` with the pixels of padded patches (``keep (B, Hg * Wg)`` 0) zeroed by
    ``torch.where``, so NaN or inf there reaches no real output and no gradient (a product would
    not: ``0 * NaN`` is NaN)."""
    if keep is None:
        return pixel_values
    b, c, h, w = pixel_values.shape
    tiles = pixel_values.reshape(b, c, grid[0], h // grid[0], grid[1], w // grid[1])
    real = keep.bool().reshape(b, 1, grid[0], 1, grid[1], 1)
    return torch.where(real, tiles, tiles.new_zeros(())).reshape(b, c, h, w)


class RelativePerformerViTEmbeddings(nn.Module):
    """Patches -> tokens ``(B, Hg * Wg, C)`` (a strided convolution), plus the absolute table for
    ``rpe="absolute"`` and the class token for ``pooling="cls"`` (prepended by the model)."""

    def __init__(self, config: RelativePerformerViTConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embeddings = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.grid = config.image_size // config.patch_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if config.pooling == "cls" else None
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, self.grid * self.grid, config.hidden_size)) if config.rpe == "absolute" else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def absolute_positions(self, grid: tuple[int, int], interpolate: bool) -> torch.Tensor:
        """The absolute table for a ``grid`` (bicubic interpolation of the trained one when the
        grid differs and ``interpolate``; ``ValueError`` when it differs otherwise)."""
        table = self.position_embeddings
        if grid == (self.grid, self.grid):
            return table
        if not interpolate:
            side = self.grid * self.config.patch_size
            raise ValueError(
                f"rpe='absolute' has a position table for {side} x {side} images; got a patch grid of {grid[0]} x "
                f"{grid[1]}: pass interpolate_pos_encoding=True to interpolate it, or use a relative position option"
            )
        square = table.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
        resized = nn.functional.interpolate(square.float(), size=grid, mode="bicubic", align_corners=False)
        return resized.to(table.dtype).permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)

    def forward(
        self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Checked ``pixel_values`` -> patch tokens ``(B, Hg * Wg, C)`` and the class token
        ``(B, 1, C)`` or None (the model places it). Reads all its parameters here: FSDP2 gathers
        them only around a module's forward."""
        x = self.patch_embeddings(pixel_values.to(self.patch_embeddings.weight.dtype))
        grid = (x.shape[-2], x.shape[-1])
        x = x.flatten(2).transpose(1, 2)
        if self.position_embeddings is not None:
            x = x + self.absolute_positions(grid, interpolate_pos_encoding)
        token = None if self.cls_token is None else self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype)
        return self.dropout(x), token


class RelativePerformerViTPositions(nn.Module):
    """What one layer's attention receives for ``config.rpe``: a 2D bias with its grid (and
    ``rpe_clip`` for the Manhattan bias), or rotary position features; nothing otherwise."""

    def __init__(self, config: RelativePerformerViTConfig) -> None:
        super().__init__()
        self.kind = config.rpe
        heads, k = config.num_attention_heads, config.max_relative_position
        self.table: Optional[nn.Module] = None
        if self.kind == "learned_2d":
            self.table = RelativePositionBias2D(heads, k)
        elif self.kind == "manhattan":
            self.table = ManhattanDistanceBias(heads, k, config.relative_heads)
        elif self.kind == "rotary_features":
            self.table = RotaryPositionFeatures(heads, config.position_scales)

    def forward(self, grid: tuple[int, int], cls: bool, device) -> dict:
        """Keyword arguments for :class:`KernelizedSelfAttention` on the token layout of the
        model (see :meth:`RelativePerformerViTModel.layout`)."""
        if self.kind in GRID_BIASES:
            rows = grid[0] + (1 if cls else 0)
            if self.kind == "manhattan":  # the per-distance table itself: the core expands it only where a backend needs it
                return {"rpe_bias": self.table.distances(), "grid": (rows, grid[1]), "rpe_clip": self.table.max_distance}
            return {"rpe_bias": self.table(rows, grid[1]), "grid": (rows, grid[1])}
        if self.kind == "rotary_features":
            y, x = torch.meshgrid(torch.arange(grid[0], device=device), torch.arange(grid[1], device=device), indexing="ij")
            coords = torch.stack([y.flatten(), x.flatten()], dim=-1).to(self.table.log_scales.dtype)
            query, key = self.table(coords)
            if cls:  # the class token has no position: zero features on both sides
                query = nn.functional.pad(query, (0, 0, 1, 0))
                key = nn.functional.pad(key, (0, 0, 1, 0))
            return {"extra": (query[None], key[None])}
        return {}


class RelativePerformerViTLayer(GradientCheckpointingLayer):
    """Pre-LN encoder layer: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: RelativePerformerViTConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = config.rpe == "rotary_features"
        self.layernorm_before = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = KernelizedSelfAttention(
            config, layer_idx=layer_idx, extra_features=4 * config.position_scales if rotary else 0
        )
        self.positions = None if config.rpe_shared_across_layers else RelativePerformerViTPositions(config)
        self.layernorm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor], grid: tuple[int, int],
                cls: bool, shared_positions: Optional[dict] = None,
                projection: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``shared_positions``: the model's position inputs when one table serves every layer;
        otherwise the layer's own, computed here (inside its forward, for FSDP2)."""
        recompute = False if self.gradient_checkpointing and self.training else None
        if shared_positions is not None:
            positions = shared_positions
        else:
            positions = self.positions(grid, cls, hidden_states.device) if self.positions is not None else {}
        attn = self.attention(self.layernorm_before(hidden_states), attention_mask=attention_mask, recompute=recompute,
                              projection=projection, **positions)
        hidden_states = hidden_states + self.dropout(attn)
        mlp = self.output(self.act(self.intermediate(self.layernorm_after(hidden_states))))
        return hidden_states + self.dropout(mlp)


class RelativePerformerViTPreTrainedModel(KernelizedPreTrainedModel):
    """Weight init for every relative-performer ViT class: ViT's truncated normal; bias tables at
    zero (normal with ``rpe_init_std > 0``); rotary scales log-spaced, rotations the identity;
    projections draw 0 of ``feature_seed``."""

    config_class = RelativePerformerViTConfig
    config: RelativePerformerViTConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    _no_split_modules = ["RelativePerformerViTLayer"]
    lora_mlp_modules = ("intermediate", "output")  # LoRA targets of the MLP (see lora_target_modules)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        self._init_window_weights(module)
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            init.trunc_normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, RelativePerformerViTEmbeddings):
            for param in (module.cls_token, module.position_embeddings):
                if param is not None:
                    init.trunc_normal_(param, mean=0.0, std=std)
        elif isinstance(module, (RelativePositionBias2D, ManhattanDistanceBias)):
            if self.config.rpe_init_std > 0:
                init.normal_(module.weight, mean=0.0, std=self.config.rpe_init_std)
            else:
                init.zeros_(module.weight)
        elif isinstance(module, RotaryPositionFeatures):
            if not getattr(module.log_scales, "_is_hf_initialized", False):
                module.reset_parameters()
        elif isinstance(module, FeatureMap):
            self._init_feature_map(module)


class RelativePerformerViTModel(RelativePerformerViTPreTrainedModel):
    """The encoder: ``pixel_values (B, C_in, H, W)`` -> ``last_hidden_state (B, [1 +] Hg Wg, C)``
    (the class token first with ``pooling="cls"``) and ``pooler_output (B, C)`` (the mean of
    the patch tokens, or the class token), after the final LayerNorm."""

    def __init__(self, config: RelativePerformerViTConfig) -> None:
        super().__init__(config)
        self.embeddings = RelativePerformerViTEmbeddings(config)
        self.positions = RelativePerformerViTPositions(config) if config.rpe_shared_across_layers else None
        self.layers = nn.ModuleList([RelativePerformerViTLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Conv2d:
        return self.embeddings.patch_embeddings

    def layout(
        self, patches: torch.Tensor, grid: tuple[int, int], keep: Optional[torch.Tensor],
        token: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The layers' token sequence and padding mask (None: nothing padded): the patches, after
        the class token ``token (B, 1, C)`` if any (with a grid bias on an extra first row padded
        to the grid's width). ``keep (B, Hg * Wg)``: 0 for padded patches."""
        b = patches.shape[0]
        if token is None:
            return patches, keep
        if self.config.rpe not in GRID_BIASES:
            ones = torch.ones(b, 1, dtype=torch.long, device=patches.device)
            return torch.cat([token, patches], dim=1), None if keep is None else torch.cat([ones, keep], dim=1)
        # the token and grid width - 1 padding tokens, by padding: a dynamic width (torch.export) needs no case
        row = nn.functional.pad(token, (0, 0, 0, grid[1] - 1))
        row_keep = (torch.arange(grid[1], device=patches.device) == 0).long().expand(b, -1)
        rest = torch.ones(b, grid[0] * grid[1], dtype=torch.long, device=patches.device) if keep is None else keep
        return torch.cat([row, patches], dim=1), torch.cat([row_keep, rest], dim=1)

    def patch_keep(self, patch_mask: object, b: int, grid: tuple[int, int], device) -> Optional[torch.Tensor]:
        """``patch_mask`` -> ``(B, Hg * Wg)`` long 1 (real) / 0 (padding), or None."""
        if patch_mask is None:
            return None
        want = f"(batch, grid_height, grid_width) = ({b}, {grid[0]}, {grid[1]}) or (batch, {grid[0] * grid[1]})"
        if not isinstance(patch_mask, torch.Tensor):
            raise TypeError(f"patch_mask must be a torch.Tensor of shape {want}, got {type(patch_mask).__name__}")
        if tuple(patch_mask.shape) not in ((b, grid[0], grid[1]), (b, grid[0] * grid[1])):
            raise ValueError(f"patch_mask must have shape {want} with 1 = real patch and 0 = padding, "
                             f"got {tuple(patch_mask.shape)}")
        keep = patch_mask.reshape(b, -1).to(device)
        if eager_checks():
            if patch_mask.dtype != torch.bool and bool(((keep != 0) & (keep != 1)).any()):
                raise ValueError("patch_mask must hold only 1 (real patch) and 0 (padding)")
            if not bool(keep.bool().any(dim=1).all()):
                raise ValueError("patch_mask leaves an image without any real patch")
        return keep.long()

    def forward(
        self,
        pixel_values: Optional[torch.Tensor] = None,
        patch_mask: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        interpolate_pos_encoding: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPooling, tuple]:
        """Args:
            pixel_values: ``(B, num_channels, H, W)``, H and W multiples of ``patch_size``.
            patch_mask: ``(B, H / patch_size, W / patch_size)`` (or flattened), 1 real patch, 0
                padding: padded patches are neither attended to nor pooled and their pixels are
                zeroed first (NaN, inf there reach no real output); their outputs are unspecified.
            output_hidden_states: also return every layer's input and the final output.
            interpolate_pos_encoding: with ``rpe="absolute"``, interpolate the position table for
                images of another size (otherwise they raise ``ValueError``).
            output_attentions: must be False/None (no attention weights).
        Returns:
            :class:`BaseModelOutputWithPooling`.
        """
        cfg = self.config
        refuse_output_attentions("relative-performer ViT", output_attentions, cfg)
        if pixel_values is None:
            raise ValueError("pixel_values is required: (batch, num_channels, height, width)")
        return_dict = cfg.return_dict if return_dict is None else return_dict
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        grid = check_pixel_values(pixel_values, cfg)
        keep = self.patch_keep(patch_mask, pixel_values.shape[0], grid, pixel_values.device)
        pixel_values = hide_padded_pixels(pixel_values, keep, grid)
        patches, token = self.embeddings(pixel_values, bool(interpolate_pos_encoding))
        hidden, mask = self.layout(patches, grid, keep, token)
        cls = token is not None
        feature_maps_step(self)
        shared = self.positions(grid, cls, hidden.device) if self.positions is not None else None
        collected = HiddenStates(output_hidden_states, len(self.layers))
        for layer in self.layers:
            collected.add(hidden)
            # passed in: a checkpointed layer recomputes with this forward's projection
            hidden = layer(hidden, mask, grid, cls, shared_positions=shared, projection=layer.attention.feature_map.projection)
        hidden = self.layernorm(hidden)
        if cls and cfg.rpe in GRID_BIASES:  # drop the padding of the class token's row
            hidden = torch.cat([hidden[:, :1], hidden[:, grid[1]:]], dim=1)
        collected.add(hidden)
        all_hidden = collected.result()
        if cls:
            pooled = hidden[:, 0]
        elif keep is None:
            pooled = hidden.mean(dim=1)
        else:  # the mean over real patches; where, not multiply: padded outputs may hold anything
            real = keep.bool()[..., None]
            pooled = torch.where(real, hidden, hidden.new_zeros(())).sum(1) / real.sum(1).to(hidden.dtype)
        if not return_dict:
            return tuple(x for x in (hidden, pooled, all_hidden) if x is not None)
        return BaseModelOutputWithPooling(
            last_hidden_state=hidden, pooler_output=pooled,
            hidden_states=all_hidden,
        )


class RelativePerformerViTForImageClassification(RelativePerformerViTPreTrainedModel):
    """The encoder and a linear classifier on the pooled output: ``logits (B, num_labels)``.
    ``labels`` follow ``problem_type`` (inferred as ViT does when unset): ``(B,)`` class ids,
    ``(B, num_labels)`` 0/1 floats (multi-label) or ``(B,)`` floats (regression, ``num_labels == 1``).
    """

    def __init__(self, config: RelativePerformerViTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = RelativePerformerViTModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    def forward(
        self,
        pixel_values: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        patch_mask: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        interpolate_pos_encoding: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> Union[ImageClassifierOutput, tuple]:
        """Args as :meth:`RelativePerformerViTModel.forward`, plus ``labels`` (see the class) and
        loss keywords (``num_items_in_batch``)."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.vit(pixel_values, patch_mask=patch_mask, output_hidden_states=output_hidden_states,
                       interpolate_pos_encoding=interpolate_pos_encoding, return_dict=True,
                       output_attentions=output_attentions)
        logits = self.classifier(out.pooler_output)
        loss = classification_loss(self, logits, labels, **kwargs) if labels is not None else None
        if not return_dict:
            rest = (logits,) + ((out.hidden_states,) if out.hidden_states is not None else ())
            return ((loss,) + rest) if loss is not None else rest
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


__all__ = [
    "RelativePerformerViTPreTrainedModel",
    "RelativePerformerViTModel",
    "RelativePerformerViTForImageClassification",
]
