"""GAT's attention's autograd: the backward registered once on the op (torch.library), and
the eager call (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.gat import _gat, _gat_backward


def _setup(ctx, inputs, output):
    x, a_src, a_dst, keep, keep_index, pattern, negative_slope, dropout, dropout_state = inputs
    out, lse = output
    ctx.save_for_backward(x, a_src, a_dst, keep, keep_index, out, lse, dropout_state)
    ctx.pattern, ctx.negative_slope, ctx.dropout = pattern, negative_slope, dropout


def _backward(ctx, dout, _dlse, *, run=torch.ops.trisparse.gat_attention_backward):
    if dout is None:  # (unmaterialised: the loss does not reach the output)
        return (None,) * 9
    x, a_src, a_dst, keep, keep_index, out, lse, dropout_state = ctx.saved_tensors
    dout = dout.to(out.dtype).contiguous()
    dx, da_src, da_dst = run(
        dout, x, a_src, a_dst, keep, keep_index, out, lse, ctx.pattern, ctx.negative_slope,
        ctx.dropout, dropout_state,
    )  # fmt: skip
    return dx, da_src, da_dst, None, None, None, None, None, None


_gat.register_autograd(_backward, setup_context=_setup)


_gat_eager = eager_autograd(
    _gat, _setup, _backward, materialize_grads=False, backward_op=_gat_backward
)
