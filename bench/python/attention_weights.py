#!/usr/bin/env python3
"""The cost of return_attention_weights=True on the CPU: trisparse.nn's TransformerConv and GATConv
(128 -> 8 heads x 16, float32, without and with 16 edge features) on a random graph of 20,000
nodes and 200,000 edges; a training step (forward, backward of out.sum() + alpha.sum()) and an
eval forward under no_grad, wall-clock medians of 5 after 3 warm-ups. --label names the Python
tree in the record: an A/B of two trees runs the script once per tree (PYTHONPATH), interleaved.

    PYTHONPATH=build/cpu-only/python python3 bench/python/attention_weights.py --label new
"""

import argparse
import json
import os
import sys

import torch
import trisparse.nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import wall_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    n, e = 20000, 200000
    ei = torch.randint(0, n, (2, e))
    x = torch.randn(n, 128)
    ea = torch.randn(e, 16)
    for mode in ("train", "eval"):
        rec = {"label": a.label, "mode": mode}
        for layer in ("TransformerConv", "GATConv"):
            for edge_dim in (None, 16):
                torch.manual_seed(0)
                m = getattr(trisparse.nn, layer)(128, 16, heads=8, edge_dim=edge_dim)
                kw = {"edge_attr": ea} if edge_dim else {}

                def train(m=m, kw=kw):
                    xs = x.clone().requires_grad_()
                    out, (_, alpha) = m(xs, ei, **kw, return_attention_weights=True)
                    (out.sum() + alpha.sum()).backward()

                @torch.no_grad()
                def evaluate(m=m, kw=kw):
                    m(x, ei, **kw, return_attention_weights=True)

                m.train(mode == "train")
                rec[f"{layer}/{edge_dim}"] = round(
                    wall_ms(train if mode == "train" else evaluate, 5), 1
                )
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
