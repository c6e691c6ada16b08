"""Linear GPT: a decoder-only causal LM with kernelized (linear) attention.

Trains in parallel and decodes as an RNN with a constant-size state per layer (Katharopoulos et
al. 2020): both are one call of :func:`kernelized_attention` (``causal=True``) continuing from
the layer's state in :class:`LinearGPTCache`. Pre-norm blocks, GPT-2 style (LayerNorm, GELU MLP)
or Llama style (``norm_type="rmsnorm"``, ``mlp_type="gated"``, ``num_key_value_heads``).
Positions: a learned absolute table, ``"rotary"`` features, Llama's ``"rope"`` or none,
optionally with a clipped causal bias (``rpe="learned"``).

Rotary on features (RoFormer, Su et al. 2021)::

    out_i = sum_{j<=i} (R_i phi(q_i) . R_j phi(k_j)) v_j / (sum_{j<=i} phi(q_i) . phi(k_j) + eps)

The denominator keeps the positive, un-rotated features (``q_den``, ``k_den``); the state carries
``S = sum R_j phi(k_j) v_j^T`` and ``z = sum phi(k_j)``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .attention import KernelizedSelfAttention
from .cache import CACHE_FIELD, UNSET, LinearGPTCache, LinearGPTCacheLayer, cache_argument, is_linear_gpt_cache
from .configuration_linear_gpt import LinearGPTConfig, check_attn_backend
from .decoding import after_module_step, decoding_step
from .dispatch import get_backend
from .feature_maps import FeatureMap, feature_maps_step
from .positional import RelativePositionBias1D, apply_rotary, rotary_cos_sin  # noqa: F401  (apply_rotary: public here)
from .pretrained import (
    HiddenStates,
    KernelizedPreTrainedModel,
    drop_default_generation_attentions,
    eager_checks,
    refuse_output_attentions,
)

def dropout(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, skipping the call where nothing drops (a decoding step makes many)."""
    return module(x) if module.training and module.p > 0 else x


# ----------------------------------------------------------------------------- layers


class LinearGPTAttention(KernelizedSelfAttention):
    """Causal kernelized self-attention continuing from the layer's state: training, prefill,
    continuation and one-token decoding differ only in the state they start from."""

    def __init__(self, config: LinearGPTConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx=layer_idx, causal=True)
        self.rotary = config.position_embedding_type == "rotary"
        self.rope = config.position_embedding_type == "rope"
        self.rpe = (
            RelativePositionBias1D(config.num_attention_heads, config.max_relative_position)
            if config.rpe == "learned"
            else None
        )
        # keys a decoding state keeps apart for the bias clipped at K (None: no bias)
        self.window = config.max_relative_position - 1 if self.rpe is not None else None
        self.dropout = nn.Dropout(config.attn_pdrop)
        self._position_embedding_type = config.position_embedding_type
        self.call_backend(continuing=False)  # a backend that cannot serve this model fails here

    def call_backend(self, continuing: bool) -> str:
        """``attn_backend``, checked against this model's options (a backend may be
        re-registered); a call from a state runs ``auto`` unless that backend carries state."""
        if self.backend == "auto":
            return "auto"
        check_attn_backend(
            self.backend, rpe="learned" if self.rpe is not None else "none",
            max_relative_position=self.rpe.max_relative_position if self.rpe is not None else 0,
            position_embedding_type=self._position_embedding_type, softmax_window=self.softmax_window,
        )
        return "auto" if continuing and not get_backend(self.backend).state else self.backend


# the same function as one fused kernel (GPT-2's gelu_new is torch's tanh GELU; float64 agrees to rounding)
_FUSED_ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh"}


def activation(name: str) -> nn.Module:
    """The MLP activation ``hidden_act`` names, in its fused form where torch has one."""
    return ACT2FN[_FUSED_ACTIVATIONS.get(name, name)]


class LinearGPTMLP(nn.Module):
    """``(B, N, C) -> (B, N, C)``: Linear, activation, Linear, dropout (``mlp_type="standard"``)."""

    def __init__(self, config: LinearGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.dropout, self.c_proj(self.act(self.c_fc(x))))


class LinearGPTGatedMLP(nn.Module):
    """``(B, N, C) -> (B, N, C)``: ``down_proj(act(gate_proj(x)) * up_proj(x))``, dropout
    (``mlp_type="gated"``, Llama's MLP)."""

    def __init__(self, config: LinearGPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.dropout, self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


class LinearGPTRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (``norm_type="rmsnorm"``, Llama's
    RMSNorm), computed in float32 at least (float64 stays float64)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def make_norm(config: LinearGPTConfig) -> nn.Module:
    """The block / final normalisation ``norm_type`` names."""
    if config.norm_type == "rmsnorm":
        return LinearGPTRMSNorm(config.hidden_size, config.layer_norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class LinearGPTBlock(GradientCheckpointingLayer):
    """Pre-norm decoder block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: LinearGPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = LinearGPTAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = LinearGPTGatedMLP(config) if config.mlp_type == "gated" else LinearGPTMLP(config)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: Optional[torch.Tensor] = None,
        rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        past_key_values: Optional[LinearGPTCacheLayer] = None,
        projection: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``(B, N, C) -> (B, N, C)``; ``past_key_values``: this layer's state or None;
        ``projection``: read by the caller, so a checkpointed block recomputes with its forward's."""
        # inside a checkpointed block the backward recomputes the attention already
        recompute = False if self.gradient_checkpointing and self.training else None
        attn = self.attn(
            self.ln_1(hidden_states), attention_mask=key_mask, rotary=rotary, past_key_values=past_key_values,
            projection=projection, recompute=recompute,
        )
        hidden_states = hidden_states + dropout(self.resid_dropout, attn)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


# ----------------------------------------------------------------------------- models


class LinearGPTPreTrainedModel(KernelizedPreTrainedModel):
    """Weight init, config class and capabilities of the Linear GPT models. Stateful
    (``_is_stateful``): the RNN state cannot forget tokens, so ``generate()`` refuses assisted
    and prompt-lookup decoding."""

    config_class = LinearGPTConfig
    config: LinearGPTConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["LinearGPTBlock"]
    _is_stateful = True
    lora_mlp_modules = ("c_fc", "c_proj", "gate_proj", "up_proj", "down_proj")  # LoRA targets of the MLP (see lora_target_modules)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        self._init_window_weights(module)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, LinearGPTRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, RelativePositionBias1D):
            nn.init.zeros_(module.weight)
        elif isinstance(module, FeatureMap):
            self._init_feature_map(module)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """False: ``forward`` builds the :class:`LinearGPTCache`. Generate's own
        ``DynamicCache(config=...)`` would hold transformers' ``LinearAttentionLayer``, which
        counts no positions (its ``get_seq_length()`` refuses)."""
        return False


def _normalize_attention_mask(
    attention_mask: object, batch: int, n: int, past: int, check_values: bool = True
) -> Optional[torch.Tensor]:
    """An HF mask -> a ``(B, past + N)`` or ``(B, N)`` long 1 / 0 tensor, or None; dict and 4D
    masks reduce to the last query row. ``check_values`` refuses values other than 0/1 (they
    would shift the position ids)."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, dict):  # a compileable-cache mask mapping: take any entry
        attention_mask = next((m for m in attention_mask.values() if m is not None), None)
        if attention_mask is None:
            return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor of shape (batch, seq), got {type(attention_mask).__name__}")
    if attention_mask.dim() == 4:  # (B, 1, Q, KV): bool keep, or additive float (0 keep)
        last = attention_mask[:, 0, -1, :]
        attention_mask = last if last.dtype == torch.bool else (last == 0)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in (n, past + n):
        raise ValueError(
            f"attention_mask must have shape (batch, past + seq) = ({batch}, {past + n}) or (batch, seq) = "
            f"({batch}, {n}) with 1 = keep and 0 = padding, got {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask.long()
    if check_values:
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError(
                f"attention_mask must hold only 1 (keep) and 0 (padding), got values in "
                f"[{attention_mask.min().item()}, {attention_mask.max().item()}] (dtype {attention_mask.dtype})"
            )
        return attention_mask.long()
    return (attention_mask != 0).long()


def _refuse_foreign_cache(past_key_values: object) -> None:
    """``TypeError`` unless ``past_key_values`` is None or a cache of Linear GPT layers."""
    if past_key_values is not None and not is_linear_gpt_cache(past_key_values):
        raise TypeError(
            "past_key_values must be a LinearGPTCache (the state returned by this model) or None, got "
            f"{type(past_key_values).__name__}; Linear GPT keeps a recurrent state, not keys and values"
        )


def _check_cache(cache: LinearGPTCache, model: "LinearGPTModel", batch: int) -> None:
    """``ValueError`` unless ``cache`` was made by a model of this layout for this batch (shapes
    only: no host sync)."""
    cfg = model.config
    attn = model.h[0].attn
    if len(cache.layers) != cfg.num_hidden_layers:
        raise ValueError(f"past_key_values has {len(cache.layers)} layers, the model {cfg.num_hidden_layers}")
    window = cache.layers[0].window
    if window != UNSET and window != attn.window:
        def describe(w: Optional[int]) -> str:
            return (f"a relative-position window of {w} keys (rpe='learned', max_relative_position={w + 1})"
                    if w is not None else "no relative-position window (rpe='none')")
        raise ValueError(
            f"past_key_values was made by a model with {describe(window)}; this model has "
            f"{describe(attn.window)}: a decoding state only continues in the model that made it"
        )
    hybrid = cache.layers[0].softmax_window
    if window != UNSET and hybrid != attn.softmax_window:
        def describe_hybrid(w: Optional[int]) -> str:
            return f"a softmax window of W={w} keys" if w is not None else "no softmax window"
        raise ValueError(
            f"past_key_values was made by a model with {describe_hybrid(hybrid)}; this model has "
            f"{describe_hybrid(attn.softmax_window)}: a decoding state only continues in the model that made it"
        )
    rows = cache.layers[0].batch_size
    if rows is not None and rows != batch:
        raise ValueError(f"past_key_values holds a batch of {rows} rows, the inputs have {batch}")
    state = cache.layers[0].get_state(ordered=False) if getattr(cache.layers[0], "keeps_window_ring", False) \
        else cache.layers[0].get_state()
    want = (attn.num_heads, attn.feature_map.num_features, attn.head_dim)
    if state is not None and tuple(state.kv.shape[1:]) != want:
        raise ValueError(
            f"past_key_values holds states of (heads, feature size, head size) = {tuple(state.kv.shape[1:])}, this "
            f"model needs {want}: a decoding state only continues in the model that made it"
        )


class LinearGPTModel(LinearGPTPreTrainedModel):
    """The decoder stack: embeddings, ``num_hidden_layers`` blocks, final LayerNorm.

    ``forward`` returns ``last_hidden_state (B, N, C)`` and, with ``use_cache``, the recurrent
    state as ``past_key_values`` (a :class:`LinearGPTCache`).
    """

    def __init__(self, config: LinearGPTConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "absolute"
            else None
        )
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([LinearGPTBlock(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = make_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LinearGPTCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        cache: Optional[LinearGPTCache] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """Args:
            input_ids: ``(B, N)`` token ids, or ``inputs_embeds`` ``(B, N, C)``.
            attention_mask: ``(B, past + N)`` or ``(B, N)``, 1 keep, 0 padding (left padding).
            position_ids: ``(B, N)``; default: real tokens counted along the mask (as
                ``generate()`` does); with a mask of the new tokens only, or none, counted on from
                ``past_key_values.get_seq_length()`` (earlier padding included).
            past_key_values: a :class:`LinearGPTCache` from an earlier call (or a ``Cache`` of
                :class:`~cache.LinearGPTCacheLayer`), or None.
            use_cache: return the updated state (default ``config.use_cache``).
            output_hidden_states: also return every layer's input and the final output.
            output_attentions: must be False/None (no attention weights).
            cache: ``past_key_values`` under transformers' name from 5.24 (give one).
            kwargs: what transformers passes besides (``cache_position``); unused.
        Returns:
            :class:`BaseModelOutputWithPast` (``last_hidden_state (B, N, C)``, ``past_key_values``).

        Value checks (token ids, mask values) run in eager mode, not on one-token steps from a
        state (no host sync per token).
        """
        cfg = self.config
        past_key_values = cache_argument(past_key_values, cache)
        refuse_output_attentions("Linear GPT", output_attentions, cfg)
        return_dict = cfg.return_dict if return_dict is None else return_dict
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
                raise TypeError(f"input_ids must be an integer torch.Tensor of shape (batch, seq), got {type(input_ids).__name__}"
                                + (f" of dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else ""))
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
        elif not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
            raise ValueError(f"inputs_embeds must be a tensor of shape (batch, seq, hidden_size={cfg.hidden_size})")
        batch, n = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if batch < 1 or n < 1:
            raise ValueError(
                f"input_ids / inputs_embeds must have batch >= 1 and seq >= 1, got batch={batch}, seq={n}"
            )
        _refuse_foreign_cache(past_key_values)
        if past_key_values is not None:
            _check_cache(past_key_values, self, batch)
        check_values = eager_checks() and not (
            past_key_values is not None and past_key_values.get_seq_length() > 0 and n == 1
        )
        if input_ids is not None:
            if check_values and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
                raise ValueError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}), got values in "
                                 f"[{int(input_ids.min())}, {int(input_ids.max())}]")
            inputs_embeds = self.wte(input_ids)
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = LinearGPTCache(cfg.num_hidden_layers, self.h[0].attn.window, self.h[0].attn.softmax_window)
        cache = past_key_values if use_cache or past_key_values is not None else None
        past = cache.get_seq_length() if cache is not None else 0

        mask = _normalize_attention_mask(attention_mask, batch, n, past, check_values=check_values)
        if mask is not None:
            mask = mask.to(inputs_embeds.device)
        mask_new = None if mask is None else mask[:, -n:]
        given_positions = position_ids is not None
        if position_ids is None:
            # as generate() makes them (see the docstring)
            if mask is not None:
                position_ids = ((past if mask.shape[1] == n else 0) + mask.cumsum(-1) - 1).clamp(min=0)[:, -n:]
            else:
                position_ids = torch.arange(past, past + n, device=inputs_embeds.device)[None].expand(batch, n)
        elif not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != n:
            raise ValueError(f"position_ids must be a tensor of shape (batch, seq) = ({batch}, {n})")
        position_ids = position_ids.to(inputs_embeds.device).expand(batch, n)
        if mask_new is None:
            key_mask = None
        elif check_values:  # skip the masking work when nothing is padded (a host sync: not per token)
            key_mask = None if bool(mask_new.all()) else mask_new.bool()
        else:
            key_mask = mask_new.bool()  # multiplying by an all-ones mask changes nothing

        hidden = inputs_embeds
        if self.wpe is not None:
            # default positions stay below past + n: read them only beyond it; given ones outside
            # one-token steps (no host sync per token)
            if ((given_positions and check_values) or past + n > cfg.max_position_embeddings) and eager_checks() and (
                int(position_ids.max()) >= cfg.max_position_embeddings
            ):
                raise ValueError(
                    f"position {int(position_ids.max())} is beyond max_position_embeddings={cfg.max_position_embeddings} "
                    "(use position_embedding_type='rotary' or 'none' for unbounded lengths)"
                )
            hidden = hidden + self.wpe(position_ids)
        hidden = dropout(self.drop, hidden)
        rotary = None
        if cfg.position_embedding_type in ("rotary", "rope"):
            attn = self.h[0].attn
            dim = attn.feature_map.num_features if cfg.position_embedding_type == "rotary" else attn.head_dim
            rotary = rotary_cos_sin(position_ids, dim, cfg.rotary_base, torch.float64 if hidden.dtype == torch.float64 else torch.float32)

        feature_maps_step(self)  # once per top-level forward (training only)
        collected = HiddenStates(output_hidden_states, len(self.h))
        for i, block in enumerate(self.h):
            collected.add(hidden)
            layer_state = cache.layers[i] if cache is not None else None
            # read outside the block's checkpoint: the backward recomputes with this forward's features
            hidden = block(
                hidden, key_mask=key_mask, rotary=rotary, past_key_values=layer_state,
                projection=block.attn.feature_map.projection,
            )
        hidden = self.ln_f(hidden)
        collected.add(hidden)
        all_hidden = collected.result()
        if cache is not None:
            for layer in cache.layers:
                layer.cumulative_length += n
        out_cache = cache if use_cache else None
        if not return_dict:
            return tuple(x for x in (hidden, out_cache, all_hidden) if x is not None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            **{CACHE_FIELD: out_cache},
            hidden_states=all_hidden,
        )


# ----------------------------------------------------------------------------- causal LM


class LinearGPTForCausalLM(LinearGPTPreTrainedModel, GenerationMixin):
    """Linear GPT with a language-modelling head; works with ``generate()`` (greedy, sampling,
    beam search, streaming) using its recurrent state as ``past_key_values``."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: LinearGPTConfig) -> None:
        super().__init__(config)
        self.transformer = LinearGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def generate(self, inputs: Optional[torch.Tensor] = None, *args, **kwargs):
        """``GenerationMixin.generate`` after checking ``past_key_values`` (a
        :class:`LinearGPTCache`) and ``attention_mask`` (covering the input, or past + input)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        past = cache_argument(kwargs.get("past_key_values"), kwargs.get("cache"))
        _refuse_foreign_cache(past)
        if CACHE_FIELD == "past_key_values" and kwargs.get("cache") is not None:
            # transformers before 5.24 knows the state only as past_key_values (it would not crop the inputs)
            kwargs["past_key_values"] = kwargs.pop("cache")
        mask = kwargs.get("attention_mask")
        if mask is not None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise ValueError("attention_mask passed to generate must be a 2D tensor (batch, seq) of 1 keep / 0 padding")
            allowed = {ids.shape[1]} | ({past.get_seq_length() + ids.shape[1]} if past is not None else set())
            if mask.shape[0] != ids.shape[0] or mask.shape[1] not in allowed:
                raise ValueError(
                    f"attention_mask must have shape (batch, seq) = {tuple(ids.shape)}"
                    + (" or (batch, past + seq)" if past is not None else "")
                    + f" (1 = keep, 0 = padding), got {tuple(mask.shape)}"
                )
        drop_default_generation_attentions("Linear GPT", self.generation_config, kwargs)
        return super().generate(inputs, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: Optional[int] = None,
        past_key_values: Optional[LinearGPTCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        is_first_iteration: Optional[bool] = False,
        cache: Optional[LinearGPTCache] = None,
        **kwargs,
    ) -> dict:
        """One ``generate()`` step's inputs: the tokens not in the state yet (or the prompt's
        ``inputs_embeds`` first), the full mask, the state, other keywords as given; no signature
        inspection or 4D mask per step (the state needs none)."""
        if inputs_embeds is not None and is_first_iteration:
            embeds = inputs_embeds[:, -next_sequence_length:] if next_sequence_length is not None else inputs_embeds
            model_inputs = {"input_ids": None, "inputs_embeds": embeds}
        else:
            model_inputs = {"input_ids": input_ids[:, -next_sequence_length:] if next_sequence_length is not None else input_ids}
        n = (model_inputs["inputs_embeds"] if model_inputs["input_ids"] is None else model_inputs["input_ids"]).shape[1]
        past_key_values = cache_argument(past_key_values, cache)
        if past_key_values is not None:
            model_inputs[CACHE_FIELD] = past_key_values
        position_ids = kwargs.pop("position_ids", None)
        if position_ids is not None:
            model_inputs["position_ids"] = position_ids[..., -n:]
        if attention_mask is not None:
            model_inputs["attention_mask"] = attention_mask
        for key, value in kwargs.items():
            if key not in ("labels", "next_sequence_length") and key not in model_inputs:
                model_inputs[key] = value
        return model_inputs

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LinearGPTCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        output_attentions: Optional[bool] = None,
        cache: Optional[LinearGPTCache] = None,
        **kwargs,
    ) -> Union[CausalLMOutputWithPast, tuple]:
        """Args as :meth:`LinearGPTModel.forward`, plus:
            labels: ``(B, N)`` next-token targets (shifted inside; -100 ignored).
            logits_to_keep: ``k``: logits of the last ``k`` positions only (0: all), or a 1D tensor
                of positions.
            kwargs: loss arguments for ``self.loss_function`` (``num_items_in_batch``: the sum over
                the batch divided by it, for gradient accumulation; ``shift_labels``: targets
                aligned with the logits); what ``generate()`` passes besides is unused.
        Returns:
            :class:`CausalLMOutputWithPast`: ``logits (B, N_kept, vocab)``, ``loss``, ``past_key_values``.

        One-token steps from a cache without autograd run, after the first, through the cache's
        decoding plan (``decoding.py``: the same operations, the same results).
        """
        past_key_values = cache_argument(past_key_values, cache)
        step = (past_key_values is not None and labels is None and inputs_embeds is None
                and type(input_ids) is torch.Tensor and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.jit.is_tracing())
        if step:
            out = decoding_step(self, input_ids, attention_mask, position_ids, past_key_values, use_cache,
                                output_hidden_states, return_dict, logits_to_keep, output_attentions)
            if out is not None:
                return out
        elif isinstance(past_key_values, LinearGPTCache):
            past_key_values.decoding_plan = None  # any other call from the cache: its plan is made again
        out = self._forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache,
                            output_hidden_states, return_dict, logits_to_keep, output_attentions, **kwargs)
        if step:
            after_module_step(self, past_key_values, input_ids.shape[0])
        return out

    def _forward(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache,
                 output_hidden_states, return_dict, logits_to_keep, output_attentions, **kwargs):
        """:meth:`forward` through the modules."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, torch.Tensor)):
            raise TypeError(f"logits_to_keep must be an int or a 1D tensor of positions, got {type(logits_to_keep).__name__}")
        if isinstance(logits_to_keep, int) and logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0 (0 = all positions), got {logits_to_keep}")
        out = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            output_attentions=output_attentions,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            if labels.shape != hidden.shape[:2]:
                raise ValueError(f"labels must have shape (batch, seq) = {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
            full = logits if logits.shape[1] == hidden.shape[1] else self.lm_head(hidden)
            shift_labels = kwargs.get("shift_labels")
            if shift_labels is not None and tuple(shift_labels.shape) != tuple(labels.shape):
                raise ValueError(
                    f"shift_labels must have the shape of labels {tuple(labels.shape)}, got {tuple(shift_labels.shape)}"
                )
            loss = self.loss_function(full, labels, vocab_size=self.config.vocab_size, **kwargs)
        if not return_dict:
            rest = tuple(x for x in (getattr(out, CACHE_FIELD), out.hidden_states) if x is not None)
            return ((loss,) if loss is not None else ()) + (logits,) + rest
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)}, hidden_states=out.hidden_states
        )


__all__ = ["LinearGPTPreTrainedModel", "LinearGPTModel", "LinearGPTForCausalLM", "LinearGPTCache"]
