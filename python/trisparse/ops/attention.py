"""Sparse attention as torch ops (`trisparse::sparse_attention` and its backward) with their
fake implementations for torch.compile."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _tensors
from ..pattern import lookup


def _lse_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _lse_shape(q: Tensor, with_lse: bool) -> tuple[int, ...]:
    return (q.shape[0], q.shape[1]) if with_lse else (0,)


def _bias_view(bias: Tensor | None) -> tuple | None:
    """[nnz, H] or [nnz] (shared by the heads) as the plans' [nnz, H, 1] or [nnz, 1, 1] view."""
    if bias is None:
        return None
    return _tensors.view(bias.unsqueeze(-1) if bias.dim() == 2 else bias.view(-1, 1, 1))


def _forward_outputs(q: Tensor, v: Tensor, with_lse: bool) -> tuple[Tensor, Tensor]:
    """The forward's out [rows, H, Dv] and lse, unwritten (the op's and its fake's)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(_lse_shape(q, with_lse), dtype=_lse_dtype(q))


@torch.library.custom_op("trisparse::sparse_attention", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    pattern: int,
    scale: float,
    with_lse: bool,
    gradients: bool,
) -> tuple[Tensor, Tensor]:
    """`with_lse`: also write the log-sum-exp (else it comes back empty); `gradients`: build the
    plan with what backward needs. `bias`: per-entry score bias ([nnz, H] or [nnz], float32, or
    float64 for float64 inputs), or None."""
    # float32 runs on CUDA go row-wise on the device CSR that a plan with gradients holds, and so do
    # biased runs the fused 3S kernel does not take (head dims over 128, device-built plans).
    rowwise = q.device.type == "cuda" and (q.dtype == torch.float32 or bias is not None)
    plan = lookup(pattern).plan(q.device, gradients=gradients or rowwise)
    out, lse = _forward_outputs(q, v, with_lse)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(q.shape[1], max(q.shape[2], v.shape[2])), q.device
    )
    plan.run(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view(v),
        _tensors.view(out),
        _tensors.view2(lse) if with_lse else None,
        _bias_view(bias),
        scale,
        "automatic",  # the fastest; on the CPU float64 in float64 (gradcheck)
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return out, lse


@_forward.register_fake
def _forward_fake(q, k, v, bias, pattern, scale, with_lse, gradients):
    return _forward_outputs(q, v, with_lse)


@torch.library.custom_op("trisparse::sparse_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    bias: Tensor | None,
    pattern: int,
    scale: float,
    with_dbias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, and with `with_dbias` dL/dbias per entry and head ([nnz, H] in the bias's
    dtype, float32 without a bias; else empty)."""
    plan = lookup(pattern).plan(q.device, gradients=True)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = q.new_empty(_dbias_shape(q, pattern, with_dbias), dtype=_bias_dtype(q))
    ws_need = plan.backward_workspace_bytes(
        q.shape[1], max(q.shape[2], v.shape[2]), _tensors.dtype_code(q.dtype)
    )
    _owner, ws, ws_bytes = _tensors.workspace(ws_need, q.device)
    plan.backward(
        *(_tensors.view(t) for t in (q, k, v, out)),
        _tensors.view2(lse) if lse.dim() == 2 else None,
        *(_tensors.view(t) for t in (dout, dq, dk, dv)),
        _bias_view(bias),
        _tensors.view2(dbias) if with_dbias else None,
        scale,
        "automatic",  # the fastest; on the CPU float64 in float64 (gradcheck)
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return dq, dk, dv, dbias


def _bias_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _dbias_shape(q: Tensor, pattern: int, with_dbias: bool) -> tuple[int, ...]:
    return (lookup(pattern).nnz, q.shape[1]) if with_dbias else (0,)


@_backward_op.register_fake
def _backward_fake(q, k, v, out, lse, dout, bias, pattern, scale, with_dbias):
    dbias = q.new_empty(_dbias_shape(q, pattern, with_dbias), dtype=_bias_dtype(q))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias
