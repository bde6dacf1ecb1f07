#!/usr/bin/env python3
"""Markdown tables of the block-sparse sweep (bench_block_sparse + bench/python/block_sparse.py),
as docs/performance.md shows them: per (N, G) our fused kernel's ms at each p, its speedup over
dense SDPA (default backend) and over flex_attention, the report's three kernels end to end, and
the seeds; then the dense times and the three kernels' own times at one G. Medians over seeds; speedups are
ratios of the medians.
    bench/table_block_sparse.py RESULTS.jsonl [MORE.jsonl ...] [--stage-g 64]
Later files replace earlier ones' rows for the same N (so a re-run at some N supersedes them).
"""

import argparse
import json
import statistics

PS = (0.5, 0.9, 0.95, 0.99)


def load(paths):
    by_n = {}
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        fresh = {}
        for r in rows:
            if "n" in r:
                fresh.setdefault(r["n"], []).append(r)
        by_n.update(fresh)
    return [r for n in sorted(by_n) for r in by_n[n]]


def med(rows, key):
    v = [r[key] for r in rows if key in r]
    return statistics.median(v) if v else None


def cells(rows, key, fmt, over=None):
    """Per p: the median of key over the seeds, or with `over` the ratio of medians key / over."""
    out = []
    for p in PS:
        pr = [r for r in rows if r["p"] == p]
        m = med(pr, key)
        if m is not None and over is not None:
            d = med([r for r in pr if key in r], over)
            m = None if not d else m / d
        out.append("—" if m is None else fmt.format(m))
    return " / ".join(out)


def kib(n):
    return f"{n // 1024}K"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--stage-g", type=int, default=64)
    a = ap.parse_args()
    rows = load(a.results)
    ns = sorted({r["n"] for r in rows})
    gs = sorted({r["g"] for r in rows})
    print(
        "| N | G | ours ms, p = 0.5 / 0.9 / 0.95 / 0.99 | × dense SDPA | × flex | three kernels ms | seeds |"
    )
    print("|---:|---:|---|---|---|---|---:|")
    for n in ns:
        for g in gs:
            ng = [r for r in rows if r["n"] == n and r["g"] == g]
            seeds = len({r["seed"] for r in ng if "ms" in r})
            print(
                f"| {kib(n)} | {g} | {cells(ng, 'ms', '{:.3f}')} | "
                f"{cells(ng, 'sdpa_default_ms', '{:.1f}', 'ms')} | "
                f"{cells(ng, 'flex_ms', '{:.2f}', 'ms')} | {cells(ng, 'unfused_ms', '{:.2f}')} | {seeds} |"
            )
    print("\nDense in the same run (ms):\n")
    print("| N | dense SDPA default / flash / cuDNN ms | dense ours (G=128 mask) ms |")
    print("|---:|---|---:|")
    for n in ns:
        nr = [r for r in rows if r["n"] == n]
        sd = " / ".join(
            "—" if med(nr, k) is None else f"{med(nr, k):.3f}"
            for k in ("sdpa_default_ms", "sdpa_flash_ms", "sdpa_cudnn_ms")
        )
        d = med(nr, "dense_ours_ms")
        print(f"| {kib(n)} | {sd} | {'—' if d is None else f'{d:.3f}'} |")
    print(f"\nThe three kernels at G = {a.stage_g}, SDDMM / softmax / SpMM (ms):\n")
    print("| N | p = 0.5 | 0.9 | 0.95 | 0.99 |")
    print("|---:|---|---|---|---|")
    for n in ns:
        out = []
        for p in PS:
            pr = [r for r in rows if r["n"] == n and r["g"] == a.stage_g and r["p"] == p]
            ks = [med(pr, k) for k in ("unfused_sddmm_ms", "unfused_softmax_ms", "unfused_spmm_ms")]
            out.append("—" if None in ks else " / ".join(f"{k:.3g}" for k in ks))
        print(f"| {kib(n)} | " + " | ".join(out) + " |")


if __name__ == "__main__":
    main()
