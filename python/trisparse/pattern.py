"""The attention pattern: which keys (sources) each query (target) attends to.

A Pattern is built once per graph from whatever the user holds (PyG's ``edge_index``, an
``EdgeIndex``, a ``SparseTensor``, a torch sparse tensor, or CSR arrays) and keeps the formats the
kernels need (the plans of the C++ library) per device, so a training loop builds them once and
reuses them at every step.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from . import _C
from ._registry import Registry
from ._tensors import device_index, stream

_patterns = Registry("pattern", "trisparse.Pattern")


def lookup(pattern_id: int) -> Pattern:
    """The live Pattern with this id (the ops take the id, as torch.library ops take no objects)."""
    return _patterns.lookup(pattern_id)


def row_offsets(rows_of_entries: torch.Tensor, num_rows: int) -> torch.Tensor:
    """CSR row offsets [num_rows + 1] (int64) of entries sorted by row."""
    rowptr = torch.zeros(num_rows + 1, dtype=torch.int64, device=rows_of_entries.device)
    if num_rows > 0:
        torch.cumsum(torch.bincount(rows_of_entries, minlength=num_rows), 0, out=rowptr[1:])
    return rowptr


def coo_to_csr(
    row: torch.Tensor, col: torch.Tensor, num_rows: int, num_cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The canonical CSR of entries (row[e], col[e]) given in any order, repeats merged, on their
    device: (row offsets int64 [num_rows + 1], column ids int32 [nnz] ascending within each row,
    the entry of each input pair int64 [E]). The one COO -> CSR of the package (its transpose:
    the same with row and col swapped)."""
    width = max(num_cols, 1)
    key, inverse = torch.unique(row * width + col, sorted=True, return_inverse=True)
    r = torch.div(key, width, rounding_mode="floor")
    return row_offsets(r, num_rows), (key - r * width).to(torch.int32), inverse


def check_edge_ids(row: torch.Tensor, col: torch.Tensor, num_rows: int, num_cols: int) -> None:
    """Raises ValueError, naming the side, unless 0 <= row < num_rows and 0 <= col < num_cols."""
    if row.numel() == 0:
        return
    for t, n, what in ((row, num_rows, "target (row)"), (col, num_cols, "source (column)")):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= n:
            raise ValueError(
                f"edge_index: a {what} id is out of range: ids span [{lo}, {hi}] but there are "
                f"{n} nodes on that side"
            )


def _check_index(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must hold int32 or int64 indices, got {t.dtype}")
    return t.to(torch.int64)


_CSR_CHECK_CHUNK = 1 << 28


def _range_rows(rowptr: torch.Tensor, r0: int, r1: int, first: int) -> torch.Tensor:
    """The row id of each entry of rows [r0, r1), numbered from `first` (int64, on rowptr's
    device)."""
    counts = rowptr[r0 : r1 + 1].diff()
    ids = torch.arange(first, first + r1 - r0, device=rowptr.device)
    return torch.repeat_interleave(ids, counts, output_size=int(rowptr[r1] - rowptr[r0]))


# Pattern.undirected reads the columns in pieces of this many entries.
_UNDIRECTED_PIECE = 1 << 30


def _check_sorted_csr(rowptr: torch.Tensor, col: torch.Tensor, num_cols: int) -> None:
    """ValueError unless rowptr starts at 0, never decreases and ends at col's length, and col
    lies in [0, num_cols), ascending and unique within each row (chunks of _CSR_CHECK_CHUNK
    entries)."""
    nnz = col.numel()
    if int(rowptr[0]) != 0 or int(rowptr[-1]) != nnz or bool((rowptr.diff() < 0).any()):
        raise ValueError(f"rowptr must start at 0, never decrease and end at col's length {nnz}")
    if rowptr.numel() - 1 >= 2**31 or num_cols >= 2**31 or num_cols < 0:
        raise ValueError("node ids are 32-bit: rows and num_cols must be below 2^31")
    chunk = _CSR_CHECK_CHUNK
    for a in range(0, nnz, chunk):
        b = min(a + chunk, nnz)
        part = col[a:b]
        if int(part.min()) < 0 or int(part.max()) >= num_cols:
            raise ValueError(f"col must lie in [0, {num_cols})")
        step = col[a + 1 : b + 1] if b < nnz else col[a + 1 : b]
        up = step > part[: step.numel()]
        # a row starting at position p + 1 may start lower than position p ends
        starts = rowptr[(rowptr > a) & (rowptr <= a + step.numel())] - 1 - a
        up[starts] = True
        if not bool(up.all()):
            raise ValueError("col must be ascending and unique within each row")


def check_batch(batch: Any, num_nodes: int | None) -> None:
    """TypeError / ValueError unless ``batch`` is a 1-D int64 or int32 vector of ``num_nodes``
    (None: any count) graph ids, sorted and >= 0, as PyG's mini-batches are (one device round
    trip)."""
    if not isinstance(batch, torch.Tensor) or batch.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"batch must be an int64 or int32 tensor, got {getattr(batch, 'dtype', type(batch))}"
        )
    if batch.dim() != 1:
        raise ValueError(f"batch must be 1-D [num_nodes], got {tuple(batch.shape)}")
    if num_nodes is not None and batch.numel() != num_nodes:
        raise ValueError(f"batch has {batch.numel()} entries for {num_nodes} nodes")
    if batch.numel() and bool(((batch[1:] < batch[:-1]).any() | (batch[0] < 0)).item()):
        raise ValueError(
            "batch must be sorted with graph ids >= 0 (PyG's mini-batches are: nodes of graph 0 "
            "first, then graph 1, ...)"
        )


class Pattern:
    """A ``num_rows x num_cols`` binary pattern: row i (a target node, a query) attends to the
    columns (source nodes, keys) of its entries. Entries are sorted and unique; repeated edges of
    the input are merged (``duplicates`` says how many were) and remembered: each input edge's
    entry (:meth:`entries_of_input`) and each entry's count (:meth:`multiplicity`), so that the
    layers count every copy as PyG does."""

    PLAN_CACHES = (
        "_plans",
        "_edge_plans",
        "_gat_plans",
        "_per_device",
    )  # freed at exit (_registry)

    def __init__(self, rowptr: torch.Tensor, col: torch.Tensor, num_cols: int, duplicates: int):
        # Canonical CSR: rowptr int64 [rows + 1], col int32 [nnz], sorted and unique per row.
        self.rowptr = rowptr
        self.col = col
        self.num_rows = rowptr.numel() - 1
        self.num_cols = int(num_cols)
        self.nnz = col.numel()
        self.duplicates = int(duplicates)
        self.id = _patterns.add(self)
        self._copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {
            rowptr.device: (rowptr, col)
        }
        self._plans: dict[tuple[torch.device, bool], Any] = {}
        self._edge_plans: dict[tuple[torch.device, bool], Any] = {}
        self._gat_plans: dict[torch.device, Any] = {}
        self._entries: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._transpose_perm: dict[torch.device, torch.Tensor] = {}
        self._column_pointers: dict[torch.device, torch.Tensor] = {}
        # from_coo / from_edge_index: the entry of each input pair, in input order.
        self._input_entries: torch.Tensor | None = None
        self._input_order: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # CUDA plans keep the rows in order (no reordering search) where the builder knows the
        # pattern is already banded (from_batch's blocks).
        self._keep_order = False
        # from_edge_index with add_self_loops: the input edges kept (not self loops), in order.
        self._kept_edges: torch.Tensor | None = None
        self._per_device: dict[tuple[str, torch.device], Any] = {}
        # Known equal to its transpose (undirected()'s): transposed sums run the forward's lines.
        self.symmetric = False

    # --- builders -------------------------------------------------------------------------------

    @classmethod
    def from_coo(
        cls, row: torch.Tensor, col: torch.Tensor, num_rows: int, num_cols: int
    ) -> Pattern:
        """From entries (row[e], col[e]) in any order, repeats allowed."""
        row = _check_index(row, "row")
        col = _check_index(col, "col")
        if row.dim() != 1 or col.dim() != 1 or row.numel() != col.numel():
            raise ValueError(
                f"row and col must be 1-D of one length, got {tuple(row.shape)} and "
                f"{tuple(col.shape)}"
            )
        if num_rows < 0 or num_cols < 0:
            raise ValueError(f"the size must be non-negative, got ({num_rows}, {num_cols})")
        if num_cols >= 2**31:
            raise ValueError(f"num_cols {num_cols} does not fit the kernels' 32-bit column ids")
        check_edge_ids(row, col, num_rows, num_cols)
        rowptr, col_ids, inverse = coo_to_csr(row, col, num_rows, num_cols)
        pattern = cls(rowptr, col_ids, num_cols, row.numel() - col_ids.numel())
        pattern._input_entries = inverse
        return pattern

    @classmethod
    def from_edge_index(
        cls,
        edge_index: torch.Tensor,
        num_nodes: int | None = None,
        size: tuple[int, int] | None = None,
        add_self_loops: bool = False,
    ) -> Pattern:
        """From PyG's ``edge_index`` [2, E]: row 0 holds sources j, row 1 targets i, and each
        target attends to its incoming edges (``flow="source_to_target"``). ``size`` is PyG's
        ``(num_src_nodes, num_dst_nodes)`` for bipartite graphs; else ``num_nodes`` (default: the
        largest id + 1, or the EdgeIndex's sparse size). ``add_self_loops``: as PyG's
        ``remove_self_loops`` then ``add_self_loops``, one (i, i) per node i."""
        ei = _check_index(edge_index, "edge_index")
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise ValueError(f"edge_index must have shape [2, E], got {tuple(ei.shape)}")
        if size is None:
            sparse_size = getattr(edge_index, "sparse_size", None)
            known = sparse_size() if callable(sparse_size) else (None, None)
            if num_nodes is None and None not in known:
                size = (int(known[0]), int(known[1]))
            else:
                n = num_nodes if num_nodes is not None else (int(ei.max()) + 1 if ei.numel() else 0)
                size = (n, n)
        num_src, num_dst = int(size[0]), int(size[1])
        dst, src = ei[1], ei[0]
        kept = None
        if add_self_loops:
            keep = dst != src
            kept = keep.nonzero().view(-1)
            loops = torch.arange(min(num_src, num_dst), device=ei.device)
            dst, src = torch.cat([dst[kept], loops]), torch.cat([src[kept], loops])
        pattern = cls.from_coo(dst, src, num_dst, num_src)
        pattern._kept_edges = kept
        return pattern

    @classmethod
    def from_csr(cls, rowptr: torch.Tensor, col: torch.Tensor, num_cols: int) -> Pattern:
        """From CSR arrays of the targets' rows (columns may be unsorted or repeated)."""
        rowptr = _check_index(rowptr, "rowptr")
        col = _check_index(col, "col")
        if rowptr.dim() != 1 or rowptr.numel() < 1:
            raise ValueError(f"rowptr must be 1-D with rows + 1 entries, got {tuple(rowptr.shape)}")
        counts = rowptr[1:] - rowptr[:-1]
        if int(rowptr[0]) != 0 or int(rowptr[-1]) != col.numel() or bool((counts < 0).any()):
            raise ValueError(
                f"rowptr must start at 0, never decrease and end at col's length {col.numel()}"
            )
        rows = torch.repeat_interleave(torch.arange(rowptr.numel() - 1, device=col.device), counts)
        return cls.from_coo(rows, col, rowptr.numel() - 1, num_cols)

    @classmethod
    def from_sorted_csr(
        cls, rowptr: torch.Tensor, col: torch.Tensor, num_cols: int, check: bool = True
    ) -> Pattern:
        """From CSR arrays that are canonical already: rowptr int64 [rows + 1], col int32 [nnz]
        ascending and unique within each row (as a graph's CSR file or a generator gives them);
        taken as they are, without a sort or a copy, so that patterns of billions of entries fit
        (entries past 2^31: :func:`trisparse.edge_attention` runs them forward). ``check``: verify
        that on their device, in chunks (a few passes over col). Repeated pairs cannot be given
        here; use :meth:`from_csr`."""
        for t, name, dtype in ((rowptr, "rowptr", torch.int64), (col, "col", torch.int32)):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                raise TypeError(f"{name} must be a 1-D {dtype} tensor")
        if rowptr.device != col.device or rowptr.numel() < 1:
            raise ValueError("rowptr (rows + 1 entries) and col must be on one device")
        if check:
            _check_sorted_csr(rowptr, col, int(num_cols))
        return cls(rowptr, col, int(num_cols), 0)

    def undirected(self, chunk: int = 1 << 27) -> Pattern:
        """A ∪ Aᵀ of this square pattern (PyG's ``to_undirected`` on its pairs), built on the
        pattern's device: (i, j) is an entry if (i, j) or (j, i) is one here; a binary pattern
        (repeated input pairs count once), its CSR canonical, so the result is
        :meth:`from_sorted_csr`'s and may pass 2^31 entries. Memory: the result plus about
        ``chunk`` entries' work at a time (each pass over a range of output rows reads this
        pattern's columns in pieces of at most 2^30), so billions of entries fit."""
        if self.num_rows != self.num_cols:
            raise ValueError(
                f"undirected() needs a square pattern, this one is {self.num_rows} x {self.num_cols}"
            )
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        n, nnz, dev = self.num_rows, self.nnz, self.rowptr.device
        rowptr, col = self.rowptr, self.col
        if nnz == 0:
            result = Pattern.from_sorted_csr(rowptr.clone(), col.clone(), n, check=False)
            result.symmetric = True
            return result
        piece = _UNDIRECTED_PIECE  # torch's nonzero and bincount: < 2^31 elements at once
        pieces = range(0, nnz, piece)
        out_degree = torch.zeros(n, dtype=torch.int64, device=dev)
        for a in pieces:
            out_degree += torch.bincount(col[a : a + piece], minlength=n)
        # Output row ranges of at most `chunk` entries from A and from A^T (one row may exceed it).
        work = torch.cumsum(rowptr.diff() + out_degree, 0)
        del out_degree
        ends = torch.searchsorted(
            work, torch.arange(chunk, int(work[-1]) + chunk, chunk, device=dev)
        )
        bounds = sorted({0, n, *(min(int(e) + 1, n) for e in ends.tolist())})
        del work, ends
        out_col = torch.empty(2 * nnz, dtype=torch.int32, device=dev)
        counts = torch.zeros(n, dtype=torch.int64, device=dev)
        written = 0
        for r0, r1 in itertools.pairwise(bounds):
            lo, hi = int(rowptr[r0]), int(rowptr[r1])
            rows = _range_rows(rowptr, r0, r1, 0)
            keys = [rows * n + col[lo:hi]]
            for a in pieces:  # A's entries (i, j) with j in [r0, r1), as (j, i)
                part = col[a : a + piece]
                at = torch.nonzero((part >= r0) & (part < r1)).squeeze(1)
                sources = torch.searchsorted(rowptr, at + a, right=True) - 1
                keys.append((part[at].long() - r0) * n + sources)
            key = torch.unique(torch.cat(keys), sorted=True)
            del keys, rows
            local = torch.div(key, n, rounding_mode="floor")
            counts[r0:r1] = torch.bincount(local, minlength=r1 - r0)
            out_col[written : written + key.numel()] = key - local * n
            written += key.numel()
            del key, local
        out_rowptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=out_rowptr[1:])
        result = Pattern.from_sorted_csr(out_rowptr, out_col[:written], n, check=False)
        result.symmetric = True
        return result

    @classmethod
    def exphormer(
        cls,
        edge_index: torch.Tensor,
        num_nodes: int | None = None,
        expander_degree: int = 4,
        virtual_nodes: int = 1,
        add_self_loops: bool = True,
        seed: int = 0,
    ) -> Pattern:
        """Exphormer's sparse attention pattern (Shirzad et al., 2023) over ``num_nodes`` real
        nodes and ``virtual_nodes`` virtual ones numbered after them: the graph's edges (each
        target attends its sources, PyG's convention), a random ``expander_degree``-regular
        expander (the union of random permutations and their inverses, so both directions of
        each expander edge), every real node attending every virtual node and every virtual node
        attending every real node, and (``add_self_loops``) each node itself. Edges that several
        parts give are one entry (a binary pattern). Virtual rows attend all N nodes: the kernels
        cut such rows into chunks, so they do not serialise. ``seed`` draws the expander.

        An odd ``expander_degree`` is rounded up to even (each permutation gives every node one
        edge each way). Returns a square Pattern of num_nodes + virtual_nodes rows; its
        ``edge_index()`` gives the edges as PyG's ``edge_index``, for a PyG model of the same
        attention."""
        ei = _check_index(edge_index, "edge_index")
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise ValueError(f"edge_index must have shape [2, E], got {tuple(ei.shape)}")
        n = int(num_nodes) if num_nodes is not None else (int(ei.max()) + 1 if ei.numel() else 0)
        if expander_degree < 0 or virtual_nodes < 0:
            raise ValueError(
                f"expander_degree and virtual_nodes must be >= 0, got {expander_degree} and "
                f"{virtual_nodes}"
            )
        ei = ei.cpu()
        check_edge_ids(ei[1], ei[0], n, n)
        g = torch.Generator().manual_seed(seed)
        dst, src = [ei[1]], [ei[0]]
        nodes = torch.arange(n)
        for _ in range((expander_degree + 1) // 2):  # each permutation gives 2 edges a node
            perm = torch.randperm(n, generator=g)
            dst += [nodes, perm]
            src += [perm, nodes]
        for v in range(n, n + virtual_nodes):
            hub = torch.full((n,), v)
            dst += [nodes, hub]
            src += [hub, nodes]
        total = n + virtual_nodes
        if add_self_loops:
            dst.append(torch.arange(total))
            src.append(torch.arange(total))
        union = cls.from_coo(torch.cat(dst), torch.cat(src), total, total)
        return cls(union.rowptr, union.col, total, 0)  # binary: no multiplicities

    @classmethod
    def from_batch(cls, batch: torch.Tensor | None, num_nodes: int | None = None) -> Pattern:
        """Every node attends every node of its own graph (self included): the block-diagonal
        pattern of a PyG mini-batch, from its sorted ``batch`` vector (graph of each node; None:
        one graph of ``num_nodes``). Graph Transformers' global attention (GPS) over packed
        graphs, with no padding."""
        if batch is None:
            if num_nodes is None:
                raise ValueError("from_batch: give batch or num_nodes")
            counts = torch.tensor([int(num_nodes)], dtype=torch.int64)
        else:
            check_batch(batch, num_nodes)
            batch = batch.to(torch.int64)
            counts = torch.bincount(batch) if batch.numel() else batch.new_zeros(0)
        # On the batch's device (a GPU's takes ~1 ms where the host's takes ~100 for 4M entries).
        dev = counts.device
        starts = torch.cumsum(counts, 0) - counts
        graph_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
        degree = counts[graph_of_row]  # each row's graph size
        rowptr = torch.zeros(degree.numel() + 1, dtype=torch.int64, device=dev)
        torch.cumsum(degree, 0, out=rowptr[1:])
        entry_row = torch.repeat_interleave(
            torch.arange(degree.numel(), device=dev), degree, output_size=int(rowptr[-1])
        )
        col = starts[graph_of_row][entry_row] + (
            torch.arange(entry_row.numel(), device=dev) - rowptr[entry_row]
        )
        pattern = cls(rowptr, col.to(torch.int32), degree.numel(), 0)
        pattern._keep_order = True  # blocks on the diagonal: no reordering to search for
        return pattern

    @classmethod
    def of(cls, adj: Any, num_nodes: int | None = None) -> Pattern:
        """From any of: a Pattern (returned as is), ``edge_index`` [2, E] or ``EdgeIndex``,
        ``torch_sparse.SparseTensor`` (PyG's ``adj_t``: rows are targets), a torch sparse COO or
        CSR tensor (rows are targets), or a ``(rowptr, col)`` pair (with ``num_nodes`` columns)."""
        if isinstance(adj, Pattern):
            return adj
        if isinstance(adj, torch.Tensor):
            if adj.layout == torch.sparse_csr:
                return cls.from_csr(adj.crow_indices(), adj.col_indices(), adj.shape[1])
            if adj.layout == torch.sparse_coo:
                idx = adj.coalesce().indices()
                return cls.from_coo(idx[0], idx[1], adj.shape[0], adj.shape[1])
            return cls.from_edge_index(adj, num_nodes=num_nodes)
        if type(adj).__name__ == "SparseTensor" and hasattr(adj, "csr"):
            rowptr, col, _ = adj.csr()
            return cls.from_csr(rowptr, col, adj.sparse_size(1))
        if isinstance(adj, tuple) and len(adj) == 2:
            rowptr, col = adj
            cols = num_nodes if num_nodes is not None else rowptr.numel() - 1
            return cls.from_csr(rowptr, col, cols)
        raise TypeError(
            "adj must be a trisparse.Pattern, an edge_index tensor [2, E], an EdgeIndex, a "
            f"SparseTensor, a torch sparse tensor or a (rowptr, col) pair, got {type(adj).__name__}"
        )

    # --- plans ----------------------------------------------------------------------------------

    @property
    def num_edges(self) -> int:
        """The pairs of the input (each copy of a repeated pair counted): the rows of per-edge
        tensors such as ``edge_attr``; nnz for a pattern not built from pairs."""
        return self.nnz if self._input_entries is None else self._input_entries.numel()

    @property
    def device(self) -> torch.device:
        return self.rowptr.device

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._copies.get(device)
        if got is None:
            got = (self.rowptr.to(device).contiguous(), self.col.to(device).contiguous())
            self._copies[device] = got
        return got

    def plan(self, device: torch.device, gradients: bool = False):
        """The C++ plan for `device`, built on first use (it synchronises then; later runs do not).
        A plan with gradients serves the forward too."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for g in (True, gradients):
            plan = self._plans.get((device, g))
            if plan is not None:
                return plan
        # CPU plans, and CUDA plans with gradients of patterns whose rows the host build may
        # reorder, come from the host copy; other CUDA plans (a mini-batch's block-diagonal
        # pattern made on the GPU with gradients too: transposed there) from the device copy, with
        # no host trip but the work lists' offsets.
        host = device.type == "cpu" or (
            gradients and not (self._keep_order and self.rowptr.is_cuda)
        )
        rowptr, col = self._on(torch.device("cpu") if host else device)
        args = (rowptr.data_ptr(), col.data_ptr(), self.num_rows, self.num_cols, self.nnz)
        if device.type == "cpu":
            plan = _C.AttentionPlan.from_host(*args, "automatic", gradients, -1, 0)
        else:
            index = device_index(device)
            with torch.cuda.device(device):
                if host:
                    plan = _C.AttentionPlan.from_host(
                        *args, "automatic", gradients, index, stream(device), self._keep_order
                    )
                else:
                    plan = _C.AttentionPlan.from_device(
                        *args, "automatic", gradients, stream(device)
                    )
        self._plans[(device, gradients)] = plan
        return plan

    def row_pointers(self, device: torch.device) -> torch.Tensor:
        """The CSR row offsets (int64 [num_rows + 1]) on `device`; cached."""
        return self._on(device)[0]

    def entries(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of every entry in CSR order (the order of per-edge values), int64, on
        `device`; cached."""
        got = self._entries.get(device)
        if got is None:  # formed on `device` (a batch's pattern lives on the GPU)
            rowptr, col = self._on(device)
            rows = torch.arange(self.num_rows, device=device)
            row = torch.repeat_interleave(rows, rowptr.diff(), output_size=self.nnz)
            got = (row, col.to(torch.int64))
            self._entries[device] = got
        return got

    def _cached(self, name: str, device: torch.device, make):
        key = (name, device)
        got = self._per_device.get(key)
        if got is None:
            got = make()
            self._per_device[key] = got
        return got

    def entries_of_input(self, device: torch.device) -> torch.Tensor | None:
        """The entry (int64, on `device`) of each pair of the input the pattern was built from
        (``from_coo``, ``from_edge_index``, ``from_csr``), in the input's order; copies of a repeated
        edge share one entry. None for other patterns. Cached."""
        if self._input_entries is None:
            return None
        return self._cached("input_entries", device, lambda: self._input_entries.to(device))

    def entries_of(self, edge_index: torch.Tensor, check: bool = True) -> torch.Tensor:
        """The entry (int64, on edge_index's device) of each edge of ``edge_index`` [2, E] (row 0
        sources j, row 1 targets i: the pair (i, j)) in this pattern's entry order, for per-edge
        values on a pattern that holds the edges among others: a bias on the local edges of a
        mini-batch's block-diagonal pattern (:meth:`from_batch`), on the graph's edges of an
        :meth:`exphormer` pattern. Copies of a repeated edge share their entry. ``check`` (skipped
        while compiling): a ValueError naming the first edge that is not an entry (one device
        round trip)."""
        ei = _check_index(edge_index, "edge_index")
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise ValueError(f"edge_index must have shape [2, E], got {tuple(ei.shape)}")
        device = ei.device
        if ei.shape[1] == 0:
            return ei.new_zeros(0)
        if self.nnz == 0:
            raise ValueError("edge_index: the pattern has no entries to hold its edges")

        def make():  # row * num_cols + col: ascending in the canonical CSR
            rowptr, col = self._on(device)
            rows = torch.arange(self.num_rows, device=device)
            row = torch.repeat_interleave(rows, rowptr.diff(), output_size=self.nnz)
            return row * max(self.num_cols, 1) + col.to(torch.int64)

        keys = self._cached("pair_keys", device, make)
        dst, src = ei[1], ei[0]
        query = dst * max(self.num_cols, 1) + src
        entry = torch.searchsorted(keys, query).clamp_(max=self.nnz - 1)
        if check and not torch.compiler.is_compiling():
            bad = (src < 0) | (src >= self.num_cols) | (dst < 0) | (dst >= self.num_rows)
            bad |= keys[entry] != query
            if bool(bad.any()):
                e = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"edge_index: edge {e} ({int(src[e])} -> {int(dst[e])}) is not an entry of "
                    f"the pattern ({self.num_rows} x {self.num_cols}, {self.nnz} entries)"
                    + (
                        "; in a mini-batch's pattern an edge must join two nodes of one graph"
                        if self._keep_order
                        else ""
                    )
                )
        return entry

    def kept_edges(self, device: torch.device) -> torch.Tensor | None:
        """For a pattern from ``from_edge_index(..., add_self_loops=True)``: the edges of the
        given edge_index that were kept (not self loops), int64 in their order, on `device` (the
        pattern's input pairs are these, then one loop per node, as PyG's remove_self_loops and
        add_self_loops give them); else None. Cached."""
        if self._kept_edges is None:
            return None
        return self._cached("kept_edges", device, lambda: self._kept_edges.to(device))

    def multiplicity(self, device: torch.device) -> torch.Tensor | None:
        """How many input pairs each entry stands for (int64 [nnz] on `device`), or None when the
        input had no repeated pair. Cached."""
        if self.duplicates == 0 or self._input_entries is None:
            return None
        return self._cached(
            "multiplicity",
            device,
            lambda: torch.bincount(self._input_entries, minlength=self.nnz).to(device),
        )

    def log_multiplicity(self, device: torch.device) -> torch.Tensor | None:
        """log(multiplicity) (float64 [nnz] on `device`; the ops round it to their bias dtype): as the ``bias`` of
        :func:`trisparse.sparse_attention` it counts each copy of a repeated edge as a separate
        term of the softmax (as PyG does). None without repeats. Cached."""
        counts = self.multiplicity(device)
        if counts is None:
            return None
        return self._cached("log_multiplicity", device, lambda: counts.double().log())

    def copies_by_entry(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The input's pairs grouped by entry: (order, offsets), with input pairs order[offsets[e]
        : offsets[e + 1]] the copies of entry e in input order (int64, on `device`), for fixed-order
        reductions over copies. None for patterns not built from pairs. Cached."""
        if self._input_entries is None:
            return None

        def make():
            entries = self._input_entries
            order = torch.argsort(entries, stable=True)
            counts = torch.bincount(entries, minlength=self.nnz)
            offsets = torch.zeros(self.nnz + 1, dtype=torch.int64, device=entries.device)
            torch.cumsum(counts, 0, out=offsets[1:])
            return order.to(device), offsets.to(device)

        return self._cached("copies_by_entry", device, make)

    def input_order(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a pattern built from pairs without repeats (``from_coo``, ``from_edge_index``):
        (entry of each input pair in input order, and its inverse), on `device`; else None.
        Per-edge values gathered by the first are in the input's edge order (PyG's)."""
        if self._input_entries is None or self.duplicates != 0:
            return None
        got = self._input_order.get(device)
        if got is None:
            back = torch.empty_like(self._input_entries)
            back[self._input_entries] = torch.arange(back.numel(), device=back.device)
            got = (self._input_entries.to(device), back.to(device))
            self._input_order[device] = got
        return got

    def transpose_order(self, device: torch.device | None = None) -> torch.Tensor:
        """perm (int64, on `device`, default the CPU; cached) with entry t of the transposed
        pattern's CSR = entry perm[t] of this one's."""
        device = torch.device("cpu") if device is None else device
        perm = self._transpose_perm.get(device)
        if perm is None:
            host = self._transpose_perm.get(torch.device("cpu"))
            if host is None:
                row, col = self.entries(torch.device("cpu"))
                host = torch.argsort(col * max(self.num_rows, 1) + row, stable=True)
                self._transpose_perm[torch.device("cpu")] = host
            perm = host.to(device)
            self._transpose_perm[device] = perm
        return perm

    def column_pointers(self, device: torch.device) -> torch.Tensor:
        """The transposed pattern's CSR offsets (int64 [num_cols + 1]) on `device`: entries
        ``transpose_order()[column_pointers[j]:column_pointers[j + 1]]`` are column j's; cached."""
        got = self._column_pointers.get(device)
        if got is None:
            col = self.entries(torch.device("cpu"))[1]
            got = row_offsets(col[self.transpose_order()], self.num_cols).to(device)
            self._column_pointers[device] = got
        return got

    def edge_plan(self, device: torch.device, transposed: bool = False):
        """The C++ sparse plan (SpMM, SDDMM with per-edge values) of the pattern or of its
        transpose on `device`, built on first use."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        plan = self._edge_plans.get((device, transposed))
        if plan is None:
            rowptr, col = self._on(torch.device("cpu"))
            rows, cols = self.num_rows, self.num_cols
            if transposed:
                row, _ = self.entries(torch.device("cpu"))
                perm = self.transpose_order()
                rowptr = self.column_pointers(torch.device("cpu"))
                col = row[perm].to(torch.int32)
                rows, cols = cols, rows
            ones = torch.ones(col.numel(), dtype=torch.float32)
            plan = _C.SparsePlan.from_host(
                rowptr.data_ptr(),
                col.data_ptr(),
                ones.data_ptr(),
                rows,
                cols,
                col.numel(),
                device_index(device),
                stream(device),
                self._keep_order,
            )
            self._edge_plans[(device, transposed)] = plan
        return plan

    def gat_plan(self, device: torch.device):
        """The C++ plan of GAT's fused attention on `device` (the pattern and its transpose),
        built on first use."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        plan = self._gat_plans.get(device)
        if plan is None:
            rowptr, col = self._on(torch.device("cpu"))
            plan = _C.GatPlan.from_host(
                rowptr.data_ptr(),
                col.data_ptr(),
                self.num_rows,
                self.num_cols,
                self.nnz,
                device_index(device),
                stream(device),
            )
            self._gat_plans[device] = plan
        return plan

    def edge_attention_plan(self, device: torch.device, backward: bool = True):
        """The C++ plan of the edge-feature attention (:func:`trisparse.edge_attention`) on
        `device`: the input's pairs as a multigraph (each copy of a repeated pair its own edge,
        edge e = input pair e; a pattern not built from pairs: its entries, read in place), grouped
        by target and, for the backward, by source, on the device; built on first use. With
        ``backward=False``, for a pattern not built from pairs, a plan for the forward alone (no
        grouping by source: no sort and no copy, so entry counts past 2^31 fit), unless the whole
        plan is built already."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        whole = self._per_device.get(("edge_attention_plan", device))
        if whole is None and not backward and self._input_entries is None:
            return self._cached(
                "edge_attention_forward_plan", device, lambda: self._multigraph_plan(device, False)
            )[0]
        return self._cached(
            "edge_attention_plan", device, lambda: self._multigraph_plan(device, True)
        )[0]

    def _multigraph_plan(self, device: torch.device, by_source: bool):
        """(EdgeAttentionPlan, the arrays it views: kept with it) of the multigraph (see
        edge_attention_plan), with or without (a pattern not built from pairs) its grouping by
        source."""
        if self.entries_of_input(device) is not None:
            rows, cols = self.input_pairs(device)
            order = torch.argsort(rows, stable=True)  # by target, input order within
            src = cols[order].to(torch.int32)
            dst = rows[order].to(torch.int32)
            row_ptr = row_offsets(dst, self.num_rows)
        else:  # the entries, already by target, are the edges: read in place, no edge ids
            row_ptr, src = self._on(device)
            order = None
            dst = None
            if by_source:
                targets = torch.arange(self.num_rows, dtype=torch.int32, device=device)
                dst = torch.repeat_interleave(targets, row_ptr.diff(), output_size=self.nnz)
        # Lines longer than this get a warp per head (their id lists).
        heavy = _C.EdgeAttentionPlan.heavy_degree
        heavy_rows = torch.nonzero(row_ptr.diff() > heavy).flatten().to(torch.int32)
        col_ptr = by_src = heavy_cols = None
        if by_source:
            sorted_src, by_src = torch.sort(src, stable=True)
            col_ptr = row_offsets(sorted_src, self.num_cols)
            del sorted_src
            heavy_cols = torch.nonzero(col_ptr.diff() > heavy).flatten().to(torch.int32)
        arrays = (row_ptr, src, dst, order, col_ptr, by_src, heavy_rows, heavy_cols)
        ptr = [0 if t is None or t.numel() == 0 else t.data_ptr() for t in arrays]
        plan = _C.EdgeAttentionPlan.build(
            self.num_rows,
            self.num_cols,
            src.numel(),
            *ptr[:6],
            heavy,
            ptr[6],
            heavy_rows.numel(),
            ptr[7],
            0 if heavy_cols is None else heavy_cols.numel(),
            device_index(device),
        )
        return plan, arrays  # the plan views the arrays: kept together

    def input_pairs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, sources) int64 of the input's pairs in input order, each copy of a repeated
        pair its own; the entries for a pattern not built from pairs."""
        rows, cols = self.entries(device)
        entries = self.entries_of_input(device)
        return (rows, cols) if entries is None else (rows[entries], cols[entries])

    def pair_counts(
        self, device: torch.device, chunk: int = 1 << 27
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(in-degrees int64 [num_rows], out-degrees [num_cols], self-loop counts [min(rows,
        cols)]) of the input's pairs, each copy of a repeated pair counted (PyG's degrees of
        ``edge_index()`` with its repeats): in row ranges of at most ``chunk`` entries, so
        patterns of billions of entries fit. Cached."""

        def count():
            rowptr, col = self._on(device)
            mult = self.multiplicity(device)
            in_deg = torch.zeros(self.num_rows, dtype=torch.int64, device=device)
            out_deg = torch.zeros(self.num_cols, dtype=torch.int64, device=device)
            loops = torch.zeros(min(self.num_rows, self.num_cols), dtype=torch.int64, device=device)
            r0 = 0
            while r0 < self.num_rows:
                r1 = int(torch.searchsorted(rowptr, rowptr[r0] + chunk, right=True)) - 1
                r1 = min(max(r1, r0 + 1), self.num_rows)
                lo, hi = int(rowptr[r0]), int(rowptr[r1])
                rows = _range_rows(rowptr, r0, r1, r0)
                c = col[lo:hi].long()
                m = torch.ones_like(c) if mult is None else mult[lo:hi]
                in_deg.index_add_(0, rows, m)  # integer sums: exact in any order
                out_deg.index_add_(0, c, m)
                on = rows == c
                loops.index_add_(0, c[on], m[on])
                r0 = r1
            return in_deg, out_deg, loops

        return self._cached("pair_counts", device, count)

    def edge_index(self) -> torch.Tensor:
        """The entries as PyG's ``edge_index`` [2, nnz] (row 0 sources j, row 1 targets i), in
        entry order, on the pattern's device."""
        row, col = self.entries(self.device)
        return torch.stack([col, row])

    def __repr__(self) -> str:
        return (
            f"Pattern(num_rows={self.num_rows}, num_cols={self.num_cols}, nnz={self.nnz}, "
            f"device={self.device})"
        )
