"""Linear GPT: a decoder-only causal LM with kernelized (linear) attention.

Trains in parallel and decodes as an RNN with a constant-size state per layer (Katharopoulos
et al. 2020): both are one call of the shared core (:func:`kernelized_attention` with
``causal=True``), which continues from the layer's state and returns the next one; the state is
stored in :class:`LinearGPTCache` (``past_key_values``), wired into ``transformers``'
``generate()``. ``attn_backend`` (the ``auto`` rule is documented with the config's shared
attention fields) runs every call that starts without a state (training and prefill, with or
without ``use_cache``); calls that continue from a state use it when it carries a state,
``auto``'s choice among those that do otherwise.

Blocks are pre-norm (norm, attention, norm, MLP): GPT-2 style by default (LayerNorm, GELU MLP)
or Llama style (``norm_type="rmsnorm"``, ``mlp_type="gated"``, grouped-query attention through
``num_key_value_heads``). Positions are either a learned absolute table (default), rotations
applied to the feature-mapped queries and keys (``position_embedding_type="rotary"``), Llama's
rotations of the queries and keys before the feature map (``"rope"``), or none, optionally with
a learned causal relative bias (``rpe="learned"``).

Rotary on features (RoFormer, Su et al. 2021, linear-attention form)::

    out_i = sum_{j<=i} (R_i phi(q_i) . R_j phi(k_j)) v_j / (sum_{j<=i} phi(q_i) . phi(k_j) + eps)

The rotated features are signed, so the denominator uses the un-rotated (positive) ones (the
core's separate denominator features ``q_den``, ``k_den``); the state then carries
``S = sum R_j phi(k_j) v_j^T`` and ``z = sum phi(k_j)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections import OrderedDict
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from transformers import GenerationMixin
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .attention import KernelizedSelfAttention
from .dispatch import decoding_step_spec, get_backend, hybrid_step_spec, registered_backend, zero_padded_token
from .kernels_common import per_head
from .kernels_hybrid import HybridState, _mask_padded, _step as hybrid_step, step_reshapes
from .kernels_common import step_constant
from .kernels_linear import recurrent_step, step_in_place, step_views
from .cache import CACHE_FIELD, UNSET, LinearGPTCache, LinearGPTCacheLayer, cache_argument, is_linear_gpt_cache
from .configuration_linear_gpt import LinearGPTConfig, check_attn_backend
from .feature_maps import FeatureMap, feature_maps_step
from .positional import RelativePositionBias1D, apply_rotary, rotary_cos_sin  # noqa: F401  (apply_rotary: public here)
from .registry import auto_version
from .pretrained import (
    KernelizedPreTrainedModel,
    drop_default_generation_attentions,
    eager_checks,
    refuse_output_attentions,
)

def dropout(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` where it can drop anything (training, p > 0); ``x`` otherwise, without the
    module call (a decoding step makes many of these)."""
    return module(x) if module.training and module.p > 0 else x


# ----------------------------------------------------------------------------- layers


class LinearGPTAttention(KernelizedSelfAttention):
    """Causal kernelized self-attention whose state carries over between calls.

    One call of the core for every case: project, apply the positions (rotary: rotated
    features in the numerator, the positive ones in the denominator; ``rpe="learned"``: the
    layer's bias clipped at K), then :func:`kernelized_attention` with the layer's state, which
    returns the state after these tokens. Training, prefill, continuation with many new tokens
    and one-token decoding differ only in the state they start from.
    """

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
        self._checked_backend = None  # the BackendSpec attn_backend was last checked as
        self.call_backend(continuing=False)  # a backend that cannot serve this model fails here

    def call_backend(self, continuing: bool) -> str:
        """The backend of a call: the configured ``attn_backend``, checked against this model's
        options (again when it was re-registered); for a call that continues from a state, the
        configured one if it carries a state, else ``auto`` (which picks one that does)."""
        if self.backend == "auto":
            return "auto"
        spec = get_backend(self.backend)
        if spec is not self._checked_backend:
            check_attn_backend(
                self.backend, rpe="learned" if self.rpe is not None else "none",
                max_relative_position=self.rpe.max_relative_position if self.rpe is not None else 0,
                position_embedding_type=self._position_embedding_type, softmax_window=self.softmax_window,
            )
            self._checked_backend = spec
        return "auto" if continuing and not spec.state else self.backend


# activations computed by one fused kernel: the same function (GPT-2's "gelu_new" is the tanh
# approximation of GELU that torch computes in one pass; float64 results agree to rounding)
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
        """``(B, N, C) -> (B, N, C)``; ``past_key_values`` is this layer's state (or None);
        ``projection`` the attention's random-feature projection, read by the caller so that a
        checkpointed block recomputes with the tensor of its forward even after a redraw."""
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
    """Weight init, config class and capabilities shared by the Linear GPT models.

    The model is stateful (``_is_stateful``): its decoding state is an RNN state that cannot
    forget tokens, so ``generate()`` refuses assisted and prompt-lookup decoding up front.
    ``output_attentions=True`` raises ``ValueError``: kernelized attention has no attention matrix.
    """

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
        """``generate()`` builds no cache: ``forward`` builds the :class:`LinearGPTCache` (a
        DynamicCache of recurrent-state layers), which generate then passes back. The cache
        generate would build, ``DynamicCache(config=...)``, holds for a ``"linear_attention"``
        layer type (the only recurrent one a config may declare) the stock
        ``LinearAttentionLayer``, which counts no positions: ``get_seq_length()``, which
        generate calls, refuses a cache of such layers only."""
        return False


def _normalize_attention_mask(
    attention_mask: object, batch: int, n: int, past: int, check_values: bool = True
) -> Optional[torch.Tensor]:
    """The HF mask -> ``(B, past + N)`` or ``(B, N)`` long tensor of 1 (keep) / 0 (padding), or
    None. Dicts / 4D masks are reduced to the key mask of the last query row. With
    ``check_values`` (eager calls outside the one-token decode step) any value other than 0/1
    is refused: a 2 or -1 would shift the position ids silently."""
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
    """``ValueError`` unless ``cache`` was made by a model of this layout (layers, relative-position
    window, heads, feature size, head size) for this batch. Shape checks only: no host sync."""
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
            input_ids: ``(B, N)`` token ids (or ``inputs_embeds`` ``(B, N, C)``, not both).
            attention_mask: ``(B, past + N)`` or ``(B, N)``, 1 keep, 0 padding (left padding).
            position_ids: ``(B, N)``; by default counted over real tokens along the mask (padding
                skipped; ``generate()`` passes them so); a mask of the N new tokens only, or none,
                counts from ``past_key_values.get_seq_length()`` (padding of earlier calls
                included): continue a left-padded batch with its ``(B, past + N)`` mask.
            past_key_values: a :class:`LinearGPTCache` from an earlier call (or any transformers
                ``Cache`` built of :class:`~cache.LinearGPTCacheLayer`), or None.
            use_cache: return the updated state (default ``config.use_cache``).
            output_hidden_states: also return every layer's input and the final output.
            output_attentions: must be False/None (there are no attention weights).
            cache: ``past_key_values`` under the name transformers passes it from 5.24 (give one).
            kwargs: what ``transformers`` passes besides (e.g. ``cache_position``); not used: the
                state counts its own positions.
        Returns:
            :class:`BaseModelOutputWithPast` (``last_hidden_state (B, N, C)``, ``past_key_values``).

        Value checks (token ids in range, mask values) run in eager mode and not on one-token
        decoding steps from an existing state, so decoding does not sync with the device per
        token; ``torch.export`` / ``torch.compile`` trace the model without them.
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
        # one-token steps from an existing state skip value checks (no host sync per decoded token)
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
            # as generate() makes them: real tokens counted along the (past + N) mask; a mask of the
            # N new tokens only counts from past (the earlier calls' padding included)
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
            # default positions count real tokens, so they stay below past + n: read them only beyond
            # that; given ones (generate() passes them every step) are read outside one-token steps,
            # like input_ids (no host sync per decoded token)
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
        all_hidden = [] if output_hidden_states else None
        for i, block in enumerate(self.h):
            if all_hidden is not None:
                all_hidden.append(hidden)
            layer_state = cache.layers[i] if cache is not None else None
            # the projection is read outside the block's checkpoint: a redraw installs a new tensor,
            # so a recomputation in the backward uses this forward's features
            hidden = block(
                hidden, key_mask=key_mask, rotary=rotary, past_key_values=layer_state,
                projection=block.attn.feature_map.projection,
            )
        hidden = self.ln_f(hidden)
        if all_hidden is not None:
            all_hidden.append(hidden)
        if cache is not None:
            for layer in cache.layers:
                layer.cumulative_length += n
        out_cache = cache if use_cache else None
        if not return_dict:
            return tuple(x for x in (hidden, out_cache, all_hidden) if x is not None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            **{CACHE_FIELD: out_cache},
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
        )


# ----------------------------------------------------------------------------- decoding steps


_INDEX_DTYPES = (torch.long, torch.int)
_STEP_DTYPES = (torch.float32, torch.float64)  # hidden states the step computes in (the state's dtype)
# what a module's call would run besides its forward (backward hooks do nothing where no gradient is recorded)
_GLOBAL_HOOKS = (_global_forward_hooks, _global_forward_pre_hooks)
_getitem, _version, _data_ptr = operator.getitem, operator.attrgetter("_version"), torch.Tensor.data_ptr
_training, _backend, _eps, _fused_of = (operator.attrgetter(name) for name in ("training", "backend", "eps", "_fused"))
_is = operator.is_
# modules whose forward does not depend on the training flag (the others' flags are compared per step)
_STATELESS = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.ModuleList)


_OUTPUT_FIELDS = dict.fromkeys(field.name for field in dataclasses.fields(CausalLMOutputWithPast))
_new_output, _set_output_item = OrderedDict.__new__, OrderedDict.__setitem__


def _step_output(logits: torch.Tensor, cache: Optional[LinearGPTCache]) -> CausalLMOutputWithPast:
    """``CausalLMOutputWithPast(logits=logits, <cache field>=cache)`` as the constructor makes it
    (the same items, in order, and attributes: every field, None where not given), without its
    per-field checks (a decoding step makes one per token)."""
    out = _new_output(CausalLMOutputWithPast)
    _set_output_item(out, "logits", logits)
    if cache is not None:
        _set_output_item(out, CACHE_FIELD, cache)
    fields = out.__dict__
    fields.update(_OUTPUT_FIELDS)
    fields["logits"], fields[CACHE_FIELD] = logits, cache
    return out


def _norm(module: nn.Module, params: Optional[dict], x: torch.Tensor, cudnn: bool) -> torch.Tensor:
    """``module(x)`` without the module call: ``params`` is the parameter dict of an
    ``nn.LayerNorm`` (:func:`_ln_params`; ``cudnn`` what ``F.layer_norm`` passes), None for a
    :class:`LinearGPTRMSNorm`."""
    if params is None:
        return LinearGPTRMSNorm.forward(module, x)
    return torch.layer_norm(x, module.normalized_shape, params["weight"], params["bias"], module.eps, cudnn)


class _DecodingSession:
    """One-token decoding steps of a :class:`LinearGPTForCausalLM` as flat torch calls: the
    operations of the module path (``forward`` through the blocks, the attention's
    ``_step`` and the core's in-place decoding step), in the same order on the same tensors, so
    logits and states are bitwise those of the module path, without its per-step Python layers
    (module calls, argument checks, cache objects, output classes per layer).

    Made after a one-token step ran through the modules (which checked the call and the state,
    made the fused projections and recorded the state's kind): ``start`` validates once what the
    steps may take for granted (the exact module classes: plain ``nn.Linear``, ``nn.Embedding``,
    ``nn.LayerNorm`` / :class:`LinearGPTRMSNorm`, the two MLPs; attention without a relative
    bias, a backend whose one-token steps are the core's decoding step, or, with the
    sliding-window hybrid (``softmax_window``, not with feature rotations), one whose steps are
    the built-in ``hybrid`` backend's (``kernels_hybrid._step`` in place on the window's ring;
    ``auto``'s choice is asked again per step); a ``LinearGPTCache`` of ``S, z`` states (and the
    hybrid's window) in the model's float32/float64 dtype, contiguous). Every
    step then compares what can change between calls (:meth:`current`): the modules in place,
    without hooks (nor global ones), none training or with a forward of its own; the fused
    projections still those of the parameters (versions and addresses); the state tensors (a
    new cache or reordered states, as beam search makes, are checked again, here); the
    attention's backend and eps; then per call the arguments (:meth:`step`). Anything else (a
    prefill, hidden states or attentions asked for, grad mode, autocast, compile/export tracing,
    other masks) runs the module path, which stays the reference; a call that is not a one-token
    step ends the session. Parameters are read from the modules at every step; derived copies
    (the fused projections) are compared as the attention does.

    Attributes that configure a layer beyond those (the feature map's kind, the head layout,
    the rotary base) are read when the session starts.
    """

    stale = False

    def __reduce__(self):  # never saved or copied with a model
        return (type(None), ())

    def __deepcopy__(self, memo):
        return None

    @classmethod
    def start(cls, model: "LinearGPTForCausalLM", cache: object, batch: int) -> Optional["_DecodingSession"]:
        """The session for ``model`` decoding from ``cache`` after a one-token step through the
        modules, or None where the fast path does not apply (see the class docstring)."""
        tr = model._modules.get("transformer")
        head = model._modules.get("lm_head")
        cfg = model.config
        if type(tr) is not LinearGPTModel or type(head) is not nn.Linear or cfg.position_embedding_type not in (
                "absolute", "none", "rope", "rotary"):
            return None
        wte, wpe, ln_f, blocks = (tr._modules.get(n) for n in ("wte", "wpe", "ln_f", "h"))
        if not (type(wte) is nn.Embedding and wte.max_norm is None and type(blocks) is nn.ModuleList and len(blocks)
                and (cfg.position_embedding_type == "absolute") == (wpe is not None)
                and (wpe is None or (type(wpe) is nn.Embedding and wpe.max_norm is None)) and _is_norm(ln_f)):
            return None
        dtype = wte.weight.dtype
        if dtype not in _STEP_DTYPES:
            return None
        self = cls()
        layers, attns = [], []
        for block in blocks:
            ln_1, attn, ln_2, mlp = (block._modules.get(n) for n in ("ln_1", "attn", "ln_2", "mlp"))
            if not (type(block) is LinearGPTBlock and _is_norm(ln_1) and _is_norm(ln_2) and type(attn) is LinearGPTAttention
                    and type(mlp) in (LinearGPTMLP, LinearGPTGatedMLP)):
                return None
            names = ("gate_proj", "up_proj", "down_proj") if type(mlp) is LinearGPTGatedMLP else ("c_fc", None, "c_proj")
            mlp_linears = [mlp._modules.get(n) if n else None for n in names]
            act = mlp._modules.get("act")
            proj = [attn._modules.get(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            if not (all(type(m) is nn.Linear for m in proj + [m for m in mlp_linears if m is not None])
                    and mlp_linears[0] is not None and mlp_linears[2] is not None
                    and (names[1] is None or mlp_linears[1] is not None) and isinstance(act, nn.Module)
                    and type(attn._modules.get("feature_map")) is FeatureMap and attn.rpe is None
                    and (attn.softmax_window is None or not attn.rotary) and attn.extra_features == 0
                    and attn.causal is True
                    and attn.rope == (cfg.position_embedding_type == "rope")
                    and attn.rotary == (cfg.position_embedding_type == "rotary")):
                return None
            try:
                backend = attn.call_backend(continuing=True)
            except (TypeError, ValueError):
                return None
            hybrid = None
            if attn.softmax_window is None:
                if decoding_step_spec(backend) is None:
                    return None
            else:  # the sliding-window hybrid: its decoding step, with the window's scale
                if hybrid_step_spec(backend, False, wte.weight.device.type, dtype, attn.num_heads) is None:
                    return None
                hybrid = (float(attn.head_dim ** -0.5), attn.softmax_window - 1, backend == "auto", len(layers))
            attns.append(attn)
            layers.append((ln_1, _ln_params(ln_1), attn, attn.num_heads != attn.num_key_value_heads,
                           attn._modules["o_proj"]._parameters, ln_2, _ln_params(ln_2), type(mlp) is LinearGPTGatedMLP,
                           mlp_linears[0]._parameters, None if mlp_linears[1] is None else mlp_linears[1]._parameters,
                           mlp_linears[2]._parameters, act, type(act).forward, attn.maps_in_place(),
                           attn.feature_map._buffers, float(attn.eps), hybrid))
        first = attns[0]
        # layers whose step is the plain one with the feature map in place and nothing between the map and the
        # core's step (no rotation, one key/value head per query head): the split sizes and the map, inlined
        self.plain = [((attn.num_heads + attn.num_key_value_heads, attn.num_key_value_heads),
                       (attn.num_heads, attn.num_key_value_heads), attn.feature_map.kind == "elu")
                      if (spec[-1] is None and spec[13] and not spec[3] and cfg.position_embedding_type in ("absolute", "none"))
                      else None for attn, spec in zip(attns, layers)]
        self.one = step_constant(1.0, wte.weight)
        self.model, self.transformer, self.layers, self.attns = model, tr, layers, attns
        self.spec = decoding_step_spec("recurrent")
        self.auto_hybrid = any(layer[-1] is not None and layer[-1][2] for layer in layers)  # auto's choice, see step
        self.auto_seen, self.auto_runs_hybrid = None, {}
        self.mixing = [[None] * 8 for _ in layers]  # per layer: the hybrid's mixing weights and what they were made from
        self.backends = list(map(_backend, attns))
        # a named backend is checked against the model again when it is re-registered
        self.named_specs = [(name, registered_backend(name)) for name in set(self.backends) if name != "auto"]
        self.eps = list(map(_eps, attns))
        self.dtype = dtype
        if not self._remake_projections():  # the fused projections, and the parameters they were made from
            return None
        # every module below the model: in place (each parent's children as they were), without hooks or a
        # forward of its own where it is called, and not training where that changes what it computes
        modules = list(model.modules())
        self.parent_dicts = [m._modules for m in modules if m._modules]
        self.parent_copies = [dict(d) for d in self.parent_dicts]
        below = modules[1:]
        self.hook_dicts = [d for m in below for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.module_dicts = [m.__dict__ for m in below if not isinstance(m, (nn.Dropout, nn.ModuleList))]
        self.modules = [m for m in modules if type(m) not in _STATELESS and type(m) is not LinearGPTRMSNorm]
        self.typed, self.types = below, list(map(type, below))  # a class swapped in place (parametrizations)
        self.wte, self.wpe, self.ln_f, self.ln_f_params, self.head = wte, wpe, ln_f, _ln_params(ln_f), head._parameters
        self.device = wte.weight.device
        self.device_type = self.device.type
        self.autocast = torch.amp.is_autocast_available(self.device_type)
        self.heads, self.head_dim = first.num_heads, first.head_dim
        self.features = first.feature_map.num_features
        self.rotary = cfg.position_embedding_type in ("rotary", "rope")
        self.rope = cfg.position_embedding_type == "rope"
        self.rotary_dim = self.features if cfg.position_embedding_type == "rotary" else self.head_dim
        self.rotary_base = cfg.rotary_base
        self.max_positions = cfg.max_position_embeddings
        self.zero = step_constant(0.0, wte.weight)
        self.kinds = [getattr(layer, "state_kind", None) for layer in getattr(cache, "layers", ())]
        self.cache = None
        if any(kind is None for kind in self.kinds) or not self.bind(cache, batch) or not self.current(cache, batch):
            return None
        return self

    def _record_sources(self) -> None:
        """The fused projections' sources: their parameter dicts and names, and the versions and
        addresses of the parameters the projections were made from."""
        sources = [(m._parameters, name) for attn in self.attns for m in (attn.q_proj, attn.k_proj, attn.v_proj)
                   for name, p in m._parameters.items() if p is not None]
        self.source_dicts, self.source_names = [d for d, _ in sources], [n for _, n in sources]
        params = list(map(_getitem, self.source_dicts, self.source_names))
        self.source_versions, self.source_pointers = list(map(_version, params)), list(map(_data_ptr, params))

    def _remake_projections(self) -> bool:
        """The fused projections made again (by the attention, as its next step would: a
        parameter written in place, replaced or swapped through ``.data``, or the fused copy
        dropped by a call that was not a one-token step); False when one cannot be made (in the
        model's dtype)."""
        fused = []
        for attn in self.attns:
            made = attn.fused_projection()
            if made is None or made[0].dtype != self.dtype:
                return False
            fused.append(attn._fused)
        self.fused = fused
        self._record_sources()
        return True

    def bind(self, cache: object, batch: int) -> bool:
        """Take the states of ``cache`` (a new cache, or states replaced in it) when a one-token step
        of the module path would run the core's decoding step on them as it did on the ones the
        session started with: a ``LinearGPTCache`` of initialised ``S, z`` layers of this model's
        shapes for ``batch`` rows, in its dtype and device, contiguous, of the recorded kind."""
        self.cache = None
        if type(cache) is not LinearGPTCache:
            return False
        layers = cache.layers
        if type(layers) is not list or len(layers) != len(self.layers):
            return False
        b, h, m, d = shape = (batch, self.heads, self.features, self.head_dim)
        states = []
        for layer, kind, eps, spec in zip(layers, self.kinds, self.eps, self.layers):
            hybrid = spec[-1]
            if not (type(layer) is LinearGPTCacheLayer and layer.window is None and layer.has_previous_state[0]
                    and layer.number_of_states == (2 if hybrid is None else 6)
                    and layer.softmax_window == (None if hybrid is None else hybrid[1] + 1)
                    and (layer.state_kind is None or layer.state_kind == kind)):
                return False
            found = layer.recurrent_states
            kv, z = found[0], found[1]
            if not (type(kv) is torch.Tensor and type(z) is torch.Tensor and kv.shape == shape
                    and z.shape == shape[:3] and kv.dtype == self.dtype and z.dtype == self.dtype
                    and kv.device == self.device and z.device == self.device):
                return False
            if hybrid is None:
                views = step_views(kv, z, float(eps))
                if views is None:
                    return False
            else:  # the window's tensors, written in place: contiguous, of the hybrid's shapes
                keep = hybrid[1]
                views = HybridState(*(found[i] for i in range(6)))
                shapes = (shape, shape[:3], (b, h, keep, m), (b, h, keep, d), (b, h, keep, d), (b, 1, keep))
                if not all(type(x) is torch.Tensor and x.shape == want and x.device == self.device and x.is_contiguous()
                           and x.dtype == (torch.bool if i == 5 else self.dtype)
                           for i, (x, want) in enumerate(zip(views, shapes))):
                    return False
                views = (views, step_reshapes(views))
            states.append((found, kv, z, views, layer))
        for layer, kind in zip(layers, self.kinds):
            layer.state_kind = kind  # what a step of the module path records
        self.cache, self.cache_layers, self.states, self.batch = cache, layers, states, batch
        self.all_valid = torch.ones(batch, 1, 1, dtype=torch.bool, device=self.device)
        self.keep_shape = (batch, 1, 1, 1)
        return True

    def current(self, cache: object, batch: int) -> bool:
        """Whether the session still describes the model and ``cache`` (see the class docstring)."""
        if _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or self.spec is not decoding_step_spec("recurrent") or not all(
                registered_backend(name) is spec for name, spec in self.named_specs):
            return False
        if self.parent_dicts != self.parent_copies or list(map(type, self.typed)) != self.types:
            return False  # a module replaced, added, removed (dicts compare their values by identity first) or re-classed
        if any(self.hook_dicts) or any(map(_training, self.modules)) or any(map(operator.contains, self.module_dicts,
                                                                                 itertools.repeat("forward"))):
            return False
        if not (list(map(_backend, self.attns)) == self.backends and list(map(_eps, self.attns)) == self.eps
                and self.wte._parameters["weight"].dtype == self.dtype):
            return False
        try:
            params = list(map(_getitem, self.source_dicts, self.source_names))
            fresh = (list(map(_version, params)) == self.source_versions
                     and list(map(_data_ptr, params)) == self.source_pointers)
        except (AttributeError, KeyError, TypeError):  # a parameter removed
            fresh = False
        if not (fresh and all(map(_is, map(_fused_of, self.attns), self.fused))) and not self._remake_projections():
            return False
        if cache is not self.cache or cache.layers is not self.cache_layers or batch != self.batch:
            return self.bind(cache, batch)
        for (found, kv, z, views, layer), kind in zip(self.states, self.kinds):
            if found[0] is not kv or found[1] is not z or layer.state_kind is not kind or not layer.has_previous_state[0]:
                return self.bind(cache, batch)
            if type(views) is tuple and not all(map(_is, map(found.__getitem__, range(6)), views[0])):  # the hybrid's window replaced
                return self.bind(cache, batch)
        return True

    def step(self, input_ids: torch.Tensor, attention_mask, position_ids, cache, use_cache, output_hidden_states,
             return_dict, logits_to_keep, output_attentions):
        """The output of ``model(input_ids, ...)`` for a one-token step, or None where the module
        path must run (the session is then marked stale if it no longer applies)."""
        cfg = self.model.config
        if (output_attentions or (output_attentions is None and cfg.output_attentions) or output_hidden_states
                or (output_hidden_states is None and cfg.output_hidden_states) or type(logits_to_keep) is not int
                or logits_to_keep < 0 or input_ids.dtype not in _INDEX_DTYPES
                or (self.autocast and torch.is_autocast_enabled(self.device_type))):
            return None
        batch = input_ids.shape[0]
        if not self.current(cache, batch):
            self.stale = True
            return None
        past = self.cache_layers[0].cumulative_length
        if past < 1 or (self.wpe is not None and past + 1 > self.max_positions):
            return None  # the module path checks positions beyond the table (a host read)
        keep = keep4 = None
        if attention_mask is not None:
            if not (type(attention_mask) is torch.Tensor and attention_mask.shape == (batch, past + 1)
                    and attention_mask.device == self.device):
                return None
            keep = attention_mask[:, past:].bool()
            keep4 = keep.view(self.keep_shape)
        if position_ids is not None:
            if not (type(position_ids) is torch.Tensor and position_ids.shape[-1] == 1):
                return None
            position_ids = position_ids.to(self.device).expand(batch, 1)
        elif attention_mask is not None and (self.wpe is not None or self.rotary):
            # the last of the positions counted along the mask (real tokens; padding skipped)
            position_ids = (torch.count_nonzero(attention_mask, -1) - 1).clamp(min=0).view(batch, 1)
        elif self.rotary:
            position_ids = torch.arange(past, past + 1, device=self.device)[None].expand(batch, 1)

        if self.auto_hybrid:  # auto's choice for the hybrid's step, asked again when a table or backend changed
            version = auto_version()
            if version != self.auto_seen:
                self.auto_seen, self.auto_runs_hybrid = version, {}
            masked = keep is not None
            runs = self.auto_runs_hybrid.get(masked)
            if runs is None:
                runs = self.auto_runs_hybrid[masked] = hybrid_step_spec(
                    "auto", masked, self.device_type, self.dtype, self.heads) is not None
            if not runs:
                return None  # auto would not run the hybrid's step here
        for (_, _, _, views, layer), spec in zip(self.states, self.layers):
            if spec[-1] is not None and not (type(layer.window_start) is int
                                             and 0 <= layer.window_start < max(spec[-1][1], 1)):
                return None  # a window start set by hand: the module path checks it
        # hidden states as (B, C) rows: the module path's (B, 1, C) products are these (a linear layer folds a
        # contiguous (B, 1, C) input into (B, C) rows), without the folding views
        hidden = F.embedding(input_ids.view(batch), self.wte._parameters["weight"])
        if self.wpe is not None:
            table = self.wpe._parameters["weight"]
            hidden = hidden + (table[past] if position_ids is None else F.embedding(position_ids.reshape(batch), table))
        rope = rotary = None
        if self.rotary:
            cos_sin = rotary_cos_sin(position_ids, self.rotary_dim, self.rotary_base, self.dtype)
            rope, rotary = (cos_sin, None) if self.rope else (None, cos_sin)
        zero, width, head_dim = self.zero, (batch, self.heads * self.head_dim), self.head_dim
        cudnn = torch.backends.cudnn.enabled  # what F.layer_norm passes
        linear = F.linear
        one = self.one
        for (ln_1, p_1, attn, grouped, o_proj, ln_2, p_2, gated, fc, up, down, act, act_forward, in_place, buffers,
             eps, hybrid), state, fused, plain in zip(self.layers, self.states, self.fused, self.plain):
            h = _norm(ln_1, p_1, hidden, cudnn)
            x = linear(h, fused[1], fused[2]).view(batch, -1, 1, head_dim)
            if plain is not None:  # attn.step_features and the core's step in place, inlined (the same operations)
                qk, v = x.split_with_sizes(plain[0], 1)
                if plain[2]:
                    F.elu_(qk).add_(one)
                else:
                    qk.relu_()
                q, k = qk.split_with_sizes(plain[1], 1)
                if keep4 is not None:
                    k, v, _ = zero_padded_token(keep4, k, v, None, zero)
                out = step_in_place(q, k, v, state[1], state[3]).view(width)
                hidden.add_(linear(out, o_proj["weight"], o_proj["bias"]))  # hidden: this step's own tensor
                h = _norm(ln_2, p_2, hidden, cudnn)
                if gated:
                    h = act_forward(act, linear(h, fc["weight"], fc["bias"])) * linear(h, up["weight"], up["bias"])
                else:
                    h = act_forward(act, linear(h, fc["weight"], fc["bias"]))
                hidden.add_(linear(h, down["weight"], down["bias"]))
                continue
            q, k, v, raw = attn.step_features(x, rope, buffers.get("projection"), keep, in_place)
            if grouped:
                k, v = attn._repeat_kv(k), attn._repeat_kv(v)
            if hybrid is not None:  # the sliding-window hybrid's step, as its backend runs it
                out = self._hybrid_step(attn, hybrid, q, k, v, raw, keep, state, eps)
            else:
                q_den = k_den = None
                if rotary is not None:
                    q_den, k_den = q, k
                    q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
                if keep4 is not None:
                    k, v, k_den = zero_padded_token(keep4, k, v, k_den, zero)
                out = recurrent_step(q, k, v, state[1], state[2], eps, q_den, k_den, in_place=True, views=state[3])[0]
            hidden = hidden + linear(out.reshape(width), o_proj["weight"], o_proj["bias"])
            h = _norm(ln_2, p_2, hidden, cudnn)
            if gated:
                h = act_forward(act, linear(h, fc["weight"], fc["bias"])) * linear(h, up["weight"], up["bias"])
            else:
                h = act_forward(act, linear(h, fc["weight"], fc["bias"]))
            hidden = hidden + linear(h, down["weight"], down["bias"])
        hidden = _norm(self.ln_f, self.ln_f_params, hidden, cudnn)
        for layer in self.cache_layers:
            layer.cumulative_length += 1
        logits = linear(hidden, self.head["weight"], self.head["bias"]).unsqueeze(1)  # (B, 1, V)
        out_cache = cache if (cfg.use_cache if use_cache is None else use_cache) else None
        if not (cfg.return_dict if return_dict is None else return_dict):
            return (logits,) if out_cache is None else (logits, out_cache)
        return _step_output(logits, out_cache)

    def _hybrid_step(self, attn, hybrid, q, k, v, raw, keep, state, eps):
        """One layer's sliding-window hybrid step (``kernels_hybrid._step`` in place on the cache
        layer's tensors, as the ``hybrid`` backend runs it from ``kernelized_attention``, the
        raw queries and keys made and masked as there); its window's start advanced."""
        dtype = q.dtype
        raw_q, raw_k = raw[0].to(dtype), attn._repeat_kv(raw[1]).to(dtype)
        if keep is None:
            valid = self.all_valid  # (B, 1, 1) True, read only
        else:
            raw_k, k, v = _mask_padded(raw_k, k, v, keep)
            valid = keep[:, None, :]
        layer = state[4]
        mixing = self.mixing[hybrid[3]]  # the mixing weights as the module path makes them, again when changed
        params = attn._parameters
        w, l = params["window_log_weight"], params["linear_log_weight"]
        if not (w is mixing[0] and l is mixing[1] and w._version == mixing[2] and l._version == mixing[3]
                and w.data_ptr() == mixing[4] and l.data_ptr() == mixing[5]):
            mixing[:] = (w, l, w._version, l._version, w.data_ptr(), l.data_ptr(),
                         per_head(w.exp().to(dtype), 3), per_head(l.exp().to(dtype), 3))
        out, (_, layer.window_start) = hybrid_step(
            raw_q, raw_k, q, k, v, valid, hybrid[0], mixing[6], mixing[7], eps, state[3][0], True,
            layer.window_start, True, state[3][1])
        return out


class _NoSession:
    """What a model keeps where :meth:`_DecodingSession.start` found no session for a decoding
    state: the module path runs the later steps of that state's cache too (not asked again per
    step; a new cache, as the next ``generate()`` makes, asks again)."""

    stale = False

    def __init__(self, cache: object) -> None:
        self.cache = cache

    def __reduce__(self):
        return (type(None), ())

    def __deepcopy__(self, memo):
        return None

    def step(self, input_ids, attention_mask, position_ids, cache, *args):
        if cache is not self.cache:
            self.stale = True
        return None


def _is_norm(module: object) -> bool:
    return type(module) is nn.LayerNorm or type(module) is LinearGPTRMSNorm


def _ln_params(module: nn.Module) -> Optional[dict]:
    """The parameter dict of an ``nn.LayerNorm`` (read at every step), None for an RMSNorm."""
    return module._parameters if type(module) is nn.LayerNorm else None


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
        """``GenerationMixin.generate`` after checking the inputs this model is picky about
        (``past_key_values`` must be a :class:`LinearGPTCache`; ``attention_mask`` must match
        ``input_ids``, or cover ``past + input`` when continuing from a state)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        past = kwargs.get("past_key_values", kwargs.get("cache"))
        _refuse_foreign_cache(past)
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
        """The inputs of one ``generate()`` step: the tokens not yet in the state (the last
        ``next_sequence_length``), or the prompt's ``inputs_embeds`` on the first step; the full
        ``attention_mask``; the state; every other keyword as given. The model's own, so that a
        step does no per-step work beyond this (no signature inspection, no 4D mask: the state
        needs none)."""
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
            labels: ``(B, N)`` next-token targets (shifted inside; -100 ignored) for the loss.
            logits_to_keep: int ``k`` computes logits of the last ``k`` positions only (0 = all),
                or a 1D tensor of positions to keep.
            kwargs: loss arguments for ``self.loss_function`` (``num_items_in_batch``: the loss is
                the sum over this batch divided by it, as the Trainer uses for gradient
                accumulation; ``shift_labels``: targets already aligned with the logits), and what
                ``generate()`` passes besides (``cache_position``, ``tokenizer``), not used.
        Returns:
            :class:`CausalLMOutputWithPast` with ``logits (B, N_kept, vocab)``, ``loss`` and ``past_key_values``.

        One-token decoding steps from a state with nothing recorded for autograd run, after the
        first step of a decoding session, as flat torch calls with the same results
        (:class:`_DecodingSession`); every other call runs the modules and ends the session.
        """
        past_key_values = cache_argument(past_key_values, cache)
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # traced: the modules, nothing kept
            return self._forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels,
                                 use_cache, output_hidden_states, return_dict, logits_to_keep, output_attentions, **kwargs)
        step = (labels is None and inputs_embeds is None and past_key_values is not None
                and type(input_ids) is torch.Tensor and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and not torch.is_grad_enabled())
        session = self.__dict__.get("_decoding_session")
        if step:
            if session is not None and not session.stale:
                out = session.step(input_ids, attention_mask, position_ids, past_key_values, use_cache,
                                   output_hidden_states, return_dict, logits_to_keep, output_attentions)
                if out is not None:
                    return out
        elif session is not None:  # a call that is not a one-token step ends the decoding session
            self.__dict__["_decoding_session"] = session = None
        out = self._forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache,
                            output_hidden_states, return_dict, logits_to_keep, output_attentions, **kwargs)
        if step and (session is None or session.stale):  # this step ran through the modules: the next ones need not
            self.__dict__["_decoding_session"] = (_DecodingSession.start(self, past_key_values, input_ids.shape[0])
                                                  or _NoSession(past_key_values))
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
