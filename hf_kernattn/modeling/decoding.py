"""One-token decoding steps of Linear GPT as flat torch calls: the fast path of ``generate()``.

A decoding step reads every weight once; what it adds beyond that is Python: module calls,
argument checks, the core's dispatch, output classes. A :class:`DecodingPlan` runs the module
path's operations in the same order on the same tensors (logits and states are bitwise those of
the module path, which stays the reference) without that overhead.

The plan belongs to one cache, so to one generation: it is built after a one-token step from
that cache ran through the modules, kept as ``cache.decoding_plan``, and checked at each step
against what can change between calls (modules replaced, hooks, training mode, the backends, the
cache's tensors); anything it does not cover runs the modules. The model keeps nothing: threads
generating on one model share only its weights. Projections that are not a plain ``nn.Linear``
(LoRA, quantized layers) are called as modules; tensor-subclass weights (torchao) go through
``F.linear`` as ``nn.Linear`` would.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import CACHE_FIELD, LinearGPTCache, LinearGPTCacheLayer
from .feature_maps import FeatureMap
from .kernels_common import per_head
from .kernels_hybrid import HybridState, _step as hybrid_step, hybrid_attention
from .kernels_linear import recurrent_attention, recurrent_step
from .positional import apply_rotary, rotary_cos_sin
from .registry import auto_version, choose_backend, get_backend

_STEP_DTYPES = (torch.float32, torch.float64)
_INDEX_DTYPES = (torch.long, torch.int)


class Projection:
    """A linear map of the step: ``F.linear`` on a plain ``nn.Linear``'s live parameters, else
    the module itself (an adapter, a quantized layer: its own forward and hooks)."""

    __slots__ = ("module", "params")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        plain = type(module) is nn.Linear and not _has_own_call(module)
        self.params = module._parameters if plain else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        return self.module(x) if p is None else F.linear(x, p["weight"], p["bias"])


class Norm:
    """An ``nn.LayerNorm`` (``F.layer_norm`` on its live parameters) or Linear GPT's RMSNorm."""

    __slots__ = ("module", "params")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params = module._parameters if type(module) is nn.LayerNorm else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, p = self.module, self.params
        if p is None:
            return m.forward(x)
        return F.layer_norm(x, m.normalized_shape, p["weight"], p["bias"], m.eps)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one block's step needs, named (read once, when the plan is built)."""

    attn: nn.Module
    ln_1: Norm
    ln_2: Norm
    q_proj: Projection
    k_proj: Projection
    v_proj: Projection
    o_proj: Projection
    mlp_in: Projection  # c_fc, or the gated MLP's gate_proj
    mlp_up: Optional[Projection]  # the gated MLP's up_proj
    mlp_out: Projection
    act: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    in_place_map: Optional[str]  # "elu" / "relu": the feature map written into the projections; None: the module
    window: Optional[int]  # the sliding-window hybrid's W (None: plain linear attention)


@dataclasses.dataclass
class LayerState:
    """One layer's state tensors as the plan last bound them (rebound when the cache replaced them)."""

    layer: LinearGPTCacheLayer
    tensors: tuple


_OUTPUT_FIELDS = dict.fromkeys(field.name for field in dataclasses.fields(CausalLMOutputWithPast))


def _step_output(logits: torch.Tensor, cache: Optional[LinearGPTCache]) -> CausalLMOutputWithPast:
    """``CausalLMOutputWithPast(logits=..., <cache field>=cache)`` as its constructor makes it
    (items, order, attributes), without the per-field checks."""
    out = OrderedDict.__new__(CausalLMOutputWithPast)
    OrderedDict.__setitem__(out, "logits", logits)
    if cache is not None:
        OrderedDict.__setitem__(out, CACHE_FIELD, cache)
    out.__dict__.update(_OUTPUT_FIELDS)
    out.__dict__.update({"logits": logits, CACHE_FIELD: cache})
    return out


def _has_own_call(module: nn.Module) -> bool:
    """Hooks, or a ``forward`` set on the instance (as accelerate's hooks do)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _built_in_step(attn: nn.Module, window: bool, device: str, dtype: torch.dtype) -> bool:
    """Whether the layer's one-token calls run the built-in recurrent (or hybrid) step, masked or not."""
    name = attn.call_backend(continuing=True)
    want, fn = ("hybrid", hybrid_attention) if window else ("recurrent", recurrent_attention)
    for masked in (False, True):
        chosen = name if name != "auto" else choose_backend(
            n=1, causal=True, rpe=None, key_mask=masked, device=device, state=True, split=attn.rotary,
            dtype=dtype, window=window, heads=attn.num_heads)
        if chosen != want or get_backend(chosen).fn is not fn:
            return False
    return True


class DecodingPlan:
    """The flat one-token step of one model from one cache (see the module docstring)."""

    def __deepcopy__(self, memo):  # a copied cache starts without a plan (never a copy of the model)
        return None

    def __reduce__(self):
        return (type(None), ())

    @classmethod
    def build(cls, model: nn.Module, cache: object, batch: int) -> Optional["DecodingPlan"]:
        """The plan, or None where the step needs the modules (a relative-position bias, hooks,
        training mode, a backend other than the built-in step, a dtype other than float32/64)."""
        from .modeling_linear_gpt import (
            LinearGPTAttention, LinearGPTBlock, LinearGPTGatedMLP, LinearGPTMLP, LinearGPTModel, LinearGPTRMSNorm,
        )

        norms = (nn.LayerNorm, LinearGPTRMSNorm)
        tr, head = model._modules.get("transformer"), model._modules.get("lm_head")
        cfg = model.config
        if type(tr) is not LinearGPTModel or head is None or type(cache) is not LinearGPTCache:
            return None
        wte, wpe, ln_f = tr.wte, tr.wpe, tr.ln_f
        if not (type(wte) is nn.Embedding and wte.max_norm is None and type(ln_f) in norms
                and (wpe is None or (type(wpe) is nn.Embedding and wpe.max_norm is None))
                and wte.weight.dtype in _STEP_DTYPES and type(wte.weight) is nn.Parameter):
            return None
        dtype, device = wte.weight.dtype, wte.weight.device
        layers = []
        for block in tr.h:
            attn, mlp = block._modules.get("attn"), block._modules.get("mlp")
            if not (type(block) is LinearGPTBlock and type(block.ln_1) in norms and type(block.ln_2) in norms
                    and type(attn) is LinearGPTAttention and type(mlp) in (LinearGPTMLP, LinearGPTGatedMLP)
                    and type(attn.feature_map) is FeatureMap and attn.rpe is None and attn.extra_features == 0
                    and not (attn.rotary and attn.softmax_window is not None)):
                return None
            if not _built_in_step(attn, attn.softmax_window is not None, device.type, dtype):
                return None
            gated = type(mlp) is LinearGPTGatedMLP
            fm = attn.feature_map
            layers.append(LayerPlan(
                attn=attn, ln_1=Norm(block.ln_1), ln_2=Norm(block.ln_2),
                q_proj=Projection(attn.q_proj), k_proj=Projection(attn.k_proj), v_proj=Projection(attn.v_proj),
                o_proj=Projection(attn.o_proj),
                mlp_in=Projection(mlp.gate_proj if gated else mlp.c_fc), mlp_up=Projection(mlp.up_proj) if gated else None,
                mlp_out=Projection(mlp.down_proj if gated else mlp.c_proj), act=mlp.act,
                heads=attn.num_heads, kv_heads=attn.num_key_value_heads, head_dim=attn.head_dim,
                in_place_map=(fm.kind if fm.kind in ("elu", "relu") and not fm.normalize_qk
                              and attn.softmax_window is None else None),
                window=attn.softmax_window,
            ))
        plan = cls()
        plan.model, plan.cache, plan.layers, plan.dtype, plan.device = model, cache, layers, dtype, device
        plan.wte, plan.wpe, plan.ln_f, plan.head = wte, wpe, Norm(ln_f), Projection(head)
        plan.positions = cfg.position_embedding_type
        plan.max_positions = cfg.max_position_embeddings
        first = layers[0].attn
        plan.rotary_dim = first.feature_map.num_features if plan.positions == "rotary" else first.head_dim
        plan.rotary_base = cfg.rotary_base
        plan.version = auto_version()
        plan.backends = [(lp.attn, lp.attn.backend) for lp in layers]
        # the modules the step bypasses: checked per step for hooks, training mode, replacement
        projections = [p for lp in layers for p in (lp.q_proj, lp.k_proj, lp.v_proj, lp.o_proj, lp.mlp_in, lp.mlp_up,
                                                     lp.mlp_out)] + [plan.head]
        called = {id(p.module) for p in projections if p is not None and p.params is None}
        flat, stack = [], [model]
        while stack:
            m = stack.pop()
            flat.append(m)
            stack.extend(c for c in m._modules.values() if c is not None and id(c) not in called)
        plan.flat = flat
        plan.children = [(m._modules, dict(m._modules)) for m in flat if m._modules]
        plan.states, plan.batch = None, None
        plan.steps = 0  # the one-token steps this plan has run
        return plan if plan.current(model, cache, batch) else None

    def bind(self, cache: LinearGPTCache, batch: int) -> bool:
        """Take the cache's state tensors (again after a reorder or copy): initialised ``S, z``
        (and the hybrid's window) of this model's shapes for ``batch`` rows, in its dtype and
        device, contiguous (they are updated in place)."""
        self.states = None
        layers = cache.layers
        if type(layers) is not list or len(layers) != len(self.layers):
            return False
        states = []
        for layer, lp in zip(layers, self.layers):
            hybrid = lp.window is not None
            m, d, h = lp.attn.feature_map.num_features, lp.head_dim, lp.heads
            if not (type(layer) is LinearGPTCacheLayer and layer.window is None and layer.has_previous_state[0]
                    and layer.softmax_window == lp.window and layer.number_of_states == (6 if hybrid else 2)):
                return False
            tensors = tuple(layer.recurrent_states[i] for i in range(layer.number_of_states))
            shapes = [(batch, h, m, d), (batch, h, m)]
            if hybrid:
                keep = lp.window - 1
                shapes += [(batch, h, keep, m), (batch, h, keep, d), (batch, h, keep, d), (batch, 1, keep)]
            for i, (x, shape) in enumerate(zip(tensors, shapes)):
                want = torch.bool if i == 5 else self.dtype
                if not (type(x) is torch.Tensor and x.shape == shape and x.dtype == want and x.device == self.device
                        and x.is_contiguous()):
                    return False
            states.append(LayerState(layer, tensors))
        self.states, self.batch = states, batch
        return True

    def current(self, model: nn.Module, cache: LinearGPTCache, batch: int) -> bool:
        """Whether the plan still describes the model and the cache (rebinding replaced states)."""
        version = auto_version()  # (a counter, the registry, the active table): a backend or table made active
        if (model is not self.model or _global_forward_hooks or _global_forward_pre_hooks
                or version[0] != self.version[0] or version[1] is not self.version[1]
                or version[2] is not self.version[2] or self.wte.weight.dtype != self.dtype
                or self.wte.weight.device != self.device):
            return False
        for m in self.flat:
            if m.training or _has_own_call(m):
                return False
        for live, snapshot in self.children:
            if live != snapshot:  # a module replaced, added or removed
                return False
        for attn, backend in self.backends:
            if attn.backend != backend:
                return False
        if batch != self.batch:
            return self.bind(cache, batch)
        for state in self.states:
            found = state.layer.recurrent_states
            if any(found[i] is not x for i, x in enumerate(state.tensors)) or not state.layer.has_previous_state[0]:
                return self.bind(cache, batch)
        return True

    def step(self, input_ids: torch.Tensor, attention_mask, position_ids) -> Optional[torch.Tensor]:
        """The logits ``(B, V)`` of one new token, the cache's states advanced; None where the
        module path must run this call (it then checks what the plan does not)."""
        batch = input_ids.shape[0]
        past = self.states[0].layer.cumulative_length
        if past < 1 or (self.wpe is not None and past + 1 > self.max_positions):
            return None  # the module path checks positions beyond the table
        keep = None
        if attention_mask is not None:
            if not (type(attention_mask) is torch.Tensor and attention_mask.shape == (batch, past + 1)
                    and attention_mask.device == self.device):
                return None
            keep = attention_mask[:, past:].bool()  # (B, 1): the new token is real
        for lp, state in zip(self.layers, self.states):
            if lp.window is not None and not 0 <= state.layer.window_start < max(lp.window - 1, 1):
                return None  # a window start set by hand: the module path checks it
        if position_ids is not None:
            if not (type(position_ids) is torch.Tensor and position_ids.shape[-1] == 1):
                return None
            position_ids = position_ids.to(self.device).expand(batch, 1)
        elif attention_mask is not None and self.positions != "none":
            position_ids = (torch.count_nonzero(attention_mask, -1) - 1).clamp(min=0).view(batch, 1)
        elif self.positions in ("rotary", "rope"):
            position_ids = torch.full((batch, 1), past, device=self.device)

        hidden = F.embedding(input_ids.view(batch), self.wte.weight)  # (B, C) rows: a linear layer's (B, 1, C)
        if self.wpe is not None:
            table = self.wpe.weight
            hidden = hidden + (table[past] if position_ids is None else F.embedding(position_ids.reshape(batch), table))
        rotary = None
        if self.positions in ("rotary", "rope"):
            rotary = rotary_cos_sin(position_ids, self.rotary_dim, self.rotary_base, self.dtype)
        for lp, state in zip(self.layers, self.states):
            hidden = hidden + self._attention(lp, state, lp.ln_1(hidden), keep, rotary)
            h = lp.ln_2(hidden)
            h = lp.act.forward(lp.mlp_in(h)) if lp.mlp_up is None else lp.act.forward(lp.mlp_in(h)) * lp.mlp_up(h)
            hidden = hidden + lp.mlp_out(h)
        for state in self.states:
            state.layer.cumulative_length += 1
        self.steps += 1
        return self.head(self.ln_f(hidden))

    def _attention(self, lp: LayerPlan, state: LayerState, x: torch.Tensor, keep, rotary) -> torch.Tensor:
        """One layer's attention for one token: what ``LinearGPTAttention`` and the core's
        recurrent (or hybrid) step compute, the state updated in place. ``x (B, C)`` -> ``(B, C)``."""
        attn, b, d = lp.attn, x.shape[0], lp.head_dim
        # (B, 1, H, D) -> (B, H, 1, D) as the module splits heads (the same strides: matmul may read them)
        q, k, v = (proj(x).view(b, 1, -1, d).transpose(1, 2) for proj in (lp.q_proj, lp.k_proj, lp.v_proj))
        if self.positions == "rope":
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        raw = (q, k) if lp.window is not None else None
        fm = attn.feature_map
        if lp.in_place_map is not None:  # the map's formula, elementwise, in the projections' own memory
            if lp.in_place_map == "elu":
                q, k = F.elu_(q).add_(1.0), F.elu_(k).add_(1.0)
            else:
                q, k = q.relu_(), k.relu_()
        else:
            projection = fm.projection
            q = fm(q, is_query=True, projection=projection)
            k = fm(k, is_query=False, projection=projection, key_mask=keep, sync_free=True)
        k, v = attn._repeat_kv(k), attn._repeat_kv(v.to(q.dtype))
        keep4 = None if keep is None else keep.view(b, 1, 1, 1)
        if lp.window is not None:
            out = self._hybrid(lp, state, q, k, v, raw, keep4)
        else:
            q_den = k_den = None
            if self.positions == "rotary":
                q_den, k_den = q, k
                q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
            if keep4 is not None:  # a padded token: its key and value leave no trace (where: NaN included)
                zero = torch.zeros((), dtype=k.dtype, device=k.device)
                k, v = torch.where(keep4, k, zero), torch.where(keep4, v, zero)
                k_den = None if k_den is None else torch.where(keep4, k_den, zero)
            kv, z = state.tensors
            out = recurrent_step(q, k, v, kv, z, attn.eps, q_den, k_den, in_place=True)[0]
        return lp.o_proj(out.reshape(b, lp.heads * d).to(x.dtype))

    def _hybrid(self, lp: LayerPlan, state: LayerState, q, k, v, raw, keep4) -> torch.Tensor:
        """The sliding-window hybrid's step (``kernels_hybrid._step``) on the ring in place."""
        attn, dtype = lp.attn, q.dtype
        raw_q, raw_k = raw[0].to(dtype), attn._repeat_kv(raw[1]).to(dtype)
        if keep4 is None:
            valid = torch.ones(q.shape[0], 1, 1, dtype=torch.bool, device=q.device)
        else:
            zero = torch.zeros((), dtype=dtype, device=q.device)
            raw_k, k, v = torch.where(keep4, raw_k, zero), torch.where(keep4, k, zero), torch.where(keep4, v, zero)
            valid = keep4.view(-1, 1, 1)
        a = per_head(attn.window_log_weight.exp().to(dtype), 3)
        b = per_head(attn.linear_log_weight.exp().to(dtype), 3)
        layer = state.layer
        out, (_, layer.window_start) = hybrid_step(
            raw_q, raw_k, q, k, v, valid, lp.head_dim ** -0.5, a, b, attn.eps, HybridState(*state.tensors), True,
            layer.window_start, True)
        return out


def decoding_step(model, input_ids, attention_mask, position_ids, cache, use_cache, output_hidden_states, return_dict,
                  logits_to_keep, output_attentions) -> Optional[CausalLMOutputWithPast]:
    """``model(...)``'s output for a one-token step from ``cache`` by its plan, or None where the
    module path must run (no plan, or one that no longer applies: then dropped)."""
    plan = getattr(cache, "decoding_plan", None)
    if not plan:
        return None
    cfg = model.config
    if (output_attentions or (output_attentions is None and cfg.output_attentions) or output_hidden_states
            or (output_hidden_states is None and cfg.output_hidden_states) or type(logits_to_keep) is not int
            or logits_to_keep < 0 or input_ids.dtype not in _INDEX_DTYPES
            or torch.is_autocast_enabled(plan.device.type)):
        return None
    if not plan.current(model, cache, input_ids.shape[0]):
        cache.decoding_plan = None
        return None
    logits = plan.step(input_ids, attention_mask, position_ids)
    if logits is None:
        return None
    logits = logits.unsqueeze(1)  # (B, 1, V)
    out_cache = cache if (cfg.use_cache if use_cache is None else use_cache) else None
    if not (cfg.return_dict if return_dict is None else return_dict):
        return (logits,) if out_cache is None else (logits, out_cache)
    return _step_output(logits, out_cache)


def after_module_step(model, cache, batch: int) -> None:
    """After a one-token step from ``cache`` ran through the modules: make the cache's plan
    (kept; a model the plan cannot serve is not asked again for this cache)."""
    if type(cache) is LinearGPTCache and cache.decoding_plan is None:
        cache.decoding_plan = DecodingPlan.build(model, cache, batch) or False
