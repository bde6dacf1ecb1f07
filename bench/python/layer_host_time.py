#!/usr/bin/env python3
"""Host time of a drop-in layer's training step: trisparse.nn's TransformerConv and GATConv
(8 heads x 16, in 128), with and without 16 edge features, in float32 and under bfloat16
autocast, on one graph file. A step is zero_grad, the layer's forward and backward of a fixed
dout; per configuration 5 warm-ups, then 5 groups of 10 steps: host = the time to enqueue a
group (no synchronisation), wall = until the GPU is done; the best group, per step. Where host
≈ wall the step is bound by the host (a graph with few nodes: het_tolokers). --label names the
build in the records (an A/B of two Python trees runs the script once per tree). --cprofile FILE
appends, per configuration, cProfile's top functions over 20 steps (own time, then cumulative);
--sync-debug runs one step of each under torch.cuda.set_sync_debug_mode("warn") and prints the
Python stack of each synchronising call (a step that waits on the GPU is not host-bound).

    python3 bench/python/layer_host_time.py data/het_tolokers.el.xz --label new >> host.jsonl
"""

import argparse
import cProfile
import io
import json
import pstats
import time
import traceback
import warnings

import torch
import trisparse.datasets
import trisparse.nn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graph")
    ap.add_argument("--label", default="")
    ap.add_argument("--cprofile", metavar="FILE")
    ap.add_argument("--sync-debug", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    edge_index, n = trisparse.datasets.read_graph(a.graph)
    edge_index = edge_index.to(dev)
    x = torch.randn(n, 128, device=dev, requires_grad=True)
    edge_attr = torch.randn(edge_index.shape[1], 16, device=dev, requires_grad=True)
    dout = torch.randn(n, 128, device=dev)
    for name in ("TransformerConv", "GATConv"):
        for edge_dim in (16, 0):
            for autocast in (False, True):
                torch.manual_seed(0)
                extra = {"edge_dim": edge_dim} if edge_dim else {}
                layer = getattr(trisparse.nn, name)(128, 16, heads=8, **extra).to(dev)
                kwargs = {"edge_attr": edge_attr} if edge_dim else {}

                def step(layer=layer, kwargs=kwargs, autocast=autocast):
                    layer.zero_grad(set_to_none=True)
                    x.grad = edge_attr.grad = None
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        out = layer(x, edge_index, **kwargs)
                    out.backward(dout.to(out.dtype))

                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                config = f"{name} edge_dim={edge_dim} bf16={autocast}"
                if a.sync_debug:
                    sync_stacks(step, config)
                if a.cprofile:
                    profiled(step, config, a.cprofile)
                host, wall = [], []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        step()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    host.append((t1 - t0) * 100)  # ms per step: 10 steps, 1000 ms a second
                    wall.append((t2 - t0) * 100)
                rec = {"side": a.label, "layer": name, "edge_dim": edge_dim, "bf16": autocast}
                rec.update(host_ms=round(min(host), 3), wall_ms=round(min(wall), 3))
                rec.update(wall_median_ms=round(sorted(wall)[2], 3))
                print(json.dumps(rec), flush=True)


def sync_stacks(step, config):
    """One step with synchronising CUDA calls reported: each one's Python stack (the step's
    frames only)."""
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        if "synchroniz" in str(message) and "prototype" not in str(message):
            seen.append((str(message), stack[-8:]))

    with warnings.catch_warnings():  # (restores showwarning and the filters after)
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"# {config}: {len(seen)} synchronising calls", flush=True)
    for message, stack in seen:
        print(f"#   {message}")
        for f in stack:
            print(f"#     {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}")


def profiled(step, config, path):
    """cProfile over 20 steps (synchronised at the end), its top functions appended to path."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    with open(path, "a") as f:
        f.write(f"===== {config} (20 steps)\n{text.getvalue()}\n")


if __name__ == "__main__":
    main()
