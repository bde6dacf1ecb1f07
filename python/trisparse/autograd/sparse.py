"""SpMM's and the fused GCN layer's autograd: each backward registered once on its op
(torch.library), and the eager calls (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.sparse import (
    _gcn_fused,
    _gcn_fused_backward,
    _spmm,
)


def _setup_context(ctx, inputs, output):
    _b, matrix, transposed = inputs
    ctx.matrix, ctx.transposed = matrix, transposed


def _backward(ctx, dc, *, run=torch.ops.trisparse.spmm):
    dc = dc if dc.stride(-1) == 1 else dc.contiguous()
    return run(dc, ctx.matrix, not ctx.transposed), None, None


_spmm.register_autograd(_backward, setup_context=_setup_context)


_spmm_eager = eager_autograd(_spmm, _setup_context, _backward, backward_op=_spmm)


def _gcn_setup_context(ctx, inputs, output):
    x, w, bias, matrix, relu, order = inputs
    _out, mask, ax = output
    ctx.matrix, ctx.relu, ctx.order = matrix, relu, order
    ctx.save_for_backward(x, w, mask if relu else None, ax, bias)


def _gcn_backward(ctx, dout, _dmask, _dax, *, run=torch.ops.trisparse.gcn_fused_backward):
    if dout is None:  # (unmaterialised: the loss does not reach the output)
        return (None,) * 6
    x, w, mask, ax, bias = ctx.saved_tensors
    dx, dw, dbias = run(
        dout.contiguous(), mask, x, w, ax, bias, ctx.matrix, ctx.order, ctx.needs_input_grad[0]
    )
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw,
        dbias if bias is not None else None,
        None,
        None,
        None,
    )


_gcn_fused.register_autograd(_gcn_backward, setup_context=_gcn_setup_context)


_gcn_fused_eager = eager_autograd(
    _gcn_fused,
    _gcn_setup_context,
    _gcn_backward,
    materialize_grads=False,
    backward_op=_gcn_fused_backward,
)
