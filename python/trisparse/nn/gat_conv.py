"""trisparse.nn.GATConv: PyG's GATConv over the fused GAT attention or the per-edge path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import GATConv as _PygGATConv
from torch_geometric.utils import scatter

from ..copies import copy_logsumexp, copy_sum, copy_weights, to_copies
from ..edge import edge_scores, edge_softmax, edge_spmm
from ..edge_attention import edge_attention_supported, edge_gat_attention
from ..gat import gat_attention
from ..pattern import Pattern
from ._common import _check_float, _edge_features, _Fused

# The widest heads the fused GAT kernels take (gat_plan::max_head_width); wider ones run the
# per-edge ops.
_GAT_MAX_WIDTH = 512


class GATConv(_Fused, _PygGATConv):
    """PyG's :class:`torch_geometric.nn.GATConv` (same arguments, parameters, outputs): the
    scores LeakyReLU(a_dst . W x_i + a_src . W x_j), their softmax over each target's incoming
    edges and the aggregation of W x_j run as one fused op (:func:`trisparse.gat_attention`), so
    neither [E, heads] scores nor [E, heads, channels] messages are materialised, and the
    gradients are deterministic. Attention dropout (``dropout``) drops the same edges as PyG's
    for the same seed (its [E, heads] factors are the one per-edge tensor formed).

    Repeated edges (each copy its own term, as in PyG) and edge features (``edge_dim``: the edge
    term a_edge . W_e a_ij becomes one [edge_dim, heads] product, with ``fill_value`` for the self
    loops as PyG) run fused on CUDA over the input's edges (:func:`trisparse.edge_gat_attention`,
    attention dropout included). These on the CPU, ``return_attention_weights`` and heads wider
    than 512 channels run the per-edge path:
    [E, heads] scores, their softmax and the per-edge SpMM (no [E, heads, channels] tensor).
    Bipartite inputs ``(x_src, x_dst)`` and ``size`` are taken as PyG takes them. ``edge_index``
    may also be a :class:`trisparse.Pattern` (built once, self loops included if wanted). Falls
    back to PyG's code, with a one-time warning, only for edge features or attention weights over
    a graph given as a ``SparseTensor``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused()

    def forward(self, x, edge_index, edge_attr=None, size=None, return_attention_weights=None):
        edge_attr, per_edge, unfused = self._edge_request(
            edge_index, edge_attr, return_attention_weights
        )
        if unfused:
            return super().forward(x, edge_index, edge_attr, size, return_attention_weights)
        H, C = self.heads, self.out_channels
        res = None
        if isinstance(x, Tensor):
            res = self.res(x) if getattr(self, "res", None) is not None else None
            if self.lin is not None:
                x_src = x_dst = self.lin(x).view(-1, H, C)
            else:
                x_src, x_dst = self.lin_src(x).view(-1, H, C), self.lin_dst(x).view(-1, H, C)
        else:
            x_src, x_dst = x
            if x_dst is not None and getattr(self, "res", None) is not None:
                res = self.res(x_dst)
            lin_src = self.lin if self.lin is not None else self.lin_src
            lin_dst = self.lin if self.lin is not None else self.lin_dst
            x_src = lin_src(x_src).view(-1, H, C)
            x_dst = None if x_dst is None else lin_dst(x_dst).view(-1, H, C)
        num_src = x_src.size(0)
        num_dst = x_dst.size(0) if x_dst is not None else num_src
        if size is not None:
            num_src, num_dst = int(size[0]), int(size[1])
        pattern = self._patterns.get(
            edge_index, num_src, num_dst, add_self_loops=self.add_self_loops
        )
        alpha_src = (x_src * self.att_src).sum(dim=-1)
        alpha_dst = (
            x_src.new_zeros(num_dst, H) if x_dst is None else (x_dst * self.att_dst).sum(dim=-1)
        )
        dropout = self.training and self.dropout > 0
        weights = None
        multigraph = edge_attr is not None or pattern.duplicates
        if (
            multigraph and not return_attention_weights and edge_attention_supported(pattern, x_src)
        ):  # fused over the input's edges, each copy its own term and dropout draw
            a_edge = None
            if edge_attr is not None:
                edge_attr = self._edge_features(edge_attr, edge_index, pattern, num_src, num_dst)
                a_edge = self._edge_term(edge_attr)
            out = edge_gat_attention(
                x_src,
                alpha_src,
                alpha_dst,
                pattern,
                self.negative_slope,
                a_edge,
                self.dropout if dropout else 0.0,
            )
        elif per_edge or pattern.duplicates or C > _GAT_MAX_WIDTH:
            if edge_attr is not None:
                edge_attr = self._edge_features(edge_attr, edge_index, pattern, num_src, num_dst)
            out, weights = self._per_edge(x_src, alpha_src, alpha_dst, edge_attr, pattern, dropout)
        else:
            keep = order = None
            if dropout:  # PyG's dropout of the [E, H] weights, drawn in the input's edge order
                keep = F.dropout(x_src.new_ones(pattern.nnz, H), p=self.dropout, training=True)
                order = pattern.input_order(x_src.device)
                order = None if order is None else order[1]
            out = gat_attention(
                x_src, alpha_src, alpha_dst, pattern, self.negative_slope, keep, order
            )
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        if res is not None:
            out = out + res
        if self.bias is not None:
            out = out + self.bias
        if return_attention_weights:
            return out, (_with_loops(edge_index, pattern), weights)
        return out

    def _edge_features(self, edge_attr, edge_index, pattern, num_src, num_dst) -> Tensor:
        """edge_attr of the pattern's input edges: with self loops, the kept edges' features and
        the loops' from ``fill_value``, as PyG's remove_self_loops and add_self_loops give them
        (the kept edges come from the pattern, so no shape depends on data: torch.compile)."""
        _check_float("edge_attr", edge_attr)
        if not self.add_self_loops:
            return _edge_features(edge_attr, pattern, self.edge_dim)
        kept = pattern.kept_edges(edge_attr.device)
        if kept is None or not isinstance(edge_index, Tensor):
            raise TypeError(
                "edge_index: edge features with add_self_loops need the edge_index tensor (the "
                "loops' features are filled from it)"
            )
        if edge_attr.dim() == 1:
            edge_attr = edge_attr.unsqueeze(-1)
        if edge_attr.size(0) != edge_index.size(1):
            raise ValueError(
                f"edge_attr must have one row per edge of edge_index ({edge_index.size(1)}), "
                f"got {edge_attr.size(0)}"
            )
        n = min(num_src, num_dst)
        attr = edge_attr[kept]
        fill = self.fill_value
        size = (n, *attr.shape[1:])
        if fill is None:
            loops = attr.new_ones(size)
        elif isinstance(fill, (int, float)):
            loops = attr.new_full(size, fill)
        elif isinstance(fill, Tensor):
            loops = fill.to(attr.device, attr.dtype).expand(size).contiguous()
        else:  # "mean", "add", ...: PyG's scatter over each node's incoming kept edges
            loops = scatter(attr, edge_index[1][kept], 0, n, reduce=fill)
        return _edge_features(torch.cat([attr, loops]), pattern, self.edge_dim)

    def _edge_term(self, edge_attr: Tensor) -> Tensor:
        """[E, H]: (W_e a . att_edge) summed over C = a . (W_e^T att_edge), one [edge_dim, H]
        matrix."""
        H, C = self.heads, self.out_channels
        w_edge = self.lin_edge.weight.view(H, C, -1)
        return edge_attr @ torch.einsum("hcd,hc->dh", w_edge, self.att_edge[0])

    def _per_edge(self, x_src, alpha_src, alpha_dst, edge_attr, pattern, dropout):
        """GAT's attention with [E, H] weights per input edge: the output [N, H, C] and the
        weights (after dropout, as PyG's layer returns them)."""
        scores = to_copies(edge_scores(alpha_dst, alpha_src, pattern), pattern)
        if edge_attr is not None:
            scores = scores + self._edge_term(edge_attr)
        scores = F.leaky_relu(scores, self.negative_slope)
        entry = copy_logsumexp(scores, pattern)
        alpha = edge_softmax(entry, pattern)
        weights = to_copies(alpha, pattern)
        shares = copy_weights(scores, entry, pattern)
        if shares is not None:  # a repeated edge's copies share its weight
            weights = weights * shares
        if dropout:
            weights = F.dropout(weights, p=self.dropout, training=True)
        return edge_spmm(copy_sum(weights, pattern), x_src, pattern), weights


def _with_loops(edge_index, pattern: Pattern) -> Tensor:
    """The edge_index whose edges the per-edge weights are of (PyG's, self loops included)."""
    if isinstance(edge_index, Pattern):
        row, col = edge_index.entries(edge_index.device)
        return torch.stack([col, row])
    rows = pattern.entries(edge_index.device)
    entries = pattern.entries_of_input(edge_index.device)
    return torch.stack([rows[1][entries], rows[0][entries]])
