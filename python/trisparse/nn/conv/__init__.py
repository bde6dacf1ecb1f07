"""The convolution layers, one file per layer as in PyG's torch_geometric.nn.conv."""

from .agnn_conv import AGNNConv
from .gat_conv import GATConv
from .gcn_conv import GCNConv
from .gps_conv import GPSConv
from .transformer_conv import TransformerConv

__all__ = ["AGNNConv", "GATConv", "GCNConv", "GPSConv", "TransformerConv"]
