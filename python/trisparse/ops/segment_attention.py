"""Attention within segments as torch ops (`trisparse::segment_attention` and its backward)
with their fake implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _C, _tensors


def _workspace(batch: Tensor, rows: int, heads: int, backward: bool):
    return _tensors.workspace(
        _C.segment_attention_workspace(batch.data_ptr(), rows, heads, backward), batch.device
    )


def _forward_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """out [rows, H, D] in q's dtype and lse [rows, H] float32, unwritten (op and fake)."""
    return q.new_empty(q.shape), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def _edges(edges: Tensor | None, rows: int) -> tuple[int, int]:
    """(address, count) of the edges' packed lists (int32: two [rows + 1] offsets and four [E]
    arrays, trisparse.segment_attention's ``_edge_lists``), or (0, 0) for none."""
    if edges is None:
        return 0, 0
    return edges.data_ptr(), (edges.numel() - 2 * (rows + 1)) // 4


def _grads(q: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv in q's shape and dtype, unwritten, and the pair bias's gradient: float32 [rows,
    H, M] (per edge: [E, H, 1]) zeros where a bias is given (places of no pair stay 0), else empty
    (op and fake)."""
    dbias = (
        q.new_zeros(bias.shape[0], q.shape[1], bias.shape[2], dtype=torch.float32)
        if bias is not None
        else q.new_empty(0, dtype=torch.float32)
    )
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape), dbias


@torch.library.custom_op("trisparse::segment_attention", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: Tensor,
    scale: float,
    dropout: float,
    dropout_state: Tensor | None,
    bias: Tensor | None,
    edges: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [rows, H, D] in q's dtype, lse [rows, H] float32); q, k, v any strides; attention
    dropout p = ``dropout`` drawn in the kernels from ``dropout_state`` ({seed, offset}, int64
    [2] on q's device); ``bias`` the pairs' score bias (float32 [rows, H or 1, M], last dimension
    contiguous: pair (i, j) at [i, h, j - the first row of i's segment]) or None; with ``edges``
    (the edges' packed int32 lists) a bias per edge, float32 [E, H or 1, 1]."""
    q, k, v = (_tensors.rows16(t) for t in (q, k, v))
    out, lse = _forward_outputs(q)
    _owner, ws, ws_bytes = _workspace(batch, q.shape[0], q.shape[1], False)
    _C.segment_attention_forward(
        batch.data_ptr(),
        batch.dtype == torch.int64,
        *(_tensors.view(t) for t in (q, k, v, out)),
        _tensors.view2(lse),
        scale,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
        None if bias is None else _tensors.view(bias),
        *_edges(edges, q.shape[0]),
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return out, lse


@_forward.register_fake
def _forward_fake(q, k, v, batch, scale, dropout, dropout_state, bias, edges=None):
    return _forward_outputs(q)


@torch.library.custom_op("trisparse::segment_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    batch: Tensor,
    scale: float,
    dropout: float,
    dropout_state: Tensor | None,
    bias: Tensor | None,
    edges: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv in q's dtype (fp32 accumulation, one rounding at the store), and dL/dS of each
    pair where a bias is given (float32 [rows, H, M], zeros elsewhere; per edge [E, H, 1]; else
    empty); the forward's dropout regenerated from the same state."""
    q, k, v, out, dout = (_tensors.rows16(t) for t in (q, k, v, out, dout))
    dq, dk, dv, dbias = _grads(q, bias)
    _owner, ws, ws_bytes = _workspace(batch, q.shape[0], q.shape[1], True)
    _C.segment_attention_backward(
        batch.data_ptr(),
        batch.dtype == torch.int64,
        *(_tensors.view(t) for t in (q, k, v, out)),
        _tensors.view2(lse),
        *(_tensors.view(t) for t in (dout, dq, dk, dv)),
        scale,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
        None if bias is None else _tensors.view(bias),
        None if bias is None else _tensors.view(dbias),
        *_edges(edges, q.shape[0]),
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return dq, dk, dv, dbias


@_backward_op.register_fake
def _backward_fake(q, k, v, out, lse, dout, batch, scale, dropout, dropout_state, bias, edges=None):
    return _grads(q, bias)
