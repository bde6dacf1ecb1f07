"""Sparse attention over a Pattern, :func:`sparse_attention`: the arguments checked, then the op
(``trisparse.ops.attention``: forward and backward with their fakes; its autograd in
``trisparse.autograd.attention``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _C, _tensors
from .autograd.attention import _forward_eager
from .autograd.edge_attention import _forward_eager as _edge_forward_eager
from .edge_attention import _operand, edge_attention_supported
from .ops.attention import (
    _bias_dtype,
)
from .pattern import Pattern

__all__ = ["sparse_attention"]

# Entry counts from which a CUDA call runs the multigraph kernels (64-bit positions; the fused 3S
# and row-wise plans index entries in 32 bits).
_WIDE_ENTRIES = 2**31 - 1


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
    bias: Tensor | None = None,
):
    """out[i] = sum over the pattern's entries (i, j) of softmax_j(scale q_i . k_j + bias_ij) v_j.

    ``q``: [num_rows, H, D] (targets), ``k``: [num_cols, H, D], ``v``: [num_cols, H, Dv] (sources),
    one float dtype; ``pattern``: a :class:`Pattern` or anything :meth:`Pattern.of` takes (then
    rebuilt at every call: build the Pattern once instead). ``scale`` defaults to 1/sqrt(D).
    Rows without entries give zeros. Returns ``out`` [num_rows, H, Dv] in q's dtype, and with
    ``return_lse`` also the per-row log-sum-exp of the scores [num_rows, H] (float32; float64 for
    float64 inputs; -inf on empty rows), which is not differentiable.

    ``bias``: a per-entry additive score bias, [nnz, H] or [nnz] (shared by the heads), float, in
    the pattern's entry order (:meth:`Pattern.entries`; :meth:`Pattern.entries_of_input` maps
    edge_index's order to it), finite. A bias of log(m) counts an entry as m copies (what
    :meth:`Pattern.log_multiplicity` gives for repeated edges); a learned bias (edge encodings,
    Graphormer's spatial biases) gets its gradient dL/dbias, written once per entry (no atomics).
    On CUDA float16/bfloat16 heads of up to 128 channels take the bias on the tensor cores (the
    fused 3S forward and the backward's dq pass); other biased calls run the row-wise kernels
    (float32 math, any float dtype).

    Differentiable in q, k, v and bias (deterministic: the same gradients on every run). On the CPU,
    float16/bfloat16/float32 run the OpenMP engine in float32, float64 the float64 reference; on
    CUDA float16 and bfloat16 run the fused 3S kernel (tensor cores), float32 a row-wise float32
    kernel, and the backward a deterministic two-pass kernel; a pattern of 2^31 entries or more
    (their plans index entries in 32 bits) the multigraph kernels of :func:`edge_attention`
    (64-bit; no bias there).
    """
    if not isinstance(pattern, Pattern):
        pattern = Pattern.of(pattern, num_nodes=k.shape[0] if isinstance(k, Tensor) else None)
    _check_qkv(q, k, v, pattern)
    if bias is not None:
        bias = _checked_bias(bias, q, pattern)
    scale = _tensors.resolve_scale(scale, q.shape[2])
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias)
    )
    dim_v = v.shape[2]
    if q.device.type == "cuda" and pattern.nnz >= _WIDE_ENTRIES:
        return _wide(q, k, v, pattern, scale, return_lse, bias)
    if q.device.type == "cuda":
        q, k, v = _padded_for_cuda(q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    with_lse = bool(return_lse or needs_grad)  # the backward reads it
    out, lse = _forward_eager(q, k, v, bias, pattern.id, float(scale), with_lse, bool(needs_grad))
    out = out if out.shape[2] == dim_v else out[..., :dim_v]
    return (out, lse) if return_lse else out


def _wide(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, scale: float, return_lse, bias):
    """A pattern of 2^31 entries or more on CUDA: the multigraph kernels (trisparse.edge_attention,
    64-bit), which read a pattern not built from pairs in place; each entry once, as here."""
    if bias is not None or pattern.duplicates > 0 or q.shape[2] != v.shape[2]:
        raise ValueError(
            f"a pattern of {pattern.nnz} entries (2^31 or more) runs on CUDA through the multigraph "
            "kernels, which take no bias, repeated pairs or a head dim of v other than q's"
        )
    if not edge_attention_supported(pattern, q):
        raise ValueError(
            f"a pattern of {pattern.nnz} entries (2^31 or more) runs on CUDA through the multigraph "
            f"kernels: heads of 4 * 2^k <= 128 or 256 channels, not {q.shape[2]}"
        )
    out, _edge, lse = _edge_forward_eager(
        _operand(q), _operand(k), _operand(v), None, None, None, pattern.id, float(scale), 0.0, None
    )
    return (out, lse) if return_lse else out


def _checked_bias(bias, q: Tensor, pattern: Pattern) -> Tensor:
    """The bias as the op takes it: float32 (float64 for float64 inputs), on q's device, its last
    dimension contiguous. Raises TypeError/ValueError naming ``bias``."""
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a float tensor, got {bias.dtype}")
    shapes = ((pattern.nnz,), (pattern.nnz, q.shape[1]))
    if torch.compiler.is_compiling() and bias.dim() in (1, 2):
        # A bias made in the traced graph from the pattern (log_multiplicity's counts) has a
        # size the compiler cannot read: stated here, checked when the graph runs.
        torch._check(bias.shape[0] == pattern.nnz)
        torch._check(bias.dim() == 1 or bias.shape[1] == q.shape[1])
    elif tuple(bias.shape) not in shapes:
        raise ValueError(
            f"bias must have shape [nnz] or [nnz, heads] = {list(shapes[0])} or "
            f"{list(shapes[1])} (one value per pattern entry, in entry order), got "
            f"{list(bias.shape)}"
        )
    if bias.device != q.device:
        raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
    bias = bias.to(_bias_dtype(q))
    return bias if bias.dim() == 1 or bias.stride(-1) == 1 else bias.contiguous()


# The fused 3S kernel's head dims in this build (q, k and v share one).
_CUDA_HEAD_DIMS = tuple(_C.cuda_head_dims())


def _padded_for_cuda(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v zero-padded to the fused kernel's next head dim when theirs is not one of its own
    or differs between q and v (zeros change no score and add output columns that are cut off);
    autograd passes through the padding."""
    dim = max(q.shape[2], v.shape[2])
    target = next((d for d in _CUDA_HEAD_DIMS if d >= dim), None)
    if target is None:
        raise ValueError(
            f"on CUDA the head dims must be at most {max(_CUDA_HEAD_DIMS, default=0)} "
            f"(this build's: {_CUDA_HEAD_DIMS}), got {dim}"
        )
    if q.shape[2] == target and v.shape[2] == target:
        return q, k, v
    pad = torch.nn.functional.pad
    return (
        pad(q, (0, target - q.shape[2])),
        pad(k, (0, target - k.shape[2])),
        pad(v, (0, target - v.shape[2])),
    )
