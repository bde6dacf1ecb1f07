#!/usr/bin/env python3
"""Joins a bench_fused3s JSONL with the peers' H200 times in ../shared/anchors/README.md.

Prints a Markdown table: our kernel time, the Fused3S kernel time measured on an H200, the ratio,
and the geometric means the fused 3S issue asks for.
    bench/compare_anchors.py RESULTS.jsonl [ANCHORS_README]
"""
import json
import math
import re
import sys
from pathlib import Path


def anchors(path):
    table = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"[0-9,]+", cells[1] or "x") and re.fullmatch(r"[0-9.]+", cells[3] or "x"):
            table[cells[0]] = {"nnz": int(cells[2].replace(",", "")), "fused3s": float(cells[3])}
    return table


def main():
    results = Path(sys.argv[1])
    anchor_file = sys.argv[2] if len(sys.argv) > 2 else Path(__file__).resolve().parents[2] / "shared/anchors/README.md"
    peers = anchors(anchor_file)
    rows = [json.loads(l) for l in results.read_text().splitlines() if l.strip()]
    header = rows[0] if "device" in rows[0] else {}
    print(f"device: {header.get('device', '?')}, copy bandwidth {header.get('copy_bandwidth_gbps', 0):.0f} GB/s\n")
    print("| graph | nnz | ours (ms) | format build (ms) | Fused3S on H200 (ms) | speedup | GFLOP/s | rel. error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios, big = [], []
    for r in rows:
        if "graph" not in r:
            continue
        p = peers.get(r["graph"])
        ratio = p["fused3s"] / r["kernel_ms"] if p else None
        if ratio:
            ratios.append(ratio)
            if r["nnz"] >= 200_000:
                big.append(ratio)
        print(f"| {r['graph']} | {r['nnz']:,} | {r['kernel_ms']:.4f} | {r['build_ms']:.2f} | "
              f"{p['fused3s'] if p else '—'} | {f'{ratio:.2f}×' if ratio else '—'} | {r['gflops']:.0f} | {r['max_rel_error']:.1e} |")
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
    wins = sum(x > 1 for x in ratios)
    print(f"\nfaster than Fused3S on {wins} of {len(ratios)} graphs; geometric-mean speedup {gm(ratios):.2f}× "
          f"(all), {gm(big):.2f}× (nnz ≥ 200K, {len(big)} graphs)")


if __name__ == "__main__":
    main()
