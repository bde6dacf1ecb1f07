#!/usr/bin/env python3
"""The capturable learner's prune (trisparse's prune_block_importance kernel, "row" and "global")
against prune_blocks' torch ops (a stable sort) on CUDA: CUDA-event times a call, 8 heads, 90 %
block sparsity, the diagonal kept, N 8K - 128K tokens at G 64 and 128 (qb = kb = N / G); the
kernel's keep checked equal to prune_blocks' on each input before timing. One JSON line a point.

    PYTHONPATH=build/device/python python3 bench/python/prune_time.py [--out FILE]
"""

import argparse
import json

import torch
import trisparse
from trisparse import _C, _tensors
from trisparse.block_pattern import _forced_blocks, _prune_budget


def _kernel(importance, forced, keep, method, sparsity):
    heads, qb, kb = importance.shape
    budget = _prune_budget(sparsity, kb * (qb if method == "global" else 1))
    dev = importance.device
    _C.prune_block_importance(
        importance.data_ptr(),
        forced.data_ptr(),
        keep.data_ptr(),
        0,
        heads,
        qb,
        kb,
        budget,
        method,
        _tensors.device_index(dev),
        _tensors.stream(dev),
    )


def _time(fn, reps):
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the JSON lines to this file")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sparsity", type=float, default=0.9)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for n in (8192, 32768, 131072):
        for g in (64, 128):
            qb = kb = n // g
            importance = torch.rand(args.heads, qb, kb, device="cuda", dtype=torch.float64)
            forced = _forced_blocks(qb, kb, "cuda", True, 0, 0).expand(qb, kb).contiguous()
            for method in ("row", "global"):
                keep = torch.ones(args.heads, qb, kb, device="cuda", dtype=torch.bool)
                _kernel(importance, forced, keep, method, args.sparsity)
                want = trisparse.prune_blocks(importance, args.sparsity, method)
                assert torch.equal(keep, want), (n, g, method)
                reps = 20 if n < 131072 else 5
                kernel_ms = _time(
                    lambda: _kernel(importance, forced, keep, method, args.sparsity), reps
                )
                torch_ms = _time(
                    lambda: trisparse.prune_blocks(importance, args.sparsity, method), reps
                )
                row = {
                    "n": n,
                    "block": g,
                    "heads": args.heads,
                    "method": method,
                    "blocks_per_head": qb * kb,
                    "kernel_ms": round(kernel_ms, 4),
                    "prune_blocks_ms": round(torch_ms, 4),
                    "gpu": torch.cuda.get_device_name(),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
