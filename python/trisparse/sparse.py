"""Weighted sparse matrices and SpMM as a torch op (the propagation of GCN-style layers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _C, _tensors
from ._registry import Registry
from .pattern import check_edge_ids, row_offsets

__all__ = ["SparseMatrix", "spmm"]

_matrices = Registry("matrix", "trisparse.SparseMatrix")


class SparseMatrix:
    """A ``num_rows x num_cols`` matrix with float32 values, kept with its transpose (the SpMM's
    gradient) and prepared per device on first use. Repeated entries are summed."""

    def __init__(self, row: Tensor, col: Tensor, value: Tensor, num_rows: int, num_cols: int):
        if row.numel() != col.numel() or value.numel() != row.numel():
            raise ValueError(
                f"row, col and value must have one length, got {row.numel()}, {col.numel()} and "
                f"{value.numel()}"
            )
        if num_cols >= 2**31 or num_rows >= 2**31:
            raise ValueError(f"({num_rows}, {num_cols}) does not fit the kernels' 32-bit ids")
        # Canonical CSR on the host (the sums of repeated entries in one fixed order).
        row, col = row.detach().to("cpu", torch.int64), col.detach().to("cpu", torch.int64)
        value = value.detach().to("cpu", torch.float32)
        check_edge_ids(row, col, num_rows, num_cols)
        self.num_rows, self.num_cols = int(num_rows), int(num_cols)
        self._csr = {False: self._canonical(row, col, value, num_rows, num_cols)}
        self._csr[True] = self._canonical(col, row, value, num_cols, num_rows)
        self._plans: dict[tuple[torch.device, bool], Any] = {}
        self.id = _matrices.add(self)

    @staticmethod
    def _canonical(row, col, value, rows, cols):
        key = row * max(cols, 1) + col
        order = torch.argsort(key, stable=True)
        key, value = key[order], value[order]
        uniq, inverse = torch.unique_consecutive(key, return_inverse=True)
        summed = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(
            0, inverse, value.double()
        )
        r = torch.div(uniq, max(cols, 1), rounding_mode="floor")
        return row_offsets(r, rows), (uniq - r * max(cols, 1)).to(torch.int32), summed.float()

    def plan(self, device: torch.device, transposed: bool = False):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        plan = self._plans.get((device, transposed))
        if plan is None:
            rowptr, col, value = self._csr[transposed]
            rows, cols = (
                (self.num_cols, self.num_rows) if transposed else (self.num_rows, self.num_cols)
            )
            plan = _C.SparsePlan.from_host(
                rowptr.data_ptr(),
                col.data_ptr(),
                value.data_ptr(),
                rows,
                cols,
                col.numel(),
                _tensors.device_index(device),
                _tensors.stream(device),
            )
            self._plans[(device, transposed)] = plan
        return plan


@torch.library.custom_op("trisparse::spmm", mutates_args=())
def _spmm(b: Tensor, matrix: int, transposed: bool) -> Tensor:
    """c = A b (A^T b when transposed) for b [cols, H, n]: c [rows, H, n] in b's dtype."""
    m = _matrices.lookup(matrix)
    plan = m.plan(b.device, transposed)
    rows = m.num_cols if transposed else m.num_rows
    c = b.new_empty(rows, b.shape[1], b.shape[2])
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(b.shape[1], b.shape[2]), b.device
    )
    plan.spmm(None, _tensors.view(b), _tensors.view(c), _tensors.stream(b.device), ws, ws_bytes)
    return c


@_spmm.register_fake
def _spmm_fake(b, matrix, transposed):
    m = _matrices.lookup(matrix)
    return b.new_empty(m.num_cols if transposed else m.num_rows, b.shape[1], b.shape[2])


def _setup_context(ctx, inputs, output):
    _b, matrix, transposed = inputs
    ctx.matrix, ctx.transposed = matrix, transposed


def _backward(ctx, dc):
    dc = dc if dc.stride(-1) == 1 else dc.contiguous()
    return torch.ops.trisparse.spmm(dc, ctx.matrix, not ctx.transposed), None, None


_spmm.register_autograd(_backward, setup_context=_setup_context)


def spmm(matrix: SparseMatrix, b: Tensor) -> Tensor:
    """A b for b [num_cols, n] or [num_cols, H, n]; differentiable in b (deterministic). The CPU
    computes in float64; CUDA takes float16, bfloat16 or float32 (tf32 on the tensor cores)."""
    if not isinstance(matrix, SparseMatrix):
        raise TypeError(f"matrix must be a trisparse.SparseMatrix, got {type(matrix).__name__}")
    if not isinstance(b, Tensor) or b.dtype not in _tensors.FLOAT_DTYPES:
        raise TypeError("b must be a float16, bfloat16, float32 or float64 tensor")
    if b.dim() not in (2, 3) or b.shape[0] != matrix.num_cols:
        raise ValueError(
            f"b must have shape [{matrix.num_cols}, n] or [{matrix.num_cols}, H, n], got "
            f"{tuple(b.shape)}"
        )
    b3 = b if b.dim() == 3 else b.unsqueeze(1)
    b3 = b3 if b3.stride(-1) == 1 else b3.contiguous()
    c = torch.ops.trisparse.spmm(b3, matrix.id, False)
    return c if b.dim() == 3 else c.squeeze(1)
