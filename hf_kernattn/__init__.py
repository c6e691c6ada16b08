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

# --- NPRF-BERT (model classes; importing registers them with the Auto classes) ---

__version__ = "0.1.0"

__all__ = [
    "BackendSpec",
    "FeatureMap",
    "KernelizedSelfAttention",
    "RelativePositionBias1D",
    "RelativePositionBias2D",
    "available_backends",
    "feature_maps_step",
    "get_backend",
    "kernelized_attention",
    "register_backend",
]
