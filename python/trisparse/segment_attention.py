"""Attention within segments: the rows of a packed batch of short sequences (the graphs of a PyG
mini-batch) named by a sorted id per row (PyG's ``batch``); each row attends every row of its own
segment. The block-diagonal pattern of :meth:`trisparse.Pattern.from_batch`, with no pattern built:
on CUDA the kernels read the ids themselves (``segment_attention_plan``), so a new mini-batch costs
no host work; elsewhere, and for float32 or other head dims, the fused attention over that
pattern. The ops: ``trisparse.ops.segment_attention``; their autograd:
``trisparse.autograd.segment_attention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C, _tensors
from .attention import sparse_attention
from .autograd.segment_attention import _call
from .edge import edge_softmax, edge_spmm, sddmm
from .pattern import Pattern, check_batch

__all__ = ["segment_attention", "segment_attention_supported"]


_HALF = (torch.float16, torch.bfloat16)


# The head dims this build's kernels take (asked once: no extension call inside a traced graph).
_DIMS = frozenset(d for d in (16, 32, 64, 128) if _C.segment_attention_supports(d))


def segment_attention_supported(q: Tensor) -> bool:
    """Whether :func:`segment_attention` runs its own kernels for q ([rows, heads, channels]): CUDA,
    float16 or bfloat16, 16, 32, 64 or 128 channels a head."""
    return q.is_cuda and q.dtype in _HALF and q.shape[-1] in _DIMS


def segment_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: Tensor | None,
    scale: float | None = None,
    assume_sorted: bool = False,
    dropout_p: float = 0.0,
) -> Tensor:
    """out[i] = softmax_j(scale q[i] . k[j]) v[j] over the rows j with batch[j] == batch[i]: q, k,
    v [rows, heads, channels], ``batch`` [rows] sorted int64 or int32 ids (PyG's mini-batch vector;
    None: one segment), ``scale`` default 1/sqrt(channels). Differentiable in q, k, v; the
    gradients are the same bits on every run. On CUDA with float16/bfloat16 and 16, 32, 64 or 128
    channels a head, the segment kernels (no pattern, no host work per batch); elsewhere
    :func:`trisparse.sparse_attention` over :meth:`Pattern.from_batch`. ``assume_sorted``: skip
    the sortedness check (a device round trip) for a batch already checked.

    ``dropout_p``: attention dropout, as ``F.scaled_dot_product_attention``'s (apply it while
    training only): each weight is kept with probability 1 - p and scaled by 1 / (1 -
    p). The segment kernels draw it themselves from a counter-based generator (Philox4x32-10 per
    query, key and head, 16-bit draws: p to 1 / 65,536; ``trisparse/core/dropout.hpp``) seeded
    from torch's generator of q's device, and regenerate it in the backward: nothing [pairs,
    heads] is stored, the result is the same bits for the same seed. Elsewhere the weights are dropped by ``F.dropout`` (the same
    distribution, other draws)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [rows, heads, channels] tensor")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    rows = q.shape[0]
    if batch is None:
        batch = torch.zeros(rows, dtype=torch.int64, device=q.device)
    elif not assume_sorted and not torch.compiler.is_compiling():
        check_batch(batch, rows)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    batch = batch.contiguous()
    scale = _tensors.resolve_scale(scale, q.shape[-1])
    if segment_attention_supported(q) and batch.device == q.device:
        state = _tensors.new_dropout_state(dropout_p, q.device)
        out, _ = _call(q, k, v, batch, scale, float(dropout_p), state)
        return out
    pattern = Pattern.from_batch(batch, rows)
    if dropout_p > 0:
        alpha = edge_softmax(scale * sddmm(q, k, pattern), pattern)
        return edge_spmm(F.dropout(alpha, p=dropout_p, training=True), v, pattern)
    return sparse_attention(q, k, v, pattern, scale=scale)
