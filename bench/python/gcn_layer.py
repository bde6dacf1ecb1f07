#!/usr/bin/env python3
"""The GCN layer with its ReLU, relu(Â x Wᵀ + b), forward and forward + backward: PyG's GCNConv
(cached=True) followed by torch.relu, against trisparse's fused GCN layer
(trisparse.gcn_conv(relu=True)) in the order its rule picks and in both forced orders ('fused':
(Â x) W, bias and ReLU in one kernel; 'unfused': x W, SpMM, epilogue). fp32 inputs (trisparse:
tf32 tensor cores; PyG: its fp32 SpMM and cuBLAS with tf32 off, as PyG users get by default).
Â is PyG's own gcn_norm of the graph (self loops added), given to trisparse as a SparseMatrix.
CUDA-event medians after warm-ups; per graph and width pair one JSON line, with the largest
difference of trisparse's outputs and input gradients from PyG's (relative to PyG's largest).

  python3 bench/python/gcn_layer.py data/cora.el.xz ... --widths 16:16 64:128 > results.jsonl
"""

import argparse
import json
import os
import sys

import torch
import trisparse
from torch_geometric.nn import GCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_sparse import time_ms
from pyg_attention import read_graph


def step(layer_fn, x, up, backward):
    """One forward (and backward of <out, up>) call; returns out and x's gradient."""
    if not backward:
        with torch.no_grad():
            return layer_fn(x), None
    x = x.detach().requires_grad_()
    out = layer_fn(x)
    out.backward(up)
    return out, x.grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--widths", nargs="+", default=["16:16", "64:64", "64:128", "32:256"])
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    for path in a.graphs:
        name = os.path.basename(path).split(".el")[0]
        n, row, col = read_graph(path)
        edge_index = torch.stack([col, row]).to(dev)
        ei, w = gcn_norm(edge_index, None, n, add_self_loops=True)
        matrix = trisparse.SparseMatrix(ei[1], ei[0], w, n, n)
        for spec in a.widths:
            f_in, f_out = map(int, spec.split(":"))
            torch.manual_seed(0)
            pyg = GCNConv(f_in, f_out, cached=True).to(dev)
            with torch.no_grad():
                pyg.bias.uniform_(-0.1, 0.1)
            x = torch.randn(n, f_in, device=dev)
            up = torch.randn(n, f_out, device=dev)
            layers = {
                "pyg": lambda t: torch.relu(pyg(t, edge_index)),
                "trisparse": lambda t: trisparse.gcn_conv(
                    matrix, t, pyg.lin.weight, pyg.bias, relu=True
                ),
                "fused": lambda t: trisparse.gcn_conv(
                    matrix, t, pyg.lin.weight, pyg.bias, relu=True, order="fused"
                ),
                "unfused": lambda t: trisparse.gcn_conv(
                    matrix, t, pyg.lin.weight, pyg.bias, relu=True, order="unfused"
                ),
            }
            r = {"graph": name, "rows": n, "nnz": int(ei.shape[1]), "in": f_in, "out": f_out}
            ref, _ = step(layers["pyg"], x, up, True)
            for key, fn in layers.items():
                out, dx = step(fn, x, up, True)
                if key != "pyg":
                    # dx against PyG's with the ReLU decisions of ours (outputs within rounding
                    # of 0 may fall either way).
                    keep = (out > 0).to(out.dtype)
                    _, ref_dx = step(lambda t: pyg(t, edge_index) * keep, x, up, True)
                    r[key + "_error"] = float((out - ref).abs().max() / ref.abs().max())
                    r[key + "_dx_error"] = float((dx - ref_dx).abs().max() / ref_dx.abs().max())
                r[key + "_forward_ms"] = time_ms(lambda: step(fn, x, up, False), a.repeat)
                r[key + "_training_ms"] = time_ms(lambda: step(fn, x, up, True), a.repeat)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
