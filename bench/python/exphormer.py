#!/usr/bin/env python3
"""An Exphormer-style model (Shirzad et al., 2023): `--layers` TransformerConv layers with
residuals over the Exphormer pattern (the graph's edges, a random expander of degree
`--expander-degree`, `--virtual-nodes` virtual nodes, self loops: Pattern.exphormer), with
trisparse.nn's TransformerConv on the Pattern against the same model with PyG's TransformerConv
on the pattern's edge_index, the same weights; forward + backward of a training step, float32 and
bfloat16 autocast, per graph file with at least --min-edges edges.

    python3 bench/python/exphormer.py data/snap_web_notredame.el.xz > exphormer.jsonl

Times: CUDA-event medians of --repeat steps after warm-ups; peak memory: the step's beyond its
inputs; error: max |ours - PyG| / max |PyG| over the output and the input's gradient.
"""

import argparse
import json
import os
import sys

import torch
import torch_geometric.nn
import trisparse
import trisparse.datasets
import trisparse.nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import events_ms


class Model(torch.nn.Module):
    def __init__(self, conv, channels, heads, layers):
        super().__init__()
        width = heads * channels
        self.convs = torch.nn.ModuleList(conv(width, channels, heads=heads) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))

    def forward(self, x, graph):
        for conv, norm in zip(self.convs, self.norms):
            x = x + torch.relu(norm(conv(x, graph)))
        return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--min-edges", type=int, default=1_000_000)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--expander-degree", type=int, default=4)
    ap.add_argument("--virtual-nodes", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device("cuda")
    for path in a.graphs:
        edge_index, n = trisparse.datasets.read_graph(path)
        if edge_index.shape[1] < a.min_edges:
            continue
        pattern = trisparse.Pattern.exphormer(
            edge_index, n, a.expander_degree, a.virtual_nodes, add_self_loops=True
        )
        pyg_edges = pattern.edge_index().to(dev)
        torch.manual_seed(0)
        pyg = Model(torch_geometric.nn.TransformerConv, a.channels, a.heads, a.layers).to(dev)
        ours = Model(trisparse.nn.TransformerConv, a.channels, a.heads, a.layers).to(dev)
        ours.load_state_dict(pyg.state_dict())
        width = a.heads * a.channels
        x = torch.randn(pattern.num_rows, width, device=dev)
        dout = torch.randn_like(x)
        for mode, autocast in (("fp32", False), ("bf16_autocast", True)):
            rec = {"graph": os.path.basename(path).split(".")[0], "nodes": n}
            rec.update(graph_edges=int(edge_index.shape[1]), pattern_entries=pattern.nnz)
            rec.update(heads=a.heads, channels=a.channels, layers=a.layers, mode=mode)
            rec.update(expander_degree=a.expander_degree, virtual_nodes=a.virtual_nodes)
            rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
            ref = None
            for name, model, graph in (("pyg", pyg, pyg_edges), ("trisparse", ours, pattern)):
                xs = x.detach().requires_grad_()

                def step(model=model, graph=graph, xs=xs):
                    model.zero_grad(set_to_none=True)
                    xs.grad = None
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        out = model(xs, graph)
                    out.backward(dout.to(out.dtype))
                    return out

                try:
                    out = step()
                    got = [out.detach().float(), xs.grad.float()]
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    ms = events_ms(step, a.repeat)
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                    rec[name] = {"step_ms": ms, "peak_mib": peak}
                    if ref is None:
                        ref = got
                    else:
                        rec[name]["rel_error_vs_pyg"] = max(
                            float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)
                        )
                except torch.OutOfMemoryError as e:
                    rec[name] = {"error": "out of memory: " + str(e).splitlines()[0][:160]}
                torch.cuda.empty_cache()
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
