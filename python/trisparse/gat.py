"""GAT's attention fused over a Pattern: the scores LeakyReLU(a_dst[i] + a_src[j]), their softmax
over each target's incoming edges and the aggregation of the sources' features in one pass, with
no [E, H] score or [E, H, C] message tensor; the backward is one pass over the transposed pattern
and a fixed-order row sum, so the gradients are deterministic. The ops: ``trisparse.ops.gat``;
their autograd: ``trisparse.autograd.gat``."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _tensors
from .autograd.gat import _gat_eager
from .pattern import Pattern

__all__ = ["gat_attention"]


def gat_attention(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    pattern: Pattern,
    negative_slope: float = 0.2,
    keep: Tensor | None = None,
    keep_order: Tensor | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """out[i, h] = sum over the pattern's entries (i, j) of softmax_j(LeakyReLU(a_dst[i, h] +
    a_src[j, h])) * keep[e, h] * x[j, h]: GAT's attention (PyG's GATConv between its linear map
    and the head concat), fused. x [num_cols, H, C] (the sources' W x_j, C <= 512 on CUDA),
    a_src [num_cols, H], a_dst [num_rows, H] (the per-node attention terms), keep [E, H]
    (attention dropout's factors: 0 or 1 / (1 - p)) or None, in the pattern's entry order or, with
    ``keep_order`` (int64 [E]), entry e's in row keep_order[e] (a mask drawn in the input's edge
    order serves as it is). Or `dropout` > 0 (applied as given: pass 0 in eval mode): attention
    dropout drawn in the kernels, one draw per (edge, head) keyed by the entry's input edge
    (``keep_order[e]``, or e) from a seed taken from torch's generator, regenerated in the
    backward (nothing [E, H] is stored; the draws of :func:`trisparse.edge_gat_attention` for the
    same input edges). Differentiable in x, a_src and a_dst; the scores are computed in float32."""
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a trisparse.Pattern, got {type(pattern).__name__}")
    if not isinstance(x, Tensor) or x.dtype not in _tensors.FLOAT_DTYPES or x.dim() != 3:
        raise TypeError(
            "x must be a float16, bfloat16, float32 or float64 [nodes, heads, C] tensor"
        )
    heads = x.shape[1]
    for name, t, rows in (
        ("x", x, pattern.num_cols),
        ("a_src", a_src, pattern.num_cols),
        ("a_dst", a_dst, pattern.num_rows),
    ):
        if t.shape[0] != rows or t.shape[1] != heads or (t is not x and t.dim() != 2):
            raise ValueError(
                f"{name} must have {rows} rows and {heads} heads (x [num_cols, H, C], a_src "
                f"[num_cols, H], a_dst [num_rows, H]), got {tuple(t.shape)}"
            )
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if keep is not None and (keep.shape != (pattern.nnz, heads) or keep.device != x.device):
        raise ValueError(
            f"keep must be [{pattern.nnz}, {heads}] (entries, heads) on {x.device}, got "
            f"{tuple(keep.shape)} on {keep.device}"
        )
    dropout = float(dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if dropout > 0 and keep is not None:
        raise ValueError("give keep (factors drawn outside) or dropout (drawn here), not both")
    if keep_order is not None:
        if keep is None and dropout == 0:
            raise ValueError("keep_order orders keep's rows (or keys dropout's draws): pass one")
        if keep_order.shape != (pattern.nnz,) or keep_order.device != x.device:
            raise ValueError(
                f"keep_order must be [{pattern.nnz}] on {x.device}, got "
                f"{tuple(keep_order.shape)} on {keep_order.device}"
            )
        keep_order = keep_order.to(torch.int64).contiguous()
    f32 = torch.float64 if x.dtype == torch.float64 else torch.float32
    out, _lse = _gat_eager(
        x.contiguous(),
        a_src.to(f32).contiguous(),
        a_dst.to(f32).contiguous(),
        None if keep is None else keep.to(f32).contiguous(),
        keep_order,
        pattern.id,
        float(negative_slope),
        dropout,
        _tensors.new_dropout_state(dropout, x.device),
    )
    return out
