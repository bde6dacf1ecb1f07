#!/usr/bin/env python3
"""PNGs of the block-sparse sweep (bench_block_sparse + bench/python/block_sparse.py), like the
blocked-sparse report's Figure 2: speedup against the sparsity p, one line per (N, G), the ideal
1/(1-p) drawn; the median over seeds where a point has several. Panels: the fused kernel over
dense SDPA (PyTorch's default backend) and over flex_attention with the same mask; where the
results hold the report's three kernels (bench_block_sparse --unfused), their pipeline over dense
SDPA and each kernel's time at G = 64.
    bench/plot_block_sparse.py RESULTS.jsonl [MORE.jsonl ...] OUT.png
A later file's rows replace an earlier file's at the same N.
"""

import argparse
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from table_block_sparse import load


def medians(rows, key):
    """{(n, g): [(p, median of key over seeds)]} for the rows that have key."""
    by = {}
    for r in rows:
        if key in r:
            by.setdefault((r["n"], r["g"]), {}).setdefault(r["p"], []).append(r[key])
    return {ng: sorted((p, statistics.median(v)) for p, v in ps.items()) for ng, ps in by.items()}


def speedup_panel(ax, rows, key, title, bound):
    lines = medians(rows, key)
    ax.set_prop_cycle(color=[plt.cm.tab20(i % 20) for i in range(len(lines))])
    for (n, g), pts in sorted(lines.items()):
        ax.plot(
            [p for p, _ in pts],
            [s for _, s in pts],
            marker="o",
            ms=3,
            label=f"N={n // 1024}K G={g}",
        )
    if bound:
        ps = sorted({r["p"] for r in rows})
        ax.plot(ps, [1 / (1 - p) for p in ps], "k--", label="1/(1-p)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("sparsity p (fraction of blocks dropped)")
    ax.set_ylabel("speedup (x)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=6, ncol=3)


def stage_panel(ax, rows, g):
    styles = {"unfused_sddmm_ms": "-", "unfused_softmax_ms": ":", "unfused_spmm_ms": "--"}
    ns = sorted({r["n"] for r in rows if r["g"] == g and "unfused_sddmm_ms" in r})
    for i, n in enumerate(ns):
        for key, style in styles.items():
            pts = medians([r for r in rows if r["g"] == g], key).get((n, g), [])
            ax.plot(
                [p for p, _ in pts],
                [t for _, t in pts],
                style,
                marker="o",
                ms=3,
                color=plt.cm.tab10(i % 10),
                label=f"N={n // 1024}K {key.split('_')[1]}",
            )
    ax.set_yscale("log")
    ax.set_xlabel("sparsity p (fraction of blocks dropped)")
    ax.set_ylabel("kernel time (ms)")
    ax.set_title(f"the three kernels' times at G = {g} (SDDMM -, softmax :, SpMM --)", fontsize=10)
    ax.legend(fontsize=6, ncol=3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("out")
    a = ap.parse_args()
    rows = [r for r in load(a.results) if "ms" in r]
    unfused = any("unfused_ms" in r for r in rows)
    fig, axes = plt.subplots(
        2 if unfused else 1, 2, figsize=(14, 10 if unfused else 5), squeeze=False
    )
    speedup_panel(
        axes[0][0],
        rows,
        "speedup_vs_sdpa_default",
        "fused kernel over dense SDPA (default backend)",
        True,
    )
    speedup_panel(
        axes[0][1],
        rows,
        "speedup_vs_flex",
        "fused kernel over flex_attention, same BlockMask",
        False,
    )
    if unfused:
        for r in rows:
            if "unfused_ms" in r and "sdpa_default_ms" in r:
                r["unfused_vs_sdpa"] = r["sdpa_default_ms"] / r["unfused_ms"]
        speedup_panel(
            axes[1][0],
            rows,
            "unfused_vs_sdpa",
            "the report's three kernels (SDDMM, softmax, SpMM) over dense SDPA",
            True,
        )
        stage_panel(axes[1][1], rows, 64)
    r0 = rows[0]
    causal = ", causal" if all(r.get("causal", False) for r in rows) else ""
    fig.suptitle(
        f"trisparse block-sparse attention, {r0['gpu']}, heads {r0['heads']}, D {r0['dim']}, "
        f"{r0['dtype']}{causal}"
    )
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
