"""What the drop-in PyG layers share: the Pattern cache of the last graph, PyG's generic propagate
for the fallback and its one-time warning, and the checks of per-edge inputs."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import MessagePassing

from ... import _C, _tensors
from ...pattern import Pattern


class _PatternCache:
    """The Pattern of the last graph a layer saw: rebuilt when the graph object, its contents
    (torch's version counter) or the node counts change. It holds the graph object, so that an
    equal id() never means another graph."""

    def __init__(self):
        self._adj = None
        self._key = None
        self._pattern = None

    def __deepcopy__(self, memo):
        """An empty cache: a copied layer (copy.deepcopy of a model) builds its own patterns
        (a Pattern's plans are device state, not copyable)."""
        return type(self)()

    def get(self, adj, num_src: int, num_dst: int, add_self_loops: bool = False) -> Pattern:
        if isinstance(adj, Pattern):
            return adj
        if torch.compiler.is_compiling():
            # Under torch.compile the Pattern is built from the real edge_index when the graph
            # is traced and baked into it (building it is data-dependent: no graph can hold it).
            return _TRACED[_traced_pattern(adj, num_src, num_dst, add_self_loops)]
        return self._get(adj, num_src, num_dst, add_self_loops)

    def _get(self, adj, num_src: int, num_dst: int, add_self_loops: bool) -> Pattern:
        key = (getattr(adj, "_version", None), num_src, num_dst, add_self_loops)
        if adj is not self._adj or key != self._key:
            if isinstance(adj, Tensor) and adj.layout == torch.strided:
                self._pattern = Pattern.from_edge_index(
                    adj, size=(num_src, num_dst), add_self_loops=add_self_loops
                )
            elif add_self_loops:
                raise TypeError(
                    "edge_index: with add_self_loops the fused path takes an edge_index tensor "
                    f"or a trisparse.Pattern, not {type(adj).__name__}"
                )
            else:
                self._pattern = Pattern.of(adj, num_nodes=num_src)
            self._adj, self._key = adj, key
        return self._pattern


# The Patterns that compiled graphs hold (by id): a graph baked with one must find it alive.
_TRACED: dict[int, Pattern] = {}


@torch._dynamo.assume_constant_result
def _traced_pattern(adj, num_src: int, num_dst: int, add_self_loops: bool) -> int:
    """Run by torch.compile while tracing, on the real edge_index: its Pattern's id, a constant
    of the compiled graph. The graph then serves that edge_index; a model called with another
    graph of the same shape must be recompiled (torch.compiler.reset()) or given a Pattern. The
    layers share one cache here: torch 2.11's dynamo takes no object argument to a constant
    result."""
    pattern = _TRACE_CACHE._get(adj, num_src, num_dst, add_self_loops)
    _TRACED[pattern.id] = pattern
    return pattern.id


_TRACE_CACHE = _PatternCache()


def _generic_propagate(self, edge_index, size=None, **kwargs):
    return MessagePassing.propagate(self, edge_index, size=size, **kwargs)


def _generic_edge_updater(self, edge_index, size=None, **kwargs):
    return MessagePassing.edge_updater(self, edge_index, size=size, **kwargs)


class _Fused:
    """What the drop-in layers share: the Pattern cache, PyG's generic propagate for the
    fallback, and the one-time warning that names why a call runs PyG's code."""

    def _init_fused(self) -> None:
        self._patterns = _PatternCache()
        self._warned: set[str] = set()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # PyG's generic propagate and edge_updater, in the class itself: PyG would otherwise
        # generate them from the class's source, which has no such calls to read arguments from.
        cls.propagate = _generic_propagate
        cls.edge_updater = _generic_edge_updater

    def _edge_request(self, edge_index, edge_attr, return_attention_weights):
        """What a call asks of edge features and attention weights: (edge_attr, None where the
        layer has no edge_dim, as PyG ignores it then; whether the per-edge path is asked;
        whether PyG's code must run: those asked over a graph that is neither an edge_index
        tensor nor a Pattern)."""
        if self.lin_edge is None:
            edge_attr = None
        per_edge = edge_attr is not None or bool(return_attention_weights)
        unfused = per_edge and not isinstance(edge_index, (Tensor, Pattern))
        if unfused:
            self._fallback(
                "edge features and attention weights need an edge_index tensor", edge_index
            )
        return edge_attr, per_edge, unfused

    def _check_distributed(self, x, return_attention_weights) -> None:
        if return_attention_weights:
            raise ValueError(
                "return_attention_weights is not taken with a DistributedPattern (the weights "
                "of each rank's edges are in its local order)"
            )
        if not isinstance(x, Tensor):
            raise TypeError("x: with a DistributedPattern, pass this rank's rows as one tensor")

    def _fallback(self, reason: str, edge_index) -> None:
        if isinstance(edge_index, Pattern):
            raise TypeError(
                f"edge_index: a trisparse.Pattern cannot run PyG's code ({reason}); pass edge_index"
            )
        if reason not in self._warned:
            self._warned.add(reason)
            name = type(self).__name__
            warnings.warn(
                f"trisparse.nn.{name}: {reason}; running PyG's {name} code for this call "
                "(exact, not fused)",
                stacklevel=3,
            )


def _block_diagonal(blocks: Tensor) -> Tensor:
    """[H, a, b] -> [H a, H b] with block h on the diagonal and zeros elsewhere: one product
    with the identity (torch.block_diag of H blocks copies them one by one, and its backward
    slices them: some 40 small ops a layer call, which set the step's host time on graphs with
    few nodes)."""
    H, a, b = blocks.shape
    eye = torch.eye(H, dtype=blocks.dtype, device=blocks.device)
    return (blocks[:, :, None, :] * eye[:, None, :, None]).reshape(H * a, H * b)


def _float32_cuda_eager(x: Tensor, w: Tensor, min_rows: int) -> bool:
    """Whether a product of x (at least min_rows rows) with a small weight w takes its float32
    CUDA form of our own: both float32 on CUDA, outside autocast (whose 16-bit products are
    fast) and outside torch.compile (which traces the plain products)."""
    return (
        x.is_cuda
        and x.dtype == w.dtype == torch.float32
        and x.shape[0] >= min_rows
        and not torch.is_autocast_enabled(x.device.type)
        and not torch.compiler.is_compiling()
    )


_HEAD_CHUNKS = 256  # interleaved row chunks a per-head weight gradient sums (cuBLAS's split-K
# over 325,729 rows runs in a few thread blocks)


def _library_takes(x: Tensor, a: int, b: int) -> bool:
    """Whether trisparse's per-head kernels (`head_product`, `head_outer`: one pass over the rows)
    take [N, H, a] x with widths a, b: float32 on CUDA, up to head_product_max_width."""
    return x.is_cuda and x.dtype == torch.float32 and max(a, b) <= _C.head_product_max_width


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _per_head(x: Tensor, w: Tensor) -> Tensor:
    """[N, H, b]: x[n, h] @ w[h] for x [N, H, a] with a unit last stride (read in place) and w
    [H, a, b]: the library's kernel, else one product batched over the heads, written in place
    into the [N, H, b] result."""
    out = x.new_empty(x.shape[0], x.shape[1], w.shape[2])
    if _library_takes(x, w.shape[1], w.shape[2]):
        views = (_tensors.view(x), _tensors.view(_unit_last(w)), _tensors.view(out))
        _C.head_product(*views, _tensors.stream(x.device))
        return out
    torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    return out


def _head_outer(x: Tensor, g: Tensor) -> Tensor:
    """[H, a, b]: sum over n of x[n, h]^T g[n, h] for x [N, H, a], g [N, H, b]: the library's
    kernels (chunks of rows summed in order, then the chunks), else the rows dealt to
    _HEAD_CHUNKS interleaved chunks (row n to chunk n mod K: chunk and head then index one batch
    of a strided batched product, no copy), the chunks summed in a fixed order."""
    (n, h, a), b = x.shape, g.shape[2]
    if _library_takes(x, a, b):
        x, g = _unit_last(x), _unit_last(g)
        dw = x.new_empty(h, a, b)
        _owner, ws, nbytes = _tensors.workspace(_C.head_outer_workspace_bytes(n, h, a, b), x.device)
        _C.head_outer(
            _tensors.view(x),
            _tensors.view(g),
            _tensors.view(dw),
            ws,
            nbytes,
            _tensors.stream(x.device),
        )
        return dw
    x, g = x.contiguous(), g.contiguous()
    k = _HEAD_CHUNKS
    body = n // k * k
    xs = x[:body].view(body // k, k * h, a).transpose(0, 1)  # [K H, rows, a]
    gs = g[:body].view(body // k, k * h, b).transpose(0, 1)
    total = torch.bmm(xs.transpose(1, 2), gs).view(k, h, a, b).sum(0)
    if body < n:
        total = total + torch.einsum("nha,nhb->hab", x[body:], g[body:])
    return total


class _HeadProduct(torch.autograd.Function):
    """x [N, H, a] times a weight per head w [H, a, b] (the block-diagonal product's result
    without its H - 1 zero blocks of FLOPs): forward and x's gradient batched over the heads,
    the weight's gradient by :func:`_head_outer` (repeatable: a fixed order, no atomics)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _per_head(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _per_head(g, w.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        dw = _head_outer(x, g) if ctx.needs_input_grad[1] else None
        return dx, dw


def _head_product(x: Tensor, w: Tensor) -> Tensor:
    """x [N, H, a] @ w[h] per head -> [N, H, b]: float32 on CUDA over many rows as
    :class:`_HeadProduct` (the block-diagonal GEMM's zero blocks are 7/8 of its FLOPs at 8 heads,
    on float32 cores); else one GEMM with the block-diagonal weight, which costs fewer launches
    where the host sets the pace (few nodes) or tensor cores make FLOPs cheap (autocast)."""
    n, h, _ = x.shape
    if _float32_cuda_eager(x, w, 16 * _HEAD_CHUNKS):
        return _HeadProduct.apply(x, w)
    if _few_rows_under_autocast(x, w):
        with torch.autocast("cuda", enabled=False):
            return _HeadProduct.apply(x.float(), w.float()).to(x.dtype)
    return F.linear(x.reshape(n, -1), _block_diagonal(w.transpose(1, 2))).view(n, h, -1)


_AUTOCAST_KERNEL_ROWS = 65_536  # below: the host's pace (few nodes), fewer ops than autocast's GEMM


def _few_rows_under_autocast(x: Tensor, w: Tensor) -> bool:
    """Whether a 16-bit product under CUDA autocast takes the float32 kernels (two casts and one
    kernel a pass against the block-diagonal GEMM's ~6 ops): few rows, where the host sets the
    step's pace."""
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and 16 * _HEAD_CHUNKS <= x.shape[0] < _AUTOCAST_KERNEL_ROWS
        and torch.is_autocast_enabled("cuda")
        and not torch.compiler.is_compiling()
        and max(w.shape[1], w.shape[2]) <= _C.head_product_max_width
    )


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of 16-bit operands, accumulated and written in float32: by the GEMM itself on CUDA
    (out_dtype: no cast pass over the result), from float32 copies elsewhere (the CPU's mm has
    no out_dtype)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float().mm(b.float())


class _AutocastLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) as CUDA autocast computes it (x, weight and bias cast to the
    autocast dtype, the product and its gradients in it, the gradients cast back), saving x
    itself for the weight's gradient instead of its 16-bit copy: the backward casts x again. A
    float32 x is the caller's (an input, held anyway), so the copy was one [N, in] tensor more
    alive through the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        w = weight.to(dtype)
        ctx.save_for_backward(x, w)
        ctx.bias = None if bias is None else bias.dtype
        return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        # As autograd's addmm backward orders the products (grad @ w, grad^T @ x), each written
        # in float32 by the GEMM itself (no cast pass over its result).
        if ctx.needs_input_grad[0]:
            dx = _mm_f32(g, w).to(x.dtype)
        with_bias = ctx.bias is not None and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1] or with_bias:
            # x in the products' dtype with a column of ones (padded to 8 columns for the tensor
            # cores' alignment): the bias gradient g^T 1 is a column of the weight's product
            # instead of a reduction pass over g.
            n, k = x.shape
            xa = x.new_empty(n, k + 8, dtype=w.dtype)
            xa[:, :k].copy_(x)
            xa[:, k:].zero_()
            xa[:, k].fill_(1)
            dwa = _mm_f32(g.t(), xa)
            dw = dwa[:, :k] if ctx.needs_input_grad[1] else None
            db = dwa[:, k].to(ctx.bias) if with_bias else None
        return dx, dw, db, None


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear; under CUDA autocast with many rows of a float32 x (from _AUTOCAST_KERNEL_ROWS,
    where the copy's memory counts and one more cast costs little), :class:`_AutocastLinear`."""
    if (
        x.is_cuda
        and x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.shape[0] >= _AUTOCAST_KERNEL_ROWS
        and torch.is_autocast_enabled("cuda")
        and not torch.compiler.is_compiling()
    ):
        dtype = torch.get_autocast_dtype("cuda")
        with torch.autocast("cuda", enabled=False):
            return _AutocastLinear.apply(x, weight, bias, dtype)
    return F.linear(x, weight, bias)


def _input_edges(pattern: Pattern) -> int:
    entries = pattern.entries_of_input(torch.device("cpu"))
    if entries is None:
        raise TypeError(
            "edge_index: per-edge values need the edges a Pattern was built from; pass "
            "edge_index (or a Pattern from Pattern.from_edge_index)"
        )
    return entries.numel()


def _check_float(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


def _edge_features(edge_attr, pattern: Pattern, edge_dim: int) -> Tensor:
    """edge_attr as [E, edge_dim] (PyG also takes [E] for edge_dim 1), checked against the
    graph's edge count."""
    _check_float("edge_attr", edge_attr)
    if edge_attr.dim() == 1:
        edge_attr = edge_attr.unsqueeze(-1)
    edges = _input_edges(pattern)
    if edge_attr.dim() != 2 or edge_attr.shape != (edges, edge_dim):
        raise ValueError(
            f"edge_attr must have shape [{edges}, {edge_dim}] (one row per edge of edge_index, "
            f"edge_dim columns), got {list(edge_attr.shape)}"
        )
    return edge_attr
