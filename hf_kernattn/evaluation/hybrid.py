"""How much of a sliding-window hybrid's attention goes through its window and how much through its linear part.

A Linear GPT layer with ``softmax_window = W`` weighs key ``j`` for query ``i`` by (see
``hf_kernattn/modeling/kernels_hybrid.py``)::

    w_ij = a_h exp(s_ij),  s_ij = (q_i . k_j) / sqrt(D)     i - W < j <= i   (the window)
    w_ij = b_h phi(q_i) . phi(k_j)                         j <= i - W       (the linear part)

and outputs ``sum_j w_ij v_j / sum_j w_ij``. For each query ``i >= W`` (the first ``W`` have no
key outside the window) the window's share is ``A_i / (A_i + L_i)`` with ``A_i, L_i`` the two
sums of ``w_ij``, the linear part's ``L_i / (A_i + L_i)``; :class:`HybridShares` averages them
over queries per head and layer. A hybrid whose linear share is near 0 ignores everything
older than its window.

The shares come from the layers' own inputs: a forward pre-hook on each hybrid attention module
takes the hidden states it is called with and computes the queries, keys, features and mixing
weights with the module's public ``projections``, ``features`` and ``window_input``. Calls in
chunks (a window scored with a carried cache) are followed across chunks: each layer keeps the
last ``W - 1`` keys and ``sum_j phi(k_j)`` of the older ones, so the cost is O(N (C + W)) per
head for chunks of C tokens, independent of the sequence length. Both sums are scaled by
``exp(-m_i)``, ``m_i = max(0, max_{j in window} s_ij)``, as the kernel does (the ratios are
unchanged).
"""

from __future__ import annotations

from typing import Optional

import torch


def hybrid_attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every sliding-window hybrid attention module in ``model`` (an int
    ``softmax_window`` and the ``projections`` / ``features`` / ``window_input`` methods; found by
    these, so a model loaded with ``trust_remote_code`` counts too), in module order."""
    found = []
    for name, module in model.named_modules():
        w = getattr(module, "softmax_window", None)
        if isinstance(w, int) and not isinstance(w, bool) and all(
                callable(getattr(module, m, None)) for m in ("projections", "features", "window_input")):
            found.append((name, module))
    return found


class _LayerShares:
    """One layer's running sums and the keys carried from the previous chunk."""

    def __init__(self, name: str, index: int) -> None:
        self.name, self.index = name, index
        self.window_sum: Optional[torch.Tensor] = None  # (H,) float64: sum of window shares over queries
        self.linear_sum: Optional[torch.Tensor] = None
        self.queries = 0  # queries counted per head (batch rows included)
        self.window = None
        self.window_weight = self.linear_weight = None
        self.new_sequence()

    def new_sequence(self) -> None:
        self.tail_raw = self.tail_feat = self.older = None  # last W-1 raw keys, their features, sum of older features
        self.position = 0

    def add(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        rope = kwargs.get("rotary") if getattr(module, "rope", False) else None
        if getattr(module, "rotary", False):
            raise ValueError(f"{self.name}: rotations of the features (position_embedding_type='rotary') are not "
                             "covered by the hybrid shares")
        q, k, v = module.projections(hidden, rope=rope)
        q_feat, k_feat, _ = module.features(q, k, v, kwargs.get("projection"))
        sw = module.window_input(q, k, q_feat.dtype)
        w, scale = int(sw.window), float(sw.scale)
        b, h, n, _ = sw.q.shape
        ones = torch.ones(h, dtype=q_feat.dtype, device=q_feat.device)
        a = (ones if sw.window_weight is None else sw.window_weight.to(q_feat.dtype)).view(1, h, 1)
        c = (ones if sw.linear_weight is None else sw.linear_weight.to(q_feat.dtype)).view(1, h, 1)
        self.window, self.window_weight, self.linear_weight = w, a.flatten().tolist(), c.flatten().tolist()
        keys, feats = sw.k, k_feat
        if self.tail_raw is not None:
            keys = torch.cat([self.tail_raw, keys], dim=2)
            feats = torch.cat([self.tail_feat, feats], dim=2)
        t = keys.shape[2] - n  # carried keys before this chunk's first query
        # offsets r = j - i of key column c from query row r: c - t - r
        rel = (torch.arange(t + n, device=keys.device)[None, :] - t
               - torch.arange(n, device=keys.device)[:, None])
        in_window = (rel > -w) & (rel <= 0)
        s = (sw.q @ keys.transpose(-1, -2)) * scale  # (B, H, n, t + n)
        s = s.masked_fill(~in_window, float("-inf"))
        m = s.amax(dim=-1, keepdim=True).clamp_min(0.0)
        window_mass = a * torch.exp(s - m).sum(-1)  # (B, H, n)
        # sum of phi(k_j) over j <= i - W: the carried older sum plus this array's columns c <= r + t - W
        cumulative = torch.cumsum(feats, dim=2)
        last = torch.arange(n, device=keys.device) + t - w
        z = cumulative[:, :, last.clamp_min(0)] * (last >= 0).to(feats.dtype)[:, None]
        if self.older is not None:
            z = z + self.older[:, :, None]
        linear_mass = c * torch.exp(-m[..., 0]) * (q_feat * z).sum(-1)
        total = window_mass + linear_mass
        counted = (self.position + torch.arange(n, device=keys.device)) >= w  # queries with keys beyond the window
        ws = (window_mass / total)[..., counted].double().sum(dim=(0, 2)).cpu()
        ls = (linear_mass / total)[..., counted].double().sum(dim=(0, 2)).cpu()
        self.window_sum = ws if self.window_sum is None else self.window_sum + ws
        self.linear_sum = ls if self.linear_sum is None else self.linear_sum + ls
        self.queries += b * int(counted.sum())
        keep = min(w - 1, keys.shape[2])
        leaving = keys.shape[2] - keep
        if leaving:
            gone = feats[:, :, :leaving].sum(dim=2)
            self.older = gone if self.older is None else self.older + gone
        self.tail_raw, self.tail_feat = keys[:, :, leaving:], feats[:, :, leaving:]
        self.position += n

    def result(self) -> dict:
        heads = []
        if self.queries:
            window = (self.window_sum / self.queries).tolist()
            linear = (self.linear_sum / self.queries).tolist()
            heads = [{"head": i, "window_share": window[i], "linear_share": linear[i], "window_weight": self.window_weight[i],
                      "linear_weight": self.linear_weight[i]} for i in range(len(window))]
        mean = (lambda key: sum(x[key] for x in heads) / len(heads)) if heads else (lambda key: None)
        return {"layer": self.index, "module": self.name, "window": self.window, "queries": self.queries,
                "window_share": mean("window_share"), "linear_share": mean("linear_share"), "heads": heads}


class HybridShares:
    """Context manager recording the window and linear shares of every hybrid layer of
    ``model`` during the forward calls made inside it (see the module docstring). Call
    :meth:`new_sequence` before each new batch of sequences (not between chunks of one);
    :meth:`result` gives per layer ``window_share`` / ``linear_share`` (means over heads), the
    per-head shares with the mixing weights ``a_h`` (``window_weight``) and ``b_h``
    (``linear_weight``), and ``queries`` (queries counted per head). Inputs are unpadded
    sequences (no attention mask)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = hybrid_attention_modules(model)
        self.layers = [_LayerShares(name, i) for i, (name, _) in enumerate(self.modules)]
        self._handles = []

    def __bool__(self) -> bool:
        return bool(self.modules)

    def __enter__(self) -> "HybridShares":
        for (_, module), layer in zip(self.modules, self.layers):
            def hook(mod, args, kwargs, layer=layer):
                with torch.no_grad():
                    layer.add(mod, args, kwargs)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def new_sequence(self) -> None:
        for layer in self.layers:
            layer.new_sequence()

    def result(self) -> list[dict]:
        return [layer.result() for layer in self.layers]


def hybrid_shares(model: torch.nn.Module, input_ids: torch.Tensor, *, chunk_size: int = 1024) -> list[dict]:
    """:class:`HybridShares` of ``model`` on ``input_ids (B, N)`` (unpadded), scored in chunks of
    ``chunk_size`` tokens carrying the cache; ``[]`` for a model without hybrid layers."""
    from .models import score_tokens

    with HybridShares(model) as shares:
        if not shares:
            return []
        score_tokens(model, input_ids, chunk_size=chunk_size)
    return shares.result()
