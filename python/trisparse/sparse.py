"""Weighted sparse matrices and SpMM as a torch op (the propagation of GCN-style layers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _C, _tensors
from ._eager import eager_autograd
from ._registry import Registry
from .pattern import check_edge_ids, coo_to_csr

__all__ = ["SparseMatrix", "gcn_conv", "spmm"]

_matrices = Registry("matrix", "trisparse.SparseMatrix")


class SparseMatrix:
    """A ``num_rows x num_cols`` matrix with float32 values, kept with its transpose (the SpMM's
    gradient) and prepared per device on first use. Repeated entries are summed."""

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
        value = value.detach().to("cpu", torch.float32)
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
        return rowptr, col_ids, summed.float()

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
            rowptr, col, value = self._csr[False]
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
_spmm_eager = eager_autograd(_spmm, _setup_context, _backward)


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
    c = _spmm_eager(b3, matrix.id, False)
    return c if b.dim() == 3 else c.squeeze(1)


def _mask_words(f_out: int) -> int:
    return (f_out + 31) // 32


@torch.library.custom_op("trisparse::gcn_fused", mutates_args=())
def _gcn_fused(
    x: Tensor, w: Tensor, bias: Tensor | None, matrix: int, relu: bool, order: str
) -> tuple[Tensor, Tensor, Tensor]:
    """out = A x w + bias (ReLU'd) for x [N, F_in], w [F_in, F_out] (row-major), with the ReLU
    mask [N, ceil(F_out / 32)] (int32 words) and, in the fused order, A x [N, F_in] (else [0])."""
    m = _matrices.lookup(matrix)
    plan = m.fused_plan(x.device)
    n, f_in, f_out = x.shape[0], x.shape[1], w.shape[1]
    code = _tensors.dtype_code(x.dtype)
    fused = plan.fused(f_in, f_out, code, order)
    out = x.new_empty(n, f_out)
    mask = torch.empty(n, _mask_words(f_out), dtype=torch.int32, device=x.device)
    ax = x.new_empty(n, f_in) if fused else x.new_empty(0)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(f_in, f_out, code, order), x.device
    )
    plan.forward(
        _tensors.view(x.unsqueeze(1)),
        _tensors.view(w.unsqueeze(1)),
        None if bias is None else _tensors.view(bias.view(1, 1, -1)),
        _tensors.view(out.unsqueeze(1)),
        relu,
        mask.data_ptr(),
        _tensors.view(ax.unsqueeze(1)) if fused else None,
        order,
        _tensors.stream(x.device),
        ws,
        ws_bytes,
    )
    return out, mask, ax


@_gcn_fused.register_fake
def _gcn_fused_fake(x, w, bias, matrix, relu, order):
    m = _matrices.lookup(matrix)
    plan = m.fused_plan(x.device)
    fused = plan.fused(x.shape[1], w.shape[1], _tensors.dtype_code(x.dtype), order)
    return (
        x.new_empty(x.shape[0], w.shape[1]),
        x.new_empty(x.shape[0], _mask_words(w.shape[1]), dtype=torch.int32),
        x.new_empty(x.shape[0], x.shape[1]) if fused else x.new_empty(0),
    )


def _gcn_setup_context(ctx, inputs, output):
    x, w, bias, matrix, relu, order = inputs
    _out, mask, ax = output
    ctx.matrix, ctx.relu, ctx.order = matrix, relu, order
    ctx.save_for_backward(x, w, mask if relu else None, ax, bias)


@torch.library.custom_op("trisparse::gcn_fused_backward", mutates_args=())
def _gcn_fused_backward(
    dout: Tensor,
    mask: Tensor | None,
    x: Tensor,
    w: Tensor,
    ax: Tensor,
    bias: Tensor | None,
    matrix: int,
    order: str,
    with_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """One call of the plan's backward: dZ = dout ∘ mask, dbias = Σ dZ (in bias's dtype; empty
    without a bias), and dW, dX (empty unless `with_dx`) through the transposed matrix, all
    deterministic."""
    plan = _matrices.lookup(matrix).fused_plan(x.device)
    f_in, f_out = w.shape
    code = _tensors.dtype_code(x.dtype)
    # dx only where x needs it (a model's input features do not): its products are skipped.
    dx = torch.empty_like(x) if with_dx else x.new_empty(0)
    dw = torch.empty_like(w)
    dbias = dout.new_empty(0) if bias is None else dout.new_empty(f_out, dtype=bias.dtype)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.backward_workspace_bytes(f_in, f_out, code, order), x.device
    )
    plan.backward(
        _tensors.view(dout.unsqueeze(1)),
        0 if mask is None else mask.data_ptr(),
        _tensors.view(x.unsqueeze(1)),
        _tensors.view(w.unsqueeze(1)),
        _tensors.view(ax.unsqueeze(1)) if ax.numel() > 0 else None,
        _tensors.view(dx.unsqueeze(1)) if with_dx else None,
        _tensors.view(dw.unsqueeze(1)),
        None if bias is None else _tensors.view(dbias.view(1, 1, -1)),
        order,
        _tensors.stream(x.device),
        ws,
        ws_bytes,
    )
    return dx, dw, dbias


@_gcn_fused_backward.register_fake
def _gcn_fused_backward_fake(dout, mask, x, w, ax, bias, matrix, order, with_dx):
    dx = torch.empty_like(x) if with_dx else x.new_empty(0)
    dbias = dout.new_empty(0) if bias is None else dout.new_empty(w.shape[1], dtype=bias.dtype)
    return dx, torch.empty_like(w), dbias


def _gcn_backward(ctx, dout, _dmask, _dax):
    x, w, mask, ax, bias = ctx.saved_tensors
    dx, dw, dbias = torch.ops.trisparse.gcn_fused_backward(
        dout.contiguous(), mask, x, w, ax, bias, ctx.matrix, ctx.order, ctx.needs_input_grad[0]
    )
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw,
        dbias if bias is not None else None,
        None,
        None,
        None,
    )


_gcn_fused.register_autograd(_gcn_backward, setup_context=_gcn_setup_context)
_gcn_fused_eager = eager_autograd(_gcn_fused, _gcn_setup_context, _gcn_backward)


def gcn_conv(
    matrix: SparseMatrix,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    relu: bool = False,
    order: str = "auto",
) -> Tensor:
    """A (x weightᵀ) + bias, ReLU'd with `relu`, as one fused layer (GraphCUDA's A·X·W): on CUDA
    (A x) W in one kernel with the bias and ReLU in its epilogue, or x W, SpMM and the epilogue,
    whichever `order` ('auto': the measured rule, 'fused', 'unfused') picks; the CPU computes
    float32 in float32 (OpenMP), other dtypes in float64. ``weight`` is [F_out, F_in] as
    torch.nn.Linear's; x [N, F_in] float16, bfloat16 or float32 (tf32 on the tensor cores); bias
    [F_out] in float32 or x's dtype. Differentiable in x, weight and bias (deterministic): the
    ReLU is applied through a 1-bit mask."""
    if not isinstance(matrix, SparseMatrix):
        raise TypeError(f"matrix must be a trisparse.SparseMatrix, got {type(matrix).__name__}")
    if x.dim() != 2 or x.shape[0] != matrix.num_cols:
        raise ValueError(f"x must have shape [{matrix.num_cols}, F_in], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must have shape [F_out, {x.shape[1]}], got {tuple(weight.shape)}")
    if order not in ("auto", "fused", "unfused"):
        raise ValueError(f"order must be 'auto', 'fused' or 'unfused', not {order!r}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = weight.t().to(x.dtype).contiguous()
    if bias is not None:
        bias = bias.to(x.dtype if bias.dtype != torch.float32 else bias.dtype).contiguous()
    out, _mask, _ax = _gcn_fused_eager(x, w, bias, matrix.id, relu, order)
    return out
