"""The per-edge ops' autograd: each backward registered once on its op (torch.library), and the
eager calls (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.edge import (
    _edge_scores,
    _edge_softmax,
    _edge_spmm,
    _sddmm,
)


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


def _edge_softmax_setup(ctx, inputs, output):
    ctx.pattern = inputs[1]
    ctx.save_for_backward(output)


def _edge_softmax_backward(ctx, dp):
    (p,) = ctx.saved_tensors
    return torch.ops.trisparse.edge_softmax_backward(p, dp.contiguous(), ctx.pattern), None


_edge_softmax.register_autograd(_edge_softmax_backward, setup_context=_edge_softmax_setup)


_edge_softmax_eager = eager_autograd(_edge_softmax, _edge_softmax_setup, _edge_softmax_backward)


def _edge_scores_setup(ctx, inputs, output):
    ctx.pattern = inputs[2]


def _edge_scores_backward(ctx, ds):
    ddst, dsrc = torch.ops.trisparse.edge_scores_backward(ds.contiguous(), ctx.pattern)
    return ddst, dsrc, None


_edge_scores.register_autograd(_edge_scores_backward, setup_context=_edge_scores_setup)


_edge_scores_eager = eager_autograd(_edge_scores, _edge_scores_setup, _edge_scores_backward)
