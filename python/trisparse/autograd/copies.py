"""The per-copy gathers' autograd: each backward registered once on its op (torch.library), and
the eager calls (_eager.eager_autograd)."""

from __future__ import annotations

import torch

from .._eager import eager_autograd
from ..ops.copies import _gather_rows, _to_copies


def _gather_rows_setup(ctx, inputs, output):
    values, index = inputs
    ctx.save_for_backward(index)
    ctx.rows = values.shape[0]


def _gather_rows_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return grad.new_zeros(ctx.rows, grad.shape[1]).index_add_(0, index, grad), None


_gather_rows.register_autograd(_gather_rows_backward, setup_context=_gather_rows_setup)


_gather_rows_eager = eager_autograd(_gather_rows, _gather_rows_setup, _gather_rows_backward)


def _to_copies_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _to_copies_backward(ctx, grad):
    order, offsets = ctx.saved_tensors
    summed = torch.segment_reduce(grad[order], "sum", offsets=offsets, axis=0)
    return summed, None, None, None


_to_copies.register_autograd(_to_copies_backward, setup_context=_to_copies_setup)


_to_copies_eager = eager_autograd(_to_copies, _to_copies_setup, _to_copies_backward)
