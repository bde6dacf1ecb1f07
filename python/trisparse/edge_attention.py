"""TransformerConv's attention with edge features, fused (CUDA kernels or the CPU engine): per head,
the score of edge (i <- j) with features a is scale q_i . k_j + r_i . a (r_i = scale W_e^T q_i for
PyG's layer), the softmax runs over each target's incoming edges (every copy of a repeated pair its
own term), and the op returns out_i = sum alpha v_j and out_edge_i = sum alpha a, so that PyG's
message sum is out + W_e out_edge: no [E, H, C] message and no [E, H] score is stored in the
forward. The backward recomputes the weights from the saved lse; every sum has a fixed order.

:func:`edge_gat_attention` is GAT's attention over the same multigraph (PyG's GATConv with
repeated edges and edge features): additive scores LeakyReLU(a_dst_i + a_src_j + a_edge_e).
The ops: ``trisparse.ops.edge_attention``; their autograd: ``trisparse.autograd.edge_attention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C, _tensors
from .autograd.edge_attention import (
    _forward_eager,
    _gat_forward_eager,
    _neighbor_sum_eager,
)
from .pattern import Pattern

__all__ = ["edge_attention", "edge_attention_supported", "edge_gat_attention", "neighbor_sum"]


def _factor_dtype(t: Tensor) -> torch.dtype:
    """The dtype of per-edge factors and score terms beside t: float32 (the CUDA kernels), float64
    where the CPU engine runs in float64."""
    return torch.float64 if t.is_cpu and t.dtype == torch.float64 else torch.float32


def _dropout_args(pattern: Pattern, like: Tensor, p: float, pyg_dropout: bool) -> tuple:
    """The ops' dropout arguments (keep, dropout, dropout_state). pyg_dropout: factors per (input
    edge, head) in the input's edge order (0 or 1 / (1 - p)) drawn as F.dropout draws them over
    PyG's [E, H] weights, read by the kernels; else drawn in the kernels (Philox4x32-10, input
    edge u's word of head h: trisparse/core/dropout.hpp) from a {seed, offset} state taken
    from torch's generator of the device, and regenerated in the backward."""
    if not (0.0 <= p < 1.0 or (pyg_dropout and p == 1.0)):
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    if p == 0.0:
        return None, 0.0, None
    if pyg_dropout:
        # float32 factors for the kernels; float64 for the CPU engine's float64 (1 / (1 - p) exact)
        dtype = _factor_dtype(like)
        ones = torch.ones(pattern.num_edges, like.shape[1], device=like.device, dtype=dtype)
        return F.dropout(ones, p=p, training=True), 0.0, None
    return None, p, _tensors.new_dropout_state(p, like.device)


def edge_gat_attention(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    pattern: Pattern,
    negative_slope: float = 0.2,
    a_edge: Tensor | None = None,
    dropout: float = 0.0,
    pyg_dropout: bool = False,
    return_lse: bool = False,
):
    """out[i, h] = sum over the input pairs e = (i, j) of softmax_e(LeakyReLU(a_dst[i, h] + a_src[j,
    h] + a_edge[e, h])) x[j, h], each copy of a repeated pair its own term: GAT's attention (PyG's
    GATConv) over a multigraph with edge features, fused (CUDA or the CPU). x [num_cols, H, C],
    a_src [num_cols, H], a_dst [num_rows, H], a_edge [E, H] (one row per input pair, in the input's
    order) or None. `dropout`: attention dropout's probability (applied as given: pass 0 in eval
    mode), one draw per (input edge, head), made in the kernels (regenerated in the backward:
    nothing [E, H] is stored) or, with `pyg_dropout`, drawn as PyG's F.dropout over its [E, H]
    weights (the same factors as PyG's layer given torch's seed). Differentiable in all four;
    deterministic given the draws. ``return_lse``: also each row's log-sum-exp of the scores
    [num_rows, H] (float32; float64 for float64 x on the CPU; -inf on rows without pairs; not
    differentiable; dropout leaves it alone)."""
    _check_device(x)
    heads = x.shape[1]
    for name, t, rows in (
        ("a_src", a_src, pattern.num_cols),
        ("a_dst", a_dst, pattern.num_rows),
    ):
        if t.shape != (rows, heads):
            raise ValueError(f"{name} must be [{rows}, {heads}], got {list(t.shape)}")
    if a_edge is not None and (a_edge.dim() != 2 or a_edge.shape[1] != heads):
        raise ValueError(f"a_edge must be [edges, {heads}], got {list(a_edge.shape)}")
    terms = {"dtype": _factor_dtype(x)}
    keep, p, state = _dropout_args(pattern, x, float(dropout), pyg_dropout)
    out, lse = _gat_forward_eager(
        _operand(x),
        a_src.to(**terms).contiguous(),
        a_dst.to(**terms).contiguous(),
        None if a_edge is None else a_edge.to(**terms).contiguous(),
        keep,
        pattern.id,
        float(negative_slope),
        p,
        state,
    )
    return (out, lse.detach()) if return_lse else out


def _check_device(t: Tensor) -> None:
    if not (t.is_cuda or t.is_cpu):
        raise ValueError(f"the multigraph attention runs on the CPU and on CUDA, not on {t.device}")


def _operand(t: Tensor) -> Tensor:
    """t as the kernels read it: as it is if contiguous, or a view whose rows and heads are
    16-byte aligned (a slice of a fused projection's output); else a contiguous copy."""
    return t if t.is_contiguous() or _tensors.aligned16(t) else t.contiguous()


def edge_attention_supported(pattern: Pattern, q: Tensor, features: int = 0) -> bool:
    """True where :func:`edge_attention` runs fused: CPU tensors (any heads and features), or CUDA
    tensors with heads of 4 * 2^k <= 128 (or 256) channels and at most 8 features a lane."""
    if pattern.num_rows >= 2**31 or pattern.num_cols >= 2**31:
        return False
    if q.is_cpu:
        return True
    if not q.is_cuda:
        return False
    C = q.shape[-1]
    if not _C.EdgeAttentionPlan.supports(C):
        return False
    try:
        _C.EdgeAttentionPlan.feature_width(C, features)
    except ValueError:
        return False
    return True


def edge_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern,
    scale: float,
    r: Tensor | None = None,
    a: Tensor | None = None,
    dropout: float = 0.0,
    pyg_dropout: bool = False,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(out [num_rows, H, C], out_edge [num_rows, H, F] or None; in q's dtype): the attention over
    the pattern's input pairs (each copy of a repeated pair a separate term) with scores
    scale q_i . k_j + r_i . a_e, out = sum alpha v_j and out_edge = sum alpha a_e. q [num_rows, H,
    C], k and v [num_cols, H, C], r [num_rows, H, F] and a [E, F] (one row per input pair, in the
    input's order) in q's dtype, on CUDA or the CPU (:func:`edge_attention_supported`; the CPU
    engine in float64 for float64 tensors, else fp32). `dropout`, `pyg_dropout`: attention dropout
    on the weights of both sums (as :func:`edge_gat_attention`'s). `bias`: an additive score bias
    per input pair, [E, H] or [E] (shared by the heads), rounded to q's dtype: the score term with
    H more features, r_i one-hot per head and a_e the bias (so `features` H more where
    :func:`edge_attention_supported` is asked). Differentiable in all six; deterministic given
    the draws."""
    _check_device(q)
    if (r is None) != (a is None):
        raise ValueError("r and a come together (the edge features' score term) or not at all")
    features = 0 if r is None else r.shape[-1]
    if r is not None and (a.dim() != 2 or a.shape[1] != features):
        raise ValueError(f"a must be [edges, {features}] (r's feature count), got {list(a.shape)}")
    if bias is not None:
        r, a = _with_bias(q, r, a, bias, pattern.num_edges)
    total = 0 if r is None else r.shape[-1]  # the features and the bias's columns
    width = _C.EdgeAttentionPlan.feature_width(q.shape[-1], total) if q.is_cuda else total
    if r is not None:
        if width != total:  # zero columns up to the kernels' width
            r = F.pad(r, (0, width - total))
            a = F.pad(a, (0, width - total))
        r, a = r.contiguous(), a.contiguous()
    keep, p, state = _dropout_args(pattern, q, float(dropout), pyg_dropout)
    out, out_edge, _lse = _forward_eager(
        _operand(q),
        _operand(k),
        _operand(v),
        r,
        a,
        keep,
        pattern.id,
        float(scale),
        p,
        state,
    )
    return out, (None if features == 0 else out_edge[..., :features])


def _with_bias(q: Tensor, r, a, bias: Tensor, edges: int) -> tuple[Tensor, Tensor]:
    """The score term's r and a with a per-pair bias [E, H] or [E] appended as H features: r_i's
    one-hot head selects a_e's column of that head. Raises TypeError/ValueError naming bias."""
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        raise TypeError(f"bias must be a float tensor, got {getattr(bias, 'dtype', type(bias))}")
    heads = q.shape[1]
    if tuple(bias.shape) not in ((edges,), (edges, heads)):
        raise ValueError(
            f"bias must be [E] or [E, heads] = [{edges}, {heads}] (one row per input pair), got "
            f"{list(bias.shape)}"
        )
    if bias.device != q.device:
        raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
    b = (bias if bias.dim() == 2 else bias[:, None].expand(edges, heads)).to(q.dtype)
    one_hot = torch.eye(heads, dtype=q.dtype, device=q.device).expand(q.shape[0], heads, heads)
    if r is None:
        return one_hot, b
    return torch.cat([r, one_hot], -1), torch.cat([a, b.to(a.dtype)], -1)


def _sum_width(channels: int) -> int:
    """The channels the CUDA neighbour sum takes for a head of `channels`: 4 * 2^k up to 128, then
    256; wider heads run in slices of 128."""
    width = 4
    while width < channels and width < 128:
        width *= 2
    return 256 if 128 < channels <= 256 else width


def neighbor_sum(x: Tensor, pattern: Pattern, transposed: bool = False) -> Tensor:
    """out_i = sum over the pattern's input pairs (i <- j) of x_j: the unweighted aggregation of
    message passing (PyG's ``aggr="add"`` over ``pattern.edge_index()``, each copy of a repeated
    pair counted), x [num_cols, C] or [num_cols, H, C], out [num_rows, ...] in x's dtype;
    ``transposed``: out_j = sum over the pairs (i <- j) of x_i. A GCN layer's normalised
    aggregation is d^-1/2 ⊙ neighbor_sum(d^-1/2 ⊙ x) (:class:`trisparse.nn.GCNConv` given a
    Pattern). On CUDA (f16, bf16, f32) the multigraph kernels, f32 sums in a fixed order, 64-bit
    positions: a pattern of billions of entries (:meth:`Pattern.from_sorted_csr`,
    :meth:`Pattern.undirected`) runs in place; the transposed sum groups the pairs by source once
    (a sort), except for a symmetric pattern (:meth:`Pattern.undirected`'s), whose transpose is
    itself. On the CPU index_add in the pairs' order. Differentiable in x, deterministic."""
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a trisparse.Pattern, got {type(pattern).__name__}")
    if not isinstance(x, Tensor) or x.dtype not in _tensors.FLOAT_DTYPES:
        raise TypeError("x must be a float16, bfloat16, float32 or float64 tensor")
    rows = pattern.num_rows if transposed else pattern.num_cols
    if x.dim() not in (2, 3) or x.shape[0] != rows:
        raise ValueError(
            f"x must be [{rows}, C] or [{rows}, H, C] (the pattern's "
            f"{'rows' if transposed else 'columns'}), got {list(x.shape)}"
        )
    flat = x.dim() == 2
    h = x.unsqueeze(1) if flat else x
    if h.is_cuda:
        if h.dtype == torch.float64:
            raise TypeError("neighbor_sum on CUDA takes float16, bfloat16 or float32 x")
        c = h.shape[2]
        if c > 256:  # slices of 128 channels (one pass over the pattern each)
            out = torch.cat(
                [neighbor_sum(h[..., a : a + 128], pattern, transposed) for a in range(0, c, 128)],
                dim=2,
            )
            return out.squeeze(1) if flat else out
        width = _sum_width(c)
        if width != c:
            h = F.pad(h, (0, width - c))
        h = h if _tensors.aligned16(h) else h.contiguous()
        out = _neighbor_sum_eager(h, pattern.id, bool(transposed))[..., :c]
    else:
        out = _neighbor_sum_eager(h.contiguous(), pattern.id, bool(transposed))
    return out.squeeze(1) if flat else out
