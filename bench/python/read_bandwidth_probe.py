#!/usr/bin/env python3
"""Read bandwidth of a plain reduction on the GPU, for comparing the top-k pooling (a read of Q and
K) with what a library reduction of the same size reaches: torch.sum over fp16 tensors of 64 MB,
256 MB and 1 GB (three rotating tensors each), event-timed, the median of 30 calls.
    python3 bench/python/read_bandwidth_probe.py
"""

import torch


def main():
    for mb in (64, 256, 1024):
        n = mb * 2**20 // 2
        xs = [torch.randn(n, device="cuda", dtype=torch.float16) for _ in range(3)]
        for x in xs:
            x.sum(dtype=torch.float32)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for i in range(30):
            start.record()
            xs[i % 3].sum(dtype=torch.float32)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        print(f"read {mb} MB: {ms * 1000:.1f} us, {mb * 2**20 / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
