"""trisparse.nn.GATConv: PyG's GATConv over the fused GAT attention or the per-edge path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torch_geometric.nn import GATConv as _PygGATConv
from torch_geometric.utils import scatter

from ... import _C
from ...copies import (
    copy_logsumexp,
    copy_sum,
    copy_weights,
    gather_rows,
    to_copies,
    weights_from_lse,
)
from ...distributed import DistributedPattern
from ...edge import edge_scores, edge_softmax, edge_spmm
from ...edge_attention import edge_attention_supported, edge_gat_attention, neighbor_sum
from ...gat import gat_attention
from ...pattern import Pattern
from ._common import _check_float, _edge_features, _float32_cuda_eager, _Fused


class _BiasAdd(torch.autograd.Function):
    """out + bias, PyG's last step (16-bit out promoted to bias's float32 under autocast), with
    the bias's gradient as a matrix-vector product of the output's gradient with ones: torch's
    column sum over 128 columns read at 0.75 TB/s on an H200 (0.22 ms for 325,729 float32 rows)."""

    @staticmethod
    def forward(ctx, out, bias):
        ctx.out_dtype, ctx.bias_dtype = out.dtype, bias.dtype
        return out + bias

    @staticmethod
    def backward(ctx, grad):
        d_out = grad.to(ctx.out_dtype) if ctx.needs_input_grad[0] else None
        d_bias = None
        if ctx.needs_input_grad[1]:
            rows = grad.reshape(-1, grad.shape[-1])
            with torch.autocast(grad.device.type, enabled=False):
                d_bias = torch.mv(rows.t(), rows.new_ones(rows.shape[0])).to(ctx.bias_dtype)
        return d_out, d_bias


_CHUNK_ROWS = 1024  # rows of the edge features a chunk of the weight's gradient sums


# The fused kernel's widest head (a plain int: torch.compile does not compare the extension's).
_MAX_HEAD_WIDTH = int(_C.GatPlan.max_head_width)


def _chunked_outer(a: Tensor, g: Tensor) -> Tensor:
    """a^T g [F, H] over E rows as chunks of _CHUNK_ROWS rows (one batched product) summed in a
    fixed order, then the rest: cuBLAS's split-K product over 1.5M float32 rows took 0.23 ms on
    an H200 where the chunks take 0.13."""
    chunks = a.shape[0] // _CHUNK_ROWS
    body = chunks * _CHUNK_ROWS
    a_chunks = a[:body].view(chunks, _CHUNK_ROWS, a.shape[1]).transpose(1, 2)
    total = torch.bmm(a_chunks, g[:body].view(chunks, _CHUNK_ROWS, g.shape[1])).sum(0)
    return total + a[body:].t() @ g[body:] if body < a.shape[0] else total


class _EdgeProduct(torch.autograd.Function):
    """GATConv's edge features times their [edge_dim, heads] weight, float32 on CUDA, with the
    weight's gradient by chunks (:func:`_chunked_outer`; repeatable: no atomics, a fixed
    order)."""

    @staticmethod
    def forward(ctx, a, w):
        a = a.contiguous()
        ctx.save_for_backward(a, w)
        return a @ w

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        g = g.contiguous()
        da = g @ w.t() if ctx.needs_input_grad[0] else None
        dw = _chunked_outer(a, g) if ctx.needs_input_grad[1] else None
        return da, dw


def _edge_product(a: Tensor, w: Tensor) -> Tensor:
    """a @ w for edge features a [E, F] and their weight w [F, H]: :class:`_EdgeProduct` for
    float32 on CUDA with enough rows to chunk (outside autocast, whose 16-bit product is fast),
    else the matmul."""
    fast = _float32_cuda_eager(a, w, 16 * _CHUNK_ROWS)
    return _EdgeProduct.apply(a, w) if fast else a @ w


def _projects_with_terms(lin, x: Tensor) -> bool:
    """Whether GATConv's projection and node terms run as one GEMM (CUDA, lin initialised and
    without a bias, as PyG makes it; a lazy lin's first call takes PyG's products)."""
    return x.is_cuda and lin.bias is None and not isinstance(lin.weight, UninitializedParameter)


class GATConv(_Fused, _PygGATConv):
    """PyG's :class:`torch_geometric.nn.GATConv` (same arguments, parameters, outputs): the
    scores LeakyReLU(a_dst . W x_i + a_src . W x_j), their softmax over each target's incoming
    edges and the aggregation of W x_j run as one fused op (:func:`trisparse.gat_attention`), so
    neither [E, heads] scores nor [E, heads, channels] messages are materialised, and the
    gradients are deterministic. Attention dropout (``dropout``) is drawn in the fused kernels,
    one draw per (input edge, head), and regenerated in the backward: no [E, heads] tensor, and
    the same draws for a plain graph and a multigraph, on the CPU and on CUDA. With
    ``pyg_dropout=True`` it drops the same edges as PyG's layer for the same seed (PyG's
    [E, heads] factors, read by the kernels), as the per-edge path below always does.

    Repeated edges (each copy its own term, as in PyG) and edge features (``edge_dim``: the edge
    term a_edge . W_e a_ij becomes one [edge_dim, heads] product, with ``fill_value`` for the self
    loops as PyG) run fused over the input's edges (:func:`trisparse.edge_gat_attention`, CUDA
    kernels or the CPU engine, attention dropout included). ``return_attention_weights``: the
    same fused attention, then the [E, heads] weights from its log-sum-exp; while training with
    dropout (PyG returns the weights after it), under torch.compile, and for heads wider than
    512 channels the per-edge path: [E, heads] scores, their softmax and the per-edge SpMM (no
    [E, heads, channels] tensor).
    Bipartite inputs ``(x_src, x_dst)`` and ``size`` are taken as PyG takes them. ``edge_index``
    may also be a :class:`trisparse.Pattern` (built once, self loops included if wanted) or a
    :class:`trisparse.distributed.DistributedPattern` (this rank's rows of a partitioned graph).
    Falls back to PyG's code, with a one-time warning, only for edge features or attention
    weights over a graph given as a ``SparseTensor``."""

    def __init__(self, *args, pyg_dropout: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.pyg_dropout = pyg_dropout
        self._init_fused()

    def forward(self, x, edge_index, edge_attr=None, size=None, return_attention_weights=None):
        if isinstance(edge_index, DistributedPattern):
            if self.add_self_loops != edge_index.add_self_loops:
                raise ValueError(
                    f"edge_index: GATConv(add_self_loops={self.add_self_loops}) takes a "
                    "DistributedPattern built with add_self_loops="
                    f"{self.add_self_loops} (the loops are added to the whole graph)"
                )
            return self._distributed(x, edge_index, edge_attr, return_attention_weights)
        edge_attr, per_edge, unfused = self._edge_request(
            edge_index, edge_attr, return_attention_weights
        )
        if unfused:
            return super().forward(x, edge_index, edge_attr, size, return_attention_weights)
        H, C = self.heads, self.out_channels
        res = alphas = None
        if isinstance(x, Tensor):
            res = self.res(x) if getattr(self, "res", None) is not None else None
            if self.lin is not None and _projects_with_terms(self.lin, x):
                x_src, alphas = self._project_with_terms(x)
                x_dst = x_src
            elif self.lin is not None:
                x_src = x_dst = self.lin(x).view(-1, H, C)
            else:
                x_src, x_dst = self.lin_src(x).view(-1, H, C), self.lin_dst(x).view(-1, H, C)
        else:
            x_src, x_dst = x
            if x_dst is not None and getattr(self, "res", None) is not None:
                res = self.res(x_dst)
            lin_src = self.lin if self.lin is not None else self.lin_src
            lin_dst = self.lin if self.lin is not None else self.lin_dst
            x_src = lin_src(x_src).view(-1, H, C)
            x_dst = None if x_dst is None else lin_dst(x_dst).view(-1, H, C)
        num_src = x_src.size(0)
        num_dst = x_dst.size(0) if x_dst is not None else num_src
        if size is not None:
            num_src, num_dst = int(size[0]), int(size[1])
        pattern = self._patterns.get(
            edge_index, num_src, num_dst, add_self_loops=self.add_self_loops
        )
        if alphas is not None:
            alpha_src, alpha_dst = alphas
        else:
            alpha_src = (x_src * self.att_src).sum(dim=-1)
            alpha_dst = (
                x_src.new_zeros(num_dst, H) if x_dst is None else (x_dst * self.att_dst).sum(dim=-1)
            )

        def edge_terms():
            return self._edge_terms(edge_attr, edge_index, pattern, num_src, num_dst)

        out, weights = self._attend(
            x_src, alpha_src, alpha_dst, pattern, edge_attr, edge_terms, per_edge,
            return_attention_weights,
        )  # fmt: skip
        out = self._finish(out, res)
        if return_attention_weights:
            return out, (_with_loops(edge_index, pattern), weights)
        return out

    def _project_with_terms(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """W x [N, H, C] and GAT's node terms alpha_src, alpha_dst [N, H] from one GEMM: the
        terms are x's products with att_h W_h (W_h: head h's rows of lin's weight), two more
        [H, in] rows appended to W, so the terms cost H / C more of the projection instead of a
        pass over W x (and its backward) of their own. Both are views of the GEMM's output, which
        the kernels read in place. Under autocast the terms come out of the GEMM in 16 bits (PyG
        sums att * W x in float32), as the projection does."""
        H, C = self.heads, self.out_channels
        w = self.lin.weight  # [H C, in]
        atts = torch.cat([self.att_src, self.att_dst]).transpose(0, 1)  # [H, 2, C]
        rows = torch.bmm(atts, w.view(H, C, -1)).transpose(0, 1).reshape(2 * H, -1)
        y = F.linear(x, torch.cat([w, rows]))  # [N, H C + 2 H]: (one product, few host ops)
        x_proj, alpha_src, alpha_dst = y.split([H * C, H, H], dim=-1)  # (one cat backward)
        return x_proj.view(-1, H, C), (alpha_src, alpha_dst)

    def _attend(
        self, x_src, alpha_src, alpha_dst, pattern, edge_attr, edge_terms, per_edge, weights
    ):
        """GAT's attention of projected sources x_src [num_cols, H, C] with their and the
        targets' terms over `pattern`: (out [num_rows, H, C], the input edges' weights where the
        per-edge path ran, else None). ``edge_terms()`` gives the [E, H] edge terms."""
        C = self.out_channels
        dropout = self.training and self.dropout > 0
        multigraph = edge_attr is not None or pattern.duplicates
        # The weights from the fused forward's lse, where they are the softmax's (PyG returns them
        # after dropout, whose draws in training the per-edge path makes; so does torch.compile).
        from_lse = bool(weights) and not dropout and not torch.compiler.is_compiling()
        if from_lse and edge_attention_supported(pattern, x_src):
            a_edge = edge_terms() if edge_attr is not None else None
            out, lse = edge_gat_attention(
                x_src, alpha_src, alpha_dst, pattern, self.negative_slope, a_edge,
                return_lse=True,
            )  # fmt: skip
            scores = self._copy_scores(alpha_src, alpha_dst, a_edge, pattern)
            return out, weights_from_lse(scores, lse, pattern)
        if multigraph and not weights and edge_attention_supported(pattern, x_src):
            # fused over the input's edges, each copy its own term and dropout draw
            a_edge = edge_terms() if edge_attr is not None else None
            out = edge_gat_attention(
                x_src,
                alpha_src,
                alpha_dst,
                pattern,
                self.negative_slope,
                a_edge,
                self.dropout if dropout else 0.0,
                pyg_dropout=self.pyg_dropout,
            )
            return out, None
        if per_edge or pattern.duplicates or C > _MAX_HEAD_WIDTH:
            a_edge = edge_terms() if edge_attr is not None else None
            return self._per_edge(x_src, alpha_src, alpha_dst, a_edge, pattern, dropout)
        keep = order = None
        p = self.dropout if dropout else 0.0
        if dropout:  # keyed by (or PyG's factors in) the input's edge order
            order = pattern.input_order(x_src.device)
            order = None if order is None else order[1]
        if dropout and self.pyg_dropout:  # PyG's dropout of the [E, H] weights
            keep = F.dropout(x_src.new_ones(pattern.nnz, self.heads), p=p, training=True)
            p = 0.0
        out = gat_attention(
            x_src, alpha_src, alpha_dst, pattern, self.negative_slope, keep, order, dropout=p
        )
        return out, None

    def _finish(self, out, res):
        """The heads concatenated or averaged, the residual and the bias."""
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if res is not None:
            out = out + res
        if self.bias is not None:
            fused = out.is_cuda and not torch.compiler.is_compiling()
            out = _BiasAdd.apply(out, self.bias) if fused else out + self.bias
        return out

    def _distributed(self, x, dp, edge_attr=None, return_attention_weights=None):
        """This rank's rows of a partitioned graph: the owned rows projected once, the interior
        rows attended while the halo's inputs arrive, then the halo's rows projected and the
        boundary rows attended."""
        self._check_distributed(x, return_attention_weights)
        if self.lin_edge is None:
            edge_attr = None
        H, C = self.heads, self.out_channels
        halo, arrived = dp.start_exchange(x)
        lin_src = self.lin if self.lin is not None else self.lin_src
        lin_dst = self.lin if self.lin is not None else self.lin_dst
        x_src = lin_src(x).view(-1, H, C)
        x_dst = x_src if lin_dst is lin_src else lin_dst(x).view(-1, H, C)
        alpha_src = (x_src * self.att_src).sum(dim=-1)
        alpha_dst = (x_dst * self.att_dst).sum(dim=-1)
        res = self.res(x) if getattr(self, "res", None) is not None else None
        outs = []
        for side in (0, 1):
            if side == 1:
                arrived.wait()
                halo_src = lin_src(halo).view(-1, H, C)
                x_src = torch.cat([x_src, halo_src])
                alpha_src = torch.cat([alpha_src, (halo_src * self.att_src).sum(dim=-1)])
            rows = dp.rows(side)
            if rows.stop > rows.start:
                pattern = dp.pattern(side)
                attr = dp.edge_rows(side, edge_attr)  # (no self loops: edge_rows checks)

                def edge_terms(pattern=pattern, attr=attr):
                    return self._edge_terms(attr, None, pattern, 0, 0)

                out, _ = self._attend(
                    x_src, alpha_src, alpha_dst[rows], pattern, attr, edge_terms,
                    attr is not None, None,
                )  # fmt: skip
                outs.append(out)
        out = dp.joined(outs[0] if len(outs) == 1 else torch.cat(outs), halo)
        return self._finish(out, res)

    def _edge_terms(self, edge_attr, edge_index, pattern, num_src, num_dst) -> Tensor:
        """[E_in, H]: the edge term (W_e a . att_edge) summed over C = a . (W_e^T att_edge) of
        the pattern's input edges. With self loops: the kept edges' terms and the loops' from
        ``fill_value``, as PyG's remove_self_loops and add_self_loops give the features. The
        product is taken first, over every edge, so only [E, H] values are gathered or reduced: a
        linear fill ("mean", "add", a constant) commutes with it; "min", "max" and "mul" reduce
        the features. The kept edges come from the pattern, so no shape depends on data
        (torch.compile)."""
        _check_float("edge_attr", edge_attr)
        H, C = self.heads, self.out_channels
        w_edge = self.lin_edge.weight.view(H, C, -1)
        to_heads = torch.bmm(self.att_edge.transpose(0, 1), w_edge).view(H, -1).t()  # [F, H]
        if not self.add_self_loops:
            return _edge_product(_edge_features(edge_attr, pattern, self.edge_dim), to_heads)
        kept = pattern.kept_edges(edge_attr.device)
        if kept is None or not isinstance(edge_index, Tensor):
            raise TypeError(
                "edge_index: edge features with add_self_loops need the edge_index tensor (the "
                "loops' features are filled from it)"
            )
        if edge_attr.dim() == 1:
            edge_attr = edge_attr.unsqueeze(-1)
        if edge_attr.dim() != 2 or edge_attr.shape != (edge_index.size(1), self.edge_dim):
            raise ValueError(
                f"edge_attr must have shape [{edge_index.size(1)}, {self.edge_dim}] (one row per "
                f"edge of edge_index, edge_dim columns), got {list(edge_attr.shape)}"
            )
        n = min(num_src, num_dst)
        fill = self.fill_value
        nonlinear = isinstance(fill, str) and fill not in ("mean", "add", "sum")
        values = edge_attr if nonlinear else _edge_product(edge_attr, to_heads)
        if fill is None or isinstance(fill, (int, float, Tensor)):
            row = edge_attr.new_full((self.edge_dim,), 1.0 if fill is None else 0.0)
            if isinstance(fill, Tensor):
                row = fill.to(edge_attr.device, edge_attr.dtype).reshape(-1).expand(self.edge_dim)
            elif fill is not None:
                row = row + fill
            loops = (row @ to_heads).expand(n, H)
        else:  # a reduction over each node's incoming kept edges
            loops = _incoming(values, edge_index[1], kept, n, fill, pattern)
        if kept.numel() != edge_attr.size(0):  # self loops in the input: dropped
            values = gather_rows(values, kept)
        if nonlinear:
            values, loops = values @ to_heads, loops @ to_heads
        return torch.cat([values, loops])

    def _copy_scores(self, alpha_src, alpha_dst, a_edge, pattern):
        """[E, H]: each input edge's score LeakyReLU(alpha_dst_i + alpha_src_j + a_edge)."""
        scores = to_copies(edge_scores(alpha_dst, alpha_src, pattern), pattern)
        if a_edge is not None:
            scores = scores + a_edge
        return F.leaky_relu(scores, self.negative_slope)

    def _per_edge(self, x_src, alpha_src, alpha_dst, a_edge, pattern, dropout):
        """GAT's attention with [E, H] weights per input edge: the output [N, H, C] and the
        weights (after dropout, as PyG's layer returns them)."""
        scores = self._copy_scores(alpha_src, alpha_dst, a_edge, pattern)
        entry = copy_logsumexp(scores, pattern)
        alpha = edge_softmax(entry, pattern)
        weights = to_copies(alpha, pattern)
        shares = copy_weights(scores, entry, pattern)
        if shares is not None:  # a repeated edge's copies share its weight
            weights = weights * shares
        if dropout:
            weights = F.dropout(weights, p=self.dropout, training=True)
        return edge_spmm(copy_sum(weights, pattern), x_src, pattern), weights


def _incoming(
    values: Tensor, targets: Tensor, kept: Tensor, n: int, reduce: str, pattern: Pattern
) -> Tensor:
    """[n, W]: PyG's scatter(values[kept], targets[kept], 0, n, reduce) (0 where no edge comes
    in) for the given edges' values [E, W]. A sum or mean on CUDA (16 or 32 bits) is
    :class:`_IncomingSum` (the rows of `values` read in place, in a fixed order); elsewhere a
    segment reduction over the kept edges grouped by target (also a fixed order: repeatable,
    where PyG's scatter adds with atomics); the other reductions, and any call under
    torch.compile, take PyG's scatter."""
    linear = reduce in ("mean", "add", "sum")
    fused = values.is_cuda and values.dtype != torch.float64  # neighbor_sum's CUDA types
    if linear and fused and not torch.compiler.is_compiling():
        lines = pattern._cached(
            "loop_fill_lines",
            values.device,
            lambda: _IncomingLines(targets, kept, n, values.size(0)),
        )
        return _IncomingSum.apply(values, lines, reduce == "mean")
    if kept.numel() != values.size(0):
        values, targets = gather_rows(values, kept), targets[kept]
    if not linear or torch.compiler.is_compiling():
        return scatter(values, targets, 0, n, reduce=reduce)

    def grouped():
        order = torch.argsort(targets, stable=True)
        return order, torch.bincount(targets, minlength=n)

    order, lengths = pattern._cached("loop_fill_groups", values.device, grouped)
    return torch.segment_reduce(
        gather_rows(values, order),
        "mean" if reduce == "mean" else "sum",
        lengths=lengths,
        axis=0,
        unsafe=True,  # the lengths sum to the edges by construction: no host check
        initial=0.0,
    )


class _IncomingLines:
    """Each node's incoming kept edges: a pattern whose row i lists them (columns: their positions
    among the given `edges`, ascending), each row's count (at least 1: a mean's divisor, float32
    [n, 1]), and each given edge's row in a gradient with a zero row appended (its target, or n
    for a dropped edge)."""

    def __init__(self, targets: Tensor, kept: Tensor, n: int, edges: int):
        into = targets[kept]
        lengths = torch.bincount(into, minlength=n)
        if lengths.numel() != n:
            raise ValueError(
                f"edge_index: an edge's target is {lengths.numel() - 1}, past the {n} nodes "
                "that get self loops"
            )
        order = torch.argsort(into, stable=True)
        rowptr = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        self.pattern = Pattern.from_sorted_csr(
            rowptr, kept[order].to(torch.int32), edges, check=False
        )
        self.count = lengths.clamp(min=1).to(torch.float32)[:, None]
        self.source_row = torch.full((edges,), n, dtype=torch.int64, device=targets.device)
        self.source_row[kept] = into


class _IncomingSum(torch.autograd.Function):
    """The sum (or mean) over each node's incoming kept edges of the given edges' values [E, W]
    on CUDA: forward the multigraph kernels' sum over the lines (a fixed order), backward a
    gather of each edge's target's gradient (zero for a dropped edge): one read of each, where
    the transposed sum would take a warp per edge."""

    @staticmethod
    def forward(ctx, values, lines: _IncomingLines, mean: bool):
        total = neighbor_sum(values, lines.pattern)
        ctx.lines, ctx.mean = lines, mean
        return total / lines.count.to(total.dtype) if mean else total

    @staticmethod
    def backward(ctx, grad):
        lines = ctx.lines
        if ctx.mean:
            grad = grad / lines.count.to(grad.dtype)
        padded = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
        return gather_rows(padded, lines.source_row), None, None


def _with_loops(edge_index, pattern: Pattern) -> Tensor:
    """The edge_index whose edges the per-edge weights are of (PyG's, self loops included)."""
    if isinstance(edge_index, Pattern):
        row, col = edge_index.entries(edge_index.device)
        return torch.stack([col, row])
    rows = pattern.entries(edge_index.device)
    entries = pattern.entries_of_input(edge_index.device)
    return torch.stack([rows[1][entries], rows[0][entries]])
