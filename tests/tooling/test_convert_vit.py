"""ViT checkpoints into the relative-performer ViT (hf_kernattn.convert): exact copies, a start
close to the original that tightens with more random features, a save that loads without the
package, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification, ViTModel

from hf_kernattn.convert import convert, convert_to_relative_performer_vit

from tests.remote import run_without_package

SHAPE = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(**SHAPE, num_labels=3)).eval()
    folder = tmp_path_factory.mktemp("vit")
    model.save_pretrained(folder)
    return folder, model


def test_every_mapped_weight_is_copied_exactly(vit_dir):
    folder, vit = vit_dir
    rp = convert(folder)
    src, dst = vit.state_dict(), rp.state_dict()
    assert (rp.config.rpe, rp.config.pooling, rp.config.num_labels) == ("absolute", "cls", 3)
    assert torch.equal(dst["vit.embeddings.patch_embeddings.weight"], src["vit.embeddings.patch_embeddings.projection.weight"])
    assert torch.equal(dst["vit.embeddings.position_embeddings"], src["vit.embeddings.position_embeddings"][:, 1:])
    assert torch.equal(dst["vit.embeddings.cls_token"],
                       src["vit.embeddings.cls_token"] + src["vit.embeddings.position_embeddings"][:, :1])
    for i in range(2):
        for ours, theirs in (("attention.q_proj", "attention.q_proj"), ("attention.o_proj", "attention.o_proj"),
                             ("intermediate", "mlp.fc1"), ("output", "mlp.fc2"), ("layernorm_after", "layernorm_after")):
            for part in ("weight", "bias"):
                assert torch.equal(dst[f"vit.layers.{i}.{ours}.{part}"], src[f"vit.layers.{i}.{theirs}.{part}"])
    assert torch.equal(dst["classifier.weight"], src["classifier.weight"])
    assert rp.conversion_report["unused_source_keys"] == []


def test_converted_model_approaches_vit_as_features_grow(vit_dir):
    """Positive random features estimate ViT's exp(q . k / sqrt(d)) without bias: from 16 to
    4096 features the logits' relative error to ViT should shrink ~16x; asked: 4x (measured
    9.3e-3 -> 2.2e-4)."""
    folder, vit = vit_dir
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = vit(pixel_values=pixels).logits
        err = {m: float((convert(folder, num_random_features=m)(pixel_values=pixels).logits - want).norm() / want.norm())
               for m in (16, 4096)}
    assert err[4096] < err[16] / 4, err


def test_saved_conversion_loads_without_the_package_and_bare_vit_converts(vit_dir, tmp_path):
    folder, _ = vit_dir
    rp = convert_to_relative_performer_vit(folder, tmp_path / "rp")
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = rp(pixel_values=pixels).logits.tolist()
    code = f"""
import json, torch, transformers
m = transformers.AutoModelForImageClassification.from_pretrained("rp", trust_remote_code=True).eval()
with torch.no_grad():
    print(json.dumps(m(pixel_values=torch.tensor({pixels.tolist()})).logits.tolist()))
"""
    assert json.loads(run_without_package(code, cwd=str(tmp_path)).strip().splitlines()[-1]) == want
    ViTModel(ViTConfig(**SHAPE), add_pooling_layer=False).save_pretrained(tmp_path / "bare")
    base = convert(tmp_path / "bare")
    assert type(base).__name__ == "RelativePerformerViTModel"


def test_what_cannot_be_converted_is_refused(tmp_path):
    ViTModel(ViTConfig(**SHAPE, qkv_bias=False)).save_pretrained(tmp_path / "nobias")
    with pytest.raises(ValueError, match="qkv_bias=False; supported: qkv_bias=True"):
        convert(tmp_path / "nobias")
