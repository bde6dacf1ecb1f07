"""Drop-in replacements for PyG layers (needs torch_geometric)."""

from .conv import AGNNConv, GCNConv, TransformerConv

__all__ = ["AGNNConv", "GCNConv", "TransformerConv"]
