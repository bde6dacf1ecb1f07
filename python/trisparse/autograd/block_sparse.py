"""Block-sparse attention's autograd: the backward registered once on the op (torch.library), and
the eager call (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..block_mask import _masks, _trackers
from ..ops.block_sparse import (
    _backward_op,
    _forward,
)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, cu_q, cu_k, scale, _with_lse, importance, dropout, dropout_state, bias = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, dropout_state, bias)
    ctx.mask, ctx.cu_q, ctx.cu_k, ctx.scale = mask, cu_q, cu_k, scale
    ctx.dropout = dropout
    ctx.importance = _trackers.get(importance) if importance else None
    ctx.importance_shape = ctx.importance._shape if ctx.importance is not None else None
    # Held until the backward: a mask made for one step (a top-k selection) may be dropped by the
    # caller as soon as the forward returns.
    ctx.mask_object = _masks.get(mask)


def _backward(ctx, dout, _dlse, *, run=torch.ops.trisparse.block_sparse_attention_backward):
    if dout is None:  # (unmaterialised: the loss does not reach the output)
        return (None,) * 12
    q, k, v, out, lse, dropout_state, bias = ctx.saved_tensors
    tracker = ctx.importance
    dq, dk, dv, mass, grad, dbias = run(
        q,
        k,
        v,
        out,
        lse,
        dout,
        ctx.mask,
        ctx.cu_q,
        ctx.cu_k,
        ctx.scale,
        0 if tracker is None else 1 + tracker.measure_grad,
        ctx.dropout,
        dropout_state,
        bias,
        bias is not None and ctx.needs_input_grad[11],
    )
    if tracker is not None:
        tracker._record(mass, grad, ctx.importance_shape)
    return (dq, dk, dv) + (None,) * 8 + (dbias if dbias.numel() else None,)


_forward.register_autograd(_backward, setup_context=_setup_context)


_forward_eager = eager_autograd(
    _forward, _setup_context, _backward, materialize_grads=False, backward_op=_backward_op
)
