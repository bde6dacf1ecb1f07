"""Per-edge values on a Pattern as torch ops: the SpMM that aggregates with per-edge, per-head
weights and the SDDMM that gives per-edge scores, each the other's gradient (over the pattern or
its transpose), so no [E, heads, channels] message tensor is ever formed; and the per-edge
softmax and node-to-edge scores with gradients reduced over CSR segments in a fixed order (torch's
gather/scatter backward adds with atomics on CUDA). Per-edge tensors are [E, H] in the pattern's
entry order (``Pattern.entries``)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _tensors
from ._eager import eager_autograd
from .pattern import Pattern, lookup

__all__ = ["edge_scores", "edge_softmax", "edge_spmm", "sddmm"]


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


def _edge_spmm_setup(ctx, inputs, output):
    values, b, pattern, transposed = inputs
    ctx.save_for_backward(values, b)
    ctx.pattern, ctx.transposed = pattern, transposed


def _edge_spmm_backward(ctx, dc):
    values, b = ctx.saved_tensors
    dc = dc if dc.stride(-1) == 1 else dc.contiguous()
    dvalues = db = None
    if ctx.needs_input_grad[0]:
        # d values[(i, j)] = <dc[i], b[j]>, or <b[i], dc[j]> over the transpose.
        x, y = (b, dc) if ctx.transposed else (dc, b)
        dvalues = torch.ops.trisparse.sddmm(x, y, ctx.pattern).to(values.dtype)
    if ctx.needs_input_grad[1]:
        db = torch.ops.trisparse.edge_spmm(values, dc, ctx.pattern, not ctx.transposed)
    return dvalues, db, None, None


_edge_spmm.register_autograd(_edge_spmm_backward, setup_context=_edge_spmm_setup)
_edge_spmm_eager = eager_autograd(_edge_spmm, _edge_spmm_setup, _edge_spmm_backward)


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


def _sddmm_setup(ctx, inputs, output):
    x, y, pattern = inputs
    ctx.save_for_backward(x, y)
    ctx.pattern = pattern


def _sddmm_backward(ctx, ds):
    x, y = ctx.saved_tensors
    ds = ds.contiguous()
    dx = dy = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.trisparse.edge_spmm(ds, y, ctx.pattern, False)
    if ctx.needs_input_grad[1]:
        dy = torch.ops.trisparse.edge_spmm(ds, x, ctx.pattern, True)
    return dx, dy, None


_sddmm.register_autograd(_sddmm_backward, setup_context=_sddmm_setup)
_sddmm_eager = eager_autograd(_sddmm, _sddmm_setup, _sddmm_backward)


def _check_pattern(pattern) -> None:
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a trisparse.Pattern, got {type(pattern).__name__}")


def _check(name: str, t: Tensor, rows: int) -> None:
    if not isinstance(t, Tensor) or t.dtype not in _tensors.FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor")
    if t.dim() != 3 or t.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, heads, channels], got {tuple(t.shape)}")


def edge_spmm(values: Tensor, b: Tensor, pattern: Pattern, transposed: bool = False) -> Tensor:
    """out[i, h] = sum over the pattern's entries (i, j) of values[e, h] * b[j, h]: the
    aggregation of per-edge, per-head weights (``values`` [E, H] in entry order) over
    ``b`` [num_cols, H, C]; with ``transposed``, over the transpose (b [num_rows, H, C]).
    Differentiable in both (deterministic)."""
    _check_pattern(pattern)
    _check("b", b, pattern.num_rows if transposed else pattern.num_cols)
    if values.dim() != 2 or values.shape != (pattern.nnz, b.shape[1]):
        raise ValueError(
            f"values must have shape [{pattern.nnz}, {b.shape[1]}] (entries, heads), got "
            f"{tuple(values.shape)}"
        )
    if values.device != b.device:
        raise ValueError(f"values is on {values.device} but b is on {b.device}")
    b = b if b.stride(-1) == 1 else b.contiguous()
    return _edge_spmm_eager(values, b, pattern.id, bool(transposed))


def sddmm(x: Tensor, y: Tensor, pattern: Pattern) -> Tensor:
    """s[e, h] = <x[i, h], y[j, h]> for every entry e = (i, j) of the pattern: x
    [num_rows, H, D], y [num_cols, H, D], s [E, H] in entry order. Differentiable in both."""
    _check_pattern(pattern)
    _check("x", x, pattern.num_rows)
    _check("y", y, pattern.num_cols)
    if y.dtype != x.dtype or y.shape[1:] != x.shape[1:] or y.device != x.device:
        raise ValueError("x and y must have one dtype, device, head count and width")
    x, y = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, y))
    return _sddmm_eager(x, y, pattern.id)


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


def _edge_softmax_setup(ctx, inputs, output):
    ctx.pattern = inputs[1]
    ctx.save_for_backward(output)


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


def _edge_softmax_backward(ctx, dp):
    (p,) = ctx.saved_tensors
    return torch.ops.trisparse.edge_softmax_backward(p, dp.contiguous(), ctx.pattern), None


_edge_softmax.register_autograd(_edge_softmax_backward, setup_context=_edge_softmax_setup)
_edge_softmax_eager = eager_autograd(_edge_softmax, _edge_softmax_setup, _edge_softmax_backward)


@torch.library.custom_op("trisparse::edge_scores", mutates_args=())
def _edge_scores(dst: Tensor, src: Tensor, pattern: int) -> Tensor:
    """s[e, h] = dst[i, h] + src[j, h] for every entry e = (i, j)."""
    row, col = lookup(pattern).entries(dst.device)
    return dst[row] + src[col]


@_edge_scores.register_fake
def _edge_scores_fake(dst, src, pattern):
    dtype = torch.promote_types(dst.dtype, src.dtype)
    return dst.new_empty(lookup(pattern).nnz, dst.shape[1], dtype=dtype)


def _edge_scores_setup(ctx, inputs, output):
    ctx.pattern = inputs[2]


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


def _edge_scores_backward(ctx, ds):
    ddst, dsrc = torch.ops.trisparse.edge_scores_backward(ds.contiguous(), ctx.pattern)
    return ddst, dsrc, None


_edge_scores.register_autograd(_edge_scores_backward, setup_context=_edge_scores_setup)
_edge_scores_eager = eager_autograd(_edge_scores, _edge_scores_setup, _edge_scores_backward)


def edge_softmax(scores: Tensor, pattern: Pattern) -> Tensor:
    """The softmax of per-edge scores ([E, H] in entry order) over each row's entries (each
    target's incoming edges, as PyG's ``softmax(src, index)``); empty rows have no entries.
    Its gradient is deterministic."""
    _check_pattern(pattern)
    if scores.dim() != 2 or scores.shape[0] != pattern.nnz:
        raise ValueError(
            f"scores must have shape [{pattern.nnz}, heads] (entries, heads), got "
            f"{tuple(scores.shape)}"
        )
    return _edge_softmax_eager(scores, pattern.id)


def edge_scores(dst: Tensor, src: Tensor, pattern: Pattern) -> Tensor:
    """s[e, h] = dst[i, h] + src[j, h] for every entry e = (i, j): dst [num_rows, H], src
    [num_cols, H] (GAT's per-node attention terms). Its gradient is deterministic."""
    _check_pattern(pattern)
    if dst.dim() != 2 or src.dim() != 2 or dst.shape[1] != src.shape[1]:
        raise ValueError(
            f"dst and src must be [nodes, heads] with one head count, got {tuple(dst.shape)} and "
            f"{tuple(src.shape)}"
        )
    if dst.shape[0] != pattern.num_rows or src.shape[0] != pattern.num_cols:
        raise ValueError(
            f"dst must have {pattern.num_rows} rows and src {pattern.num_cols} (the pattern's "
            f"sides), got {dst.shape[0]} and {src.shape[0]}"
        )
    return _edge_scores_eager(dst, src, pattern.id)
