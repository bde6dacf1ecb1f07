"""trisparse.nn.AGNNConv: PyG's AGNNConv as fused attention."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import AGNNConv as _PygAGNNConv

from ...attention import sparse_attention
from ._common import _Fused


class AGNNConv(_Fused, _PygAGNNConv):
    """PyG's :class:`torch_geometric.nn.AGNNConv` (same arguments, ``beta`` parameter or buffer,
    outputs), as fused attention: out_i = sum_j softmax_j(beta cos(x_i, x_j)) x_j over i's
    incoming edges (and a self loop per node with ``add_self_loops``), with q = beta x_i / |x_i|,
    k = x_j / |x_j|, v = x_j, so autograd reaches beta through q. Repeated edges count once per
    copy, as in PyG (a log-count bias on the fused scores)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused()

    def forward(self, x: Tensor, edge_index) -> Tensor:
        n = x.size(0)
        pattern = self._patterns.get(edge_index, n, n, add_self_loops=self.add_self_loops)
        x_norm = F.normalize(x, p=2.0, dim=-1)
        q = (self.beta * x_norm).unsqueeze(1)
        out = sparse_attention(
            q,
            x_norm.unsqueeze(1),
            x.unsqueeze(1),
            pattern,
            scale=1.0,
            bias=pattern.log_multiplicity(x.device),
        )
        return out.squeeze(1)
