"""Block masks and what the kernels measure of them: :class:`BlockMask` (which G x G blocks are
attended, per sequence and head, with its plans), the top-k masks the library's GPU plan selects,
and :class:`BlockImportance`; the registries the block-sparse ops find them in."""

from __future__ import annotations

import atexit
import math
import weakref
from typing import Any

import torch
from torch import Tensor

from . import _C, _tensors
from ._registry import Registry
from .pattern import row_offsets

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
    where the mask drops a block; None before the first backward (``grad`` stays None with
    ``measure_grad=False``: the mass alone, at less cost). A call without gradients (inference,
    a frozen model) measures the mass alone by a light pass after the forward (``grad`` None:
    |dS| needs a backward; the weights before any dropout). Each block is summed in a
    fixed order, without atomics: the same bits on every run. The last measurement's values are
    kept (``steps`` counts them); :class:`PatternLearner` folds them into its average."""

    def __init__(self, measure_grad: bool = True):
        self.measure_grad = bool(measure_grad)
        self.mass: Tensor | None = None
        self.grad: Tensor | None = None
        self.steps = 0
        self._shape: tuple[int, int] | None = None  # (B, H) of the last call
        self._sink: Tensor | None = None  # a buffer each mass is also copied into (PatternLearner)
        self.id = _trackers.add(self)

    def _record(self, mass: Tensor, grad: Tensor, shape: tuple[int, int]) -> None:
        # [sequences, QB, H', KB] from the op, H' = B * H where the heads were folded; `shape`:
        # the (B, H) of the forward this backward belongs to.
        b, h = shape
        qb, kb = mass.shape[1], mass.shape[3]
        self.mass, self.grad = (
            t.permute(0, 2, 1, 3).reshape(b, h, qb, kb) if t.numel() else None for t in (mass, grad)
        )
        if self._sink is not None and self.mass is not None:
            self._sink.copy_(self.mass)
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
        self._refills: dict[tuple, tuple] = {}  # per device plan: what refresh_ rewrites it from
        self._folds: dict[tuple[int, int], BlockMask] = {}
        self.id = _masks.add(self)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The blocks' shape: (B or 1, H or 1, query blocks, key blocks)."""
        return tuple(self.blocks.shape)

    def refresh_(self, due: torch.Tensor | None = None) -> None:
        """After new contents were written into ``blocks`` in place (a pattern pruned again): the
        mask's plans follow them. The plans built on the GPU are rewritten by kernels on the
        current stream, into their own memory (no allocation, no host synchronisation: a step
        that changes its mask can be captured in a CUDA graph); plans made from a host copy are
        dropped and made again at their next use (not while capturing). Calls enqueued before
        see the old mask, later ones the new: refresh between a step's backward and the next
        forward, as a backward runs under its forward's mask. `due` (a bool on the plans'
        device): the device plans' kernels rewrite them only where it is true, so that a captured
        step refreshes at a cadence (the blocks must then be new only where it is)."""
        rebuilt = [key for key in self._plans if key not in self._refills]
        if rebuilt and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "BlockMask.refresh_: plans made from a host copy of the blocks (CPU, float64 or "
                "a block size that is not a multiple of 16) cannot be made again under CUDA graph "
                "capture"
            )
        for key in rebuilt:
            del self._plans[key]
        self._host = self.blocks if self.blocks.device.type == "cpu" else None
        for key, (kept, layout) in self._refills.items():
            if kept is not self.blocks:  # a contiguous copy the plan reads
                kept.copy_(self.blocks)
            self._plans[key].refill(
                kept.data_ptr(),
                *layout,
                _tensors.stream(key[0]),
                0 if due is None else due.data_ptr(),
            )
        for (batch, heads), fold in self._folds.items():
            if fold.blocks.data_ptr() != self.blocks.data_ptr():  # shared blocks, expanded
                qb, kb = self.blocks.shape[2:]
                fold.blocks.copy_(self.blocks.expand(batch, heads, qb, kb).reshape(fold.shape))
            fold.refresh_(due)

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
            layout = (
                kept.stride(0) if b_m > 1 else 0,
                kept.stride(1) if h_m > 1 else 0,
                kept.stride(2),
                qb,
                kb,
                _tensors.device_index(device),
            )
            plan = _C.BlockSparsePlan.build_on_device(
                g,
                h_m,
                self.causal,
                list(cu_q),
                list(cu_k),
                kept.data_ptr(),
                *layout,
                stream,
                -1.0 if self.density is None else self.density * kb,
            )
            self._plans[key] = plan
            self._refills[key] = (kept, layout)
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
        self._refills: dict[tuple, tuple] = {}
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

    def refresh_(self, due: torch.Tensor | None = None) -> None:
        raise TypeError("a top-k mask is selected by its plan: select it again (topk_block_mask)")

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


def _topk_on_plan(q: Tensor, k: Tensor, block: int, top_k: int, causal: bool, keep_diag: bool):
    """topk_block_mask through the library's GPU selection where it takes the inputs (CUDA, f16 or
    bf16, a block a multiple of 16, D a multiple of 8), else None. The heads are folded where the
    strides allow (the selection reads q and k in place, as block_sparse_attention does)."""
    b, h, n_q, d = q.shape
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or block % 16 or d % 8:
        return None
    n_k = k.shape[2]
    qf, kf = _heads_folded(q), _heads_folded(k)
    if qf is not None and kf is not None and _tensors.aligned16(qf) and _tensors.aligned16(kf):
        qs, ks, heads, fold = qf, kf, b * h, (b, h)
        cu_q, cu_k = (0, n_q), (0, n_k)
    else:  # packed rows (a copy where the view's rows are not 16-byte aligned)
        qs, ks = _tensors.rows16(_packed(q)), _tensors.rows16(_packed(k))
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


# The folded masks compiled graphs hold (by id): a graph baked with one must find it alive (a top-k
# mask's fold is a new object each call, not cached on the mask).
_TRACED_FOLDS: dict[int, BlockMask] = {}
atexit.register(_TRACED_FOLDS.clear)


@torch.compiler.assume_constant_result
def _folded_id(mask: int, batch: int, heads: int) -> int:
    """The id of mask `mask` folded for `batch` sequences of `heads` heads (`BlockMask.folded`):
    a constant to torch.compile, which cannot trace a new mask's registration (the fold is made
    while tracing and kept alive for the graph)."""
    fold = _masks.lookup(mask).folded(batch, heads)
    _TRACED_FOLDS[fold.id] = fold
    return fold.id


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
