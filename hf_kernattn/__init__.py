"""hf-kernattn: kernelized (linear) attention for Hugging Face Transformers.

Importing the package registers every model family with the ``transformers`` Auto classes.
"""

from .modeling.backends import (
    BackendSpec,
    available_backends,
    get_backend,
    kernelized_attention,
    register_backend,
)
from .modeling.feature_maps import FeatureMap, feature_maps_step
from .modeling.positional import RelativePositionBias1D, RelativePositionBias2D
from .modeling.attention import KernelizedSelfAttention

# --- Linear GPT (model classes; importing registers them with the Auto classes) ---
from .modeling.configuration_linear_gpt import LinearGPTConfig
from .modeling.modeling_linear_gpt import LinearGPTForCausalLM, LinearGPTModel
from .modeling.cache import LinearGPTCache

def _register_linear_gpt() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register("linear_gpt", LinearGPTConfig, exist_ok=True)
    AutoModel.register(LinearGPTConfig, LinearGPTModel, exist_ok=True)
    AutoModelForCausalLM.register(LinearGPTConfig, LinearGPTForCausalLM, exist_ok=True)
    LinearGPTConfig.register_for_auto_class("AutoConfig")
    LinearGPTModel.register_for_auto_class("AutoModel")
    LinearGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")


_register_linear_gpt()

# --- NPRF-BERT (model classes; importing registers them with the Auto classes) ---
from .modeling.configuration_nprf_bert import NPRFBertConfig
from .modeling.modeling_nprf_bert import (
    NPRFBertForMaskedLM,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
    NPRFBertPreTrainedModel,
)


def _register_nprf_bert() -> None:
    """Register NPRF-BERT with the Auto classes (in-process and for ``save_pretrained``)."""
    import transformers

    transformers.AutoConfig.register("nprf_bert", NPRFBertConfig, exist_ok=True)
    NPRFBertConfig.register_for_auto_class("AutoConfig")
    for auto_name, cls in (
        ("AutoModel", NPRFBertModel),
        ("AutoModelForMaskedLM", NPRFBertForMaskedLM),
        ("AutoModelForSequenceClassification", NPRFBertForSequenceClassification),
        ("AutoModelForTokenClassification", NPRFBertForTokenClassification),
        ("AutoModelForQuestionAnswering", NPRFBertForQuestionAnswering),
    ):
        getattr(transformers, auto_name).register(NPRFBertConfig, cls, exist_ok=True)
        cls.register_for_auto_class(auto_name)


_register_nprf_bert()
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
    "BackendSpec",
    "FeatureMap",
    "KernelizedSelfAttention",
    "LinearGPTCache",
    "LinearGPTConfig",
    "LinearGPTForCausalLM",
    "LinearGPTModel",
    "RelativePositionBias1D",
    "RelativePositionBias2D",
    "available_backends",
    "feature_maps_step",
    "get_backend",
    "kernelized_attention",
    "register_backend",
]
__all__ += _NPRF_BERT_ALL  # NPRF-BERT
