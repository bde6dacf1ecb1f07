"""Drop-in replacements for PyG layers (needs torch_geometric): the same constructor arguments,
parameters and state_dict as PyG's, with the attention computed by trisparse's kernels; one file
per layer under conv/, as PyG's; ``capture``: training steps as CUDA graphs over padded
mini-batches."""

try:
    import torch_geometric  # noqa: F401  (every layer here subclasses PyG's)
except ImportError as e:  # pragma: no cover - exercised only without PyG
    raise ImportError(
        "trisparse.nn holds drop-in replacements for PyG layers and needs torch_geometric "
        "(pip install torch_geometric)"
    ) from e

from . import capture  # noqa: F401  (trisparse.nn.capture without its own import)
from .conv import AGNNConv, GATConv, GCNConv, GPSConv, TransformerConv

__all__ = ["AGNNConv", "GATConv", "GCNConv", "GPSConv", "TransformerConv"]
