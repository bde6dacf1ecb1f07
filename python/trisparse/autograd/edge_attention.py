"""The multigraph attention's autograd: each backward registered once on its op (torch.library),
and the eager calls (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.edge_attention import (
    _backward_op,
    _forward,
    _gat_backward_op,
    _gat_forward,
    _neighbor_sum,
)
from ..pattern import lookup


def _setup(ctx, inputs, output):
    q, k, v, r, a, keep, pattern, scale, dropout, dropout_state = inputs
    out, out_edge, lse = output
    ctx.save_for_backward(q, k, v, r, a, keep, out, out_edge, lse, dropout_state)
    ctx.pattern, ctx.scale, ctx.dropout = pattern, scale, dropout
    ctx.held = lookup(pattern)  # alive until the backward, if the caller dropped it


def _backward(ctx, dout, dout_edge, _dlse, *, run=torch.ops.trisparse.edge_attention_backward):
    q, k, v, r, a, keep, out, out_edge, lse, dropout_state = ctx.saved_tensors
    if dout is None and dout_edge is None:  # (unmaterialised: the loss reaches neither)
        return (None,) * 10
    dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype).contiguous()
    if dout_edge is None:
        dout_edge = torch.zeros_like(out_edge)
    dout_edge = dout_edge.to(out_edge.dtype).contiguous()
    dq, dk, dv, dr, da = run(
        q,
        k,
        v,
        r,
        a,
        keep,
        out,
        out_edge,
        lse,
        dout,
        dout_edge,
        ctx.pattern,
        ctx.scale,
        ctx.dropout,
        dropout_state,
    )
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    grads += [None, None] if r is None else [dr.to(r.dtype), da.to(a.dtype)]
    return (*grads, None, None, None, None, None)


_forward.register_autograd(_backward, setup_context=_setup)


_forward_eager = eager_autograd(
    _forward, _setup, _backward, materialize_grads=False, backward_op=_backward_op
)


def _gat_setup(ctx, inputs, output):
    x, a_src, a_dst, a_edge, keep, pattern, negative_slope, dropout, dropout_state = inputs
    out, lse = output
    ctx.save_for_backward(x, a_src, a_dst, a_edge, keep, out, lse, dropout_state)
    ctx.pattern, ctx.negative_slope, ctx.dropout = pattern, negative_slope, dropout
    ctx.held = lookup(pattern)


def _gat_backward(ctx, dout, _dlse, *, run=torch.ops.trisparse.edge_gat_backward):
    if dout is None:  # (unmaterialised: the loss does not reach the output)
        return (None,) * 9
    x, a_src, a_dst, a_edge, keep, out, lse, dropout_state = ctx.saved_tensors
    dx, da_src, da_dst, da_edge = run(
        x,
        a_src,
        a_dst,
        a_edge,
        keep,
        out,
        lse,
        dout.to(out.dtype).contiguous(),
        ctx.pattern,
        ctx.negative_slope,
        ctx.dropout,
        dropout_state,
    )
    da_edge = None if a_edge is None else da_edge
    return dx.to(x.dtype), da_src, da_dst, da_edge, None, None, None, None, None


_gat_forward.register_autograd(_gat_backward, setup_context=_gat_setup)


_gat_forward_eager = eager_autograd(
    _gat_forward, _gat_setup, _gat_backward, materialize_grads=False, backward_op=_gat_backward_op
)


def _sum_setup(ctx, inputs, output):
    _x, pattern, transposed = inputs
    ctx.pattern, ctx.transposed = pattern, transposed
    ctx.held = lookup(pattern)


def _sum_backward(ctx, dout):
    dx = torch.ops.trisparse.neighbor_sum(dout.contiguous(), ctx.pattern, not ctx.transposed)
    return dx, None, None


_neighbor_sum.register_autograd(_sum_backward, setup_context=_sum_setup)


_neighbor_sum_eager = eager_autograd(_neighbor_sum, _sum_setup, _sum_backward)
