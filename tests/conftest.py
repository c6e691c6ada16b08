"""Shared tiny configurations: one builder per model family (and one for a bare attention module).

Every test that builds a tiny model starts from these and passes overrides for the sizes or
options it is about, so a change of the tiny shape happens in one place. The builders are plain
functions (``from tests.conftest import tiny_nprf_bert_config``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from hf_kernattn import LinearGPTConfig, NPRFBertConfig, RelativePerformerViTConfig

# vocabulary sizes of the tiny models (test inputs draw token ids below these)
V_BERT, V_GPT = 40, 53

# The accelerator of the device tests (``accelerator`` fixture): ``--device`` or this variable; without
# either, CUDA where torch sees it, else those tests skip.
DEVICE_ENV = "HF_KERNATTN_TEST_DEVICE"


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get(DEVICE_ENV) or None,
                     help=f"accelerator for the device tests, e.g. cuda or cuda:1 (default ${DEVICE_ENV}, else cuda "
                          "where available; without one they skip)")


@pytest.fixture(scope="session")
def accelerator(request) -> torch.device:
    """The accelerator the device tests run on (never the CPU: their reference runs there). Skips
    when none was asked for and torch sees no CUDA device; fails when the one asked for is missing."""
    name = request.config.getoption("--device")
    if name is None:
        if not torch.cuda.is_available():
            pytest.skip("no accelerator: the device tests run on CUDA (scripts/gpu_check.sh; --device or "
                        f"${DEVICE_ENV} to choose one)")
        name = "cuda"
    dev = torch.device(name)
    if dev.type == "cpu":
        pytest.fail("--device cpu: the device tests compare an accelerator with the CPU; name an accelerator")
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as err:
        pytest.fail(f"--device {name}: torch cannot use it ({' '.join(str(err).split())[:200]})")
    torch.set_float32_matmul_precision("highest")  # float32 products in float32 (no TF32) against the references
    return dev


def tiny_nprf_bert_config(**overrides) -> NPRFBertConfig:
    """A 2-layer, 4-head, width-32 NPRF-BERT with 16 random features and a bias clipped at 8
    (initialised at std 0.5, so the bias really changes the output)."""
    base = dict(
        vocab_size=V_BERT, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_random_features=16, max_relative_position=8, rpe_init_std=0.5,
    )
    base.update(overrides)
    return NPRFBertConfig(**base)


def tiny_linear_gpt_config(**overrides) -> LinearGPTConfig:
    """A 2-layer, 2-head, width-32 Linear GPT. ``initializer_range=0.3`` makes the next token
    depend strongly on the context, so a wrong state or leaking padding changes the output."""
    base = dict(
        vocab_size=V_GPT, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, initializer_range=0.3,
    )
    base.update(overrides)
    return LinearGPTConfig(**base)


def tiny_relative_performer_vit_config(**overrides) -> RelativePerformerViTConfig:
    """A 2-layer, 4-head, width-32 relative-performer ViT on 16 x 16 single-channel images in
    4 x 4 patches (a 4 x 4 grid), 3 labels, 2D FFT bias clipped at 3 with a non-zero init."""
    base = dict(
        image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3, max_relative_position=3, num_random_features=16, rpe_init_std=0.5,
        initializer_range=0.3,
    )
    base.update(overrides)
    return RelativePerformerViTConfig(**base)


def tiny_attention_config(**overrides) -> SimpleNamespace:
    """Fields for a bare ``KernelizedSelfAttention`` (width 16, 2 heads, elu features, fixed
    random features); fields left out take the schema's base defaults."""
    base = dict(
        hidden_size=16, num_attention_heads=2, feature_map="elu", num_random_features=8,
        feature_projection="orthogonal", normalize_qk=False, feature_redraw_interval=0, attn_backend="auto",
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def checkpointing_enable(model, **kwargs) -> None:
    """Activation (gradient) checkpointing on ``model`` with ``kwargs`` for ``torch.utils.checkpoint``,
    through transformers' current name (``activation_checkpointing_enable`` since 5.23; the old
    ``gradient_checkpointing_enable`` warns there) or the old one on earlier versions."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def checkpointing_disable(model) -> None:
    """Undo :func:`checkpointing_enable` (the current name where it exists)."""
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def checkpointing_training_argument() -> dict:
    """``TrainingArguments`` keyword that turns checkpointing on: ``activation_checkpointing``
    since transformers 5.23 (``gradient_checkpointing`` warns there), the old name before."""
    from dataclasses import fields

    from transformers import TrainingArguments

    names = {f.name for f in fields(TrainingArguments)}
    return {"activation_checkpointing": True} if "activation_checkpointing" in names else {"gradient_checkpointing": True}


@contextlib.contextmanager
def unpickling_forbidden(what: str = "the unpickler ran"):
    """Within the block any unpickling (``pickle.load``/``loads``/``Unpickler``, ``torch.load``)
    fails the test with ``AssertionError(what)``."""
    def trap(*args, **kwargs):
        raise AssertionError(what)

    with pytest.MonkeyPatch.context() as m:
        for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
            m.setattr(module, name, trap)
        yield
