"""What every family shares as a ``transformers`` model (:class:`KernelizedPreTrainedModel`).

* ``_init_weights`` also sets the :class:`FeatureMap` buffers (projection, counters): loaded ones
  are kept, missing ones drawn from the feature seed (``from_pretrained`` warns).
* No attention matrix is formed: ``forward(output_attentions=True)`` raises ``ValueError``; a
  config with ``output_attentions=True`` gives outputs without them and warns once.
* Weights load from safetensors only, unless ``use_safetensors=False`` (warned).
* Checks that read tensor values run in eager mode only (:func:`eager_checks`): they sync with
  the host and break ``torch.export`` / ``torch.compile``.
* ``save_pretrained`` of an FSDP2-sharded model writes the family's own code and ``auto_map``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from transformers import PreTrainedModel
from transformers.dynamic_module_utils import custom_object_save
from transformers.utils import logging

from .attention import WINDOW_WEIGHTS
from .attention_config import CONFIG_ATTENTIONS_IGNORED, NO_ATTENTION_WEIGHTS
from .feature_maps import LEARNED_WEIGHTS, FeatureMap

logger = logging.get_logger(__name__)

FEATURE_BUFFERS = ("projection", "num_draws", "num_steps")



def warn_pickle_weights(option: str) -> None:
    """Warn that the caller's ``option`` lets weights load from a pickle file."""
    logger.warning(
        f"{option}: the weights may be loaded from a pickle file (pytorch_model.bin), "
        "which runs the unpickler on it; load only files you trust"
    )


def eager_checks() -> bool:
    """True when value checks on tensors may run: not while ``torch.compile`` / ``torch.export``
    trace the model (reading a value there is a data-dependent guard)."""
    return not torch.compiler.is_compiling()


def refuse_output_attentions(name: str, output_attentions: Optional[bool], config) -> None:
    """``ValueError`` for ``output_attentions=True``; None follows the config (``True`` there:
    no weights, one warning)."""
    if output_attentions is None:
        if getattr(config, "output_attentions", False):
            logger.warning_once(CONFIG_ATTENTIONS_IGNORED.format(name=name))
        return
    if output_attentions:
        raise ValueError(NO_ATTENTION_WEIGHTS.format(name=name))


def drop_default_generation_attentions(name: str, generation_config, kwargs: dict) -> None:
    """For ``generate(**kwargs)``: a generation config inheriting ``output_attentions=True`` from
    the model's config generates without them (warned) instead of failing at the first forward;
    an explicit request still raises."""
    if "output_attentions" in kwargs or kwargs.get("generation_config") is not None:
        return
    if getattr(generation_config, "output_attentions", False):
        logger.warning_once(CONFIG_ATTENTIONS_IGNORED.format(name=name))
        kwargs["output_attentions"] = False


class HiddenStates:
    """The hidden states ``output_hidden_states`` asks for among a stack's ``layers + 1`` (each
    layer's input, then the output): True all; an int or ints (negative from the end) those,
    None elsewhere; False / None none (``states`` None)."""

    def __init__(self, request: object, layers: int) -> None:
        count = layers + 1
        if request is None or isinstance(request, bool):
            self.keep = range(count) if request else None
        elif isinstance(request, int) or (isinstance(request, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in request)):
            self.keep = {i % count for i in ([request] if isinstance(request, int) else request) if -count <= i < count}
        else:
            raise TypeError(f"output_hidden_states must be a bool, an int or a list of ints (indices of the {count} "
                            f"hidden states), got {request!r}")
        self.states = None if self.keep is None else []

    def add(self, hidden: torch.Tensor) -> None:
        if self.states is not None:
            self.states.append(hidden if len(self.states) in self.keep else None)

    def result(self) -> Optional[tuple]:
        return None if self.states is None else tuple(self.states)


def classification_loss(model, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """A classification head's loss through ``model.loss_function`` (``problem_type`` inferred as
    BERT does). With ``num_items_in_batch`` every problem type gives the sum of per-item losses
    divided by it (transformers' regression and multi-label means are rescaled), so gradient
    accumulation equals the full batch."""
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
    """Base of every family's ``PreTrainedModel`` (see the module docstring)."""

    supports_gradient_checkpointing = True
    # LoRA targets by part, as last components of module names (how PEFT matches a list)
    lora_attention_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_mlp_modules: tuple[str, ...] = ()
    # Kernelized attention is its own attention: no eager/SDPA/flash switch, no attention weights.
    _supports_attention_backend = False
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def lora_target_modules(self, attention: bool = True, mlp: bool = True) -> list[str]:
        """Names for PEFT's ``LoraConfig(target_modules=...)``: the attention projections
        (``attention``) and MLP layers (``mlp``) this model has; no heads, poolers or embeddings."""
        wanted = (self.lora_attention_modules if attention else ()) + (self.lora_mlp_modules if mlp else ())
        present = {name.rsplit(".", 1)[-1] for name, module in self.named_modules() if isinstance(module, torch.nn.Linear)}
        return [name for name in wanted if name in present]

    @torch.no_grad()
    def _init_window_weights(self, module: torch.nn.Module) -> None:
        """The hybrid's mixing log-weights of an attention layer, where not loaded: 0 (weights 1)."""
        for name in WINDOW_WEIGHTS:
            param = module._parameters.get(name)
            if param is not None and not getattr(param, "_is_hf_initialized", False):
                param.zero_()

    @torch.no_grad()
    def _init_feature_map(self, module: FeatureMap) -> None:
        """Draw 0 and zero counters, and a learned map's identity weights, where not loaded."""
        loaded = {
            name: buf.clone()
            for name in FEATURE_BUFFERS + LEARNED_WEIGHTS
            if (buf := getattr(module, name, None)) is not None and getattr(buf, "_is_hf_initialized", False)
        }
        module.init_features()
        for name, value in loaded.items():
            buf = getattr(module, name)
            if buf.shape == value.shape:
                buf.copy_(value)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``; an FSDP2-sharded model (whose class ``fully_shard``
        swaps for one of torch's) still saves its own code and ``auto_map``. Pass it the gathered
        ``state_dict`` (e.g. ``accelerator.get_state_dict(model)``); a tied weight gathered twice is
        saved once."""
        state_dict = kwargs.get("state_dict")
        if state_dict is not None and getattr(self.config, "tie_word_embeddings", False):
            tied = [target for target, source in (getattr(self, "_tied_weights_keys", None) or {}).items()
                    if target in state_dict and source in state_dict
                    and torch.equal(state_dict[target], state_dict[source])]
            kwargs["state_dict"] = {k: v for k, v in state_dict.items() if k not in tied}
        wrapper = type(self)
        own = next((c for c in wrapper.__mro__ if not c.__module__.startswith("torch.")), wrapper)
        if own is wrapper or wrapper._auto_class is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        # transformers copies type(self)'s code: copy the own class's here, hide the wrapper's meanwhile
        if self.should_save_on_this_rank(kwargs.get("is_main_process", True)):
            os.makedirs(save_directory, exist_ok=True)
            # an empty instance of the own class: custom_object_save reads only class attributes
            custom_object_save(object.__new__(own), save_directory, config=self.config)
        had_own = "_auto_class" in wrapper.__dict__
        saved, wrapper._auto_class = wrapper._auto_class, None
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            if had_own:
                wrapper._auto_class = saved
            else:
                del wrapper._auto_class

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained`` from safetensors only (``use_safetensors=False``
        allows pickled weights, warned); warns when random-feature buffers were missing (drawn
        from ``feature_seed``: right only if the saved model used that seed and never redrew)."""
        if kwargs.get("use_safetensors") is None:
            kwargs["use_safetensors"] = True
        elif kwargs["use_safetensors"] is False:
            warn_pickle_weights("use_safetensors=False")
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
           "refuse_output_attentions", "NO_ATTENTION_WEIGHTS", "warn_pickle_weights"]
