"""trisparse.BlockPattern: a block-sparse attention pattern that is made, kept and reused (the
learned-pattern plan's pattern object) over the C++ ``block_pattern``: per head, the kept G x G
blocks of an N_q x N_k score matrix, the node order they refer to, and how the pattern was made;
its statistics, its file, and the masks the attention takes."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import _C
from .block_sparse import BlockMask

__all__ = ["BlockPattern"]


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
        """A PNG (Pillow's encoder) with one panel per head, `columns` panels a row: each pixel
        the share of kept blocks in its cell (dark: kept, white: dropped), cells of several
        blocks where a head has more than `max_side` block rows or columns (so that 10^4 x 10^4
        blocks stay readable), and small patterns scaled up to at least 256 pixels a side."""
        try:
            from PIL import Image
        except ImportError as e:  # an optional dependency
            raise ImportError("BlockPattern.to_png needs Pillow: pip install pillow") from e
        rows, cols = self.shape
        g = self.block_size
        qb, kb = -(-rows // g), -(-cols // g)
        cell = max(1, -(-max(qb, kb) // max_side))  # blocks a pixel a side
        up = max(1, 256 // max(qb, kb, 1)) if cell == 1 else 1  # pixels a block a side
        h_px, w_px = -(-qb // cell) * up, -(-kb // cell) * up
        gap, per_row = 4, max(1, min(columns, self.num_heads))
        n_rows = -(-self.num_heads // per_row)
        canvas = torch.full(
            (n_rows * (h_px + gap) - gap, per_row * (w_px + gap) - gap), 255, dtype=torch.uint8
        )
        for h in range(self.num_heads):
            row_ptr, col_idx = self.head(h)
            r = torch.repeat_interleave(torch.arange(qb), row_ptr.diff()) // cell
            c = col_idx.long() // cell
            grid = torch.zeros(-(-qb // cell), -(-kb // cell), dtype=torch.float64)
            grid.index_put_((r, c), torch.ones(r.numel(), dtype=torch.float64), accumulate=True)
            shade = (255 - torch.round(255 * (grid / (cell * cell)).clamp(max=1))).to(torch.uint8)
            shade = shade.repeat_interleave(up, 0).repeat_interleave(up, 1)
            y, x = (h // per_row) * (h_px + gap), (h % per_row) * (w_px + gap)
            canvas[y : y + h_px, x : x + w_px] = shade
        Image.fromarray(canvas.numpy(), mode="L").save(os.fspath(path), format="PNG")

    def to_block_mask(self, causal: bool = False, device: torch.device | str | None = None):
        """A :class:`trisparse.BlockMask` ([1, H, qb, kb]) for :func:`block_sparse_attention`
        over tensors in the pattern's node order, its table on `device` (default the CPU)."""
        dense = self.blocks()[None]
        density = float(dense.float().mean()) if dense.numel() else 0.0
        return BlockMask(dense.to(device or "cpu"), self.block_size, causal, density=density)

    def __repr__(self) -> str:
        rows, cols = self.shape
        return (
            f"BlockPattern(heads={self.num_heads}, shape=({rows}, {cols}), "
            f"block_size={self.block_size}, made_by={self.made_by!r})"
        )
