"""hf-kernattn: kernelized (linear) attention for Hugging Face Transformers.

Importing the package registers every model family with the ``transformers`` Auto classes.
"""

from .modeling.dispatch import kernelized_attention  # importing it registers the built-in backends
from .modeling.kernels_manhattan import manhattan_attention as _manhattan  # noqa: F401  (registers manhattan)
from .modeling.kernels_hybrid import hybrid_attention as _hybrid  # noqa: F401  (registers hybrid)
from .modeling.registry import BackendSpec, available_backends, get_backend, register_backend, unregister_backend
from .modeling import registry as _registry
from . import auto_tables as _auto_tables
from .auto_tables import load_auto_table

_registry.set_table_source(_auto_tables.environment_table)  # HF_KERNATTN_AUTO_TABLE, read on the first automatic choice
from .modeling.state import AttentionState, StateKind
from .modeling.feature_maps import FeatureMap, feature_maps_step
from .modeling.positional import RelativePositionBias1D, RelativePositionBias2D
from .modeling.attention import KernelizedSelfAttention
from .modeling.attention_inputs import SoftmaxWindow

import importlib as _importlib

import transformers as _transformers

from .modeling import configuration_linear_gpt as _configuration_linear_gpt
from .modeling import configuration_nprf_bert as _configuration_nprf_bert
from .modeling import configuration_relative_performer_vit as _configuration_relative_performer_vit

# --- Linear GPT ---
from .modeling.configuration_linear_gpt import LinearGPTConfig
from .modeling.modeling_linear_gpt import LinearGPTForCausalLM, LinearGPTModel
from .modeling.cache import LinearGPTCache

# --- NPRF-BERT ---
from .modeling.configuration_nprf_bert import NPRFBertConfig
from .modeling.modeling_nprf_bert import (
    NPRFBertForMaskedLM,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
    NPRFBertPreTrainedModel,
)

# --- relative-performer ViT ---
from .modeling.configuration_relative_performer_vit import RelativePerformerViTConfig
from .modeling.modeling_relative_performer_vit import (
    RelativePerformerViTForImageClassification,
    RelativePerformerViTModel,
    RelativePerformerViTPreTrainedModel,
)


def _register_family(config_module) -> None:
    """Register one family with the Auto classes, in-process and for ``save_pretrained``, from
    its one table ``AUTO_MAP`` (the same table the config writes into config.json as
    ``auto_map``): ``{Auto class name: "module.Class"}`` inside ``hf_kernattn/modeling/``."""
    classes = {}
    for auto_name, reference in config_module.AUTO_MAP.items():
        module_name, class_name = reference.split(".")
        classes[auto_name] = getattr(_importlib.import_module(f"{__name__}.modeling.{module_name}"), class_name)
    config_class = classes["AutoConfig"]
    _transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for auto_name, cls in classes.items():
        if auto_name != "AutoConfig":
            getattr(_transformers, auto_name).register(config_class, cls, exist_ok=True)
        cls.register_for_auto_class(auto_name)


_register_family(_configuration_linear_gpt)
_register_family(_configuration_nprf_bert)
_register_family(_configuration_relative_performer_vit)

# attn_implementation="kernelized" for stock transformers models
from . import drop_in as drop_in  # noqa: E402

drop_in.register()

# LoRA through PEFT (an optional dependency: imported only when a LoraConfig is built)
from .lora import lora_config, lora_target_modules  # noqa: E402

_NPRF_BERT_ALL = [
    "NPRFBertConfig",
    "NPRFBertForMaskedLM",
    "NPRFBertForQuestionAnswering",
    "NPRFBertForSequenceClassification",
    "NPRFBertForTokenClassification",
    "NPRFBertModel",
    "NPRFBertPreTrainedModel",
]

__version__ = "0.1.0"

__all__ = [
    "AttentionState",
    "StateKind",
    "BackendSpec",
    "FeatureMap",
    "KernelizedSelfAttention",
    "LinearGPTCache",
    "LinearGPTConfig",
    "LinearGPTForCausalLM",
    "LinearGPTModel",
    "RelativePositionBias1D",
    "RelativePositionBias2D",
    "SoftmaxWindow",
    "available_backends",
    "feature_maps_step",
    "get_backend",
    "kernelized_attention",
    "load_auto_table",
    "lora_config",
    "lora_target_modules",
    "register_backend",
    "unregister_backend",
]
__all__ += _NPRF_BERT_ALL  # NPRF-BERT
__all__ += [
    "RelativePerformerViTConfig",
    "RelativePerformerViTForImageClassification",
    "RelativePerformerViTModel",
    "RelativePerformerViTPreTrainedModel",
]
