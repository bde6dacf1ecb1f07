"""Block-sparse attention for sequences: a mask of G x G blocks (ours, or FlexAttention's
BlockMask), on [B, H, N, D] tensors as PyTorch's SDPA and flex_attention take them. The masks:
``trisparse.block_mask``; the ops: ``trisparse.ops.block_sparse``; their autograd:
``trisparse.autograd.block_sparse``."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from . import _tensors
from .autograd.block_sparse import _forward_eager
from .block_mask import (
    BlockImportance,
    BlockMask,
    _folded_id,
    _packed,
    _topk_on_plan,
)
from .ops.block_sparse import longest_blocks

__all__ = ["BlockImportance", "BlockMask", "block_sparse_attention", "topk_block_mask"]


def _offsets(cu: Any, name: str) -> list[int]:
    """cu_seqlens as a list of ints (a tensor on a GPU is read back: one synchronisation)."""
    if isinstance(cu, Tensor):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor or a list of ints")
        cu = cu.tolist()
    if not isinstance(cu, (list, tuple)) or not all(isinstance(x, int) for x in cu):
        raise TypeError(f"{name} must be a 1-D int32 or int64 tensor or a list of ints")
    cu = [int(x) for x in cu]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"{name} must start at 0 and not decrease, with at least 2 entries")
    return cu


def _kernel_bias(
    bias: Tensor, sequences: int, h: int, qb: int, kb: int, q: Tensor, folded: bool
) -> Tensor:
    """The user's [B or 1, H or 1, QB, KB] bias in the kernels' layout, by differentiable views
    and copies (their autograd sums the gradient over broadcast dimensions): [sequences * QB,
    H or 1, KB]; heads folded ([N, B * H, D] tensors, one sequence): [QB, B * H or 1, KB]."""
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if (
        bias.dim() != 4
        or bias.shape[0] not in (1, sequences)
        or bias.shape[1] not in (1, h)
        or bias.shape[2:] != (qb, kb)
    ):
        raise ValueError(
            f"bias must be [{sequences} or 1, {h} or 1, {qb}, {kb}] (sequences, heads, query "
            f"blocks, key blocks), got {tuple(bias.shape)}"
        )
    if bias.device != q.device:
        raise TypeError(f"bias must be on q's device ({q.device}), got {bias.device}")
    wide = q.dtype == torch.float64 and q.device.type == "cpu"
    bias = bias.to(torch.float64 if wide else torch.float32).contiguous()
    if folded:
        if bias.shape[0] == 1 and bias.shape[1] == 1:
            return bias[0].transpose(0, 1)  # [QB, 1, KB]
        return bias.expand(sequences, h, qb, kb).reshape(sequences * h, qb, kb).transpose(0, 1)
    heads = bias.shape[1]
    bias = bias.expand(sequences, heads, qb, kb).transpose(1, 2)
    bias = bias.reshape(sequences * qb, heads, kb)
    # (one query block and a bias shared by the sequences: reshape keeps the broadcast as a zero
    # row stride, which the kernels' views refuse as overlapping rows)
    return bias.contiguous() if sequences * qb > 1 and bias.stride(0) == 0 else bias


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: BlockMask | Any,
    scale: float | None = None,
    cu_seqlens_q: Tensor | list[int] | None = None,
    cu_seqlens_k: Tensor | list[int] | None = None,
    importance: BlockImportance | None = None,
    dropout_p: float = 0.0,
    bias: Tensor | None = None,
) -> Tensor:
    """Attention of q [B, H, N_q, D] over k [B, H, N_k, D], v [B, H, N_k, Dv] under a block mask
    (a :class:`BlockMask`, or FlexAttention's ``BlockMask``, converted by
    :meth:`BlockMask.from_flex` on its first use and kept on it). Returns [B, H, N_q, Dv]
    in q's dtype; query rows with no key left give zeros. ``scale`` defaults to 1/sqrt(D).

    Ragged batches, packed as FlashAttention's varlen functions take them: with ``cu_seqlens_q``
    (and ``cu_seqlens_k``, default the same) q is [total_q, H, D], k [total_k, H, D], v
    [total_k, H, Dv], sequence i at rows cu_seqlens_q[i]:cu_seqlens_q[i + 1], and the result is
    [total_q, H, Dv]. The mask's blocks cover the longest sequence; sequence i uses the top left
    blocks that cover its lengths (causal aligns each at its own bottom right). The offsets are
    needed on the host (a list, or a tensor, read back once per call).

    Differentiable in q, k and v, deterministically: on CUDA by the tensor-core backward (block
    sizes a multiple of 16, D 64 or 128; other masks raise NotImplementedError), on the CPU by
    the CPU engine's fp32 backward (float64 inputs: the float64 reference). With ``importance``
    (a :class:`BlockImportance`) the backward also measures each kept block's attention mass and
    gradient there, in the same pass (eager and CUDA graphs; not under torch.compile); a call
    without gradients (``torch.no_grad``, or inputs that do not require them) measures the mass
    alone by a light pass after the forward (on CUDA: the key tiles walk their kept blocks with
    P = exp(scale q·k - lse) from the forward's lse; about a forward's time).

    ``dropout_p``: attention dropout, as ``F.scaled_dot_product_attention``'s (apply it while
    training only; FlexAttention has none): each weight is kept with probability 1 - p and scaled
    by 1 / (1 - p). The kernels draw it themselves from a counter-based generator (Philox4x32-10
    per sequence, head, query and key, 16-bit draws: p to 1 / 65,536; the same draws in either
    layout, on the CPU and on CUDA)
    seeded from torch's generator of q's device, and regenerate it in the backward: nothing
    [rows, keys] is stored, the gradients stay bitwise repeatable.

    ``bias``: a learnable score bias per block, [B, H, QB, KB] (packed: [sequences, H, QB, KB];
    QB, KB the query and key blocks of the longest sequence, as the mask's ``blocks``), B and H
    broadcast where they are 1: each score of block (r, c) becomes scale * q·k + bias[b, h, r, c]
    (Graphormer-style pair or distance encodings at block granularity). Blocks the mask drops
    ignore it. Its gradient is each kept block's sum of dS, summed in a fixed order (no atomics:
    bitwise repeatable), zeros where the mask drops the block. Read as float32 (float64 for
    float64 inputs on the CPU), with ``dropout_p`` or without; not with ``importance``."""
    if not isinstance(mask, BlockMask):
        if hasattr(mask, "kv_num_blocks") and hasattr(mask, "BLOCK_SIZE"):
            # Converted once and kept on the FlexAttention mask: the ops refer to it by id, so it
            # must outlive the backward too.
            converted = getattr(mask, "_trisparse_mask", None)
            if converted is None:
                converted = BlockMask.from_flex(mask)
                mask._trisparse_mask = converted
            mask = converted
        else:
            raise TypeError(
                f"mask must be a trisparse.BlockMask or a FlexAttention BlockMask, got "
                f"{type(mask).__name__}"
            )
    mask_id = mask.id
    packed = cu_seqlens_q is not None
    if cu_seqlens_k is not None and not packed:
        raise ValueError("cu_seqlens_k needs cu_seqlens_q")
    rank = 3 if packed else 4
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            shape = "[total, H, D] with cu_seqlens" if packed else "[B, H, N, D]"
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype} on {q.device})")
        if t.dtype not in _tensors.FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if packed:
        cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q")
        cu_k = cu_q if cu_seqlens_k is None else _offsets(cu_seqlens_k, "cu_seqlens_k")
        h, d = q.shape[1], q.shape[2]
        if len(cu_k) != len(cu_q):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
        if cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0] or v.shape[0] != k.shape[0]:
            raise ValueError(
                f"cu_seqlens end at {cu_q[-1]} queries and {cu_k[-1]} keys; q, k, v have "
                f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]} rows"
            )
        if k.shape[1:] != (h, d) or v.shape[1] != h:
            raise ValueError(
                f"k and v must be [total_k, H, D] and [total_k, H, Dv] with q's H = {h} and "
                f"D = {d}, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        qp, kp, vp = q, k, v
    else:
        b, h, n_q, d = q.shape
        n_k = k.shape[2]
        if k.shape[:2] != (b, h) or v.shape[:3] != (b, h, n_k) or k.shape[3] != d:
            raise ValueError(
                f"k and v must be [B, H, N_k, D] and [B, H, N_k, Dv] with q's B = {b}, H = {h} "
                f"and D = {d}, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if mask.shape[1] not in (1, h) or mask.shape[0] not in (1, b):
            raise ValueError(
                f"mask: {mask.shape[0]} sequences' and {mask.shape[1]} heads' "
                f"masks for a batch of {b} sequences of {h} heads"
            )
        heads_folded = all(_tensors.foldable(t) for t in (q, k, v))
        if heads_folded:  # [B, H, N, D] seen as [N, B * H, D] by the op: no copy, no view
            qp, kp, vp = q, k, v
            cu_q, cu_k = [0, n_q], [0, n_k]
            if torch.compiler.is_compiling():  # (a constant: the fold is made while tracing)
                mask_id = _folded_id(mask.id, b, h)
            else:  # (a top-k mask's fold is a new object, held until the op's context holds it)
                mask = mask.folded(b, h)
                mask_id = mask.id
        else:  # as [B * N, H, D], B sequences: a view where the rows are outermost, else a copy
            cu_q, cu_k = [i * n_q for i in range(b + 1)], [i * n_k for i in range(b + 1)]
            qp, kp, vp = _packed(q), _packed(k), _packed(v)
    if (packed or not heads_folded) and mask.shape[1] not in (1, qp.shape[1]):
        raise ValueError(f"mask: {mask.shape[1]} heads' masks for {h} heads")
    scale = _tensors.resolve_scale(scale, d)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    state = _tensors.new_dropout_state(dropout_p, q.device)

    if bias is not None:
        if importance is not None:
            raise ValueError("block_sparse_attention: importance and bias cannot be combined")
        qb, kb = longest_blocks(cu_q, mask.block_size), longest_blocks(cu_k, mask.block_size)
        sequences = len(cu_q) - 1 if packed else b
        bias = _kernel_bias(bias, sequences, h, qb, kb, q, not packed and heads_folded)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias)
    )
    qp, kp, vp = (t if t.stride(-1) == 1 else t.contiguous() for t in (qp, kp, vp))
    tracker = 0
    if importance is not None:
        if not isinstance(importance, BlockImportance):
            raise TypeError(
                f"importance must be a trisparse.BlockImportance, got {type(importance).__name__}"
            )
        importance._shape = (len(cu_q) - 1, h) if packed else (b, h)
        tracker = importance.id
    measure = tracker != 0 and not needs_grad  # no backward to measure in: the light pass
    out, lse = _forward_eager(
        qp,
        kp,
        vp,
        mask_id,
        cu_q,
        cu_k,
        scale,
        needs_grad or measure,
        tracker,
        float(dropout_p),
        state,
        bias,
    )
    if measure:
        mass = torch.ops.trisparse.block_sparse_attention_mass(
            qp, kp, lse, mask_id, cu_q, cu_k, scale
        )
        importance._record(mass, mass.new_empty(0), importance._shape)
    if packed or heads_folded:
        return out
    return out.view(b, n_q, h, v.shape[3]).transpose(1, 2)


def topk_block_mask(
    q: Tensor,
    k: Tensor,
    block_size: int,
    top_k: int,
    causal: bool = False,
    keep_diagonal: bool = True,
) -> BlockMask:
    """A block mask selected from the inputs (block routing, as MoBA's and NSA's selection):
    per sequence, head and query block, the ``top_k`` key blocks with the highest
    <mean of the block's q rows, mean of the key block's k rows>, among those it may attend
    (causal: not past the diagonal, aligned at the bottom right), plus with ``keep_diagonal``
    the block holding the key aligned with the query block's last row. Ties go to the lower
    block. q [B, H, N_q, D], k [B, H, N_k, D] on the CPU or CUDA (selected there, and on CUDA
    the mask's plan is built there too: no host synchronisation); the mask is per sequence and
    head, ``causal`` as given, for :func:`block_sparse_attention`. Not differentiable (a
    selection)."""
    for t, name in ((q, "q"), (k, "k")):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, N, D] tensor")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in B, H and D")
    if block_size < 1 or top_k < 0:
        raise ValueError(f"block_size must be >= 1 and top_k >= 0, got {block_size}, {top_k}")
    if not torch.compiler.is_compiling():
        on_plan = _topk_on_plan(
            q.detach(), k.detach(), int(block_size), int(top_k), bool(causal), bool(keep_diagonal)
        )
        if on_plan is not None:
            return on_plan
    blocks = torch.ops.trisparse.topk_blocks(
        _packed(q.detach()),
        _packed(k.detach()),
        q.shape[0],
        int(block_size),
        int(top_k),
        bool(causal),
        bool(keep_diagonal),
    )
    key_blocks = blocks.shape[3]
    density = min(top_k, key_blocks) / key_blocks if key_blocks else 0.0
    return BlockMask(blocks, block_size, causal=causal, density=density)
