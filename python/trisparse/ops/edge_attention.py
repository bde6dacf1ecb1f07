"""The multigraph attention as torch ops (`trisparse::edge_attention`, `edge_gat` and their
backwards) with their fake implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _tensors
from ..pattern import lookup


def _rows(t: Tensor | None) -> tuple | None:
    return None if t is None else _tensors.view(t)


def _keep(keep: Tensor | None) -> tuple | None:
    """[E, H] keep factors as the plan's [E, H, 1] view."""
    return None if keep is None else _tensors.view2(keep)


def _edge_rows(a: Tensor | None) -> tuple | None:
    """[E, F] edge features as the [E, 1, F] view the plan takes."""
    return None if a is None else _tensors.view(a.unsqueeze(1))


def _lse_dtype(t: Tensor) -> torch.dtype:
    """The lse's dtype: float64 where the CPU engine runs in float64, else float32 (the
    kernels')."""
    return torch.float64 if t.is_cpu and t.dtype == torch.float64 else torch.float32


def _forward_outputs(q: Tensor, r: Tensor | None, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """out and out_edge [rows, H, C], [rows, H, F] in q's dtype and lse [rows, H] (_lse_dtype),
    unwritten (the op's and its fake's)."""
    heads, features = q.shape[1], 0 if r is None else r.shape[2]
    return (
        q.new_empty(rows, heads, q.shape[2]),
        q.new_empty(rows, heads, features),
        q.new_empty(rows, heads, dtype=_lse_dtype(q)),
    )


@torch.library.custom_op("trisparse::edge_attention", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor | None,
    a: Tensor | None,
    keep: Tensor | None,
    pattern: int,
    scale: float,
    dropout: float,
    dropout_state: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [rows, H, C] and out_edge [rows, H, F] in q's dtype, lse [rows, H]);
    attention dropout as `keep`: [E, H] float32 factors on the weights, or drawn in the kernels
    with probability `dropout` from `dropout_state` ({seed, offset}, int64 [2] on q's device)."""
    p = lookup(pattern)
    out, out_edge, lse = _forward_outputs(q, r, p.num_rows)
    p.edge_attention_plan(q.device, backward=False).forward(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view(v),
        _rows(r),
        _edge_rows(a),
        _tensors.view(out),
        None if r is None else _tensors.view(out_edge),
        _tensors.view2(lse),
        _keep(keep),
        scale,
        _tensors.stream(q.device),
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
    )
    return out, out_edge, lse


@_forward.register_fake
def _forward_fake(q, k, v, r, a, keep, pattern, scale, dropout, dropout_state):
    return _forward_outputs(q, r, lookup(pattern).num_rows)


def _grads(q, k, v, r, a) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dr and da in q's dtype (the kernels round their float32 sums once; dr and da
    empty without edge features); packed, unwritten; the op's and its fake's."""
    like = {"dtype": q.dtype, "device": q.device}
    edged = r is not None
    return (
        *(torch.empty(t.shape, **like) for t in (q, k, v)),
        torch.empty(r.shape if edged else (0,), **like),
        torch.empty(a.shape if edged else (0,), **like),
    )


@torch.library.custom_op("trisparse::edge_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor | None,
    a: Tensor | None,
    keep: Tensor | None,
    out: Tensor,
    out_edge: Tensor,
    lse: Tensor,
    dout: Tensor,
    dout_edge: Tensor,
    pattern: int,
    scale: float,
    dropout: float,
    dropout_state: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dr, da) in q's dtype (dr and da empty without edge features); the forward's
    dropout regenerated from the same state."""
    p = lookup(pattern)
    plan = p.edge_attention_plan(q.device)
    dq, dk, dv, dr, da = _grads(q, k, v, r, a)
    edged = r is not None
    ws_need = plan.workspace_bytes(q.shape[1], _tensors.dtype_code(dq.dtype))
    _owner, ws, ws_bytes = _tensors.workspace(ws_need, q.device)
    plan.backward(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view(v),
        _rows(r),
        _edge_rows(a),
        _tensors.view(out),
        _tensors.view(out_edge) if edged else None,
        _tensors.view2(lse),
        _tensors.view(dout),
        _tensors.view(dout_edge) if edged else None,
        _tensors.view(dq),
        _tensors.view(dk),
        _tensors.view(dv),
        _tensors.view(dr) if edged else None,
        _edge_rows(da) if edged else None,
        _keep(keep),
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
    )
    return dq, dk, dv, dr, da


@_backward_op.register_fake
def _backward_fake(
    q, k, v, r, a, keep, out, out_edge, lse, dout, dout_edge, pattern, scale, dropout, state
):
    return _grads(q, k, v, r, a)


def _gat_outputs(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """GAT's out [rows, H, C] in x's dtype and lse [rows, H] (_lse_dtype), unwritten (op and
    fake)."""
    return (
        x.new_empty(rows, x.shape[1], x.shape[2]),
        x.new_empty(rows, x.shape[1], dtype=_lse_dtype(x)),
    )


@torch.library.custom_op("trisparse::edge_gat", mutates_args=())
def _gat_forward(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    a_edge: Tensor | None,
    keep: Tensor | None,
    pattern: int,
    negative_slope: float,
    dropout: float,
    dropout_state: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(out [rows, H, C] in x's dtype, lse [rows, H]); the dropout as edge_attention's."""
    p = lookup(pattern)
    out, lse = _gat_outputs(x, p.num_rows)
    p.edge_attention_plan(x.device, backward=False).gat_forward(
        _tensors.view(x),
        _tensors.view2(a_src),
        _tensors.view2(a_dst),
        _tensors.view2(a_edge),
        _tensors.view(out),
        _tensors.view2(lse),
        _keep(keep),
        negative_slope,
        _tensors.stream(x.device),
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
    )
    return out, lse


@_gat_forward.register_fake
def _gat_forward_fake(x, a_src, a_dst, a_edge, keep, pattern, negative_slope, dropout, state):
    return _gat_outputs(x, lookup(pattern).num_rows)


def _gat_grads(x, a_src, a_dst, a_edge) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx (x's dtype, packed), da_src, da_dst, da_edge (empty without a_edge), unwritten (the
    op's and its fake's)."""
    return (
        torch.empty(x.shape, device=x.device, dtype=x.dtype),
        torch.empty_like(a_src),
        torch.empty_like(a_dst),
        torch.empty_like(a_edge) if a_edge is not None else a_src.new_empty(0),
    )


@torch.library.custom_op("trisparse::edge_gat_backward", mutates_args=())
def _gat_backward_op(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    a_edge: Tensor | None,
    keep: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    pattern: int,
    negative_slope: float,
    dropout: float,
    dropout_state: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx in x's dtype, da_src, da_dst, da_edge: empty without a_edge)."""
    p = lookup(pattern)
    plan = p.edge_attention_plan(x.device)
    dx, da_src, da_dst, da_edge = _gat_grads(x, a_src, a_dst, a_edge)
    _owner, ws, ws_bytes = _tensors.workspace(plan.workspace_bytes(x.shape[1]), x.device)
    plan.gat_backward(
        _tensors.view(x),
        _tensors.view2(a_src),
        _tensors.view2(a_dst),
        _tensors.view2(a_edge),
        _tensors.view(out),
        _tensors.view2(lse),
        _tensors.view(dout),
        _tensors.view(dx),
        _tensors.view2(da_src),
        _tensors.view2(da_dst),
        None if a_edge is None else _tensors.view2(da_edge),
        _keep(keep),
        negative_slope,
        _tensors.stream(x.device),
        ws,
        ws_bytes,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
    )
    return dx, da_src, da_dst, da_edge


@_gat_backward_op.register_fake
def _gat_backward_fake(
    x, a_src, a_dst, a_edge, keep, out, lse, dout, pattern, negative_slope, dropout, state
):
    return _gat_grads(x, a_src, a_dst, a_edge)


@torch.library.custom_op("trisparse::neighbor_sum", mutates_args=())
def _neighbor_sum(x: Tensor, pattern: int, transposed: bool) -> Tensor:
    """out [num_rows, H, C] = sum over the input's pairs (i <- j) of x[j] (transposed: out
    [num_cols, H, C] = sum of x[i] at j), in x's dtype: on CUDA the multigraph kernels (f32 sums
    in a fixed order), on the CPU index_add in the pairs' order."""
    p = lookup(pattern)
    transposed = transposed and not p.symmetric
    rows = p.num_cols if transposed else p.num_rows
    if x.device.type == "cuda":
        out = x.new_empty(rows, x.shape[1], x.shape[2])
        plan = p.edge_attention_plan(x.device, backward=transposed)
        plan.neighbor_sum(
            _tensors.view(x), _tensors.view(out), transposed, _tensors.stream(x.device)
        )
        return out
    targets, sources = p.input_pairs(x.device)
    at, of = (sources, targets) if transposed else (targets, sources)
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros(rows, x.shape[1], x.shape[2], dtype=acc)
    return out.index_add_(0, at, x[of].to(acc)).to(x.dtype)


@_neighbor_sum.register_fake
def _neighbor_sum_fake(x, pattern, transposed):
    p = lookup(pattern)
    rows = p.num_cols if transposed and not p.symmetric else p.num_rows
    return x.new_empty(rows, x.shape[1], x.shape[2])
