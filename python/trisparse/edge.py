"""Per-edge values on a Pattern as torch ops: the SpMM that aggregates with per-edge, per-head
weights and the SDDMM that gives per-edge scores, each the other's gradient (over the pattern or
its transpose), so no [E, heads, channels] message tensor is ever formed; and the per-edge
softmax and node-to-edge scores with gradients reduced over CSR segments in a fixed order (torch's
gather/scatter backward adds with atomics on CUDA). Per-edge tensors are [E, H] in the pattern's
entry order (``Pattern.entries``). The ops: ``trisparse.ops.edge``; their autograd:
``trisparse.autograd.edge``."""

from __future__ import annotations

from torch import Tensor

from . import _tensors
from .autograd.edge import (
    _edge_scores_eager,
    _edge_softmax_eager,
    _edge_spmm_eager,
    _sddmm_eager,
)
from .pattern import Pattern

__all__ = ["edge_scores", "edge_softmax", "edge_spmm", "sddmm"]


def _check_pattern(pattern) -> None:
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a trisparse.Pattern, got {type(pattern).__name__}")


def _check(name: str, t: Tensor, rows: int) -> None:
    if not isinstance(t, Tensor) or t.dtype not in _tensors.FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor")
    if t.dim() != 3 or t.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, heads, channels], got {tuple(t.shape)}")


def edge_spmm(values: Tensor, b: Tensor, pattern: Pattern, transposed: bool = False) -> Tensor:
    """out[i, h] = sum over the pattern's entries (i, j) of values[e, h] * b[j, h]: the
    aggregation of per-edge, per-head weights (``values`` [E, H] in entry order) over
    ``b`` [num_cols, H, C]; with ``transposed``, over the transpose (b [num_rows, H, C]).
    Differentiable in both (deterministic)."""
    _check_pattern(pattern)
    _check("b", b, pattern.num_rows if transposed else pattern.num_cols)
    if values.dim() != 2 or values.shape != (pattern.nnz, b.shape[1]):
        raise ValueError(
            f"values must have shape [{pattern.nnz}, {b.shape[1]}] (entries, heads), got "
            f"{tuple(values.shape)}"
        )
    if values.device != b.device:
        raise ValueError(f"values is on {values.device} but b is on {b.device}")
    b = b if b.stride(-1) == 1 else b.contiguous()
    return _edge_spmm_eager(values, b, pattern.id, bool(transposed))


def sddmm(x: Tensor, y: Tensor, pattern: Pattern) -> Tensor:
    """s[e, h] = <x[i, h], y[j, h]> for every entry e = (i, j) of the pattern: x
    [num_rows, H, D], y [num_cols, H, D], s [E, H] in entry order. Differentiable in both."""
    _check_pattern(pattern)
    _check("x", x, pattern.num_rows)
    _check("y", y, pattern.num_cols)
    if y.dtype != x.dtype or y.shape[1:] != x.shape[1:] or y.device != x.device:
        raise ValueError("x and y must have one dtype, device, head count and width")
    x, y = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, y))
    return _sddmm_eager(x, y, pattern.id)


def edge_softmax(scores: Tensor, pattern: Pattern) -> Tensor:
    """The softmax of per-edge scores ([E, H] in entry order) over each row's entries (each
    target's incoming edges, as PyG's ``softmax(src, index)``); empty rows have no entries.
    Its gradient is deterministic."""
    _check_pattern(pattern)
    if scores.dim() != 2 or scores.shape[0] != pattern.nnz:
        raise ValueError(
            f"scores must have shape [{pattern.nnz}, heads] (entries, heads), got "
            f"{tuple(scores.shape)}"
        )
    return _edge_softmax_eager(scores, pattern.id)


def edge_scores(dst: Tensor, src: Tensor, pattern: Pattern) -> Tensor:
    """s[e, h] = dst[i, h] + src[j, h] for every entry e = (i, j): dst [num_rows, H], src
    [num_cols, H] (GAT's per-node attention terms). Its gradient is deterministic."""
    _check_pattern(pattern)
    if dst.dim() != 2 or src.dim() != 2 or dst.shape[1] != src.shape[1]:
        raise ValueError(
            f"dst and src must be [nodes, heads] with one head count, got {tuple(dst.shape)} and "
            f"{tuple(src.shape)}"
        )
    if dst.shape[0] != pattern.num_rows or src.shape[0] != pattern.num_cols:
        raise ValueError(
            f"dst must have {pattern.num_rows} rows and src {pattern.num_cols} (the pattern's "
            f"sides), got {dst.shape[0]} and {src.shape[0]}"
        )
    return _edge_scores_eager(dst, src, pattern.id)
