"""Drop-in replacements for PyG layers (needs torch_geometric)."""

from .conv import AGNNConv, GATConv, GCNConv, TransformerConv

__all__ = ["AGNNConv", "GATConv", "GCNConv", "TransformerConv"]
