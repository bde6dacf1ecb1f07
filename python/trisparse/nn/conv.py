"""Drop-in PyG layers: the same constructor arguments, parameters and state_dict as PyG's, with
the attention computed by trisparse's fused kernels. What the fused path does not cover runs
PyG's own code (the layers subclass PyG's), after a one-time warning naming the reason."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

try:
    from torch_geometric.nn import MessagePassing
    from torch_geometric.nn import TransformerConv as _PygTransformerConv
except ImportError as e:  # pragma: no cover - exercised only without PyG
    raise ImportError(
        "trisparse.nn holds drop-in replacements for PyG layers and needs torch_geometric "
        "(pip install torch_geometric)"
    ) from e

from ..attention import sparse_attention
from ..pattern import Pattern

__all__ = ["TransformerConv"]


class _PatternCache:
    """The Pattern of the last graph a layer saw: rebuilt when the graph object, its contents
    (torch's version counter) or the node counts change. It holds the graph object, so that an
    equal id() never means another graph."""

    def __init__(self):
        self._adj = None
        self._key = None
        self._pattern = None

    def get(self, adj, num_src: int, num_dst: int) -> Pattern:
        if isinstance(adj, Pattern):
            return adj
        key = (getattr(adj, "_version", None), num_src, num_dst)
        if adj is not self._adj or key != self._key:
            if isinstance(adj, Tensor) and adj.layout == torch.strided:
                self._pattern = Pattern.from_edge_index(adj, size=(num_src, num_dst))
            else:
                self._pattern = Pattern.of(adj, num_nodes=num_src)
            self._adj, self._key = adj, key
        return self._pattern


class TransformerConv(_PygTransformerConv):
    """PyG's :class:`torch_geometric.nn.TransformerConv` (same arguments, parameters, outputs),
    its attention fused by trisparse: no [E, heads, channels] messages are materialised, and the
    gradients are deterministic.

    ``edge_index`` may also be a :class:`trisparse.Pattern` (built once, reused every step).
    Falls back to PyG's code, with a one-time warning, for: ``edge_dim`` / ``edge_attr``,
    ``return_attention_weights``, attention dropout while training, and graphs with repeated
    edges (PyG counts each copy; the fused pattern is binary)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._patterns = _PatternCache()
        self._warned: set[str] = set()

    def propagate(self, edge_index, size=None, **kwargs):
        # PyG's generic propagate: PyG would otherwise generate one from this class's source,
        # which has no propagate call to read the arguments from.
        return MessagePassing.propagate(self, edge_index, size=size, **kwargs)

    def _fallback(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"trisparse.nn.TransformerConv: {reason}; running PyG's TransformerConv code "
                "for this call (exact, not fused)",
                stacklevel=3,
            )

    def forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
        reason = None
        if self.lin_edge is not None or edge_attr is not None:
            reason = "edge features (edge_dim) are not fused"
        elif return_attention_weights is not None:
            reason = "return_attention_weights is not fused"
        elif self.training and self.dropout > 0:
            reason = "attention dropout is not fused yet"
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        pattern = None
        if reason is None:
            pattern = self._patterns.get(edge_index, x_src.size(0), x_dst.size(0))
            if pattern.duplicates:
                reason = f"the graph has {pattern.duplicates} repeated edges"
        if reason is not None:
            self._fallback(reason)
            if isinstance(edge_index, Pattern):
                raise ValueError(
                    f"edge_index: a trisparse.Pattern cannot run PyG's code ({reason}); pass "
                    "edge_index"
                )
            return super().forward(x, edge_index, edge_attr, return_attention_weights)

        H, C = self.heads, self.out_channels
        query = self.lin_query(x_dst).view(-1, H, C)
        key = self.lin_key(x_src).view(-1, H, C)
        value = self.lin_value(x_src).view(-1, H, C)
        out = sparse_attention(query, key, value, pattern, scale=1.0 / math.sqrt(C))
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        if self.root_weight:
            x_r = self.lin_skip(x_dst)
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        return out
