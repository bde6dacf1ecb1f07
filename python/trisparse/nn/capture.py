"""Training steps replayed as CUDA graphs over padded mini-batches.

A mini-batch of small graphs (molecules) gives a GPU a few microseconds of work per kernel and the
host a few tens of microseconds per launch: the step waits on Python. A CUDA graph replays the
step's kernels with one launch, but only for fixed shapes and addresses. :func:`pad_batch` pads a
PyG mini-batch to fixed node, edge and graph counts (:func:`bucket` picks them from a few sizes)
such that the padding touches no real node, and :class:`CapturedStep` captures the whole step
(forward, loss, backward, optimizer) once per padded shape and replays it. Layers whose statistics
span the batch (``BatchNorm`` in :class:`trisparse.nn.GPSConv`) take the ``node_mask`` and leave the
padded nodes out; every trisparse layer on the path must be capturable: GPSConv's global attention
on the segment kernels (CUDA, float16/bfloat16 heads under autocast), which read the batch vector
on the device. :class:`PackedGraphs` collates mini-batches of a list of small graphs by a few
vectorised gathers (PyG's collation works graph by graph in Python).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

__all__ = ["CapturedStep", "PackedGraphs", "bucket", "capture_stream", "pad_batch"]


def bucket(n: int, steps: int = 8, minimum: int = 64) -> int:
    """The size a count of ``n`` is padded to: ``n + 1`` rounded up to a multiple of the power of
    two at most ``1 / steps`` of it (at least ``minimum``), so at most about ``steps`` sizes per
    octave (one captured graph each) and, above ``minimum * steps``, under ``1 / steps`` of
    padding."""
    if n < 0 or steps < 1 or minimum < 1:
        raise ValueError(
            f"bucket needs n >= 0, steps >= 1, minimum >= 1; got {n}, {steps}, {minimum}"
        )
    n += 1  # at least one padded row: padded edges need a node
    step = max(minimum, 1 << max(0, math.floor(math.log2(n / steps))))
    return -(-n // step) * step


def _padded(t: Tensor, rows: int, fill) -> Tensor:
    """``t`` with rows appended along dim 0 up to ``rows``, filled with ``fill``."""
    extra = t.new_full((rows - t.size(0),) + tuple(t.shape[1:]), fill)
    return torch.cat([t, extra])


def pad_batch(data, num_nodes: int, num_edges: int, num_graphs: int, segment: int = 32):
    """A PyG mini-batch (``x``, ``edge_index``, ``batch``, optional ``edge_attr`` and ``y``) padded
    to ``num_nodes`` nodes, ``num_edges`` edges and ``num_graphs`` graphs, returned as a new
    :class:`torch_geometric.data.Data` with the same fields plus ``node_mask`` (bool [num_nodes]:
    the real nodes) and ``num_graphs``. Padded nodes (zero features) form graphs of at most
    ``segment`` nodes after the real ones (so attention over them stays small); padded edges
    (zero features) are self loops spread over the padded nodes; graph-level (or node-level)
    ``y`` gets NaN rows (floating) or -100 (integer: cross entropy's ``ignore_index``). Pool with
    ``size=data.num_graphs`` and drop the NaN targets with a mask (not boolean indexing, which
    synchronises) to keep the step capturable."""
    from torch_geometric.data import Data

    n, e = data.num_nodes, data.edge_index.size(1)
    g = int(data.num_graphs)
    pad = num_nodes - n
    groups = -(-pad // segment)
    if pad < 0 or num_edges < e or (num_edges > e and pad == 0) or num_graphs < g + groups:
        raise ValueError(
            f"pad_batch: {n} nodes, {e} edges, {g} graphs do not fit {num_nodes} nodes, "
            f"{num_edges} edges, {num_graphs} graphs (padded edges need a padded node; padded "
            f"nodes need {groups} graphs of at most {segment})"
        )
    out = Data()
    out.x = _padded(data.x, num_nodes, 0)
    pad_ids = g + torch.arange(pad, dtype=data.batch.dtype) // segment
    out.batch = torch.cat([data.batch, pad_ids])
    loops = n + torch.arange(num_edges - e, dtype=data.edge_index.dtype) % max(pad, 1)
    out.edge_index = torch.cat([data.edge_index, loops.expand(2, -1)], dim=1)
    if getattr(data, "edge_attr", None) is not None:
        out.edge_attr = _padded(data.edge_attr, num_edges, 0)
    y = getattr(data, "y", None)
    if y is not None:
        rows = num_graphs if y.size(0) == g else num_nodes
        out.y = _padded(y, rows, math.nan if y.is_floating_point() else -100)
    out.node_mask = torch.arange(num_nodes) < n
    out.num_graphs = num_graphs
    return out


class PackedGraphs:
    """A list of PyG ``Data`` graphs (``x``, ``edge_index``, optional ``edge_attr``, graph-level
    ``y``) stacked once into whole-dataset tensors, so that a mini-batch is a few index gathers
    rather than PyG's graph-by-graph collation: :meth:`batch` gives the same ``x``,
    ``edge_index``, ``edge_attr``, ``batch`` and ``y`` as ``Batch.from_data_list`` of those
    graphs, as a ``Data`` with ``num_graphs``; :meth:`batches` one epoch of them."""

    def __init__(self, graphs):
        from torch_geometric.data import Batch

        whole = Batch.from_data_list(list(graphs))
        self.num_graphs = whole.num_graphs
        self._node_ptr = whole.ptr
        graph_of_edge = whole.batch[whole.edge_index[0]]
        self._edge_ptr = torch.zeros(self.num_graphs + 1, dtype=torch.int64)
        self._edge_ptr[1:] = torch.cumsum(
            torch.bincount(graph_of_edge, minlength=self.num_graphs), 0
        )
        order = torch.argsort(graph_of_edge, stable=True)
        # per-graph node ids, edges grouped by graph
        self._edge_index = whole.edge_index[:, order] - whole.ptr[graph_of_edge[order]]
        self._x = whole.x
        self._edge_attr = None if whole.edge_attr is None else whole.edge_attr[order]
        self._y = getattr(whole, "y", None)

    @staticmethod
    def _ranges(ptr: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(the rows of the graphs ``ids`` in order, each graph's count)."""
        starts, counts = ptr[ids], ptr[ids + 1] - ptr[ids]
        first = torch.cumsum(counts, 0) - counts
        rows = torch.arange(int(counts.sum())) + torch.repeat_interleave(starts - first, counts)
        return rows, counts

    def batch(self, ids: Tensor):
        """The mini-batch of graphs ``ids`` (int64), as PyG collates it."""
        from torch_geometric.data import Data

        nodes, n = self._ranges(self._node_ptr, ids)
        edges, e = self._ranges(self._edge_ptr, ids)
        offsets = torch.repeat_interleave(torch.cumsum(n, 0) - n, e)
        data = Data(x=self._x[nodes], edge_index=self._edge_index[:, edges] + offsets)
        data.batch = torch.repeat_interleave(torch.arange(ids.numel()), n)
        if self._edge_attr is not None:
            data.edge_attr = self._edge_attr[edges]
        if self._y is not None:
            data.y = self._y[ids]
        data.num_graphs = ids.numel()
        return data

    def batches(self, batch_size: int, shuffle: bool = False, generator=None):
        """One epoch of mini-batches of ``batch_size`` graphs (the last may be smaller), in a
        random order drawn from ``generator`` if ``shuffle``."""
        n = self.num_graphs
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        for start in range(0, n, batch_size):
            yield self.batch(order[start : start + batch_size])


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every CapturedStep's warm-ups and captures: torch keeps a
    cuBLAS workspace (32 MiB on Hopper) per thread and stream for the process's lifetime, so a
    stream per CapturedStep would hold another for each model trained in the process."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def capture_stream(device: torch.device | str | None = None):
    """Run eager work between captured steps (evaluation, above all) on the stream every
    :class:`CapturedStep` of ``device`` warms up and captures on, ordered after the current
    stream's work and before what the current stream does next. torch keeps a cuBLAS workspace
    (32 MiB on Hopper) per thread and stream for the process's life: a model evaluated on the
    default stream between replays adds a second one to the one the captured steps hold (their
    forward and backward run on one thread and stream). Yields the stream. Tensors made inside
    and used outside on another stream must be recorded there (``Tensor.record_stream``);
    reading results to the host inside is simplest::

        with trisparse.nn.capture.capture_stream():
            preds = [model(batch).float().cpu() for batch in loader]
    """
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"capture_stream: a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    side, current = _side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            yield side
    finally:
        current.wait_stream(side)


class CapturedStep:
    """``step(*inputs)`` (forward, loss, ``backward()``, ``optimizer.step()``; returns tensors, e.g.
    the loss) run as a CUDA graph captured once per input shape and dtype, then replayed with the
    inputs copied into the graph's own. The first call of a shape runs ``warmup`` eager steps on a
    side stream (as CUDA graph capture needs), puts back the model's parameters and buffers and
    the optimizer's state as they were before them, captures, and replays once: every call is one
    training step on its own inputs. Warm-ups and capture run their backward on the calling
    thread (``torch.autograd.set_multithreading_enabled(False)``), so the forward and the backward
    share one cuBLAS workspace; evaluate between calls under :func:`capture_stream` to keep it at
    one. The graphs share one memory pool. The returned tensors are the graph's own, overwritten
    by the next call: read them before it.

    ``optimizer`` needs ``capturable=True`` (torch's Adam, AdamW, SGD...); state it creates during
    the warm-up (the first step) is zeroed, which is how those optimizers start it. Use autocast
    with ``cache_enabled=False`` inside ``step``. Every op on the path must be capturable (no host
    synchronisation, no data-dependent shape): see :func:`pad_batch` for PyG mini-batches."""

    def __init__(self, step, model: torch.nn.Module, optimizer: torch.optim.Optimizer, warmup=3):
        if not optimizer.defaults.get("capturable", False):
            raise ValueError(
                "CapturedStep: build the optimizer with capturable=True (its step runs inside the "
                "CUDA graph)"
            )
        self._step, self._model, self._optimizer, self._warmup = step, model, optimizer, warmup
        self._graphs: dict = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        """How many shapes have been captured."""
        return len(self._graphs)

    def __call__(self, *inputs: Tensor):
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(inputs)
        else:
            for static, t in zip(entry[1], inputs):
                static.copy_(t)
        entry[0].replay()
        return entry[2]

    def _capture(self, inputs):
        device = next(self._model.parameters()).device
        static = [t.to(device, copy=True) for t in inputs]
        saved = self._state()
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        # The backward on this thread, not autograd's device thread: its cuBLAS calls then share
        # the forward's handle and workspace on the side stream (one workspace, not two).
        with torch.autograd.set_multithreading_enabled(False):
            with torch.cuda.stream(side):
                for _ in range(self._warmup):
                    self._optimizer.zero_grad(set_to_none=True)
                    self._step(*static)
            torch.cuda.current_stream(device).wait_stream(side)
            self._restore(saved)
            self._optimizer.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                outputs = self._step(*static)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, static, outputs

    def _state(self):
        """Copies of the model's parameters and buffers and of the optimizer's tensor state."""
        model = {k: v.detach().clone() for k, v in self._model.state_dict().items()}
        opt = {
            (p, k): v.clone()
            for p, state in self._optimizer.state.items()
            for k, v in state.items()
            if isinstance(v, Tensor)
        }
        return model, opt

    @torch.no_grad()
    def _restore(self, saved):
        model, opt = saved
        for k, v in self._model.state_dict().items():
            v.copy_(model[k])
        for p, state in self._optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, Tensor):
                    v.copy_(opt[(p, k)]) if (p, k) in opt else v.zero_()
