"""TransformerConv's attention with edge features, fused (CUDA): per head, the score of edge
(i <- j) with features a is scale q_i . k_j + r_i . a (r_i = scale W_e^T q_i for PyG's layer), the
softmax runs over each target's incoming edges (every copy of a repeated pair its own term), and
the op returns out_i = sum alpha v_j and out_edge_i = sum alpha a, so that PyG's message sum is
out + W_e out_edge: no [E, H, C] message and no [E, H] score is stored in the forward. The
backward recomputes the weights from the saved lse; every sum has a fixed order.

:func:`edge_gat_attention` is GAT's attention over the same multigraph (PyG's GATConv with
repeated edges and edge features): additive scores LeakyReLU(a_dst_i + a_src_j + a_edge_e)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C, _tensors
from ._eager import eager_autograd
from .pattern import Pattern, lookup

__all__ = ["edge_attention", "edge_attention_supported", "edge_gat_attention"]


def _rows(t: Tensor | None) -> tuple | None:
    return None if t is None else _tensors.view(t)


def _keep(keep: Tensor | None) -> tuple | None:
    """[E, H] keep factors as the plan's [E, H, 1] view."""
    return None if keep is None else _tensors.view2(keep)


def _dropout_factors(pattern: Pattern, like: Tensor, p: float) -> Tensor | None:
    """Attention dropout's factors, one per (input edge, head) in the input's edge order (0 or
    1 / (1 - p), as F.dropout draws them over PyG's [E, H] weights); None for p = 0."""
    if p == 0.0:
        return None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {p}")
    ones = torch.ones(pattern.num_edges, like.shape[1], device=like.device, dtype=torch.float32)
    return F.dropout(ones, p=p, training=True)


def _edge_rows(a: Tensor | None) -> tuple | None:
    """[E, F] edge features as the [E, 1, F] view the plan takes."""
    return None if a is None else _tensors.view(a.unsqueeze(1))


@torch.library.custom_op("trisparse::edge_attention", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor | None,
    a: Tensor | None,
    keep: Tensor | None,
    pattern: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [rows, H, C] in q's dtype, out_edge [rows, H, F] float32, lse [rows, H] float32);
    `keep`: [E, H] float32 factors on the weights (attention dropout) or None."""
    p = lookup(pattern)
    rows, heads = p.num_rows, q.shape[1]
    out = q.new_empty(rows, heads, q.shape[2])
    out_edge = q.new_empty(rows, heads, 0 if r is None else r.shape[2], dtype=torch.float32)
    lse = q.new_empty(rows, heads, dtype=torch.float32)
    p.edge_attention_plan(q.device).forward(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view(v),
        _rows(r),
        _edge_rows(a),
        _tensors.view(out),
        None if r is None else _tensors.view(out_edge),
        _tensors.view2(lse),
        _keep(keep),
        scale,
        _tensors.stream(q.device),
    )
    return out, out_edge, lse


@_forward.register_fake
def _forward_fake(q, k, v, r, a, keep, pattern, scale):
    p = lookup(pattern)
    rows, heads = p.num_rows, q.shape[1]
    return (
        q.new_empty(rows, heads, q.shape[2]),
        q.new_empty(rows, heads, 0 if r is None else r.shape[2], dtype=torch.float32),
        q.new_empty(rows, heads, dtype=torch.float32),
    )


@torch.library.custom_op("trisparse::edge_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor | None,
    a: Tensor | None,
    keep: Tensor | None,
    out: Tensor,
    out_edge: Tensor,
    lse: Tensor,
    dout: Tensor,
    dout_edge: Tensor,
    pattern: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dr, da), float32 (dr and da empty without edge features)."""
    p = lookup(pattern)
    plan = p.edge_attention_plan(q.device)
    f32 = {"dtype": torch.float32}
    dq, dk, dv = (torch.empty(t.shape, device=t.device, **f32) for t in (q, k, v))
    edged = r is not None
    dr = torch.empty(r.shape if edged else (0,), device=q.device, **f32)
    da = torch.empty(a.shape if edged else (0,), device=q.device, **f32)
    _owner, ws, ws_bytes = _tensors.workspace(plan.workspace_bytes(q.shape[1]), q.device)
    plan.backward(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view(v),
        _rows(r),
        _edge_rows(a),
        _tensors.view(out),
        _tensors.view(out_edge) if edged else None,
        _tensors.view2(lse),
        _tensors.view(dout),
        _tensors.view(dout_edge) if edged else None,
        _tensors.view(dq),
        _tensors.view(dk),
        _tensors.view(dv),
        _tensors.view(dr) if edged else None,
        _edge_rows(da) if edged else None,
        _keep(keep),
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return dq, dk, dv, dr, da


@_backward_op.register_fake
def _backward_fake(q, k, v, r, a, keep, out, out_edge, lse, dout, dout_edge, pattern, scale):
    f32 = {"dtype": torch.float32}
    edged = r is not None
    return (
        torch.empty_like(q, **f32),
        torch.empty_like(k, **f32),
        torch.empty_like(v, **f32),
        torch.empty_like(r, **f32) if edged else q.new_empty(0, **f32),
        torch.empty_like(a, **f32) if edged else q.new_empty(0, **f32),
    )


def _setup(ctx, inputs, output):
    q, k, v, r, a, keep, pattern, scale = inputs
    out, out_edge, lse = output
    ctx.save_for_backward(q, k, v, r, a, keep, out, out_edge, lse)
    ctx.pattern, ctx.scale = pattern, scale
    ctx.held = lookup(pattern)  # alive until the backward, if the caller dropped it


def _backward(ctx, dout, dout_edge, _dlse):
    q, k, v, r, a, keep, out, out_edge, lse = ctx.saved_tensors
    dout = dout.to(out.dtype).contiguous()
    if dout_edge is None:
        dout_edge = torch.zeros_like(out_edge)
    dout_edge = dout_edge.float().contiguous()
    dq, dk, dv, dr, da = torch.ops.trisparse.edge_attention_backward(
        q, k, v, r, a, keep, out, out_edge, lse, dout, dout_edge, ctx.pattern, ctx.scale
    )
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    grads += [None, None] if r is None else [dr.to(r.dtype), da.to(a.dtype)]
    return (*grads, None, None, None)


_forward.register_autograd(_backward, setup_context=_setup)
_forward_eager = eager_autograd(_forward, _setup, _backward)


@torch.library.custom_op("trisparse::edge_gat", mutates_args=())
def _gat_forward(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    a_edge: Tensor | None,
    keep: Tensor | None,
    pattern: int,
    negative_slope: float,
) -> tuple[Tensor, Tensor]:
    """(out [rows, H, C] in x's dtype, lse [rows, H] float32); `keep` as edge_attention's."""
    p = lookup(pattern)
    out = x.new_empty(p.num_rows, x.shape[1], x.shape[2])
    lse = x.new_empty(p.num_rows, x.shape[1], dtype=torch.float32)
    p.edge_attention_plan(x.device).gat_forward(
        _tensors.view(x),
        _tensors.view2(a_src),
        _tensors.view2(a_dst),
        _tensors.view2(a_edge),
        _tensors.view(out),
        _tensors.view2(lse),
        _keep(keep),
        negative_slope,
        _tensors.stream(x.device),
    )
    return out, lse


@_gat_forward.register_fake
def _gat_forward_fake(x, a_src, a_dst, a_edge, keep, pattern, negative_slope):
    p = lookup(pattern)
    return (
        x.new_empty(p.num_rows, x.shape[1], x.shape[2]),
        x.new_empty(p.num_rows, x.shape[1], dtype=torch.float32),
    )


@torch.library.custom_op("trisparse::edge_gat_backward", mutates_args=())
def _gat_backward_op(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    a_edge: Tensor | None,
    keep: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    pattern: int,
    negative_slope: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx float32, da_src, da_dst, da_edge: empty without a_edge)."""
    p = lookup(pattern)
    plan = p.edge_attention_plan(x.device)
    dx = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    da_src, da_dst = torch.empty_like(a_src), torch.empty_like(a_dst)
    da_edge = torch.empty_like(a_edge) if a_edge is not None else a_src.new_empty(0)
    _owner, ws, ws_bytes = _tensors.workspace(plan.workspace_bytes(x.shape[1]), x.device)
    plan.gat_backward(
        _tensors.view(x),
        _tensors.view2(a_src),
        _tensors.view2(a_dst),
        _tensors.view2(a_edge),
        _tensors.view(out),
        _tensors.view2(lse),
        _tensors.view(dout),
        _tensors.view(dx),
        _tensors.view2(da_src),
        _tensors.view2(da_dst),
        None if a_edge is None else _tensors.view2(da_edge),
        _keep(keep),
        negative_slope,
        _tensors.stream(x.device),
        ws,
        ws_bytes,
    )
    return dx, da_src, da_dst, da_edge


@_gat_backward_op.register_fake
def _gat_backward_fake(x, a_src, a_dst, a_edge, keep, out, lse, dout, pattern, negative_slope):
    return (
        torch.empty_like(x, dtype=torch.float32),
        torch.empty_like(a_src),
        torch.empty_like(a_dst),
        torch.empty_like(a_edge) if a_edge is not None else a_src.new_empty(0),
    )


def _gat_setup(ctx, inputs, output):
    x, a_src, a_dst, a_edge, keep, pattern, negative_slope = inputs
    out, lse = output
    ctx.save_for_backward(x, a_src, a_dst, a_edge, keep, out, lse)
    ctx.pattern, ctx.negative_slope = pattern, negative_slope
    ctx.held = lookup(pattern)


def _gat_backward(ctx, dout, _dlse):
    x, a_src, a_dst, a_edge, keep, out, lse = ctx.saved_tensors
    dx, da_src, da_dst, da_edge = torch.ops.trisparse.edge_gat_backward(
        x,
        a_src,
        a_dst,
        a_edge,
        keep,
        out,
        lse,
        dout.to(out.dtype).contiguous(),
        ctx.pattern,
        ctx.negative_slope,
    )
    da_edge = None if a_edge is None else da_edge
    return dx.to(x.dtype), da_src, da_dst, da_edge, None, None, None


_gat_forward.register_autograd(_gat_backward, setup_context=_gat_setup)
_gat_forward_eager = eager_autograd(_gat_forward, _gat_setup, _gat_backward)


def edge_gat_attention(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor,
    pattern: Pattern,
    negative_slope: float = 0.2,
    a_edge: Tensor | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """out[i, h] = sum over the input pairs e = (i, j) of softmax_e(LeakyReLU(a_dst[i, h] +
    a_src[j, h] + a_edge[e, h])) x[j, h], each copy of a repeated pair its own term: GAT's
    attention (PyG's GATConv) over a multigraph with edge features, fused on CUDA. x [num_cols,
    H, C], a_src [num_cols, H], a_dst [num_rows, H], a_edge [E, H] (one row per input pair, in
    the input's order) or None. `dropout`: attention dropout's probability (applied as given:
    pass 0 in eval mode), one draw per (input edge, head) as PyG's F.dropout over its [E, H]
    weights. Differentiable in all four; deterministic given the draws."""
    _check_cuda(x)
    heads = x.shape[1]
    for name, t, rows in (
        ("a_src", a_src, pattern.num_cols),
        ("a_dst", a_dst, pattern.num_rows),
    ):
        if t.shape != (rows, heads):
            raise ValueError(f"{name} must be [{rows}, {heads}], got {list(t.shape)}")
    if a_edge is not None and (a_edge.dim() != 2 or a_edge.shape[1] != heads):
        raise ValueError(f"a_edge must be [edges, {heads}], got {list(a_edge.shape)}")
    f32 = {"dtype": torch.float32}
    out, _lse = _gat_forward_eager(
        x.contiguous(),
        a_src.to(**f32).contiguous(),
        a_dst.to(**f32).contiguous(),
        None if a_edge is None else a_edge.to(**f32).contiguous(),
        _dropout_factors(pattern, x, float(dropout)),
        pattern.id,
        float(negative_slope),
    )
    return out


def _check_cuda(t: Tensor) -> None:
    if not t.is_cuda:
        raise ValueError(
            f"the multigraph kernels run on CUDA tensors, got one on {t.device} (on the CPU, "
            "trisparse.nn's layers take the per-edge ops: sddmm, edge_softmax, edge_spmm)"
        )


def edge_attention_supported(pattern: Pattern, q: Tensor, features: int = 0) -> bool:
    """True where :func:`edge_attention` runs fused: CUDA tensors, heads of 4 * 2^k <= 128 (or
    256) channels and at most 8 features a lane."""
    if not q.is_cuda or pattern.num_rows >= 2**31 or pattern.num_cols >= 2**31:
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
) -> tuple[Tensor, Tensor | None]:
    """(out [num_rows, H, C], out_edge [num_rows, H, F] or None): the attention over the
    pattern's input pairs (each copy of a repeated pair a separate term) with scores
    scale q_i . k_j + r_i . a_e, out = sum alpha v_j and out_edge = sum alpha a_e. q [num_rows, H,
    C], k and v [num_cols, H, C], r [num_rows, H, F] and a [E, F] (one row per input pair, in the
    input's order) in q's dtype, on CUDA (:func:`edge_attention_supported`). `dropout`: attention
    dropout's probability on the weights of both sums (as :func:`edge_gat_attention`'s).
    Differentiable in all five; deterministic given the draws."""
    _check_cuda(q)
    if (r is None) != (a is None):
        raise ValueError("r and a come together (the edge features' score term) or not at all")
    features = 0 if r is None else r.shape[-1]
    width = _C.EdgeAttentionPlan.feature_width(q.shape[-1], features)
    if r is not None:
        if a.dim() != 2 or a.shape[1] != features:
            raise ValueError(
                f"a must be [edges, {features}] (r's feature count), got {list(a.shape)}"
            )
        if width != features:  # zero columns up to the kernels' width
            r = F.pad(r, (0, width - features))
            a = F.pad(a, (0, width - features))
        r, a = r.contiguous(), a.contiguous()
    out, out_edge, _lse = _forward_eager(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        r,
        a,
        _dropout_factors(pattern, q, float(dropout)),
        pattern.id,
        float(scale),
    )
    return out, (None if r is None else out_edge[..., :features])
