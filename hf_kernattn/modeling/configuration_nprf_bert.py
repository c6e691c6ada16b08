"""Configuration of NPRF-BERT: a BERT encoder whose attention is normalised positive random
features with a learnable relative-position bias evaluated by FFT (Luo et al. 2021).

The BERT fields keep BERT's names and defaults, so a ``BertConfig`` maps onto this one field by
field (see ``hf_kernattn.convert``). The attention fields are the ones every hf-kernattn family
shares (same names everywhere), with the paper's choices as defaults.
"""

from __future__ import annotations

from typing import Optional

from transformers import PreTrainedConfig

from .attention_config import AttentionSchema, validate_model_fields

# The one Auto-class table of NPRF-BERT: written into config.json as ``auto_map`` (remote-code
# loading) and read by ``hf_kernattn/__init__.py`` for the in-process registration.
AUTO_MAP = {
    "AutoConfig": "configuration_nprf_bert.NPRFBertConfig",
    "AutoModel": "modeling_nprf_bert.NPRFBertModel",
    "AutoModelForMaskedLM": "modeling_nprf_bert.NPRFBertForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_nprf_bert.NPRFBertForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_nprf_bert.NPRFBertForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_nprf_bert.NPRFBertForQuestionAnswering",
}

POSITION_EMBEDDING_TYPES = ("absolute", "none")

# Luo et al. 2021's choices where they differ from the shared defaults.
ATTENTION_SCHEMA = AttentionSchema(
    "NPRF-BERT",
    feature_map=("prf", "NPRF: positive random features"),
    normalize_qk=(True, "the N of NPRF"),
    rpe=("learned", "the paper's learnable bias, applied by FFT"),
    max_relative_position=(512, "BERT's length"),
)


class NPRFBertConfig(PreTrainedConfig):
    """Configuration of an NPRF-BERT model.

    BERT fields (names and defaults as ``transformers.BertConfig``):

    Args:
        vocab_size: size of the token vocabulary.
        hidden_size: width C of the encoder.
        num_hidden_layers: number of encoder layers.
        num_attention_heads: heads H per layer; ``hidden_size`` must be a multiple of it.
        intermediate_size: width of the feed-forward layer.
        hidden_act: feed-forward activation (a key of ``transformers.activations.ACT2FN``).
        hidden_dropout_prob: dropout on embeddings and on every residual branch.
        attention_probs_dropout_prob: kept for compatibility with BERT configs (conversion copies
            it); kernelized attention never forms the attention matrix, so there are no attention
            probabilities to drop and this value is not used by the model.
        max_position_embeddings: size of the absolute position table (the longest input when
            ``position_embedding_type="absolute"``).
        type_vocab_size: number of token types (segments) for ``token_type_ids``.
        initializer_range: std of the normal initialisation of weights.
        layer_norm_eps: epsilon of the layer norms.
        pad_token_id: id of the padding token (its embedding row starts at zero).
        bos_token_id: id of a beginning-of-sequence token, if the tokenizer has one (unused by
            the model; kept for tokenizer/config round trips, e.g. RoBERTa's ``<s>``).
        eos_token_id: id of an end-of-sequence token, if any (unused by the model, as above).
        position_embedding_type: ``"absolute"`` (BERT's learned absolute positions, added to the
            relative bias; needed to reuse BERT weights) or ``"none"`` (relative positions only:
            no length limit beyond memory).
        classifier_dropout: dropout before classification heads; ``None`` uses
            ``hidden_dropout_prob``.
        tie_word_embeddings: tie the MLM decoder weight to the input embeddings.

    NPRF-BERT's own attention fields:

    Args:
        rpe_shared_across_layers: one bias table for the whole model (default, as in the paper)
            or one per layer.
        rpe_init_std: std of the normal initialisation of the bias (0: start from plain kernel
            attention, which is also what conversion from BERT produces).

    ``rpe`` takes ``"learned"`` or ``"none"`` here (a 1D encoder).

    @shared-attention-fields@

    ``output_attentions`` is accepted and kept, as by every transformers config, but kernelized
    attention never forms the attention matrix: a model built from a config with
    ``output_attentions=True`` returns no attention weights (and warns once), and
    ``forward(output_attentions=True)`` raises ``ValueError``.
    """

    model_type = "nprf_bert"

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-12,
        pad_token_id: Optional[int] = 0,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        position_embedding_type: str = "absolute",
        classifier_dropout: Optional[float] = None,
        tie_word_embeddings: bool = True,
        rpe_shared_across_layers: bool = True,
        rpe_init_std: float = 0.0,
        **kwargs,
    ) -> None:
        for name, value, lo in (
            ("vocab_size", vocab_size, 1),
            ("num_hidden_layers", num_hidden_layers, 1),
            ("intermediate_size", intermediate_size, 1),
            ("max_position_embeddings", max_position_embeddings, 1),
            ("type_vocab_size", type_vocab_size, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
        for name, value in (
            ("hidden_dropout_prob", hidden_dropout_prob),
            ("attention_probs_dropout_prob", attention_probs_dropout_prob),
        ):
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
        if classifier_dropout is not None and (
            not isinstance(classifier_dropout, (int, float)) or not 0.0 <= classifier_dropout < 1.0
        ):
            raise ValueError(f"classifier_dropout must be None or a float in [0, 1), got {classifier_dropout!r}")
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {list(POSITION_EMBEDDING_TYPES)}, got {position_embedding_type!r}"
            )
        if pad_token_id is not None and (not isinstance(pad_token_id, int) or not 0 <= pad_token_id < vocab_size):
            raise ValueError(f"pad_token_id must be None or an int in [0, vocab_size={vocab_size}), got {pad_token_id!r}")
        if not isinstance(rpe_shared_across_layers, bool):
            raise ValueError(f"rpe_shared_across_layers must be a bool, got {rpe_shared_across_layers!r}")
        if not isinstance(rpe_init_std, (int, float)) or rpe_init_std < 0:
            raise ValueError(f"rpe_init_std must be a number >= 0, got {rpe_init_std!r}")
        validate_model_fields(
            family=ATTENTION_SCHEMA.family,
            hidden_act=hidden_act,
            initializer_range=initializer_range,
            layer_norm_eps=("layer_norm_eps", layer_norm_eps),
            use_cache=kwargs.get("use_cache"),
            output_attentions=kwargs.get("output_attentions"),
        )
        attention = ATTENTION_SCHEMA.take(kwargs, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        if attention["rpe"] not in ("none", "learned"):
            raise ValueError(f"rpe must be 'learned' or 'none' for NPRF-BERT (a 1D encoder), got {attention['rpe']!r}")

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.position_embedding_type = position_embedding_type
        self.classifier_dropout = classifier_dropout
        self.tie_word_embeddings = tie_word_embeddings
        ATTENTION_SCHEMA.apply(self, attention)
        self.rpe_shared_across_layers = rpe_shared_across_layers
        self.rpe_init_std = float(rpe_init_std)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)


NPRFBertConfig.__doc__ = ATTENTION_SCHEMA.document(NPRFBertConfig.__doc__)

__all__ = ["NPRFBertConfig"]
