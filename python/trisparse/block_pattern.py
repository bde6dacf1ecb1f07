"""trisparse.BlockPattern: a block-sparse attention pattern that is made, kept and reused (the
learned-pattern plan's pattern object) over the C++ ``block_pattern``: per head, the kept G x G
blocks of an N_q x N_k score matrix, the node order they refer to, and how the pattern was made;
its statistics, its file, and the masks the attention takes."""

from __future__ import annotations

import dataclasses
import numbers
import os

import torch
from torch import Tensor

from . import _C, _tensors
from .block_sparse import BlockImportance, BlockMask, block_sparse_attention

__all__ = [
    "BlockPattern",
    "PatternLearner",
    "attention_error",
    "block_mass",
    "block_value_mass",
    "dense_attention",
    "learn_block_pattern",
    "pooled_block_mass",
    "prune_blocks",
    "prune_blocks_by_output",
]


class BlockPattern:
    """Per head, the kept blocks of each block row (over ceil(rows / block) x ceil(cols /
    block) blocks), ``order`` (None: the identity; else position i holds node order[i]) and
    ``made_by``. Build with :meth:`from_blocks`, :meth:`layout`, :meth:`union` or :meth:`load`."""

    def __init__(self, native):
        self._native = native

    # --- builders -------------------------------------------------------------------------------

    @classmethod
    def from_blocks(
        cls,
        blocks: Tensor,
        block_size: int,
        rows: int | None = None,
        cols: int | None = None,
        order: Tensor | None = None,
        made_by: str = "",
    ) -> BlockPattern:
        """From a bool block table [H, query blocks, key blocks] (or one head's [qb, kb]) of
        ``rows`` x ``cols`` elements (default: the blocks' extent)."""
        if not isinstance(blocks, Tensor) or blocks.dtype != torch.bool:
            raise TypeError("blocks must be a bool tensor [H, query blocks, key blocks]")
        if blocks.dim() == 2:
            blocks = blocks[None]
        if blocks.dim() != 3:
            raise ValueError(f"blocks must be [H, qb, kb] or [qb, kb], got {tuple(blocks.shape)}")
        blocks = blocks.detach().to("cpu")
        heads, qb, kb = blocks.shape
        rows = qb * block_size if rows is None else int(rows)
        cols = kb * block_size if cols is None else int(cols)
        counts = blocks.sum(-1, dtype=torch.int64)  # [H, qb]
        row_ptr = torch.zeros(heads, qb + 1, dtype=torch.int64)
        torch.cumsum(counts, 1, out=row_ptr[:, 1:])
        col_idx = blocks.nonzero()[:, 2].to(torch.int32).contiguous()  # head, row, col order
        order_t = None
        if order is not None:
            order_t = torch.as_tensor(order, dtype=torch.int64).to("cpu").contiguous()
        native = _C.BlockPattern.from_csr(
            int(block_size),
            rows,
            cols,
            heads,
            row_ptr.data_ptr(),
            col_idx.data_ptr(),
            0 if order_t is None else order_t.data_ptr(),
            0 if order_t is None else order_t.numel(),
            made_by,
        )
        return cls(native)

    @classmethod
    def layout(
        cls,
        kind: str,
        n: int,
        block_size: int = 64,
        heads: int = 1,
        p: float = 0.9,
        window: int = 1,
        stride: int = 8,
        global_blocks: int = 1,
        random_blocks: int = 2,
        seed: int = 1,
    ) -> BlockPattern:
        """A sparse transformer's layout over n x n: "dense", "random" (each block kept with
        probability 1 - p, the diagonal always), "window" (|i - j| <= window blocks), "strided"
        (j = i mod stride), "global" (the first global_blocks block rows and columns) or
        "bigbird" (window, global and random_blocks random key blocks a row); with heads > 1 each
        head draws its own."""
        return cls(
            _C.BlockPattern.layout(
                kind, n, block_size, heads, p, window, stride, global_blocks, random_blocks, seed
            )
        )

    @classmethod
    def community(
        cls,
        edge_index: Tensor,
        num_nodes: int,
        block_size: int = 64,
        heads: int = 1,
        seed: int = 1,
    ) -> BlockPattern:
        """A graph's structure as a pattern: the nodes in community order (label propagation,
        then reverse Cuthill-McKee within and across communities: no package, linear time a
        round; the pattern's ``order``) and the blocks of the reordered graph that hold an edge
        (target i attends source j, PyG's edge_index), plus the diagonal blocks."""
        edge_index = torch.as_tensor(edge_index).to("cpu", torch.int64)
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must be [2, E], got {tuple(edge_index.shape)}")
        if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= num_nodes):
            raise ValueError(f"edge_index has ids outside 0 .. {num_nodes - 1}")
        dst, src = edge_index[1].contiguous(), edge_index[0].contiguous()
        native = _C.BlockPattern.community(
            dst.data_ptr(), src.data_ptr(), dst.numel(), int(num_nodes), block_size, heads, seed
        )
        return cls(native)

    @classmethod
    def knn(
        cls,
        x: Tensor,
        k: int,
        block_size: int = 64,
        heads: int = 1,
        seed: int = 1,
        chunk: int = 4096,
    ) -> BlockPattern:
        """Nodes attending their k most similar nodes by features (cosine similarity of x [N,
        F], itself excluded; top-k per row by matrix products on x's device, `chunk` rows at a
        time), as a pattern: the k-nearest-neighbour graph through :meth:`community` (its
        community order, so that similar nodes share blocks)."""
        if x.dim() != 2:
            raise ValueError(f"x must be [N, F], got {tuple(x.shape)}")
        n = x.shape[0]
        if not 0 < k < n:
            raise ValueError(f"k must be in 1 .. N - 1 = {n - 1}, got {k}")
        unit = torch.nn.functional.normalize(x.detach().float(), dim=1)
        nearest = []
        for r0 in range(0, n, chunk):
            sim = unit[r0 : r0 + chunk] @ unit.T
            rows = torch.arange(r0, min(n, r0 + chunk), device=x.device)
            sim[rows - r0, rows] = float("-inf")  # not itself
            nearest.append(torch.topk(sim, k, dim=1).indices)
        src = torch.cat(nearest).reshape(-1)
        dst = torch.arange(n, device=x.device).repeat_interleave(k)
        edge_index = torch.stack([src, dst])
        return cls.community(edge_index, n, block_size, heads, seed)

    @classmethod
    def union(cls, *patterns: BlockPattern) -> BlockPattern:
        """Head h keeps what head h of any of the patterns keeps (one of one head serves all)."""
        return cls(_C.BlockPattern.union([q._native for q in patterns]))

    @classmethod
    def load(cls, path: str | os.PathLike) -> BlockPattern:
        """What :meth:`save` wrote. Raises ValueError naming the file for a missing, truncated,
        damaged (checksum) or other-version file."""
        return cls(_C.BlockPattern.load(os.fspath(path)))

    # --- what it holds --------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """A versioned, checksummed binary file (the C++ library's and the CLI's format)."""
        self._native.save(os.fspath(path))

    @property
    def block_size(self) -> int:
        return self._native.block

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) in elements."""
        return self._native.rows, self._native.cols

    @property
    def num_heads(self) -> int:
        return self._native.heads

    @property
    def made_by(self) -> str:
        return self._native.made_by

    @property
    def order(self) -> Tensor | None:
        """The node order (int64 [rows]), or None for the identity."""
        n = self._native.order_len
        if n == 0:
            return None
        out = torch.empty(n, dtype=torch.int64)
        self._native.copy_order(out.data_ptr())
        return out

    def head(self, h: int) -> tuple[Tensor, Tensor]:
        """Head h's block rows as CSR: (offsets int64 [qb + 1], key blocks int32)."""
        rows = -(-self._native.rows // self._native.block)
        row_ptr = torch.empty(rows + 1, dtype=torch.int64)
        col_idx = torch.empty(self._native.head_nnz(h), dtype=torch.int32)
        self._native.copy_head(h, row_ptr.data_ptr(), col_idx.data_ptr())
        return row_ptr, col_idx

    def blocks(self) -> Tensor:
        """The bool block table [H, query blocks, key blocks]."""
        rows, cols = self.shape
        g = self.block_size
        out = torch.zeros(self.num_heads, -(-rows // g), -(-cols // g), dtype=torch.bool)
        for h in range(self.num_heads):
            row_ptr, col_idx = self.head(h)
            r = torch.repeat_interleave(torch.arange(row_ptr.numel() - 1), row_ptr.diff())
            out[h, r, col_idx.long()] = True
        return out

    def stats(self) -> dict:
        """Per head: density, the emptiest and fullest block row's density, the mean block
        distance from the diagonal over the block rows (locality); the mean Jaccard overlap of
        the heads' blocks."""
        return self._native.stats()

    def to_png(self, path: str | os.PathLike, max_side: int = 1024, columns: int = 4) -> None:
        """A PNG (Pillow's encoder) of the library's picture of the pattern (the CLI's `pattern
        show --png` draws the same): one panel per head, `columns` panels a row, each pixel the
        share of kept blocks in its cell (dark: kept, white: dropped), cells of several blocks
        where a head has more than `max_side` block rows or columns, small patterns scaled up
        to at least 256 pixels a side."""
        try:
            from PIL import Image
        except ImportError as e:  # an optional dependency
            raise ImportError("BlockPattern.to_png needs Pillow: pip install pillow") from e
        width, height, pixels = self._native.render(max_side, columns)
        Image.frombytes("L", (width, height), pixels).save(os.fspath(path), format="PNG")

    def to_block_mask(self, causal: bool = False, device: torch.device | str | None = None):
        """A :class:`trisparse.BlockMask` ([1, H, qb, kb]) for :func:`block_sparse_attention`
        over tensors in the pattern's node order, its table on `device` (default the CPU)."""
        dense = self.blocks()[None]
        density = float(dense.float().mean()) if dense.numel() else 0.0
        return BlockMask(dense.to(device or "cpu"), self.block_size, causal, density=density)

    def to_flex(self, device: torch.device | str | None = None):
        """FlexAttention's ``BlockMask`` [1, H, qb, kb] with the kept blocks as full blocks (no
        mask_mod inside them), on `device` (default the CPU)."""
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        blocks = self.blocks()[None].to(device or "cpu")
        counts = blocks.sum(-1, dtype=torch.int32)
        # Kept key blocks first, ascending (a stable sort of the dropped flags).
        indices = torch.sort((~blocks).to(torch.int8), dim=-1, stable=True).indices
        indices = indices.to(torch.int32)
        return FlexBlockMask.from_kv_blocks(
            torch.zeros_like(counts),
            indices,
            full_kv_num_blocks=counts,
            full_kv_indices=indices,
            BLOCK_SIZE=self.block_size,
            seq_lengths=self.shape,
        )

    def __repr__(self) -> str:
        rows, cols = self.shape
        return (
            f"BlockPattern(heads={self.num_heads}, shape=({rows}, {cols}), "
            f"block_size={self.block_size}, made_by={self.made_by!r})"
        )


def block_mass(
    q: Tensor, k: Tensor, block_size: int, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Each block's attention mass (float64 [H, query blocks, key blocks]): the softmax weights
    of softmax(scale q kᵀ) (causal: keys up to the query's position) summed over the block, each
    block row divided by its rows, so that a block row's masses sum to 1 (the true attention
    mass a pattern keeps or drops). q [H, N_q, D], k [H, N_k, D]; the scores and the softmax in
    float64 for float64 inputs (exact), else in float32 (about 1e-6 relative), the block sums in
    float64; a chunk of query blocks at a time on q's device (memory: H x chunk x N_k)."""
    _check_qk(q, k)
    heads, n_q, d = q.shape
    n_k, g = k.shape[1], _block_size(block_size)
    qb, kb = -(-n_q // g), -(-n_k // g)
    scale = _tensors.resolve_scale(scale, d)
    if _cpu_fast(q, k):  # the library's blocked CPU loops
        out = torch.empty(heads, qb, kb, dtype=torch.float64)
        _C.block_attention_mass(*_nhd(q, k), g, causal, scale, out.data_ptr())
        return out
    return _block_sums(q, k, None, g, causal, scale)[0]


def block_value_mass(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_size: int,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Each block's attention mass and value sum: ``(mass, value)``, float64 [H, query blocks, key
    blocks] and [H, query blocks, key blocks, Dv], where ``value[h, r, c]`` is the softmax weights
    of the block times the keys' values, summed over the block's keys and averaged over its rows
    as :func:`block_mass` averages the mass (so ``value.sum(2)`` is each block row's mean
    attention output). q [H, N_q, D], k [H, N_k, D], v [H, N_k, Dv]; what
    :func:`prune_blocks_by_output` selects from. CPU inputs other than float64 run the library's
    loops (float32 scores, OpenMP), the rest torch ops on q's device (float64 scores for float64
    inputs, else float32); sums in float64."""
    if v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"v must be [H, N_k, Dv] as k, got {tuple(v.shape)} for k {tuple(k.shape)}"
        )
    _check_qk(q, k)
    g, scale = _block_size(block_size), _tensors.resolve_scale(scale, q.shape[2])
    if _cpu_fast(q, k) and v.dtype == q.dtype:  # the library's blocked CPU loops
        qb, kb = -(-q.shape[1] // g), -(-k.shape[1] // g)
        mass = torch.empty(q.shape[0], qb, kb, dtype=torch.float64)
        value = torch.empty(q.shape[0], qb, kb, v.shape[2], dtype=torch.float64)
        _C.block_value_mass(
            *_nhd(q, k), *_nhd(v), g, causal, scale, mass.data_ptr(), value.data_ptr()
        )
        return mass, value
    return _block_sums(q, k, v, g, causal, scale)


def _check_qk(q: Tensor, k: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [H, N, D] alike, got {tuple(q.shape)}, {tuple(k.shape)}")


def _block_size(block_size) -> int:
    """block_size as an int, checked (>= 1)."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


def _check_pruning(method: str, sparsity: float) -> None:
    """A learner's pruning method and sparsity, checked."""
    if method not in ("row", "global", "threshold", "output"):
        raise ValueError(f"method must be row, global, threshold or output, not {method!r}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")


_KEEP_RULES = {"keep_diagonal": True, "window": 0, "global_blocks": 0, "top_p": 0.9}


def _keep_rules(**rules) -> dict:
    """The keep rules (and top_p) with their defaults, checked: names, window and global_blocks
    >= 0, top_p in (0, 1]."""
    unknown = set(rules) - set(_KEEP_RULES)
    if unknown:
        raise TypeError(f"unknown keep rules {sorted(unknown)} (known: {sorted(_KEEP_RULES)})")
    rules = {**_KEEP_RULES, **rules}
    for name in ("window", "global_blocks"):
        if rules[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {rules[name]}")
    if not 0.0 < rules["top_p"] <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {rules['top_p']}")
    return rules


def _block_sums(q, k, v, g, causal, scale):
    """block_mass's torch path, and with v the blocks' value sums (block_value_mass)."""
    heads, n_q, _ = q.shape
    n_k = k.shape[1]
    qb, kb = -(-n_q // g), -(-n_k // g)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc = q.to(dtype), k.to(dtype)
    out = torch.zeros(heads, qb, kb, dtype=torch.float64, device=q.device)
    value = vb = None
    if v is not None:
        vb = torch.nn.functional.pad(v.to(dtype), (0, 0, 0, kb * g - n_k)).view(heads, kb, g, -1)
        value = torch.zeros(heads, qb, kb, v.shape[2], dtype=torch.float64, device=q.device)
    step = max(1, (1 << 24) // max(1, heads * n_k * g))  # query blocks a chunk
    for r0 in range(0, qb, step):
        rows = slice(r0 * g, min(n_q, (r0 + step) * g))
        s = (qc[:, rows] @ kc.transpose(1, 2)) * scale  # [H, rows, N_k]
        if causal:
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None] + (n_k - n_q)
            s = s.masked_fill(torch.arange(n_k, device=q.device)[None, :] > i, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        blocks = -(-(rows.stop - rows.start) // g)
        p = torch.nn.functional.pad(p, (0, 0, 0, blocks * g - p.shape[1]))  # whole blocks
        out[:, r0 : r0 + blocks], sums = _block_row_sums(p, vb, g)
        if value is not None:
            value[:, r0 : r0 + blocks] = sums
    counts = torch.clamp(n_q - torch.arange(qb, device=q.device) * g, max=g).to(torch.float64)
    if value is not None:
        value /= counts[None, :, None, None]
    return out / counts[None, :, None], value


def _block_row_sums(p: Tensor, vb: Tensor | None, g: int) -> tuple[Tensor, Tensor | None]:
    """Softmax weights p [H, R·g, N_k] of R whole block rows (padding rows zero) summed per block:
    ([H, R, kb] masses, [H, R, kb, Dv] value sums with the values vb [H, kb, g, Dv], or None), in
    float64, not yet divided by the rows; _block_sums' and _sampled_stats' one summation."""
    heads, n, n_k = p.shape
    kb = -(-n_k // g)
    p = torch.nn.functional.pad(p, (0, kb * g - n_k))
    per_key = p.view(heads, n // g, g, kb, g).sum(2, dtype=torch.float64)  # over the rows
    value = None if vb is None else torch.einsum("hrkj,hkjd->hrkd", per_key, vb.double())
    return per_key.sum(-1), value


def pooled_block_mass(
    q: Tensor, k: Tensor, block_size: int, causal: bool = False, scale: float | None = None
) -> Tensor:
    """An estimate of each block's attention mass from pooled queries and keys (the scores top-k
    block routing ranks by): per head and block row r, the softmax over key blocks c of
    scale <mean of r's q rows, mean of c's k rows> + log(c's keys), causal blocks past the
    diagonal excluded — float64 [H, query blocks, key blocks], rows summing to 1 (zeros where
    causal leaves a block row no key). q [H, N_q, D], k [H, N_k, D] on the CPU or CUDA (the
    library's loops, or two kernels on the current stream: no host synchronisation). What
    :class:`PatternLearner` gives the blocks the kernels do not see, inside training steps."""
    return _pooled_block_mass(q, k, block_size, causal, scale)


def _pooled_block_mass(
    q, k, block_size, causal, scale, out: Tensor | None = None, due: Tensor | None = None
) -> Tensor:
    """pooled_block_mass, written into `out` where given (float64, contiguous, its shape), and
    only where the bool `due` on q's device (if given) is true."""
    _check_qk(q, k)
    heads, n_q, d = q.shape
    n_k, g = k.shape[1], _block_size(block_size)
    qv, kv = (t.transpose(0, 1) for t in (q, k.to(q.dtype)))  # [N, H, D] views
    qv, kv = (t if t.stride(-1) == 1 else t.contiguous() for t in (qv, kv))
    if out is None:
        out = torch.empty(heads, -(-n_q // g), -(-n_k // g), dtype=torch.float64, device=q.device)
    nbytes = _C.pooled_block_mass_workspace_bytes(heads, n_q, n_k, d, g) if q.is_cuda else 0
    _owner, ws, ws_bytes = _tensors.workspace(nbytes, q.device)
    _C.pooled_block_mass(
        _tensors.view(qv),
        _tensors.view(kv),
        g,
        bool(causal),
        _tensors.resolve_scale(scale, d),
        out.data_ptr(),
        ws,
        ws_bytes,
        _tensors.stream(q.device),
        0 if due is None else due.data_ptr(),
    )
    return out


def prune_blocks(
    importance: Tensor,
    sparsity: float,
    method: str = "row",
    keep_diagonal: bool = True,
    window: int = 0,
    global_blocks: int = 0,
    top_p: float = 0.9,
) -> Tensor:
    """The blocks to keep (bool, importance's shape [H, qb, kb]) from a block importance (mass,
    |dS|, pooled scores): the forced blocks (the diagonal, a band of `window` blocks, the first
    `global_blocks` key blocks and block rows), then by `method`: "global" the highest-ranked
    blocks of each head up to (1 - sparsity) of its blocks, "row" each block row's highest up to
    (1 - sparsity) of its key blocks (at least one), "threshold" each block row's fewest blocks
    whose importance reaches `top_p` of the row's total (top-p; `sparsity` unused). Ties go to
    the lower key block. No host synchronisation: on CUDA "row" and "global" are the library's
    prune kernels (a radix select a row or head), the rest torch ops on importance's device."""
    if importance.dim() != 3:
        raise ValueError(f"importance must be [H, qb, kb], got {tuple(importance.shape)}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    _keep_rules(window=window, global_blocks=global_blocks, top_p=top_p)
    heads, qb, kb = importance.shape
    forced = _forced_blocks(qb, kb, importance.device, keep_diagonal, window, global_blocks)
    if importance.is_cuda and method in ("row", "global"):
        keep = torch.empty(heads, qb, kb, dtype=torch.bool, device=importance.device)
        budget = _prune_budget(sparsity, kb * (qb if method == "global" else 1))
        imp = importance.to(torch.float64).contiguous()
        _prune_kernel(imp, forced.expand(qb, kb).contiguous(), keep, None, budget, method)
        return keep
    return _prune(importance, forced.expand(heads, qb, kb), sparsity, method, top_p)


def _prune_kernel(importance, forced, keep, due, budget, method, workspace=None) -> None:
    """keep = the library's prune of importance (float64 [H, qb, kb], contiguous) with the forced
    blocks [qb, kb] (contiguous), where `due` (a device bool; None: always); `workspace`: its
    bytes (prune_block_importance_workspace_bytes), or None for one from the allocator."""
    heads, qb, kb = importance.shape
    dev = importance.device
    if workspace is None:
        workspace = _prune_workspace(heads, qb, kb, method, dev)
    _C.prune_block_importance(
        importance.data_ptr(),
        forced.data_ptr(),
        keep.data_ptr(),
        0 if due is None else due.data_ptr(),
        heads,
        qb,
        kb,
        budget,
        method,
        _tensors.device_index(dev),
        _tensors.stream(dev),
        workspace.data_ptr(),
        workspace.numel(),
    )


def _prune_workspace(heads, qb, kb, method, device) -> Tensor:
    """The prune kernels' workspace (bytes; none on the CPU)."""
    nbytes = _C.prune_block_importance_workspace_bytes(heads, qb, kb, method)
    return torch.empty(nbytes if device.type == "cuda" else 0, dtype=torch.uint8, device=device)


def _prune(importance: Tensor, forced: Tensor, sparsity: float, method: str, top_p: float):
    """prune_blocks by torch ops (a stable sort) with its forced blocks [H, qb, kb] given: the
    threshold method, the CPU's, and the reference the kernels are tested against."""
    heads, qb, kb = importance.shape
    dev = importance.device
    score = importance.to(torch.float64).masked_fill(forced, float("inf"))
    keep = torch.zeros(heads, qb, kb, dtype=torch.bool, device=dev)
    if method == "global":
        budget = _prune_budget(sparsity, qb * kb)
        flat = score.reshape(heads, -1)
        order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :budget]
        keep.view(heads, -1).scatter_(1, order, True)
    elif method == "row":
        budget = _prune_budget(sparsity, kb)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :budget]
        keep.scatter_(2, order, True)
    elif method == "threshold":
        imp = importance.to(torch.float64).clamp(min=0)
        order = torch.sort(imp, dim=-1, descending=True, stable=True)
        before = torch.cumsum(order.values, -1) - order.values  # mass of the higher-ranked ones
        need = before < top_p * imp.sum(-1, keepdim=True)
        keep.scatter_(2, order.indices, need)
    else:
        raise ValueError(f"method must be global, row or threshold, not {method!r}")
    return keep | forced


def _prune_budget(sparsity: float, n: int) -> int:
    """The blocks `sparsity` leaves of n: round((1 - sparsity) n), half to even, at least 1 (the
    library's prune_budget)."""
    return max(1, round((1.0 - sparsity) * n))


def _forced_blocks(qb, kb, device, keep_diagonal, window, global_blocks) -> Tensor:
    """[qb, kb]: the blocks the keep rules force (diagonal, band, global blocks)."""
    r = torch.arange(qb, device=device)[:, None]
    c = torch.arange(kb, device=device)[None, :]
    forced = (r - c).abs() <= window if (keep_diagonal or window > 0) else r < 0
    if global_blocks > 0:
        forced = forced | (c < global_blocks) | (r < global_blocks)
    return forced


def prune_blocks_by_output(
    mass: Tensor,
    value: Tensor,
    sparsity: float,
    keep_diagonal: bool = True,
    window: int = 0,
    global_blocks: int = 0,
    causal: bool = False,
) -> Tensor:
    """The blocks to keep (bool [H, qb, kb]) chosen for the attention output rather than the mass:
    each block row keeps (1 - sparsity) of its key blocks (causal: of the blocks it sees, the
    last block row aligned with the last key block; at least one; the keep rules' blocks first;
    blocks of no mass are never added), adding one block at a time, the one that brings the kept
    blocks' renormalised output sum(value) / sum(mass) nearest (L2) to the row's full output.
    `mass`, `value`: the blocks' statistics of :func:`block_value_mass` (or their average over
    samples). Where the attention spreads evenly (no block holds much mass) the mass says little
    about which blocks matter, the values do: the kept blocks are made to average to the dropped
    ones. Ties go to the lower key block. On the CPU the library's greedy (OpenMP), elsewhere
    torch ops on mass's device (float64, no host synchronisation): the same blocks."""
    if mass.dim() != 3 or value.dim() != 4 or value.shape[:3] != mass.shape:
        raise ValueError(
            f"mass must be [H, qb, kb] and value [H, qb, kb, Dv] over the same blocks, got "
            f"{tuple(mass.shape)} and {tuple(value.shape)}"
        )
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    _keep_rules(window=window, global_blocks=global_blocks)
    rules = (bool(keep_diagonal), int(window), int(global_blocks), bool(causal))
    if mass.device.type == "cpu":
        m, u = (t.to(torch.float64).contiguous() for t in (mass, value))
        keep = torch.empty(mass.shape, dtype=torch.uint8)
        _C.prune_blocks_by_output(
            m.data_ptr(), u.data_ptr(), *u.shape, float(sparsity), *rules, keep.data_ptr()
        )
        return keep.bool()
    return _prune_by_output_torch(mass, value, sparsity, *rules)


def _prune_by_output_torch(mass, value, sparsity, keep_diagonal, window, global_blocks, causal):
    """prune_blocks_by_output as torch ops on mass's device."""
    heads, qb, kb = mass.shape
    m, u = mass.to(torch.float64), value.to(torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    target = u.sum(2) / m.sum(2).clamp(min=tiny)[..., None]  # [H, qb, Dv]: the full output
    forced = _forced_blocks(qb, kb, m.device, keep_diagonal, window, global_blocks)
    keep = forced.expand(heads, qb, kb).clone()
    kept_m = (m * keep).sum(-1)
    kept_u = (u * keep[..., None]).sum(2)
    seen = torch.full((qb,), kb, device=m.device)
    if causal:
        seen = (torch.arange(qb, device=m.device) + 1 + kb - qb).clamp(1, kb)
    # [1, qb, 1]: float64 as the library's budget (llrint of a double)
    budget = torch.round((1.0 - sparsity) * seen.double()).clamp(min=1)[None, :, None]
    empty = m <= 0  # blocks no query of the row sees (causal): never worth a slot
    # One block a row a step; rows at their budget, or out of candidates, add nothing.
    for _ in range(max(1, round((1.0 - sparsity) * kb))):
        mixed = (kept_u[:, :, None] + u) / (kept_m[:, :, None] + m).clamp(min=tiny)[..., None]
        err = ((mixed - target[:, :, None]) ** 2).sum(-1).masked_fill(keep | empty, float("inf"))
        least, best = err.min(-1, keepdim=True)  # [H, qb, 1]: ties to the lower key block
        add = (keep.sum(-1, keepdim=True) < budget) & torch.isfinite(least)
        keep |= torch.zeros_like(keep).scatter_(2, best, add)
        kept_m += m.gather(2, best)[..., 0] * add[..., 0]
        gathered = u.gather(2, best[..., None].expand(heads, qb, 1, u.shape[3]))[:, :, 0]
        kept_u += gathered * add
    return keep


def learn_block_pattern(
    q: Tensor,
    k: Tensor,
    block_size: int,
    sparsity: float,
    method: str = "row",
    causal: bool = False,
    v: Tensor | None = None,
    **keep_rules,
) -> BlockPattern:
    """A pattern learned offline from attention samples: the blocks' exact attention mass
    (:func:`block_mass` of q [H, N_q, D], k [H, N_k, D]) pruned by :func:`prune_blocks` (`method`,
    `sparsity` and the keep rules) — per head, the blocks that carry the most attention. CPU
    inputs other than float64 run the library's learner (C++: blocked float32 scores, OpenMP,
    the same rules); the rest torch ops on q's device. ``method="output"`` with the values ``v``
    [H, N_k, Dv]: the blocks that keep the attention output (:func:`block_value_mass`, then
    :func:`prune_blocks_by_output`, causal budgets where `causal`)."""
    block_size = _block_size(block_size)
    rules = _keep_rules(**keep_rules)
    _check_pruning(method, sparsity)
    if method == "output" and v is None:
        raise ValueError('learn_block_pattern: method="output" needs the values v [H, N_k, Dv]')
    if method == "output" and not (_cpu_fast(q, k) and v.dtype == q.dtype):
        keep = prune_blocks_by_output(
            *block_value_mass(q, k, v, block_size, causal),
            sparsity,
            causal=causal,
            **{name: x for name, x in keep_rules.items() if name != "top_p"},
        )
        made_by = "attention mass and values"
    elif _cpu_fast(q, k):  # the library's learner (ops/pattern_learn.hpp), the same rules
        return BlockPattern(
            _C.BlockPattern.learn(
                *_nhd(q, k),
                block_size,
                method,
                float(sparsity),
                float(rules["top_p"]),
                bool(rules["keep_diagonal"]),
                int(rules["window"]),
                int(rules["global_blocks"]),
                bool(causal),
                _nhd(v)[0] if method == "output" else None,
            )
        )
    else:
        keep = prune_blocks(block_mass(q, k, block_size, causal), sparsity, method, **keep_rules)
        made_by = "attention mass"
    made_by = (
        f"learned from {made_by} of {q.shape[1]} queries x {k.shape[1]} keys, "
        f"{q.shape[0]} heads; prune {method} sparsity={sparsity} {keep_rules}"
    )
    return BlockPattern.from_blocks(
        keep.cpu(), block_size, rows=q.shape[1], cols=k.shape[1], made_by=made_by
    )


def _cpu_fast(q: Tensor, k: Tensor) -> bool:
    """Whether the C++ CPU path serves q and k: on the CPU, not float64 (its scores are float32;
    float64 inputs keep the exact torch path)."""
    return q.device.type == "cpu" and q.dtype != torch.float64 and k.dtype == q.dtype


def _nhd(*ts: Tensor) -> tuple:
    """[H, N, D] tensors (q, k, v) as the library's [N, H, D] views (no copy)."""
    return tuple(
        _tensors.view(t.transpose(0, 1) if t.stride(-1) == 1 else t.contiguous().transpose(0, 1))
        for t in ts
    )


def attention_error(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: BlockPattern,
    causal: bool = False,
    dense: Tensor | None = None,
) -> Tensor:
    """Per head, the relative L2 error ||O_pattern - O_dense|| / ||O_dense|| of the attention
    over the pattern's blocks against dense attention (float64 [H]), for q [H, N_q, D], k and v
    [H, N_k, D] in the pattern's node order (causal: keys up to each query's position, aligned at
    the bottom right, in both): how much of the attention a pattern loses. ``dense``: the dense
    output [H, N_q, Dv] when already computed (:func:`dense_attention`), for several patterns."""
    if not isinstance(pattern, BlockPattern):
        raise TypeError(f"pattern must be a trisparse.BlockPattern, got {type(pattern).__name__}")
    mask = pattern.to_block_mask(causal=causal, device=q.device)
    q64, k64, v64 = (t.to(torch.float64)[None] for t in (q, k, v))
    sparse = block_sparse_attention(q64, k64, v64, mask)[0]
    if dense is None:
        dense = dense_attention(q, k, v, causal)
    dense = dense.to(torch.float64)
    return (sparse - dense).flatten(1).norm(dim=1) / dense.flatten(1).norm(dim=1)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """Dense attention in float64 of q [H, N_q, D] over k, v [H, N_k, D] (causal: aligned at the
    bottom right), the reference :func:`attention_error` compares against."""
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    if causal and q64.shape[1] != k64.shape[1]:
        # SDPA's is_causal aligns at the top left; the library's masks at the bottom right, where
        # a query that sees no key gets zeros (whatever the SDPA backend gives such a row).
        rows = torch.arange(q64.shape[1], device=q.device)[:, None] + (k64.shape[1] - q64.shape[1])
        allowed = torch.arange(k64.shape[1], device=q.device)[None, :] <= rows
        out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=allowed)
        return out.masked_fill(~allowed.any(1)[:, None], 0.0)
    return torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)


class PatternLearner:
    """A block pattern learned while training (the plan's initialise → learn → prune → refine
    lifecycle, for one attention site). Two ways to feed it:

    - ``learner(q, k, v)`` in place of the site's attention ([B, H, N, D], one pattern per head
      for the batch): dense (SDPA) through the `warmup` steps (and until a pattern exists),
      folding the sampled exact mass of the first sequence; then block-sparse under the current
      pattern (with `initial`, its blocks from the first step past the warm-up), where every
      `track_every`-th step the kernels measure each kept block's attention mass in the backward
      (:class:`BlockImportance`, no extra pass; 4-9 % of an attention step on an H200 at D = 64,
      so about 1-2 % at the default cadence; inputs that need no gradient, as a frozen model's:
      the light pass after the forward) and the next call folds it in, with the blocks the
      pattern drops estimated from pooled queries and keys (:func:`pooled_block_mass`) so that
      they can come back;
    - ``observe(q, k)`` with q [H, N_q, D], k [H, N_k, D]: the exact mass (:func:`block_mass`
      over `sample_blocks` random query block rows, or all), and ``mask()`` for your own call.

    Either way the importance aggregates the observations: `aggregate` "ema" (an exponential moving
    average, `decay`), or "mean" / "max" over each block row's last `window` observations; the
    pattern is pruned from it (:func:`prune_blocks`: `sparsity`, `method` and keep rules) once
    past the warm-up, refreshed every `every` steps and frozen after `freeze_after` steps.

    ``method="output"`` chooses for the attention output (:func:`prune_blocks_by_output`) from
    the aggregated masses and value sums (:func:`block_value_mass`, in :attr:`values`): where the
    attention spreads evenly the mass cannot tell the blocks apart, the values can. The values
    are observed too (``observe(q, k, v)``), and in the block-sparse phase every
    `track_every`-th step takes the exact statistics of the sampled block rows of the first
    sequence by torch ops (sample_blocks · G queries against every key; the kernels measure no
    value sums) in place of the kernels' mass; "ema" or "mean" only. Block rows never
    observed keep an initial importance (uniform, or `initial`: a BlockPattern's kept blocks weigh
    1) so that an initialiser seeds the pattern. Everything runs as torch ops on q's device: no
    host synchronisation in a step. The pattern (:meth:`pattern`) can be saved and reloaded.

    ``capturable=True``: the block-sparse steps are the same launches at every step, so that a
    training step (forward, backward, optimizer) can be captured once in a CUDA graph and
    replayed: the step is counted on the device, and the kernels that track (the pooled
    estimate, the fold), prune and rewrite the mask's plan (:meth:`BlockMask.refresh_`) read
    flags computed from it and return at once where their work is not due, so the schedule
    (`track_every`, `every`, `freeze_after`) holds under replay at its own cost; the backward
    measures the mass at every step. The prune runs at the start of the step after it is due,
    before the fold of the previous step's mass; the outputs and the importance equal the
    default learner's step for step. Not with ``method="output"`` or `aggregate` other than
    "ema"; with "threshold" the prune is torch ops at every step (its result kept where due).
    Capture after the warm-up and at least two block-sparse steps (the warm-up of the capture
    itself); :attr:`steps` counts the host's calls, :meth:`device_steps` the replays too."""

    def __init__(
        self,
        block_size: int,
        sparsity: float,
        method: str = "row",
        every: int = 100,
        warmup: int = 0,
        freeze_after: int | None = None,
        decay: float = 0.9,
        sample_blocks: int | None = None,
        initial: BlockPattern | None = None,
        causal: bool = False,
        track_every: int | None = None,
        aggregate: str = "ema",
        window: int = 10,
        capturable: bool = False,
        **keep_rules,
    ):
        if capturable and (method == "output" or aggregate != "ema"):
            raise ValueError(
                'capturable=True: method "row", "global" or "threshold" and aggregate "ema", '
                f"got method {method!r}, aggregate {aggregate!r}"
            )
        track_every = 4 if track_every is None else track_every
        if aggregate not in ("ema", "mean", "max"):
            raise ValueError(f"aggregate must be ema, mean or max, not {aggregate!r}")
        if method == "output" and aggregate == "max":
            raise ValueError('method="output" averages value sums: aggregate "ema" or "mean"')
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.aggregate, self.window = aggregate, window
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if every < 1 or track_every < 1:
            raise ValueError(f"every and track_every must be >= 1, got {every}, {track_every}")
        _check_pruning(method, sparsity)
        _keep_rules(**keep_rules)
        self.block_size, self.sparsity, self.method = _block_size(block_size), sparsity, method
        self.every, self.warmup, self.freeze_after = every, warmup, freeze_after
        self.decay, self.sample_blocks, self.causal = decay, sample_blocks, causal
        self.track_every = track_every
        self.keep_rules = keep_rules
        self.initial = initial
        self.steps = 0
        self.importance: Tensor | None = None
        self.values: Tensor | None = None  # method "output": [H, qb, kb, Dv] value sums
        self._seen: Tensor | None = None
        self._all_seen = False
        self._keep: Tensor | None = None
        self._mask: BlockMask | None = None
        self.tracker = BlockImportance(measure_grad=False)  # the mass is what it folds
        self._history: list[Tensor] | None = None  # mean / max: [window, H, qb, kb(, Dv)]
        self._slot: Tensor | None = None  # [qb]: each block row's next slot
        # (keep, pooled, the tracker's steps before the measuring call)
        self._pending: tuple[Tensor, Tensor, int] | None = None
        self.capturable = bool(capturable)
        self._buffers: _CaptureBuffers | None = None  # capturable, from the first sparse step
        self._host_counts = True  # capturable: steps equals the device's count (no replay yet)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
        """The site's attention, q [B, H, N_q, D], k [B, H, N_k, D], v [B, H, N_k, Dv]
        (causal as the learner), and one learning step (see the class). With gradients off
        (evaluation) only the attention under the current pattern: no step, nothing observed."""
        if not torch.is_grad_enabled():
            if self._keep is None or self.steps < self.warmup:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=self.causal, scale=scale
                )
            return block_sparse_attention(q, k, v, self._block_mask(), scale=scale)
        self._fold_pending()
        g = self.block_size
        if self._keep is None and self.initial is not None and self.steps >= self.warmup:
            # Sparse from the first step past the warm-up: the initialiser's blocks.
            self._start(q.shape[1], -(-q.shape[2] // g), -(-k.shape[2] // g), q.device)
            self._keep = self.importance > 0
        if self._keep is None or self.steps < self.warmup:
            self.observe(q[0], k[0], v[0])
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, scale=scale
            )
        mask = self._block_mask()
        if self.capturable:
            return self._capturable_step(q, k, v, mask, scale)
        track = self.steps % self.track_every == 0 and not self._frozen()  # frozen: no use
        if track and self.method == "output":  # value sums: sampled rows, exact, by torch ops
            self._observe_rows(q[0].detach(), k[0].detach(), v[0].detach())
            track = False
        measured = self.tracker.steps  # the backward measures, or (no gradients) the forward
        out = block_sparse_attention(
            q, k, v, mask, scale=scale, importance=self.tracker if track else None
        )
        if track:
            with torch.no_grad():  # (fewer ops than detaching q and k)
                pooled = pooled_block_mass(q[0], k[0], self.block_size, self.causal, scale)
            self._pending = (self._keep, pooled, measured)
        self._advance(frozen=self._frozen())
        return out

    def _capturable_step(self, q: Tensor, k: Tensor, v: Tensor, mask, scale) -> Tensor:
        """A block-sparse step of capturable=True: the same launches every step (see the class).
        The order is the default learner's (fold the last step's mass, attend, prune when due)
        with the prune moved to the start of the next step, where it cannot change the mask
        under this step's backward."""
        b = self._buffers
        if b is None:  # the first block-sparse step: the pattern the warm-up left, made persistent
            if not self._keep.is_contiguous():
                self._keep, self._mask = self._keep.contiguous(), None
                mask = self._block_mask()
            b = self._buffers = _CaptureBuffers(
                steps=torch.tensor(self.steps, dtype=torch.int64, device=self._keep.device),
                flags=torch.zeros(3, dtype=torch.bool, device=self._keep.device),
                keep=torch.empty_like(self._keep),
                pooled=torch.empty(self._keep.shape, dtype=torch.float64, device=q.device),
                mass=torch.empty(q.shape[0], *self._keep.shape, device=q.device),
                measured=False,
            )
        # The default learner's schedule from the step count on the device, in one launch: the
        # last step's re-prune and fold, this step's pooled estimate (schedule_flags).
        freeze = -1 if self.freeze_after is None else self.freeze_after
        dev = self._keep.device
        _C.advance_learner_schedule(
            b.steps.data_ptr(),
            b.flags.data_ptr(),
            self.warmup,
            self.every,
            self.track_every,
            freeze,
            _tensors.device_index(dev),
            _tensors.stream(dev),
        )
        prune, fold, track = b.flags.unbind()
        if b.measured:  # (past the first block-sparse step: steps > warmup)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                self._host_counts = False  # replays count on the device alone from here
            s = self.steps  # the host's count, exact until a replay
            folds = (s - 1) % self.track_every == 0 and (self.freeze_after is None or s < freeze)
            self._prune_in_place(prune)
            self._fold_measured(b.mass, b.keep, b.pooled, fold, folds and self._host_counts)
        b.keep.copy_(self._keep)  # the blocks this step measures
        self.tracker._sink = b.mass
        out = block_sparse_attention(q, k, v, mask, scale=scale, importance=self.tracker)
        with torch.no_grad():  # (where the next step folds this one's mass)
            _pooled_block_mass(
                q[0], k[0], self.block_size, self.causal, scale, out=b.pooled, due=track
            )
        b.measured = True
        self.steps += 1
        return out

    def _prune_in_place(self, due: Tensor | None) -> None:
        """capturable: the pattern pruned from the importance where `due` (a device bool; None:
        now), written into the persistent keep and the mask's plans. "row" and "global": one
        library kernel that returns at once where not due; "threshold": torch ops, kept where
        due."""
        b = self._buffers
        rules = _keep_rules(**self.keep_rules)
        heads, qb, kb = self._keep.shape
        dev = self._keep.device
        if b.forced is None:
            b.forced = (
                _forced_blocks(
                    qb, kb, dev, rules["keep_diagonal"], rules["window"], rules["global_blocks"]
                )
                .expand(qb, kb)
                .contiguous()
            )
        if self.method == "threshold":
            forced = b.forced.expand(heads, qb, kb)
            new = _prune(self.importance, forced, self.sparsity, self.method, rules["top_p"])
            if due is None:
                self._keep.copy_(new)
            else:
                torch.where(due, new, self._keep, out=self._keep)
        else:
            budget = _prune_budget(self.sparsity, kb * (qb if self.method == "global" else 1))
            if b.prune_workspace is None:  # (kept: its address stays in a captured graph)
                b.prune_workspace = _prune_workspace(heads, qb, kb, self.method, dev)
            _prune_kernel(
                self.importance, b.forced, self._keep, due, budget, self.method, b.prune_workspace
            )
        self._block_mask().refresh_(due)

    def device_steps(self) -> int:
        """The steps taken, CUDA graph replays included (capturable; reads the device's count:
        a host synchronisation)."""
        return self.steps if self._buffers is None else int(self._buffers.steps)

    def observe(self, q: Tensor, k: Tensor, v: Tensor | None = None) -> None:
        """One step's q [H, N_q, D] and k [H, N_k, D] (and v [H, N_k, Dv], which
        ``method="output"`` needs; detached): the mass (and value sums) of the sampled block rows
        enter the average; the pattern is re-pruned when due."""
        frozen = self._frozen()
        if not frozen:
            self._observe_rows(q.detach(), k.detach(), None if v is None else v.detach())
        else:
            g = self.block_size
            self._start(q.shape[0], -(-q.shape[1] // g), -(-k.shape[1] // g), q.device)
        self._advance(frozen)

    def _observe_rows(self, q: Tensor, k: Tensor, v: Tensor | None) -> None:
        """Folds the exact statistics of the sampled block rows (all, without `sample_blocks`)."""
        if self.method == "output" and v is None:
            raise ValueError('PatternLearner(method="output") observes the values: give v')
        if self.method != "output":
            v = None  # the mass is all the other methods use
        g = self.block_size
        qb, kb = -(-q.shape[1] // g), -(-k.shape[1] // g)
        self._start(q.shape[0], qb, kb, q.device)
        rows = torch.arange(qb, device=q.device)
        if self.sample_blocks is not None and self.sample_blocks < qb:
            rows = torch.randperm(qb, device=q.device)[: self.sample_blocks]
        self._fold(rows, *_sampled_stats(q, k, v, g, rows, self.causal))

    def observe_importance(self, mass: Tensor, keep: Tensor, pooled: Tensor) -> None:
        """Folds a backward's kernel-measured mass ([B or 1, H, qb, kb], or [H, qb, kb]: the
        mean over the batch) of the blocks `keep` held, the rest from `pooled`
        (:func:`pooled_block_mass`): each kept block's share of its row's pooled estimate is
        split by the measured masses, dropped blocks keep their pooled estimate."""
        self._start(*mass.shape[-3:], mass.device)
        if self._frozen():
            return
        keep = keep if keep.device == mass.device else keep.to(mass.device)
        if self.aggregate == "ema" and mass.dtype == torch.float32:  # one library call
            mass = mass if mass.dim() == 4 else mass[None]
            shape = self.importance.shape
            if any(s != shape for s in (mass.shape[1:], keep.shape, pooled.shape)):
                raise ValueError(
                    f"mass {tuple(mass.shape)}, keep {tuple(keep.shape)} and pooled "
                    f"{tuple(pooled.shape)} must be [(B,) {', '.join(map(str, shape))}] as the "
                    "importance"
                )
            if self.importance.device != mass.device:
                raise ValueError(
                    f"mass is on {mass.device}, the learner's importance on "
                    f"{self.importance.device}"
                )
            keep = keep.to(torch.bool).contiguous()
            pooled = pooled.to(mass.device, torch.float64).contiguous()
            self._fold_measured(mass, keep, pooled)
            return
        if mass.dim() == 4:
            mass = mass[0] if mass.shape[0] == 1 else mass.mean(0)
        kept_share = (pooled * keep).sum(-1, keepdim=True)
        imp = torch.where(keep, mass.to(torch.float64) * kept_share, pooled)
        self._fold(None, imp)

    def _fold_measured(
        self,
        mass: Tensor,
        keep: Tensor,
        pooled: Tensor,
        due: Tensor | None = None,
        folds: bool = False,
    ) -> None:
        """The "ema" fold of float32 mass [B, H, qb, kb] (any strides), bool keep and float64
        pooled [H, qb, kb] (contiguous, on the importance's device) in one library call
        (fold_block_importance: the torch path's arithmetic), where the device bool `due` (if
        given) is true; `folds`: the host knows that it is."""
        heads, qb, kb = self.importance.shape
        _C.fold_block_importance(
            self.importance.data_ptr(),
            mass.data_ptr(),
            list(mass.stride()),
            mass.shape[0],
            keep.data_ptr(),
            pooled.data_ptr(),
            0 if self._all_seen else self._seen.data_ptr(),
            heads,
            qb,
            kb,
            self.decay,
            _tensors.device_index(mass.device),
            _tensors.stream(mass.device),
            0 if due is None else due.data_ptr(),
        )
        if self._all_seen:
            return
        if due is None or folds:
            self._seen.fill_(True)
            self._all_seen = True
        else:  # (the host does not know: the seen flags are kept on the device)
            torch.logical_or(self._seen, due, out=self._seen)

    def mask(self) -> BlockMask | None:
        """The current pattern as a mask for :func:`block_sparse_attention` (on q's device), or
        None while training stays dense."""
        if self._keep is None or self.steps <= self.warmup:
            return None
        return self._block_mask()

    def _block_mask(self) -> BlockMask:
        if self._mask is None:
            density = 1.0 - self.sparsity if self.method != "threshold" else None
            self._mask = BlockMask(self._keep[None], self.block_size, self.causal, density)
        return self._mask

    def pattern(self, rows: int, cols: int) -> BlockPattern:
        """The current pattern as a BlockPattern of rows x cols (reads it to the host)."""
        if self._keep is None:
            raise ValueError("PatternLearner: no pattern yet (observe past the warm-up first)")
        made_by = (
            f"PatternLearner: {self.steps} steps, {self._aggregation()}, prune {self.method} "
            f"sparsity={self.sparsity} {self.keep_rules}"
        )
        return BlockPattern.from_blocks(
            self._keep.cpu(), self.block_size, rows=rows, cols=cols, made_by=made_by
        )

    def _frozen(self) -> bool:
        return self.freeze_after is not None and self.steps >= self.freeze_after

    def _start(self, heads: int, qb: int, kb: int, device: torch.device) -> None:
        if self.importance is not None:
            return
        self.importance = torch.full((heads, qb, kb), 1.0 / kb, dtype=torch.float64, device=device)
        if self.initial is not None:
            init = self.initial.blocks().to(device, torch.float64)
            self.importance = init.expand(heads, qb, kb).clone()
        self._seen = torch.zeros(qb, dtype=torch.bool, device=device)
        self._all_seen = False  # known on the host once a fold covered every block row

    def _aggregation(self) -> str:
        if self.aggregate == "ema":
            return f"ema decay {self.decay}"
        return f"{self.aggregate} of the last {self.window} observations"

    def _fold(self, rows: Tensor | None, mass: Tensor, value: Tensor | None = None) -> None:
        """Aggregates block rows `rows`' new mass [H, R, kb] (and value sums [H, R, kb, Dv]);
        rows None: every block row (the kernels' measure), in fewer ops."""
        if value is not None and self.values is None:
            self.values = torch.zeros(
                *self.importance.shape, value.shape[-1], dtype=torch.float64, device=value.device
            )
        states = [(self.importance, mass)] + ([] if value is None else [(self.values, value)])
        if rows is None and self.aggregate == "ema":
            for state, new in states:
                if self._all_seen:  # every row observed before: the average alone
                    state.mul_(self.decay).add_(new, alpha=1 - self.decay)
                else:
                    seen = self._seen.view(1, -1, *[1] * (state.dim() - 2))
                    blend = (state * self.decay).add_(new, alpha=1 - self.decay)
                    state.copy_(torch.where(seen, blend, new))
            if not self._all_seen:
                self._seen.fill_(True)
                self._all_seen = True
            return
        if rows is None:
            rows = torch.arange(self.importance.shape[1], device=mass.device)
        if self.aggregate == "ema":
            for state, new in states:
                seen = self._seen[rows].view(1, -1, *[1] * (state.dim() - 2))
                state[:, rows] = torch.where(
                    seen, self.decay * state[:, rows] + (1 - self.decay) * new, new
                )
        else:  # the rows' observations in a ring of `window` slots a row (NaN: none yet)
            if self._history is None:
                self._history = []
                self._slot = torch.zeros(
                    self.importance.shape[1], dtype=torch.int64, device=self.importance.device
                )
            slot = self._slot[rows]
            for i, (state, new) in enumerate(states):
                if len(self._history) == i:
                    self._history.append(
                        torch.full(
                            (self.window, *state.shape),
                            torch.nan,
                            dtype=torch.float64,
                            device=state.device,
                        )
                    )
                self._history[i][slot, :, rows] = new.transpose(0, 1)
                window = self._history[i][:, :, rows]
                if self.aggregate == "mean":
                    state[:, rows] = window.nanmean(0)
                else:
                    state[:, rows] = window.nan_to_num(-torch.inf).amax(0)
            self._slot.index_put_((rows,), (slot + 1) % self.window)
        self._seen.index_fill_(0, rows, True)  # no host tensor: capturable in a CUDA graph

    def _fold_pending(self) -> None:
        # A tracked step whose backward has run since: its kernel-measured mass.
        if self._pending is not None and self.tracker.steps > self._pending[2]:
            keep, pooled, _ = self._pending
            self._pending = None
            mass = self.tracker.mass
            fast = self.aggregate == "ema" and mass.shape[1:] == keep.shape
            if fast and keep.is_contiguous() and not self._frozen():
                self._fold_measured(mass, keep, pooled)  # (all made here: no conversion)
            else:
                self.observe_importance(mass, keep, pooled)

    def _advance(self, frozen: bool) -> None:
        self.steps += 1
        due = self._keep is None or (self.steps - self.warmup - 1) % self.every == 0
        if self.steps > self.warmup and due and not (frozen and self._keep is not None):
            if self._buffers is not None:  # capturable: in place, the plans rewritten
                self._prune_in_place(None)
                return
            if self.method != "output":
                self._keep = prune_blocks(
                    self.importance, self.sparsity, self.method, **self.keep_rules
                )
            else:
                rules = {k: x for k, x in self.keep_rules.items() if k != "top_p"}
                # Block rows not observed yet: by their initial importance.
                self._keep = prune_blocks(self.importance, self.sparsity, "row", **rules)
                if self.values is not None:
                    by_output = prune_blocks_by_output(
                        self.importance, self.values, self.sparsity, causal=self.causal, **rules
                    )
                    self._keep = torch.where(self._seen[None, :, None], by_output, self._keep)
            self._mask = None


@dataclasses.dataclass
class _CaptureBuffers:
    """A capturable PatternLearner's state that crosses steps at fixed addresses: the step count,
    the blocks the last step measured, its pooled estimate and its measured mass."""

    steps: Tensor  # int64, on the device
    flags: Tensor  # [3] bool: this step's prune, fold and track (schedule_flags)
    keep: Tensor
    pooled: Tensor
    mass: Tensor  # [B, H, qb, kb] float32, written by the backward (BlockImportance's sink)
    measured: bool  # whether a step has measured into them yet
    forced: Tensor | None = None  # [qb, kb]: the blocks the keep rules force (every head)
    prune_workspace: Tensor | None = None  # the prune kernel's (a long head's global prune)


def _sampled_stats(q, k, v, g, rows, causal):
    """(mass, value sums or None) of the whole block rows `rows` ([R] block indices), as
    block_value_mass gives them: [H, R, kb] and [H, R, kb, Dv]. A partial last block's rows past
    N_q weigh nothing (masked, not dropped: no shape depends on data); float64. The rows in
    chunks of about 2^26 scores (at 32K keys and 8 heads, 4 block rows of 64)."""
    n_q, n_k = q.shape[1], k.shape[1]
    step = max(1, (1 << 26) // max(1, q.shape[0] * n_k * g))
    if rows.numel() > step:
        parts = [
            _sampled_stats(q, k, v, g, rows[i : i + step], causal)
            for i in range(0, rows.numel(), step)
        ]
        value = None if v is None else torch.cat([x for _, x in parts], 1)
        return torch.cat([m for m, _ in parts], 1), value
    kb, r = -(-n_k // g), rows.numel()
    elems = (rows[:, None] * g + torch.arange(g, device=q.device)).reshape(-1)
    valid = (elems < n_q).to(torch.float64)
    at = elems.clamp(max=n_q - 1)
    scale = _tensors.resolve_scale(None, q.shape[2])
    s = (q[:, at].to(torch.float64) @ k.to(torch.float64).transpose(1, 2)) * scale
    if causal:
        limit = at[:, None] + (n_k - n_q)
        s = s.masked_fill(torch.arange(n_k, device=q.device)[None, :] > limit, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0) * valid[None, :, None]
    vb = None
    if v is not None:
        vb = torch.nn.functional.pad(v, (0, 0, 0, kb * g - n_k)).view(v.shape[0], kb, g, -1)
    mass, value = _block_row_sums(p, vb, g)
    counts = valid.view(r, g).sum(1).clamp(min=1)[None, :, None]
    return mass / counts, None if value is None else value / counts[..., None]
