#!/usr/bin/env python3
"""Independently recompute `trisparse run --save DIR` output with NumPy in float64.

O[i] = sum_j softmax_j(scale * Q[i] . K[j], j in row i of the pattern) V[j]; empty rows give 0.
Exit 0 when the saved O agrees within the tolerance for its dtype, 1 otherwise.
"""

import json
import sys
from pathlib import Path

import numpy as np


def main(directory: str) -> int:
    d = Path(directory)
    meta = json.loads((d / "meta.json").read_text())
    row_ptr, col_idx = np.load(d / "row_ptr.npy"), np.load(d / "col_idx.npy")
    q, k, v, o = (np.load(d / f"{n}.npy").astype(np.float64) for n in "qkvo")
    scale = meta["scale"]
    ref = np.zeros_like(o)
    for i in range(meta["rows"]):
        cols = col_idx[row_ptr[i] : row_ptr[i + 1]]
        if cols.size == 0:
            continue
        s = scale * np.einsum("hd,nhd->nh", q[i], k[cols])  # [neighbours, heads]
        p = np.exp(s - s.max(axis=0))
        p /= p.sum(axis=0)
        ref[i] = np.einsum("nh,nhd->hd", p, v[cols])
    err = np.abs(o - ref).max() / max(np.abs(ref).max(), 1e-300)
    # The GPU rounds P to the input type before P.V; both round the output: a few units of each.
    u = {"f16": 2.0**-11, "bf16": 2.0**-8, "f32": 2.0**-24, "f64": 0.0}
    tol = 1e-5 + 4 * (u[meta["dtype"]] + u[meta["out_dtype"]])
    ok = bool(np.isfinite(o).all()) and err <= tol
    print(
        f"independent NumPy check of {d}: max relative error {err:.3g} (tolerance {tol}): {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
