"""The kernelized self-attention module every family uses.

``hidden (B, N, C) -> q, k, v projections -> heads -> feature map phi on q and k ->
kernelized_attention -> merged heads -> o_proj``. Families differ only in what they pass:
NPRF-BERT a 1D bias and a padding mask, Linear GPT ``causal=True`` and a cache layer, the ViT a
2D bias on the patch grid. Grouped-query attention (``num_key_value_heads``): ``G = H / H_kv``
query heads share a key/value head, whose features and values are computed once and repeated
(Llama's ``repeat_kv``). With ``softmax_window = W`` (the sliding-window hybrid,
``kernels_hybrid.py``) the raw projected queries and keys go to the core too, with the per-head
mixing weights ``exp(window_log_weight)``, ``exp(linear_log_weight)``.
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
    """Multi-head kernelized self-attention, configured by the shared fields of ``attention_config.py``.

    Args:
        config: a family config, or any object with ``hidden_size`` and ``num_attention_heads``
            (missing shared fields take the base defaults).
        layer_idx: the layer's index; its feature seed is ``feature_seed + 1000 * layer_idx``.
        causal: mask future keys.
        extra_features: width of position features concatenated to every head's queries and keys
            before the feature map (the ViT's rotary features); 0: none.
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
        # set by a family: ``rope`` (rotate q, k before phi), ``rotary`` (rotate the features), ``rpe``
        # (a table with ``weight (H, 2K+1)`` and ``max_relative_position`` K), dropout
        self.rope = False
        self.rotary = False
        self.rpe: Optional[nn.Module] = None
        self.dropout = nn.Dropout(0.0)
        # the hybrid's per-head weights a = exp(window_log_weight), b = exp(linear_log_weight); 1 at init
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
        """``(B, N, C)`` -> query and key features ``(B, H, N, M)`` (float32 at least) and values
        ``(B, H, N, D)``. ``extra``: ``(query_extra, key_extra)``, broadcastable to
        ``(B, H, N, extra_features)``; ``rope``: ``(cos, sin)``, each ``(B, 1, N, D/2)``; the rest
        as in :meth:`forward`."""
        return self.features(*self.projections(hidden_states, extra, rope), projection, attention_mask)

    def projections(
        self,
        hidden_states: torch.Tensor,
        extra: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`project` before the feature map: queries ``(B, H, N, D + extra)``, keys and
        values per key/value head."""
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
        """:meth:`project`'s feature maps; keys and values repeated to their query heads.
        ``sync_free`` (decoding): an out-of-range key gives NaN, not ``ValueError`` (no host read)."""
        q = self.feature_map(q, is_query=True, projection=projection)
        k = self._repeat_kv(self.feature_map(k, is_query=False, projection=projection, key_mask=attention_mask,
                                             sync_free=sync_free))
        return q, k, self._repeat_kv(v.to(q.dtype))

    def window_input(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> Optional[SoftmaxWindow]:
        """The raw queries ``(B, H, N, D)`` and keys (repeated to the query heads) in ``dtype``,
        with W, the scale ``D ** -0.5`` and the mixing weights; None without ``softmax_window``."""
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
        """The call's backend: ``attn_backend`` (a family may check it or pick another)."""
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
            rpe_bias: ``(H, 2N-1)``, its table ``(H, 2K+1)`` when clipped at ``rpe_clip`` K, or
                with ``grid`` ``(H, 2Hg-1, 2Wg-1)``; None: ``self.rpe``, if any.
            grid: ``(Hg, Wg)`` for a 2D bias.
            rpe_clip: K of a clipped 1D bias (enables the O(N K) ``windowed`` backend).
            recompute: recompute the feature maps and kernel in the backward pass (False: e.g.
                inside a checkpointed layer); None: as ``recompute_attention`` says. Never for
                calls from a state.
            projection: the random projection (None: the current one), reused by the
                recomputation, so a redraw before the backward changes nothing.
            extra: position features concatenated before phi (see :meth:`project`).
            rotary: ``(cos, sin)``: ``(B, 1, N, D/2)`` rotating q and k (``self.rope``), or
                ``(B, 1, N, M/2)`` rotating the numerator's features (``self.rotary``).
            past_key_values: a cache layer (``get_state()`` / ``set_state()``) to continue from
                and update, or None.
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
            # the table clipped at K, unexpanded: long inputs may use the O(N K) windowed backend
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
        """Projections, :meth:`_attend` (checkpointed when ``recompute``; with ``only_if_saving``
        only where that keeps less), dropout, ``o_proj``: ``(B, N, C)`` and the state (None
        unless ``output_final_state``)."""
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
        """Whether recomputing keeps less: not when the call's backend (``auto``'s choice) is
        declared ``keeps_inputs``. A wrong guess costs memory or time, never a different result."""
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
        """Projected q, k, v -> feature maps and kernel (what ``recompute`` reruns):
        ``(B, H, N, D)`` and the state (None unless ``output_final_state``)."""
        # only real keys are range-checked; a decoding step gives NaN for a bad key (no host sync)
        raw = (q, k) if self.softmax_window is not None else None
        q, k, v = self.features(q, k, v, projection, attention_mask,
                                sync_free=initial_state is not None and q.shape[2] == 1)
        return self._kernel(q, k, v, attention_mask, rpe_bias, grid, rpe_clip, rotary, initial_state, output_final_state,
                            raw)

    def _kernel(self, q, k, v, attention_mask, rpe_bias, grid, rpe_clip, rotary, initial_state, output_final_state,
                raw=None):
        """Feature-mapped q, k and v -> ``rotary``'s rotations (the positive features serve the
        denominator), then the kernel. ``raw``: the hybrid's raw q, k, or None."""
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
            # decoding: update the cache's tensors in place (out of place if the model was cast since)
            in_place=(initial_state is not None and not torch.is_grad_enabled()
                      and initial_state[0].dtype == compute_dtype_for(q)),
            softmax_window=None if raw is None else self.window_input(*raw, q.dtype), **den,
        )
        return result if output_final_state else (result, None)
