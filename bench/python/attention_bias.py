#!/usr/bin/env python3
"""A biased attention training step on CUDA: trisparse.sparse_attention with a per-entry score
bias b [nnz, H] (a leaf: its gradient is computed), forward and backward, against the same call
without a bias and against PyG's TransformerConv attention path with the bias added to its scores
(gather -> + bias -> segment softmax -> scatter, float32 autograd).

Per graph (read as trisparse reads it) and dtype: the biased and unbiased steps (forward +
backward of a fixed dout, CUDA-event medians from an idle GPU, as attention_training.py), the
biased forward alone, and the gradients' relative error (max |err| / max |ref|, q, k, v and the
bias) against PyG's float32 autograd. `--label` names the build in the output (an A/B runs the
script once per build). One JSON object per graph.
"""

import argparse
import json
import os
import sys

import torch
import trisparse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import events_ms, graph_inputs, rel_error
from torch_geometric.utils import scatter, softmax


def pyg_biased(row, col, q, k, v, bias, scale, n):
    alpha = (q[row] * k[col]).sum(-1) * scale + bias  # [E, H]
    alpha = softmax(alpha, row, num_nodes=n)
    return scatter(alpha.unsqueeze(-1) * v[col], row, dim=0, dim_size=n, reduce="sum")


def bench_graph(path, dim, heads, repeat, dtypes, label):
    scale = dim**-0.5
    n, row, col, pattern, gen, (q, k, v, dout) = graph_inputs(path, dim, heads)
    bias = 2 * torch.randn(row.numel(), heads, device=q.device, generator=gen)
    rec = {
        "graph": os.path.basename(path).split(".")[0],
        "label": label,
        "rows": n,
        "nnz": int(row.numel()),
        "heads": heads,
        "dim": dim,
        "device": torch.cuda.get_device_name(),
    }
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    pyg_out = pyg_biased(row, col, *leaves, scale, n)
    ref = torch.autograd.grad(pyg_out, leaves, dout)
    del pyg_out
    for dt in dtypes:
        xs = [t.to(dt).detach().requires_grad_() for t in (q, k, v)]
        b = bias.detach().clone().requires_grad_()
        d = dout.to(dt)

        def biased_fwd():
            return trisparse.sparse_attention(*xs, pattern, scale, bias=b)

        def biased_step():
            for t in (*xs, b):
                t.grad = None
            biased_fwd().backward(d)

        def plain_step():
            for t in xs:
                t.grad = None
            trisparse.sparse_attention(*xs, pattern, scale).backward(d)

        r = {
            "biased_forward_ms": events_ms(biased_fwd, repeat),
            "biased_step_ms": events_ms(biased_step, repeat),
            "step_ms": events_ms(plain_step, repeat),
        }
        biased_step()
        torch.cuda.synchronize()
        r["grad_rel_error_vs_pyg_fp32"] = rel_error([t.grad.float() for t in (*xs, b)], ref)
        rec[str(dt).removeprefix("torch.")] = r
        torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    dtypes = [getattr(torch, d) for d in a.dtypes]
    for path in a.graphs:
        print(json.dumps(bench_graph(path, a.dim, a.heads, a.repeat, dtypes, a.label)), flush=True)


if __name__ == "__main__":
    main()
