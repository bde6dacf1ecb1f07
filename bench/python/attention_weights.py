#!/usr/bin/env python3
"""The cost of return_attention_weights=True on the CPU: trisparse.nn's TransformerConv and GATConv
(128 -> 8 heads x 16, float32, without and with 16 edge features) on a random graph of 20,000
nodes and 200,000 edges; a training step (forward, backward of out.sum() + alpha.sum()) and an
eval forward under no_grad, wall-clock medians of 5 after 2 warm-ups. --label names the Python
tree in the record: an A/B of two trees runs the script once per tree (PYTHONPATH), interleaved.

    PYTHONPATH=build/cpu-only/python python3 bench/python/attention_weights.py --label new
"""

import argparse
import json
import statistics
import time

import torch
import trisparse.nn


def median_ms(fn, repeat=5, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 1)


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
                rec[f"{layer}/{edge_dim}"] = median_ms(train if mode == "train" else evaluate)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
