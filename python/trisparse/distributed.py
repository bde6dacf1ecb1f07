"""Graph attention over a partitioned graph, one part a process, through ``torch.distributed``
(NCCL on GPUs, Gloo on CPUs).

Every rank holds the whole ``edge_index`` and ``edge_attr`` (or only the edges into its rows:
``local_edges``), the node features of the rows it owns and a replica of the weights (DDP).
:func:`partition` assigns the nodes to parts; :meth:`DistributedPattern.build` gives each rank
its rows, its halo (the remote source nodes its rows attend to) and the send and receive lists.
A ``trisparse.nn`` layer called with a ``DistributedPattern`` instead of ``edge_index`` computes
the rows this rank owns: the halo's input rows arrive by ``all_to_all`` while the rows whose
sources are all local (the interior) are computed, the boundary rows after; in the backward the
halo's gradients go back to their owners and are summed there in rank order (bitwise
repeatable). :class:`ContextParallel` does the same for one long sequence under a block mask.
:meth:`DistributedPattern.sparse_attention` is the attention op over the partitioned graph summed
in one process's order: on the CPU engine its output and gradients equal one process's bit for
bit.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor

from . import _tensors
from .block_mask import _packed
from .pattern import Pattern, _check_index
from .sparse import SparseMatrix

PARTITION_METHODS = ("metis", "community", "random")


def _num_nodes(edge_index: Tensor, num_nodes: int | None) -> int:
    if num_nodes is not None:
        return int(num_nodes)
    return int(edge_index.max()) + 1 if edge_index.numel() else 0


def _checked_edge_index(edge_index, num_nodes: int | None) -> tuple[Tensor, int]:
    ei = _check_index(edge_index, "edge_index")
    if ei.dim() != 2 or ei.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E], got {tuple(ei.shape)}")
    n = _num_nodes(ei, num_nodes)
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
        raise ValueError(f"edge_index has node ids outside 0 .. {n - 1}")
    return ei, n


def partition(
    edge_index: Tensor,
    num_parts: int,
    num_nodes: int | None = None,
    method: str = "metis",
    seed: int = 0,
) -> Tensor:
    """The part of each node (int64 [num_nodes], in 0 .. num_parts - 1).

    ``method``: ``"metis"`` (METIS's k-way partition of the symmetrised graph through the
    ``pymetis`` package: the smallest edge cut, parts of balanced in-edges + nodes, the attention's
    work), ``"community"`` (no package: trisparse's community order, label propagation then
    reverse Cuthill-McKee, cut into contiguous ranges of equal in-edges + nodes) or ``"random"``
    (equal node counts, the baseline). :func:`partition_stats` reports the cut and the balance."""
    if int(num_parts) < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if method not in PARTITION_METHODS:
        raise ValueError(f"method must be one of {PARTITION_METHODS}, not {method!r}")
    ei, n = _checked_edge_index(edge_index, num_nodes)
    ei = ei.cpu()
    num_parts = int(num_parts)
    if num_parts == 1 or n == 0:
        return torch.zeros(n, dtype=torch.int64)
    if method == "random":
        gen = torch.Generator().manual_seed(seed)
        part = torch.empty(n, dtype=torch.int64)
        part[torch.randperm(n, generator=gen)] = torch.arange(n) * num_parts // n
        return part
    if method == "community":
        from .block_pattern import BlockPattern

        order = BlockPattern.community(ei, n, block_size=1024, seed=seed + 1).order
        order = torch.arange(n) if order is None else order
        weight = torch.bincount(ei[1], minlength=n)[order] + 1  # in-edges + the node itself
        before = weight.cumsum(0) - weight
        part = torch.empty(n, dtype=torch.int64)
        part[order] = before * num_parts // int(weight.sum())
        return part
    try:
        import pymetis
    except ImportError as e:
        raise ImportError(
            "partition(method='metis') needs the pymetis package (pip install pymetis); "
            "method='community' needs none"
        ) from e
    src, dst = ei[0], ei[1]
    off_diagonal = src != dst
    a = torch.cat([src[off_diagonal], dst[off_diagonal]])
    b = torch.cat([dst[off_diagonal], src[off_diagonal]])
    pairs = torch.unique(a * n + b)  # sorted by a, then b: the CSR of the symmetric graph
    xadj = torch.zeros(n + 1, dtype=torch.int64)
    xadj[1:] = torch.bincount(pairs // n, minlength=n).cumsum(0)
    # Each node weighs its in-edges + 1 (its row's attention work), so the parts balance work.
    work = (torch.bincount(dst, minlength=n) + 1).numpy()
    _, parts = pymetis.part_graph(
        num_parts, xadj=xadj.numpy(), adjncy=(pairs % n).numpy(), vweights=work
    )
    return torch.as_tensor(parts, dtype=torch.int64)


def partition_stats(edge_index: Tensor, part: Tensor, num_parts: int | None = None) -> dict:
    """How good a partition is for distributed attention: ``edge_cut`` (the fraction of edges
    between parts, self loops excluded), ``halo`` (remote source nodes summed over the parts, per
    node: what one layer exchanges), ``node_balance`` and ``edge_balance`` (the largest part's
    nodes and in-edges over the mean)."""
    ei = _check_index(edge_index, "edge_index").cpu()
    part = _check_index(part, "part").cpu()
    n = part.numel()
    k = int(num_parts) if num_parts is not None else int(part.max()) + 1 if n else 1
    src, dst = ei[0], ei[1]
    off = src != dst
    crossing = part[src] != part[dst]
    halo = torch.unique(part[dst][crossing] * n + src[crossing]).numel()
    nodes = torch.bincount(part, minlength=k).double()
    edges = torch.bincount(part[dst], minlength=k).double()
    return {
        "edge_cut": float(crossing.sum()) / max(1, int(off.sum())),
        "halo": halo / max(1, n),
        "node_balance": float(nodes.max() / nodes.mean()) if n else 1.0,
        "edge_balance": float(edges.max() / edges.mean()) if ei.shape[1] else 1.0,
    }


class DistributedPattern:
    """This rank's share of a partitioned graph: the rows it owns (``owned``, global ids in the
    local order: the interior rows, whose sources are all owned, then the boundary rows), the halo
    (``halo``: the remote sources of its rows, grouped by owner rank) and the lists of owned rows
    each other rank needs. Local node ids: owned rows 0 .. num_owned - 1, then the halo.

    Built by every rank of ``group`` together (:meth:`build` is collective: it makes the process
    group the exchanges run on, apart from DDP's). Pass it as ``edge_index`` to
    ``trisparse.nn.TransformerConv``, ``GATConv`` or ``GCNConv`` with this rank's rows of the
    features (``x[dp.owned]``, or :meth:`local`); the output is this rank's rows, in that order."""

    def __init__(self):
        raise TypeError("use DistributedPattern.build(edge_index, part)")

    @classmethod
    def build(
        cls,
        edge_index: Tensor,
        part: Tensor,
        num_nodes: int | None = None,
        group=None,
        add_self_loops: bool = False,
        min_interior: float = 0.2,
        local_edges: bool = False,
    ) -> DistributedPattern:
        """From the whole graph (PyG's edge_index: edge (j, i) lets target i attend source j,
        repeats counted as PyG counts them) and each node's part (:func:`partition`; part r is
        rank r's). With ``local_edges`` each rank passes only the edges into its own rows (a
        sharded load: no rank holds the whole graph), and the send lists are agreed by one
        all_to_all of the halo's ids; ``edge_attr`` then has those edges' rows.
        ``add_self_loops`` adds one (i, i) per node after removing the input's (GAT's default);
        the layer's own ``add_self_loops`` is not applied to a DistributedPattern. The structures
        are built on edge_index's device. Where fewer than ``min_interior`` of the owned rows are
        interior, all rows are computed after the exchange (an interior that small hides little
        of it, and a second pass over the sources costs more)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedPattern.build needs torch.distributed initialised "
                "(torch.distributed.init_process_group)"
            )
        ei, n = _checked_edge_index(edge_index, num_nodes)
        part = _check_index(part, "part").to(ei.device)
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if part.shape != (n,):
            raise ValueError(f"part must have one entry per node, [{n}], got {tuple(part.shape)}")
        if n and (int(part.min()) < 0 or int(part.max()) >= world):
            raise ValueError(f"part must hold ranks 0 .. {world - 1} (the group's size)")
        self = object.__new__(cls)
        self.group = dist.new_group(list(range(world))) if group is None else group
        self.rank, self.world_size, self.num_nodes = rank, world, n
        self.add_self_loops = bool(add_self_loops)
        self._given = ei  # the edges given (the whole graph, or this rank's with local_edges)
        edge_ids = torch.arange(ei.shape[1], device=ei.device)
        src, dst = ei[0], ei[1]
        if local_edges and not bool((part[dst] == rank).all()):
            raise ValueError(
                "edge_index: with local_edges every edge must lead into this rank's rows "
                f"(part[edge_index[1]] == {rank})"
            )
        if add_self_loops:  # the loops of this rank's nodes (the others' are not its edges)
            kept = src != dst
            loops = (part == rank).nonzero().view(-1)
            src, dst = torch.cat([src[kept], loops]), torch.cat([dst[kept], loops])
            edge_ids = torch.cat([edge_ids[kept], torch.full_like(loops, -1)])
        p_src, p_dst = part[src], part[dst]
        mine = p_dst == rank
        e_src, e_dst, self._edge_ids = src[mine], dst[mine], edge_ids[mine]
        remote = p_src[mine] != rank
        on_boundary = torch.zeros(n, dtype=torch.bool, device=ei.device)
        on_boundary[e_dst[remote]] = True
        owned_here = part == rank
        if int((owned_here & ~on_boundary).sum()) < min_interior * int(owned_here.sum()):
            on_boundary = owned_here
        interior = (owned_here & ~on_boundary).nonzero().view(-1)
        boundary = on_boundary.nonzero().view(-1)
        self.owned = torch.cat([interior, boundary])
        self.num_owned, self.num_interior = self.owned.numel(), interior.numel()
        if self.num_owned == 0:
            raise ValueError(f"rank {rank} owns no node: every part must hold at least one")
        halo = torch.unique(e_src[remote])
        self.halo = halo[torch.sort(part[halo] * n + halo).indices]
        local = torch.full((n,), -1, dtype=torch.int64, device=ei.device)
        local[self.owned] = torch.arange(self.num_owned, device=ei.device)
        local[self.halo] = self.num_owned + torch.arange(self.halo.numel(), device=ei.device)
        self.recv_counts = torch.bincount(part[self.halo], minlength=world).tolist()
        # Sent: each owned source of an edge into rank r's rows, once, in r's halo order (by id).
        if local_edges:  # asked for: each rank sends its owners the ids of its halo
            counts = torch.tensor(self.recv_counts, device=ei.device)
            sends = torch.empty_like(counts)
            dist.all_to_all_single(sends, counts, group=self.group)
            self.send_counts = sends.tolist()
            wanted = self.halo.new_empty(sum(self.send_counts))
            dist.all_to_all_single(
                wanted, self.halo, self.send_counts, self.recv_counts, group=self.group
            )
            self.send_index = local[wanted]
        else:
            cross = (p_src == rank) & (p_dst != rank)
            pairs = torch.unique(p_dst[cross] * n + src[cross])
            self.send_index = local[pairs % n]
            self.send_counts = torch.bincount(pairs // n, minlength=world).tolist()
        l_src, l_dst = local[e_src], local[e_dst]
        self._local_edges = (l_src, l_dst)
        self._part, self._edges = part, (e_src, e_dst)  # global ids, for the global order
        self._global = None
        rows = l_dst >= self.num_interior
        self._sides = []  # (edge selection, Pattern) of the interior, then the boundary rows
        for side, sel in enumerate((~rows, rows)):
            sel = sel.nonzero().view(-1)
            first = 0 if side == 0 else self.num_interior
            num_src = self.num_owned if side == 0 else self.num_owned + self.halo.numel()
            local_ei = torch.stack([l_src[sel], l_dst[sel] - first])
            size = (num_src, self.num_interior if side == 0 else boundary.numel())
            self._sides.append((sel, Pattern.from_edge_index(local_ei, size=size)))
        self._matrices: dict = {}
        return self

    @property
    def num_halo(self) -> int:
        return self.halo.numel()

    def local(self, x: Tensor) -> Tensor:
        """This rank's rows of a per-node tensor of the whole graph, in the local order."""
        return x[self.owned.to(x.device)]

    def exchange(self, x: Tensor) -> Tensor:
        """The halo's rows of a per-node tensor: ``x`` holds this rank's owned rows (local order),
        the result the halo's, from their owners (collective; differentiable)."""
        halo, arrived = self.start_exchange(x)
        arrived.wait()
        return halo

    def start_exchange(self, x: Tensor):
        """:meth:`exchange` started: (the halo's rows, a handle whose ``wait()`` must come before
        they are read). On CUDA ``wait()`` orders the current stream after the transfer without
        blocking the host, so work queued before it overlaps the transfer."""
        if x.shape[0] != self.num_owned:
            raise ValueError(
                f"x must hold this rank's {self.num_owned} owned rows (DistributedPattern.local), "
                f"got {x.shape[0]}"
            )
        return _start_halo(x, self)

    def joined(self, out: Tensor, halo: Tensor) -> Tensor:
        """``out``, tied to ``halo`` where no boundary row read it: the exchange's backward is a
        collective that every rank must join, so a rank whose rows read no halo row (all
        interior) still runs it, with a zero gradient."""
        if self.rows(1).stop > self.rows(1).start or not torch.is_grad_enabled():
            return out
        return _Tie.apply(out, halo)

    def rows(self, side: int) -> slice:
        """The local rows of the interior (0) or the boundary (1)."""
        return (
            slice(0, self.num_interior) if side == 0 else slice(self.num_interior, self.num_owned)
        )

    def pattern(self, side: int) -> Pattern:
        """The Pattern of the interior (0) rows over the owned sources, or of the boundary (1)
        rows over the owned then the halo's sources (local ids)."""
        return self._sides[side][1]

    def edge_rows(self, side: int, edge_attr: Tensor | None) -> Tensor | None:
        """The rows of a per-edge tensor of the whole graph (edge_attr) that the side's Pattern
        was built from, in its input order."""
        if edge_attr is None:
            return None
        if self.add_self_loops:
            raise ValueError(
                "edge_attr: a DistributedPattern built with add_self_loops has no features for "
                "the loops; add them to edge_index and edge_attr before building"
            )
        if edge_attr.shape[0] != self._given.shape[1]:
            raise ValueError(
                f"edge_attr must have one row per edge of the edge_index given to build "
                f"({self._given.shape[1]}), got {edge_attr.shape[0]}"
            )
        return edge_attr[self._edge_ids[self._sides[side][0]].to(edge_attr.device)]

    def run(self, compute, x: Tensor, edge_attr: Tensor | None = None) -> Tensor:
        """``compute(x_src, x_dst, side, edge_attr)`` over the interior rows while the halo's rows
        of ``x`` arrive, then over the boundary rows; returns the rows stacked in the local order.
        side 0 is the interior (x_src: the owned rows), 1 the boundary (x_src: owned, then halo);
        :meth:`pattern` gives its Pattern, and ``edge_attr`` is given as its edges' rows."""
        halo, arrived = self.start_exchange(x)
        out = []
        for side in (0, 1):
            if side == 1:
                arrived.wait()
            rows = self.rows(side)
            if rows.stop > rows.start:
                x_src = x if side == 0 else torch.cat([x, halo])
                out.append(compute(x_src, x[rows], side, self.edge_rows(side, edge_attr)))
        return self.joined(out[0] if len(out) == 1 else torch.cat(out), halo)

    def gcn_matrix(self, side: int, add_self_loops: bool, normalize: bool):
        """GCN's propagation rows of one side as a SparseMatrix over local ids: PyG's gcn_norm
        without edge weights (each node's self loops replaced by one of weight 1: gcn_norm adds
        them before it makes the weights, so GCNConv's ``improved`` changes nothing there; w_ij =
        1 / sqrt(deg_i deg_j) over in-degrees), from this rank's edges and its halo's degrees,
        which their owners send (collective: every rank builds it at its first forward)."""
        key = (add_self_loops, normalize)
        if key not in self._matrices:
            if self.add_self_loops:
                raise ValueError(
                    "GCNConv adds its own self loops: build the DistributedPattern without "
                    "add_self_loops"
                )
            l_src, l_dst = self._local_edges
            device = l_src.device
            w = torch.ones(l_src.numel(), dtype=torch.float64, device=device)
            if normalize:
                if add_self_loops:  # weight 1: gcn_norm fills before it has weights
                    keep = l_src != l_dst
                    own = torch.arange(self.num_owned, device=device)
                    l_src, l_dst = torch.cat([l_src[keep], own]), torch.cat([l_dst[keep], own])
                    w = torch.cat([w[keep], w.new_ones(self.num_owned)])
                deg = torch.zeros(self.num_owned, dtype=torch.float64, device=device)
                deg.index_add_(0, l_dst, w)
                scale = deg.pow(-0.5).masked_fill(deg == 0, 0.0)
                scale = torch.cat([scale, self.exchange(scale.unsqueeze(1)).squeeze(1)])
                w = scale[l_src] * w * scale[l_dst]
            matrices = []
            for s in (0, 1):
                first = 0 if s == 0 else self.num_interior
                sel = (l_dst >= self.num_interior) if s else (l_dst < self.num_interior)
                rows = self.pattern(s).num_rows
                cols = self.num_owned + (self.num_halo if s else 0)
                matrices.append(SparseMatrix(l_dst[sel] - first, l_src[sel], w[sel], rows, cols))
            self._matrices[key] = matrices
        return self._matrices[key][side]

    def sparse_attention(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None
    ) -> Tensor:
        """``trisparse.sparse_attention`` over the whole graph (its pattern: repeated edges merged,
        self loops as given), computed for this rank's rows: ``q``, ``k``, ``v`` are its owned
        rows ([num_owned, H, D], local order), the result its rows of the output (collective).

        Every sum runs in the single process's order, so on the CPU engine (float32, float64) the
        output and the gradients of q, k and v equal one process's bit for bit: a row's sources
        are attended in global id order (the halo's keys and values gathered among the owned ones
        in that order), and each owned source's dk and dv are summed over all of its targets in
        global id order on its owner, which receives the remote targets' q, out, lse and dout in
        the backward (one exchange; the halo's partial dk and dv are not returned). Built at the
        first call: every rank must make it. Tested on the CPU over Gloo; on CUDA (head dims the
        fused kernel takes) it equals one process to rounding only, as the fused 3S kernel's
        result for a row depends on the rows sharing its window."""
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError("q, k, v must have shape [num_owned, heads, channels]")
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            if t.shape[0] != self.num_owned:
                raise ValueError(
                    f"{name} must hold this rank's {self.num_owned} owned rows "
                    f"(DistributedPattern.local), got {t.shape[0]}"
                )
        scale = _tensors.resolve_scale(scale, q.shape[2])
        return _GlobalOrderAttention.apply(q, k, v, self._global_order(), float(scale))

    def _global_order(self) -> _GlobalOrder:
        if self._global is None:
            self._global = _GlobalOrder(self)
        return self._global

    def __repr__(self) -> str:
        return (
            f"DistributedPattern(rank={self.rank}/{self.world_size}, owned={self.num_owned} "
            f"({self.num_interior} interior), halo={self.num_halo}, "
            f"sent={sum(self.send_counts)})"
        )


def _exchanged(
    x: Tensor, send_index: Tensor, send_counts: list, recv_counts: list, group, async_op=False
):
    """The rows of x other ranks send this one (send_index: x's rows each rank gets, grouped by
    rank), by one all_to_all; with ``async_op`` also its handle (wait on it before reading)."""
    send = x.index_select(0, send_index.to(x.device)).contiguous()
    got = x.new_empty((sum(recv_counts), *x.shape[1:]))
    work = dist.all_to_all_single(
        got, send, recv_counts, send_counts, group=group, async_op=async_op
    )
    return (got, work) if async_op else got


class _GlobalOrder:
    """DistributedPattern.sparse_attention's structures, in global id order (built collectively):
    the source table C (owned and halo ids sorted), the forward's pattern (owned rows x C), the
    backward's rows R (owned rows and the foreign targets of owned sources, sorted) and its pattern
    (R x C: the owned rows' edges and those from owned sources into foreign rows), and the lists of
    the foreign rows' exchange (each owned row to the ranks owning one of its sources)."""

    def __init__(self, dp: DistributedPattern):
        e_src, e_dst = dp._edges
        part, n, world, device = dp._part, dp.num_nodes, dp.world_size, e_src.device
        self.dp = dp
        local = torch.full((n,), -1, dtype=torch.int64, device=device)
        local[dp.owned] = torch.arange(dp.num_owned, device=device)
        sources = torch.cat([dp.owned, dp.halo])
        self.c_order = torch.argsort(sources)  # the source table's rows in global order
        cols = sources[self.c_order]
        # Edges from other ranks' sources into owned rows go, as (target, source) pairs, to the
        # sources' owners: their foreign rows and the edges into them.
        remote = (part[e_src] != dp.rank).nonzero().view(-1)
        remote = remote[torch.sort(part[e_src[remote]], stable=True).indices]
        pairs = torch.stack([e_dst[remote], e_src[remote]], dim=1).contiguous()
        pair_counts = torch.bincount(part[e_src[remote]], minlength=world)
        got_counts = torch.empty_like(pair_counts)
        dist.all_to_all_single(got_counts, pair_counts, group=dp.group)
        got = pairs.new_empty((int(got_counts.sum()), 2))
        dist.all_to_all_single(
            got, pairs, got_counts.tolist(), pair_counts.tolist(), group=dp.group
        )
        # Foreign rows: each sent once to each rank that owns one of its sources, by id; received
        # grouped by sender, by id (the same lists on both sides).
        sent = torch.unique(part[pairs[:, 1]] * n + pairs[:, 0])
        self.send_index = local[sent % n]
        self.send_counts = torch.bincount(sent // n, minlength=world).tolist()
        sender = torch.repeat_interleave(torch.arange(world, device=device), got_counts)
        received = torch.unique(sender * n + got[:, 0])
        self.recv_counts = torch.bincount(received // n, minlength=world).tolist()
        rows = torch.cat([dp.owned, received % n])
        self.r_order = torch.argsort(rows)
        rows = rows[self.r_order]
        self.r_owned = torch.searchsorted(rows, dp.owned)  # the owned rows' places in R
        self.c_owned = torch.searchsorted(cols, dp.owned)  # and among the sources
        size = (cols.numel(), dp.num_owned)
        self.forward_pattern = Pattern.from_edge_index(
            torch.stack([torch.searchsorted(cols, e_src), local[e_dst]]), size=size
        )
        b_src, b_dst = torch.cat([e_src, got[:, 1]]), torch.cat([e_dst, got[:, 0]])
        self.backward_pattern = Pattern.from_edge_index(
            torch.stack([torch.searchsorted(cols, b_src), torch.searchsorted(rows, b_dst)]),
            size=(cols.numel(), rows.numel()),
        )

    def sources(self, k: Tensor, halo: Tensor) -> Tensor:
        """The source table in global order from the owned rows and the halo's."""
        return torch.cat([k, halo]).index_select(0, self.c_order.to(k.device))

    def backward_rows(self, x: Tensor, foreign: Tensor) -> Tensor:
        return torch.cat([x, foreign]).index_select(0, self.r_order.to(x.device))

    def foreign(self, x: Tensor) -> Tensor:
        return _exchanged(x, self.send_index, self.send_counts, self.recv_counts, self.dp.group)


class _GlobalOrderAttention(torch.autograd.Function):
    """DistributedPattern.sparse_attention: the halo's k and v arrive, the owned rows attend C in
    global order; the backward gathers the foreign rows' q, out, lse, dout and runs the backward
    over R x C, keeping dq of the owned rows and dk, dv of the owned sources."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, order: _GlobalOrder, scale: float):
        dp = order.dp
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        halo = [
            _exchanged(t, dp.send_index, dp.send_counts, dp.recv_counts, dp.group) for t in (k, v)
        ]
        k_all, v_all = order.sources(k, halo[0]), order.sources(v, halo[1])
        out, lse = torch.ops.trisparse.sparse_attention(
            q, k_all, v_all, None, order.forward_pattern.id, scale, True, True
        )
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.order, ctx.scale = order, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        order = ctx.order
        dout = dout.contiguous()
        rows = [order.backward_rows(t, order.foreign(t)) for t in (q, out, lse, dout)]
        dq, dk, dv, _ = torch.ops.trisparse.sparse_attention_backward(
            rows[0], k_all, v_all, rows[1], rows[2], rows[3], None,
            order.backward_pattern.id, ctx.scale, False,
        )  # fmt: skip
        owned_rows, owned_sources = order.r_owned.to(dq.device), order.c_owned.to(dq.device)
        return dq[owned_rows], dk[owned_sources], dv[owned_sources], None, None


CONTEXT_LAYOUTS = ("contiguous", "zigzag")


def _owner_of_blocks(num_blocks: int, world: int, layout: str) -> Tensor:
    """The rank of each block of the sequence: ``contiguous``, p ranges of equal blocks, or
    ``zigzag``, 2p ranges with rank r holding ranges r and 2p - 1 - r (a causal mask's rows then
    weigh alike on every rank)."""
    chunks = world if layout == "contiguous" else 2 * world
    chunk = torch.arange(num_blocks) * chunks // max(1, num_blocks)
    return chunk if layout == "contiguous" else torch.minimum(chunk, 2 * world - 1 - chunk)


class ContextParallel:
    """Block-sparse attention over one long sequence split across the ranks (context
    parallelism): each rank holds the query, key and value rows of its blocks (:meth:`shard`),
    receives from the others only the key and value blocks that its rows' kept blocks read (a
    block the mask drops is neither sent nor computed), and computes its rows' output; the
    backward returns the received blocks' gradients to their owners, summed there in rank order
    (bitwise repeatable).

    Built by every rank of the group together from the whole mask (``mask``: a :class:`BlockMask`
    over [N, N], N = ``seq_len``). ``layout``: ``"zigzag"`` (the default for a causal mask: each
    rank holds a block range from each end, so causal rows cost alike) or ``"contiguous"``. A
    rank's buffers hold only its rows and the blocks it reads: its keys are the received blocks
    followed by its own, under the mask's rows for its blocks and columns in that order, so a
    causal mask's diagonal (bottom-right aligned) falls on its own blocks as in the whole mask,
    and every received block a causal row reads lies wholly before it."""

    def __init__(self):
        raise TypeError("use ContextParallel.build(mask, seq_len)")

    @classmethod
    def build(cls, mask, seq_len: int, group=None, layout: str | None = None) -> ContextParallel:
        from .block_sparse import BlockMask

        if not isinstance(mask, BlockMask):
            raise TypeError(f"mask must be a trisparse.BlockMask, got {type(mask).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ContextParallel.build needs torch.distributed initialised "
                "(torch.distributed.init_process_group)"
            )
        layout = layout or ("zigzag" if mask.causal else "contiguous")
        if layout not in CONTEXT_LAYOUTS:
            raise ValueError(f"layout must be one of {CONTEXT_LAYOUTS}, not {layout!r}")
        g = mask.block_size
        blocks = mask.blocks.cpu()
        num_blocks = blocks.shape[2]
        if seq_len % g or blocks.shape[2] != seq_len // g or blocks.shape[3] != num_blocks:
            raise ValueError(
                f"mask must be [.., {seq_len // g}, {seq_len // g}] blocks of {g} for seq_len "
                f"{seq_len} (a multiple of the block size), got {tuple(blocks.shape)}"
            )
        self = object.__new__(cls)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = dist.new_group(list(range(world))) if group is None else group
        self.rank, self.world_size, self.seq_len, self.block_size = rank, world, seq_len, g
        self.layout = layout
        owner = _owner_of_blocks(num_blocks, world, layout)
        self.owned_blocks = (owner == rank).nonzero().view(-1)
        if self.owned_blocks.numel() == 0:
            raise ValueError(f"rank {rank} holds no block: seq_len / block_size < ranks")
        reads = blocks.any(dim=(0, 1))  # [QB, KB]: key blocks some sequence / head reads
        # The key blocks each rank's rows read from another rank: rank r's halo, by block id.
        needs = torch.stack([reads[owner == r].any(dim=0) for r in range(world)])  # [world, KB]
        needs &= owner.unsqueeze(0) != torch.arange(world).unsqueeze(1)
        self.halo_blocks = needs[rank].nonzero().view(-1)  # sorted by id; owners sort them too
        self.halo_blocks = self.halo_blocks[
            torch.sort(owner[self.halo_blocks], stable=True).indices
        ]
        self.recv_counts = torch.bincount(owner[self.halo_blocks], minlength=world).tolist()
        local = torch.full((num_blocks,), -1, dtype=torch.int64)
        local[self.owned_blocks] = torch.arange(self.owned_blocks.numel())
        mine = needs[:, owner == rank]  # [world, my blocks]: who reads which of my blocks
        self.send_index = torch.cat(
            [local[(owner == rank).nonzero().view(-1)[mine[r]]] for r in range(world)]
        )
        self.send_counts = [int(mine[r].sum()) for r in range(world)]
        # This rank's rows of the mask, its columns in key order: the received blocks, then its own.
        key_blocks = torch.cat([self.halo_blocks, self.owned_blocks]).to(mask.blocks.device)
        local_blocks = mask.blocks.index_select(2, self.owned_blocks.to(mask.blocks.device))
        self.mask = BlockMask(local_blocks.index_select(3, key_blocks), g, causal=mask.causal)
        # The ring's parts: this rank's rows against each owner's blocks that they read (its own
        # under the mask's causal rule; received blocks lie wholly before a causal row that reads
        # them, so theirs need none). Step s attends to rank (rank - s)'s part.
        self._parts = []
        for step in range(world):
            src = (rank - step) % world
            first = sum(self.recv_counts[:src])
            cols = (
                self.owned_blocks
                if step == 0
                else self.halo_blocks[first : first + self.recv_counts[src]]
            )
            part = None
            if cols.numel() > 0:
                part = BlockMask(
                    local_blocks.index_select(3, cols.to(mask.blocks.device)),
                    g,
                    causal=mask.causal and step == 0,
                )
            self._parts.append(part)
        self._send_offsets = [0, *itertools.accumulate(self.send_counts)]
        self._tokens: dict = {}
        return self

    @property
    def num_halo(self) -> int:
        return self.halo_blocks.numel()

    def _token_index(self, blocks: Tensor, device) -> Tensor:
        key = (int(blocks.data_ptr()), device)
        if key not in self._tokens:
            g = self.block_size
            index = (blocks.view(-1, 1) * g + torch.arange(g)).view(-1)
            self._tokens[key] = index.to(device)
        return self._tokens[key]

    def shard(self, x: Tensor) -> Tensor:
        """This rank's rows [B, H, n_own, D] of a whole sequence's [B, H, N, D]."""
        return x.index_select(2, self._token_index(self.owned_blocks, x.device))

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, ring: bool = False
    ) -> Tensor:
        """This rank's rows of block_sparse_attention(q, k, v, mask) over the whole sequence:
        q, k, v are [B, H, n_own, D] (:meth:`shard`), the result [B, H, n_own, Dv].

        ``ring=False``: every block this rank's rows read arrives first (one all_to_all), then
        one attention over them. ``ring=True``: the other ranks' blocks arrive one rank at a time
        (step s: from rank - s, while sending to rank + s), each step's transfer in flight while
        the previous part is attended; the parts' outputs are merged by their log-sum-exp, and
        the backward runs each part's backward with the merged output and lse, fetching the
        blocks again and returning their gradients to the owners, who add them in step order
        (repeatable). A rank holds at most two other ranks' blocks, or their gradients, at a
        time."""
        from .block_sparse import block_sparse_attention

        n_own = self.owned_blocks.numel() * self.block_size
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            if t.dim() != 4 or t.shape[2] != n_own:
                raise ValueError(
                    f"{name} must be this rank's rows [B, H, {n_own}, D] (ContextParallel.shard), "
                    f"got {tuple(t.shape)}"
                )
        b, h, g = q.shape[0], q.shape[1], self.block_size

        def as_blocks(t):  # [B, H, n, D] -> [blocks, G, B, H, D]: one row a block to exchange
            return t.permute(2, 0, 1, 3).reshape(-1, g, b, h, t.shape[3])

        def from_blocks(t):
            return t.reshape(-1, b, h, t.shape[-1]).permute(1, 2, 0, 3)

        d = k.shape[3]
        kv = torch.cat([k, v], dim=-1)
        if ring:
            return _RingAttention.apply(q, kv, d, self, _tensors.resolve_scale(scale, q.shape[3]))
        halo, arrived = _start_halo(as_blocks(kv), self)
        arrived.wait()
        kv = torch.cat([from_blocks(halo), kv], dim=2)
        return block_sparse_attention(q, kv[..., :d], kv[..., d:], self.mask, scale)

    def __repr__(self) -> str:
        return (
            f"ContextParallel(rank={self.rank}/{self.world_size}, {self.layout}, "
            f"blocks={self.owned_blocks.numel()}, received={self.num_halo}, "
            f"sent={sum(self.send_counts)})"
        )


def _unpacked_rows(t: Tensor, b: int) -> Tensor:
    return t.reshape(b, -1, t.shape[1], t.shape[2]).permute(0, 2, 1, 3)


class _RingStep:
    """One step of the ring: this rank's blocks that rank + s reads, sent to it, and the blocks
    of rank - s that this rank reads, received (point to point, started at construction)."""

    def __init__(self, cp: ContextParallel, blocks: Tensor, s: int):
        dst, src = (cp.rank + s) % cp.world_size, (cp.rank - s) % cp.world_size
        lo, hi = cp._send_offsets[dst], cp._send_offsets[dst + 1]
        ops = []
        if hi > lo:
            self.sent = blocks.index_select(0, cp.send_index[lo:hi].to(blocks.device)).contiguous()
            ops.append(dist.P2POp(dist.isend, self.sent, dst, group=cp.group))
        self.received = blocks.new_empty((cp.recv_counts[src], *blocks.shape[1:]))
        if self.received.shape[0] > 0:
            ops.append(dist.P2POp(dist.irecv, self.received, src, group=cp.group))
        # One batch: NCCL runs a rank's send and receive together (in turn they could deadlock).
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> Tensor:
        for w in self.works:
            w.wait()
        return self.received


def _kv_blocks(kv: Tensor, g: int) -> Tensor:
    """[B, H, n, 2D] -> [n / g, g, B, H, 2D]: a row per block to exchange."""
    return kv.permute(2, 0, 1, 3).reshape(-1, g, kv.shape[0], kv.shape[1], kv.shape[3])


def _ring(cp: ContextParallel, blocks: Tensor):
    """(s, the blocks of rank - s that this rank reads) for s = 0 .. world - 1, its own first;
    step s + 1's transfer is posted before step s is handed out."""
    step = _RingStep(cp, blocks, 1) if cp.world_size > 1 else None
    yield 0, blocks
    for s in range(1, cp.world_size):
        mine = step.wait()
        step = _RingStep(cp, blocks, s + 1) if s + 1 < cp.world_size else None
        yield s, mine


def _part_ranges(b: int, n_q: int, n_k: int) -> tuple[list[int], list[int]]:
    """cu_seqlens of b packed sequences of n_q queries and n_k keys."""
    return [i * n_q for i in range(b + 1)], [i * n_k for i in range(b + 1)]


class _RingAttention(torch.autograd.Function):
    """ContextParallel.attention(ring=True): the parts attended one step at a time and merged by
    their log-sum-exp; the backward as described there."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, d: int, cp: ContextParallel, scale: float):
        b = q.shape[0]
        blocks = _kv_blocks(kv, cp.block_size)
        qp = _packed(q).contiguous()
        parts, outs, lses = cp._parts, [], []
        for s, mine in _ring(cp, blocks):
            if parts[s] is None:
                continue
            out, lse = _attend_part(qp, mine, d, parts[s], b, scale)
            outs.append(out)
            lses.append(lse)
        out, lse = _merged(outs, lses)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.cp, ctx.d, ctx.scale = cp, d, scale
        return _unpacked_rows(out, b)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, kv, out, lse = ctx.saved_tensors
        cp, d, scale = ctx.cp, ctx.d, ctx.scale
        b = q.shape[0]
        blocks = _kv_blocks(kv, cp.block_size)
        qp, dop = _packed(q).contiguous(), _packed(dout).contiguous()
        dq = torch.zeros(
            qp.shape, dtype=torch.promote_types(qp.dtype, torch.float32), device=qp.device
        )
        dblocks = torch.zeros(blocks.shape, dtype=dq.dtype, device=blocks.device)
        # Step s also returns the gradients of rank - s's blocks to it and receives those of this
        # rank's blocks from rank + s: each message is posted at the same (step, phase) on both
        # sides, so every two ranks post their messages to each other in one order (NCCL matches
        # point-to-point messages in order, not by tag). They are added in step order.
        pending: list = []  # the last step's gradient messages: (works, arrived, sent)

        def settle():
            for works, arrived, _sent in pending:
                for work in works:
                    work.wait()
                if arrived is not None:
                    index, got = arrived
                    dblocks.index_add_(0, index, got.to(dblocks.dtype))
            pending.clear()

        for s, mine in _ring(cp, blocks):
            grads = None
            if cp._parts[s] is not None:
                dq_s, grads = _part_backward(qp, mine, d, cp._parts[s], b, out, lse, dop, scale)
                dq += dq_s
            if s == 0:
                if grads is not None:
                    dblocks += grads
                continue
            settle()
            src, dst = (cp.rank - s) % cp.world_size, (cp.rank + s) % cp.world_size
            ops, sent, arrived = [], None, None
            if grads is not None:
                sent = grads.to(blocks.dtype).contiguous()
                ops.append(dist.P2POp(dist.isend, sent, src, group=cp.group))
            lo, hi = cp._send_offsets[dst], cp._send_offsets[dst + 1]
            if hi > lo:
                got = blocks.new_empty((hi - lo, *blocks.shape[1:]))
                arrived = (cp.send_index[lo:hi].to(blocks.device), got)
                ops.append(dist.P2POp(dist.irecv, got, dst, group=cp.group))
            if ops:
                pending.append((dist.batch_isend_irecv(ops), arrived, sent))
        settle()
        dkv = dblocks.reshape(-1, b, kv.shape[1], kv.shape[3]).permute(1, 2, 0, 3)
        return _unpacked_rows(dq.to(q.dtype), b), dkv.to(kv.dtype), None, None, None


def _part_kv(mine: Tensor, d: int, b: int) -> tuple[Tensor, Tensor]:
    """[blocks, G, B, H, 2D] -> packed k, v [B * n, H, D] (sequence b at rows b n ..)."""
    x = mine.permute(2, 0, 1, 3, 4).reshape(-1, mine.shape[3], mine.shape[4])
    return x[..., :d].contiguous(), x[..., d:].contiguous()


def _attend_part(qp: Tensor, mine: Tensor, d: int, mask, b: int, scale: float):
    k, v = _part_kv(mine, d, b)
    cu_q, cu_k = _part_ranges(b, qp.shape[0] // b, k.shape[0] // b)
    return torch.ops.trisparse.block_sparse_attention(
        qp, k, v, mask.id, cu_q, cu_k, float(scale), True
    )


def _merged(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The parts' outputs combined by their log-sum-exp: out = sum_p exp(lse_p - lse) out_p with
    lse = log sum_p exp(lse_p); rows no part reaches give zeros (lse -inf)."""
    lse = torch.stack(lses).logsumexp(0)
    finite = torch.isfinite(lse)
    total = torch.zeros_like(outs[0], dtype=torch.promote_types(outs[0].dtype, torch.float32))
    for out, part_lse in zip(outs, lses, strict=True):
        w = torch.where(finite, torch.exp(part_lse - lse), torch.zeros_like(lse))
        total += w.unsqueeze(-1).to(total.dtype) * out
    return total.to(outs[0].dtype), lse


def _part_backward(qp, mine, d, mask, b, out, lse, dop, scale):
    """One part's dq and its blocks' [blocks, G, B, H, 2D] dk | dv, from the merged out and lse."""
    k, v = _part_kv(mine, d, b)
    cu_q, cu_k = _part_ranges(b, qp.shape[0] // b, k.shape[0] // b)
    dq, dk, dv, _m, _g, _db = torch.ops.trisparse.block_sparse_attention_backward(
        qp, k, v, out, lse, dop, mask.id, cu_q, cu_k, float(scale)
    )
    dkv = torch.cat([dk, dv], dim=-1)  # [B * n, H, 2D]
    n_blocks, g = mine.shape[0], mine.shape[1]
    dkv = dkv.reshape(b, n_blocks, g, dkv.shape[1], dkv.shape[2]).permute(1, 2, 0, 3, 4)
    return dq.to(torch.promote_types(dq.dtype, torch.float32)), dkv


def _start_halo(x: Tensor, lists):
    pending: list = []
    halo = _HaloExchange.apply(x, lists, pending)
    return halo, pending[0]


class _Tie(torch.autograd.Function):
    """out unchanged, with a zero gradient for ``halo`` (DistributedPattern.joined)."""

    @staticmethod
    def forward(ctx, out: Tensor, halo: Tensor):
        ctx.halo = (halo.shape, halo.dtype, halo.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.halo
        return grad, torch.zeros(shape, dtype=dtype, device=device)


class _HaloExchange(torch.autograd.Function):
    """x_halo = the owners' rows along dim 0 (``lists``: a DistributedPattern or ContextParallel:
    send_index, send_counts, recv_counts, num_halo, group), by all_to_all (started here, waited on
    by the caller through the handle put in ``pending``); the backward returns each halo row's
    gradient to its owner and adds the ranks' contributions there in rank order (a fixed order:
    repeatable)."""

    @staticmethod
    def forward(ctx, x: Tensor, dp: DistributedPattern, pending: list):
        halo, work = _exchanged(
            x, dp.send_index, dp.send_counts, dp.recv_counts, dp.group, async_op=True
        )
        pending.append(work)
        ctx.dp = dp
        ctx.shape = x.shape
        return halo

    @staticmethod
    def backward(ctx, grad_halo: Tensor):
        dp = ctx.dp
        sent = grad_halo.new_empty((dp.send_index.numel(), *ctx.shape[1:]))
        dist.all_to_all_single(
            sent, grad_halo.contiguous(), dp.send_counts, dp.recv_counts, group=dp.group
        )
        grad = grad_halo.new_zeros(ctx.shape)
        index = dp.send_index.to(grad.device)
        start = 0
        for count in dp.send_counts:  # one rank at a time: its rows are distinct
            if count:
                grad.index_add_(0, index[start : start + count], sent[start : start + count])
            start += count
        return grad, None, None
