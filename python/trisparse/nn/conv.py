"""Drop-in PyG layers: the same constructor arguments, parameters and state_dict as PyG's, with
the attention computed by trisparse's fused kernels. What the fused path does not cover runs
PyG's own code (the layers subclass PyG's), after a one-time warning naming the reason."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

try:
    import torch.nn.functional as F
    from torch_geometric.nn import AGNNConv as _PygAGNNConv
    from torch_geometric.nn import GATConv as _PygGATConv
    from torch_geometric.nn import GCNConv as _PygGCNConv
    from torch_geometric.nn import MessagePassing
    from torch_geometric.nn import TransformerConv as _PygTransformerConv
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import add_self_loops, remove_self_loops
except ImportError as e:  # pragma: no cover - exercised only without PyG
    raise ImportError(
        "trisparse.nn holds drop-in replacements for PyG layers and needs torch_geometric "
        "(pip install torch_geometric)"
    ) from e

from ..attention import sparse_attention
from ..copies import (
    copy_aggregate,
    copy_dot,
    copy_logsumexp,
    copy_sum,
    copy_weights,
    to_copies,
)
from ..edge import edge_scores, edge_softmax, edge_spmm, sddmm
from ..gat import gat_attention
from ..pattern import Pattern
from ..sparse import SparseMatrix, gcn_conv

__all__ = ["AGNNConv", "GATConv", "GCNConv", "TransformerConv"]

# The widest heads the fused GAT kernels take (gat_plan::max_head_width); wider ones run the
# per-edge ops.
_GAT_MAX_WIDTH = 512


class _PatternCache:
    """The Pattern of the last graph a layer saw: rebuilt when the graph object, its contents
    (torch's version counter) or the node counts change. It holds the graph object, so that an
    equal id() never means another graph."""

    def __init__(self):
        self._adj = None
        self._key = None
        self._pattern = None

    def get(self, adj, num_src: int, num_dst: int, add_self_loops: bool = False) -> Pattern:
        if isinstance(adj, Pattern):
            return adj
        key = (getattr(adj, "_version", None), num_src, num_dst, add_self_loops)
        if adj is not self._adj or key != self._key:
            if isinstance(adj, Tensor) and adj.layout == torch.strided:
                self._pattern = Pattern.from_edge_index(
                    adj, size=(num_src, num_dst), add_self_loops=add_self_loops
                )
            elif add_self_loops:
                raise TypeError(
                    "edge_index: with add_self_loops the fused path takes an edge_index tensor "
                    f"or a trisparse.Pattern, not {type(adj).__name__}"
                )
            else:
                self._pattern = Pattern.of(adj, num_nodes=num_src)
            self._adj, self._key = adj, key
        return self._pattern


def _generic_propagate(self, edge_index, size=None, **kwargs):
    return MessagePassing.propagate(self, edge_index, size=size, **kwargs)


def _generic_edge_updater(self, edge_index, size=None, **kwargs):
    return MessagePassing.edge_updater(self, edge_index, size=size, **kwargs)


class _Fused:
    """What the drop-in layers share: the Pattern cache, PyG's generic propagate for the
    fallback, and the one-time warning that names why a call runs PyG's code."""

    def _init_fused(self) -> None:
        self._patterns = _PatternCache()
        self._warned: set[str] = set()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # PyG's generic propagate and edge_updater, in the class itself: PyG would otherwise
        # generate them from the class's source, which has no such calls to read arguments from.
        cls.propagate = _generic_propagate
        cls.edge_updater = _generic_edge_updater

    def _attention_dropout(self, alpha: Tensor, pattern: Pattern) -> Tensor:
        """F.dropout of the [E, heads] attention weights (in the pattern's entry order) with the
        draws PyG's layer makes: in the order of the edge_index the pattern was built from, so
        that a seed drops the same edges as PyG (for a Pattern passed in, in entry order)."""
        order = pattern.input_order(alpha.device)
        if order is None:
            return F.dropout(alpha, p=self.dropout, training=True)
        to_input, to_entries = order
        return F.dropout(alpha[to_input], p=self.dropout, training=True)[to_entries]

    def _fallback(self, reason: str, edge_index) -> None:
        if isinstance(edge_index, Pattern):
            raise TypeError(
                f"edge_index: a trisparse.Pattern cannot run PyG's code ({reason}); pass edge_index"
            )
        if reason not in self._warned:
            self._warned.add(reason)
            name = type(self).__name__
            warnings.warn(
                f"trisparse.nn.{name}: {reason}; running PyG's {name} code for this call "
                "(exact, not fused)",
                stacklevel=3,
            )


class TransformerConv(_Fused, _PygTransformerConv):
    """PyG's :class:`torch_geometric.nn.TransformerConv` (same arguments, parameters, outputs),
    its attention fused by trisparse: no [E, heads, channels] messages are materialised, and the
    gradients are deterministic.

    ``edge_index`` may also be a :class:`trisparse.Pattern` (built once, reused every step).
    Repeated edges count once per copy, as in PyG (a log-count bias on the fused scores). Attention
    dropout while training, edge features (``edge_dim``) and ``return_attention_weights`` run the
    per-edge path: [E, heads] scores (SDDMM), softmax and dropout per input edge, then the per-edge
    SpMM; an edge feature a_ij enters as q_i . W_e a_ij on the score and W_e sum_j alpha_ij a_ij on
    the output (exact by linearity), so only [E, edge_dim] and [N, heads, edge_dim] tensors appear.
    Falls back to PyG's code, with a one-time warning, only for edge features or attention weights
    over a graph given as a ``SparseTensor``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused()

    def forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
        if self.lin_edge is None:
            edge_attr = None  # PyG's layer ignores it too
        per_edge = edge_attr is not None or bool(return_attention_weights)
        if per_edge and not isinstance(edge_index, (Tensor, Pattern)):
            self._fallback(
                "edge features and attention weights need an edge_index tensor", edge_index
            )
            return super().forward(x, edge_index, edge_attr, return_attention_weights)
        if self.lin_edge is not None and edge_attr is None:
            raise ValueError("edge_attr: this layer has edge_dim set and needs edge features")
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        pattern = self._patterns.get(edge_index, x_src.size(0), x_dst.size(0))
        H, C = self.heads, self.out_channels
        query = self.lin_query(x_dst).view(-1, H, C)
        key = self.lin_key(x_src).view(-1, H, C)
        value = self.lin_value(x_src).view(-1, H, C)
        scale = 1.0 / math.sqrt(C)
        dropout = self.training and self.dropout > 0
        alpha = None
        if per_edge or dropout:
            out, alpha = self._per_edge(query, key, value, edge_attr, pattern, scale, dropout)
        else:
            bias = pattern.log_multiplicity(query.device)
            out = sparse_attention(query, key, value, pattern, scale=scale, bias=bias)
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        if self.root_weight:
            x_r = self.lin_skip(x_dst)
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        if return_attention_weights:
            return out, (edge_index, alpha)
        return out

    def _per_edge(self, query, key, value, edge_attr, pattern, scale, dropout):
        """The attention with [E, H] weights: returns the output [N, H, C] and the weights of the
        input's edges (before dropout, as PyG's layer returns them)."""
        H, C = self.heads, self.out_channels
        if edge_attr is not None:
            edge_attr = _edge_features(edge_attr, pattern, self.edge_dim)
            w_edge = self.lin_edge.weight.view(H, C, -1)  # W_e of head h: [C, edge_dim]
            # q_i . (W_e a_ij) = (W_e^T q_i) . a_ij: per-node [N, H, edge_dim], then per-edge dots.
            scores = scale * copy_dot(
                torch.einsum("nhc,hcd->nhd", query, w_edge), edge_attr, pattern
            )
        else:
            scores = query.new_zeros(_input_edges(pattern), H)
        entry = copy_logsumexp(scores, pattern)  # log(count) for plain repeats
        alpha = edge_softmax(scale * sddmm(query, key, pattern) + entry, pattern)
        weights = to_copies(alpha, pattern) * copy_weights(scores, entry, pattern)
        dropped = F.dropout(weights, p=self.dropout, training=True) if dropout else weights
        out = edge_spmm(copy_sum(dropped, pattern), value, pattern)
        if edge_attr is not None:
            messages = copy_aggregate(dropped, edge_attr, pattern)  # [N, H, edge_dim]
            out = out + torch.einsum("nhd,hcd->nhc", messages, w_edge)
        return out, weights


def _input_edges(pattern: Pattern) -> int:
    entries = pattern.entries_of_input(torch.device("cpu"))
    if entries is None:
        raise TypeError(
            "edge_index: per-edge values need the edges a Pattern was built from; pass "
            "edge_index (or a Pattern from Pattern.from_edge_index)"
        )
    return entries.numel()


def _check_float(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


def _edge_features(edge_attr, pattern: Pattern, edge_dim: int) -> Tensor:
    """edge_attr as [E, edge_dim] (PyG also takes [E] for edge_dim 1), checked against the
    graph's edge count."""
    _check_float("edge_attr", edge_attr)
    if edge_attr.dim() == 1:
        edge_attr = edge_attr.unsqueeze(-1)
    edges = _input_edges(pattern)
    if edge_attr.dim() != 2 or edge_attr.shape != (edges, edge_dim):
        raise ValueError(
            f"edge_attr must have shape [{edges}, {edge_dim}] (one row per edge of edge_index, "
            f"edge_dim columns), got {list(edge_attr.shape)}"
        )
    return edge_attr


class AGNNConv(_Fused, _PygAGNNConv):
    """PyG's :class:`torch_geometric.nn.AGNNConv` (same arguments, ``beta`` parameter or buffer,
    outputs), as fused attention: out_i = sum_j softmax_j(beta cos(x_i, x_j)) x_j over i's
    incoming edges (and a self loop per node with ``add_self_loops``), with q = beta x_i / |x_i|,
    k = x_j / |x_j|, v = x_j, so autograd reaches beta through q. Repeated edges count once per
    copy, as in PyG (a log-count bias on the fused scores)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused()

    def forward(self, x: Tensor, edge_index) -> Tensor:
        n = x.size(0)
        pattern = self._patterns.get(edge_index, n, n, add_self_loops=self.add_self_loops)
        x_norm = F.normalize(x, p=2.0, dim=-1)
        q = (self.beta * x_norm).unsqueeze(1)
        out = sparse_attention(
            q,
            x_norm.unsqueeze(1),
            x.unsqueeze(1),
            pattern,
            scale=1.0,
            bias=pattern.log_multiplicity(x.device),
        )
        return out.squeeze(1)


class GCNConv(_Fused, _PygGCNConv):
    """PyG's :class:`torch_geometric.nn.GCNConv` (same arguments, ``lin`` and ``bias``
    parameters, outputs): Â x W + b as trisparse's fused GCN layer (:func:`trisparse.gcn_conv`)
    over a :class:`trisparse.SparseMatrix` of PyG's own ``gcn_norm`` weights (built once per
    graph, or once at all with ``cached=True``): on CUDA (Â x) W and the bias in one kernel, or
    x W then the SpMM, whichever the measured rule picks; deterministic in both directions.

    One argument beyond PyG's: ``fuse_relu=True`` applies the ReLU that usually follows the layer
    in the same kernel (the backward keeps a 1-bit mask instead of the output). Falls back to
    PyG's code, with a one-time warning, for an ``edge_weight`` that requires grad and for graphs
    that are not an ``edge_index`` tensor."""

    def __init__(self, *args, fuse_relu: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse_relu = bool(fuse_relu)
        self._init_fused()
        self._matrix_key = None
        self._matrix = None

    def _propagation(self, x: Tensor, edge_index: Tensor, edge_weight) -> SparseMatrix:
        n = x.size(0)
        key = (
            edge_index,
            edge_index._version,
            edge_weight,
            None if edge_weight is None else edge_weight._version,
            n,
        )
        if self._matrix is not None and (self.cached or self._matrix_key == key):
            return self._matrix
        if self.normalize:
            ei, w = gcn_norm(
                edge_index, edge_weight, n, self.improved, self.add_self_loops, self.flow, x.dtype
            )
        else:
            ei = edge_index
            w = edge_weight if edge_weight is not None else torch.ones(ei.size(1))
        src, dst = (ei[0], ei[1]) if self.flow == "source_to_target" else (ei[1], ei[0])
        self._matrix = SparseMatrix(dst, src, w, n, n)
        self._matrix_key = key
        return self._matrix

    def forward(self, x: Tensor, edge_index, edge_weight=None) -> Tensor:
        reason = None
        if isinstance(x, (tuple, list)):
            reason = "bipartite inputs are not supported"
        elif not isinstance(edge_index, Tensor) or edge_index.layout != torch.strided:
            reason = f"{type(edge_index).__name__} graphs are not fused (pass edge_index)"
        elif edge_weight is not None and edge_weight.requires_grad:
            reason = "gradients of edge_weight are not fused"
        if reason is not None:
            self._fallback(reason, edge_index)
            out = super().forward(x, edge_index, edge_weight)
            return F.relu(out) if self.fuse_relu else out
        matrix = self._propagation(x, edge_index, edge_weight)
        return gcn_conv(matrix, x, self.lin.weight, self.bias, relu=self.fuse_relu)


class GATConv(_Fused, _PygGATConv):
    """PyG's :class:`torch_geometric.nn.GATConv` (same arguments, parameters, outputs): the
    scores LeakyReLU(a_dst . W x_i + a_src . W x_j), their softmax over each target's incoming
    edges and the aggregation of W x_j run as one fused op (:func:`trisparse.gat_attention`), so
    neither [E, heads] scores nor [E, heads, channels] messages are materialised, and the
    gradients are deterministic. Attention dropout (``dropout``) drops the same edges as PyG's
    for the same seed (its [E, heads] factors are the one per-edge tensor formed).

    Repeated edges (each copy its own term, as in PyG), edge features (``edge_dim``: the edge term
    a_edge . W_e a_ij becomes one [edge_dim, heads] product, with ``fill_value`` for the self loops
    as PyG), ``return_attention_weights`` and heads wider than 512 channels run the per-edge path:
    [E, heads] scores, their softmax and the per-edge SpMM (no [E, heads, channels] tensor).
    Bipartite inputs ``(x_src, x_dst)`` and ``size`` are taken as PyG takes them. ``edge_index``
    may also be a :class:`trisparse.Pattern` (built once, self loops included if wanted). Falls
    back to PyG's code, with a one-time warning, only for edge features or attention weights over
    a graph given as a ``SparseTensor``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused()

    def forward(self, x, edge_index, edge_attr=None, size=None, return_attention_weights=None):
        if self.lin_edge is None:
            edge_attr = None  # PyG's layer ignores it too
        per_edge = edge_attr is not None or bool(return_attention_weights)
        if per_edge and not isinstance(edge_index, (Tensor, Pattern)):
            self._fallback(
                "edge features and attention weights need an edge_index tensor", edge_index
            )
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
        if per_edge or pattern.duplicates or C > _GAT_MAX_WIDTH:
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
        """edge_attr of the pattern's input edges: with self loops, PyG's own removal and
        addition (fill_value) over edge_index."""
        _check_float("edge_attr", edge_attr)
        if self.add_self_loops:
            if not isinstance(edge_index, Tensor):
                raise TypeError(
                    "edge_index: edge features with add_self_loops need the edge_index tensor "
                    "(the loops' features are filled from it)"
                )
            n = min(num_src, num_dst)
            if edge_attr.dim() == 1:
                edge_attr = edge_attr.unsqueeze(-1)
            if edge_attr.size(0) != edge_index.size(1):
                raise ValueError(
                    f"edge_attr must have one row per edge of edge_index ({edge_index.size(1)}), "
                    f"got {edge_attr.size(0)}"
                )
            ei, edge_attr = remove_self_loops(edge_index, edge_attr)
            _, edge_attr = add_self_loops(ei, edge_attr, fill_value=self.fill_value, num_nodes=n)
        return _edge_features(edge_attr, pattern, self.edge_dim)

    def _per_edge(self, x_src, alpha_src, alpha_dst, edge_attr, pattern, dropout):
        """GAT's attention with [E, H] weights per input edge: the output [N, H, C] and the
        weights (after dropout, as PyG's layer returns them)."""
        H, C = self.heads, self.out_channels
        scores = to_copies(edge_scores(alpha_dst, alpha_src, pattern), pattern)
        if edge_attr is not None:
            # (W_e a . att_edge) summed over C = a . (W_e^T att_edge): one [edge_dim, H] matrix.
            w_edge = self.lin_edge.weight.view(H, C, -1)
            scores = scores + edge_attr @ torch.einsum("hcd,hc->dh", w_edge, self.att_edge[0])
        scores = F.leaky_relu(scores, self.negative_slope)
        entry = copy_logsumexp(scores, pattern)
        alpha = edge_softmax(entry, pattern)
        weights = to_copies(alpha, pattern) * copy_weights(scores, entry, pattern)
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
