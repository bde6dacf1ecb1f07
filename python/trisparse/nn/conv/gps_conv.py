"""trisparse.nn.GPSConv: PyG's GPSConv with the global attention packed per graph."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor
from torch_geometric.nn import GPSConv as _PygGPSConv

from ..._tensors import resolve_scale
from ...attention import sparse_attention
from ...edge import edge_softmax, edge_spmm, sddmm
from ...edge_attention import edge_attention, edge_attention_supported
from ...pattern import Pattern, check_batch
from ...segment_attention import (
    _edge_lists,
    _segment_edge_attention,
    segment_attention,
    segment_attention_supported,
)
from ._common import _TRACED


class _BatchPatterns:
    """The block-diagonal Pattern of the last ``batch`` vector a GPS layer saw (rebuilt when the
    tensor object, its contents or the node count change), and the last batch checked sorted."""

    def __init__(self):
        self._batch = None
        self._key = None
        self._pattern = None
        self._checked = None
        self._entries = None  # (edge_index, (its version, pattern id), its entries)
        self._local = None  # (edge_index, batch, their versions): edges checked within graphs
        self._edge_lists = None  # (edge_index, (its version, node count), the kernels' lists)

    def __deepcopy__(self, memo):
        """The same cache: a model's GPS layers share one, copies included (a Pattern's plans
        are device state, not copyable)."""
        return self

    def checked(self, batch, num_nodes: int):
        """``batch``, checked sorted once per tensor and version (not while compiling or
        capturing)."""
        if batch is None or torch.compiler.is_compiling() or _capturing(batch):
            return batch
        key = (batch, getattr(batch, "_version", None), num_nodes)
        if self._checked is None or self._checked[0] is not batch or self._checked[1:] != key[1:]:
            check_batch(batch, num_nodes)
            self._checked = key
        return batch

    def get(self, batch, num_nodes: int) -> Pattern:
        if torch.compiler.is_compiling():  # built from the real batch while tracing, as layers'
            return _TRACED[_traced_batch_pattern(batch, num_nodes)]
        return self._get(batch, num_nodes)

    def entries(self, pattern: Pattern, edge_index: Tensor) -> Tensor:
        """edge_index's entries in `pattern` (checked once per edge_index tensor, version and
        pattern: a model's layers share them)."""
        if torch.compiler.is_compiling():
            return pattern.entries_of(edge_index)
        key = (getattr(edge_index, "_version", None), pattern.id)
        if self._entries is None or self._entries[0] is not edge_index or self._entries[1] != key:
            self._entries = (edge_index, key, pattern.entries_of(edge_index))
        return self._entries[2]

    def edge_lists(self, edge_index: Tensor, num_nodes: int) -> Tensor:
        """The segment kernels' lists of edge_index's edges (once per edge_index tensor, version
        and node count: a model's layers share them; made afresh while capturing, in the graph,
        where a replay's edges are others)."""
        if _capturing(edge_index):
            return _edge_lists(edge_index, num_nodes)
        key = (getattr(edge_index, "_version", None), num_nodes)
        cached = self._edge_lists
        if cached is None or cached[0] is not edge_index or cached[1] != key:
            self._edge_lists = cached = (edge_index, key, _edge_lists(edge_index, num_nodes))
        return cached[2]

    def check_local(self, edge_index: Tensor, batch: Tensor) -> None:
        """A ValueError naming an edge of edge_index whose ends lie in different graphs (once per
        edge_index and batch tensor and version; not while capturing)."""
        if _capturing(batch):
            return
        key = (getattr(edge_index, "_version", None), getattr(batch, "_version", None))
        if (
            self._local is not None
            and self._local[0] is edge_index
            and self._local[1] is batch
            and self._local[2] == key
        ):
            return
        n = len(batch)
        ends = edge_index.clamp(0, max(n - 1, 0))
        bad = (edge_index != ends).any(0) | (batch[ends[0]] != batch[ends[1]])
        if edge_index.numel() and bool(bad.any()):  # (one round trip where all is well)
            e = int(bad.nonzero()[0, 0])
            j, i = (int(t) for t in edge_index[:, e])
            if not (0 <= j < n and 0 <= i < n):
                raise ValueError(f"edge_index has node ids outside [0, {n}): edge {e} ({j} -> {i})")
            raise ValueError(
                f"edge_index: edge {e} ({j} -> {i}) joins nodes of graphs {int(batch[j])} and "
                f"{int(batch[i])}: GPS's edge bias takes edges within a graph"
            )
        self._local = (edge_index, batch, key)

    def _get(self, batch, num_nodes: int) -> Pattern:
        key = (getattr(batch, "_version", None), num_nodes)
        if batch is not self._batch or key != self._key or self._pattern is None:
            self._pattern = Pattern.from_batch(batch, num_nodes)
            self._batch, self._key = batch, key
        return self._pattern


def _capturing(t: Tensor) -> bool:
    """Whether ``t``'s CUDA stream is being captured into a CUDA graph (no synchronisation then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _masked_batch_norm(
    norm: torch.nn.BatchNorm1d, h: Tensor, mask: Tensor, update: bool = True
) -> Tensor:
    """``norm(h)`` with batch statistics (training, or no running statistics kept) taken, and the
    running averages updated, over the rows where ``mask`` holds only, as ``norm`` computes them on
    those rows alone (not updated with ``update=False``); the other rows are normalised with the
    same statistics. No host synchronisation (capturable)."""
    x = h.float() if h.element_size() < 4 else h  # (16-bit: float32 statistics, as torch's)
    m = mask.to(x.dtype).unsqueeze(1)
    count = m.sum()
    mean = (x * m).sum(0) / count
    centred = x - mean
    var = (centred.square() * m).sum(0) / count
    out = centred * torch.rsqrt(var + norm.eps)
    if norm.affine:
        out = out * norm.weight + norm.bias
    if update and norm.track_running_stats and norm.training:
        with torch.no_grad():
            norm.num_batches_tracked.add_(1)
            if norm.momentum is None:  # a cumulative average, as torch's
                momentum = 1.0 / norm.num_batches_tracked.to(x.dtype)
            else:
                momentum = norm.momentum
            unbiased = var * count / (count - 1).clamp_min(1)
            norm.running_mean.lerp_(mean.to(norm.running_mean.dtype), momentum)
            norm.running_var.lerp_(unbiased.to(norm.running_var.dtype), momentum)
    return out.to(h.dtype)


@torch._dynamo.assume_constant_result
def _traced_batch_pattern(batch, num_nodes: int) -> int:
    """Run by torch.compile while tracing, on the real batch vector: its Pattern's id, a constant
    of the compiled graph (see _common._traced_pattern). The layers' one cache is a global here:
    torch 2.11's dynamo takes no object argument to a constant result."""
    pattern = _SHARED_BATCHES._get(batch, num_nodes)
    _TRACED[pattern.id] = pattern
    return pattern.id


_SHARED_BATCHES = _BatchPatterns()


class GPSConv(_PygGPSConv):
    """PyG's :class:`torch_geometric.nn.GPSConv` (same arguments, submodules and state_dict: the
    local MPNN ``conv``, ``attn``, ``mlp`` and the norms): the global attention runs over each
    graph of the mini-batch as one packed sparse attention (the block-diagonal pattern of
    ``batch``, :meth:`trisparse.Pattern.from_batch`) instead of padding every graph to the largest
    and running dense ``nn.MultiheadAttention``: no padding, memory linear in sum n_g^2, the
    gradients deterministic. ``attn``'s own projections (``in_proj_weight``, ``out_proj``) are
    used as they are. On CUDA, float16/bfloat16 heads of 16, 32, 64 or 128 channels (autocast)
    run the segment kernels (:func:`trisparse.segment_attention`: no pattern at all, the batch
    vector read on the device); other CUDA heads of 4 * 2^k <= 128 channels the multigraph
    kernels (:func:`trisparse.edge_attention`), whose pattern is grouped on the GPU, so a new
    batch costs no host-side plan; elsewhere the fused attention. Attention dropout
    (``attn_kwargs={"dropout": p}``) while training draws one factor per pair and head (the same
    distribution as PyG's, not the same draws): inside the kernels on CUDA (the segment kernels
    regenerate theirs in the backward from a counter-based generator), on the per-pair weights
    elsewhere. Falls back to PyG's code, with a one-time warning, for ``attn_type="performer"``
    and ``MultiheadAttention`` options beyond PyG's default use (``add_bias_kv``,
    ``add_zero_attn``, ``kdim``/``vdim``). ``recompute=True`` (trisparse's own argument): while
    training, the layer keeps only its inputs and recomputes its activations in the backward
    (``torch.utils.checkpoint``, the random draws preserved, the norms' running averages updated
    once): the same results for a second forward's time.

    ``edge_bias=True`` (trisparse's own argument; off, the layer and its state_dict are PyG's):
    the local MPNN's edges as an additive score bias of the global attention, Graphormer's edge
    encoding for adjacent nodes: a pair (i, j) joined by edges j -> i of ``edge_index`` gets, per
    head, the learned ``edge_bias`` [heads] (zeros at first: PyG's attention) once per edge, or,
    with ``edge_dim``, ``lin_edge_bias(edge_attr)`` ([E, edge_dim] -> [E, heads], the features the
    local MPNN takes as ``edge_attr``) summed over the pair's edges; every other pair of a graph
    gets none. float16/bfloat16 heads of 16 - 128 channels on CUDA run the segment kernels with
    the edges' bias (each row's edges read from two sorted lists made once per ``edge_index``
    for all layers: nothing [N, heads, nodes] is made, no host round trip: the step can be
    captured in a CUDA graph); other heads the multigraph kernels (:func:`trisparse.edge_attention`
    with the bias, attention dropout inside; elsewhere :func:`trisparse.sparse_attention`) over
    the batch's block-diagonal pattern, made per batch (on the GPU, with host synchronisations:
    not under CUDA graph capture). The bias's gradient is written once per edge (no atomics).
    ``max_num_nodes`` (trisparse's own argument, once the pair bias's fixed size, which
    capture needed) is taken and unused: the edges' lists have no fixed size."""

    def __init__(
        self,
        *args,
        recompute: bool = False,
        edge_bias: bool = False,
        edge_dim: int | None = None,
        max_num_nodes: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if max_num_nodes is not None and (not isinstance(max_num_nodes, int) or max_num_nodes < 1):
            raise ValueError(f"max_num_nodes must be a positive int, got {max_num_nodes!r}")
        self.max_num_nodes = max_num_nodes
        self._batches = _SHARED_BATCHES  # a model's layers see one batch: one pattern for all
        self._warned: set[str] = set()
        self.recompute = recompute
        self._recomputing = False
        if edge_dim is not None and not edge_bias:
            raise ValueError("edge_dim: the edge features feed edge_bias; set edge_bias=True")
        if edge_dim is not None and (not isinstance(edge_dim, int) or edge_dim < 1):
            raise ValueError(f"edge_dim must be a positive int, got {edge_dim!r}")
        self.edge_dim = edge_dim
        self.edge_bias = None
        self.lin_edge_bias = None
        if edge_bias and edge_dim is None:
            self.edge_bias = torch.nn.Parameter(torch.zeros(self.heads))
        elif edge_bias:
            self.lin_edge_bias = torch.nn.Linear(edge_dim, self.heads)

    def reset_parameters(self):
        super().reset_parameters()
        if getattr(self, "edge_bias", None) is not None:
            torch.nn.init.zeros_(self.edge_bias)
        if getattr(self, "lin_edge_bias", None) is not None:
            self.lin_edge_bias.reset_parameters()

    def _unfused_reason(self) -> str | None:
        attn = self.attn
        if not isinstance(attn, torch.nn.MultiheadAttention):
            return f"attn_type={self.attn_type!r} is not fused"
        if attn.bias_k is not None or attn.add_zero_attn or not attn._qkv_same_embed_dim:
            return "MultiheadAttention with add_bias_kv, add_zero_attn, kdim or vdim is not fused"
        return None

    def forward(self, x: Tensor, edge_index, batch=None, node_mask=None, **kwargs) -> Tensor:
        """PyG's GPSConv.forward; ``node_mask`` (bool [num_nodes], optional: the real nodes of a
        batch padded by :func:`trisparse.nn.capture.pad_batch`) leaves the padded nodes out of
        ``BatchNorm``'s statistics while training and sets their output rows to 0 (their values
        would otherwise grow from layer to layer, up to overflow in 16 bits)."""
        reason = self._unfused_reason()
        if reason is not None and node_mask is not None:
            raise ValueError(f"node_mask: {reason}; PyG's code takes no node_mask")
        if reason is not None and self._biased():
            raise ValueError(f"edge_bias: {reason}; PyG's code has no edge bias")
        if reason is not None:
            if reason not in self._warned:
                self._warned.add(reason)
                warnings.warn(
                    f"trisparse.nn.GPSConv: {reason}; running PyG's GPSConv code (exact, not "
                    "fused)",
                    stacklevel=2,
                )
            return super().forward(x, edge_index, batch, **kwargs)
        if self.recompute and self.training and torch.is_grad_enabled():
            calls = []

            def body(x, *args):
                # the second call is the backward's recomputation: the norms' running averages
                # were updated by the first
                self._recomputing = bool(calls)
                calls.append(None)
                try:
                    return self._forward(x, edge_index, batch, node_mask, kwargs)
                finally:
                    self._recomputing = False

            tensors = [t for t in kwargs.values() if isinstance(t, Tensor)]
            return torch.utils.checkpoint.checkpoint(
                body, x, *tensors, use_reentrant=False, preserve_rng_state=True
            )
        return self._forward(x, edge_index, batch, node_mask, kwargs)

    def _forward(self, x, edge_index, batch, node_mask, kwargs) -> Tensor:
        hs = []
        if self.conv is not None:  # the local MPNN, as PyG's
            h = self.conv(x, edge_index, **kwargs)
            h = F.dropout(h, p=self.dropout, training=self.training)
            hs.append(self._norm(self.norm1, h + x, batch, node_mask))
        h = self._global_attention(x, batch, edge_index, kwargs.get("edge_attr"))
        h = F.dropout(h, p=self.dropout, training=self.training)
        hs.append(self._norm(self.norm2, h + x, batch, node_mask))
        out = sum(hs)
        out = out + self.mlp(out)
        out = self._norm(self.norm3, out, batch, node_mask)
        if node_mask is not None:  # padded rows to 0: nothing grows over the layers there
            out = torch.where(node_mask.unsqueeze(1), out, 0.0)
        return out

    def _norm(self, norm, h: Tensor, batch, node_mask=None) -> Tensor:
        if norm is None:
            return h
        bn = norm if isinstance(norm, torch.nn.BatchNorm1d) else getattr(norm, "module", None)
        batch_stats = isinstance(bn, torch.nn.BatchNorm1d) and (
            bn.training or not bn.track_running_stats
        )  # (PyG's BatchNorm wraps torch's)
        if batch_stats and node_mask is not None:
            return _masked_batch_norm(bn, h, node_mask, update=not self._recomputing)
        if batch_stats and self._recomputing and bn.track_running_stats:
            # the same output and saved tensors, the running averages left (momentum 0)
            return F.batch_norm(
                h, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.0, bn.eps
            )
        return norm(h, batch=batch) if self.norm_with_batch else norm(h)

    def _biased(self) -> bool:
        return self.edge_bias is not None or self.lin_edge_bias is not None

    def _edge_scores(self, edge_index, edge_attr, dtype: torch.dtype) -> Tensor:
        """The bias of each edge of edge_index, [E, heads]."""
        if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(
                "edge_index: GPSConv(edge_bias=True) takes the edges as a [2, E] tensor, got "
                f"{type(edge_index).__name__}"
                + (f" of shape {tuple(edge_index.shape)}" if isinstance(edge_index, Tensor) else "")
            )
        edges = edge_index.shape[1]
        if self.lin_edge_bias is None:
            return self.edge_bias.to(dtype).expand(edges, -1)
        if not isinstance(edge_attr, Tensor) or edge_attr.shape != (edges, self.edge_dim):
            got = tuple(edge_attr.shape) if isinstance(edge_attr, Tensor) else edge_attr
            raise ValueError(
                f"edge_attr: GPSConv(edge_bias=True, edge_dim={self.edge_dim}) needs edge "
                f"features [E, edge_dim] = [{edges}, {self.edge_dim}], got {got}"
            )
        return self.lin_edge_bias(edge_attr).to(dtype)

    def _on_segment_kernels(self, q: Tensor, edge_index) -> bool:
        """Whether the biased attention runs the segment kernels with the edges' bias: 16-bit
        heads they take, edges as a tensor, eager or captured (compiled: the pattern's ops)."""
        return (
            segment_attention_supported(q)
            and isinstance(edge_index, Tensor)
            and not torch.compiler.is_compiling()
        )

    def _global_attention(self, x: Tensor, batch, edge_index=None, edge_attr=None) -> Tensor:
        """nn.MultiheadAttention(x, x, x) within each graph, as packed sparse attention (with the
        edges' bias where edge_bias is set)."""
        attn = self.attn
        n, channels = x.shape
        heads = attn.num_heads
        qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).view(n, 3, heads, -1)
        q, k, v = qkv.unbind(1)
        scale = resolve_scale(None, q.shape[-1])
        dropout = attn.dropout if self.training else 0.0
        if self._biased() and self._on_segment_kernels(q, edge_index):
            if batch is None:
                batch = torch.zeros(n, dtype=torch.int64, device=x.device)
            batch = self._batches.checked(batch, n)
            self._batches.check_local(edge_index, batch)
            # each edge's bias read by the kernels through the edges' lists: nothing [n, M]
            scores = self._edge_scores(edge_index, edge_attr, torch.float32)
            lists = self._batches.edge_lists(edge_index, n)
            out = _segment_edge_attention(q, k, v, batch, scale, dropout, scores, lists)
            return attn.out_proj(out.reshape(n, channels))
        if self._biased():
            if _capturing(x):
                raise RuntimeError(
                    "trisparse.nn.GPSConv(edge_bias=True) under CUDA graph capture needs "
                    "float16/bfloat16 heads of 16, 32, 64 or 128 channels (autocast); else the "
                    "biased attention builds the batch's pattern on the host"
                )
            pattern = self._batches.get(batch, n)
            scores = self._edge_scores(
                edge_index, edge_attr, torch.promote_types(x.dtype, torch.float32)
            )
            entries = self._batches.entries(pattern, edge_index)
            # a pair's edges summed (index_put's accumulation: a fixed order on every run)
            bias = scores.new_zeros(pattern.nnz, heads).index_put(
                (entries,), scores, accumulate=True
            )
            # the multigraph kernels (grouped on the GPU); compiled: the ops torch traces
            if edge_attention_supported(pattern, q, heads) and not torch.compiler.is_compiling():
                out, _ = edge_attention(q, k, v, pattern, scale, dropout=dropout, bias=bias)
            elif dropout > 0:
                alpha = edge_softmax(scale * sddmm(q, k, pattern) + bias, pattern)
                out = edge_spmm(F.dropout(alpha, p=dropout, training=True), v, pattern)
            else:
                out = sparse_attention(q, k, v, pattern, scale=scale, bias=bias)
            return attn.out_proj(out.reshape(n, channels))
        if segment_attention_supported(q):
            batch = self._batches.checked(batch, n)
            out = segment_attention(q, k, v, batch, scale, assume_sorted=True, dropout_p=dropout)
            return attn.out_proj(out.reshape(n, channels))
        if _capturing(x):
            raise RuntimeError(
                f"trisparse.nn.GPSConv under CUDA graph capture needs float16/bfloat16 heads of "
                f"16, 32, 64 or 128 channels (autocast), which run the segment kernels; these "
                f"heads ({q.dtype}, {q.shape[-1]} channels) need a pattern built on the host per "
                f"batch"
            )
        pattern = self._batches.get(batch, n)
        if q.is_cuda and edge_attention_supported(pattern, q):  # grouped on the GPU
            out, _ = edge_attention(q, k, v, pattern, scale, dropout=dropout)
        elif dropout > 0:
            alpha = edge_softmax(scale * sddmm(q, k, pattern), pattern)
            out = edge_spmm(F.dropout(alpha, p=attn.dropout, training=True), v, pattern)
        else:
            out = sparse_attention(q, k, v, pattern, scale=scale)
        return attn.out_proj(out.reshape(n, channels))
