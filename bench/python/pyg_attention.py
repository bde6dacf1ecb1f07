#!/usr/bin/env python3
"""What a user runs today: PyG's TransformerConv message path on PyTorch (CPU or CUDA), and on
CUDA also dense scaled_dot_product_attention with the pattern as a boolean mask where N^2 fits.

For each graph: gather q_i = Q[row], k_j = K[col]; alpha = <q_i, k_j> * scale;
alpha = torch_geometric.utils.softmax(alpha, row); out = scatter-add(alpha * V[col], row).
This is exactly O = softmax(scale * (Q K^T ⊙ A)) V with A's row i listing the keys of query i:
the same function trisparse computes (checked here against float64 on sampled rows).
The graph is read the way trisparse reads it (undirected files symmetrised, duplicates merged).
Prints one JSON object per graph. CUDA times are CUDA-event medians around the whole Python call
(what a user's step pays), after 3 warm-ups, over 2 rotating input sets.
"""

import argparse
import json
import lzma
import re
import time

import numpy as np
import torch
from torch_geometric.utils import scatter, softmax


def read_graph(path):
    nodes, undirected = None, False
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        text = f.read()
    for line in re.findall(r"(?m)^[#%].*$", text):
        body = line[1:].strip().lower()
        if body.startswith("nodes:"):
            nodes = int(body.split()[1])
            undirected = "directed: no" in body
    body = re.sub(r"(?m)^[#%].*$", "", text).replace(",", " ")
    first = next(l for l in body.splitlines() if l.strip())
    fields = np.array(body.split(), dtype=np.int64).reshape(-1, len(first.split()))
    e = fields[:, :2].T.copy()
    n = nodes if nodes is not None else int(e.max()) + 1
    if undirected:
        e = np.concatenate([e, e[::-1]], axis=1)
    key = np.unique(e[0] * n + e[1])  # merge duplicates, sort by row then column
    return n, torch.from_numpy(key // n), torch.from_numpy(key % n)


def attention(row, col, q, k, v, scale, n):
    alpha = (q[row] * k[col]).sum(-1) * scale  # [E, H]
    alpha = softmax(alpha, row, num_nodes=n)  # segment softmax over each row
    return scatter(alpha.unsqueeze(-1) * v[col], row, dim=0, dim_size=n, reduce="sum")


def sdpa(mask, q, k, v, scale):
    """Dense attention with the pattern as a boolean mask ([N, H, D] -> [1, H, N, D] and back)."""
    t = lambda x: x.transpose(0, 1).unsqueeze(0)
    o = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=mask, scale=scale
    )
    return o.squeeze(0).transpose(0, 1)


def check(row, col, q, k, v, scale, out, rows):
    """float64 recomputation of sampled rows."""
    err, ref_max = 0.0, 0.0
    row_np, col_np = row.cpu().numpy(), col.cpu().numpy()
    starts = np.searchsorted(row_np, np.arange(len(out) + 1))
    q, k, v, out = (x.cpu() for x in (q, k, v, out))
    for i in rows:
        cols = col_np[starts[i] : starts[i + 1]]
        if cols.size == 0:
            ref = np.zeros(out.shape[1:])
        else:
            s = scale * np.einsum("hd,nhd->nh", q[i].double().numpy(), k[cols].double().numpy())
            p = np.exp(s - s.max(axis=0))
            p /= p.sum(axis=0)
            ref = np.einsum("nh,nhd->hd", p, v[cols].double().numpy())
        o = out[i].double().numpy()
        if not np.isfinite(o).all():
            return float("nan")
        err = max(err, float(np.abs(o - ref).max()))
        ref_max = max(ref_max, float(np.abs(ref).max()))
    return err / max(ref_max, 1e-300)


def timed(fn, inputs, repeat, cuda):
    """Median milliseconds of fn(*inputs[i % 2]) and the last output."""
    with torch.inference_mode():
        for i in range(3):
            out = fn(*inputs[i % 2])
        times = []
        for i in range(repeat):
            if cuda:
                start, stop = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize()
                start.record()
                out = fn(*inputs[i % 2])
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                out = fn(*inputs[i % 2])
                times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--dense-budget-gib",
        type=float,
        default=16,
        help="largest N x N boolean mask plus fp16 scores SDPA may need",
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cuda = a.device == "cuda"
    dev = torch.device(a.device)
    for path in a.graphs:
        n, row, col = read_graph(path)
        row, col = row.to(dev), col.to(dev)
        rng = np.random.default_rng(0)
        sample = rng.integers(0, n, 64)
        flops = 4.0 * row.numel() * a.heads * a.dim
        rec = {
            "graph": path,
            "rows": n,
            "nnz": int(row.numel()),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "threads": torch.get_num_threads(),
        }
        # PyG in fp32 (TransformerConv's default) and, on CUDA, fp16 (half-precision models).
        for dt in [torch.float32, torch.float16] if cuda else [torch.float32]:
            name = "pyg" if dt == torch.float32 else "pyg_fp16"
            inputs = [
                tuple(torch.rand(n, a.heads, a.dim, device=dev).to(dt) for _ in range(3))
                for _ in range(2)
            ]
            t, out = timed(
                lambda q, k, v: attention(row, col, q, k, v, 1.0, n), inputs, a.repeat, cuda
            )
            last = inputs[(a.repeat - 1) % 2]
            rec[name + "_ms"] = t
            rec[name + "_gflops"] = flops / t * 1e-6
            rec[name + "_max_rel_error_sampled"] = check(row, col, *last, 1.0, out.float(), sample)
        if cuda and n * n * 3 <= a.dense_budget_gib * 2**30:
            mask = torch.zeros(n, n, dtype=torch.bool, device=dev)
            mask[row, col] = True
            inputs = [
                tuple(torch.rand(n, a.heads, a.dim, device=dev).half() for _ in range(3))
                for _ in range(2)
            ]
            t, out = timed(lambda q, k, v: sdpa(mask, q, k, v, 1.0), inputs, a.repeat, cuda)
            last = inputs[(a.repeat - 1) % 2]
            rec["sdpa_ms"] = t
            rec["sdpa_max_rel_error_sampled"] = check(row, col, *last, 1.0, out.float(), sample)
            del mask
        elif cuda:
            rec["sdpa_skipped"] = f"N^2 mask needs {n * n * 3 / 2**30:.1f} GiB"
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
