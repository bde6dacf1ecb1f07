"""SpMM and the fused GCN layer as torch ops (`trisparse::spmm`, `gcn_fused` and its backward)
with their fake implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _tensors
from ..sparse_matrix import _matrices


@torch.library.custom_op("trisparse::spmm", mutates_args=())
def _spmm(b: Tensor, matrix: int, transposed: bool) -> Tensor:
    """c = A b (A^T b when transposed) for b [cols, H, n]: c [rows, H, n] in b's dtype (float64
    b on the CPU by the matrix's float64 values where it has them)."""
    m = _matrices.lookup(matrix)
    plan = m.plan(b.device, transposed)
    rows = m.num_cols if transposed else m.num_rows
    c = b.new_empty(rows, b.shape[1], b.shape[2])
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(b.shape[1], b.shape[2]), b.device
    )
    values = None
    if b.dtype == torch.float64 and b.device.type == "cpu":
        values = m.values64(transposed, b.shape[1])
    plan.spmm(
        None if values is None else _tensors.view(values),
        _tensors.view(b),
        _tensors.view(c),
        _tensors.stream(b.device),
        ws,
        ws_bytes,
    )
    return c


@_spmm.register_fake
def _spmm_fake(b, matrix, transposed):
    m = _matrices.lookup(matrix)
    return b.new_empty(m.num_cols if transposed else m.num_rows, b.shape[1], b.shape[2])


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
