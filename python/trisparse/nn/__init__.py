"""Drop-in replacements for PyG layers (needs torch_geometric)."""

from .conv import TransformerConv

__all__ = ["TransformerConv"]
