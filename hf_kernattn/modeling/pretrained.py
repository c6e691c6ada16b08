"""What every hf-kernattn model family shares as a ``transformers`` model.

* Initialisation of the random-feature state: :class:`FeatureMap` holds its projection and
  redraw counters as buffers, and ``_init_weights`` must set buffers as well as parameters
  (``from_pretrained`` with missing keys or ``ignore_mismatched_sizes``, and ``init_weights()``
  after building on the meta device, otherwise leave uninitialised memory there). Missing
  buffers are drawn from the feature seed, buffers that were loaded are kept, and
  ``from_pretrained`` warns when a checkpoint lacked them.
* No attention weights: kernelized attention never forms the ``N x N`` attention matrix, so
  ``forward(output_attentions=True)`` is refused with a ``ValueError``, as ``transformers``
  refuses it for attention implementations that cannot return weights. The config accepts and
  keeps ``output_attentions`` (an argument every transformers config takes), as transformers'
  models without attention weights do; a model whose config asks for them returns none and
  warns once.
* Safe loading: weights come from safetensors files only, unless the caller asks for pickled
  ones explicitly (``use_safetensors=False``, with a warning).
* Input checks that read tensor values (``int(x.min())``, ``bool(mask.any())``) force a host
  sync and break ``torch.export`` / ``torch.compile`` (data-dependent guards); they run in eager
  mode only (:func:`eager_checks`).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .attention_config import CONFIG_ATTENTIONS_IGNORED, NO_ATTENTION_WEIGHTS
from .feature_maps import FeatureMap

logger = logging.get_logger(__name__)

FEATURE_BUFFERS = ("projection", "num_draws", "num_steps")



def eager_checks() -> bool:
    """True when value checks on tensors may run: not while ``torch.compile`` / ``torch.export``
    trace the model (reading a value there is a data-dependent guard)."""
    return not torch.compiler.is_compiling()


def refuse_output_attentions(name: str, output_attentions: Optional[bool], config) -> None:
    """``ValueError`` when a call asks for attention weights (``output_attentions=True``).

    Left unset (``None``), the call follows the config: ``config.output_attentions=True`` (kept
    by the config, as every transformers config keeps it) gives outputs without attention
    weights, and a warning once per process saying so."""
    if output_attentions is None:
        if getattr(config, "output_attentions", False):
            logger.warning_once(CONFIG_ATTENTIONS_IGNORED.format(name=name))
        return
    if output_attentions:
        raise ValueError(NO_ATTENTION_WEIGHTS.format(name=name))


def drop_default_generation_attentions(name: str, generation_config, kwargs: dict) -> None:
    """For ``generate(**kwargs)``: a model whose own generation config asks for attention weights
    (``output_attentions=True`` inherited from its config) generates without them, with the
    config's warning, instead of failing at the first forward. A call that asks for them
    (``output_attentions=True`` or a ``generation_config`` setting it) still raises there."""
    if "output_attentions" in kwargs or kwargs.get("generation_config") is not None:
        return
    if getattr(generation_config, "output_attentions", False):
        logger.warning_once(CONFIG_ATTENTIONS_IGNORED.format(name=name))
        kwargs["output_attentions"] = False


def classification_loss(model, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """The loss of a sequence/image classification head through ``model.loss_function``
    (``problem_type`` inferred as BERT does when unset). With
    ``num_items_in_batch`` every problem type gives the sum of its per-item losses over this
    batch divided by it (transformers' regression and multi-label losses are means: they are
    rescaled here), so gradient accumulation over micro-batches equals the full batch."""
    labels = labels.to(logits.device)
    problem = model.config.problem_type
    if problem is None:
        if model.config.num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
        model.config.problem_type = problem
    if problem not in ("regression", "single_label_classification", "multi_label_classification"):
        raise ValueError(
            "problem_type must be 'regression', 'single_label_classification' or "
            f"'multi_label_classification', got {problem!r}"
        )
    if problem == "multi_label_classification" and tuple(labels.shape) != tuple(logits.shape):
        raise ValueError(
            f"labels for multi_label_classification must have shape {tuple(logits.shape)}, got {tuple(labels.shape)}"
        )
    if problem == "single_label_classification":
        return model.loss_function(labels, logits, model.config, **kwargs)
    labels = labels.to(logits.dtype)
    if problem == "regression" and model.config.num_labels == 1:
        labels = labels.reshape(logits.shape[:1])
        logits = logits.reshape(logits.shape[:1])
    loss = model.loss_function(labels, logits, model.config)  # a mean over labels.numel() items
    num_items = kwargs.get("num_items_in_batch")
    if num_items is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss * labels.numel() / num_items
    return loss


class KernelizedPreTrainedModel(PreTrainedModel):
    """Base of every family's ``PreTrainedModel``: feature-map initialisation, the warning for
    checkpoints without random-feature buffers, and the refusal of ``output_attentions``."""

    supports_gradient_checkpointing = True
    # Kernelized attention is its own attention: no eager/SDPA/flash switch, no attention weights.
    _supports_attention_backend = False
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    @torch.no_grad()
    def _init_feature_map(self, module: FeatureMap) -> None:
        """Set the random-feature state of ``module``: draw 0 of its seed and zero counters for
        every buffer that was not loaded from a checkpoint (loaded ones are kept)."""
        loaded = {
            name: buf.clone()
            for name in FEATURE_BUFFERS
            if (buf := getattr(module, name, None)) is not None and getattr(buf, "_is_hf_initialized", False)
        }
        module.init_features()
        for name, value in loaded.items():
            buf = getattr(module, name)
            if buf.shape == value.shape:
                buf.copy_(value)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, plus a warning when the checkpoint lacked the
        random-feature buffers (they are then drawn from ``feature_seed``, which reproduces the
        saved model only if it used the same seed and never redrew its features).

        Weights load from safetensors only: pickled weights (``pytorch_model.bin``) are refused
        unless the caller passes ``use_safetensors=False`` explicitly, which is warned about
        (unpickling a file can run code from it; load only files you trust)."""
        if kwargs.get("use_safetensors") is None:
            kwargs["use_safetensors"] = True
        elif kwargs["use_safetensors"] is False:
            logger.warning(
                "use_safetensors=False: the weights may be loaded from a pickle file (pytorch_model.bin), "
                "which runs the unpickler on it; load only files you trust"
            )
        want_info = bool(kwargs.get("output_loading_info", False))
        kwargs["output_loading_info"] = True
        model, info = super().from_pretrained(*args, **kwargs)
        missing = sorted(
            key for key in info.get("missing_keys", ()) if key.rsplit(".", 1)[-1] in FEATURE_BUFFERS and ".feature_map." in key
        )
        mismatched = sorted(
            key for key, *_ in info.get("mismatched_keys", ()) if key.rsplit(".", 1)[-1] == "projection"
        )
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            logger.warning(
                f"The checkpoint has no random-feature buffers for {len(missing)} key(s) ({shown}). They were "
                f"initialised from feature_seed={model.config.feature_seed} (draw 0, counters at 0): "
                "outputs match the saved model only if it was built with the same seed and never redrew its features."
            )
        if mismatched:
            logger.warning(
                f"{len(mismatched)} random-feature projection(s) of the checkpoint have another shape and were "
                f"drawn anew from feature_seed={model.config.feature_seed}."
            )
        return (model, info) if want_info else model


__all__ = ["KernelizedPreTrainedModel", "classification_loss", "drop_default_generation_attentions", "eager_checks",
           "refuse_output_attentions",
           "NO_ATTENTION_WEIGHTS"]
