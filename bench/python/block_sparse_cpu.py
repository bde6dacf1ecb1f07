#!/usr/bin/env python3
"""Block-sparse attention on the CPU through the public API: trisparse.block_sparse_attention
forward (no gradients) and forward + backward against PyTorch's scaled_dot_product_attention on
the same inputs, dense (the work a sparse kernel saves) and with the block mask expanded to a
boolean [H, N, N] mask (what a PyTorch user writes without us; its output is ours). Random
per-head block masks (p = the fraction of blocks dropped, the diagonal kept), fp32 [1, H, N, D]
inputs in [-1, 1); wall-clock medians after a warm-up. JSON lines on stdout; the error is ours
against float64 on the masked path (max |ours - ref| / max |ref|, output and gradients). With
--dropout P also ours with attention dropout P drawn in the kernels (ours_dropout_*; its time
over ours without: dropout_over_*).

    python3 bench/python/block_sparse_cpu.py --n 4096 --sparsity 0 0.5 0.9 0.95 [--dropout 0.1]
"""

import argparse
import json

import torch
import torch.nn.functional as F
import trisparse
from attention_training import wall_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.5, 0.9, 0.95])
    ap.add_argument("--causal", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own)")
    ap.add_argument("--dropout", type=float, default=0.0, help="also time attention dropout P")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for n in args.n:
        for causal in map(bool, args.causal):
            for p in args.sparsity:
                gen = torch.Generator().manual_seed(n + int(p * 100) + causal)
                nb = -(-n // args.block)
                blocks = torch.rand(1, args.heads, nb, nb, generator=gen) >= p
                blocks |= torch.eye(nb, dtype=torch.bool)
                mask = trisparse.BlockMask(blocks, args.block, causal=causal)
                dense_mask = blocks[0].repeat_interleave(args.block, 1)
                dense_mask = dense_mask.repeat_interleave(args.block, 2)[:, :n, :n]
                if causal:
                    dense_mask &= torch.ones(n, n, dtype=torch.bool).tril()
                q, k, v = (
                    (torch.rand(1, args.heads, n, args.dim, generator=gen) * 2 - 1).requires_grad_()
                    for _ in range(3)
                )
                dout = torch.rand(1, args.heads, n, args.dim, generator=gen) * 2 - 1

                def ours():
                    return trisparse.block_sparse_attention(q, k, v, mask)

                def ours_dropout():
                    return trisparse.block_sparse_attention(q, k, v, mask, dropout_p=args.dropout)

                def dense():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def masked():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)

                def no_grad(f):
                    def run():
                        with torch.no_grad():
                            f()

                    return run

                def training(f):
                    return lambda: torch.autograd.grad(f(), (q, k, v), dout)

                row = {
                    "n": n,
                    "heads": args.heads,
                    "dim": args.dim,
                    "block": args.block,
                    "sparsity": p,
                    "causal": causal,
                    "density": float(blocks.float().mean()),
                    "threads": torch.get_num_threads(),
                }
                for name, f in (("ours", ours), ("sdpa_dense", dense), ("sdpa_masked", masked)):
                    row[f"{name}_fwd_ms"] = wall_ms(no_grad(f), args.repeat)
                    row[f"{name}_fwd_bwd_ms"] = wall_ms(training(f), args.repeat)
                if args.dropout > 0:
                    row["dropout"] = args.dropout
                    row["ours_dropout_fwd_ms"] = wall_ms(no_grad(ours_dropout), args.repeat)
                    row["ours_dropout_fwd_bwd_ms"] = wall_ms(training(ours_dropout), args.repeat)
                for kind in ("fwd", "fwd_bwd"):
                    for base in ("sdpa_dense", "sdpa_masked"):
                        row[f"vs_{base}_{kind}"] = row[f"{base}_{kind}_ms"] / row[f"ours_{kind}_ms"]
                    if args.dropout > 0:
                        row[f"dropout_over_{kind}"] = (
                            row[f"ours_dropout_{kind}_ms"] / row[f"ours_{kind}_ms"]
                        )
                # Error against float64 on the masked path (rows with no key: zeros in both).
                ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*ref_in, attn_mask=dense_mask).nan_to_num()
                ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
                out = ours()
                grads = torch.autograd.grad(out, (q, k, v), dout)
                row["max_rel_error"] = max(
                    float((a.detach().double() - b).abs().max() / b.abs().max())
                    for a, b in zip((out, *grads), (ref.detach(), *ref_grads), strict=True)
                )
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
