#!/usr/bin/env python3
"""trisparse.gat_attention on the CPU, forward + backward, with and without attention dropout
drawn by the op (8 heads x 16 channels, fp32, a uniform random graph): wall-clock medians after
a warm-up, one JSON line. For A/B runs of two builds (PYTHONPATH to each build's module; --label
names the side).

    python3 bench/python/gat_cpu_dropout.py --label main [--nodes 20000 --edges 400000]
"""

import argparse
import json
import os
import sys

import torch
import trisparse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_sparse_cpu import median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--nodes", type=int, default=20000)
    ap.add_argument("--edges", type=int, default=400000)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.6)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.manual_seed(0)
    pattern = trisparse.Pattern.from_edge_index(torch.randint(0, a.nodes, (2, a.edges)), a.nodes)
    x = torch.randn(a.nodes, a.heads, a.channels, requires_grad=True)
    a_src, a_dst = (torch.randn(a.nodes, a.heads, requires_grad=True) for _ in range(2))
    dout = torch.randn(a.nodes, a.heads, a.channels)
    row = {
        "label": a.label,
        "nodes": a.nodes,
        "edges": a.edges,
        "heads": a.heads,
        "channels": a.channels,
        "threads": torch.get_num_threads(),
    }
    for p in (0.0, a.dropout):

        def step():
            out = trisparse.gat_attention(x, a_src, a_dst, pattern, dropout=p)
            torch.autograd.grad(out, (x, a_src, a_dst), dout)

        row[f"fwd_bwd_ms_dropout_{p}"] = round(median_ms(step, a.repeat), 2)
    row["dropout_over"] = row[f"fwd_bwd_ms_dropout_{a.dropout}"] / row["fwd_bwd_ms_dropout_0.0"]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
