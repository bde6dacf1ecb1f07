"""Block-sparse attention and the top-k selection as torch ops (`trisparse::block_sparse_attention`
and its backward, `topk_blocks`) with their fake implementations."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .. import _C, _tensors
from ..block_mask import _masks


def _plan(q: Tensor, mask: int, cu_q: list[int], cu_k: list[int]):
    # The fastest backend; on the CPU it computes float64 in float64 (the gradcheck path).
    return _masks.lookup(mask).plan(q.device, cu_q, cu_k, "automatic")


def _out_like(q: Tensor, dim: int) -> Tensor:
    """The output in q's layout: for q [B, H, N, D], [B, H, N, dim] with the heads outside the
    rows unless q's are inside them (one sequence of [1, N, H, D] as a transposed view); for q
    [rows, H, D], heads outermost where q's are (q from [B, H, N, D], seen as [N, B * H, D]),
    else rows outermost."""
    if q.dim() == 4:
        b, h, n, _ = q.shape
        if h > 1 and n > 1 and q.stride(1) < q.stride(2):
            return q.new_empty(b, n, h, dim).transpose(1, 2)
        return q.new_empty(b, h, n, dim)
    rows, heads = q.shape[0], q.shape[1]
    if heads > 1 and rows > 1 and q.stride(1) > q.stride(0):
        return q.new_empty(heads, rows, dim).transpose(0, 1)
    return q.new_empty(rows, heads, dim)


def _lse_dtype(q: Tensor) -> torch.dtype:
    # f32; f64 for float64 inputs (the CPU engine's type, so that its backward reads it exactly).
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _forward_outputs(q: Tensor, v: Tensor, with_lse: bool) -> tuple[Tensor, Tensor]:
    """The forward's out (in q's layout) and, when a gradient is needed (`with_lse`), the
    log-sum-exp the backward reads, [rows, heads] as `_tensors.view` sees q, unwritten (the op's
    and its fake's)."""
    rows, heads = _tensors.rows_heads(q)
    lse = q.new_empty(rows if with_lse else 0, heads, dtype=_lse_dtype(q))
    return _out_like(q, v.shape[-1]), lse


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
    dropout: float = 0.0,
    dropout_state: Tensor | None = None,
    block_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Packed [rows, H, D] tensors, sequence i at rows cu_q[i]:cu_q[i + 1] (keys cu_k), or one
    sequence of [B, H, N, D] tensors whose heads fold (`_tensors.foldable`: seen as [N, B * H,
    D], no copy; out [B, H, N, Dv]); returns out and, with `with_lse`, each row's log-sum-exp
    (f32 [rows, H], f64 for float64 inputs; else [0, H]), which the backward reads instead of
    recomputing the forward.
    `importance`: the id of a BlockImportance the backward fills (0: none). `dropout`: attention
    dropout drawn in the CUDA kernels from `dropout_state` ({seed, offset}, int64 [2] on q's
    device). `block_bias`: a score bias per kept block, [sequences * query blocks, H or 1, key
    blocks] (f32; f64 for float64 inputs on the CPU), added to scale * q·k."""
    plan = _plan(q, mask, cu_q, cu_k)
    out, lse = _forward_outputs(q, v, with_lse)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.workspace_bytes(_tensors.rows_heads(q)[1], max(q.shape[-1], v.shape[-1])), q.device
    )
    with_lse = lse.shape[0] > 0 and plan.backend in ("cuda_block", "cpu_block")
    plan.run(
        *(_tensors.view(t) for t in (q, k, v, out)),
        _tensors.view2(lse) if with_lse else None,
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
        _tensors.view(block_bias) if block_bias is not None else None,
    )
    return out, lse


@_forward.register_fake
def _forward_fake(
    q,
    k,
    v,
    mask,
    cu_q,
    cu_k,
    scale,
    with_lse,
    importance=0,
    dropout=0.0,
    dropout_state=None,
    block_bias=None,
):
    return _forward_outputs(q, v, with_lse)


def _on_block_kernel(plan, q: Tensor, what: str) -> bool:
    """Whether q is on CUDA, where the `what` pass runs the tensor-core block kernel alone
    (NotImplementedError for a mask that runs another backend)."""
    on_cuda = q.device.type == "cuda"
    if on_cuda and plan.backend != "cuda_block":
        raise NotImplementedError(
            f"block_sparse_attention: the CUDA {what} runs the tensor-core block kernel (block "
            f"sizes a multiple of 16 and head dims 64 or 128); this mask runs {plan.backend}"
        )
    return on_cuda


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
    importance: int = 0,
    dropout: float = 0.0,
    dropout_state: Tensor | None = None,
    block_bias: Tensor | None = None,
    bias_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, and with `importance` 1 each kept block's attention mass, with 2 also its
    |dS| sum (f32 [sequences, query blocks, H, key blocks], zeros where the mask drops a block;
    else [0]); with `block_bias` and `bias_grad` its gradient, each kept block's sum of dS
    (block_bias's shape and dtype, summed over the heads where it has one; zeros where the mask
    drops a block; else [0]: a bias that needs no gradient costs no dB pass)."""
    plan = _plan(q, mask, cu_q, cu_k)
    dout = dout if dout.stride(-1) == 1 and _tensors.foldable(dout) else dout.contiguous()
    rows, heads = _tensors.rows_heads(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mass, grad = _importance_like(q, mask, cu_q, cu_k, importance)
    dbias = _dbias_like(q, block_bias) if bias_grad else None
    on_cuda = _on_block_kernel(plan, q, "backward")
    sums = importance > 0 or dbias is not None  # (dB: the importance's partial sums)
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.backward_workspace_bytes(heads, sums) if on_cuda else 0, q.device
    )
    blocks = [_tensors.view(t.flatten(0, 1)) if t.numel() else None for t in (mass, grad)]
    # The forward's out and lse where it wrote them (the CPU recomputes them without).
    saved = on_cuda or lse.shape[0] == rows > 0
    plan.backward(
        *(_tensors.view(t) for t in (q, k, v)),
        _tensors.view(out) if saved else None,
        _tensors.view2(lse) if saved else None,
        *(_tensors.view(t) for t in (dout, dq, dk, dv)),
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
        *blocks,
        dropout,
        _tensors.dropout_state(dropout, dropout_state),
        *(_tensors.view(t) if t is not None else None for t in (block_bias, dbias)),
    )
    if dbias is None:
        return dq, dk, dv, mass, grad, q.new_empty(0)
    if block_bias.shape[1] != dbias.shape[1]:
        dbias = dbias.sum(1, keepdim=True)  # a bias shared by the heads
    return dq, dk, dv, mass, grad, dbias


@torch.library.custom_op("trisparse::block_sparse_attention_mass", mutates_args=())
def _mass_op(
    q: Tensor, k: Tensor, lse: Tensor, mask: int, cu_q: list[int], cu_k: list[int], scale: float
) -> Tensor:
    """Each kept block's attention mass without a backward (f32 [sequences, query blocks, H, key
    blocks], zeros where the mask drops a block), from the forward's `lse` (CUDA; the CPU
    recomputes the softmax in float64)."""
    plan = _plan(q, mask, cu_q, cu_k)
    mass, _ = _importance_like(q, mask, cu_q, cu_k, 1)
    on_cuda = _on_block_kernel(plan, q, "block mass")
    _owner, ws, ws_bytes = _tensors.workspace(
        plan.block_mass_workspace_bytes(_tensors.rows_heads(q)[1]) if on_cuda else 0, q.device
    )
    plan.block_mass(
        _tensors.view(q),
        _tensors.view(k),
        _tensors.view2(lse) if on_cuda else None,
        _tensors.view(mass.flatten(0, 1)),
        scale,
        _tensors.stream(q.device),
        ws,
        ws_bytes,
    )
    return mass


@_mass_op.register_fake
def _mass_fake(q, k, lse, mask, cu_q, cu_k, scale):
    return _importance_like(q, mask, cu_q, cu_k, 1)[0]


def _dbias_like(q: Tensor, block_bias: Tensor | None) -> Tensor | None:
    """Zeroed dB for the kernels: block_bias's rows and key blocks, every head of q."""
    if block_bias is None:
        return None
    heads = _tensors.rows_heads(q)[1]
    return block_bias.new_zeros(block_bias.shape[0], heads, block_bias.shape[2])


def longest_blocks(cu: list[int], g: int) -> int:
    """Blocks of g rows covering the longest sequence of offsets `cu` (a mask's blocks per row
    or column, the importance's and the bias's QB and KB)."""
    return -(-max(b - a for a, b in itertools.pairwise(cu)) // g)


def _importance_like(q, mask, cu_q, cu_k, importance):
    """Zeroed block importance outputs: [sequences, QB, H, KB] f32 (QB, KB: the longest
    sequence's query and key blocks) for the mass (`importance` >= 1) and the |dS| sums (2),
    else [0]."""
    if not importance:  # (two tensors: a custom op's outputs may not alias)
        return q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
    g = _masks.lookup(mask).block_size
    heads = _tensors.rows_heads(q)[1]
    shape = (len(cu_q) - 1, longest_blocks(cu_q, g), heads, longest_blocks(cu_k, g))
    mass = q.new_zeros(shape, dtype=torch.float32)
    if importance == 1:  # (empty: nothing to fill)
        return mass, q.new_empty(0, dtype=torch.float32)
    return mass, q.new_zeros(shape, dtype=torch.float32)


@_backward_op.register_fake
def _backward_fake(
    q,
    k,
    v,
    out,
    lse,
    dout,
    mask,
    cu_q,
    cu_k,
    scale,
    importance=0,
    dropout=0.0,
    dropout_state=None,
    block_bias=None,
    bias_grad=True,
):
    mass, grad = _importance_like(q, mask, cu_q, cu_k, importance)
    dbias = torch.empty_like(block_bias) if block_bias is not None and bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), mass, grad, dbias


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
