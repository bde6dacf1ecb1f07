"""Sparse attention's autograd: the backward registered once on the op (torch.library), and
the eager call (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.attention import (
    _backward_op,
    _forward,
)
from ..pattern import _patterns


def _setup_context(ctx, inputs, output):
    q, k, v, bias, pattern, scale, _with_lse, gradients = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias)
    ctx.pattern, ctx.scale, ctx.gradients = pattern, scale, gradients
    ctx.pattern_object = _patterns.get(pattern)  # held until the backward
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse, *, run=torch.ops.trisparse.sparse_attention_backward):
    if dout is None:  # (unmaterialised: the loss does not reach the output)
        return (None,) * 8
    if not ctx.gradients:
        raise RuntimeError(
            "trisparse.sparse_attention: this forward ran without preparing gradients "
            "(no input required grad when it ran)"
        )
    q, k, v, out, lse, bias = ctx.saved_tensors
    with_dbias = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = run(q, k, v, out, lse, dout, bias, ctx.pattern, ctx.scale, with_dbias)
    if with_dbias and bias.dim() == 1:
        dbias = dbias.sum(dim=1)  # a bias shared by the heads: a fixed-order sum over them
    return dq, dk, dv, dbias if with_dbias else None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


_forward_eager = eager_autograd(
    _forward, _setup_context, _backward, materialize_grads=False, backward_op=_backward_op
)
