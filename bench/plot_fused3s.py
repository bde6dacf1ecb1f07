#!/usr/bin/env python3
"""PNG of the fused 3S benchmark: per graph, our kernel's speedup over the Fused3S H200 time
(../shared/anchors) and over the in-project baselines of the same run, graphs by nnz.
    bench/plot_fused3s.py RESULTS.jsonl PYG.jsonl OUT.png [--anchors README]
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_anchors import anchors, graph_name


def main():
    here = Path(__file__).resolve()
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("pyg")
    ap.add_argument("out")
    ap.add_argument("--anchors", default=here.parents[2] / "shared/anchors/README.md")
    a = ap.parse_args()
    peers = anchors(a.anchors)
    rows = sorted(
        (json.loads(l) for l in Path(a.results).read_text().splitlines() if '"graph"' in l),
        key=lambda r: r["nnz"],
    )
    pyg = {graph_name(r["graph"]): r for r in map(json.loads, Path(a.pyg).read_text().splitlines())}
    series = {
        "Fused3S kernel (anchors, H200)": lambda r: peers.get(r["graph"], {}).get("fused3s"),
        "cuSPARSE fp16 pipeline": lambda r: (
            r.get("baselines", {}).get("cusparse_fp16", {}).get("ms")
        ),
        "cuSPARSE fp32 pipeline": lambda r: (
            r.get("baselines", {}).get("cusparse_fp32", {}).get("ms")
        ),
        "PyG TransformerConv fp32": lambda r: pyg.get(r["graph"], {}).get("pyg_ms"),
        "dense SDPA with mask": lambda r: pyg.get(r["graph"], {}).get("sdpa_ms"),
    }
    fig, ax = plt.subplots(figsize=(16, 6))
    x = range(len(rows))
    for label, get in series.items():
        pts = [(i, get(r) / r["kernel_ms"]) for i, r in zip(x, rows) if get(r)]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "o-" if "Fused3S" in label else ".",
            label=label,
            linewidth=1 if "Fused3S" in label else 0,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["graph"] for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("speedup of trisparse fused 3S (x, log scale)")
    ax.set_title("trisparse fused 3S on an H200, D = 128, H = 1, fp16 in, fp32 out; graphs by nnz")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
