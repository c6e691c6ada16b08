"""LoRA through PEFT for every hf-kernattn family (``pip install hf-kernattn[peft]``).

Every family names its adaptable linear layers the same way: the attention projections
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (the shared attention module), and the MLP's
layers: ``c_fc``/``c_proj`` (Linear GPT, ``mlp_type="standard"``), ``gate_proj``/``up_proj``/
``down_proj`` (``mlp_type="gated"``), ``intermediate``/``output`` (NPRF-BERT and the ViT).
:func:`lora_target_modules` lists them for a model; :func:`lora_config` builds a
``peft.LoraConfig`` with them::

    import peft, hf_kernattn
    model = peft.get_peft_model(model, hf_kernattn.lora_config(model, r=8))
    ...  # train; model.save_pretrained(adapter_dir) writes the adapter only
    merged = model.merge_and_unload()   # the family's own class again, LoRA folded into the weights
    merged.save_pretrained(out_dir)     # loads with trust_remote_code=True without hf-kernattn

The learned feature maps (``feature_map="hedgehog"``/``"hedgehog_exp"``) are no linear layers
and stay frozen under LoRA; to train them with the adapters, pass
``modules_to_save=["feature_map"]`` (PEFT then trains and saves a copy of every layer's map, and
``merge_and_unload`` puts the trained maps in the merged model), or train them before LoRA, as
attention transfer does.
"""

from __future__ import annotations

from typing import Any

# Heads trained from scratch on a new task: PEFT trains (and saves) them in full beside the adapters.
HEAD_MODULES = ("classifier", "qa_outputs")


def lora_target_modules(model: Any, *, attention: bool = True, mlp: bool = True) -> list[str]:
    """The module names to pass as ``peft.LoraConfig(target_modules=...)`` for ``model`` (an
    hf-kernattn model, also one loaded as remote code): the attention projections
    (``attention``) and the MLP's linear layers (``mlp``) it has. ``TypeError`` for a model of
    another library; ``ValueError`` when both parts are off."""
    method = getattr(model, "lora_target_modules", None)
    if not callable(method) or not hasattr(type(model), "lora_attention_modules"):
        raise TypeError(
            f"model must be an hf-kernattn model (NPRF-BERT, Linear GPT or the relative-performer ViT), got "
            f"{type(model).__name__}; for other models list PEFT's target_modules yourself"
        )
    if not (attention or mlp):
        raise ValueError("attention and mlp are both False: no module to adapt; set at least one of them")
    return method(attention=attention, mlp=mlp)


def lora_config(model: Any, *, attention: bool = True, mlp: bool = True, **kwargs: Any):
    """A ``peft.LoraConfig`` adapting :func:`lora_target_modules` of ``model``; ``kwargs`` go to
    ``LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``...; given ``target_modules`` or
    ``task_type`` win). ``task_type`` is ``"CAUSAL_LM"`` for a model that generates, and a head
    trained from scratch (``classifier``, ``qa_outputs``) is added to ``modules_to_save``.
    ``ImportError`` naming the extra when PEFT is not installed."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("LoRA needs PEFT: pip install 'hf-kernattn[peft]' (or pip install peft)") from err
    kwargs.setdefault("target_modules", lora_target_modules(model, attention=attention, mlp=mlp))
    if "task_type" not in kwargs and callable(getattr(model, "can_generate", None)) and model.can_generate():
        kwargs["task_type"] = "CAUSAL_LM"
    heads = [name for name in HEAD_MODULES if any(True for _ in getattr(getattr(model, name, None), "parameters", list)())]
    if heads and "modules_to_save" not in kwargs:
        kwargs["modules_to_save"] = heads
    return peft.LoraConfig(**kwargs)


__all__ = ["lora_config", "lora_target_modules"]
