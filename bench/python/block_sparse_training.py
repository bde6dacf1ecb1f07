"""Block-sparse attention forward and forward+backward: trisparse (through the package's autograd)
against flex_attention (compiled, forward and backward) with a BlockMask holding the very same
blocks, on random per-head block masks of sparsity p (the fraction of blocks dropped).

One JSON line per (N, G, p): CUDA-event medians of the forward alone and of forward + backward
(torch.autograd.grad of q, k and v), after warm-ups, and the largest difference between the two
libraries' gradients relative to flex's largest entry. bf16 inputs [1, H, N, D], uniform in [-1, 1).
trisparse_device: the same blocks as a mask on the GPU, a new one (and its plan, built there)
at every step; trisparse_device_hint: the same with the density given (BlockMask(density=1 - p)).
With --importance, trisparse_importance: the step with the kernels' block importance (mass and
|dS|), trisparse_importance_mass: the mass alone (as PatternLearner tracks it); their forwards,
timed without gradients, measure the mass by the light pass after the forward
(light_mass_overhead: over the forward alone). With --topk,
trisparse_topk: a top-k mask of the same density selected from q and k at every step
(topk_block_mask: the library's GPU plan), and trisparse_topk_torch: the same selection with
torch's ops into a BlockMask (the package's path before the plan was bound).

  python3 bench/python/block_sparse_training.py --n 32768 131072 --block 64 128 [--dense] \
      [--importance] [--topk] \
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
from block_sparse import block_mask_from, time_ms

# flex_attention's tiles for G = 64 (they must divide the mask's block; its defaults exceed
# 64): the forward's and the backward's (dk/dv and dq passes), tried in this order.
FLEX_OPTIONS_64 = [
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
    {"BLOCK_M": 64, "BLOCK_N": 64},
]


def dense_times(q, k, v, dout, repeat):
    """Dense attention through SDPA's flash backend (the plan's speed gates compare with it):
    forward and forward + backward medians in ms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            fwd = time_ms(lambda: sdpa(q, k, v), repeat)
        both = time_ms(lambda: torch.autograd.grad(sdpa(*leaves), leaves, dout), repeat)
    return {"sdpa_flash_fwd_ms": fwd, "sdpa_flash_fwd_bwd_ms": both}


def point(
    compiled,
    q,
    k,
    v,
    dout,
    g,
    p,
    repeat,
    dense=None,
    importance=False,
    topk=False,
    dropout=0.0,
    flex=True,
    bias=False,
):
    """One (N, G, p) line: both libraries' times, and their gradients' largest difference."""
    h, n, d = q.shape[1], q.shape[2], q.shape[3]
    nb = -(-n // g)
    rng = np.random.default_rng(int(n + g + 1000 * p))
    blocks = rng.random((h, nb, nb)) >= p
    ours_mask = trisparse.BlockMask(torch.from_numpy(blocks)[None], block_size=g)
    flex_mask = block_mask_from(blocks, n, g, q.device)
    fns = {"trisparse": lambda q_, k_, v_: trisparse.block_sparse_attention(q_, k_, v_, ours_mask)}
    # The same blocks as a mask on the GPU, made anew at every step (as a top-k selection is): its
    # plan is built on the device, by kernels, inside the timed step.
    on_device, last = torch.from_numpy(blocks)[None].to(q.device), [None]

    def fresh(q_, k_, v_):
        last[0] = trisparse.BlockMask(on_device, block_size=g)  # alive through the backward
        return trisparse.block_sparse_attention(q_, k_, v_, last[0])

    fns["trisparse_device"] = fresh

    def fresh_with_density(q_, k_, v_):  # the caller knows the density (as a top-k selection)
        last[0] = trisparse.BlockMask(on_device, block_size=g, density=1 - p)
        return trisparse.block_sparse_attention(q_, k_, v_, last[0])

    fns["trisparse_device_hint"] = fresh_with_density
    if topk:  # a mask of the same density routed from q and k at every step
        top_k = max(1, round((1 - p) * nb)) - 1  # plus the diagonal block

        def routed(q_, k_, v_):
            last[0] = trisparse.topk_block_mask(q_, k_, g, top_k)
            return trisparse.block_sparse_attention(q_, k_, v_, last[0])

        def routed_torch(q_, k_, v_):
            packed = [t.detach().transpose(1, 2).reshape(-1, h, d) for t in (q_, k_)]
            blocks = torch.ops.trisparse.topk_blocks(*packed, 1, g, top_k, False, True)
            last[0] = trisparse.BlockMask(blocks, g, density=(top_k + 1) / nb)
            return trisparse.block_sparse_attention(q_, k_, v_, last[0])

        fns["trisparse_topk"], fns["trisparse_topk_torch"] = routed, routed_torch
    if importance:  # the host mask's step with the kernels' block importance (BlockImportance)
        tracker = trisparse.BlockImportance()
        fns["trisparse_importance"] = lambda q_, k_, v_: trisparse.block_sparse_attention(
            q_, k_, v_, ours_mask, importance=tracker
        )
        mass_only = trisparse.BlockImportance(measure_grad=False)  # as PatternLearner tracks
        fns["trisparse_importance_mass"] = lambda q_, k_, v_: trisparse.block_sparse_attention(
            q_, k_, v_, ours_mask, importance=mass_only
        )
    if dropout > 0:  # attention dropout drawn in the kernels (FlexAttention has none)
        fns["trisparse_dropout"] = lambda q_, k_, v_: trisparse.block_sparse_attention(
            q_, k_, v_, ours_mask, dropout_p=dropout
        )
    if bias:  # a learnable per-head block bias (its gradient written by the backward)
        table = torch.randn(1, h, nb, nb, device=q.device, requires_grad=True)
        fns["trisparse_bias"] = lambda q_, k_, v_: trisparse.block_sparse_attention(
            q_, k_, v_, ours_mask, bias=table
        )
    for i, opts in enumerate(([None] if g >= 128 else FLEX_OPTIONS_64) if flex else []):
        fns[f"flex{i}"] = lambda q_, k_, v_, opts=opts: compiled(
            q_, k_, v_, block_mask=flex_mask, kernel_options=opts
        )
    r = {"n": n, "block": g, "sparsity": p, "heads": h, "dim": d, "dtype": "bf16"}
    r["blocks"] = int(blocks.sum())
    grads = {}
    for name, fn in fns.items():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def step(fn=fn, leaves=leaves):
            return torch.autograd.grad(fn(*leaves), leaves, dout)

        if name.startswith("flex") and "flex" in grads:
            continue  # an earlier choice of flex's tiles compiled
        key = "flex" if name.startswith("flex") else name
        try:
            with torch.no_grad():
                r[key + "_fwd_ms"] = time_ms(lambda fn=fn: fn(q, k, v), repeat)
            r[key + "_fwd_bwd_ms"] = time_ms(step, repeat)
            grads[key] = step()
            r.pop(key + "_error", None)
            if key == "flex":
                r["flex_options"] = name
        except Exception as e:  # noqa: BLE001 - reported in the line, not hidden
            r[key + "_error"] = str(e).splitlines()[0][:300]
    if "trisparse" in grads and "flex" in grads:
        diff, top = 0.0, 0.0
        for a, b in zip(grads["trisparse"], grads["flex"], strict=True):
            diff = max(diff, float((a.float() - b.float()).abs().max()))
            top = max(top, float(b.float().abs().max()))
        r["grad_max_rel_diff_vs_flex"] = diff / max(top, 1e-30)
        r["speedup_fwd_bwd_vs_flex"] = r["flex_fwd_bwd_ms"] / r["trisparse_fwd_bwd_ms"]
        r["speedup_fwd_vs_flex"] = r["flex_fwd_ms"] / r["trisparse_fwd_ms"]
    if "trisparse_device" in grads and "trisparse" in grads:
        pairs = zip(grads["trisparse_device"], grads["trisparse"], strict=True)
        r["device_mask_grad_max_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
    if "trisparse_dropout_fwd_bwd_ms" in r:
        r["dropout_p"] = dropout
        r["dropout_overhead"] = r["trisparse_dropout_fwd_bwd_ms"] / r["trisparse_fwd_bwd_ms"] - 1
    for name in ("importance", "importance_mass", "bias"):
        if f"trisparse_{name}_fwd_bwd_ms" in r:
            r[f"{name}_overhead"] = (
                r[f"trisparse_{name}_fwd_bwd_ms"] / r["trisparse_fwd_bwd_ms"] - 1
            )
    if "trisparse_importance_mass_fwd_ms" in r:  # no_grad: the forward and the light pass
        r["light_mass_overhead"] = r["trisparse_importance_mass_fwd_ms"] / r["trisparse_fwd_ms"] - 1
    if "trisparse_fwd_bwd_ms" in r:
        r["bwd_over_fwd"] = r["trisparse_fwd_bwd_ms"] / r["trisparse_fwd_ms"] - 1
    if dense is not None and "trisparse_fwd_bwd_ms" in r:
        r.update(dense)
        r["speedup_fwd_bwd_vs_sdpa_flash"] = (
            dense["sdpa_flash_fwd_bwd_ms"] / r["trisparse_fwd_bwd_ms"]
        )
    r["torch"] = torch.__version__
    r["gpu"] = torch.cuda.get_device_name()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--block", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.9, 0.95, 0.99])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dense", action="store_true", help="also time SDPA's flash backend, dense")
    ap.add_argument(
        "--importance", action="store_true", help="also time the step with BlockImportance"
    )
    ap.add_argument("--topk", action="store_true", help="also time top-k masks routed per step")
    ap.add_argument("--bias", action="store_true", help="also time a learnable block bias")
    ap.add_argument(
        "--dropout", type=float, default=0.0, help="also time attention dropout p in the kernels"
    )
    ap.add_argument(
        "--no-flex",
        action="store_true",
        help="leave flex_attention out (its G = 64 backward does not compile, and a failed "
        "compile can leave later points on its dense fallback)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    for n in args.n:
        gen = torch.Generator(device=dev).manual_seed(n)
        q, k, v, dout = (
            torch.rand(1, args.heads, n, args.dim, device=dev, generator=gen, dtype=torch.bfloat16)
            * 2
            - 1
            for _ in range(4)
        )
        dense = dense_times(q, k, v, dout, args.repeat) if args.dense else None
        for g in args.block:
            for p in args.sparsity:
                line = point(
                    compiled,
                    q,
                    k,
                    v,
                    dout,
                    g,
                    p,
                    args.repeat,
                    dense,
                    args.importance,
                    args.topk,
                    args.dropout,
                    not args.no_flex,
                    args.bias,
                )
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
