#!/usr/bin/env python3
"""Where a sparse_attention training step's time goes on CUDA: per graph, the step's event time
(as attention_training.py measures it), the host time to enqueue it, the GPU kernels' busy time
and their list (torch.profiler), and the same step replayed from a CUDA graph (no host work).
One JSON object per graph; 8 heads x 64, float16, as attention_training.py."""

import os
import sys
import time

import torch
import trisparse
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_training
from attention_training import events_ms
from pyg_attention import read_graph


def profile_graph(path, dim, heads, repeat):
    dev = torch.device("cuda")
    n, row, col = read_graph(path)
    pattern = trisparse.Pattern.from_coo(row.to(dev), col.to(dev), n, n)
    q, k, v, dout = (torch.randn(n, heads, dim, device=dev, dtype=torch.float16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        trisparse.sparse_attention(*leaves, pattern, dim**-0.5).backward(dout)

    rec = {"graph": os.path.basename(path).split(".")[0], "rows": n, "nnz": int(row.numel())}
    rec["step_ms"] = events_ms(step, repeat)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        step()
    rec["host_ms"] = (time.perf_counter() - t0) * 1e3 / repeat  # enqueue only, GPU may lag
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.device_type.name == "CUDA":
            kernels[e.key[:80]] = round(e.device_time_total / repeat / 1e3, 4)
    rec["kernels_ms"] = kernels
    rec["gpu_busy_ms"] = round(sum(kernels.values()), 4)
    host = {}
    for e in prof.key_averages():
        if e.device_type.name == "CPU" and e.cpu_time_total / repeat > 20:
            host[e.key[:60]] = round(e.cpu_time_total / repeat / 1e3, 4)
    rec["host_ops_ms"] = dict(sorted(host.items(), key=lambda kv: -kv[1])[:14])
    # The same step replayed from a CUDA graph: its GPU time without host gaps.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(g):
        trisparse.sparse_attention(*leaves, pattern, dim**-0.5).backward(dout)
    rec["graph_replay_ms"] = events_ms(g.replay, repeat)
    return rec


if __name__ == "__main__":
    attention_training.main(profile_graph, __doc__, repeat=20)
