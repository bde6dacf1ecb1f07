#!/usr/bin/env python3
"""Attention training step on CUDA: trisparse.sparse_attention against PyG's TransformerConv
attention path through autograd (gather -> segment softmax -> scatter), forward and backward.

Per graph (read as trisparse reads it: undirected files symmetrised, duplicates merged) and per
dtype: the training forward (inputs requiring grad), the whole step (forward + backward of a
fixed dout) and the backward as their difference, as CUDA-event medians around the Python calls
(what a user's step pays from an idle GPU); the step back to back (`repeat` steps enqueued with no
synchronisation between them, the time per step: a training loop whose host runs ahead); peak GPU memory of a step beyond its inputs; and the gradients'
relative error (max |err| / max |ref|) against PyG's float32 autograd on the same inputs.
PyG runs in float32 (its default) and in bfloat16; trisparse in float16, bfloat16 and float32.
One JSON object per graph.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import trisparse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyg_attention import attention as pyg_attention
from pyg_attention import read_graph


def events_ms(fn, repeat):
    """Median milliseconds of fn() over `repeat` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def wall_ms(fn, repeat):
    """Median wall-clock milliseconds of fn() (on the CPU) over `repeat` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn, repeat):
    """Milliseconds per call of `repeat` calls of fn() enqueued back to back (no synchronisation
    between them: the host's enqueue overlaps the previous calls' kernels), after 3 warm-ups."""
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / repeat


def measure(attend, q, k, v, dout, repeat):
    """Forward and step times, the peak memory of a step beyond its inputs, and the gradients."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        return attend(*leaves)

    def step():
        for t in leaves:
            t.grad = None
        attend(*leaves).backward(dout)

    fwd = events_ms(forward, repeat)
    full = events_ms(step, repeat)
    pipelined = back_to_back_ms(step, 3 * repeat)
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {
        "forward_ms": fwd,
        "step_ms": full,
        "backward_ms": full - fwd,
        "step_back_to_back_ms": pipelined,
        "peak_mib": peak / 2**20,
    }, [t.grad.float() for t in leaves]


def rel_error(got, ref):
    if not all(torch.isfinite(g).all() for g in got):
        return float("nan")
    return max(
        float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(got, ref)
    )


def graph_inputs(path, dim, heads):
    """A graph on CUDA as trisparse reads it and fresh random inputs: (n, row, col, pattern,
    generator, (q, k, v, dout)), each [n, heads, dim] float32."""
    dev = torch.device("cuda")
    n, row, col = read_graph(path)
    row, col = row.to(dev), col.to(dev)
    pattern = trisparse.Pattern.from_coo(row, col, n, n)
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    qkvd = tuple(torch.randn(n, heads, dim, device=dev, generator=gen) for _ in range(4))
    return n, row, col, pattern, gen, qkvd


def bench_graph(path, dim, heads, repeat):
    scale = dim**-0.5
    n, row, col, pattern, _, (q, k, v, dout) = graph_inputs(path, dim, heads)
    rec = {
        "graph": os.path.basename(path).split(".")[0],
        "rows": n,
        "nnz": int(row.numel()),
        "heads": heads,
        "dim": dim,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }

    def pyg(q_, k_, v_):
        return pyg_attention(row, col, q_, k_, v_, scale, n)

    def ours(q_, k_, v_):
        return trisparse.sparse_attention(q_, k_, v_, pattern, scale)

    ref = None
    for name, dt, fn in (
        ("pyg_fp32", torch.float32, pyg),
        ("pyg_bf16", torch.bfloat16, pyg),
        ("trisparse_fp16", torch.float16, ours),
        ("trisparse_bf16", torch.bfloat16, ours),
        ("trisparse_fp32", torch.float32, ours),  # the row-wise float32 kernel
    ):
        try:
            r, grads = measure(fn, q.to(dt), k.to(dt), v.to(dt), dout.to(dt), repeat)
        except torch.OutOfMemoryError as e:
            rec[name] = {"skipped": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
            continue
        if name == "pyg_fp32":
            ref = grads
        elif ref is not None:
            r["grad_rel_error_vs_pyg_fp32"] = rel_error(grads, ref)
        rec[name] = r
        del grads
        torch.cuda.empty_cache()
    return rec


def main(bench=None, description=None, repeat=10):
    """Runs bench(path, dim, heads, repeat) over the graphs named on the command line, one JSON
    object a graph (this file's bench_graph by default; step_profile.py passes its own)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=repeat)
    a = ap.parse_args()
    for path in a.graphs:
        print(json.dumps((bench or bench_graph)(path, a.dim, a.heads, a.repeat)), flush=True)


if __name__ == "__main__":
    main()
