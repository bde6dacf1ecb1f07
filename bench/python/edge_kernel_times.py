#!/usr/bin/env python3
"""trisparse.nn's TransformerConv (edge_dim 16 and none) and GATConv (edge_dim 16), 8 x 16 heads,
forward + backward on each graph file, fp32 and under bf16 autocast: the step (CUDA-event median
of 20 after 3 warm-ups) and the multigraph kernels' time per step (torch.profiler, 3 steps), one
JSON line per (graph, layer, mode). For A/B runs of two builds in one call (PYTHONPATH to each
build's module; --label names the side).

    python3 bench/python/edge_kernel_times.py data/snap_web_notredame.el.xz --label main \
        [--dropout 0.1]
"""

import argparse
import json
import os
import sys

import torch
import trisparse.datasets
import trisparse.nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import events_ms

LAYERS = (("TransformerConv", 16), ("GATConv", 16), ("TransformerConv", None))


def kernel_ms(step, steps=3):
    """Each multigraph kernel's CUDA time per step (its launches summed)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        if "edge_attention_kernels" in ev.key and ev.device_time_total > 0:
            name = ev.key.split("edge_attention_kernels::")[1].split("<")[0]
            kernels[name] = round(kernels.get(name, 0) + ev.device_time_total / 1e3 / steps, 3)
    return kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--dropout", type=float, default=0.0, help="the layers' attention dropout (training mode)"
    )
    a = ap.parse_args()
    dev = torch.device("cuda")
    for path in a.graphs:
        ei, n = trisparse.datasets.read_graph(path)
        ei = ei.to(dev)
        torch.manual_seed(0)
        x = torch.randn(n, 128, device=dev, requires_grad=True)
        edge_attr = torch.randn(ei.shape[1], 16, device=dev, requires_grad=True)
        dout = torch.randn(n, 128, device=dev)
        for name, edge_dim in LAYERS:
            kw = {"edge_dim": edge_dim} if edge_dim else {}
            layer = getattr(trisparse.nn, name)(128, 16, heads=8, dropout=a.dropout, **kw).to(dev)
            extra = {"edge_attr": edge_attr} if edge_dim else {}
            for mode in ("fp32", "bf16"):

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
                        out = layer(x, ei, **extra)
                    out.backward(dout.to(out.dtype))

                rec = {
                    "label": a.label,
                    "graph": os.path.basename(path).split(".")[0],
                    "layer": name,
                    "edge_dim": edge_dim,
                    "mode": mode,
                    "dropout": a.dropout,
                    "device": torch.cuda.get_device_name(),
                    "step_ms": round(events_ms(step, 20), 3),
                    "kernels": kernel_ms(step),
                }
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
