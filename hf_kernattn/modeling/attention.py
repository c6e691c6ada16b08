"""The one kernelized self-attention module shared by every model family.

``hidden (B, N, C) -> q, k, v projections -> split heads -> feature map phi on q and k ->
kernelized_attention (backend registry) -> merge heads -> output projection``.

Families differ only in what they pass in: NPRF-BERT a 1D bias and a padding mask, Linear GPT
``causal=True`` (and its decoding state, built from :meth:`KernelizedSelfAttention.project`),
the ViT a 2D bias on the patch grid. The module reads the shared attention fields of the config
(``feature_map``, ``num_random_features``, ``feature_projection``, ``normalize_qk``,
``feature_redraw_interval``, ``feature_seed``, ``num_learned_features``, ``softmax_window``, ``attn_backend``,
``attention_eps``, ``attention_bias``, ``recompute_attention``), documented and checked once in
``attention_config.py``, and ``num_key_value_heads`` where the family has it (grouped-query
attention: ``G = H / H_kv`` query heads share one key/value head; the key features and values
are computed once per key/value head and repeated to the ``G`` query heads of its group, as
Llama's ``repeat_kv``).

With ``softmax_window = W`` the module computes the sliding-window hybrid (``kernels_hybrid.py``):
the raw projected queries and keys go to the core beside their features (a
:class:`~attention_inputs.SoftmaxWindow`), with the layer's learned per-head mixing weights
``exp(window_log_weight)``, ``exp(linear_log_weight)``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.utils.checkpoint
from torch import nn

from .attention_config import complete_attention_fields
from .dispatch import get_backend, kernelized_attention
from .kernels_common import compute_dtype_for
from .registry import choose_backend
from .feature_maps import FeatureMap
from .attention_inputs import SoftmaxWindow
from .positional import apply_rotary


# the sliding-window hybrid's per-head mixing weights (log scale) of an attention layer
WINDOW_WEIGHTS = ("window_log_weight", "linear_log_weight")


class KernelizedSelfAttention(nn.Module):
    """Multi-head kernelized self-attention.

    Args:
        config: a family config (it carries every shared attention field of
            ``attention_config.py``), or any object with ``hidden_size``, ``num_attention_heads``
            and some of those fields: the missing ones take the schema's base defaults.
        layer_idx: index of the layer (also offsets the feature seed so layers draw different
            projections).
        causal: mask future keys.
        extra_features: width of position features concatenated to every head's queries and
            keys before the feature map (``project(..., extra=...)``), e.g. the ViT's rotary
            position features; 0: none.
    """

    def __init__(self, config, layer_idx: int = 0, causal: bool = False, extra_features: int = 0) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads != 0:
            raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
        self.hidden_size = hidden
        self.num_heads = heads
        self.head_dim = hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
        self.num_key_value_heads = kv_heads
        self.layer_idx = layer_idx
        self.causal = causal
        config = complete_attention_fields(config)
        self.backend = config.attn_backend
        if self.backend != "auto":
            get_backend(self.backend)  # fail at construction on an unknown name
        self.eps = float(config.attention_eps)
        self.recompute: Union[bool, str] = config.recompute_attention  # True, False or "projections"
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=bias)
        self.extra_features = int(extra_features)
        self.feature_map = FeatureMap(
            head_dim=self.head_dim + self.extra_features,
            feature_map=config.feature_map,
            num_random_features=config.num_random_features,
            projection=config.feature_projection,
            normalize_qk=config.normalize_qk,
            redraw_interval=config.feature_redraw_interval,
            seed=int(config.feature_seed) + 1000 * layer_idx,
            num_learned_features=config.num_learned_features,
            num_heads=heads,
            num_key_value_heads=kv_heads,
        )
        # what a family configures: Llama's rotary positions before the feature map (``rope``) or
        # rotations of the features (``rotary``), a bias table of its own (``rpe``, a module with
        # ``weight`` (H, 2K+1) and ``max_relative_position`` K) and dropout on the attention output
        self.rope = False
        self.rotary = False
        self.rpe: Optional[nn.Module] = None
        self.dropout = nn.Dropout(0.0)
        # the sliding-window hybrid: W and the per-head mixing weights a = exp(window_log_weight),
        # b = exp(linear_log_weight) (0 at initialisation: a = b = 1)
        self.softmax_window: Optional[int] = config.softmax_window
        if self.softmax_window is not None:
            self.window_log_weight = nn.Parameter(torch.zeros(heads))
            self.linear_log_weight = nn.Parameter(torch.zeros(heads))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, -1, self.head_dim).transpose(1, 2)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H_kv, N, .)`` -> ``(B, H, N, .)``: key/value head ``j`` serves query heads
        ``j G .. (j + 1) G - 1``."""
        groups = self.num_heads // self.num_key_value_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def project(
        self,
        hidden_states: torch.Tensor,
        projection: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        extra: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(B, N, C)`` -> query features ``(B, H, N, M)``, key features ``(B, H, N, M)``,
        values ``(B, H, N, D)``. Features are float32 at least (float64 stays float64).
        ``projection``: the random-feature projection to use (None: the feature map's current one).
        ``attention_mask``: ``(B, N)``, 1 real / 0 padding: only real keys must lie in the
        feature map's valid range (see ``feature_maps.py``). ``extra``: ``(query_extra,
        key_extra)``, each broadcastable to ``(B, H, N, extra_features)``, concatenated to the
        projected queries and keys before the feature map. ``rope``: ``(cos, sin)``, each
        ``(B, 1, N, D/2)``, rotating the projected queries and keys before the feature map
        (Llama's rotary position embedding; see ``positional.apply_rotary``)."""
        return self.features(*self.projections(hidden_states, extra, rope), projection, attention_mask)

    def projections(
        self,
        hidden_states: torch.Tensor,
        extra: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first half of :meth:`project`: the linear projections split into heads (queries
        ``(B, H, N, D + extra)``, keys and values per key/value head), rotated by ``rope`` and
        with ``extra`` concatenated; no feature map yet."""
        q, k = self._split(self.q_proj(hidden_states)), self._split(self.k_proj(hidden_states))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if (extra is None) != (self.extra_features == 0):
            raise ValueError(f"extra must be given exactly when extra_features > 0 (here {self.extra_features})")
        if extra is not None:
            q = torch.cat([q, extra[0].to(q.dtype).expand(*q.shape[:3], -1)], dim=-1)
            k = torch.cat([k, extra[1].to(k.dtype).expand(*k.shape[:3], -1)], dim=-1)
        return q, k, self._split(self.v_proj(hidden_states))

    def features(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        projection: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        sync_free: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The second half of :meth:`project`: feature maps of the projected queries and keys,
        keys and values repeated to the query heads of their group. ``sync_free`` (decoding
        steps): keys outside the feature map's range give NaN instead of a ``ValueError``, so
        nothing is read on the host (see ``FeatureMap.forward``)."""
        q = self.feature_map(q, is_query=True, projection=projection)
        k = self._repeat_kv(self.feature_map(k, is_query=False, projection=projection, key_mask=attention_mask,
                                             sync_free=sync_free))
        return q, k, self._repeat_kv(v.to(q.dtype))

    def window_input(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> Optional[SoftmaxWindow]:
        """The raw queries ``(B, H, N, D)`` and keys (per key/value head, repeated here to the
        query heads) in ``dtype``, bundled with W, the scale ``D ** -0.5`` and the mixing weights
        for the core; None without ``softmax_window``."""
        if self.softmax_window is None:
            return None
        return SoftmaxWindow(q.to(dtype), self._repeat_kv(k).to(dtype), self.softmax_window, self.head_dim ** -0.5,
                             self.window_log_weight.exp(), self.linear_log_weight.exp())

    def output(self, attn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(B, H, N, D)`` -> merged heads through ``o_proj``: ``(B, N, C)`` in ``dtype``."""
        b, h, n, d = attn.shape
        merged = attn.reshape(b, 1, h * d) if n == 1 else attn.transpose(1, 2).reshape(b, n, h * d)
        if merged.dtype != dtype:
            merged = merged.to(dtype)
        return self.o_proj(merged)

    def call_backend(self, continuing: bool) -> str:
        """The backend of a call: the configured ``attn_backend`` (a family may check it against
        its options, or pick another for a call that continues from a state)."""
        return self.backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rpe_bias: Optional[torch.Tensor] = None,
        grid: Optional[Sequence[int]] = None,
        rpe_clip: Optional[int] = None,
        recompute: Optional[bool] = None,
        projection: Optional[torch.Tensor] = None,
        extra: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        past_key_values=None,
    ) -> torch.Tensor:
        """Args:
            hidden_states: ``(B, N, C)``.
            attention_mask: ``(B, N)``, 1 keep, 0 padding.
            rpe_bias: ``(H, 2N-1)`` or with ``grid`` ``(H, 2Hg-1, 2Wg-1)``; a bias clipped at
                ``rpe_clip`` may be its table (see :func:`kernelized_attention`). None: the
                module's own table (``self.rpe``, clipped at its ``max_relative_position``) if it
                has one.
            grid: ``(Hg, Wg)`` for a 2D bias.
            rpe_clip: ``K`` when the 1D bias comes from a table clipped at ``K`` (enables the
                O(N K) ``windowed`` backend; see :func:`kernelized_attention`).
            recompute: for calls without an earlier state, recompute the feature maps and the
                kernel in the backward pass instead of storing their intermediates (see
                ``recompute_attention``; the linear projections are kept, not recomputed). None:
                the module's configured ``recompute_attention``, skipped where the backend the call
                runs keeps only its inputs for the backward (declared ``keeps_inputs``: ``dense``,
                ``manhattan``), so that recomputing would save no memory; configured as
                ``"projections"``, the whole block (projections included) is recomputed from
                ``hidden_states``; False: never (e.g. when an enclosing layer is already
                gradient-checkpointed, so the work is not done three times); True: the feature maps
                and the kernel, always. Calls that continue from a state never recompute.
            projection: the random-feature projection to use; None: the feature map's current
                buffer, read once here. The recomputation receives that tensor explicitly, and a
                redraw installs a new tensor, so a redraw before the backward changes nothing
                (an enclosing checkpointed layer can read the buffer outside its checkpoint and
                pass it here for the same guarantee).
            extra: position features concatenated before the feature map (see :meth:`project`).
            rotary: ``(cos, sin)`` of the positions: with ``self.rope`` each ``(B, 1, N, D/2)``,
                rotating the projected queries and keys (Llama's RoPE); with ``self.rotary`` each
                ``(B, 1, N, M/2)``, rotating the feature-mapped ones in the numerator while the
                positive ones serve the denominator (``q_den``, ``k_den``); else ignored.
            past_key_values: causal modules: a cache layer with ``get_state()`` / ``set_state()``
                (Linear GPT's :class:`~cache.LinearGPTCacheLayer`): the new tokens continue from
                its state, which is then replaced by the state after them; or None.
        Returns:
            ``(B, N, C)``.
        """
        if recompute is not None and not isinstance(recompute, bool):
            raise TypeError(f"recompute must be None or a bool, got {type(recompute).__name__}")
        layer = past_key_values
        # the state as stored (a Linear GPT cache layer keeps the hybrid's window as a ring)
        initial_state = (None if layer is None else layer.get_state(ordered=False)
                         if getattr(layer, "keeps_window_ring", False) else layer.get_state())
        configured = recompute is None
        recompute = (self.recompute if configured else recompute) and initial_state is None
        if projection is None:
            projection = self.feature_map.projection
        if rpe_bias is None and self.rpe is not None:
            # the table is clipped at K: declaring it lets long inputs use the O(N K) windowed
            # backend; a state reaches K positions back, so the calls take the table itself
            rpe_bias, rpe_clip = self.rpe.weight, self.rpe.max_relative_position
        rpe_clip = rpe_clip if rpe_bias is not None else None
        args = (hidden_states, attention_mask, rpe_bias, grid, rpe_clip, projection, extra, rotary, initial_state,
                layer is not None)
        if recompute and configured and self.recompute == "projections" and torch.is_grad_enabled():
            # only hidden_states is kept: the backward runs the whole block again
            out, state = torch.utils.checkpoint.checkpoint(self._block, *args, False, False, use_reentrant=False)
        else:
            out, state = self._block(*args, bool(recompute) and torch.is_grad_enabled(), configured)
        if state is not None:
            layer.set_state(state)
        return out

    def _block(self, hidden_states, attention_mask, rpe_bias, grid, rpe_clip, projection, extra, rotary, initial_state,
               output_final_state, recompute: bool, only_if_saving: bool) -> tuple[torch.Tensor, object]:
        """The attention block of a call that is not a decoding step: projections, feature maps
        and kernel (through :meth:`_attend`, recomputed in the backward pass when ``recompute``,
        with ``only_if_saving`` only where that keeps less, see :meth:`_recomputing_saves_memory`),
        dropout, output projection. Returns ``(B, N, C)`` and the state
        after these tokens (None unless ``output_final_state``)."""
        q, k, v = self.projections(hidden_states, extra, rope=rotary if self.rope else None)
        args = (q, k, v, attention_mask, rpe_bias, grid, rpe_clip, projection, rotary if self.rotary else None,
                initial_state, output_final_state)
        if recompute and (not only_if_saving or self._recomputing_saves_memory(*args)):
            out, state = torch.utils.checkpoint.checkpoint(self._attend, *args, use_reentrant=False)
        else:
            out, state = self._attend(*args)
        if self.dropout.training and self.dropout.p > 0:
            out = self.dropout(out)
        return self.output(out, hidden_states.dtype), state

    def _recomputing_saves_memory(self, q, k, v, attention_mask, rpe_bias, grid, rpe_clip, projection, rotary,
                                  initial_state, output_final_state) -> bool:
        """Whether running the feature maps and kernel again in the backward pass keeps less than
        running them once: not when the backend the call runs (``auto``'s first choice for it)
        declares ``keeps_inputs`` (its backward needs only its inputs; ``dense``, ``manhattan``).
        A wrong guess costs memory or time, never a different result."""
        name = self.call_backend(continuing=False)
        if name == "auto":
            name = choose_backend(
                n=q.shape[2], causal=self.causal, rpe=None if rpe_bias is None else ("2d" if grid is not None else "1d"),
                key_mask=attention_mask is not None, device=q.device.type, rpe_clip=rpe_clip, state=output_final_state,
                split=rotary is not None, backward=True, dtype=compute_dtype_for(q),
                window=self.softmax_window is not None, heads=self.num_heads)
        return not get_backend(name).keeps_inputs

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        rpe_bias: Optional[torch.Tensor],
        grid: Optional[Sequence[int]],
        rpe_clip: Optional[int],
        projection: Optional[torch.Tensor] = None,
        rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        initial_state=None,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, object]:
        """Projected queries, keys, values -> feature maps, positions, kernel (what ``recompute``
        runs again in the backward pass): ``(B, H, N, d)`` before ``o_proj`` and the state after
        these tokens (None unless ``output_final_state``)."""
        # padded keys are masked by the core: only real ones must lie in the feature map's valid range;
        # a decoding step reads nothing on the host: an unrepresentable key gives NaN, not an error
        raw = (q, k) if self.softmax_window is not None else None
        q, k, v = self.features(q, k, v, projection, attention_mask,
                                sync_free=initial_state is not None and q.shape[2] == 1)
        return self._kernel(q, k, v, attention_mask, rpe_bias, grid, rpe_clip, rotary, initial_state, output_final_state,
                            raw)

    def _kernel(self, q, k, v, attention_mask, rpe_bias, grid, rpe_clip, rotary, initial_state, output_final_state,
                raw=None):
        """Feature-mapped queries and keys, values -> the rotations of ``rotary`` (positive
        features kept for the denominator), the kernel: the output and the state (see :meth:`_attend`).
        ``raw``: the raw queries and keys of the sliding-window hybrid (``softmax_window``), or None."""
        den = {}
        if rotary is not None:
            den = dict(q_den=q, k_den=k)
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if rpe_bias is not None:
            rpe_bias = rpe_bias.to(q.dtype)
        result = kernelized_attention(
            q, k, v, rpe_bias=rpe_bias, causal=self.causal, attention_mask=attention_mask,
            grid=grid, backend=self.call_backend(continuing=initial_state is not None), eps=self.eps, rpe_clip=rpe_clip,
            initial_state=initial_state, output_final_state=output_final_state,
            # decoding (nothing recorded for autograd): the state is updated in the cache's own tensors
            # (a state of another dtype, e.g. the model cast between steps, continues out of place)
            in_place=(initial_state is not None and not torch.is_grad_enabled()
                      and initial_state[0].dtype == compute_dtype_for(q)),
            softmax_window=None if raw is None else self.window_input(*raw, q.dtype), **den,
        )
        return result if output_final_state else (result, None)
