"""The per-edge ops as torch ops (`trisparse::edge_spmm`, `sddmm`, `edge_softmax`, `edge_scores` and
their backwards) with their fake implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _tensors
from ..pattern import lookup


def _slots(plan, entries: Tensor) -> Tensor:
    """[E, H] in entry order -> the plan's slot layout ([slots, H, 1], one array per head)."""
    slots = entries.new_empty(entries.shape[1], plan.slots()).t().unsqueeze(-1)
    source = entries.unsqueeze(-1)
    plan.to_slots(_tensors.view(source), _tensors.view(slots), _tensors.stream(entries.device))
    return slots


def _entries(plan, slots: Tensor, nnz: int) -> Tensor:
    out = slots.new_empty(nnz, slots.shape[1], 1)
    plan.to_entries(_tensors.view(slots), _tensors.view(out), _tensors.stream(slots.device))
    return out.squeeze(-1)


@torch.library.custom_op("trisparse::edge_spmm", mutates_args=())
def _edge_spmm(values: Tensor, b: Tensor, pattern: int, transposed: bool) -> Tensor:
    """c[i] = sum over entries (i, j) of values[e, h] * b[j, h] (of the transpose if
    `transposed`, whose entry (j, i) carries values[e] of entry (i, j))."""
    p = lookup(pattern)
    plan = p.edge_plan(b.device, transposed)
    vals = values.to(b.dtype)
    if transposed:
        vals = vals[p.transpose_order(b.device)]
    rows = p.num_cols if transposed else p.num_rows
    c = b.new_empty(rows, b.shape[1], b.shape[2])
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(b.shape[1], b.shape[2]), b.device
    )
    slots = _slots(plan, vals.contiguous())  # held until the run is queued
    plan.spmm(
        _tensors.view(slots),
        _tensors.view(b),
        _tensors.view(c),
        _tensors.stream(b.device),
        ws,
        ws_bytes,
    )
    return c


@_edge_spmm.register_fake
def _edge_spmm_fake(values, b, pattern, transposed):
    p = lookup(pattern)
    return b.new_empty(p.num_cols if transposed else p.num_rows, b.shape[1], b.shape[2])


@torch.library.custom_op("trisparse::sddmm", mutates_args=())
def _sddmm(x: Tensor, y: Tensor, pattern: int) -> Tensor:
    """s[e, h] = <x[i, h], y[j, h]> for every entry e = (i, j), [E, H] in x's dtype."""
    p = lookup(pattern)
    plan = p.edge_plan(x.device, False)
    slots = x.new_empty(x.shape[1], plan.slots()).t().unsqueeze(-1)
    plan.sddmm(
        _tensors.view(x), _tensors.view(y), _tensors.view(slots), 1.0, _tensors.stream(x.device)
    )
    return _entries(plan, slots, p.nnz)


@_sddmm.register_fake
def _sddmm_fake(x, y, pattern):
    return x.new_empty(lookup(pattern).nnz, x.shape[1])


def _segment_sum(values: Tensor, offsets: Tensor) -> Tensor:
    """Sums of consecutive entry segments (CSR offsets), each added in order: deterministic."""
    return torch.segment_reduce(values, "sum", offsets=offsets, axis=0)


@torch.library.custom_op("trisparse::edge_softmax", mutates_args=())
def _edge_softmax(scores: Tensor, pattern: int) -> Tensor:
    """The softmax of [E, H] scores over each row's entries."""
    p = lookup(pattern)
    row, ptr = p.entries(scores.device)[0], p.row_pointers(scores.device)
    # The row maxima leave exp() <= 1; the 1e-16 is PyG's softmax's, for the same values.
    top = torch.segment_reduce(scores, "max", offsets=ptr, axis=0)
    e = (scores - top[row]).exp()
    return e / (_segment_sum(e, ptr) + 1e-16)[row]


@_edge_softmax.register_fake
def _edge_softmax_fake(scores, pattern):
    return torch.empty_like(scores)


@torch.library.custom_op("trisparse::edge_softmax_backward", mutates_args=())
def _edge_softmax_grad(p: Tensor, dp: Tensor, pattern: int) -> Tensor:
    """ds = p * (dp - sum over the row of p * dp), the row sums in entry order."""
    pat = lookup(pattern)
    row, ptr = pat.entries(p.device)[0], pat.row_pointers(p.device)
    g = p * dp
    return g - p * _segment_sum(g, ptr)[row]


@_edge_softmax_grad.register_fake
def _edge_softmax_grad_fake(p, dp, pattern):
    return torch.empty_like(p)


@torch.library.custom_op("trisparse::edge_scores", mutates_args=())
def _edge_scores(dst: Tensor, src: Tensor, pattern: int) -> Tensor:
    """s[e, h] = dst[i, h] + src[j, h] for every entry e = (i, j)."""
    row, col = lookup(pattern).entries(dst.device)
    return dst[row] + src[col]


@_edge_scores.register_fake
def _edge_scores_fake(dst, src, pattern):
    dtype = torch.promote_types(dst.dtype, src.dtype)
    return dst.new_empty(lookup(pattern).nnz, dst.shape[1], dtype=dtype)


@torch.library.custom_op("trisparse::edge_scores_backward", mutates_args=())
def _edge_scores_grad(ds: Tensor, pattern: int) -> tuple[Tensor, Tensor]:
    """Each node's gradient, the sum over its entries (rows for dst, the transpose's rows for
    src) in a fixed order: no atomics."""
    p, d = lookup(pattern), ds.device
    ddst = _segment_sum(ds, p.row_pointers(d))
    return ddst, _segment_sum(ds[p.transpose_order(d)], p.column_pointers(d))


@_edge_scores_grad.register_fake
def _edge_scores_grad_fake(ds, pattern):
    p = lookup(pattern)
    return ds.new_empty(p.num_rows, ds.shape[1]), ds.new_empty(p.num_cols, ds.shape[1])
