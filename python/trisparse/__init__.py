"""trisparse: fused sparse attention for graphs and block masks, on tensor cores and the CPU.

``trisparse.sparse_attention(q, k, v, pattern)`` on [nodes, heads, channels] tensors, with the
pattern built once per graph (``trisparse.Pattern.of(edge_index)``); ``trisparse.nn`` holds
drop-in replacements for PyG layers. The ops are registered with torch.library (namespace
``trisparse``), so autograd, torch.compile and CUDA graphs see them as any torch op.
"""

import torch  # noqa: F401  (loads the CUDA libraries torch ships, which the extension shares)

from . import _C, distributed
from .attention import sparse_attention
from .block_gate import BlockGate, GateLearner
from .block_pattern import (
    BlockPattern,
    PatternLearner,
    attention_error,
    block_mass,
    block_value_mass,
    dense_attention,
    learn_block_pattern,
    pooled_block_mass,
    prune_blocks,
    prune_blocks_by_output,
)
from .block_sparse import BlockImportance, BlockMask, block_sparse_attention, topk_block_mask
from .edge import edge_scores, edge_softmax, edge_spmm, sddmm
from .edge_attention import edge_attention, edge_gat_attention, neighbor_sum
from .gat import gat_attention
from .pattern import Pattern
from .segment_attention import segment_attention, segment_attention_supported
from .sparse import SparseMatrix, gcn_conv, spmm

__version__ = "0.1.0"


def cuda_available() -> bool:
    """Whether this build has the CUDA backend and a device is visible."""
    return _C.cuda_available()


__all__ = [
    "BlockGate",
    "BlockImportance",
    "BlockMask",
    "BlockPattern",
    "GateLearner",
    "Pattern",
    "PatternLearner",
    "SparseMatrix",
    "__version__",
    "attention_error",
    "block_mass",
    "block_sparse_attention",
    "block_value_mass",
    "cuda_available",
    "dense_attention",
    "distributed",
    "edge_attention",
    "edge_gat_attention",
    "edge_scores",
    "edge_softmax",
    "edge_spmm",
    "gat_attention",
    "gcn_conv",
    "learn_block_pattern",
    "neighbor_sum",
    "pooled_block_mass",
    "prune_blocks",
    "prune_blocks_by_output",
    "sddmm",
    "segment_attention",
    "segment_attention_supported",
    "sparse_attention",
    "spmm",
    "topk_block_mask",
]
