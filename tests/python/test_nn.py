"""trisparse.nn layers against the PyG layers with the same weights: outputs, and gradients of the
inputs and of every parameter; state_dict both ways; the fallbacks."""

import math
import os
import subprocess
import sys
import warnings
from functools import partial

import pytest
import torch
from conftest import load_shared_graph, random_edge_index

pyg_nn = pytest.importorskip("torch_geometric.nn")
import trisparse.nn


def pair(cls_ours, cls_pyg, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    pyg = cls_pyg(*args, **kwargs)
    ours = cls_ours(*args, **kwargs)
    ours.load_state_dict(pyg.state_dict())
    return ours, pyg


def run(layer, x, edge_index):
    xs = tuple(t.detach().clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)))
    out = layer(xs if isinstance(x, tuple) else xs[0], edge_index)
    g = torch.Generator().manual_seed(99)
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return out.detach(), [t.grad for t in xs], params


def assert_close(ours, pyg, rtol):
    (o, gx, gp), (o2, gx2, gp2) = ours, pyg
    scale = o2.abs().max()
    assert (o - o2).abs().max() <= rtol * scale
    for a, b in zip(gx, gx2):
        assert (a - b).abs().max() <= rtol * b.abs().max().clamp_min(1e-12)
    assert gp.keys() == gp2.keys()
    # Normwise over all parameters: some gradients are zero up to rounding (a key bias shifts
    # every score of a row alike, which the softmax cancels).
    norm = max((float(b.abs().max()) for b in gp2.values()), default=0.0)
    for name in gp:
        assert (gp[name] - gp2[name]).abs().max() <= rtol * norm, name


OPTIONS = {
    "TransformerConv": [
        {"heads": 1},
        {"heads": 4, "concat": True},
        {"heads": 3, "concat": False},
        {"heads": 2, "beta": True},
        {"heads": 2, "concat": False, "beta": True},
        {"heads": 2, "root_weight": False},
        {"heads": 2, "bias": False},
    ],
    "GATConv": [
        {"heads": 1},
        {"heads": 4},
        {"heads": 3, "concat": False},
        {"heads": 2, "add_self_loops": False},
        {"heads": 2, "residual": True},
        {"heads": 2, "bias": False, "negative_slope": 0.1},
    ],
}


@pytest.mark.parametrize(
    "layer, kwargs", [(layer, kw) for layer, options in OPTIONS.items() for kw in options]
)
def test_attention_layers_match_pyg(layer, kwargs):
    n = 120
    ei = random_edge_index(n, n, 7, seed=1, self_loops=True)  # isolated nodes and self loops
    ours, pyg = pair(getattr(trisparse.nn, layer), getattr(pyg_nn, layer), 24, 8, **kwargs)
    x = torch.randn(n, 24)
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=2e-5)


def test_transformer_conv_bipartite():
    n_src, n_dst = 70, 45
    ei = random_edge_index(n_src, n_dst, 6, seed=2)
    ours, pyg = pair(trisparse.nn.TransformerConv, pyg_nn.TransformerConv, (16, 12), 8, heads=2)
    x = (torch.randn(n_src, 16), torch.randn(n_dst, 12))
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=2e-5)


@pytest.mark.parametrize("name", ["cora", "citeseer"])
@pytest.mark.parametrize("layer, channels, heads", [("TransformerConv", 16, 4), ("GATConv", 8, 8)])
def test_attention_layers_on_shared_graphs(name, layer, channels, heads):
    ei, n = load_shared_graph(name)
    ours, pyg = pair(
        getattr(trisparse.nn, layer), getattr(pyg_nn, layer), 32, channels, heads=heads
    )
    x = torch.randn(n, 32)
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=5e-5)


def test_state_dict_both_ways_and_pattern_reuse():
    ours, pyg = pair(trisparse.nn.TransformerConv, pyg_nn.TransformerConv, 8, 4, heads=2, beta=True)
    assert list(ours.state_dict()) == list(pyg.state_dict())
    pyg2 = pyg_nn.TransformerConv(8, 4, heads=2, beta=True)
    pyg2.load_state_dict(ours.state_dict())
    ei = random_edge_index(30, 30, 4, seed=3)
    x = torch.randn(30, 8)
    assert torch.allclose(ours(x, ei), pyg2(x, ei), rtol=1e-5, atol=1e-6)
    # The same edge_index object is not re-planned; a changed one (in place) is.
    p1 = ours._patterns.get(ei, 30, 30)
    assert ours._patterns.get(ei, 30, 30) is p1
    ei[0, 0] = (ei[0, 0] + 1) % 30
    assert ours._patterns.get(ei, 30, 30) is not p1
    # A Pattern may be passed instead of edge_index.
    p = trisparse.Pattern.from_edge_index(ei, num_nodes=30)
    assert torch.allclose(ours(x, p), pyg2(x, ei), rtol=1e-5, atol=1e-6)


def multigraph(num_src, num_dst, seed):
    """edge_index [2, E] with repeated edges (one edge up to three times, in shuffled order),
    self loops and isolated nodes."""
    g = torch.Generator().manual_seed(seed)
    ei = random_edge_index(num_src, num_dst, 5, seed=seed, self_loops=True)
    picks = torch.randint(0, ei.shape[1], (ei.shape[1] // 3,), generator=g)
    ei = torch.cat([ei, ei[:, picks], ei[:, picks[: picks.numel() // 2]]], dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=g)]


def run_full(layer, x, edge_index, edge_attr=None, weights=False, **kwargs):
    """Output, attention weights (if asked), and the gradients of x, edge_attr and every
    parameter for a random upstream gradient."""
    xs = tuple(t.detach().clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)))
    ea = None if edge_attr is None else edge_attr.detach().clone().requires_grad_()
    args = (xs if isinstance(x, tuple) else xs[0], edge_index)
    if ea is not None:
        kwargs["edge_attr"] = ea
    if weights:
        kwargs["return_attention_weights"] = True
    got = layer(*args, **kwargs)
    out, (ei, alpha) = got if weights else (got, (None, None))
    g = torch.Generator().manual_seed(99)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if weights:
        loss = loss + (alpha * torch.randn(alpha.shape, generator=g, dtype=alpha.dtype)).sum()
    loss.backward()
    grads = [t.grad for t in xs] + ([] if ea is None else [ea.grad])
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    extra = [] if not weights else [alpha.detach(), ei]
    return out.detach(), grads, params, extra


def assert_same(ours, pyg, rtol=1e-9):
    """Float64 agreement of run_full's results (the weights' edge_index exactly)."""
    (o, gx, gp, extra), (o2, gx2, gp2, extra2) = ours, pyg
    assert_close((o, gx, gp), (o2, gx2, gp2), rtol)
    if extra2:
        assert torch.equal(extra[1], extra2[1])
        assert (extra[0] - extra2[0]).abs().max() <= rtol * extra2[0].abs().max()


MULTIGRAPH_CASES = [
    ("TransformerConv", {"heads": 2}, False),
    ("TransformerConv", {"heads": 3, "concat": False, "beta": True}, False),
    ("TransformerConv", {"heads": 2, "edge_dim": 5}, False),
    ("TransformerConv", {"heads": 2, "edge_dim": 5, "root_weight": False}, True),
    ("TransformerConv", {"heads": 1}, True),
    ("GATConv", {"heads": 2}, False),
    ("GATConv", {"heads": 3, "concat": False, "add_self_loops": False}, True),
    ("GATConv", {"heads": 2, "edge_dim": 5}, False),
    ("GATConv", {"heads": 2, "edge_dim": 5, "fill_value": 0.5}, True),
    ("GATConv", {"heads": 2, "edge_dim": 5, "fill_value": "add", "residual": True}, True),
    ("GATConv", {"heads": 2, "edge_dim": 5, "fill_value": "max"}, False),
    (
        "GATConv",
        {"heads": 2, "edge_dim": 5, "fill_value": torch.linspace(-1, 1, 5).double()},
        False,
    ),
    ("AGNNConv", {}, False),
]


@pytest.mark.parametrize("layer, kwargs, weights", MULTIGRAPH_CASES)
def test_layers_on_multigraphs_equal_pyg_in_float64(layer, kwargs, weights):
    """Repeated edges (each copy its own softmax term), self loops, isolated nodes, edge features
    and the attention weights: the same outputs and gradients (x, edge_attr, every parameter) as
    PyG's layer in float64, and no fallback (warnings are errors)."""
    n = 50
    ei = multigraph(n, n, seed=21)
    args = (16,) if layer == "AGNNConv" else (16, 6)
    ours, pyg = pair(getattr(trisparse.nn, layer), getattr(pyg_nn, layer), *args, **kwargs)
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 16, dtype=torch.float64)
    ea = torch.randn(ei.shape[1], 5, dtype=torch.float64) if "edge_dim" in kwargs else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_full(ours, x, ei, ea, weights)
    assert_same(got, run_full(pyg, x, ei, ea, weights))


@pytest.mark.parametrize("layer", ["TransformerConv", "GATConv"])
@pytest.mark.parametrize("size", [False, True])
def test_bipartite_multigraphs_equal_pyg_in_float64(layer, size):
    n_src, n_dst = 40, 25
    ei = multigraph(n_src, n_dst, seed=5)
    kwargs = {"heads": 2, "edge_dim": 3}
    if layer == "GATConv":
        kwargs["add_self_loops"] = False  # PyG's GATConv takes no self loops on bipartite graphs
    ours, pyg = pair(getattr(trisparse.nn, layer), getattr(pyg_nn, layer), (8, 6), 4, **kwargs)
    ours, pyg = ours.double(), pyg.double()
    x = (torch.randn(n_src, 8, dtype=torch.float64), torch.randn(n_dst, 6, dtype=torch.float64))
    ea = torch.randn(ei.shape[1], 3, dtype=torch.float64)
    extra = {"size": (n_src, n_dst)} if size and layer == "GATConv" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_full(ours, x, ei, ea, True, **extra)
    assert_same(got, run_full(pyg, x, ei, ea, True, **extra))


@pytest.mark.parametrize("layer", ["TransformerConv", "GATConv"])
def test_dropout_on_multigraphs_drops_each_copy_as_pyg(layer):
    """Attention dropout draws one factor per input edge (copy), in edge_index's order, as PyG."""
    n = 50
    ei = multigraph(n, n, seed=8)
    ours, pyg = pair(
        getattr(trisparse.nn, layer),
        getattr(pyg_nn, layer),
        8,
        4,
        heads=2,
        dropout=0.4,
        edge_dim=3,
    )
    ours.pyg_dropout = True  # (GATConv draws in its kernels by default)
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 8, dtype=torch.float64)
    ea = torch.randn(ei.shape[1], 3, dtype=torch.float64)
    torch.manual_seed(13)
    got = run_full(ours, x, ei, ea)
    torch.manual_seed(13)
    assert_same(got, run_full(pyg, x, ei, ea))


def test_repeated_edges_run_fused_and_match_pyg():
    """Without dropout or edge features, repeats take the fused kernel with a log-count bias (the
    float32 CPU engine here)."""
    n = 60
    ei = multigraph(n, n, seed=4)
    ours, pyg = pair(trisparse.nn.TransformerConv, pyg_nn.TransformerConv, 8, 4, heads=2)
    x = torch.randn(n, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(ours, x, ei)
    assert_close(got, run(pyg, x, ei), rtol=2e-5)


def test_edge_feature_errors_name_the_argument():
    n = 20
    ei = random_edge_index(n, n, 3, seed=2)
    x = torch.randn(n, 8)
    for cls in (trisparse.nn.TransformerConv, trisparse.nn.GATConv):
        layer = cls(8, 4, heads=2, edge_dim=3)
        with pytest.raises(ValueError, match="edge_attr"):
            layer(x, ei, torch.randn(ei.shape[1] + 1, 3))
        with pytest.raises(ValueError, match="edge_attr"):
            layer(x, ei, torch.randn(ei.shape[1], 4))
        with pytest.raises(TypeError, match="edge_attr"):
            layer(x, ei, torch.ones(ei.shape[1], 3, dtype=torch.int64))


@pytest.mark.parametrize("layer", ["TransformerConv", "GATConv"])
def test_attention_dropout_drops_the_edges_pyg_drops(layer):
    """Training with attention dropout and ``pyg_dropout=True``, no fallback: for the same seed
    the layer drops the same edges as PyG's (its draws follow the edge_index order), so outputs
    and gradients agree."""
    n = 60
    ei = random_edge_index(n, n, 6, seed=12)
    ei = ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(3))]
    ours, pyg = pair(
        partial(getattr(trisparse.nn, layer), pyg_dropout=True),
        getattr(pyg_nn, layer),
        8,
        4,
        heads=2,
        dropout=0.5,
    )
    x = torch.randn(n, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        torch.manual_seed(13)
        got = run(ours, x, ei)
    torch.manual_seed(13)
    assert_close(got, run(pyg, x, ei), rtol=2e-5)


def test_gat_conv_draws_its_dropout_in_the_op():
    """GATConv's default attention dropout is drawn in the fused op (no [E, heads] factors):
    the same seed gives the same bits, another seed other drops, and over many seeds the mean
    output is the eval-mode output (the undropped normaliser, kept weights scaled by 1 / (1 -
    p)) within 5 standard errors per element."""
    n = 60
    ei = random_edge_index(n, n, 6, seed=14)
    torch.manual_seed(0)
    layer = trisparse.nn.GATConv(8, 4, heads=2, dropout=0.5)
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        want = layer.eval()(x, ei)
        layer.train()
        outs = []
        for seed in range(300):
            torch.manual_seed(seed)
            outs.append(layer(x, ei))
        torch.manual_seed(0)
        again = layer(x, ei)
    outs = torch.stack(outs).double()
    assert torch.equal(again, outs[0].float())
    assert not torch.equal(outs[0], outs[1])
    mean, err = outs.mean(0), outs.std(0) / math.sqrt(outs.shape[0])
    assert bool(((mean - want.double()).abs() <= 5 * err + 1e-6).all())


def test_bad_graph_inputs():
    layer = trisparse.nn.TransformerConv(8, 4)
    x = torch.randn(10, 8)
    with pytest.raises(ValueError, match="out of range"):
        layer(x, torch.tensor([[0, 12], [1, 2]]))
    with pytest.raises(ValueError, match="q has 10 rows"):
        layer(x, trisparse.Pattern.from_edge_index(torch.tensor([[0, 1], [1, 2]]), num_nodes=5))


@pytest.mark.parametrize("kwargs", [{}, {"requires_grad": False}, {"add_self_loops": False}])
def test_agnn_conv_matches_pyg(kwargs):
    n = 150
    ei = random_edge_index(n, n, 8, seed=5, self_loops=True)  # isolated nodes and self loops
    ours, pyg = pair(trisparse.nn.AGNNConv, pyg_nn.AGNNConv, **kwargs)
    with torch.no_grad():  # beta away from 1, so that its gradient is not special
        ours.beta.fill_(1.7)
        pyg.beta.fill_(1.7)
    x = torch.randn(n, 24)
    x[3] = 0.0  # a zero row: cosine 0 with everything
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=2e-5)
    if kwargs.get("requires_grad", True):
        assert "beta" in dict(ours.named_parameters())


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_agnn_conv_on_shared_graphs(name):
    ei, n = load_shared_graph(name)
    ours, pyg = pair(trisparse.nn.AGNNConv, pyg_nn.AGNNConv)
    x = torch.randn(n, 32)
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=5e-5)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"improved": True}, {"add_self_loops": False}, {"normalize": False}, {"bias": False}],
)
def test_gcn_conv_matches_pyg(kwargs):
    n = 140
    ei = random_edge_index(n, n, 6, seed=6, self_loops=True)
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 20, 12, **kwargs)
    x = torch.randn(n, 20)
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=2e-5)
    w = torch.rand(ei.shape[1]) + 0.5  # edge weights
    a, b = ours(x, ei, w), pyg(x, ei, w)
    assert (a - b).abs().max() <= 2e-5 * b.abs().max()


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_gcn_conv_on_shared_graphs(name):
    ei, n = load_shared_graph(name)
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 32, 16, cached=True)
    x = torch.randn(n, 32)
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=5e-5)
    assert_close(run(ours, x, ei), run(pyg, x, ei), rtol=5e-5)  # from the cache


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"improved": True},
        {"add_self_loops": False},
        {"normalize": False},
        {"bias": False},
        {"flow": "target_to_source"},
    ],
)
def test_gcn_conv_learned_edge_weights_match_pyg(kwargs):
    n = 90
    ei = multigraph(n, n, seed=7)
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 8, 5, **kwargs)
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 8, dtype=torch.float64)
    w = torch.rand(ei.shape[1], dtype=torch.float64) + 0.5

    def step(layer):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = layer(xs, ei, ws)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).double())
        grads = {k: p.grad.clone() for k, p in layer.named_parameters()}
        layer.zero_grad()
        return out.detach(), xs.grad, ws.grad, grads

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        got = step(ours)
    want = step(pyg)
    for a, b in zip(got[:3], want[:3]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert got[3].keys() == want[3].keys()
    for k in got[3]:
        assert torch.allclose(got[3][k], want[3][k], rtol=1e-12, atol=1e-12), k
    again = step(ours)  # the cached pattern; the same bits
    assert all(torch.equal(a, b) for a, b in zip(got[:3], again[:3]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"improved": True},
        {"add_self_loops": False},
        {"normalize": False, "add_self_loops": False},
        {"bias": False},
        {"flow": "target_to_source"},
    ],
)
def test_gcn_conv_over_a_pattern_matches_pyg(kwargs):
    """A Pattern as the graph (the neighbour-sum path, no per-edge values): PyG's layer over the
    same pairs, repeated pairs and repeated self loops included, in float64, outputs and the
    gradients of x and every parameter; and over a from_sorted_csr / undirected() pattern
    against PyG over its edge_index()."""
    n = 60
    ei = multigraph(n, n, seed=12)
    ei = torch.cat([ei, torch.tensor([[4, 4, 4, 9], [4, 4, 4, 9]])], 1)
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 8, 5, **kwargs)
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 8, dtype=torch.float64)
    up = torch.randn(n, 5, generator=torch.Generator().manual_seed(3)).double()

    def step(layer, graph):
        xs = x.clone().requires_grad_()
        out = layer(xs, graph)
        out.backward(up)
        grads = {k: p.grad.clone() for k, p in layer.named_parameters()}
        layer.zero_grad()
        return [out.detach(), xs.grad, *grads.values()]

    pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=n)
    undirected = trisparse.Pattern.from_sorted_csr(pattern.rowptr, pattern.col, n).undirected()
    for graph, pairs in ((pattern, ei), (undirected, undirected.edge_index())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            got = step(ours, graph)
        for a, b in zip(got, step(pyg, pairs), strict=True):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="edge_weight"):
        ours(x, pattern, torch.ones(ei.shape[1], dtype=torch.float64))
    with pytest.raises(ValueError, match="square"):
        ours(x[:-1], pattern)


def test_neighbor_sum_against_index_add_and_its_gradient():
    """trisparse.neighbor_sum over a multigraph (each copy counted), both directions, [N, C] and
    [N, H, C], equals index_add over the pairs; gradcheck; a symmetric pattern's transposed sum
    is its sum."""
    n_src, n_dst = 23, 31
    ei = multigraph(n_src, n_dst, seed=4)
    p = trisparse.Pattern.from_edge_index(ei, size=(n_src, n_dst))
    for shape in ((n_src, 6), (n_src, 3, 4)):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        want = torch.zeros(n_dst, *shape[1:], dtype=torch.float64).index_add(0, ei[1], x[ei[0]])
        assert torch.allclose(trisparse.neighbor_sum(x, p), want, rtol=1e-14, atol=1e-14)
        y = torch.randn(n_dst, *shape[1:], dtype=torch.float64, requires_grad=True)
        want_t = torch.zeros(*shape, dtype=torch.float64).index_add(0, ei[0], y[ei[1]])
        got_t = trisparse.neighbor_sum(y, p, transposed=True)
        assert torch.allclose(got_t, want_t, rtol=1e-14, atol=1e-14)
        assert torch.autograd.gradcheck(lambda t: trisparse.neighbor_sum(t, p), (x,))
        assert torch.autograd.gradcheck(lambda t: trisparse.neighbor_sum(t, p, True), (y,))
    u = trisparse.Pattern.from_edge_index(ei[:, ei[0] < n_src], num_nodes=n_dst)
    u = trisparse.Pattern.from_sorted_csr(u.rowptr, u.col, n_dst).undirected()
    z = torch.randn(n_dst, 5, dtype=torch.float64)
    assert u.symmetric
    assert torch.equal(trisparse.neighbor_sum(z, u, transposed=True), trisparse.neighbor_sum(z, u))
    with pytest.raises(ValueError, match="x must be"):
        trisparse.neighbor_sum(torch.randn(n_dst, 4), p)
    with pytest.raises(TypeError, match="Pattern"):
        trisparse.neighbor_sum(torch.randn(n_src, 4), ei)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
@pytest.mark.parametrize("kwargs", [{}, {"add_self_loops": False}, {"normalize": False}])
def test_gcn_conv_on_a_torch_sparse_adjacency_matches_pyg(layout, kwargs):
    """adj_t as PyG takes it (rows: targets; weights as values), self loops included."""
    n = 70
    ei = random_edge_index(n, n, 5, seed=9, self_loops=True)
    w = torch.rand(ei.shape[1], dtype=torch.float64) + 0.5
    adj = torch.sparse_coo_tensor(ei.flip(0), w, (n, n)).coalesce()
    adj = adj if layout == torch.sparse_coo else adj.to_sparse_csr()
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 6, 4, **kwargs)
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        got = run(ours, x, adj)
    assert_close(got, run(pyg, x, adj), rtol=1e-12)  # the matrix's float64 values


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"improved": True},
        {"add_self_loops": False},
        {"normalize": False},
        {"flow": "target_to_source"},
        {"fuse_relu": True},
    ],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_gcn_conv_matches_pyg_in_float64(kwargs, weighted):
    """On a multigraph with repeated edges, self loops and isolated nodes, in float64: the output
    and the gradients of x and every parameter equal PyG's to float64's precision (the
    propagation matrix keeps gcn_norm's float64 weights; float32 inputs take its float32 ones)."""
    n = 80
    ei = multigraph(n, n, seed=11)
    relu = kwargs.pop("fuse_relu", False)
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 7, 5, **kwargs)
    if relu:
        ours.fuse_relu = True
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 7, dtype=torch.float64)
    w = torch.rand(ei.shape[1], dtype=torch.float64) + 0.5 if weighted else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        got = run_full(_Layer(ours), x, ei, edge_weight=w)
    want = _Layer(pyg, torch.relu if relu else None)  # fuse_relu's reference: PyG's, then ReLU
    assert_same(got, run_full(want, x, ei, edge_weight=w), rtol=1e-12)


def test_gcn_conv_takes_another_graph_on_each_call():
    ours, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 6, 4)
    x = torch.randn(40, 6)
    for seed in (1, 2, 3):  # a new edge_index object each call, of another shape
        ei = random_edge_index(40, 40, 3 + seed, seed=seed)
        assert torch.allclose(ours(x, ei), pyg(x, ei), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="edge_weight must have shape"):
        ours(x, ei, torch.rand(ei.shape[1] + 1, requires_grad=True))
    with pytest.raises(ValueError, match="edge_weight must have shape"):  # fixed weights too
        ours(x, ei, torch.rand(ei.shape[1] + 1))
    bad = ei.clone()
    bad[1, 0] = 40  # a node past x's rows, before gcn_norm indexes with it
    for w in (None, torch.rand(ei.shape[1]), torch.rand(ei.shape[1], requires_grad=True)):
        with pytest.raises(ValueError, match="edge_index: a target"):
            ours(x, bad, w)


def test_spmm_gradients():
    row, col = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([1, 3, 0, 0, 2, 3])
    val = torch.tensor([0.5, -1.0, 2.0, 1.5, 0.25, 3.0])
    m = trisparse.SparseMatrix(row, col, val, 3, 4)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    dense = torch.zeros(3, 4, dtype=torch.float64)
    dense[row, col] = val.double()
    assert torch.allclose(trisparse.spmm(m, b), dense @ b)
    assert torch.autograd.gradcheck(lambda t: trisparse.spmm(m, t), (b,))
    torch.library.opcheck(torch.ops.trisparse.spmm.default, (b.unsqueeze(1), m.id, False))


def dense_gcn(matrix_parts, n, x, weight, bias, relu):
    row, col, val = matrix_parts
    a = torch.zeros(n, n, dtype=torch.float64).index_put_((row, col), val.double(), accumulate=True)
    out = a @ (x.double() @ weight.double().t())
    if bias is not None:
        out = out + bias.double()
    return out.relu() if relu else out


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("order", ["auto", "fused", "unfused"])
@pytest.mark.parametrize("f_in, f_out", [(6, 40), (40, 6), (33, 33)])
def test_gcn_conv_values_and_gradients_on_the_cpu(relu, order, f_in, f_out):
    n = 70
    g = torch.Generator().manual_seed(f_in + f_out)
    row, col = torch.randint(0, n, (400,), generator=g), torch.randint(0, n, (400,), generator=g)
    val = torch.rand(400, generator=g) + 0.1  # repeated entries are summed
    m = trisparse.SparseMatrix(row, col, val, n, n)
    x = torch.randn(n, f_in, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(f_out, f_in, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(f_out, dtype=torch.float64, generator=g, requires_grad=True)
    out = trisparse.gcn_conv(m, x, w, b, relu=relu, order=order)
    want = dense_gcn((row, col, val), n, x, w, b, relu)
    # (repeated entries are summed, then kept in float32)
    assert (out - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.autograd.gradcheck(
        lambda x_, w_, b_: trisparse.gcn_conv(m, x_, w_, b_, relu=relu, order=order), (x, w, b)
    )


def test_gcn_conv_rejects_bad_arguments():
    m = trisparse.SparseMatrix(torch.tensor([0, 1]), torch.tensor([1, 2]), torch.ones(2), 3, 3)
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="x must have shape"):
        trisparse.gcn_conv(m, torch.randn(4, 4), w)
    with pytest.raises(ValueError, match="weight must have shape"):
        trisparse.gcn_conv(m, x, torch.randn(5, 3))
    with pytest.raises(ValueError, match="order"):
        trisparse.gcn_conv(m, x, w, order="fastest")
    rect = trisparse.SparseMatrix(torch.tensor([0]), torch.tensor([1]), torch.ones(1), 2, 3)
    with pytest.raises(ValueError, match="square"):
        trisparse.gcn_conv(rect, x, w)


class _Layer(torch.nn.Module):
    """conv(x, edge_index), then `act`: the ReLU a model applies after PyG's layer."""

    def __init__(self, conv, act=None):
        super().__init__()
        self.conv, self.act = conv, act

    def forward(self, x, ei, **kwargs):
        out = self.conv(x, ei, **kwargs)
        return out if self.act is None else self.act(out)


def test_gcn_conv_with_fused_relu_is_pyg_then_relu():
    n = 120
    ei = random_edge_index(n, n, 5, seed=8)
    _, pyg = pair(trisparse.nn.GCNConv, pyg_nn.GCNConv, 16, 24, seed=3)
    fused = trisparse.nn.GCNConv(16, 24, fuse_relu=True)
    fused.load_state_dict(pyg.state_dict())
    x = torch.randn(n, 16)
    assert_close(run(_Layer(fused), x, ei), run(_Layer(pyg, torch.relu), x, ei), rtol=2e-5)


def test_a_script_using_the_layers_exits_silently(tmp_path):
    """A model alive until exit (its layers' pattern caches hold C++ plans) frees them before the
    extension is torn down: nanobind reports no leak."""
    script = tmp_path / "use_layers.py"
    script.write_text(
        "import torch, trisparse, trisparse.nn\n"
        "ei = torch.randint(0, 50, (2, 300), generator=torch.Generator().manual_seed(1))\n"
        "x = torch.randn(50, 8, requires_grad=True)\n"
        "trisparse.nn.TransformerConv(8, 4, heads=2)(x, ei).sum().backward()\n"
        "gat = trisparse.nn.GATConv(8, 4, heads=2, edge_dim=3)\n"
        "gat(x, ei, torch.randn(300, 3)).sum().backward()\n"
        "pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=50)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "leak" not in done.stderr, done.stderr


def random_batch(num_graphs, seed, max_nodes=40):
    """A PyG-style mini-batch of small graphs: (batch, edge_index) with graphs of 1..max_nodes
    nodes and random directed edges within each."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_nodes + 1, (num_graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(num_graphs), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    edges = []
    for b in range(num_graphs):
        n = int(sizes[b])
        e = torch.randint(0, n, (2, 2 * n), generator=g) + starts[b]
        edges.append(e)
    return batch, torch.cat(edges, dim=1)


@pytest.mark.parametrize(
    "conv, kwargs",
    [
        ("gine", {"heads": 4}),
        ("none", {"heads": 2, "norm": "layer_norm"}),
        ("gine", {"heads": 1, "norm": None, "act": "gelu"}),
    ],
)
def test_gps_conv_equals_pyg_in_float64(conv, kwargs):
    """GPSConv with the global attention packed per graph: the same outputs and gradients (x,
    edge_attr, every parameter) as PyG's GPSConv, which pads to the largest graph."""
    channels = 16
    batch, ei = random_batch(12, seed=3)
    n = batch.numel()

    def local():
        if conv == "none":
            return None
        mlp = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.ReLU())
        return pyg_nn.GINEConv(mlp, edge_dim=3)

    torch.manual_seed(0)
    pyg = pyg_nn.GPSConv(channels, local(), **kwargs).double()
    ours = trisparse.nn.GPSConv(channels, local(), **kwargs).double()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, channels, dtype=torch.float64)
    ea = torch.randn(ei.shape[1], 3, dtype=torch.float64)
    extra = {} if conv == "none" else {"edge_attr": ea}

    def result(layer):
        xs = x.clone().requires_grad_()
        out = layer(xs, ei, batch, **extra)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).double())
        grads = {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
        layer.zero_grad()
        return out.detach(), [xs.grad], grads

    for train in (True, False):  # batch statistics, then the running ones
        ours.train(train)
        pyg.train(train)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = result(ours)
        assert_close(got, result(pyg), rtol=1e-9)


class _BiasedAttention(torch.nn.MultiheadAttention):
    """PyG's GPSConv attention with an additive float attn_mask [B * heads, L, L] (the dense
    reference of GPSConv(edge_bias=True)): ``self.dense`` is set before each call."""

    dense = None

    def forward(self, q, k, v, key_padding_mask=None, need_weights=False):
        padding = torch.zeros(key_padding_mask.shape, dtype=q.dtype).masked_fill(
            key_padding_mask, -math.inf
        )
        return super().forward(
            q, k, v, key_padding_mask=padding, attn_mask=self.dense, need_weights=False
        )


def _dense_edge_bias(scores, ei, batch, heads):
    """[B * heads, L, L]: each graph's edges' scores [E, heads] summed at (target, source)."""
    counts = torch.bincount(batch)
    start = torch.cumsum(counts, 0) - counts
    g = batch[ei[1]]
    dense = scores.new_zeros(counts.numel(), heads, int(counts.max()), int(counts.max()))
    heads_ = torch.arange(heads).expand(ei.shape[1], heads)
    at = (g[:, None].expand_as(heads_), heads_)
    at += (
        (ei[1] - start[g])[:, None].expand_as(heads_),
        (ei[0] - start[g])[:, None].expand_as(heads_),
    )
    dense = dense.index_put(at, scores, accumulate=True)
    return dense.view(-1, dense.shape[-2], dense.shape[-1])


@pytest.mark.parametrize("edge_dim, dropout", [(None, 0.0), (3, 0.0), (3, 0.3)])
def test_gps_conv_edge_bias_equals_dense_attention_with_the_bias(edge_dim, dropout):
    """GPSConv(edge_bias=True): the local edges' bias (a learned scalar per head, or a linear map
    of edge_attr; repeated edges summed) equals PyG's GPSConv whose attention adds the same bias
    as a dense float mask, in float64: outputs and the gradients of x, edge_attr and every
    parameter, the bias's included; bitwise the same on a second run."""
    channels, heads = 16, 4
    batch, ei = random_batch(10, seed=5)
    ei = torch.cat([ei, ei[:, :7], ei[:, :3]], dim=1)  # pairs with two and three edges
    n = batch.numel()
    mlp = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.ReLU())
    torch.manual_seed(0)
    pyg = pyg_nn.GPSConv(channels, pyg_nn.GINEConv(mlp, edge_dim=3), heads=heads).double()
    ours = trisparse.nn.GPSConv(
        channels,
        pyg_nn.GINEConv(mlp, edge_dim=3),
        heads=heads,
        edge_bias=True,
        edge_dim=edge_dim,
    ).double()
    biased = _BiasedAttention(channels, heads, batch_first=True).double()
    biased.load_state_dict(pyg.attn.state_dict())
    pyg.attn = biased
    with torch.no_grad():  # a bias away from its zero start
        for p in [ours.edge_bias] if edge_dim is None else ours.lin_edge_bias.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    missing = ours.load_state_dict(pyg.state_dict(), strict=False).missing_keys
    assert sorted(missing) == (
        ["edge_bias"] if edge_dim is None else ["lin_edge_bias.bias", "lin_edge_bias.weight"]
    )
    ref_bias = ours.edge_bias if edge_dim is None else ours.lin_edge_bias
    x = torch.randn(n, channels, dtype=torch.float64)
    ea = torch.randn(ei.shape[1], 3, dtype=torch.float64)
    dout = torch.randn(n, channels, generator=torch.Generator().manual_seed(1)).double()

    def result(layer):
        xs, eas = x.clone().requires_grad_(), ea.clone().requires_grad_()
        if layer is pyg:  # the same scores from ours' bias parameters
            scores = ref_bias.expand(ei.shape[1], heads) if edge_dim is None else ref_bias(eas)
            biased.dense = _dense_edge_bias(scores, ei, batch, heads)
        torch.manual_seed(7)  # the same dropout draws for the layers' own dropout
        out = layer(xs, ei, batch, edge_attr=eas)
        out.backward(dout)
        grads = {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
        for k, p in ours.named_parameters():
            if "edge_bias" in k:
                grads[k] = p.grad.clone()
        layer.zero_grad()
        ours.zero_grad()
        return out.detach(), [xs.grad, eas.grad], grads

    ours.dropout = pyg.dropout = dropout
    for train in (True, False):
        ours.train(train)
        pyg.train(train)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = result(ours)
        want = result(pyg)
        assert_close(got, want, rtol=1e-9)
        running = {k: b.clone() for k, b in ours.named_buffers()}
        again = result(ours)
        for k, b in ours.named_buffers():  # the norms' running statistics as PyG's layer's
            b.copy_(running[k])
        assert all(torch.equal(a, b) for a, b in zip(again[1], got[1]))
        assert all(torch.equal(again[2][k], got[2][k]) for k in got[2])


def test_gps_conv_edge_bias_with_attention_dropout():
    """GPSConv(edge_bias=True) with attention dropout: the weights dropped per pair and head
    (torch's generator: the same bits for the same seed), the bias learning through them; in
    evaluation the layer equals the one without dropout."""
    batch, ei = random_batch(6, seed=2)
    x = torch.randn(batch.numel(), 8, dtype=torch.float64)
    torch.manual_seed(0)
    layer = trisparse.nn.GPSConv(8, None, heads=2, edge_bias=True, attn_kwargs={"dropout": 0.5})
    plain = trisparse.nn.GPSConv(8, None, heads=2, edge_bias=True)
    layer, plain = layer.double(), plain.double()

    def step(seed):
        torch.manual_seed(seed)
        out = layer(x, ei, batch)
        (grad,) = torch.autograd.grad(out.square().sum(), layer.edge_bias)
        return out.detach(), grad

    (a, ga), (b, gb), (c, _) = step(1), step(1), step(2)
    assert torch.equal(a, b) and torch.equal(ga, gb) and not torch.equal(a, c)
    assert ga.abs().min() > 0
    plain.load_state_dict(layer.state_dict())  # the norms' running statistics too
    layer.eval(), plain.eval()
    torch.testing.assert_close(layer(x, ei, batch), plain(x, ei, batch), rtol=0, atol=0)


def _edge_lookup(lists, rows, edges, by_key):
    """The segment kernels' cursor walk over the edges' lists, in Python: for each stationary row
    (query, or key with by_key) and the streamed rows in rising order, the pair's edges (the
    kernels sum their biases and write each one's gradient)."""
    ptr0 = rows + 1 + 2 * edges if by_key else 0
    ptr = lists[ptr0 : ptr0 + rows + 1].tolist()
    other = lists[ptr0 + rows + 1 : ptr0 + rows + 1 + edges].tolist()
    ids = lists[ptr0 + rows + 1 + edges : ptr0 + rows + 1 + 2 * edges].tolist()
    found = {}
    for r in range(rows):
        cur, end = ptr[r], ptr[r + 1]
        at = other[cur] if cur < end else math.inf
        for col in range(rows):  # a thread sees a rising subset; all of them here
            while at < col:
                cur += 1
                at = other[cur] if cur < end else math.inf
            run = []
            while at == col:
                run.append(ids[cur])
                cur += 1
                at = other[cur] if cur < end else math.inf
            if run:
                found[(col, r) if by_key else (r, col)] = run
    return found


def test_segment_edge_lists_find_each_pairs_edges():
    """The lists the segment kernels read an edge bias from (trisparse.segment_attention's
    `_edge_lists`, made by torch ops on every device): walked as the kernels walk them (by
    query for the forward and dq, by key for dk/dv), each (query, key) pair finds exactly its
    edges j -> i, copies in edge order; the edges' bias summed per pair equals the dense
    per-graph bias; the dense form (the path without the kernels) too, with its gradient."""
    from trisparse.segment_attention import _dense_edge_bias as dense_form
    from trisparse.segment_attention import _edge_lists

    batch, ei = random_batch(5, seed=5, max_nodes=12)
    ei = torch.cat([ei, ei[:, :7]], dim=1)  # repeated edges
    n, e = batch.numel(), ei.shape[1]
    lists = _edge_lists(ei, n)
    assert lists.dtype == torch.int32 and lists.numel() == 2 * (n + 1) + 4 * e
    want = {}
    for k in range(e):
        want.setdefault((int(ei[1, k]), int(ei[0, k])), []).append(k)
    assert _edge_lookup(lists, n, e, by_key=False) == want
    assert _edge_lookup(lists, n, e, by_key=True) == want
    big, m = _edge_lists(ei, 50_000), 50_001  # 64-bit sort keys: the same lists, longer offsets
    assert torch.equal(big[: n + 1], lists[: n + 1]) and bool((big[n + 1 : m] == e).all())
    assert torch.equal(big[m : m + 2 * e], lists[n + 1 : n + 1 + 2 * e])
    k0 = n + 1 + 2 * e
    assert torch.equal(big[m + 2 * e : m + 2 * e + n + 1], lists[k0 : k0 + n + 1])
    assert torch.equal(big[-2 * e :], lists[-2 * e :])
    heads = 2
    scores = torch.randn(e, heads, dtype=torch.float64, requires_grad=True)
    counts = torch.bincount(batch)
    start = torch.cumsum(counts, 0) - counts
    pair = dense_form(ei, scores, batch, n)  # [n, heads, longest]
    dense = _dense_edge_bias(scores, ei, batch, heads).view(5, heads, *(2 * [int(counts.max())]))
    local = torch.arange(n) - start[batch]
    torch.testing.assert_close(pair, dense[batch, :, local, :], rtol=0, atol=1e-12)
    r = torch.randn(pair.shape, dtype=torch.float64)
    got = torch.autograd.grad((pair * r).sum(), scores)[0]
    for (i, j), ks in want.items():  # each edge's gradient: its pair's place
        for k in ks:
            torch.testing.assert_close(got[k], r[i, :, j - start[batch[i]]], rtol=0, atol=0)
    cross = torch.tensor([[0, n - 1], [1, 0]])  # the second joins two graphs: no pair
    two = dense_form(cross, torch.ones(2, 1), batch, n)
    assert two.sum() == 1 and two[1, 0, 0] == 1


def test_gps_conv_edge_bias_checks_edges(monkeypatch):
    """GPSConv(edge_bias=True) names edges joining two graphs and ids out of range; max_num_nodes
    (once the pair bias's size, now unused) is still checked to be a positive int; under capture,
    heads the segment kernels do not take are a RuntimeError naming what is needed."""
    batch, ei = random_batch(6, seed=5)
    n = batch.numel()
    layer = trisparse.nn.GPSConv(8, None, heads=2, edge_bias=True, edge_dim=3)
    with pytest.raises(ValueError, match="max_num_nodes must be a positive int"):
        trisparse.nn.GPSConv(8, None, heads=2, edge_bias=True, max_num_nodes=0)
    cross = torch.tensor([[0, n - 1], [1, 0]])  # the second joins two graphs
    with pytest.raises(ValueError, match=r"edge 1 \(.* joins nodes of graphs 5 and 0"):
        layer._batches.check_local(cross, batch)
    with pytest.raises(ValueError, match=r"outside \[0, .*edge 0"):
        layer._batches.check_local(torch.tensor([[n], [0]]), batch)
    from trisparse.nn.conv import gps_conv

    monkeypatch.setattr(gps_conv, "_capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="under CUDA graph capture needs float16/bfloat16"):
        layer(torch.randn(n, 8), ei, batch, edge_attr=torch.randn(ei.shape[1], 3))


def test_gps_conv_edge_bias_names_bad_arguments():
    batch, ei = random_batch(3, seed=1)
    x = torch.randn(batch.numel(), 8)
    with pytest.raises(ValueError, match="edge_dim: the edge features feed edge_bias"):
        trisparse.nn.GPSConv(8, None, heads=2, edge_dim=3)
    layer = trisparse.nn.GPSConv(8, None, heads=2, edge_bias=True, edge_dim=3)
    with pytest.raises(ValueError, match=r"edge_attr: .* \[E, edge_dim\]"):
        layer(x, ei, batch)
    with pytest.raises(ValueError, match=r"edge_attr: .*got \(5, 3\)"):
        layer(x, ei, batch, edge_attr=torch.randn(5, 3))
    layer = trisparse.nn.GPSConv(8, None, heads=2, edge_bias=True)
    cross = torch.tensor([[0, int(batch.numel()) - 1], [1, 0]])  # the second joins two graphs
    with pytest.raises(ValueError, match="edge_index: edge 1 .* one graph"):
        layer(x, cross, batch)
    performer = trisparse.nn.GPSConv(8, None, heads=2, attn_type="performer", edge_bias=True)
    with pytest.raises(ValueError, match="edge_bias: attn_type='performer'"):
        performer(x, ei, batch)


def test_pattern_entries_of_finds_each_edge():
    ei = random_edge_index(50, 50, 8, seed=4)
    pattern = trisparse.Pattern.from_edge_index(ei, 50)
    rows, cols = pattern.entries(torch.device("cpu"))
    got = pattern.entries_of(ei)
    assert torch.equal(rows[got], ei[1]) and torch.equal(cols[got], ei[0])
    assert torch.equal(got, pattern.entries_of_input(torch.device("cpu")))
    with pytest.raises(ValueError, match=r"edge_index: edge 0 \(0 -> 50\) is not an entry"):
        pattern.entries_of(torch.tensor([[0], [50]]))


def test_gps_conv_batch_errors_name_the_argument():
    layer = trisparse.nn.GPSConv(8, None, heads=2)
    x = torch.randn(5, 8)
    ei = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="batch must be sorted"):
        layer(x, ei, torch.tensor([0, 1, 0, 1, 1]))
    with pytest.raises(ValueError, match="batch has 4 entries"):
        layer(x, ei, torch.tensor([0, 0, 1, 1]))


def _gps_batch(num_graphs, seed, channels=16, edge_dim=3):
    """A PyG Batch of random small graphs with float features, edge features and one graph label."""
    from torch_geometric.data import Batch, Data

    batch, ei = random_batch(num_graphs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    graphs = []
    for b in range(num_graphs):
        nodes = (batch == b).nonzero().squeeze(1)
        keep = (batch[ei[0]] == b).nonzero().squeeze(1)
        graphs.append(
            Data(
                x=torch.randn(nodes.numel(), channels, generator=g, dtype=torch.float64),
                edge_index=ei[:, keep] - nodes[0],
                edge_attr=torch.randn(keep.numel(), edge_dim, generator=g, dtype=torch.float64),
                y=torch.randn(1, 2, generator=g, dtype=torch.float64),
            )
        )
    return Batch.from_data_list(graphs)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_gps_conv_on_a_padded_batch_equals_the_batch(momentum):
    """GPSConv (GINE local MPNN, BatchNorm) on a batch padded by pad_batch, with its node_mask:
    the real nodes' outputs, every parameter's gradient and BatchNorm's running statistics equal
    the unpadded batch's in float64 (the padded nodes reach no real node, not even through the
    norms' statistics); without the mask the statistics differ (the test can fail)."""
    from torch_geometric.nn import global_add_pool
    from trisparse.nn.capture import bucket, pad_batch

    channels = 16
    data = _gps_batch(9, seed=5, channels=channels)
    nodes, edges = bucket(data.num_nodes), bucket(data.edge_index.size(1))
    padded = pad_batch(data, nodes, edges, data.num_graphs + 8, segment=8)

    def layer():
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.ReLU())
        conv = pyg_nn.GINEConv(mlp, edge_dim=3)
        norm = {"momentum": momentum}
        return trisparse.nn.GPSConv(channels, conv, heads=2, norm_kwargs=norm).double()

    def run(d, mask):
        m = layer()
        x = d.x.clone().requires_grad_()
        out = m(x, d.edge_index, d.batch, edge_attr=d.edge_attr, node_mask=mask)
        pooled = global_add_pool(out, d.batch, size=d.num_graphs)[: data.num_graphs]
        (pooled * torch.arange(1.0, channels + 1, dtype=torch.float64)).square().sum().backward()
        grads = {k: p.grad for k, p in m.named_parameters()}
        stats = [b.double() for b in m.buffers()]  # running means, variances, batch counts
        return (out[: data.num_nodes].detach(), [x.grad[: data.num_nodes]], grads), stats

    want, want_stats = run(data, None)
    got, got_stats = run(padded, padded.node_mask)
    assert_close(got, want, rtol=1e-9)
    for a, b in zip(got_stats, want_stats, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=0)
    m = layer()
    out = m(padded.x, padded.edge_index, padded.batch, edge_attr=padded.edge_attr,
            node_mask=padded.node_mask)  # fmt: skip
    assert not out[data.num_nodes :].any()
    unmasked, _ = run(padded, None)
    assert not torch.allclose(unmasked[0], want[0], rtol=1e-3)


def test_pad_batch_and_bucket():
    from trisparse.nn.capture import bucket, pad_batch

    for n in [0, 1, 63, 64, 1000, 4097, 123457]:
        b = bucket(n)
        assert b > n and b % 64 == 0
        if n >= 1024:
            assert (b - n - 1) / (n + 1) < 1 / 8
    assert len({bucket(n) for n in range(4096, 8192)}) <= 9
    data = _gps_batch(5, seed=2)
    data.y = data.y.float()
    p = pad_batch(data, data.num_nodes + 20, data.edge_index.size(1) + 7, 10, segment=8)
    n, e = data.num_nodes, data.edge_index.size(1)
    assert p.x.shape == (n + 20, 16) and not p.x[n:].any() and torch.equal(p.x[:n], data.x)
    assert torch.equal(p.batch, torch.cat([data.batch, torch.tensor([5] * 8 + [6] * 8 + [7] * 4)]))
    assert torch.equal(p.edge_index[:, :e], data.edge_index)
    loops = p.edge_index[:, e:]
    assert torch.equal(loops[0], loops[1]) and torch.equal(loops[0], n + torch.arange(7))
    assert p.edge_attr.shape == (e + 7, 3) and not p.edge_attr[e:].any()
    assert p.y.shape == (10, 2) and p.y[5:].isnan().all() and torch.equal(p.y[:5], data.y)
    assert p.node_mask.sum() == n and p.node_mask[:n].all() and p.num_graphs == 10
    with pytest.raises(ValueError, match="padded nodes need 3 graphs"):
        pad_batch(data, n + 20, e, 7, segment=8)
    with pytest.raises(ValueError, match="padded edges need a padded node"):
        pad_batch(data, n, e + 1, 5)


def test_captured_step_needs_a_capturable_optimizer():
    from trisparse.nn.capture import CapturedStep

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="capturable=True"):
        CapturedStep(lambda x: x, model, torch.optim.Adam(model.parameters()))


def test_segment_attention_on_the_cpu_and_its_errors():
    """segment_attention off CUDA (the fused attention over the batch's pattern) against float64
    dense attention per graph, with gradients; bad batches named."""
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([3, 1, 7, 4])
    batch = torch.repeat_interleave(torch.tensor([0, 2, 3, 5]), sizes)  # ids with gaps
    q, k, v = (
        torch.randn(15, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    out = trisparse.segment_attention(q, k, v, batch, scale=0.4)
    want = []
    for a, b in ((0, 3), (3, 4), (4, 11), (11, 15)):
        w = torch.softmax(0.4 * torch.einsum("ihd,jhd->hij", q[a:b], k[a:b]), -1)
        want.append(torch.einsum("hij,jhd->ihd", w, v[a:b]))
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *t: trisparse.segment_attention(*t, batch, scale=0.4), (q, k, v)
    )
    with pytest.raises(ValueError, match="batch must be sorted"):
        trisparse.segment_attention(q, k, v, batch.flip(0))
    with pytest.raises(ValueError, match="batch has 14 entries"):
        trisparse.segment_attention(q, k, v, batch[1:])
    with pytest.raises(TypeError, match="int64 or int32"):
        trisparse.segment_attention(q, k, v, batch.double())
    with pytest.raises(ValueError, match="one shape"):
        trisparse.segment_attention(q, k[:, :1], v, batch)


@pytest.mark.parametrize("shared", [False, True])
def test_segment_attention_pair_bias_on_the_cpu_and_its_errors(shared):
    """segment_attention with a score bias per pair off CUDA (the fused attention over the
    batch's pattern with the bias at its entries) against float64 dense attention per graph with
    the bias; gradcheck in q, k, v and the bias; bad biases named."""
    g = torch.Generator().manual_seed(4)
    sizes = torch.tensor([3, 1, 7, 4])
    batch = torch.repeat_interleave(torch.tensor([0, 2, 3, 5]), sizes)
    q, k, v = (
        torch.randn(15, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    bias = torch.randn(15, 1 if shared else 2, 9, generator=g, dtype=torch.float64)
    bias.requires_grad_()
    out = trisparse.segment_attention(q, k, v, batch, scale=0.4, bias=bias)
    want = []
    for a, b in ((0, 3), (3, 4), (4, 11), (11, 15)):
        s = 0.4 * torch.einsum("ihd,jhd->hij", q[a:b], k[a:b])
        w = torch.softmax(s + bias[a:b, :, : b - a].transpose(0, 1), -1)
        want.append(torch.einsum("hij,jhd->ihd", w, v[a:b]))
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *t: trisparse.segment_attention(*t[:3], batch, scale=0.4, bias=t[3]),
        (q, k, v, bias),
    )
    with pytest.raises(ValueError, match="longest segment 7"):
        trisparse.segment_attention(q, k, v, batch, bias=bias[:, :, :6])
    with pytest.raises(ValueError, match="bias must be"):
        trisparse.segment_attention(q, k, v, batch, bias=bias[1:])
    with pytest.raises(TypeError, match="float tensor"):
        trisparse.segment_attention(q, k, v, batch, bias=bias.long())


@pytest.mark.parametrize("shared", [False, True])
def test_segment_attention_edge_bias_on_the_cpu_and_its_errors(shared):
    """segment_attention with a score bias per edge off CUDA against float64 dense attention per
    graph with each pair's edges summed (repeated edges, self loops, an edge between two
    segments, which joins no pair); gradcheck in q, k, v and the edges' bias; bad arguments
    named."""
    g = torch.Generator().manual_seed(6)
    sizes = torch.tensor([3, 1, 7, 4])
    batch = torch.repeat_interleave(torch.tensor([0, 2, 3, 5]), sizes)
    starts = (0, 3, 4, 11)
    ei = torch.cat(
        [torch.randint(0, int(m), (2, 2 * int(m)), generator=g) + a for a, m in zip(starts, sizes)]
        + [torch.tensor([[0, 5, 5], [12, 5, 5]])],  # a cross edge, a self loop twice
        dim=1,
    )
    q, k, v = (
        torch.randn(15, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    eb = torch.randn(ei.shape[1], 1 if shared else 2, generator=g, dtype=torch.float64)
    eb.requires_grad_()
    out = trisparse.segment_attention(q, k, v, batch, scale=0.4, edge_index=ei, edge_bias=eb)
    pair = torch.zeros(15, 15, eb.shape[1], dtype=torch.float64)
    local = batch[ei[0]] == batch[ei[1]]
    pair = pair.index_put((ei[1, local], ei[0, local]), eb[local], accumulate=True)
    pair = pair.permute(2, 0, 1)  # [H or 1, query, key]
    want = []
    for a, b in zip(starts, (3, 4, 11, 15)):
        s = 0.4 * torch.einsum("ihd,jhd->hij", q[a:b], k[a:b]) + pair[:, a:b, a:b]
        want.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v[a:b]))
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-12, atol=1e-12)
    call = partial(trisparse.segment_attention, batch=batch, scale=0.4, edge_index=ei)
    assert torch.autograd.gradcheck(lambda *t: call(*t[:3], edge_bias=t[3]), (q, k, v, eb))
    with pytest.raises(ValueError, match="edge_bias must be"):
        trisparse.segment_attention(q, k, v, batch, edge_index=ei, edge_bias=eb[1:])
    with pytest.raises(TypeError, match="edge_bias must be a float tensor"):
        trisparse.segment_attention(q, k, v, batch, edge_index=ei, edge_bias=eb.long())
    with pytest.raises(ValueError, match="edge_index must be"):
        trisparse.segment_attention(q, k, v, batch, edge_index=ei[0], edge_bias=eb)
    with pytest.raises(ValueError, match=r"outside \[0, 15\)"):
        trisparse.segment_attention(q, k, v, batch, edge_index=ei + 1, edge_bias=eb)
    with pytest.raises(ValueError, match="come together"):
        trisparse.segment_attention(q, k, v, batch, edge_index=ei)
    with pytest.raises(ValueError, match="give one score bias"):
        trisparse.segment_attention(
            q, k, v, batch, bias=torch.zeros(15, 2, 7), edge_index=ei, edge_bias=eb
        )


@pytest.mark.parametrize("layer", ["TransformerConv", "GATConv"])
def test_edge_features_without_repeats_equal_pyg_in_float64(layer):
    """A graph without repeated edges (each entry one edge: the per-copy reductions reduce to a
    permutation): edge features and attention weights as PyG's, no fallback."""
    n = 50
    ei = random_edge_index(n, n, 6, seed=9, self_loops=True)
    ei = ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(2))]
    ours, pyg = pair(
        getattr(trisparse.nn, layer), getattr(pyg_nn, layer), 16, 6, heads=2, edge_dim=4
    )
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n, 16, dtype=torch.float64)
    ea = torch.randn(ei.shape[1], 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_full(ours, x, ei, ea, True)
    assert_same(got, run_full(pyg, x, ei, ea, True))


def test_exphormer_pattern_and_a_transformer_over_it():
    """Pattern.exphormer: the graph's edges, a symmetric expander of the asked degree, virtual
    nodes attending and attended by every node, self loops, reproducible by seed; a
    TransformerConv over it equals PyG's over its edge_index()."""
    n, virtual = 60, 2
    ei = random_edge_index(n, n, 4, seed=17)
    p = trisparse.Pattern.exphormer(ei, n, expander_degree=4, virtual_nodes=virtual, seed=3)
    assert p.num_rows == p.num_cols == n + virtual and p.duplicates == 0
    dense = torch.zeros(n + virtual, n + virtual, dtype=torch.bool)
    row, col = p.entries(torch.device("cpu"))
    dense[row, col] = True
    assert dense[ei[1], ei[0]].all()  # targets attend their sources
    assert dense.diagonal().all()
    assert dense[n:, :n].all() and dense[:n, n:].all()  # virtual rows and columns are full
    # The expander alone (no graph edges): both directions of each edge, degree <= 4.
    bare = trisparse.Pattern.exphormer(
        torch.zeros(2, 0, dtype=torch.int64), n, expander_degree=4, virtual_nodes=0
    )
    expander = torch.zeros(n, n, dtype=torch.bool)
    r, c = bare.entries(torch.device("cpu"))
    expander[r, c] = True
    expander.fill_diagonal_(False)
    assert torch.equal(expander, expander.t()) and 0 < int(expander.sum(1).max()) <= 4
    again = trisparse.Pattern.exphormer(ei, n, expander_degree=4, virtual_nodes=virtual, seed=3)
    assert torch.equal(again.col, p.col) and torch.equal(again.rowptr, p.rowptr)
    ours, pyg = pair(
        trisparse.nn.TransformerConv, pyg_nn.TransformerConv, 8, 4, heads=2, dropout=0.3
    )
    ours, pyg = ours.double(), pyg.double()
    x = torch.randn(n + virtual, 8, dtype=torch.float64)
    for train in (False, True):  # with attention dropout: drawn in entry order, as PyG's
        ours.train(train)
        pyg.train(train)
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run_full(ours, x, p)
        torch.manual_seed(5)
        assert_same(got, run_full(pyg, x, p.edge_index()))


@pytest.mark.parametrize(
    "layer, kwargs, edge_dim",
    [
        ("TransformerConv", {"heads": 2}, 0),
        ("TransformerConv", {"heads": 2, "edge_dim": 3}, 3),
        ("GATConv", {"heads": 2}, 0),
        ("GATConv", {"heads": 2, "edge_dim": 3}, 3),
        ("AGNNConv", {}, 0),
        ("GCNConv", {}, 0),
    ],
)
def test_torch_compile_fullgraph_with_edge_index(layer, kwargs, edge_dim):
    """A model that passes edge_index (and edge features) to a trisparse.nn layer compiles with
    fullgraph=True (the pattern is built from the real edge_index while tracing) and matches eager
    in the output and every gradient."""
    torch.compiler.reset()
    n = 40
    ei = multigraph(n, n, seed=30)
    args = (8,) if layer == "AGNNConv" else (8, 4)
    torch.manual_seed(0)
    conv = getattr(trisparse.nn, layer)(*args, **kwargs)
    x = torch.randn(n, 8)
    ea = torch.randn(ei.shape[1], edge_dim) if edge_dim else None

    def model(x, ei, ea):
        out = conv(x, ei, ea) if ea is not None else conv(x, ei)
        return out.relu()

    def result(fn):
        xs = x.clone().requires_grad_()
        out = fn(xs, ei, ea)
        out.backward(torch.ones_like(out))
        grads = [xs.grad] + [p.grad.clone() for p in conv.parameters() if p.grad is not None]
        conv.zero_grad()
        return [out.detach(), *grads]

    want = result(model)
    got = result(torch.compile(model, fullgraph=True))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    torch.compiler.reset()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_torch_compile_fullgraph_gat_on_a_plain_graph(dropout):
    """GATConv over a graph without repeated edges (its fused plain-graph op) compiles with
    fullgraph=True in training mode, its attention dropout drawn in the op from a state the graph
    draws (inductor's fallback_random: torch's generator, as eager), and matches eager in the
    output and every gradient."""
    import torch._inductor.config as inductor_config

    torch.compiler.reset()
    n = 40
    ei = random_edge_index(n, n, 5, seed=31)
    torch.manual_seed(0)
    conv = trisparse.nn.GATConv(8, 4, heads=2, dropout=dropout).train()
    x = torch.randn(n, 8)

    def model(x, ei):
        return conv(x, ei).relu()

    def result(fn):
        xs = x.clone().requires_grad_()
        torch.manual_seed(7)
        out = fn(xs, ei)
        out.backward(torch.ones_like(out))
        grads = [xs.grad] + [p.grad.clone() for p in conv.parameters() if p.grad is not None]
        conv.zero_grad()
        return [out.detach(), *grads]

    with inductor_config.patch(fallback_random=True):
        want = result(model)
        got = result(torch.compile(model, fullgraph=True))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    torch.compiler.reset()


@pytest.mark.parametrize("edge_bias", [False, True])
def test_torch_compile_fullgraph_gps(edge_bias):
    """GPSConv compiled whole (with edge_bias: the edges' entries found in the traced graph): the
    output and every parameter's gradient as eager (normwise: BatchNorm leaves some near 0)."""
    torch.compiler.reset()
    batch, ei = random_batch(6, seed=4)
    torch.manual_seed(0)
    dim = 3 if edge_bias else None
    layer = trisparse.nn.GPSConv(16, None, heads=2, edge_bias=edge_bias, edge_dim=dim).eval()
    x = torch.randn(batch.numel(), 16)
    ea = torch.randn(ei.shape[1], 3)

    def run(fn):
        out = fn(x, ei, batch, edge_attr=ea)
        grads = torch.autograd.grad(out.square().sum(), list(layer.parameters()), allow_unused=True)
        return [out] + [g for g in grads if g is not None]

    want = run(layer)
    got = run(torch.compile(layer, fullgraph=True))
    assert len(got) == len(want) > 8
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1.0)
    torch.compiler.reset()


def test_gat_projection_with_node_terms_equals_pygs_products():
    """GATConv's projection and node terms as one GEMM (its CUDA path, called here on the CPU):
    lin(x) and PyG's (lin(x) * att).sum(-1) in float64, and the same gradients of x, lin's
    weight and att."""
    torch.manual_seed(4)
    layer = trisparse.nn.GATConv(7, 5, heads=3).double()
    x = torch.randn(30, 7, dtype=torch.float64)

    def run(fused):
        xs = x.clone().requires_grad_()
        if fused:
            proj, (src, dst) = layer._project_with_terms(xs)
        else:
            proj = layer.lin(xs).view(-1, 3, 5)
            src, dst = (proj * layer.att_src).sum(-1), (proj * layer.att_dst).sum(-1)
        loss = proj.square().sum() + (src * dst).sum() + src.sum()
        params = [layer.lin.weight, layer.att_src, layer.att_dst]
        grads = torch.autograd.grad(loss, [xs, *params])
        return [proj.detach(), src.detach(), dst.detach(), *grads]

    for got, want in zip(run(True), run(False)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_gat_bias_add_gradcheck_and_autocast_types():
    """GATConv's bias add on CUDA (its autograd Function called here on the CPU): gradcheck in
    float64, and 16-bit out with a float32 bias gives a float32 output, out's gradient in out's
    type and the bias's in float32."""
    from trisparse.nn.conv.gat_conv import _BiasAdd

    gen = torch.Generator().manual_seed(6)
    out = torch.randn(20, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_BiasAdd.apply, [out, bias])
    half = out.detach().bfloat16().requires_grad_()
    b32 = bias.detach().float().requires_grad_()
    y = _BiasAdd.apply(half, b32)
    y.square().sum().backward()
    assert y.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    assert b32.grad.dtype == torch.float32
    assert torch.allclose(b32.grad, (2 * y.detach()).sum((0, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_autocast_linear_equals_autocast_bitwise(with_bias):
    """TransformerConv's projection under CUDA autocast (its autograd Function called here on
    the CPU, in bf16): the output bitwise F.linear's under autocast (which saves x's 16-bit copy
    where the Function saves x); the gradients of x, the weight and the bias float32 sums of the
    16-bit operands' products (within float32 rounding of float64 ones), where autocast's are
    rounded to bf16."""
    from trisparse.nn.conv._common import _AutocastLinear

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(300, 24, generator=gen)
    w = torch.randn(40, 24, generator=gen)
    b = torch.randn(40, generator=gen) if with_bias else None
    g = torch.randn(300, 40, generator=gen).bfloat16()

    def grads(run):
        leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
        xs, ws = leaves[0], leaves[1]
        bs = leaves[2] if with_bias else None
        out = run(xs, ws, bs)
        out.backward(g)
        return [out.detach()] + [t.grad for t in leaves]

    def autocast(xs, ws, bs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.linear(xs, ws, bs)

    got = grads(lambda xs, ws, bs: _AutocastLinear.apply(xs, ws, bs, torch.bfloat16))
    want = grads(autocast)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert torch.equal(got[0], want[0])
    g64, x16, w16 = g.double(), x.bfloat16().double(), w.bfloat16().double()
    exact = [g64 @ w16, g64.t() @ x16, g64.sum(0)][: len(got) - 1]  # dx, dw, db
    for ours, theirs, e in zip(got[1:], want[1:], exact, strict=True):
        err_ours = float((ours.double() - e).abs().max() / e.abs().max())
        err_theirs = float((theirs.double() - e).abs().max() / e.abs().max())
        assert err_ours < 1e-5 <= err_theirs, (err_ours, err_theirs)


def test_gat_edge_product_gradcheck_with_chunks(monkeypatch):
    """GATConv's float32 CUDA product of edge features with their [edge_dim, heads] weight (its
    autograd Function called here on the CPU, with chunks of 8 rows): rows the chunks do not
    divide, equal to the matmul and gradcheck in float64."""
    from trisparse.nn.conv import gat_conv

    monkeypatch.setattr(gat_conv, "_CHUNK_ROWS", 8)
    gen = torch.Generator().manual_seed(8)
    for rows in (3, 37, 64):
        a = torch.randn(rows, 5, generator=gen, dtype=torch.float64, requires_grad=True)
        w = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.allclose(gat_conv._EdgeProduct.apply(a, w), a @ w, rtol=0, atol=1e-12)
        assert torch.autograd.gradcheck(gat_conv._EdgeProduct.apply, [a, w])


def test_head_product_gradcheck_on_strided_views(monkeypatch):
    """The per-head product with a weight per head (TransformerConv's edge-feature products in
    float32 on CUDA; its autograd Function called here on the CPU, with 4 interleaved chunks):
    on a strided view as the projection's split gives it, rows the chunks do not divide, equal
    to the block-diagonal GEMM and gradcheck in float64."""
    from trisparse.nn.conv import _common

    monkeypatch.setattr(_common, "_HEAD_CHUNKS", 4)
    gen = torch.Generator().manual_seed(9)
    for rows in (3, 13, 16):
        y = torch.randn(rows, 3 * 2 * 5, generator=gen, dtype=torch.float64)
        x = y[:, 10:20].view(rows, 2, 5).requires_grad_()  # a strided view, like a split
        w = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        block = _common._block_diagonal(w.transpose(1, 2))
        want = torch.nn.functional.linear(x.reshape(rows, -1), block).view(rows, 2, 4)
        got = _common._HeadProduct.apply(x, w)
        assert got.shape == (rows, 2, 4)
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
        assert torch.autograd.gradcheck(_common._HeadProduct.apply, [x, w])


def test_head_product_ops_on_the_cpu_equal_float64():
    """trisparse's per-head product and its weight gradient (`_C.head_product`, `_C.head_outer`:
    the CPU's float64 loops, rounded once), on strided float32 views: x[n, h] @ w[h] and
    sum_n x[n, h]^T g[n, h] as float64 einsums give them."""
    from trisparse import _C, _tensors

    gen = torch.Generator().manual_seed(10)
    for rows, heads, a, b in ((7, 3, 5, 4), (1, 1, 1, 1), (2100, 2, 16, 16)):
        y = torch.randn(rows, heads * (a + 2), generator=gen)
        x = y.view(rows, heads, a + 2)[:, :, 1 : a + 1]  # strided rows and heads
        w = torch.randn(heads, a, b, generator=gen)
        g = torch.randn(rows, heads, b, generator=gen)
        out = torch.full((rows, heads, b), float("nan"))
        _C.head_product(_tensors.view(x), _tensors.view(w), _tensors.view(out), 0)
        want = torch.einsum("nha,hab->nhb", x.double(), w.double())
        assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)
        dw = torch.full((heads, a, b), float("nan"))
        _C.head_outer(_tensors.view(x), _tensors.view(g), _tensors.view(dw), 0, 0, 0)
        want_dw = torch.einsum("nha,nhb->hab", x.double(), g.double())
        assert torch.allclose(dw.double(), want_dw, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        x64 = torch.zeros(2, 1, 3, dtype=torch.float64)
        w64 = torch.zeros(1, 3, 2, dtype=torch.float64)
        _C.head_product(
            _tensors.view(x64), _tensors.view(w64), _tensors.view(torch.zeros(2, 1, 2)), 0
        )


def test_gat_incoming_sum_equals_a_scatter_and_gradcheck():
    """The sum and mean over each node's incoming kept edges (GATConv's self-loop fill on CUDA,
    its autograd Function called here on the CPU): PyG's scatter over the kept edges in float64,
    zero where no kept edge comes in, and gradcheck."""
    from torch_geometric.utils import scatter
    from trisparse.nn.conv.gat_conv import _IncomingLines, _IncomingSum

    gen = torch.Generator().manual_seed(5)
    n, e = 12, 50
    targets = torch.randint(2, n, (e,), generator=gen)  # nodes 0 and 1: nothing comes in
    kept = torch.sort(torch.randperm(e, generator=gen)[:40]).values
    values = torch.randn(e, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    lines = _IncomingLines(targets, kept, n, e)
    for reduce in ("sum", "mean"):
        got = _IncomingSum.apply(values, lines, reduce == "mean")
        want = scatter(values[kept], targets[kept], 0, n, reduce=reduce)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(got[:2], torch.zeros(2, 3, dtype=torch.float64))
        assert torch.autograd.gradcheck(
            lambda v, m=reduce == "mean": _IncomingSum.apply(v, lines, m), [values]
        )


def test_layers_deepcopy_after_a_forward():
    """copy.deepcopy of layers that have run (their pattern caches hold plans, which are not
    copyable): the copies run and give the same outputs."""
    import copy

    batch, ei = random_batch(6, seed=4)
    x = torch.randn(batch.numel(), 16)
    layers = [
        (trisparse.nn.TransformerConv(16, 8, heads=2), lambda m: m(x, ei)),
        (trisparse.nn.GATConv(16, 8, heads=2), lambda m: m(x, ei)),
        (trisparse.nn.GPSConv(16, None, heads=2).eval(), lambda m: m(x, ei, batch)),
    ]
    for layer, call in layers:
        want = call(layer)
        twin = copy.deepcopy(layer)
        assert torch.equal(call(twin), want)


def test_packed_graphs_collate_as_pyg():
    """PackedGraphs.batch gives PyG's Batch.from_data_list fields for any subset and order of the
    graphs; batches() covers every graph once."""
    from torch_geometric.data import Batch
    from trisparse.nn.capture import PackedGraphs

    data = _gps_batch(7, seed=8)
    graphs = data.to_data_list()
    packed = PackedGraphs(graphs)
    for ids in ([3, 0, 6], [5], list(range(7))):
        got = packed.batch(torch.tensor(ids))
        want = Batch.from_data_list([graphs[i] for i in ids])
        for key in ("x", "edge_index", "edge_attr", "batch", "y"):
            assert torch.equal(getattr(got, key), getattr(want, key)), key
        assert got.num_graphs == len(ids)
    seen = torch.cat([b.y for b in packed.batches(3, shuffle=True, generator=torch.Generator())])
    assert sorted(seen[:, 0].tolist()) == sorted(data.y[:, 0].tolist())


def test_gps_conv_under_capture_names_what_it_needs(monkeypatch):
    """GPSConv's global attention while a CUDA graph is being captured (faked here) on heads the
    segment kernels do not take: a RuntimeError naming the dtype and channels, not a capture
    failure deep in a host synchronisation."""
    from trisparse.nn.conv import gps_conv

    monkeypatch.setattr(gps_conv, "_capturing", lambda t: True)
    layer = trisparse.nn.GPSConv(8, None, heads=2)
    with pytest.raises(RuntimeError, match="float16/bfloat16 heads.*torch.float32, 4 channels"):
        layer(torch.randn(5, 8), torch.tensor([[0, 1], [1, 2]]), torch.tensor([0, 0, 1, 1, 1]))


@pytest.mark.parametrize("padded", [False, True])
def test_gps_conv_recompute_equals_keeping_the_activations(padded):
    """GPSConv(recompute=True) (torch.utils.checkpoint inside the layer) in float64 with dropout
    on the layer and on the attention: the outputs, every gradient and the norms' running
    averages (updated once, not again by the recomputation) equal the plain layer's; it keeps
    fewer tensors for the backward."""
    from trisparse.nn.capture import bucket, pad_batch

    channels = 16
    data = _gps_batch(9, seed=6, channels=channels)
    if padded:
        data = pad_batch(data, bucket(data.num_nodes), bucket(data.edge_index.size(1)), 64, 8)
    mask = data.node_mask if padded else None

    def run(recompute):
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.ReLU())
        m = trisparse.nn.GPSConv(
            channels,
            pyg_nn.GINEConv(mlp, edge_dim=3),
            heads=2,
            dropout=0.2,
            attn_kwargs={"dropout": 0.3},
            recompute=recompute,
        ).double()
        x = data.x.clone().requires_grad_()
        ea = data.edge_attr.clone().requires_grad_()
        saved = []
        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = m(x, data.edge_index, data.batch, edge_attr=ea, node_mask=mask)
        out.square().sum().backward()
        grads = {k: p.grad for k, p in m.named_parameters()}
        return (out.detach(), [x.grad, ea.grad], grads), list(m.buffers()), len(saved)

    (want, want_stats, kept), (got, got_stats, kept_recompute) = run(False), run(True)
    assert_close(got, want, rtol=1e-12)
    for a, b in zip(got_stats, want_stats, strict=True):
        assert torch.equal(a, b)
    assert kept_recompute < kept / 4
