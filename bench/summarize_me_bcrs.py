#!/usr/bin/env python3
"""Summarises bench_me_bcrs JSONL: per-graph and geometric-mean speedups of the ME-BCRS kernels
over cuSPARSE, and of 8x1 over 16x1 vectors. Usage: summarize_me_bcrs.py RESULTS.jsonl [--table]"""

import argparse
import itertools
import json
import math


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--table", action="store_true", help="a markdown row per graph (n=128, d=32)")
    ap.add_argument(
        "--footprint",
        action="store_true",
        help="the ME-BCRS vs SR-BCRS footprint per graph and its distribution "
        "(the FlashSparse paper's Table 7 comparison)",
    )
    args = ap.parse_args()
    with open(args.results) as lines:
        rows = [json.loads(l) for l in lines if l.strip().startswith('{"build')]
    spmm = {}
    sddmm = {}
    for r in rows:
        for s in r["spmm"]:
            spmm.setdefault(s["n"], []).append((r, s))
        for s in r["sddmm"]:
            sddmm.setdefault(s["d"], []).append((r, s))
    print(f"{len(rows)} graphs")
    for n, items in sorted(spmm.items()):
        f = lambda k: geomean([s.get(k, 0) / s["ours_f16_ms"] for _, s in items if k in s])
        print(
            f"SpMM n={n}: f16 vs cuSPARSE fp32 {f('cusparse_fp32_ms'):.2f}x, vs fp16 "
            f"{f('cusparse_fp16_ms'):.2f}x; 8x1 over 16x1 {f('ours_f16_16x1_ms'):.2f}x; "
            f"tf32 vs cuSPARSE fp32 "
            f"{geomean([s['cusparse_fp32_ms'] / s['ours_tf32_ms'] for _, s in items if 'cusparse_fp32_ms' in s]):.2f}x; "
            f"max err f16 {max(s['err_f16'] for _, s in items):.1e} tf32 {max(s['err_tf32'] for _, s in items):.1e}"
        )
    for d, items in sorted(sddmm.items()):
        f = lambda k: geomean([s.get(k, 0) / s["ours_f16_ms"] for _, s in items if k in s])
        print(
            f"SDDMM d={d}: f16 vs cuSPARSE fp32 {f('cusparse_fp32_ms'):.2f}x, vs fp16 "
            f"{f('cusparse_fp16_ms'):.2f}x; 8x1 over 16x1 {f('ours_f16_16x1_ms'):.2f}x; tf32 vs fp32 "
            f"{geomean([s['cusparse_fp32_ms'] / s['ours_tf32_ms'] for _, s in items if 'cusparse_fp32_ms' in s]):.2f}x"
        )
    print(
        "ME-BCRS footprint vs SR-BCRS: mean reduction "
        f"{100 * (1 - sum(r['me_bcrs_bytes'] / r['sr_bcrs_bytes'] for r in rows) / len(rows)):.1f}%"
    )
    if args.footprint:
        cut = sorted(100 * (1 - r["me_bcrs_bytes"] / r["sr_bcrs_bytes"]) for r in rows)
        q = lambda f: cut[min(len(cut) - 1, int(f * len(cut)))]
        print(
            f"footprint reduction over {len(cut)} graphs: min {cut[0]:.1f}%, p10 {q(0.1):.1f}%, "
            f"p25 {q(0.25):.1f}%, median {q(0.5):.1f}%, p75 {q(0.75):.1f}%, p90 {q(0.9):.1f}%, "
            f"max {cut[-1]:.1f}%"
        )
        edges = [0, 5, 10, 15, 20, 30, 50, 100]
        for lo, hi in itertools.pairwise(edges):
            n = sum(lo <= c < hi for c in cut)
            print(f"  {lo:3d}-{hi:3d}%: {n:3d} {'#' * n}")
        print("| graph | nnz | 8x1 vectors | SR-BCRS MB | ME-BCRS MB | reduction |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in sorted(rows, key=lambda r: r["me_bcrs_bytes"] / r["sr_bcrs_bytes"]):
            print(
                f"| {r['graph']} | {r['nnz']} | {r['vectors_8x1']} | {r['sr_bcrs_bytes'] / 1e6:.2f} | "
                f"{r['me_bcrs_bytes'] / 1e6:.2f} | {100 * (1 - r['me_bcrs_bytes'] / r['sr_bcrs_bytes']):.1f}% |"
            )
    if args.table:
        print(
            "| graph | nnz | SpMM f16 µs | 16x1 µs | tf32 µs | cuSPARSE fp32 µs | fp16 µs | "
            "SDDMM f16 µs | cuSPARSE fp32 µs | softmax µs |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            s = next(x for x in r["spmm"] if x["n"] == 128)
            d = next(x for x in r["sddmm"] if x["d"] == 32)
            us = lambda x, k: f"{1000 * x[k]:.1f}" if k in x else "-"
            print(
                f"| {r['graph']} | {r['nnz']} | {us(s, 'ours_f16_ms')} | {us(s, 'ours_f16_16x1_ms')} | "
                f"{us(s, 'ours_tf32_ms')} | {us(s, 'cusparse_fp32_ms')} | {us(s, 'cusparse_fp16_ms')} | "
                f"{us(d, 'ours_f16_ms')} | {us(d, 'cusparse_fp32_ms')} | {us(r, 'softmax_ms')} |"
            )


if __name__ == "__main__":
    main()
