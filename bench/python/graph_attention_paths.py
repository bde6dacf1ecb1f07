#!/usr/bin/env python3
"""The two CUDA paths a plain graph's attention can take in trisparse.nn's TransformerConv, timed
side by side: :func:`trisparse.sparse_attention` (the fused 3S tensor-core kernel in 16-bit, the
row-wise kernel in float32, and their deterministic backward) and :func:`trisparse.edge_attention`
(the multigraph kernels: a warp per row, each edge its own term). Forward + backward of a fixed
random dout on [N, H, C] q, k, v, per graph file with at least --min-edges edges, float32 and
bfloat16; CUDA-event medians of --repeat after 3 warm-ups; one JSON line per (graph, dtype, shape),
with the outputs' and gradients' largest difference between the paths (relative to the largest
value).

    python3 bench/python/graph_attention_paths.py data/*.el.xz --min-edges 200000 > paths.jsonl
"""

import argparse
import json
import os
import sys

import torch
import trisparse
import trisparse.datasets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import events_ms


def step(path, q, k, v, pattern, scale, dout):
    """One forward + backward through `path`; returns (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if path == "sparse_attention":
        out = trisparse.sparse_attention(q, k, v, pattern, scale=scale)
    else:
        out, _ = trisparse.edge_attention(q, k, v, pattern, scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--min-edges", type=int, default=200_000)
    ap.add_argument("--shapes", nargs="+", default=["8x16", "4x64"], help="heads x channels")
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device("cuda")
    for path in a.graphs:
        edge_index, n = trisparse.datasets.read_graph(path)
        if edge_index.shape[1] < a.min_edges:
            continue
        pattern = trisparse.Pattern.from_edge_index(edge_index.to(dev), size=(n, n))
        graph = os.path.basename(path).split(".")[0]
        for shape in a.shapes:
            heads, channels = (int(s) for s in shape.split("x"))
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator(device=dev).manual_seed(n)
                q, k, v, dout = (
                    torch.randn(n, heads, channels, device=dev, generator=g).to(dtype)
                    for _ in range(4)
                )
                scale = channels**-0.5
                rec = {"graph": graph, "nodes": n, "entries": pattern.nnz, "heads": heads}
                rec.update(channels=channels, dtype=str(dtype).split(".")[1])
                rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
                results = {}
                for name in ("sparse_attention", "edge_attention"):
                    results[name] = step(name, q, k, v, pattern, scale, dout)
                    rec[name + "_ms"] = events_ms(
                        lambda name=name: step(name, q, k, v, pattern, scale, dout), a.repeat
                    )
                a_, b_ = results["sparse_attention"], results["edge_attention"]
                rec["max_rel_difference"] = max(
                    float((x.float() - y.float()).abs().max()) / max(float(x.abs().max()), 1e-30)
                    for x, y in zip(a_, b_)
                )
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
