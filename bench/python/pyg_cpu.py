#!/usr/bin/env python3
"""What a user runs today without a GPU: PyG's TransformerConv message path on PyTorch CPU.

For each graph: gather q_i = Q[row], k_j = K[col]; alpha = <q_i, k_j> * scale;
alpha = torch_geometric.utils.softmax(alpha, row); out = scatter-add(alpha * V[col], row).
This is exactly O = softmax(scale * (Q K^T ⊙ A)) V with A's row i listing the keys of query i:
the same function trisparse computes (checked here against float64 on sampled rows).
The graph is read the way trisparse reads it (undirected files symmetrised, duplicates merged).
Prints one JSON object per graph.
"""
import argparse
import json
import lzma
import time

import numpy as np
import torch
from torch_geometric.utils import scatter, softmax


def read_graph(path):
    nodes, undirected, pairs = None, False, []
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        for line in f:
            s = line.strip()
            if not s:
                continue
            if s[0] in "#%":
                body = s[1:].strip().lower()
                if body.startswith("nodes:"):
                    toks = body.split()
                    nodes = int(toks[1])
                    undirected = "directed: no" in body
                continue
            a, b = s.replace(",", " ").split()[:2]
            pairs.append((int(a), int(b)))
    e = np.array(pairs, dtype=np.int64).T
    n = nodes if nodes is not None else int(e.max()) + 1
    if undirected:
        e = np.concatenate([e, e[::-1]], axis=1)
    key = np.unique(e[0] * n + e[1])  # merge duplicates, sort by row then column
    return n, torch.from_numpy(key // n), torch.from_numpy(key % n)


def attention(row, col, q, k, v, scale, n):
    alpha = (q[row] * k[col]).sum(-1) * scale          # [E, H]
    alpha = softmax(alpha, row, num_nodes=n)           # segment softmax over each row
    return scatter(alpha.unsqueeze(-1) * v[col], row, dim=0, dim_size=n, reduce="sum")


def check(row, col, q, k, v, scale, out, rows):
    """float64 recomputation of sampled rows."""
    err, ref_max = 0.0, 0.0
    row_np, col_np = row.numpy(), col.numpy()
    for i in rows:
        cols = col_np[row_np == i]
        if cols.size == 0:
            ref = np.zeros(out.shape[1:])
        else:
            s = scale * np.einsum("hd,nhd->nh", q[i].double().numpy(), k[cols].double().numpy())
            p = np.exp(s - s.max(axis=0))
            p /= p.sum(axis=0)
            ref = np.einsum("nh,nhd->hd", p, v[cols].double().numpy())
        err = max(err, float(np.abs(out[i].double().numpy() - ref).max()))
        ref_max = max(ref_max, float(np.abs(ref).max()))
    return err / max(ref_max, 1e-300)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for path in a.graphs:
        n, row, col = read_graph(path)
        inputs = [tuple(torch.rand(n, a.heads, a.dim) for _ in range(3)) for _ in range(2)]
        with torch.inference_mode():
            attention(row, col, *inputs[0], 1.0, n)  # warm-up
            times = []
            for i in range(a.repeat):
                t0 = time.perf_counter()
                out = attention(row, col, *inputs[i % 2], 1.0, n)
                times.append(time.perf_counter() - t0)
        times.sort()
        t = times[len(times) // 2]
        last = inputs[(a.repeat - 1) % 2]
        rng = np.random.default_rng(0)
        rel = check(row, col, *last, 1.0, out, rng.integers(0, n, 64))
        flops = 4.0 * row.numel() * a.heads * a.dim
        print(json.dumps({"graph": path, "rows": n, "nnz": int(row.numel()), "pyg_ms": t * 1e3,
                          "pyg_gflops": flops / t * 1e-9, "pyg_max_rel_error_sampled": rel,
                          "torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
