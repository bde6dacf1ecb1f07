"""GAT's attention over a Pattern as torch ops (`trisparse::gat_attention` and its backward)
with their fake implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _tensors
from ..pattern import lookup


def _outputs(x: Tensor, a_dst: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """out [rows, H, C] in x's dtype and lse [rows, H] in the scores' dtype, unwritten (the op's
    and its fake's)."""
    return x.new_empty(rows, x.shape[1], x.shape[2]), a_dst.new_empty(rows, x.shape[1])


def _grads(x: Tensor, a_src: Tensor, a_dst: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dx, da_src, da_dst like their inputs, unwritten (the op's and its fake's)."""
    return torch.empty_like(x), torch.empty_like(a_src), torch.empty_like(a_dst)


@torch.library.custom_op("trisparse::gat_attention", mutates_args=())
def _gat(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    keep: Tensor | None,
    keep_index: Tensor | None,
    pattern: int,
    negative_slope: float,
    dropout: float,
    dropout_state: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(out [rows, H, C] in x's dtype, lse [rows, H] in the scores' dtype: float32, or float64
    with float64 x on the CPU). `dropout` > 0: attention dropout drawn in the kernels from
    `dropout_state` ({seed, offset}, int64 [2] on x's device), keyed by keep_index (the input
    edges) or the entries."""
    p = lookup(pattern)
    out, lse = _outputs(x, a_dst, p.num_rows)
    plan = p.gat_plan(x.device)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(x.shape[1], x.shape[2], False), x.device
    )
    plan.forward(
        _tensors.view(x),
        _tensors.view2(a_src),
        _tensors.view2(a_dst),
        _tensors.view2(keep),
        0 if keep_index is None else keep_index.data_ptr(),
        _tensors.view(out),
        _tensors.view2(lse),
        negative_slope,
        _tensors.stream(x.device),
        ws,
        ws_bytes,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
    )
    return out, lse


@_gat.register_fake
def _gat_fake(x, a_src, a_dst, keep, keep_index, pattern, negative_slope, dropout, state):
    return _outputs(x, a_dst, lookup(pattern).num_rows)


@torch.library.custom_op("trisparse::gat_attention_backward", mutates_args=())
def _gat_backward(
    dout: Tensor,
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    keep: Tensor | None,
    keep_index: Tensor | None,
    out: Tensor,
    lse: Tensor,
    pattern: int,
    negative_slope: float,
    dropout: float,
    dropout_state: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx in x's dtype, da_src and da_dst in the scores' dtype); the dropout as the forward's."""
    p = lookup(pattern)
    plan = p.gat_plan(x.device)
    heads = x.shape[1]
    dx, da_src, da_dst = _grads(x, a_src, a_dst)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(heads, x.shape[2], True), x.device
    )
    plan.backward(
        _tensors.view(x),
        _tensors.view2(a_src),
        _tensors.view2(a_dst),
        _tensors.view2(keep),
        0 if keep_index is None else keep_index.data_ptr(),
        _tensors.view(out),
        _tensors.view2(lse),
        _tensors.view(dout),
        _tensors.view(dx),
        _tensors.view2(da_src),
        _tensors.view2(da_dst),
        negative_slope,
        _tensors.stream(x.device),
        ws,
        ws_bytes,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
    )
    return dx, da_src, da_dst


@_gat_backward.register_fake
def _gat_backward_fake(
    dout, x, a_src, a_dst, keep, keep_index, out, lse, pattern, negative_slope, dropout, state
):
    return _grads(x, a_src, a_dst)
