#!/usr/bin/env python3
"""PNGs of the block-sparse sweep (bench_block_sparse + bench/python/block_sparse.py), like the
blocked-sparse report's Figure 2: speedup against the sparsity p, one line per (N, G), the ideal
1/(1-p) drawn. One panel over dense SDPA (PyTorch's default backend), one over flex_attention
with the same mask.
    bench/plot_block_sparse.py RESULTS.jsonl OUT.png
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("out")
    a = ap.parse_args()
    rows = [json.loads(l) for l in Path(a.results).read_text().splitlines() if l.strip()]
    rows = [r for r in rows if "ms" in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, title in ((axes[0], "speedup_vs_sdpa_default", "over dense SDPA (default backend)"),
                           (axes[1], "speedup_vs_flex", "over flex_attention, same BlockMask")):
        lines = sorted({(r["n"], r["g"]) for r in rows if key in r})
        ax.set_prop_cycle(color=[plt.cm.tab20(i % 20) for i in range(len(lines))])
        for n, g in lines:
            pts = sorted((r["p"], r[key]) for r in rows if r["n"] == n and r["g"] == g and key in r)
            ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o",
                    label=f"N={n // 1024}K G={g}")
        if key == "speedup_vs_sdpa_default":
            ps = sorted({r["p"] for r in rows})
            ax.plot(ps, [1 / (1 - p) for p in ps], "k--", label="1/(1-p)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("sparsity p (fraction of blocks dropped)")
        ax.set_ylabel("speedup (x)")
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=2)
    r0 = rows[0]
    fig.suptitle(f"trisparse block-sparse attention, {r0['gpu']}, heads {r0['heads']}, D {r0['dim']}, "
                 f"{r0['dtype']}")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
