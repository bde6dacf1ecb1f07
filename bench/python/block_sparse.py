#!/usr/bin/env python3
"""Baselines of the block-sparse attention sweep, run after bench_block_sparse in the same call:
dense scaled_dot_product_attention (PyTorch's default choice, and the FlashAttention and cuDNN
backends forced; no mask: the dense
work a sparse kernel is compared with) and flex_attention (compiled) with a BlockMask holding the
very blocks of each mask bench_block_sparse exported (--export; causal masks: the diagonal blocks
masked by q >= kv inside, the others full). Reads that benchmark's JSON lines
and prints them back with the baseline times and the speedups of trisparse's kernel ("ms") added.

Times are CUDA-event medians of the attention call alone (after 3 warm-ups; the BlockMask is
built once outside the timing, its build time reported apart as flex_mask_ms). Inputs are
uniform in [-1, 1) fp16 [1, heads, N, dim]; flex's output is checked against float64 on sampled
rows (flex_max_rel_error).
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def time_ms(fn, repeat):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def kv_lists(kept):
    """(counts [1, h, nb], indices [1, h, nb, nc]) of a [h, nb, nc] bool block mask: each row's
    kept column indices first (ascending), the rest after; flex reads the first `counts`."""
    counts = kept.sum(-1, dtype=torch.int32)[None]
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]
    return counts, order


def block_mask_from(dense_blocks, n, g, device, causal=False):
    """BlockMask holding exactly the kept blocks: all full blocks (no mask_mod inside a block);
    causal (square, the blocks above the diagonal already dropped): the diagonal blocks partial,
    masked by q >= kv inside, the blocks below it full."""
    kept = torch.from_numpy(dense_blocks).to(device).bool()
    if not causal:
        counts, order = kv_lists(kept)
        return BlockMask.from_kv_blocks(
            torch.zeros_like(counts), order, counts, order, BLOCK_SIZE=g, seq_lengths=(n, n)
        )
    diagonal = torch.eye(kept.shape[1], kept.shape[2], dtype=torch.bool, device=device)
    partial_counts, partial = kv_lists(kept & diagonal)
    full_counts, full = kv_lists(kept & ~diagonal)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial,
        full_counts,
        full,
        BLOCK_SIZE=g,
        mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        seq_lengths=(n, n),
    )


def check_rows(q, k, v, out, dense_blocks, g, scale, causal=False, samples=32):
    rng = np.random.default_rng(0)
    n = q.shape[2]
    err, ref = 0.0, 0.0
    for i in rng.integers(0, n, samples):
        for h in range(q.shape[1]):
            cols = np.nonzero(dense_blocks[h if dense_blocks.shape[0] > 1 else 0, i // g])[0]
            keys = np.concatenate([np.arange(c * g, min(n, c * g + g)) for c in cols])
            keys = torch.from_numpy(keys[keys <= i] if causal else keys)
            qi = q[0, h, i].double()
            kk, vv = k[0, h, keys].double(), v[0, h, keys].double()
            want = torch.softmax(kk @ qi * scale, 0) @ vv
            err = max(err, (out[0, h, i].double() - want).abs().max().item())
            ref = max(ref, want.abs().max().item())
    return err / max(ref, 1e-300)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_jsonl")
    ap.add_argument("--mask-dir", required=True)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    # One compilation per (N, G, kernel options): past Dynamo's default limit of 8 the call would
    # silently fall back to eager flex_attention (materialising the scores).
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    compiled = torch.compile(flex_attention, dynamic=False)
    dense_cache, inputs = {}, {}
    with open(args.bench_jsonl) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    for r in rows:
        if "ms" not in r:
            print(json.dumps(r), flush=True)
            continue
        n, h, d, g = r["n"], r["heads"], r["dim"], r["g"]
        if (n, h, d) not in inputs:
            inputs.clear()
            gen = torch.Generator(device=dev).manual_seed(n)
            inputs[(n, h, d)] = [
                torch.rand(1, h, n, d, device=dev, dtype=torch.float16, generator=gen) * 2 - 1
                for _ in range(3)
            ]
        q, k, v = inputs[(n, h, d)]
        scale = 1.0 / math.sqrt(d)
        key = (n, h, d, r.get("causal", False))
        if key not in dense_cache:
            dense = {}
            for name, backend in (
                ("default", None),
                ("flash", SDPBackend.FLASH_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ):
                try:
                    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                        dense[name] = time_ms(
                            lambda: F.scaled_dot_product_attention(
                                q, k, v, is_causal=r.get("causal", False)
                            ),
                            args.repeat,
                        )
                except Exception as e:  # noqa: BLE001 - a backend this build or shape lacks
                    dense[name + "_error"] = str(e).splitlines()[0][:200]
            dense_cache[key] = dense
        dense = dense_cache[key]
        for name in ("default", "flash", "cudnn"):
            if name in dense:
                r["sdpa_" + name + "_ms"] = dense[name]
                r["speedup_vs_sdpa_" + name] = dense[name] / r["ms"]
            else:
                r["sdpa_" + name + "_error"] = dense[name + "_error"]
        try:
            if g < 16:
                raise ValueError(
                    "flex_attention's kernel tiles are at least 16 (BLOCK_M = 8 fails to compile)"
                )
            blocks = np.fromfile(os.path.join(args.mask_dir, r["mask_file"]), dtype=np.uint8)
            nb = (n + g - 1) // g
            blocks = blocks.reshape(-1, nb, nb)
            causal = r.get("causal", False)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            bm = block_mask_from(blocks, n, g, dev, causal)
            b.record()
            b.synchronize()
            r["flex_mask_ms"] = a.elapsed_time(b)
            # Flex's kernel tiles must divide the mask's block; its defaults are larger than 64.
            opts = None if g >= 128 else {"BLOCK_M": g, "BLOCK_N": g}
            first_call = time.perf_counter()
            out = compiled(q, k, v, block_mask=bm, scale=scale, kernel_options=opts)
            torch.cuda.synchronize()
            r["flex_first_call_s"] = time.perf_counter() - first_call  # compilation included
            r["flex_ms"] = time_ms(
                lambda: compiled(q, k, v, block_mask=bm, scale=scale, kernel_options=opts),
                args.repeat,
            )
            r["flex_kernel_options"] = opts
            r["speedup_vs_flex"] = r["flex_ms"] / r["ms"]
            r["flex_max_rel_error"] = check_rows(q, k, v, out, blocks, g, scale, causal)
        except Exception as e:  # noqa: BLE001 - reported in the row, not hidden
            r["flex_error"] = str(e).splitlines()[0][:300]
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
