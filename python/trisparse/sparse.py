"""SpMM with a weighted sparse matrix (the propagation of GCN-style layers) and the fused GCN
layer: the arguments checked, then the ops (``trisparse.ops.sparse``; autograd in
``trisparse.autograd.sparse``). :class:`SparseMatrix` is in ``trisparse.sparse_matrix``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _tensors
from .autograd.sparse import (
    _gcn_fused_eager,
    _spmm_eager,
)
from .sparse_matrix import SparseMatrix

__all__ = ["SparseMatrix", "gcn_conv", "spmm"]


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
    whichever `order` ('auto': the measured rule, 'fused', 'unfused') picks. On the CPU torch's
    GEMM and the library's SpMM (OpenMP), the SpMM over the narrower of x and x Wᵀ (measured
    faster than the library's fused CPU engine with its own GEMM: 5-7 × on a 2-core VM at 20K and
    100K nodes); float64 with a matrix of float64 values by those values. ``weight`` is [F_out,
    F_in] as torch.nn.Linear's; x [N, F_in] float16, bfloat16 or float32 (tf32 on the tensor
    cores), or float64 on the CPU; bias [F_out] in float32 or x's dtype. Differentiable in x,
    weight and bias (deterministic); on CUDA the ReLU is applied through a 1-bit mask."""
    if not isinstance(matrix, SparseMatrix):
        raise TypeError(f"matrix must be a trisparse.SparseMatrix, got {type(matrix).__name__}")
    if x.dim() != 2 or x.shape[0] != matrix.num_cols:
        raise ValueError(f"x must have shape [{matrix.num_cols}, F_in], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must have shape [F_out, {x.shape[1]}], got {tuple(weight.shape)}")
    if order not in ("auto", "fused", "unfused"):
        raise ValueError(f"order must be 'auto', 'fused' or 'unfused', not {order!r}")
    if matrix.num_rows != matrix.num_cols:  # (as the CUDA layer's plan: a propagation matrix)
        raise ValueError(
            f"the GCN layer needs a square matrix, not {matrix.num_rows} x {matrix.num_cols}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    if x.device.type == "cpu":  # torch's GEMM, the library's SpMM (float64 values for float64)
        w = weight.to(x.dtype)
        narrow = w.shape[0] <= w.shape[1]  # the SpMM over x Wᵀ, else over x
        out = spmm(matrix, F.linear(x, w)) if narrow else F.linear(spmm(matrix, x), w)
        out = out if bias is None else out + bias.to(x.dtype)
        return F.relu(out) if relu else out
    w = weight.t().to(x.dtype).contiguous()
    if bias is not None:
        bias = bias.to(x.dtype if bias.dtype != torch.float32 else bias.dtype).contiguous()
    out, _mask, _ax = _gcn_fused_eager(x, w, bias, matrix.id, relu, order)
    return out
