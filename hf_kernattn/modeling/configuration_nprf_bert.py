"""Configuration of NPRF-BERT: BERT with normalised positive-random-feature attention and a
learnable relative-position bias (Luo et al. 2021). BERT's fields keep their names and defaults,
so a ``BertConfig`` maps onto it field by field (``hf_kernattn.convert``); the shared attention
fields default to the paper's choices.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .attention_config import (AttentionSchema, ConfigField, activation, boolean, choice, finite_above,
                               finite_at_least, int_at_least, optional, probability)
from .registry import backends_for, get_backend

# The Auto classes: config.json's ``auto_map`` (remote code) and the in-process registration.
AUTO_MAP = {
    "AutoConfig": "configuration_nprf_bert.NPRFBertConfig",
    "AutoModel": "modeling_nprf_bert.NPRFBertModel",
    "AutoModelForMaskedLM": "modeling_nprf_bert.NPRFBertForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_nprf_bert.NPRFBertForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_nprf_bert.NPRFBertForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_nprf_bert.NPRFBertForQuestionAnswering",
}

POSITION_EMBEDDING_TYPES = ("absolute", "none")

ATTENTION_SCHEMA = AttentionSchema(
    "NPRF-BERT",
    fields=(
        "BERT fields (names and defaults as ``transformers.BertConfig``)",
        ConfigField("vocab_size", 30522, "size of the token vocabulary.", int_at_least(1)),
        ConfigField("hidden_size", 768, "width C of the encoder.", int_at_least(1)),
        ConfigField("num_hidden_layers", 12, "number of encoder layers.", int_at_least(1)),
        ConfigField("num_attention_heads", 12, "heads H per layer; ``hidden_size`` must be a multiple of it.",
                    int_at_least(1)),
        ConfigField("intermediate_size", 3072, "width of the feed-forward layer.", int_at_least(1)),
        ConfigField("hidden_act", "gelu", "feed-forward activation (a key of ``transformers.activations.ACT2FN``).",
                    activation),
        ConfigField("hidden_dropout_prob", 0.1, "dropout on embeddings and on every residual branch.", probability),
        ConfigField("attention_probs_dropout_prob", 0.1,
                    "kept for BERT configs (conversion copies it); unused: kernelized attention forms no "
                    "attention probabilities.", probability),
        ConfigField("max_position_embeddings", 512,
                    "size of the absolute position table (the longest input when "
                    "``position_embedding_type=\"absolute\"``).", int_at_least(1)),
        ConfigField("type_vocab_size", 2, "number of token types (segments) for ``token_type_ids``.",
                    int_at_least(1)),
        ConfigField("initializer_range", 0.02, "std of the normal initialisation of weights.", finite_at_least(0)),
        ConfigField("layer_norm_eps", 1e-12, "epsilon of the layer norms.", finite_above(0)),
        ConfigField("pad_token_id", 0,
                    "id of the padding token (its embedding row starts at zero), below ``vocab_size``; or None.",
                    optional(int_at_least(0))),
        ConfigField("bos_token_id", None,
                    "id of a beginning-of-sequence token, if any (unused by the model; kept for tokenizer round "
                    "trips, e.g. RoBERTa's ``<s>``)."),
        ConfigField("eos_token_id", None, "id of an end-of-sequence token, if any (unused by the model, as above)."),
        ConfigField("position_embedding_type", "absolute",
                    "``\"absolute\"`` (BERT's learned absolute positions, added to the relative bias; needed to "
                    "reuse BERT weights) or ``\"none\"`` (relative positions only: no length limit beyond memory).",
                    choice(POSITION_EMBEDDING_TYPES)),
        ConfigField("classifier_dropout", None,
                    "dropout before classification heads; ``None`` uses ``hidden_dropout_prob``.",
                    optional(probability)),
        ConfigField("tie_word_embeddings", True, "tie the MLM decoder weight to the input embeddings.", boolean),
        "NPRF-BERT's own attention fields",
        ConfigField("rpe_shared_across_layers", True,
                    "one bias table for the whole model (as in the paper) or one per layer.", boolean),
        ConfigField("rpe_init_std", 0.0,
                    "std of the normal initialisation of the bias (0: start from plain kernel attention, which is "
                    "also what conversion from BERT produces).", finite_at_least(0), float),
    ),
    choices={"rpe": ("learned", "none")},  # a 1D encoder
    # Luo et al. 2021's choices where they differ from the shared defaults.
    feature_map=("prf", "NPRF: positive random features"),
    normalize_qk=(True, "the N of NPRF"),
    rpe=("learned", "the paper's learnable bias"),
    max_relative_position=(512, "BERT's length"),
)


def check_combinations(values: dict) -> None:
    """Checks across fields: the padding id is a token id; the hybrid takes no bias, and only a
    backend declared for it runs it (and nothing else)."""
    pad, vocab_size = values["pad_token_id"], values["vocab_size"]
    if pad is not None and pad >= vocab_size:
        raise ValueError(f"pad_token_id must be None or an int in [0, vocab_size={vocab_size}), got {pad!r}")
    window, backend = values["softmax_window"], values["attn_backend"]
    if window is not None and values["rpe"] != "none":
        raise ValueError(f"softmax_window={window} cannot be combined with rpe={values['rpe']!r}: the sliding-window "
                         "hybrid takes no relative-position bias; use rpe='none'")
    if backend != "auto" and (window is not None or get_backend(backend).softmax_window):
        learned = values["rpe"] != "none"  # (never with a window)
        request = dict(causal=False, rpe="1d" if learned else None,
                       rpe_clip=values["max_relative_position"] if learned else None, window=window is not None)
        lacks = get_backend(backend).missing(key_mask=False, device=None, **request)
        if lacks:
            raise ValueError(f"attn_backend={backend!r} cannot serve this NPRF-BERT: it cannot do {', '.join(lacks)}; "
                             f"attn_backend must be 'auto' or one of {backends_for(**request)}")


@ATTENTION_SCHEMA.declare
class NPRFBertConfig(PreTrainedConfig):
    """Configuration of an NPRF-BERT model.

    @family-fields@

    ``rpe`` takes ``"learned"`` or ``"none"`` here (a 1D encoder).

    @shared-attention-fields@
    """

    model_type = "nprf_bert"

    def __init__(self, **kwargs) -> None:
        ATTENTION_SCHEMA.configure(self, kwargs, check_combinations)
        super().__init__(**{"auto_map": dict(AUTO_MAP), **kwargs})


__all__ = ["NPRFBertConfig"]
