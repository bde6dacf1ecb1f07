#!/usr/bin/env python3
"""Joins a bench_fused3s JSONL (and optionally the PyG/SDPA JSONL of the same run) with the peers'
H200 times in ../shared/anchors/README.md.

Prints a Markdown table: our kernel time (GPU time, busy GPU ahead) and call time (events around
the whole call on an idle GPU), the format-building time from a host and from a device CSR, each
in-project baseline's time, the Fused3S kernel time measured on an H200, the ratio, and the
geometric means the fused 3S issue asks for.
    bench/compare_anchors.py RESULTS.jsonl [--pyg PYG.jsonl] [--anchors ANCHORS_README]
"""

import argparse
import json
import math
import re
from pathlib import Path


def anchors(path):
    table = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) == 7
            and re.fullmatch(r"[0-9,]+", cells[1] or "x")
            and re.fullmatch(r"[0-9.]+", cells[3] or "x")
        ):
            table[cells[0]] = {"nnz": int(cells[2].replace(",", "")), "fused3s": float(cells[3])}
    return table


def graph_name(path):
    name = Path(path).name
    for suffix in (".el.xz", ".el"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def fmt(x, digits=4):
    return "—" if x is None else f"{x:.{digits}f}"


def base(r, key):
    b = r.get("baselines", {}).get(key, {})
    if "ms" not in b:
        return None
    # A baseline that is wrong (non-finite or off by more than 1e-2) is shown with "!".
    return (b["ms"], not b.get("all_finite", True) or b.get("max_rel_error", 0) > 1e-2)


def cell(v):
    if v is None:
        return "—"
    ms, wrong = v
    return f"{ms:.4f}{' !' if wrong else ''}"


def main():
    here = Path(__file__).resolve()
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--pyg")
    ap.add_argument("--anchors", default=here.parents[2] / "shared/anchors/README.md")
    a = ap.parse_args()
    peers = anchors(a.anchors)
    rows = [json.loads(l) for l in Path(a.results).read_text().splitlines() if l.strip()]
    pyg = {}
    if a.pyg and Path(a.pyg).exists():
        for l in Path(a.pyg).read_text().splitlines():
            if l.strip():
                r = json.loads(l)
                pyg[graph_name(r["graph"])] = r
    header = rows[0] if "device" in rows[0] else {}
    print(
        f"device: {header.get('device', '?')}, copy bandwidth {header.get('copy_bandwidth_gbps', 0):.0f} GB/s\n"
    )
    print(
        "| graph | nnz | ours: kernel (ms) | ours: call (ms) | build, host CSR (ms) | build, device CSR (ms) "
        "| ours unfused | cuSPARSE fp32 | cuSPARSE fp16 | dense cuBLAS | PyG fp32 | PyG fp16 | SDPA dense | Fused3S on H200 "
        "| speedup | GB/s | rel. error |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios, big, call_ratios = [], [], []
    for r in rows:
        if "graph" not in r:
            continue
        p = peers.get(r["graph"])
        ratio = p["fused3s"] / r["kernel_ms"] if p else None
        if ratio:
            ratios.append(ratio)
            call_ratios.append(p["fused3s"] / r.get("call_ms", r["kernel_ms"]))
            if r["nnz"] >= 200_000:
                big.append(ratio)
        py = pyg.get(r["graph"], {})
        py_cell = lambda k: (
            None
            if f"{k}_ms" not in py
            else (py[f"{k}_ms"], not (py.get(f"{k}_max_rel_error_sampled", 0) <= 1e-2))
        )
        print(
            f"| {r['graph']} | {r['nnz']:,} | {r['kernel_ms']:.4f} | {fmt(r.get('call_ms'))} | {r['build_ms']:.2f} | "
            f"{fmt(r.get('device_build_ms'), 2)} | {cell(base(r, 'ours_unfused'))} | {cell(base(r, 'cusparse_fp32'))} | {cell(base(r, 'cusparse_fp16'))} | "
            f"{cell(base(r, 'dense_cublas'))} | {cell(py_cell('pyg'))} | {cell(py_cell('pyg_fp16'))} | "
            f"{cell(py_cell('sdpa'))} | {p['fused3s'] if p else '—'} | {f'{ratio:.2f}×' if ratio else '—'} | "
            f"{r['compulsory_gbps']:.0f} | {r['max_rel_error']:.1e} |"
        )
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
    wins = sum(x > 1 for x in ratios)
    print(
        f"\nkernel time: faster than Fused3S on {wins} of {len(ratios)} graphs; geometric-mean speedup "
        f"{gm(ratios):.2f}× (all), {gm(big):.2f}× (nnz ≥ 200K, {len(big)} graphs)"
    )
    print(
        f"call time: faster than Fused3S on {sum(x > 1 for x in call_ratios)} of {len(call_ratios)} graphs; "
        f"geometric mean {gm(call_ratios):.2f}×"
    )
    for key in ("ours_unfused", "cusparse_fp32", "cusparse_fp16", "dense_cublas"):
        xs = [base(r, key)[0] / r["kernel_ms"] for r in rows if "graph" in r and base(r, key)]
        if xs:
            print(f"over {key}: geometric mean {gm(xs):.1f}× on {len(xs)} graphs")
    for key in ("pyg", "pyg_fp16", "sdpa"):
        xs = [
            pyg[r["graph"]][f"{key}_ms"] / r["kernel_ms"]
            for r in rows
            if "graph" in r and f"{key}_ms" in pyg.get(r["graph"], {})
        ]
        if xs:
            print(f"over {key}: geometric mean {gm(xs):.1f}× on {len(xs)} graphs")


if __name__ == "__main__":
    main()
