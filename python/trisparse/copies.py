"""Per-copy values of a multigraph on its Pattern: a repeated edge is one pattern entry standing
for several input pairs (copies), each a separate term of the softmax, as PyG counts them. A copy's
score enters its entry's as a log-sum-exp over the entry's copies, which is exact: the softmax
weight of an entry is the sum of its copies' weights, and its copies share one source node. Every
reduction runs over the copies grouped by entry in input order (``Pattern.copies_by_entry``), in a
fixed order with torch's segment reductions: no atomics, so the gradients are repeatable. The
gathers' ops: ``trisparse.ops.copies``; their autograd: ``trisparse.autograd.copies``."""

from __future__ import annotations

import torch
from torch import Tensor

from .autograd.copies import (
    _gather_rows_eager,
    _to_copies_eager,
)
from .edge import edge_spmm, sddmm
from .pattern import Pattern

__all__ = [
    "copy_aggregate",
    "copy_dot",
    "copy_logsumexp",
    "copy_sum",
    "copy_weights",
    "gather_rows",
    "to_copies",
    "weights_from_lse",
]


def gather_rows(values: Tensor, index: Tensor) -> Tensor:
    """values[index] for [E, W] values and distinct int64 indices (kept edges, a permutation):
    on CUDA a gather with the index spelled out per element, and its gradient an index_add of
    distinct rows (one write each: the same bits every run). torch 2.11's row gather (index_select,
    values[index]) takes ~6 ms for 10M rows of 4 or more float32 columns on an H200, this 0.7 ms
    (measured; 1-D gathers are fast either way)."""
    if not values.is_cuda or values.dim() != 2:
        return values[index]
    return _gather_rows_eager(values, index)


def _grouped(pattern: Pattern, device: torch.device) -> tuple[Tensor, Tensor]:
    grouped = pattern.copies_by_entry(device)
    if grouped is None:
        raise ValueError(
            "per-copy values need a Pattern built from pairs (from_edge_index, from_coo, from_csr)"
        )
    return grouped


def _identity(pattern: Pattern) -> bool:
    """A Pattern not built from pairs (given as such, e.g. Pattern.exphormer's): its entries are
    the pairs, in entry order."""
    return pattern.entries_of_input(torch.device("cpu")) is None


def _bijective(pattern: Pattern, device: torch.device) -> Tensor | None:
    """Without repeated pairs, each entry is one input pair: the input pair of each entry
    (int64 [nnz] on `device`), the permutation that the reductions over copies reduce to."""
    order = pattern.input_order(device)
    return None if order is None else order[1]


def _one_copy_each(values: Tensor, pattern: Pattern) -> Tensor | None:
    """[E_in, ...] -> [nnz, ...] where every entry has one copy (the entries themselves, or a
    permutation of the pairs): any reduction over copies is this; None where entries repeat."""
    if _identity(pattern):
        return values
    pair_of_entry = _bijective(pattern, values.device)
    return None if pair_of_entry is None else values[pair_of_entry]


def copy_sum(values: Tensor, pattern: Pattern) -> Tensor:
    """[E_in, ...] values of the input's pairs -> [nnz, ...]: each entry's sum over its copies."""
    single = _one_copy_each(values, pattern)
    if single is not None:
        return single
    order, offsets = _grouped(pattern, values.device)
    return torch.segment_reduce(values[order], "sum", offsets=offsets, axis=0)


def to_copies(values: Tensor, pattern: Pattern) -> Tensor:
    """[nnz, ...] per-entry values -> [E_in, ...]: each input pair gets its entry's; the gradient
    sums over each entry's copies in a fixed order (a plain gather's adds with atomics on CUDA)."""
    if _identity(pattern):
        return values
    entries = pattern.entries_of_input(values.device)
    if _bijective(pattern, values.device) is not None:
        return values[entries]  # a permutation: its gradient writes each entry once
    order, offsets = _grouped(pattern, values.device)
    return _to_copies_eager(values, entries, order, offsets)


def copy_logsumexp(scores: Tensor, pattern: Pattern) -> Tensor:
    """[E_in, H] scores of the input's pairs -> [nnz, H]: log sum over each entry's copies of
    exp(score) (the entry's score when every copy is a term of the softmax)."""
    single = _one_copy_each(scores, pattern)
    if single is not None:
        return single
    order, offsets = _grouped(pattern, scores.device)
    grouped = scores[order]
    # The max only steadies the exponentials: the result does not depend on it.
    top = torch.segment_reduce(grouped.detach(), "max", offsets=offsets, axis=0)
    entry = pattern.entries_of_input(scores.device)[order]
    sums = torch.segment_reduce((grouped - top[entry]).exp(), "sum", offsets=offsets, axis=0)
    # Each entry has a copy: its sum is >= 1 and the log finite.
    return top + sums.log()


def copy_weights(scores: Tensor, entry_scores: Tensor, pattern: Pattern) -> Tensor | None:
    """[E_in, H]: each copy's share of its entry's weight, exp(score - entry's log-sum-exp); None
    where every entry is one pair (every share 1)."""
    if _identity(pattern) or _bijective(pattern, scores.device) is not None:
        return None
    return (scores - to_copies(entry_scores, pattern)).exp()


def _copy_pattern(pattern: Pattern) -> Pattern:
    """The pattern's rows against one column per input pair: entry (i, c) for copy c of an entry
    of row i (cached on the pattern). Per-copy features live on its columns."""
    device = torch.device("cpu")

    def make():
        rows = pattern.entries(device)[0][pattern.entries_of_input(device)]
        n = rows.numel()
        return Pattern.from_coo(rows, torch.arange(n), pattern.num_rows, n)

    _grouped(pattern, device)
    return pattern._cached("copy_pattern", device, make)


def copy_dot(x: Tensor, a: Tensor, pattern: Pattern) -> Tensor:
    """[E_in, H]: <x[i, h], a[c]> for each input pair c = (i, j): x [num_rows, H, D], a [E_in, D]
    (per-pair features), by one SDDMM a head over the copies' pattern: no [E_in, H, D] tensor."""
    cp = _copy_pattern(pattern)
    a3 = a.to(x.dtype).unsqueeze(1)  # under autocast x may be 16-bit
    heads = [sddmm(x[:, h : h + 1], a3, cp) for h in range(x.shape[1])]
    return torch.cat(heads, dim=1)[cp.entries_of_input(x.device)]


def copy_aggregate(w: Tensor, a: Tensor, pattern: Pattern) -> Tensor:
    """[num_rows, H, D]: out[i, h] = sum over the input pairs c = (i, j) of w[c, h] a[c]: w [E_in,
    H], a [E_in, D], by one SpMM a head over the copies' pattern (fixed order)."""
    cp = _copy_pattern(pattern)
    _, to_entries = cp.input_order(w.device)
    w = w[to_entries]  # the copies' pattern's entry order
    a3 = a.to(torch.promote_types(a.dtype, w.dtype)).unsqueeze(1)
    heads = [edge_spmm(w[:, h : h + 1].contiguous(), a3, cp) for h in range(w.shape[1])]
    return torch.cat(heads, dim=1)


def _row_sums(values: Tensor, pattern: Pattern) -> Tensor:
    """[E_in, ...] values of the input's pairs -> [num_rows, ...]: each row's sum over its pairs,
    in a fixed order (each entry's copies, then the row's entries)."""
    entries = copy_sum(values, pattern)
    rowptr = pattern.row_pointers(values.device)
    return torch.segment_reduce(entries, "sum", offsets=rowptr, axis=0)


class _WeightsFromLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, lse, targets, pattern):
        weights = (scores.to(lse.dtype) - gather_rows(lse, targets)).exp()
        ctx.save_for_backward(weights, targets)
        ctx.pattern, ctx.dtype = pattern, scores.dtype
        return weights.to(scores.dtype)

    @staticmethod
    def backward(ctx, grad):
        weights, targets = ctx.saved_tensors
        wg = weights * grad.to(weights.dtype)
        sums = _row_sums(wg, ctx.pattern)
        return (wg - weights * gather_rows(sums, targets)).to(ctx.dtype), None, None, None


def weights_from_lse(scores: Tensor, lse: Tensor, pattern: Pattern) -> Tensor:
    """[E_in, H]: each input pair's softmax weight exp(score - lse of its target row), from the
    log-sum-exp [num_rows, H] that a fused forward returned (every copy of a repeated pair its own
    term; a score's exponent is its copy's): no pass over the scores for the normaliser.
    Differentiable in ``scores`` by the softmax's Jacobian, dL/ds = w (g - sum over the row of
    w g) with the row sums in a fixed order; ``lse`` is taken as theirs (not differentiated)."""
    targets = pattern.input_pairs(scores.device)[0]
    return _WeightsFromLse.apply(scores, lse.detach(), targets, pattern)
