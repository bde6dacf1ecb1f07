"""Block-sparse attention forward and forward+backward: trisparse (through the package's autograd)
against flex_attention (compiled, forward and backward) with a BlockMask holding the very same
blocks, on random per-head block masks of sparsity p (the fraction of blocks dropped).

One JSON line per (N, G, p): CUDA-event medians of the forward alone and of forward + backward
(torch.autograd.grad of q, k and v), after warm-ups, and the largest difference between the two
libraries' gradients relative to flex's largest entry. bf16 inputs [1, H, N, D], uniform in [-1, 1).

  python3 bench/python/block_sparse_training.py --n 32768 131072 --block 64 128 \
      --sparsity 0.5 0.9 0.95 0.99 > results.jsonl
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import trisparse
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_sparse import block_mask_from, time_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--block", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.9, 0.95, 0.99])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    h, d = args.heads, args.dim
    for n in args.n:
        gen = torch.Generator(device=dev).manual_seed(n)
        q, k, v, dout = (
            torch.rand(1, h, n, d, device=dev, generator=gen, dtype=torch.bfloat16) * 2 - 1
            for _ in range(4)
        )
        for g in args.block:
            nb = -(-n // g)
            for p in args.sparsity:
                rng = np.random.default_rng(int(n + g + 1000 * p))
                blocks = rng.random((h, nb, nb)) >= p
                ours_mask = trisparse.BlockMask(torch.from_numpy(blocks)[None], block_size=g)
                flex_mask = block_mask_from(blocks, n, g, dev)
                r = {"n": n, "block": g, "sparsity": p, "heads": h, "dim": d, "dtype": "bf16"}
                r["blocks"] = int(blocks.sum())

                def ours(q_, k_, v_):
                    return trisparse.block_sparse_attention(q_, k_, v_, ours_mask)

                def flex(q_, k_, v_):
                    return compiled(q_, k_, v_, block_mask=flex_mask)

                for name, fn in (("trisparse", ours), ("flex", flex)):
                    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

                    def step(fn=fn, leaves=leaves):
                        out = fn(*leaves)
                        return torch.autograd.grad(out, leaves, dout)

                    with torch.no_grad():
                        r[name + "_fwd_ms"] = time_ms(lambda fn=fn: fn(q, k, v), args.repeat)
                    r[name + "_fwd_bwd_ms"] = time_ms(step, args.repeat)
                    r[name + "_grads"] = step()
                diff, top = 0.0, 0.0
                for a, b in zip(r.pop("trisparse_grads"), r.pop("flex_grads"), strict=True):
                    diff = max(diff, float((a.float() - b.float()).abs().max()))
                    top = max(top, float(b.float().abs().max()))
                r["grad_max_rel_diff_vs_flex"] = diff / max(top, 1e-30)
                r["speedup_fwd_bwd_vs_flex"] = r["flex_fwd_bwd_ms"] / r["trisparse_fwd_bwd_ms"]
                r["speedup_fwd_vs_flex"] = r["flex_fwd_ms"] / r["trisparse_fwd_ms"]
                r["bwd_over_fwd"] = (r["trisparse_fwd_bwd_ms"] - r["trisparse_fwd_ms"]) / r[
                    "trisparse_fwd_ms"
                ]
                r["torch"] = torch.__version__
                r["gpu"] = torch.cuda.get_device_name()
                print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
