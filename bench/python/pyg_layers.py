#!/usr/bin/env python3
"""PyG's GCNConv and AGNNConv forward on the device: what a GNN user runs today, timed for the
same graphs and widths as trisparse's bench_layers.

GCNConv(F_in, F_out, cached=True, bias=False): Â X W with Â = D^-1/2 (A + I) D^-1/2, the
normalisation computed on the first call and cached (as trisparse's layer builds it once).
AGNNConv(requires_grad=False): softmax(β cos(h_i, h_j)) over A + I, β = 1.
The graph is read the way trisparse reads it (pyg_attention.read_graph); row i's columns are the
sources of edges into i (edge_index = [col, row]). fp32, and fp16 (module and inputs in half)
where PyG runs it. Times: CUDA-event medians of the forward call under torch.no_grad(), after 3
warm-ups, over 2 rotating input sets. One JSON object per graph.
"""

import argparse
import json
import os
import sys

import torch
from torch_geometric.nn import AGNNConv, GCNConv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyg_attention import read_graph


def timed(fn, inputs, repeat):
    for i in range(3):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(inputs[i % len(inputs)])
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    if not torch.isfinite(out).all():
        raise RuntimeError("non-finite output")
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--in-dim", type=int, default=128)
    ap.add_argument("--out-dim", type=int, default=128)
    ap.add_argument("--agnn-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    for path in a.graphs:
        name = os.path.basename(path).split(".el")[0]
        n, row, col = read_graph(path)
        edge_index = torch.stack([col, row]).to(dev)
        r = {"graph": name, "rows": n, "nnz": int(row.numel())}
        with torch.no_grad():
            for dtype, key in ((torch.float32, "fp32"), (torch.float16, "fp16")):
                try:
                    gcn = GCNConv(a.in_dim, a.out_dim, cached=True, bias=False).to(dev, dtype)
                    xs = [
                        torch.rand(n, a.in_dim, device=dev, dtype=dtype) * 2 - 1 for _ in range(2)
                    ]
                    r[f"gcn_{key}_ms"] = timed(lambda x: gcn(x, edge_index), xs, a.repeat)
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    r[f"gcn_{key}_error"] = str(e)[:200]
                try:
                    agnn = AGNNConv(requires_grad=False).to(dev, dtype)
                    hs = [
                        torch.rand(n, a.agnn_dim, device=dev, dtype=dtype) * 2 - 1 for _ in range(2)
                    ]
                    r[f"agnn_{key}_ms"] = timed(lambda h: agnn(h, edge_index), hs, a.repeat)
                except Exception as e:  # noqa: BLE001
                    r[f"agnn_{key}_error"] = str(e)[:200]
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
