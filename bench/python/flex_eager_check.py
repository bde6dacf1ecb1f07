#!/usr/bin/env python3
"""Does flex_attention honour a BlockMask given as block lists when called without torch.compile?
Builds a random block mask (as bench/python/block_sparse.py does), runs flex_attention eagerly and
compiled on the CPU, and prints each output's relative error against float64 block-sparse
attention and its distance from dense attention. (With torch 2.15 the eager call returned dense
attention: docs/notes/block_sparse.md.)
    bench/python/flex_eager_check.py
"""

import os
import sys
import warnings

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import block_sparse


def main():
    warnings.filterwarnings("ignore")
    n, g, heads, d, scale = 256, 32, 2, 16, 0.25
    rng = np.random.default_rng(1)
    q, k, v = (torch.rand(1, heads, n, d) * 2 - 1 for _ in range(3))
    compiled = torch.compile(flex_attention)
    for causal in (False, True):
        blocks = (rng.random((heads, n // g, n // g)) > 0.5).astype(np.uint8)
        for h in range(heads):
            np.fill_diagonal(blocks[h], 1)
            if causal:
                blocks[h] = np.tril(blocks[h])
        bm = block_sparse.block_mask_from(blocks, n, g, "cpu", causal)
        scores = (q @ k.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        dense = torch.softmax(scores, -1) @ v
        for name, fn in (("eager", flex_attention), ("compiled", compiled)):
            try:
                out = fn(q, k, v, block_mask=bm, scale=scale)
            except Exception as e:  # noqa: BLE001 - e.g. an inductor build failure on the CPU
                print(
                    f"torch {torch.__version__} causal={causal} {name}: failed: {str(e).splitlines()[0][:120]}"
                )
                continue
            err = block_sparse.check_rows(q, k, v, out, blocks, g, scale, causal, samples=64)
            print(
                f"torch {torch.__version__} causal={causal} {name}: relative error {err:.3g} against "
                f"block-sparse float64, max |out - dense attention| {(out - dense).abs().max().item():.3g}"
            )


if __name__ == "__main__":
    main()
