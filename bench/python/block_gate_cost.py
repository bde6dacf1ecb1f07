"""What a learned gate's block selection costs: ``BlockGate.block_mask`` (pooling, scores, top-k
rows, the mask on the device) against ``topk_block_mask`` (the library's pooled top-k selection)
and the block-sparse forward it feeds, and the gate's selection replayed as a CUDA graph (the
same ops without their host time). bf16 q, k, v [1, H, N, D], causal, one JSON line per N;
CUDA-event medians (ms).

  python3 bench/python/block_gate_cost.py --n 8192 32768 131072 --block 64 --sparsity 0.9
"""

import argparse
import json
import os
import sys

import torch
import trisparse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_sparse import time_ms


def point(n, heads, dim, g, sparsity, repeat):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    q, k, v = (
        torch.rand(1, heads, n, dim, device=dev, generator=gen, dtype=torch.bfloat16) - 0.5
        for _ in range(3)
    )
    gate = trisparse.BlockGate(heads, dim, g, causal=True).to(dev)
    with torch.no_grad():  # a trained gate's weights are not the identity
        gate.wq.add_(0.05 * torch.randn_like(gate.wq))
        gate.wk.add_(0.05 * torch.randn_like(gate.wk))
    nb = -(-n // g)
    top_k = max(1, round((1 - sparsity) * nb)) - 1
    r = {"n": n, "heads": heads, "dim": dim, "block": g, "sparsity": sparsity, "causal": True}
    with torch.no_grad():
        r["gate_block_mask_ms"] = time_ms(lambda: gate.block_mask(q[0], k[0], sparsity), repeat)
        r["topk_block_mask_ms"] = time_ms(
            lambda: trisparse.topk_block_mask(q, k, g, top_k, causal=True), repeat
        )
        mask = gate.block_mask(q[0], k[0], sparsity)
        r["forward_ms"] = time_ms(lambda: trisparse.block_sparse_attention(q, k, v, mask), repeat)
        # The selection captured once and replayed: its kernels alone.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                gate.select(q[0], k[0], sparsity)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gate.select(q[0], k[0], sparsity)
        graph.replay()
        torch.cuda.synchronize()
        eager = gate.select(q[0], k[0], sparsity)
        r["captured_equal"] = bool(torch.equal(captured, eager))
        r["gate_select_graph_ms"] = time_ms(graph.replay, repeat)
        r["gate_select_ms"] = time_ms(lambda: gate.select(q[0], k[0], sparsity), repeat)
    r["gpu"] = torch.cuda.get_device_name()
    r["torch"] = torch.__version__
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    for n in args.n:
        print(json.dumps(point(n, args.heads, args.dim, args.block, args.sparsity, args.repeat)))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
