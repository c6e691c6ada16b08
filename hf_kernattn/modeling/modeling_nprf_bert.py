"""NPRF-BERT: BERT with normalised positive-random-feature attention and a learnable
relative-position bias ``b_{j-i}`` clipped at K (Luo et al. 2021, Algorithm 1): O(N log N) by
FFT or exactly O(N K) windowed, as ``auto`` picks per length.

BERT's layout: post-norm blocks, pooler on the first token, MLM head tied to the embeddings. The
bias table is one per model (``rpe_shared_across_layers``, the paper's choice) or per layer.
Padding removes a key from every query's numerator and denominator, and the bias depends only on
``j - i``, so real positions of a right-padded batch match the unpadded sequences. Shapes: ``B``
batch, ``N`` sequence, ``C`` hidden size, ``V`` vocab.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from .kernels_hybrid import hybrid_attention  # noqa: F401  (registers the hybrid backend: softmax_window)
from .attention import KernelizedSelfAttention
from .attention_inputs import check_attention_mask
from .configuration_nprf_bert import NPRFBertConfig
from .feature_maps import FeatureMap, feature_maps_step
from .positional import RelativePositionBias1D
from .pretrained import HiddenStates, KernelizedPreTrainedModel, classification_loss, eager_checks, refuse_output_attentions


class NPRFBertEmbeddings(nn.Module):
    """Word + token-type (+ absolute position) embeddings, then LayerNorm and dropout.

    ``input_ids (B, N)`` or ``inputs_embeds (B, N, C)`` -> ``(B, N, C)``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.use_absolute = config.position_embedding_type == "absolute"
        self.max_positions = config.max_position_embeddings
        if self.use_absolute:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.type_vocab_size = config.type_vocab_size
        self.vocab_size = config.vocab_size

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        b, n = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        if token_type_ids is None:
            token_type_ids = torch.zeros((b, n), dtype=torch.long, device=device)
        emb = inputs_embeds + self.token_type_embeddings(token_type_ids)
        if self.use_absolute:
            if position_ids is None:
                if n > self.max_positions:
                    raise ValueError(
                        f"input_ids has {n} positions but max_position_embeddings is {self.max_positions}; "
                        "use position_embedding_type='none' for longer inputs"
                    )
                position_ids = torch.arange(n, device=device)[None, :]
            emb = emb + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(emb))


class NPRFBertLayer(GradientCheckpointingLayer):
    """Post-norm encoder block (BERT): attention and feed-forward, each with residual, dropout and
    LayerNorm. ``(B, N, C) -> (B, N, C)``. Under gradient checkpointing the attention's own
    recomputation is off (its projections run twice, not three times)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.attention = KernelizedSelfAttention(config, layer_idx=layer_idx, causal=False)
        self.max_relative_position = config.max_relative_position
        self.attention_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act] if isinstance(config.hidden_act, str) else config.hidden_act
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rpe = (
            RelativePositionBias1D(config.num_attention_heads, config.max_relative_position)
            if config.rpe == "learned" and not config.rpe_shared_across_layers
            else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rpe_bias: Optional[torch.Tensor] = None,
        projection: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``hidden_states (B, N, C)``, ``attention_mask (B, N)`` or None; ``rpe_bias``: the shared
        table ``(H, 2K+1)`` or ``(H, 2N-1)`` (ignored when the layer has its own); ``projection``:
        read by the caller, so a checkpointed layer recomputes with its forward's."""
        if self.rpe is not None:
            rpe_bias = self.rpe.weight
        # a table clipped at K: long inputs may use the O(N K) windowed backend
        clip = self.max_relative_position if rpe_bias is not None else None
        # inside a checkpointed layer the backward recomputes the block already
        recompute = False if self.gradient_checkpointing and self.training else None
        attn = self.attention(
            hidden_states, attention_mask=attention_mask, rpe_bias=rpe_bias, rpe_clip=clip, recompute=recompute,
            projection=projection,
        )
        hidden_states = self.attention_norm(hidden_states + self.attention_dropout(attn))
        ff = self.output(self.act(self.intermediate(hidden_states)))
        return self.output_norm(hidden_states + self.output_dropout(ff))


class NPRFBertPooler(nn.Module):
    """``tanh(W h_0 + b)`` on the first token: ``(B, N, C) -> (B, C)``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class NPRFBertLMHead(nn.Module):
    """BERT's MLM head: dense + act + LayerNorm, then the decoder to the vocabulary (weight tied
    to the word embeddings). ``(B, N, C) -> (B, N, V)``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act] if isinstance(config.hidden_act, str) else config.hidden_act
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.LayerNorm(self.act(self.dense(hidden_states))))


MASK_FORMS = (
    "attention_mask must be (batch, seq) with 1 = keep and 0 = padding, or a 4D padding mask of shape "
    "(batch, 1, 1, seq) or (batch, 1, seq, seq), bool (True = keep) or additive float (0 = keep, a large "
    "negative value such as torch.finfo(dtype).min or -inf = padding), with the same keys masked for every query"
)


def _key_mask_from_4d(attention_mask: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """BERT's extended mask ``(B, 1, 1, N)`` / ``(B, 1, N, N)`` -> the ``(B, N)`` bool key mask;
    ``ValueError`` for a mask that is not a padding mask."""
    if attention_mask.shape[0] != b or attention_mask.shape[1] != 1 or attention_mask.shape[2] not in (1, n) or (
        attention_mask.shape[3] != n
    ):
        raise ValueError(f"{MASK_FORMS}; batch={b}, seq={n}, got shape {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    elif attention_mask.is_floating_point():
        # additive: 0 keeps a key; BERT uses finfo.min (older code -10000)
        keep = attention_mask == 0
        if eager_checks() and bool(((attention_mask != 0) & (attention_mask > -1e4)).any()):
            raise ValueError(f"{MASK_FORMS}; this float mask holds values other than 0 and large negatives "
                             "(a soft bias is not a padding mask)")
    else:
        keep = attention_mask != 0
        if eager_checks() and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError(f"{MASK_FORMS}; this integer mask holds values other than 0 and 1")
    keep = keep[:, 0]  # (B, Q, N)
    if eager_checks() and keep.shape[1] > 1 and not bool((keep == keep[:, :1]).all()):
        raise ValueError(f"{MASK_FORMS}; this mask differs between query rows (not a padding mask)")
    return keep[:, 0]


def _check_inputs(
    config,
    input_ids: Optional[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    token_type_ids: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """Check the encoder inputs; returns the ``(B, N)`` mask (a 4D padding mask reduced). Value
    checks run in eager mode only."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids (B, N) or inputs_embeds (B, N, hidden_size)")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of shape (batch, seq), got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        b, n = input_ids.shape
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3:
            raise ValueError("inputs_embeds must be a tensor of shape (batch, seq, hidden_size)")
        if inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(
                f"inputs_embeds must have last dim hidden_size={config.hidden_size}, got {tuple(inputs_embeds.shape)}"
            )
        b, n = inputs_embeds.shape[:2]
    if b < 1 or n < 1:
        raise ValueError(
            f"input_ids / inputs_embeds must have at least one sequence and one position, got batch={b}, seq={n}"
        )
    if input_ids is not None and eager_checks() and (
        int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size
    ):
        raise ValueError(f"input_ids must lie in [0, vocab_size={config.vocab_size})")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        attention_mask = _key_mask_from_4d(attention_mask, b, n)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        raise ValueError(f"{MASK_FORMS}; got shape {tuple(attention_mask.shape)}")
    check_attention_mask(attention_mask, b, n)
    if token_type_ids is not None:
        if not isinstance(token_type_ids, torch.Tensor) or tuple(token_type_ids.shape) != (b, n):
            raise ValueError(f"token_type_ids must be a tensor of shape (batch, seq) = ({b}, {n})")
        if eager_checks() and (int(token_type_ids.min()) < 0 or int(token_type_ids.max()) >= config.type_vocab_size):
            raise ValueError(f"token_type_ids must lie in [0, type_vocab_size={config.type_vocab_size})")
    return attention_mask


class NPRFBertPreTrainedModel(KernelizedPreTrainedModel):
    """Weight init for every NPRF-BERT class: BERT's normal init; biases and the bias table at
    zero (normal with ``rpe_init_std > 0``); projections draw 0 of ``feature_seed``. Losses
    honour ``num_items_in_batch`` (the Trainer then does not rescale them)."""

    config_class = NPRFBertConfig
    config: NPRFBertConfig
    base_model_prefix = "nprf_bert"
    _no_split_modules = ["NPRFBertLayer"]
    _keys_to_ignore_on_load_unexpected = [r"position_ids"]
    lora_mlp_modules = ("intermediate", "output")  # LoRA targets of the MLP (see lora_target_modules)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        self._init_window_weights(module)
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, RelativePositionBias1D):
            if self.config.rpe_init_std > 0:
                init.normal_(module.weight, mean=0.0, std=self.config.rpe_init_std)
            else:
                init.zeros_(module.weight)
        elif isinstance(module, FeatureMap):
            self._init_feature_map(module)


class NPRFBertModel(NPRFBertPreTrainedModel):
    """The bare encoder: ``input_ids (B, N)`` -> ``last_hidden_state (B, N, C)`` and
    ``pooler_output (B, C)`` (when ``add_pooling_layer``)."""

    def __init__(self, config: NPRFBertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = NPRFBertEmbeddings(config)
        self.rpe = (
            RelativePositionBias1D(config.num_attention_heads, config.max_relative_position)
            if config.rpe == "learned" and config.rpe_shared_across_layers
            else None
        )
        self.layers = nn.ModuleList([NPRFBertLayer(config, i) for i in range(config.num_hidden_layers)])
        self.pooler = NPRFBertPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPooling, tuple]:
        """Args:
            input_ids: ``(B, N)`` token ids (or ``inputs_embeds (B, N, C)``).
            attention_mask: ``(B, N)`` 1 keep / 0 padding, or BERT's extended padding mask
                ``(B, 1, 1, N)`` / ``(B, 1, N, N)`` (bool True or additive 0: keep).
            token_type_ids: ``(B, N)`` segment ids.
            position_ids: ``(B, N)`` or ``(1, N)`` absolute positions (default ``0..N-1``).
            output_hidden_states: also return the ``L + 1`` hidden states ``(B, N, C)``.
            output_attentions: must be False/None (no attention weights).
        Returns:
            ``BaseModelOutputWithPooling`` with ``last_hidden_state (B, N, C)`` and
            ``pooler_output (B, C)`` or None.
        """
        refuse_output_attentions("NPRF-BERT", output_attentions, self.config)
        attention_mask = _check_inputs(self.config, input_ids, inputs_embeds, attention_mask, token_type_ids)
        feature_maps_step(self)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        hidden = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)
        # the table clipped at K itself (H, 2K+1): the core expands it only where a backend needs it
        rpe_bias = self.rpe.weight if self.rpe is not None else None
        collected = HiddenStates(output_hidden_states, len(self.layers))
        collected.add(hidden)
        for layer in self.layers:
            # positional: gradient checkpointing tracks positional tensors (rpe_bias has a gradient);
            # the projection is read outside the layer's checkpoint
            hidden = layer(hidden, attention_mask, rpe_bias, projection=layer.attention.feature_map.projection)
            collected.add(hidden)
        all_hidden = collected.result()
        pooled = self.pooler(hidden) if self.pooler is not None else None
        if not return_dict:
            return tuple(x for x in (hidden, pooled, all_hidden) if x is not None)
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled, hidden_states=all_hidden)


class NPRFBertHeadModel(NPRFBertPreTrainedModel):
    """The task heads' base: encoder under ``nprf_bert``; ``forward`` encodes, applies
    :meth:`head` and, with ``labels``, :meth:`loss`, and returns :attr:`output_class` (or a tuple)."""

    output_class: type = ModelOutput

    def head(self, encoded: BaseModelOutputWithPooling) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def add_classifier(self, config: NPRFBertConfig, pooled: bool) -> None:
        """The encoder (with the pooler when ``pooled``), dropout (``classifier_dropout``, else
        ``hidden_dropout_prob``) and a linear layer to ``num_labels``."""
        self.num_labels = config.num_labels
        self.nprf_bert = NPRFBertModel(config, add_pooling_layer=pooled)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_hidden_states,
               output_attentions) -> BaseModelOutputWithPooling:
        """The encoder's output (always as a ``ModelOutput``)."""
        return self.nprf_bert(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states, return_dict=True,
            output_attentions=output_attentions,
        )

    def wrap(self, return_dict: Optional[bool], loss: Optional[torch.Tensor], hidden_states, **outputs):
        """:attr:`output_class` with ``outputs``, or with ``return_dict=False`` the tuple
        ``(loss?, *outputs, hidden_states?)`` as transformers models return it."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if not return_dict:
            rest = tuple(outputs.values()) + ((hidden_states,) if hidden_states is not None else ())
            return ((loss,) + rest) if loss is not None else rest
        return self.output_class(loss=loss, hidden_states=hidden_states, **outputs)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ):
        """Args as :meth:`NPRFBertModel.forward`, plus ``labels`` (see the class) and loss keywords
        (``num_items_in_batch``). Returns :attr:`output_class` (``loss``, ``logits``,
        ``hidden_states``)."""
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_hidden_states, output_attentions)
        logits = self.head(out)
        loss = self.loss(logits, labels, **kwargs) if labels is not None else None
        return self.wrap(return_dict, loss, out.hidden_states, logits=logits)


class NPRFBertForMaskedLM(NPRFBertHeadModel):
    """Encoder + BERT MLM head. ``labels (B, N)`` with -100 on unmasked positions give the
    cross-entropy loss; ``logits`` are ``(B, N, V)``."""

    _tied_weights_keys = {"lm_head.decoder.weight": "nprf_bert.embeddings.word_embeddings.weight"}
    output_class = MaskedLMOutput

    def __init__(self, config: NPRFBertConfig) -> None:
        super().__init__(config)
        self.nprf_bert = NPRFBertModel(config, add_pooling_layer=False)
        self.lm_head = NPRFBertLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head.decoder = new_embeddings

    def head(self, encoded: BaseModelOutputWithPooling) -> torch.Tensor:
        return self.lm_head(encoded.last_hidden_state)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        if tuple(labels.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"labels must have shape (batch, seq) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
        return self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)


class NPRFBertForSequenceClassification(NPRFBertHeadModel):
    """Pooled first token -> dropout -> linear: ``logits (B, num_labels)``. The loss follows
    BERT's ``problem_type`` (inferred from ``num_labels`` and the label dtype when unset):
    ``regression`` (MSE, ``(B,)`` / ``(B, 1)`` floats, ``num_labels == 1``),
    ``single_label_classification`` (cross-entropy, ``(B,)`` ids) or
    ``multi_label_classification`` (BCE with logits, ``(B, num_labels)`` 0/1 floats).
    """

    output_class = SequenceClassifierOutput

    def __init__(self, config: NPRFBertConfig) -> None:
        super().__init__(config)
        self.add_classifier(config, pooled=True)
        self.post_init()

    def head(self, encoded: BaseModelOutputWithPooling) -> torch.Tensor:
        return self.classifier(self.dropout(encoded.pooler_output))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        return classification_loss(self, logits, labels, **kwargs)


class NPRFBertForTokenClassification(NPRFBertHeadModel):
    """Per-token linear head: ``logits (B, N, num_labels)``; ``labels (B, N)`` with -100 ignored."""

    output_class = TokenClassifierOutput

    def __init__(self, config: NPRFBertConfig) -> None:
        super().__init__(config)
        self.add_classifier(config, pooled=False)
        self.post_init()

    def head(self, encoded: BaseModelOutputWithPooling) -> torch.Tensor:
        return self.classifier(self.dropout(encoded.last_hidden_state))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.loss_function(logits, labels, self.config, **kwargs)


class NPRFBertForQuestionAnswering(NPRFBertHeadModel):
    """Extractive QA (SQuAD style): ``start_logits, end_logits (B, N)``; with ``start_positions``
    and ``end_positions (B,)`` the loss is the mean of the two cross-entropies (positions outside
    the input are ignored, as in BERT)."""

    output_class = QuestionAnsweringModelOutput

    def __init__(self, config: NPRFBertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        if config.num_labels != 2:
            raise ValueError(f"num_labels must be 2 (start, end) for question answering, got {config.num_labels}")
        self.nprf_bert = NPRFBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(  # type: ignore[override]
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        start_positions: Optional[torch.Tensor] = None,
        end_positions: Optional[torch.Tensor] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        **kwargs,
    ) -> Union[QuestionAnsweringModelOutput, tuple]:
        """Args as :meth:`NPRFBertModel.forward`, plus ``start_positions``, ``end_positions``
        ``(B,)`` for the loss."""
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_hidden_states, output_attentions)
        logits = self.qa_outputs(out.last_hidden_state)
        start_logits, end_logits = (x.squeeze(-1).contiguous() for x in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            start_positions = start_positions.reshape(-1).to(start_logits.device)
            end_positions = end_positions.reshape(-1).to(end_logits.device)
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        return self.wrap(return_dict, loss, out.hidden_states, start_logits=start_logits, end_logits=end_logits)


__all__ = [
    "NPRFBertPreTrainedModel",
    "NPRFBertHeadModel",
    "NPRFBertModel",
    "NPRFBertForMaskedLM",
    "NPRFBertForSequenceClassification",
    "NPRFBertForTokenClassification",
    "NPRFBertForQuestionAnswering",
]
