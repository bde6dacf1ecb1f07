#!/usr/bin/env python3
"""The prune kernels (prune_block_importance, "row" and "global": what a capturable learner and
prune_blocks on CUDA run; a global prune of more than 16,384 blocks a head over many thread
blocks, with its workspace) against torch ops (a stable sort: prune_blocks' path before, and its
CPU path) on CUDA: CUDA-event times a call, 8 heads, 90 % block sparsity, the diagonal kept, N 8K
- 128K tokens at G 64 and 128 (qb = kb = N / G); the kernel's keep checked equal to the sort's on
each input before timing. One JSON line a point.

    PYTHONPATH=build/device/python python3 bench/python/prune_time.py [--out FILE]
"""

import argparse
import json

import torch
from trisparse.block_pattern import (
    _forced_blocks,
    _prune,
    _prune_budget,
    _prune_kernel,
    _prune_workspace,
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
                budget = _prune_budget(args.sparsity, kb * (qb if method == "global" else 1))
                ws = _prune_workspace(args.heads, qb, kb, method, importance.device)

                def kernel():
                    _prune_kernel(importance, forced, keep, None, budget, method, ws)

                def by_sort():
                    forced_h = forced.expand(args.heads, qb, kb)
                    return _prune(importance, forced_h, args.sparsity, method, 0.9)

                kernel()
                assert torch.equal(keep, by_sort()), (n, g, method)
                reps = 20 if n < 131072 else 5
                row = {
                    "n": n,
                    "block": g,
                    "heads": args.heads,
                    "method": method,
                    "blocks_per_head": qb * kb,
                    "workspace_bytes": ws.numel(),
                    "kernel_ms": round(_time(kernel, reps), 4),
                    "sort_ms": round(_time(by_sort, reps), 4),
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
