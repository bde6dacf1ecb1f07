"""Drop-in replacements for PyG layers (needs torch_geometric)."""

from .conv import AGNNConv, TransformerConv

__all__ = ["AGNNConv", "TransformerConv"]
