"""Attention within segments' autograd: the backward registered once on the op (torch.library), and
the eager call (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.segment_attention import (
    _backward_op,
    _forward,
)


def _setup_context(ctx, inputs, output):
    q, k, v, batch, scale, dropout, dropout_state, bias, edges = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, batch, dropout_state, bias, edges)
    ctx.scale = scale
    ctx.dropout = dropout
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse, *, run=torch.ops.trisparse.segment_attention_backward):
    if dout is None:  # (unmaterialised: the loss does not reach the output)
        return (None,) * 9
    q, k, v, out, lse, batch, dropout_state, bias, edges = ctx.saved_tensors
    dq, dk, dv, dbias = run(
        q, k, v, out, lse, dout, batch, ctx.scale, ctx.dropout, dropout_state, bias, edges
    )
    if bias is None or not ctx.needs_input_grad[7]:
        dbias = None
    elif bias.shape[1] != dbias.shape[1]:  # shared by the heads: their sum, in head order
        dbias = dbias.sum(1, keepdim=True)
    return dq, dk, dv, None, None, None, None, dbias, None


_forward.register_autograd(_backward, setup_context=_setup_context)


_call = eager_autograd(
    _forward, _setup_context, _backward, materialize_grads=False, backward_op=_backward_op
)
