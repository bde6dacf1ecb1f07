"""trisparse.nn.TransformerConv: PyG's TransformerConv over the fused attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torch_geometric.nn import TransformerConv as _PygTransformerConv

from ..._tensors import resolve_scale
from ...attention import sparse_attention
from ...copies import copy_aggregate, copy_dot, copy_logsumexp, copy_sum, copy_weights, to_copies
from ...distributed import DistributedPattern
from ...edge import edge_softmax, edge_spmm, sddmm
from ...edge_attention import edge_attention, edge_attention_supported
from ._common import _edge_features, _Fused, _head_product, _input_edges, _linear


def _plain_graph_on_edge_kernels(query: Tensor) -> bool:
    """Whether a graph without repeated edges, features or dropout runs faster on the multigraph
    kernels (:func:`edge_attention`: a warp per row) than on :func:`sparse_attention` (the fused
    3S kernel in 16-bit, the row-wise kernel in float32), forward + backward. Measured on the H200
    over the 12 shared graphs of >= 200K edges (bench/python/graph_attention_paths.py,
    docs/notes/graph_transformers.md): faster on every one at 16 channels a head (1.4-3.4 x in
    float32, 1.2-2.2 x in bfloat16) and in float32 at 64 (1.04-1.55 x on 11 of 12), slower in
    bfloat16 at 64 (0.41-1.03 x: the tensor cores' turn)."""
    channels = query.shape[-1]
    return query.is_cuda and (channels <= 16 or (query.dtype == torch.float32 and channels <= 64))


class TransformerConv(_Fused, _PygTransformerConv):
    """PyG's :class:`torch_geometric.nn.TransformerConv` (same arguments, parameters, outputs),
    its attention fused by trisparse: no [E, heads, channels] messages are materialised, and the
    gradients are deterministic.

    ``edge_index`` may also be a :class:`trisparse.Pattern` (built once, reused every step).
    Repeated edges count once per copy, as in PyG (on CUDA each copy is its own edge of the
    multigraph kernels; elsewhere a log-count bias on the fused scores). On CUDA a plain graph
    takes the multigraph kernels too where they measured faster (heads of at most 16 channels, or
    64 in float32), else :func:`trisparse.sparse_attention`'s tensor-core kernel. Edge
    features (``edge_dim``) and attention dropout run fused on CUDA and on the CPU
    (:func:`trisparse.edge_attention`: the kernel reads each edge's features; on CUDA the dropout
    is drawn per input edge and head in the kernels and regenerated in the backward, or with
    ``pyg_dropout=True`` -- always on the CPU -- drawn as PyG draws it, the same edges as PyG's
    layer for the same seed, and read as an [E, heads] factor); an edge feature a_ij enters as
    q_i . W_e a_ij on the score and W_e sum_j alpha_ij a_ij on the output (exact by linearity), so
    only [E, edge_dim] and [N, heads, edge_dim] tensors appear. ``return_attention_weights`` runs
    the per-edge path: [E, heads] scores (SDDMM), softmax and dropout per input edge, then the
    per-edge SpMM.
    With a :class:`trisparse.distributed.DistributedPattern` as ``edge_index`` and this rank's
    rows as ``x``, it computes this rank's rows of a partitioned graph (halo exchange included).
    Falls back to PyG's code, with a one-time warning, only for edge features or attention weights
    over a graph given as a ``SparseTensor``."""

    def __init__(self, *args, pyg_dropout: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.pyg_dropout = pyg_dropout
        self._init_fused()

    def forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
        if isinstance(edge_index, DistributedPattern):
            return self._distributed(x, edge_index, edge_attr, return_attention_weights)
        edge_attr, per_edge, unfused = self._edge_request(
            edge_index, edge_attr, return_attention_weights
        )
        if unfused:
            return super().forward(x, edge_index, edge_attr, return_attention_weights)
        if self.lin_edge is not None and edge_attr is None:
            raise ValueError("edge_attr: this layer has edge_dim set and needs edge features")
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        pattern = self._patterns.get(edge_index, x_src.size(0), x_dst.size(0))
        query, key, value, x_r = self._project(x_src, x_dst)
        out, alpha = self._attend(
            query, key, value, pattern, edge_attr, per_edge, return_attention_weights
        )
        out = self._finish(out, x_r)
        if return_attention_weights:
            return out, (edge_index, alpha)
        return out

    def _attend(self, query, key, value, pattern, edge_attr, per_edge, return_weights):
        """The attention of projected [N, H, C] query, key and value over `pattern`: (out, the
        input edges' weights where the per-edge path ran, else None)."""
        scale = resolve_scale(None, self.out_channels)
        dropout = self.dropout if self.training else 0.0
        features = self.edge_dim if edge_attr is not None else 0
        # Repeated edges, edge features and dropout take the multigraph kernels (each copy its
        # own edge); a plain graph too where they measured faster, else sparse_attention.
        fused_edges = (
            (
                edge_attr is not None
                or dropout > 0
                or pattern.duplicates > 0
                or _plain_graph_on_edge_kernels(query)
            )
            and not return_weights
            and edge_attention_supported(pattern, query, features)
        )
        if fused_edges:
            return self._edge_attention(query, key, value, edge_attr, pattern, scale, dropout), None
        if per_edge or dropout > 0:
            return self._per_edge(query, key, value, edge_attr, pattern, scale, dropout > 0)
        bias = pattern.log_multiplicity(query.device)
        return sparse_attention(query, key, value, pattern, scale=scale, bias=bias), None

    def _project(self, x_src, x_dst):
        """query [N_dst, H, C], key and value [N_src, H, C] and the skip term lin_skip(x_dst)
        (None without root_weight). One node set: one GEMM over the concatenated weights and
        biases, whose output the attention reads in place (one cast of x under autocast, one
        gradient of x and one bias reduction in the backward, where four linears pay each four
        times); the same products, the columns of one matrix."""
        H, C = self.heads, self.out_channels
        lins = [self.lin_query, self.lin_key, self.lin_value]
        lins += [self.lin_skip] if self.root_weight else []
        if x_src is not x_dst or any(
            isinstance(lin.weight, UninitializedParameter) for lin in lins
        ):
            parts = [lins[0](x_dst), lins[1](x_src), lins[2](x_src)]
            parts += [lins[3](x_dst)] if self.root_weight else []
        else:
            weight = torch.cat([lin.weight for lin in lins])
            bias = None if lins[0].bias is None else torch.cat([lin.bias for lin in lins])
            y = _linear(x_src, weight, bias)
            parts = list(y.split([lin.weight.shape[0] for lin in lins], dim=-1))
        x_r = parts[3] if self.root_weight else None
        return parts[0].view(-1, H, C), parts[1].view(-1, H, C), parts[2].view(-1, H, C), x_r

    def _finish(self, out, x_r):
        """The heads concatenated or averaged, then the skip connection x_r = lin_skip(x_dst)
        (gated with beta)."""
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if self.root_weight:
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        return out

    def _distributed(self, x, dp, edge_attr=None, return_attention_weights=None):
        """This rank's rows of a partitioned graph: the owned rows projected once, the interior
        rows attended while the halo's inputs arrive, then the halo's keys and values projected
        and the boundary rows attended."""
        self._check_distributed(x, return_attention_weights)
        if self.lin_edge is None:
            edge_attr = None
        elif edge_attr is None:
            raise ValueError("edge_attr: this layer has edge_dim set and needs edge features")
        H, C = self.heads, self.out_channels
        halo, arrived = dp.start_exchange(x)
        query = self.lin_query(x).view(-1, H, C)
        key, value = self.lin_key(x).view(-1, H, C), self.lin_value(x).view(-1, H, C)
        outs = []
        for side in (0, 1):
            if side == 1:
                arrived.wait()
                key = torch.cat([key, self.lin_key(halo).view(-1, H, C)])
                value = torch.cat([value, self.lin_value(halo).view(-1, H, C)])
            rows = dp.rows(side)
            if rows.stop > rows.start:
                attr = dp.edge_rows(side, edge_attr)
                pattern = dp.pattern(side)
                out, _ = self._attend(
                    query[rows], key, value, pattern, attr, attr is not None, None
                )
                outs.append(out)
        out = dp.joined(outs[0] if len(outs) == 1 else torch.cat(outs), halo)
        return self._finish(out, self.lin_skip(x) if self.root_weight else None)

    def _pyg_draws(self, query: Tensor) -> bool:
        """Whether the dropout is drawn as PyG's (an [E, heads] factor): asked for, or on the CPU
        (whose engine reads the factors; its draws then match PyG's layer as before)."""
        return self.pyg_dropout or query.is_cpu

    def _edge_attention(self, query, key, value, edge_attr, pattern, scale, dropout):
        """Edge features or attention dropout on CUDA, fused: the score term q_i . W_e a_ij =
        (W_e^T q_i) . a_ij and the message term W_e sum_j alpha_ij a_ij come from one kernel that
        reads a_ij per edge (trisparse.edge_attention), the dropout a factor per (edge, head) on
        the weights; no per-edge tensor but edge_attr itself. The per-head products with W_e are
        :func:`_head_product`'s."""
        if edge_attr is None:
            out, _ = edge_attention(
                query,
                key,
                value,
                pattern,
                scale,
                dropout=dropout,
                pyg_dropout=self._pyg_draws(query),
            )
            return out
        H, C = self.heads, self.out_channels
        edge_attr = _edge_features(edge_attr, pattern, self.edge_dim)
        n = query.shape[0]
        w_edge = self.lin_edge.weight.view(H, C, -1)  # W_e of head h: [C, edge_dim]
        r = _head_product(query, scale * w_edge)  # (W_e^T q_i) per head: [n, H, edge_dim]
        out, out_edge = edge_attention(
            query,
            key,
            value,
            pattern,
            scale,
            r.to(query.dtype),
            edge_attr.to(query.dtype),
            dropout=dropout,
            pyg_dropout=self._pyg_draws(query),
        )
        message = _head_product(out_edge.view(n, H, -1), w_edge.transpose(1, 2))
        return out + message

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
        elif pattern.duplicates:
            scores = query.new_zeros(_input_edges(pattern), H)
        else:
            scores = None
        logits = scale * sddmm(query, key, pattern)
        if scores is not None:
            entry = copy_logsumexp(scores, pattern)  # log(count) for plain repeats
            logits = logits + entry
        alpha = edge_softmax(logits, pattern)
        weights = to_copies(alpha, pattern)
        shares = None if scores is None else copy_weights(scores, entry, pattern)
        if shares is not None:  # a repeated edge's copies share its weight
            weights = weights * shares
        dropped = F.dropout(weights, p=self.dropout, training=True) if dropout else weights
        out = edge_spmm(copy_sum(dropped, pattern), value, pattern)
        if edge_attr is not None:
            messages = copy_aggregate(dropped, edge_attr, pattern)  # [N, H, edge_dim]
            out = out + torch.einsum("nhd,hcd->nhc", messages, w_edge)
        return out, weights
