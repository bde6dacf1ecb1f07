#!/usr/bin/env python3
"""The pooled block-mass estimate's kernels (trisparse.pooled_block_mass: the block means, then the
scores and their softmax) on CUDA, torch.profiler's time of each a call, 8 heads x 64, bf16,
causal, at N 8K (G 64, 128) and 32K (G 64); with SAVE=PATH the outputs too, for a bitwise
comparison of two builds.

    PYTHONPATH=build/device/python python3 bench/python/pooled_block_mass_time.py
"""

import os

import torch
import trisparse
from torch.profiler import ProfilerActivity, profile


def main():
    torch.manual_seed(0)
    saved = {}
    for n, g in ((8192, 64), (8192, 128), (32768, 64)):
        q = torch.randn(8, n, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(8, n, 64, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            trisparse.pooled_block_mass(q, k, g, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                trisparse.pooled_block_mass(q, k, g, True)
            torch.cuda.synchronize()
        us = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = "pooled_scores" if "pooled_scores" in e.name else "block_means"
                us[name] = us.get(name, 0.0) + e.time_range.elapsed_us() / 50
        print(n, g, {name: round(t, 2) for name, t in us.items()}, flush=True)
        saved[(n, g)] = trisparse.pooled_block_mass(q, k, g, True).cpu()
    if os.environ.get("SAVE"):
        torch.save(saved, os.environ["SAVE"])


if __name__ == "__main__":
    main()
