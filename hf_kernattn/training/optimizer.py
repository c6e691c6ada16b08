"""Weight decay of the example scripts: the ``transformers`` rule (no decay for biases and
normalisation weights, as ``Trainer.get_decay_parameter_names``), extended to the
relative-position bias tables (``RelativePositionBias1D``): they are additive biases on the
attention logits, and decaying them pulls the model towards having no position information.
Embedding tables are decayed, as ``transformers`` does.
"""

from __future__ import annotations

from torch import nn
from transformers.trainer_pt_utils import get_parameter_names

# transformers' patterns (Trainer.get_decay_parameter_names), matched on lower-cased names.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
_NO_DECAY_MODULES = ("RelativePositionBias1D", "LinearGPTRMSNorm")

WEIGHT_DECAY_HELP = (
    "weight decay of AdamW; as in transformers, biases and normalisation weights get none, and "
    "neither do the relative-position bias tables (embeddings are decayed)"
)


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that get weight decay (see the module docstring for the rule)."""
    forbidden = [nn.LayerNorm]
    # By class name as well: a model loaded as remote code has its own copy of the class.
    forbidden += list({type(m) for m in model.modules() if type(m).__name__ in _NO_DECAY_MODULES})
    return get_parameter_names(model, forbidden, _NO_DECAY_PATTERNS)


def optimizer_grouped_parameters(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups following :func:`decay_parameter_names` (trainable parameters)."""
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
