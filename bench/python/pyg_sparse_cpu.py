#!/usr/bin/env python3
"""PyG's (and PyTorch's) CPU paths for the operations bench_sparse_cpu times, on the same graphs
and widths: SpMM (torch_geometric.utils.spmm over a CSR adjacency), SDDMM as PyG computes edge
scores (gather both ends, multiply, sum), the sparse softmax (torch_geometric.utils.softmax),
GCNConv(cached=True, bias=False) and AGNNConv(requires_grad=False). fp32, wall-clock medians
after a warm-up, torch's threads as given. One JSON object per graph.

  python3 bench/python/pyg_sparse_cpu.py --dim 64 --threads 2 GRAPH...
"""

import argparse
import json
import os
import sys

import torch
from torch_geometric.nn import AGNNConv, GCNConv
from torch_geometric.utils import softmax, spmm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import wall_ms
from pyg_attention import read_graph


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for path in args.graphs:
        n, row, col = read_graph(path)  # row i's columns: the sources of edges into i
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.rand(n, args.dim, generator=gen) * 2 - 1 for _ in range(2))
        s = torch.rand(row.numel(), generator=gen) * 4 - 2
        ptr = torch.zeros(n + 1, dtype=torch.int64)
        ptr[1:] = torch.bincount(row, minlength=n).cumsum(0)
        adj = torch.sparse_csr_tensor(ptr, col, torch.ones(row.numel()), (n, n))
        edge_index = torch.stack([col, row])
        gcn = GCNConv(args.dim, args.dim, cached=True, bias=False)
        agnn = AGNNConv(requires_grad=False)
        r = {"graph": path, "rows": n, "nnz": int(row.numel()), "dim": args.dim}
        r["threads"] = torch.get_num_threads()
        with torch.no_grad():
            r["pyg_spmm_ms"] = wall_ms(lambda: spmm(adj, y), args.repeat)
            r["pyg_sddmm_ms"] = wall_ms(lambda: (x[row] * y[col]).sum(-1), args.repeat)
            r["pyg_softmax_ms"] = wall_ms(lambda: softmax(s, row, num_nodes=n), args.repeat)
            r["pyg_gcn_ms"] = wall_ms(lambda: gcn(x, edge_index), args.repeat)
            r["pyg_agnn_ms"] = wall_ms(lambda: agnn(x, edge_index), args.repeat)
        r["torch"] = torch.__version__
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
