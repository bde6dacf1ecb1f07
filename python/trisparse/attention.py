"""Sparse attention as torch ops (namespace ``trisparse``): forward and backward registered with
torch.library, each with a fake implementation for torch.compile, and autograd registered once."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _tensors
from .pattern import Pattern, _patterns, lookup

__all__ = ["sparse_attention"]


def _algo(t: Tensor) -> str:
    # float64 runs the float64 reference (the gradcheck path); the rest the fastest backend.
    return "reference" if t.dtype == torch.float64 else "automatic"


def _lse_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _lse_shape(q: Tensor, with_lse: bool) -> tuple[int, ...]:
    return (q.shape[0], q.shape[1]) if with_lse else (0,)


def _lse_view(lse: Tensor) -> tuple:
    return _tensors.view(lse.unsqueeze(-1))


@torch.library.custom_op("trisparse::sparse_attention", mutates_args=())
def _forward(
    q: Tensor, k: Tensor, v: Tensor, pattern: int, scale: float, with_lse: bool, gradients: bool
) -> tuple[Tensor, Tensor]:
    """`with_lse`: also write the log-sum-exp (else it comes back empty); `gradients`: build the
    plan with what backward needs."""
    # float32 on CUDA runs row-wise on the device CSR that a plan with gradients holds.
    f32_cuda = q.device.type == "cuda" and q.dtype == torch.float32
    plan = lookup(pattern).plan(q.device, gradients=gradients or f32_cuda)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(_lse_shape(q, with_lse), dtype=_lse_dtype(q))
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(q.shape[1], max(q.shape[2], v.shape[2])), q.device
    )
    plan.run(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view(v),
        _tensors.view(out),
        _lse_view(lse) if with_lse else None,
        scale,
        _algo(q),
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return out, lse


@_forward.register_fake
def _forward_fake(q, k, v, pattern, scale, with_lse, gradients):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(_lse_shape(q, with_lse), dtype=_lse_dtype(q))


@torch.library.custom_op("trisparse::sparse_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    pattern: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    plan = lookup(pattern).plan(q.device, gradients=True)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ws_need = plan.backward_workspace_bytes(q.shape[1], max(q.shape[2], v.shape[2]))
    _owner, ws, ws_bytes = _tensors.workspace(ws_need, q.device)
    plan.backward(
        *(_tensors.view(t) for t in (q, k, v, out)),
        _lse_view(lse) if lse.dim() == 2 else None,
        *(_tensors.view(t) for t in (dout, dq, dk, dv)),
        scale,
        _algo(q),
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return dq, dk, dv


@_backward_op.register_fake
def _backward_fake(q, k, v, out, lse, dout, pattern, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, pattern, scale, _with_lse, gradients = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.pattern, ctx.scale, ctx.gradients = pattern, scale, gradients
    ctx.pattern_object = _patterns.get(pattern)  # held until the backward
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    if not ctx.gradients:
        raise RuntimeError(
            "trisparse.sparse_attention: this forward ran without preparing gradients "
            "(no input required grad when it ran)"
        )
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.trisparse.sparse_attention_backward(
        q, k, v, out, lse, dout, ctx.pattern, ctx.scale
    )
    return dq, dk, dv, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _tensors.FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have shape [nodes, heads, channels], got {tuple(t.shape)}"
            )
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: use one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.shape[0] != pattern.num_rows:
        raise ValueError(
            f"q has {q.shape[0]} rows but the pattern has {pattern.num_rows} target nodes "
            "(a pattern built for another graph?)"
        )
    if k.shape[0] != pattern.num_cols or v.shape[0] != pattern.num_cols:
        raise ValueError(
            f"k and v must have the pattern's {pattern.num_cols} source nodes as rows, got "
            f"{k.shape[0]} and {v.shape[0]} (a pattern built for another graph?)"
        )
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"q, k, v must have one head count, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}"
        )
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k's channels {k.shape[2]} differ from q's {q.shape[2]}")


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern,
    scale: float | None = None,
    return_lse: bool = False,
):
    """out[i] = sum over the pattern's entries (i, j) of softmax_j(scale q_i . k_j) v_j.

    ``q``: [num_rows, H, D] (targets), ``k``: [num_cols, H, D], ``v``: [num_cols, H, Dv] (sources),
    one float dtype; ``pattern``: a :class:`Pattern` or anything :meth:`Pattern.of` takes (then
    rebuilt at every call: build the Pattern once instead). ``scale`` defaults to 1/sqrt(D).
    Rows without entries give zeros. Returns ``out`` [num_rows, H, Dv] in q's dtype, and with
    ``return_lse`` also the per-row log-sum-exp of the scaled scores [num_rows, H] (float32;
    float64 for float64 inputs; -inf on empty rows), which is not differentiable.

    Differentiable in q, k and v (deterministic: the same gradients on every run). On the CPU,
    float16/bfloat16/float32 run the OpenMP engine in float32, float64 the float64 reference; on
    CUDA float16 and bfloat16 run the fused 3S kernel (tensor cores), float32 a row-wise float32
    kernel, and the backward a deterministic two-pass kernel.
    """
    if not isinstance(pattern, Pattern):
        pattern = Pattern.of(pattern, num_nodes=k.shape[0] if isinstance(k, Tensor) else None)
    _check_qkv(q, k, v, pattern)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[2])
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    dim_v = v.shape[2]
    if q.device.type == "cuda":
        q, k, v = _padded_for_cuda(q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    with_lse = bool(return_lse or needs_grad)  # the backward reads it
    out, lse = torch.ops.trisparse.sparse_attention(
        q, k, v, pattern.id, float(scale), with_lse, bool(needs_grad)
    )
    out = out if out.shape[2] == dim_v else out[..., :dim_v]
    return (out, lse) if return_lse else out


_CUDA_HEAD_DIMS = (32, 64, 128, 256)  # the fused 3S kernel's (q, k and v share one)


def _padded_for_cuda(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v zero-padded to the fused kernel's next head dim when theirs is not one of its own
    or differs between q and v (zeros change no score and add output columns that are cut off);
    autograd passes through the padding."""
    dim = max(q.shape[2], v.shape[2])
    target = next((d for d in _CUDA_HEAD_DIMS if d >= dim), None)
    if target is None:
        raise ValueError(f"on CUDA the head dims must be at most 256, got {dim}")
    if q.shape[2] == target and v.shape[2] == target:
        return q, k, v
    pad = torch.nn.functional.pad
    return (
        pad(q, (0, target - q.shape[2])),
        pad(k, (0, target - k.shape[2])),
        pad(v, (0, target - v.shape[2])),
    )
