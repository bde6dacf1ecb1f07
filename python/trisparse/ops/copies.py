"""Per-copy gathers as torch ops (`trisparse::gather_rows`, `to_copies`) with their fake
implementations."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("trisparse::gather_rows", mutates_args=())
def _gather_rows(values: Tensor, index: Tensor) -> Tensor:
    return values.gather(0, index[:, None].expand(-1, values.shape[1]).contiguous())


@_gather_rows.register_fake
def _gather_rows_fake(values, index):
    return values.new_empty(index.shape[0], values.shape[1])


@torch.library.custom_op("trisparse::to_copies", mutates_args=())
def _to_copies(values: Tensor, entries: Tensor, order: Tensor, offsets: Tensor) -> Tensor:
    return values[entries]


@_to_copies.register_fake
def _to_copies_fake(values, entries, order, offsets):
    return values.new_empty(entries.shape[0], *values.shape[1:])
