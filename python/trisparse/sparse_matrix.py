""":class:`SparseMatrix`: a weighted sparse matrix with its transpose and plans (the SpMM's and the
fused GCN layer's operand), and the registry the ops find it in."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _C, _tensors
from ._registry import Registry
from .pattern import check_edge_ids, coo_to_csr

_matrices = Registry("matrix", "trisparse.SparseMatrix")


class SparseMatrix:
    """A ``num_rows x num_cols`` matrix with float32 values, kept with its transpose (the SpMM's
    gradient) and prepared per device on first use. Repeated entries are summed (in float64).
    Given float64 values it also keeps their float64 sums, which float64 operands on the CPU
    multiply by (:func:`spmm`, :func:`gcn_conv`): float64 results as exact as the values."""

    PLAN_CACHES = ("_plans", "_fused_plans")  # freed at exit (_registry)

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
        wide = value.dtype == torch.float64
        value = value.detach().to("cpu", torch.float64 if wide else torch.float32)
        check_edge_ids(row, col, num_rows, num_cols)
        self.num_rows, self.num_cols = int(num_rows), int(num_cols)
        self._csr = {False: self._canonical(row, col, value, num_rows, num_cols)}
        self._csr[True] = self._canonical(col, row, value, num_cols, num_rows)
        self._plans: dict[tuple[torch.device, bool], Any] = {}
        self._fused_plans: dict[torch.device, Any] = {}
        self.id = _matrices.add(self)

    @staticmethod
    def _canonical(row, col, value, rows, cols):
        rowptr, col_ids, inverse = coo_to_csr(row, col, rows, cols)
        # Repeats summed in float64, in the input's order (the CPU's index_add: a fixed order).
        summed = torch.zeros(col_ids.numel(), dtype=torch.float64).index_add_(
            0, inverse, value.double()
        )
        # (the float64 sums kept for float64 values only: 8 more bytes an entry)
        return rowptr, col_ids, summed.float(), summed if value.dtype == torch.float64 else None

    def plan(self, device: torch.device, transposed: bool = False):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        plan = self._plans.get((device, transposed))
        if plan is None:
            rowptr, col, value, _ = self._csr[transposed]
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

    def values64(self, transposed: bool, heads: int) -> torch.Tensor | None:
        """The float64 values as the CPU plan's per-head weights [nnz, heads, 1] (None where the
        matrix was given float32 values)."""
        sums = self._csr[transposed][3]  # float64 [nnz] in the CSR's entry order, or None
        return None if sums is None else sums.view(-1, 1, 1).expand(-1, heads, 1).contiguous()

    def fused_plan(self, device: torch.device):
        """The fused GCN layer's plan on `device` (square matrices only)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        plan = self._fused_plans.get(device)
        if plan is None:
            if self.num_rows != self.num_cols:
                raise ValueError(
                    f"the fused GCN layer needs a square matrix, not {self.num_rows} x "
                    f"{self.num_cols}"
                )
            rowptr, col, value, _ = self._csr[False]
            plan = _C.GcnFusedPlan.from_host(
                rowptr.data_ptr(),
                col.data_ptr(),
                value.data_ptr(),
                self.num_rows,
                col.numel(),
                _tensors.device_index(device),
                _tensors.stream(device),
            )
            self._fused_plans[device] = plan
        return plan
