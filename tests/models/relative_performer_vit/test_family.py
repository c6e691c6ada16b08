"""The relative-performer ViT through the shared family tests (tests/family_mixin.py), with the
padding test written for images: padded patches instead of padded tokens."""

from __future__ import annotations

import torch

from hf_kernattn import RelativePerformerViTForImageClassification, RelativePerformerViTModel
from hf_kernattn.modeling.configuration_relative_performer_vit import AUTO_MAP
from tests.conftest import tiny_relative_performer_vit_config
from tests.family_mixin import FamilyTests


class TestRelativePerformerViTFamily(FamilyTests):
    model_classes = (RelativePerformerViTModel, RelativePerformerViTForImageClassification)
    auto_map = AUTO_MAP
    export_class = RelativePerformerViTForImageClassification
    export_variants = {rpe: {"rpe": rpe} for rpe in ("learned_2d", "manhattan", "rotary_features", "absolute")}
    config_fields_absent = ("use_cache",)
    training_class = RelativePerformerViTForImageClassification

    def make_config(self, **overrides):
        return tiny_relative_performer_vit_config(**overrides)

    def make_inputs(self, batch, n, seed=0):
        """Images of 4 x 4 patches (``n`` is the text families' length; a grid is fixed here)."""
        return {"pixel_values": torch.randn(batch, 1, 16, 16, generator=torch.Generator().manual_seed(seed))}

    def training_inputs(self, seed):
        return {**self.make_inputs(2, 0, seed=seed), "labels": torch.tensor([0, 2])}

    def empty_inputs(self):
        return [({"pixel_values": torch.zeros(0, 1, 16, 16)}, "at least one image")]

    def expected_shapes(self, cls, config, batch, n):
        c, tokens = config.hidden_size, 16
        return {
            RelativePerformerViTModel: {"last_hidden_state": (batch, tokens, c), "pooler_output": (batch, c)},
            RelativePerformerViTForImageClassification: {"logits": (batch, config.num_labels)},
        }[cls]

    def test_padded_batch_equals_unpadded_rows_and_padding_never_leaks(self):
        """Images of 4 x 4, 3 x 2 and 1 x 3 patches padded into one 16 x 16 batch whose padded
        pixels are NaN (``patch_mask`` 0 there): each image's pooled output and logits equal the
        image run alone at its own size, and are finite. float32: within the bound of reordered
        sums over 16 keys and two layers."""
        sizes = [(4, 4), (3, 2), (1, 3)]
        images = self.make_inputs(3, 0, seed=1)["pixel_values"]
        mask = torch.zeros(3, 4, 4, dtype=torch.long)
        for i, (h, w) in enumerate(sizes):
            mask[i, :h, :w] = 1
            images[i, :, 4 * h :, :] = float("nan")
            images[i, :, :, 4 * w :] = float("nan")
        for cls in self.model_classes:
            model = self.build(cls)
            with torch.no_grad():
                batch = self.tensors(model(pixel_values=images, patch_mask=mask))
                for i, (h, w) in enumerate(sizes):
                    alone = self.tensors(model(pixel_values=images[i : i + 1, :, : 4 * h, : 4 * w]))
                    for name in ("pooler_output", "logits"):
                        if name in alone:
                            row = batch[name][i : i + 1]
                            assert torch.isfinite(row).all(), f"{cls.__name__}.{name} row {i}: padding leaked"
                            self.assert_reordered(row, alone[name], model.config, 16, msg=f"{name} row {i}")
