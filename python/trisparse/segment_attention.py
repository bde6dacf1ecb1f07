"""Attention within segments: the rows of a packed batch of short sequences (the graphs of a PyG
mini-batch) named by a sorted id per row (PyG's ``batch``); each row attends every row of its own
segment. The block-diagonal pattern of :meth:`trisparse.Pattern.from_batch`, with no pattern built:
on CUDA the kernels read the ids themselves (``segment_attention_plan``), so a new mini-batch costs
no host work; elsewhere, and for float32 or other head dims, the fused attention over that
pattern. The ops: ``trisparse.ops.segment_attention``; their autograd:
``trisparse.autograd.segment_attention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C, _tensors
from .attention import sparse_attention
from .autograd.segment_attention import _call
from .edge import edge_softmax, edge_spmm, sddmm
from .pattern import Pattern, check_batch

__all__ = ["segment_attention", "segment_attention_supported"]


_HALF = (torch.float16, torch.bfloat16)


# The head dims this build's kernels take (asked once: no extension call inside a traced graph).
_DIMS = frozenset(d for d in (16, 32, 64, 128) if _C.segment_attention_supports(d))


def segment_attention_supported(q: Tensor) -> bool:
    """Whether :func:`segment_attention` runs its own kernels for q ([rows, heads, channels]): CUDA,
    float16 or bfloat16, 16, 32, 64 or 128 channels a head."""
    return q.is_cuda and q.dtype in _HALF and q.shape[-1] in _DIMS


def segment_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: Tensor | None,
    scale: float | None = None,
    assume_sorted: bool = False,
    dropout_p: float = 0.0,
    bias: Tensor | None = None,
    edge_index: Tensor | None = None,
    edge_bias: Tensor | None = None,
) -> Tensor:
    """out[i] = softmax_j(scale q[i] . k[j]) v[j] over the rows j with batch[j] == batch[i]: q, k,
    v [rows, heads, channels], ``batch`` [rows] sorted int64 or int32 ids (PyG's mini-batch vector;
    None: one segment), ``scale`` default 1/sqrt(channels). Differentiable in q, k, v; the
    gradients are the same bits on every run. On CUDA with float16/bfloat16 and 16, 32, 64 or 128
    channels a head, the segment kernels (no pattern, no host work per batch); elsewhere
    :func:`trisparse.sparse_attention` over :meth:`Pattern.from_batch`. ``assume_sorted``: skip
    the sortedness check (a device round trip) for a batch already checked.

    ``dropout_p``: attention dropout, as ``F.scaled_dot_product_attention``'s (apply it while
    training only): each weight is kept with probability 1 - p and scaled by 1 / (1 -
    p). The segment kernels draw it themselves from a counter-based generator (Philox4x32-10 per
    query, key and head, 16-bit draws: p to 1 / 65,536; ``trisparse/core/dropout.hpp``) seeded
    from torch's generator of q's device, and regenerate it in the backward: nothing [pairs,
    heads] is stored, the result is the same bits for the same seed. Elsewhere the weights are dropped by ``F.dropout`` (the same
    distribution, other draws).

    ``bias``: a score bias per pair, S_ij = scale q_i . k_j + bias[i, h, j - first(i)] with first(i)
    the first row of i's segment: [rows, heads, M] or [rows, M] (shared by the heads), M at least
    the longest segment's rows (each row's biases over its segment's keys, in order, then
    padding that is not read), float, finite: Graphormer's spatial and edge encodings, GPS's
    local edges as a bias. Differentiable: the segment kernels add it on the tensor cores' scores
    and the backward's dq pass writes each pair's gradient once (no atomics; places of no pair
    get 0). M is checked against the segments with the sortedness check (not with
    ``assume_sorted``: then the caller vouches for it).

    ``edge_index`` [2, E] and ``edge_bias`` [E, heads] or [E] (shared by the heads), instead of
    ``bias``: a score bias per edge, S_ij gaining the sum of the biases of the edges j -> i (PyG's
    flow: ``edge_index[0]`` the key row, ``edge_index[1]`` the query row; copies of a pair add);
    an edge between rows of different segments joins no pair (no score, zero gradient).
    Differentiable in ``edge_bias``. On the segment kernels nothing [rows, M] is made: the
    kernels read each row's edges from two sorted lists built here (two sorts, no host work:
    capturable), and the dq pass writes each edge's gradient once (no atomics). The ids are
    checked to lie in [0, rows) unless ``assume_sorted`` (a device round trip)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [rows, heads, channels] tensor")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    rows = q.shape[0]
    if bias is not None and (edge_index is not None or edge_bias is not None):
        raise ValueError("bias and edge_bias: give one score bias, per pair or per edge")
    if (edge_index is None) != (edge_bias is None):
        raise ValueError("edge_index and edge_bias come together (the edges and their biases)")
    if edge_bias is not None:
        edge_index, edge_bias = _edge_bias(edge_index, edge_bias, q)
        checked = not assume_sorted and not torch.compiler.is_compiling() and edge_index.numel()
        if checked and bool(((edge_index < 0) | (edge_index >= rows)).any()):
            raise ValueError(f"edge_index has ids outside [0, {rows}) (rows of q)")
    if bias is not None:
        bias = _pair_bias(bias, q)
    if batch is None:
        batch = torch.zeros(rows, dtype=torch.int64, device=q.device)
    elif not assume_sorted and not torch.compiler.is_compiling():
        check_batch(batch, rows)
    if bias is not None and not assume_sorted and not torch.compiler.is_compiling() and rows:
        longest = int(torch.unique_consecutive(batch, return_counts=True)[1].max())
        if longest > bias.shape[2]:
            raise ValueError(
                f"bias has M = {bias.shape[2]} places a row, the longest segment {longest} rows"
            )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    batch = batch.contiguous()
    scale = _tensors.resolve_scale(scale, q.shape[-1])
    if segment_attention_supported(q) and batch.device == q.device:
        if edge_bias is not None:
            lists = _edge_lists(edge_index, rows)
            return _segment_edge_attention(q, k, v, batch, scale, dropout_p, edge_bias, lists)
        state = _tensors.new_dropout_state(dropout_p, q.device)
        kernel_bias = None if bias is None else bias.float().contiguous()
        out, _ = _call(q, k, v, batch, scale, float(dropout_p), state, kernel_bias, None)
        return out
    if edge_bias is not None:
        bias = _dense_edge_bias(edge_index, edge_bias, batch, rows)
    pattern = Pattern.from_batch(batch, rows)
    entry_bias = None if bias is None else _entry_bias(bias, batch)
    if dropout_p > 0:
        scores = scale * sddmm(q, k, pattern)
        if entry_bias is not None:
            scores = scores + entry_bias.to(scores.dtype)
        alpha = edge_softmax(scores, pattern)
        return edge_spmm(F.dropout(alpha, p=dropout_p, training=True), v, pattern)
    if entry_bias is not None and entry_bias.shape[1] == 1:
        entry_bias = entry_bias[:, 0]
    return sparse_attention(q, k, v, pattern, scale=scale, bias=entry_bias)


def _pair_bias(bias: Tensor, q: Tensor) -> Tensor:
    """bias as [rows, H or 1, M], checked against q [rows, H, D]."""
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        raise TypeError(f"bias must be a float tensor, got {getattr(bias, 'dtype', type(bias))}")
    if bias.dim() == 2:
        bias = bias.unsqueeze(1)
    rows, heads = q.shape[0], q.shape[1]
    if bias.dim() != 3 or bias.shape[0] != rows or bias.shape[1] not in (1, heads):
        raise ValueError(
            f"bias must be [rows, heads, M] or [rows, M] with rows = {rows} and heads = {heads}, "
            f"got {tuple(bias.shape)}"
        )
    if bias.shape[2] < 1:
        raise ValueError("bias needs M >= 1 places a row")
    if bias.device != q.device:
        raise ValueError(f"bias is on {bias.device}, q on {q.device}")
    return bias


def _segment_edge_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: Tensor,
    scale: float,
    dropout_p: float,
    edge_bias: Tensor,
    lists: Tensor,
) -> Tensor:
    """The segment kernels with a bias per edge ([E, H or 1]) whose lists are made
    (``_edge_lists``: GPSConv's layers share one)."""
    state = _tensors.new_dropout_state(dropout_p, q.device)
    bias = edge_bias.float().unsqueeze(2).contiguous()  # [E, H or 1, 1]
    out, _ = _call(q, k, v, batch, scale, float(dropout_p), state, bias, lists)
    return out


def _edge_bias(edge_index: Tensor, edge_bias: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """edge_index as int64 [2, E] and edge_bias as [E, H or 1], checked against q [rows, H, D]."""
    if not isinstance(edge_index, Tensor) or edge_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"edge_index must be an int64 or int32 tensor, got "
            f"{getattr(edge_index, 'dtype', type(edge_index))}"
        )
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be [2, E], got {tuple(edge_index.shape)}")
    if not isinstance(edge_bias, Tensor) or not edge_bias.is_floating_point():
        raise TypeError(
            f"edge_bias must be a float tensor, got {getattr(edge_bias, 'dtype', type(edge_bias))}"
        )
    if edge_bias.dim() == 1:
        edge_bias = edge_bias.unsqueeze(1)
    edges, heads = edge_index.shape[1], q.shape[1]
    if edge_bias.dim() != 2 or edge_bias.shape[0] != edges or edge_bias.shape[1] not in (1, heads):
        raise ValueError(
            f"edge_bias must be [E, heads] or [E] with E = {edges} edges and heads = {heads}, "
            f"got {tuple(edge_bias.shape)}"
        )
    for t, name in ((edge_index, "edge_index"), (edge_bias, "edge_bias")):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return edge_index.long(), edge_bias


def _edge_lists(edge_index: Tensor, rows: int) -> Tensor:
    """The segment kernels' edge lists, packed int32 (trisparse::segment_edges): by query
    (offsets [rows + 1], keys ascending, edge ids) then by key (offsets, queries ascending, edge
    ids); stable sorts: copies of a pair in edge order, the same lists on every run."""
    # 32-bit sort keys where row * rows + row fits: half the radix passes
    dtype = torch.int32 if rows * rows < 2**31 else torch.int64
    src, dst = edge_index[0].to(dtype), edge_index[1].to(dtype)
    bounds = torch.arange(rows + 1, device=src.device, dtype=dtype)
    lists = []
    for mine, other in ((dst, src), (src, dst)):
        keys, order = torch.sort(mine * rows + other, stable=True)
        lists += [
            torch.searchsorted(keys, bounds * rows, out_int32=True),
            other[order].int(),
            order.int(),
        ]
    return torch.cat(lists)


def _dense_edge_bias(edge_index: Tensor, edge_bias: Tensor, batch: Tensor, rows: int) -> Tensor:
    """The edges' bias as the pair bias [rows, H or 1, M] (M the longest segment; copies of a pair
    summed, edges between segments left out): the path without the segment kernels."""
    src, dst = edge_index[0], edge_index[1]
    first = torch.searchsorted(batch, batch)  # each row's segment's first row
    longest = int(torch.unique_consecutive(batch, return_counts=True)[1].max()) if rows else 1
    local = batch[src] == batch[dst]
    src, dst, values = src[local], dst[local], edge_bias[local]
    pair = values.new_zeros(rows, max(longest, 1), edge_bias.shape[1])
    pair = pair.index_put((dst, src - first[dst]), values, accumulate=True)
    return pair.transpose(1, 2)


def _entry_bias(bias: Tensor, batch: Tensor) -> Tensor:
    """The pair bias [rows, H, M] at the entries of Pattern.from_batch(batch) ([nnz, H], in its
    entry order: row by row, each row's segment in order, i.e. each row's first places)."""
    counts = torch.unique_consecutive(batch, return_counts=True)[1]
    lengths = torch.repeat_interleave(counts, counts)  # each row's segment length
    places = torch.arange(bias.shape[2], device=bias.device)
    return bias.transpose(1, 2)[places[None, :] < lengths[:, None]]
