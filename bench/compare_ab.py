#!/usr/bin/env python3
"""Compares two builds' runs of the same benchmarks (scripts/gpu_ab.sh): per point, the best of
each build's rounds (median kernel times), new / base, and the worst and geometric-mean ratios.

Usage: bench/compare_ab.py DIR [--markdown] [--limit 1.03]
DIR holds {fused3s,sparse,block_sparse}_{base,new}_{round}.jsonl, or ab_*.jsonl with a "variant" and
"round" field on every line.
"""

import argparse
import collections
import glob
import json
import math
import os
import re


def points(bench, line):
    """(point name, milliseconds) pairs that one JSON line of `bench` holds."""
    if bench == "fused3s" and "kernel_ms" in line:
        yield f"{line['graph']}", line["kernel_ms"]
    elif bench == "block_sparse" and "ms" in line and "n" in line:
        yield f"N={line['n'] // 1024}K G={line['g']} p={line['p']}", line["ms"]
    elif bench == "sparse" and "spmm" in line:
        for s in line["spmm"]:
            yield f"spmm {line['graph']} n={s['n']}", s["ours_f16_ms"]
        for s in line["sddmm"]:
            yield f"sddmm {line['graph']} d={s['d']}", s["ours_f16_ms"]


def load(directory):
    # best[bench][variant][point] = the lowest time over rounds
    best = collections.defaultdict(lambda: collections.defaultdict(dict))
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        m = re.match(
            r"(fused3s|sparse|block_sparse)_(base|new)_\d+\.jsonl$", os.path.basename(path)
        )
        with open(path) as f:
            lines = f.readlines()
        for raw in lines:
            line = json.loads(raw)
            bench = m.group(1) if m else line.get("bench")
            variant = m.group(2) if m else line.get("variant")
            if bench is None or variant is None:
                continue
            for name, ms in points(bench, line):
                seen = best[bench][variant].get(name)
                best[bench][variant][name] = ms if seen is None else min(seen, ms)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--limit", type=float, default=1.03)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    best = load(args.dir)
    worst_all = 0.0
    for bench in ("fused3s", "block_sparse", "sparse"):
        base, new = best[bench]["base"], best[bench]["new"]
        common = [p for p in base if p in new]
        if not common:
            continue
        ratios = [(new[p] / base[p], p) for p in common]
        geo = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
        worst = max(ratios)
        worst_all = max(worst_all, worst[0])
        over = [(r, p) for r, p in ratios if r > args.limit]
        print(
            f"{bench}: {len(common)} points, new/base geomean {geo:.3f}, worst {worst[0]:.3f} "
            f"({worst[1]}), over {args.limit}: {len(over)}"
        )
        if args.markdown:
            print("\n| point | base ms | new ms | new/base |\n|---|---:|---:|---:|")
            for p in common:
                print(f"| {p} | {base[p]:.4f} | {new[p]:.4f} | {new[p] / base[p]:.3f} |")
            print()
        else:
            for r, p in sorted(over, reverse=True):
                print(f"  {p}: base {base[p]:.4f} ms, new {new[p]:.4f} ms, {r:.3f}")
    print(f"worst new/base over all points: {worst_all:.3f}")


if __name__ == "__main__":
    main()
