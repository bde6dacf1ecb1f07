"""Block-sparse attention for sequences: a mask of G x G blocks (ours, or FlexAttention's
BlockMask), on [B, H, N, D] tensors as PyTorch's SDPA and flex_attention take them."""

from __future__ import annotations

import atexit
import itertools
import math
import weakref
from typing import Any

import torch
from torch import Tensor

from . import _C, _tensors
from ._eager import eager_autograd
from ._registry import Registry
from .pattern import row_offsets

__all__ = ["BlockImportance", "BlockMask", "block_sparse_attention", "topk_block_mask"]

_masks = Registry("mask", "trisparse.BlockMask")
_trackers = Registry("importance", "trisparse.BlockImportance")


class BlockImportance:
    """What the kernels measure of each kept block while they train: pass it as
    ``block_sparse_attention(..., importance=this)`` and the backward, which recomputes the
    softmax weights P from the forward's log-sum-exp anyway, also writes per head and kept block

    - ``mass``: the attention mass, sum of P over the block's (query, key) pairs divided by the
      block's query rows (a block row's masses sum to 1 over the blocks the mask keeps);
    - ``grad``: the sum of |dS| over the block, dS = dL/dz for the scaled scores z;

    as float32 [B, H, query blocks, key blocks] (the packed form: [sequences, H, ...]), zeros
    where the mask drops a block; None before the first backward. Each block is summed in a fixed
    order, without atomics: the same bits on every run. The last backward's values are kept
    (``steps`` counts the backwards); :class:`PatternLearner` folds them into its average."""

    def __init__(self):
        self.mass: Tensor | None = None
        self.grad: Tensor | None = None
        self.steps = 0
        self._shape: tuple[int, int] | None = None  # (B, H) of the last call
        self.id = _trackers.add(self)

    def _record(self, mass: Tensor, grad: Tensor, shape: tuple[int, int]) -> None:
        # [sequences, QB, H', KB] from the op, H' = B * H where the heads were folded; `shape`:
        # the (B, H) of the forward this backward belongs to.
        b, h = shape
        qb, kb = mass.shape[1], mass.shape[3]
        self.mass, self.grad = (t.permute(0, 2, 1, 3).reshape(b, h, qb, kb) for t in (mass, grad))
        self.steps += 1


class BlockMask:
    """Which G x G blocks of the [N_q, N_k] score matrix are attended, per sequence and head.

    ``blocks``: a bool tensor [B or 1, H or 1, ceil(N_q / G), ceil(N_k / G)] (1 = shared by every
    sequence / head); ``block_size`` G; ``causal`` also masks the elements above the diagonal
    (aligned at the bottom right when N_q != N_k) inside kept blocks. The formats are prepared
    once per device and sequence sizes, and reused.

    ``blocks`` stays where it is. On CUDA, with G a multiple of 16, the plan's lists are built
    from it on the device by kernels on the current stream (no host synchronisation, so a mask
    made at every step, e.g. a top-k selection, costs no round trip); the CPU, float64 inputs
    and other block sizes read a host copy, made once. ``density``: the fraction of key blocks a
    query block row keeps, where the caller knows it without reading the mask (a top-k selection
    does): on the GPU it chooses the kernel as a host mask's counts would (unknown: the
    one-warpgroup kernel)."""

    PLAN_CACHES = ("_plans",)  # freed at exit (_registry)

    def __init__(
        self,
        blocks: Tensor,
        block_size: int,
        causal: bool = False,
        density: float | None = None,
    ):
        if not isinstance(blocks, Tensor) or blocks.dtype != torch.bool or blocks.dim() != 4:
            raise TypeError(
                "blocks must be a bool tensor [B or 1, H or 1, query blocks, key blocks]"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.blocks = blocks.detach()
        self._host: Tensor | None = self.blocks if self.blocks.device.type == "cpu" else None
        self.block_size = int(block_size)
        self.causal = bool(causal)
        if density is not None and not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be in [0, 1], got {density}")
        self.density = density
        self._plans: dict[tuple, Any] = {}
        self._folds: dict[tuple[int, int], BlockMask] = {}
        self.id = _masks.add(self)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The blocks' shape: (B or 1, H or 1, query blocks, key blocks)."""
        return tuple(self.blocks.shape)

    @classmethod
    def from_flex(cls, block_mask: Any, causal: bool = False) -> BlockMask:
        """From FlexAttention's ``BlockMask``: every block it visits (its partial and full blocks)
        is kept whole. Its ``mask_mod`` is not applied inside partial blocks, so the result equals
        flex_attention's where the mask_mod is block-granular, or causal with ``causal=True``.
        The blocks stay on the mask's device (``to_dense``: torch ops, no host copy)."""
        q_block, kv_block = block_mask.BLOCK_SIZE
        if q_block != kv_block:
            raise ValueError(
                f"block_mask: query and key block sizes differ ({q_block}, {kv_block}); "
                "trisparse's masks use square blocks"
            )
        return cls(block_mask.to_dense().bool(), q_block, causal)

    def plan(self, device: torch.device, cu_q: list[int], cu_k: list[int], algo: str):
        """The C++ plan for `device` and the sequences cu_q[i]:cu_q[i + 1] of queries and
        cu_k[i]:cu_k[i + 1] of keys; sequence i uses the top left ceil(len / G) blocks of its
        mask."""
        key = (device, tuple(cu_q), tuple(cu_k), algo)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        g = self.block_size
        b_m, h_m, qb, kb = self.blocks.shape
        batch = len(cu_q) - 1
        lq = [cu_q[i + 1] - cu_q[i] for i in range(batch)]
        lk = [cu_k[i + 1] - cu_k[i] for i in range(batch)]
        n_q, n_k = max(lq, default=0), max(lk, default=0)
        if (qb, kb) != (math.ceil(n_q / g), math.ceil(n_k / g)):
            raise ValueError(
                f"mask: {qb} x {kb} blocks of {g} do not cover {n_q} queries x {n_k} keys"
            )
        if b_m not in (1, batch):
            raise ValueError(f"mask: {b_m} sequences' masks for a batch of {batch}")
        stream = _tensors.stream(device)
        if (
            device.type == "cuda"
            and self.blocks.device == device
            and algo == "automatic"
            and g % 16 == 0
        ):
            kept = self.blocks if self.blocks.stride(-1) == 1 else self.blocks.contiguous()
            self._kept = kept  # read by the plan's kernels, in stream order
            plan = _C.BlockSparsePlan.build_on_device(
                g,
                h_m,
                self.causal,
                list(cu_q),
                list(cu_k),
                kept.data_ptr(),
                kept.stride(0) if b_m > 1 else 0,
                kept.stride(1) if h_m > 1 else 0,
                kept.stride(2),
                qb,
                kb,
                _tensors.device_index(device),
                stream,
                -1.0 if self.density is None else self.density * kb,
            )
            self._plans[key] = plan
            return plan
        if self._host is None:
            self._host = self.blocks.to("cpu")  # one host synchronisation per mask
        csr = []
        for b in range(batch):
            qb_b, kb_b = math.ceil(lq[b] / g), math.ceil(lk[b] / g)
            for h in range(h_m):
                dense = self._host[b if b_m > 1 else 0, h, :qb_b, :kb_b]
                rows, cols = dense.nonzero(as_tuple=True)
                csr.append((row_offsets(rows, qb_b), cols.to(torch.int32).contiguous()))
        plan = _C.BlockSparsePlan.build(
            g,
            h_m,
            self.causal,
            list(cu_q),
            list(cu_k),
            [(r.data_ptr(), c.data_ptr(), c.numel()) for r, c in csr],
            algo,
            _tensors.device_index(device),
            stream,
        )
        self._plans[key] = plan
        return plan

    def folded(self, batch: int, heads: int) -> BlockMask:
        """This mask for `batch` sequences of `heads` heads seen as one sequence of batch * heads
        heads (how [B, H, N, D] tensors reach the kernels without a copy: as [N, B * H, D]): itself
        where one mask serves every sequence and head or batch = 1, else the blocks as [1, B * H,
        ...] (a view of per-sequence, per-head blocks; a copy of shared ones). Cached."""
        b_m, h_m, qb, kb = self.blocks.shape
        if batch == 1 or (b_m == 1 and h_m == 1):
            return self
        got = self._folds.get((batch, heads))
        if got is None:
            blocks = self.blocks.expand(batch, heads, qb, kb).reshape(1, batch * heads, qb, kb)
            got = BlockMask(blocks, self.block_size, self.causal, self.density)
            self._folds[(batch, heads)] = got
        return got


class _TopkMask(BlockMask):
    """A top-k mask selected on the GPU by the library's plan (``topk_block_sparse_plan``: block
    means pooled, scored and selected in two launches, written straight into the attention plan's
    block lists, no host synchronisation). The plan serves :func:`block_sparse_attention` on the
    layout it was selected for (``layout``: device and sequence offsets; ``fold``: (B, H) where
    the heads were folded); any other call reads ``blocks`` and takes BlockMask's path. ``blocks``
    is read back from the plan on first use (one synchronisation). Plans are pooled per shape:
    the mask's returns to the pool when the mask is freed (after its backward)."""

    PLAN_CACHES = ("_plans", "_held")

    def __init__(self, plan, layout, fold, shape, block_size, causal, density):
        self._held = {"plan": plan}  # cleared at exit with the other plans (_registry)
        self._layout, self._fold, self._shape = layout, fold, shape
        self._blocks: Tensor | None = None
        self._host = None
        self.block_size, self.causal, self.density = block_size, causal, density
        self._plans: dict[tuple, Any] = {}
        self._folds: dict[tuple[int, int], BlockMask] = {}
        self.id = _masks.add(self)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self._shape

    @property
    def blocks(self) -> Tensor:
        if self._blocks is None:
            device = self._layout[0]
            table = torch.zeros(self._shape, dtype=torch.uint8)
            self._held["plan"].blocks(table.data_ptr(), _tensors.stream(device))
            self._blocks = table.bool().to(device)
        return self._blocks

    def plan(self, device: torch.device, cu_q: list[int], cu_k: list[int], algo: str):
        if algo == "automatic" and (device, tuple(cu_q), tuple(cu_k)) == self._layout:
            return self._held["plan"]
        return super().plan(device, cu_q, cu_k, algo)

    def folded(self, batch: int, heads: int) -> BlockMask:
        if batch == 1:
            return self
        if self._fold != (batch, heads):
            return super().folded(batch, heads)
        # The same plan seen as one sequence of B * H heads: a new view each call (it holds this
        # mask, and with it the plan, until it is freed; cached, it would make a cycle that only
        # the garbage collector frees, holding the plan out of the pool).
        b, h, qb, kb = self._shape
        view = _TopkMask(
            self._held["plan"], self._layout, None, (1, b * h, qb, kb), self.block_size,
            self.causal, self.density,
        )  # fmt: skip
        view._held = self._held
        view._owner = self
        return view


# Free top-k plans per (device, offsets, heads, head dim, options): a mask takes one and gives it
# back when it is freed, so a training loop builds each shape's plans once.
_topk_pool: dict[tuple, list] = {}
atexit.register(_topk_pool.clear)


def _rows16(t: Tensor) -> bool:
    """Whether the selection's 16-byte loads take [rows, H, D] t as it is."""
    s = t.stride()
    return s[-1] == 1 and s[0] % 8 == 0 and s[1] % 8 == 0 and t.data_ptr() % 16 == 0


def _topk_on_plan(q: Tensor, k: Tensor, block: int, top_k: int, causal: bool, keep_diag: bool):
    """topk_block_mask through the library's GPU selection where it takes the inputs (CUDA, f16 or
    bf16, a block a multiple of 16, D a multiple of 8), else None. The heads are folded where the
    strides allow (the selection reads q and k in place, as block_sparse_attention does)."""
    b, h, n_q, d = q.shape
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or block % 16 or d % 8:
        return None
    n_k = k.shape[2]
    qf, kf = _heads_folded(q), _heads_folded(k)
    if qf is not None and kf is not None and _rows16(qf) and _rows16(kf):
        qs, ks, heads, fold = qf, kf, b * h, (b, h)
        cu_q, cu_k = (0, n_q), (0, n_k)
    else:  # packed rows (a copy where the view's rows are not 16-byte aligned)
        qs, ks = (t if _rows16(t) else t.contiguous() for t in (_packed(q), _packed(k)))
        heads, fold = h, None
        cu_q, cu_k = tuple(i * n_q for i in range(b + 1)), tuple(i * n_k for i in range(b + 1))
    stream = _tensors.stream(q.device)
    key = (q.device, cu_q, cu_k, heads, d, block, top_k, causal, keep_diag)
    free = _topk_pool.setdefault(key, [])
    if free:
        plan = free.pop()
    else:
        try:
            with torch.cuda.device(q.device):
                plan = _C.TopkBlockSparsePlan.build(
                    list(cu_q), list(cu_k), heads, d, block, top_k, causal, keep_diag, True, stream
                )
        except NotImplementedError:  # e.g. more key blocks than the selection holds scores for
            return None
    plan.select(_tensors.view(qs), _tensors.view(ks), stream)
    kb = -(-n_k // block)
    density = min(top_k, kb) / kb if kb else 0.0
    shape = (b, h, -(-n_q // block), kb)
    mask = _TopkMask(plan, (q.device, cu_q, cu_k), fold, shape, block, causal, density)
    weakref.finalize(mask, free.append, plan).atexit = False
    return mask


def _plan(q: Tensor, mask: int, cu_q: list[int], cu_k: list[int]):
    # The fastest backend; on the CPU it computes float64 in float64 (the gradcheck path).
    return _masks.lookup(mask).plan(q.device, cu_q, cu_k, "automatic")


def _out_like(q: Tensor, dim: int) -> Tensor:
    """[rows, H, dim] in q's layout: heads outermost where q's are (q from [B, H, N, D], seen as
    [N, B * H, D]), so that the result is [B, H, N, Dv] as q was given; else rows outermost."""
    rows, heads = q.shape[0], q.shape[1]
    if heads > 1 and rows > 1 and q.stride(1) > q.stride(0):
        return q.new_empty(heads, rows, dim).transpose(0, 1)
    return q.new_empty(rows, heads, dim)


def _lse_rows(q: Tensor, with_lse: bool) -> int:
    # The log-sum-exp the backward reads: written on CUDA only (the CPU backward recomputes), and
    # only when a gradient is needed.
    return q.shape[0] if with_lse and q.device.type == "cuda" else 0


@torch.library.custom_op("trisparse::block_sparse_attention", mutates_args=())
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: int,
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
    with_lse: bool,
    importance: int = 0,
) -> tuple[Tensor, Tensor]:
    """Packed [rows, H, D] tensors, sequence i at rows cu_q[i]:cu_q[i + 1] (keys cu_k); returns
    out and, on CUDA with `with_lse`, each row's log-sum-exp (f32 [rows, H]; else [0, H]).
    `importance`: the id of a BlockImportance the backward fills (0: none)."""
    plan = _plan(q, mask, cu_q, cu_k)
    out = _out_like(q, v.shape[2])
    lse = q.new_empty(_lse_rows(q, with_lse), q.shape[1], dtype=torch.float32)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(q.shape[1], max(q.shape[2], v.shape[2])), q.device
    )
    with_lse = lse.shape[0] > 0 and plan.backend == "cuda_block"
    plan.run(
        *(_tensors.view(t) for t in (q, k, v, out)),
        _tensors.view(lse.unsqueeze(-1)) if with_lse else None,
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return out, lse


@_forward.register_fake
def _forward_fake(q, k, v, mask, cu_q, cu_k, scale, with_lse, importance=0):
    return (
        _out_like(q, v.shape[2]),
        q.new_empty(_lse_rows(q, with_lse), q.shape[1], dtype=torch.float32),
    )


@torch.library.custom_op("trisparse::block_sparse_attention_backward", mutates_args=())
def _backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    mask: int,
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
    importance: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, and with `importance` each kept block's attention mass and |dS| sum (f32
    [sequences, query blocks, H, key blocks], zeros where the mask drops a block; else [0])."""
    plan = _plan(q, mask, cu_q, cu_k)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mass, grad = _importance_like(q, mask, cu_q, cu_k, importance)
    on_cuda = q.device.type == "cuda"
    if on_cuda and plan.backend != "cuda_block":
        raise NotImplementedError(
            "block_sparse_attention: the CUDA backward runs the tensor-core block kernel (block "
            f"sizes a multiple of 16 and head dims 64 or 128); this mask runs {plan.backend}"
        )
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.backward_workspace_bytes(q.shape[1], importance) if on_cuda else 0, q.device
    )
    blocks = [_tensors.view(t.flatten(0, 1)) if importance else None for t in (mass, grad)]
    plan.backward(
        *(_tensors.view(t) for t in (q, k, v)),
        _tensors.view(out) if on_cuda else None,
        _tensors.view(lse.unsqueeze(-1)) if on_cuda else None,
        *(_tensors.view(t) for t in (dout, dq, dk, dv)),
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
        *blocks,
    )
    return dq, dk, dv, mass, grad


def _importance_like(q, mask, cu_q, cu_k, importance):
    """Zeroed block importance outputs: [sequences, QB, H, KB] f32 (QB, KB: the longest
    sequence's query and key blocks), or [0] without `importance`."""
    if not importance:
        return tuple(q.new_zeros(0, dtype=torch.float32) for _ in range(2))
    g = _masks.lookup(mask).block_size
    lq = max(b - a for a, b in itertools.pairwise(cu_q))
    lk = max(b - a for a, b in itertools.pairwise(cu_k))
    shape = (len(cu_q) - 1, -(-lq // g), q.shape[1], -(-lk // g))
    return tuple(q.new_zeros(shape, dtype=torch.float32) for _ in range(2))


@_backward_op.register_fake
def _backward_fake(q, k, v, out, lse, dout, mask, cu_q, cu_k, scale, importance=False):
    mass, grad = _importance_like(q, mask, cu_q, cu_k, importance)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), mass, grad


def _setup_context(ctx, inputs, output):
    q, k, v, mask, cu_q, cu_k, scale, _with_lse, importance = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mask, ctx.cu_q, ctx.cu_k, ctx.scale = mask, cu_q, cu_k, scale
    ctx.importance = _trackers.get(importance) if importance else None
    ctx.importance_shape = ctx.importance._shape if ctx.importance is not None else None
    # Held until the backward: a mask made for one step (a top-k selection) may be dropped by the
    # caller as soon as the forward returns.
    ctx.mask_object = _masks.get(mask)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    tracker = ctx.importance
    dq, dk, dv, mass, grad = torch.ops.trisparse.block_sparse_attention_backward(
        q, k, v, out, lse, dout, ctx.mask, ctx.cu_q, ctx.cu_k, ctx.scale, tracker is not None
    )
    if tracker is not None:
        tracker._record(mass, grad, ctx.importance_shape)
    return dq, dk, dv, None, None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)
_forward_eager = eager_autograd(_forward, _setup_context, _backward)


def _packed(t: Tensor) -> Tensor:  # [B, H, N, D] -> [B * N, H, D]
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _heads_folded(t: Tensor) -> Tensor | None:
    """[B, H, N, D] as the view [N, B * H, D] (sequence b's head h is head b * H + h), or None
    where its strides do not allow it (a sequence's heads are not evenly spaced)."""
    b, h, n, d = t.shape
    try:
        return t.view(b * h, n, d).transpose(0, 1)
    except RuntimeError:
        return None


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


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: BlockMask | Any,
    scale: float | None = None,
    cu_seqlens_q: Tensor | list[int] | None = None,
    cu_seqlens_k: Tensor | list[int] | None = None,
    importance: BlockImportance | None = None,
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
    gradient there, in the same pass (eager and CUDA graphs; not under torch.compile)."""
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
        folded = [_heads_folded(t) for t in (q, k, v)]
        heads_folded = all(t is not None for t in folded)
        if heads_folded:  # [B, H, N, D] as [N, B * H, D]: no copy
            qp, kp, vp = folded
            cu_q, cu_k = [0, n_q], [0, n_k]
            mask = mask.folded(b, h)
        else:  # as [B * N, H, D], B sequences: a view where the rows are outermost, else a copy
            cu_q, cu_k = [i * n_q for i in range(b + 1)], [i * n_k for i in range(b + 1)]
            qp, kp, vp = _packed(q), _packed(k), _packed(v)
    if mask.shape[1] not in (1, qp.shape[1]):
        raise ValueError(f"mask: {mask.shape[1]} heads' masks for {h} heads")
    scale = _tensors.resolve_scale(scale, d)

    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    qp, kp, vp = (t if t.stride(-1) == 1 else t.contiguous() for t in (qp, kp, vp))
    tracker = 0
    if importance is not None:
        if not isinstance(importance, BlockImportance):
            raise TypeError(
                f"importance must be a trisparse.BlockImportance, got {type(importance).__name__}"
            )
        importance._shape = (len(cu_q) - 1, h) if packed else (b, h)
        tracker = importance.id
    out, _lse = _forward_eager(qp, kp, vp, mask.id, cu_q, cu_k, scale, needs_grad, tracker)
    if packed:
        return out
    if heads_folded:
        return out.transpose(0, 1).view(b, h, n_q, v.shape[3])
    return out.view(b, n_q, h, v.shape[3]).transpose(1, 2)


@torch.library.custom_op("trisparse::topk_blocks", mutates_args=())
def _topk_blocks(
    q: Tensor, k: Tensor, batch: int, block: int, top_k: int, causal: bool, keep_diagonal: bool
) -> Tensor:
    """The selected blocks of packed q [batch * N_q, H, D], k [batch * N_k, H, D]: bool
    [batch, H, query blocks, key blocks]. The CPU runs the library's selection; other devices
    select with torch's ops on the device (_topk_blocks_on_device: no host synchronisation)."""
    if q.device.type != "cpu":
        return _topk_blocks_on_device(q, k, batch, block, top_k, causal, keep_diagonal)
    heads = q.shape[1]
    out = torch.zeros(
        batch,
        heads,
        -(-q.shape[0] // batch // block),
        -(-k.shape[0] // batch // block),
        dtype=torch.uint8,
    )
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    _C.topk_blocks(
        _tensors.view(q),
        _tensors.view(k),
        batch,
        block,
        top_k,
        causal,
        keep_diagonal,
        out.data_ptr(),
    )
    return out.bool()


def _block_means(x: Tensor, batch: int, block: int) -> Tensor:
    """[batch * N, H, D] -> float64 means of each block of `block` rows: [batch, H, blocks, D]
    (the last block's mean over its own rows)."""
    n, h, d = x.shape[0] // batch, x.shape[1], x.shape[2]
    nb = -(-n // block)
    x = x.reshape(batch, n, h, d).to(torch.float64)
    sums = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, nb * block - n))
    sums = sums.view(batch, nb, block, h, d).sum(2).transpose(1, 2)
    # Rows per block, computed on the device (writing a host scalar into it would synchronise).
    starts = torch.arange(nb, dtype=torch.float64, device=x.device) * block
    counts = (n - starts).clamp(max=block)
    return sums / counts[:, None]


def _topk_blocks_on_device(q, k, batch, block, top_k, causal, keep_diagonal):
    """topk_blocks with torch's ops where q and k are (float64 block means and scores as the
    library's CPU selection; a stable sort gives ties to the lower block)."""
    lq, lk = q.shape[0] // batch, k.shape[0] // batch
    nbq, nbk = -(-lq // block), -(-lk // block)
    dev = q.device
    out = torch.zeros(batch, q.shape[1], nbq, nbk, dtype=torch.bool, device=dev)
    if nbq == 0 or nbk == 0:
        return out
    scores = _block_means(q, batch, block) @ _block_means(k, batch, block).transpose(-1, -2)
    # Per query block: the key aligned with its last row (bottom right) and the key blocks it
    # may attend (causal: up to the aligned key's block).
    r = torch.arange(nbq, device=dev)
    aligned = torch.clamp((r + 1) * block, max=lq) - 1 + (lk - lq)
    last = torch.clamp(aligned, max=lk - 1) if causal else torch.full_like(r, lk - 1)
    allowed = torch.where(last < 0, 0, last // block + 1)
    c = torch.arange(nbk, device=dev)
    scores = scores.masked_fill(c[None, :] >= allowed[:, None], float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    take = min(top_k, nbk)
    keep = torch.arange(take, device=dev)[None, :] < torch.clamp(allowed, max=top_k)[:, None]
    out.scatter_(-1, order[..., :take], keep.expand(batch, q.shape[1], nbq, take))
    if keep_diagonal:
        # The block of the aligned key, where there is one (no boolean indexing: no sync).
        diag = (torch.clamp(aligned, min=0, max=lk - 1) // block).view(1, 1, nbq, 1)
        has = (aligned >= 0).view(1, 1, nbq, 1)
        shape = (batch, q.shape[1], nbq, 1)
        out |= torch.zeros_like(out).scatter_(-1, diag.expand(shape), has.expand(shape))
    return out


@_topk_blocks.register_fake
def _topk_blocks_fake(q, k, batch, block, top_k, causal, keep_diagonal):
    return q.new_empty(
        (batch, q.shape[1], -(-q.shape[0] // batch // block), -(-k.shape[0] // batch // block)),
        dtype=torch.bool,
    )


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
