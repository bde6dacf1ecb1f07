"""trisparse.nn.GCNConv: PyG's GCNConv as trisparse's fused GCN layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import GCNConv as _PygGCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

from ...copies import copy_sum
from ...distributed import DistributedPattern
from ...edge import edge_spmm
from ...edge_attention import neighbor_sum
from ...pattern import Pattern, check_edge_ids
from ...sparse import SparseMatrix, gcn_conv, spmm
from ._common import _Fused


class GCNConv(_Fused, _PygGCNConv):
    """PyG's :class:`torch_geometric.nn.GCNConv` (same arguments, ``lin`` and ``bias``
    parameters, outputs): Â x W + b as trisparse's fused GCN layer (:func:`trisparse.gcn_conv`)
    over a :class:`trisparse.SparseMatrix` of PyG's own ``gcn_norm`` weights (built once per
    graph, or once at all with ``cached=True``): on CUDA (Â x) W and the bias in one kernel, or
    x W then the SpMM, whichever the measured rule picks; deterministic in both directions.

    One argument beyond PyG's: ``fuse_relu=True`` applies the ReLU that usually follows the layer
    in the same kernel (the backward keeps a 1-bit mask instead of the output). An
    ``edge_weight`` that requires grad (learned weights) runs PyG's ``gcn_norm``, then the
    per-edge SpMM of x W (:func:`trisparse.edge_spmm`; repeated edges summed, as PyG sums their
    messages), differentiable in x, the weights and every parameter. Falls back to PyG's code,
    with a one-time warning, for graphs given as a ``SparseTensor`` and for a torch.sparse
    adjacency whose values require grad (a COO or CSR ``adj_t`` runs fused, normalised by PyG's
    ``gcn_norm`` as PyG does). A :class:`trisparse.Pattern` as ``edge_index`` (PyG's layer over
    ``pattern.edge_index()``) runs the node-normalised neighbour sums of
    :func:`trisparse.neighbor_sum`, no per-edge value: patterns of billions of entries fit. A
    :class:`trisparse.distributed.DistributedPattern` as ``edge_index`` computes this rank's rows
    of a partitioned graph."""

    def __init__(self, *args, fuse_relu: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse_relu = bool(fuse_relu)
        self._init_fused()
        self._matrix_key = None
        self._matrix = None
        self._weighted_key = None  # the Pattern of learned edge weights' graph
        self._weighted = None

    def _propagation(self, x: Tensor, edge_index: Tensor, edge_weight) -> SparseMatrix:
        if torch.compiler.is_compiling():
            # Built from the real graph while torch.compile traces, and baked into the graph.
            return _TRACED[
                _traced_matrix(self._settings(), x.size(0), x.dtype, edge_index, edge_weight)
            ]
        return self._cached_propagation(x.size(0), x.dtype, edge_index, edge_weight)

    def _settings(self) -> tuple:
        """What the propagation matrix depends on besides the graph: (normalize, improved,
        add_self_loops, flow)."""
        return (self.normalize, self.improved, self.add_self_loops, self.flow)

    def _cached_propagation(self, n: int, dtype, edge_index: Tensor, edge_weight) -> SparseMatrix:
        key = (
            edge_index,
            edge_index._version,
            edge_weight,
            None if edge_weight is None else edge_weight._version,
            n,
        )
        if self._matrix is not None and (self.cached or _same_key(self._matrix_key, key)):
            return self._matrix
        self._matrix = _propagation_matrix(self._settings(), n, dtype, edge_index, edge_weight)
        self._matrix_key = key
        return self._matrix

    def forward(self, x: Tensor, edge_index, edge_weight=None) -> Tensor:
        if isinstance(edge_index, DistributedPattern):
            return self._distributed_gcn(x, edge_index, edge_weight)
        if isinstance(edge_index, Pattern):
            out = self._over_pattern(x, edge_index, edge_weight)
            return F.relu(out) if self.fuse_relu else out
        reason = None
        if isinstance(x, (tuple, list)):
            reason = "bipartite inputs are not supported"
        elif not isinstance(edge_index, Tensor):
            reason = f"{type(edge_index).__name__} graphs are not fused (pass edge_index)"
        elif edge_index.layout not in (torch.strided, torch.sparse_coo, torch.sparse_csr):
            reason = f"{edge_index.layout} adjacency is not fused (pass edge_index, COO or CSR)"
        elif edge_index.layout != torch.strided and (
            edge_index.requires_grad or self.flow != "source_to_target"
        ):
            reason = "a sparse adjacency with gradients or flow='target_to_source' is not fused"
        if reason is not None:
            self._fallback(reason, edge_index)
            out = super().forward(x, edge_index, edge_weight)
            return F.relu(out) if self.fuse_relu else out
        sparse = edge_index.layout != torch.strided
        if sparse:
            edge_weight = None  # PyG's propagate over a sparse adjacency reads its values only
        elif edge_weight is not None and edge_weight.requires_grad:
            out = self._learned_weights(x, edge_index, edge_weight)
            return F.relu(out) if self.fuse_relu else out
        matrix = self._propagation(x, edge_index, edge_weight)
        return gcn_conv(matrix, x, self.lin.weight, self.bias, relu=self.fuse_relu)

    def _over_pattern(self, x: Tensor, pattern: Pattern, edge_weight) -> Tensor:
        """A :class:`trisparse.Pattern` as the graph: PyG's layer over ``pattern.edge_index()``
        (repeated pairs counted), with gcn_norm's weights on the nodes, d^-1/2 ⊙ (the neighbour
        sum of d^-1/2 ⊙ x W + the self loops' terms) (:func:`trisparse.neighbor_sum`): no
        per-edge value, so patterns of billions of entries (:meth:`Pattern.from_sorted_csr`,
        :meth:`Pattern.undirected`) run in place on CUDA. Degrees and self loops as gcn_norm
        counts them (``add_remaining_self_loops`` without edge weights: a node's loops become one
        of weight 1, ``improved`` or not, as in PyG); flow='target_to_source' aggregates over the
        transpose."""
        if edge_weight is not None:
            raise ValueError("edge_weight is not taken with a Pattern; pass edge_index with it")
        if not isinstance(x, Tensor):
            raise TypeError("bipartite inputs are not taken with a Pattern")
        if pattern.num_rows != pattern.num_cols or x.size(0) != pattern.num_cols:
            raise ValueError(
                f"x has {x.size(0)} nodes; the Pattern must be square over them, it is "
                f"{pattern.num_rows} x {pattern.num_cols}"
            )
        transposed = self.flow == "target_to_source"
        if not self.normalize:
            out = neighbor_sum(self.lin(x), pattern, transposed)
            return out if self.bias is None else out + self.bias
        in_deg, out_deg, loops = pattern.pair_counts(x.device)
        deg = out_deg if transposed else in_deg
        if self.add_self_loops:  # each node's loops become one of weight 1 (see above)
            deg = deg - loops + 1
        # (Each [N, C] intermediate dropped as soon as it is used: at papers100M's size one is
        # 14 GB in bf16.)
        y = self.lin(x)
        dinv = deg.to(y.dtype).pow(-0.5)
        dinv = dinv.masked_fill(dinv == float("inf"), 0.0).unsqueeze(-1)
        y = dinv * y
        s = neighbor_sum(y, pattern, transposed)
        if self.add_self_loops:  # the loops' copies out, one loop of gcn_norm's weight in
            s = s + (1 - loops).to(y.dtype).unsqueeze(-1) * y
        del y
        s = dinv * s
        return s if self.bias is None else s + self.bias

    def _learned_weights(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor) -> Tensor:
        """An edge_weight that requires grad (learned edge weights, explainer masks): PyG's own
        gcn_norm (differentiable in the weights; its degree sums are torch scatters, with atomics
        on CUDA), each entry's weight the sum over its copies, then the per-edge SpMM of x W,
        whose gradient in the weights is the SDDMM of the output gradient with x W (both in a
        fixed order)."""
        n = x.size(0)
        # gcn_norm's edges depend on edge_index alone: their Pattern is kept per edge_index.
        key = (edge_index, edge_index._version, n, self.normalize, self.add_self_loops, self.flow)
        new_graph = not _same_key(self._weighted_key, key)
        _check_graph(edge_index, edge_weight, n, ids=new_graph)  # (gcn_norm indexes with them)
        if self.normalize:
            ei, w = gcn_norm(
                edge_index, edge_weight, n, self.improved, self.add_self_loops, self.flow, x.dtype
            )
        else:
            ei, w = edge_index, edge_weight
        if new_graph:
            pairs = ei if self.flow == "source_to_target" else ei.flip(0)
            self._weighted = Pattern.from_edge_index(pairs, size=(n, n))
            self._weighted_key = key
        pattern = self._weighted
        h = self.lin(x)
        values = copy_sum(w.to(h.dtype).unsqueeze(-1), pattern)
        out = edge_spmm(values, h.unsqueeze(1), pattern).squeeze(1)
        return out if self.bias is None else out + self.bias

    def _distributed_gcn(self, x: Tensor, dp: DistributedPattern, edge_weight) -> Tensor:
        """This rank's rows of a partitioned graph: PyG's gcn_norm (DistributedPattern.gcn_matrix:
        from this rank's edges and the halo's degrees), the interior rows while the halo's
        features arrive, then the boundary rows."""
        if edge_weight is not None:
            raise ValueError("edge_weight is not taken with a DistributedPattern")

        def compute(x_src, _x_dst, side, _attr):
            # The side's matrix is rectangular (the fused layer takes square ones): the SpMM on
            # the narrower of x and x W.
            matrix = dp.gcn_matrix(side, self.add_self_loops, self.normalize)
            weight = self.lin.weight.to(x_src.dtype)
            if weight.shape[0] < weight.shape[1]:
                out = spmm(matrix, F.linear(x_src, weight))
            else:
                out = F.linear(spmm(matrix, x_src), weight)
            if self.bias is not None:
                out = out + self.bias
            return F.relu(out) if self.fuse_relu else out

        return dp.run(compute, x)


def _check_graph(edge_index: Tensor, edge_weight, n: int, ids: bool = True) -> None:
    """ValueError naming the argument: edge_weight not one value per edge, or (`ids`: a graph not
    checked before) node ids outside [0, n), before PyG's gcn_norm indexes with them."""
    edges = edge_index.size(1)
    if edge_weight is not None and edge_weight.shape != (edges,):
        raise ValueError(
            f"edge_weight must have shape [{edges}] (one weight per edge), got "
            f"{list(edge_weight.shape)}"
        )
    if ids:
        check_edge_ids(edge_index[1], edge_index[0], n, n)


def _same_key(old, new) -> bool:
    """Cache keys equal: tensors by identity (with their version beside them), the rest by value
    (== on two tensors compares their elements)."""
    return old is not None and all(
        a is b if isinstance(a, Tensor) or isinstance(b, Tensor) else a == b
        for a, b in zip(old, new, strict=True)
    )


def _propagation_matrix(settings, n: int, dtype, edge_index: Tensor, edge_weight) -> SparseMatrix:
    """The propagation matrix of a graph: an edge_index (with edge_weight) or a torch.sparse
    adj_t, normalised as PyG's gcn_norm where `settings` = (normalize, improved, add_self_loops,
    flow) asks."""
    normalize, improved, add_self_loops, flow = settings
    if edge_index.layout != torch.strided:  # a torch.sparse adj_t (rows: targets)
        adj = edge_index
        if normalize:  # PyG's gcn_norm of it; edge_weight unused, as in PyG
            adj, _ = gcn_norm(adj, None, n, improved, add_self_loops, flow, dtype)
        coo = adj.to_sparse_coo().coalesce()
        rows, cols = coo.indices()
        return SparseMatrix(rows, cols, coo.values(), n, n)
    _check_graph(edge_index, edge_weight, n)  # (gcn_norm indexes with them)
    if normalize:
        ei, w = gcn_norm(edge_index, edge_weight, n, improved, add_self_loops, flow, dtype)
    else:
        ei = edge_index
        w = edge_weight if edge_weight is not None else torch.ones(ei.size(1))
    src, dst = (ei[0], ei[1]) if flow == "source_to_target" else (ei[1], ei[0])
    return SparseMatrix(dst, src, w, n, n)


# The matrices that compiled graphs hold (by id), kept alive for them.
_TRACED: dict[int, SparseMatrix] = {}


@torch._dynamo.assume_constant_result
def _traced_matrix(settings, n: int, dtype, edge_index, edge_weight) -> int:
    """Run by torch.compile while tracing, on the real graph: the propagation matrix's id, a
    constant of the compiled graph (a model given another graph must be recompiled). It takes
    the layer's settings, not the layer: torch 2.11's dynamo takes no object argument to a
    constant result."""
    matrix = _propagation_matrix(settings, n, dtype, edge_index, edge_weight)
    _TRACED[id(matrix)] = matrix
    return id(matrix)
