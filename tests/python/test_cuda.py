"""On CUDA: TransformerConv and GATConv in float32 against PyG's on the GPU (the row-wise float32
attention and its backward; GAT's fused attention), a PyG model with its layers swapped against
the same model in float64, GAT's attention in every dtype against the float64 CPU op, a training
step captured in a CUDA graph, torch.compile of a model on the GPU. Every test here carries the
`gpu` marker and skips without a GPU."""

import copy
import itertools
import math

import pytest
import torch
import trisparse
from conftest import (
    block_dropout_reference,
    edge_attention_oracle,
    edge_dropout_draws,
    hub_multigraph,
    load_shared_graph,
    philox_factors,
    random_edge_index,
    shared_graph_names,
)

pyg_nn = pytest.importorskip("torch_geometric.nn")
import trisparse.nn
from trisparse.edge_attention import edge_attention_supported

pytestmark = pytest.mark.gpu


def relerr(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run(layer, x, edge_index):
    x = x.detach().clone().requires_grad_()
    out = layer(x, edge_index)
    g = torch.Generator(device=x.device).manual_seed(99)
    # Drawn in float32 whatever out's dtype, so that a float64 run gets the same gradient.
    out.backward(torch.randn(out.shape, generator=g, device=x.device).to(out.dtype))
    params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return out.detach(), x.grad, params


# (layer, channels, heads, tolerance): the attention in float32 (TransformerConv's row-wise
# float32 kernel, GATConv's fused attention).
LAYERS = [("TransformerConv", 16, 4, 1e-4), ("GATConv", 8, 8, 1e-4)]


@pytest.mark.parametrize("name", ["random", "cora", "citeseer"])
@pytest.mark.parametrize("layer, channels, heads, tol", LAYERS)
def test_attention_layers_in_float32_match_pyg_on_cuda(name, layer, channels, heads, tol):
    if name == "random":
        n = 300
        ei = random_edge_index(n, n, 9, seed=5, self_loops=True)  # isolated nodes, self loops
    else:
        ei, n = load_shared_graph(name)
    torch.manual_seed(0)
    pyg = getattr(pyg_nn, layer)(32, channels, heads=heads).cuda()
    ours = getattr(trisparse.nn, layer)(32, channels, heads=heads).cuda()
    ours.load_state_dict(pyg.state_dict())
    x, ei = torch.randn(n, 32, device="cuda"), ei.cuda()
    (o, gx, gp), (o2, gx2, gp2) = run(ours, x, ei), run(pyg, x, ei)
    assert o.dtype == torch.float32 and o.is_cuda
    assert relerr(o, o2) <= tol and relerr(gx, gx2) <= tol
    assert gp.keys() == gp2.keys()
    norm = max(float(b.abs().max()) for b in gp2.values())
    for key in gp2:
        assert (gp[key] - gp2[key]).abs().max() <= tol * norm, key
    assert torch.equal(run(ours, x, ei)[1], gx)  # deterministic gradients


def _shuffled_multigraph(n: int, seed: int, repeats: bool):
    """edge_index [2, E] of n nodes (8 edges a node, self loops, isolated nodes), with a quarter
    of its edges repeated where `repeats`, in shuffled order; and the generator (seeded `seed`)
    for the test's other inputs."""
    g = torch.Generator().manual_seed(seed)
    ei = random_edge_index(n, n, 8, seed=seed + 1, self_loops=True)
    if repeats:
        picks = torch.randint(0, ei.shape[1], (ei.shape[1] // 4,), generator=g)
        ei = torch.cat([ei, ei[:, picks]], dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=g)], g


@pytest.mark.parametrize(
    "layer, channels, kwargs, repeats",
    [
        ("TransformerConv", 16, {"heads": 4, "edge_dim": 6}, True),
        ("TransformerConv", 128, {"heads": 2}, False),
        ("GATConv", 16, {"heads": 4, "edge_dim": 6}, True),
        ("GATConv", 8, {"heads": 8}, False),
    ],
)
def test_attention_weights_match_pyg_on_cuda(layer, channels, kwargs, repeats):
    """return_attention_weights on CUDA (float32; GATConv: the fused attention, then each input
    edge's weight from the forward's lse; TransformerConv: the per-edge path) against PyG's layer
    on CUDA: the weights, the output and the gradients of x, edge_attr and every parameter for a
    loss that reaches the weights too; the same bits on a second run; no fallback."""
    import warnings

    n = 300
    ei, g = _shuffled_multigraph(n, 61, repeats)
    ei = ei.cuda()
    torch.manual_seed(0)
    pyg = getattr(pyg_nn, layer)(24, channels, **kwargs).cuda()
    ours = getattr(trisparse.nn, layer)(24, channels, **kwargs).cuda()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, 24, generator=g).cuda()
    ea = torch.randn(ei.shape[1], 6, generator=g).cuda() if "edge_dim" in kwargs else None

    def result(model):
        xs = x.clone().requires_grad_()
        extra = {} if ea is None else {"edge_attr": ea.clone().requires_grad_()}
        out, (edges, alpha) = model(xs, ei, **extra, return_attention_weights=True)
        w = torch.Generator(device="cuda").manual_seed(5)
        loss = (out * torch.randn(out.shape, generator=w, device="cuda")).sum()
        loss = loss + (alpha * torch.randn(alpha.shape, generator=w, device="cuda")).sum()
        loss.backward()
        res = [out.detach(), alpha.detach(), xs.grad] + ([extra["edge_attr"].grad] if extra else [])
        res += [p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None]
        model.zero_grad()
        return edges, res

    # torch warns once when a backward thread first meets cuBLAS: not ours, let it pass first.
    torch.ones(2, 2, device="cuda", requires_grad=True).matmul(
        torch.ones(2, 2, device="cuda")
    ).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        edges, got = result(ours)
        again = result(ours)[1]
    want_edges, want = result(pyg)
    assert torch.equal(edges, want_edges)
    inputs = 4 if ea is not None else 3  # out, alpha, x's (and edge_attr's) gradients
    norm = max(float(b.abs().max()) for b in want[inputs:])
    for i, (a, b, c) in enumerate(zip(got, again, want, strict=True)):
        assert torch.equal(a, b), i
        if i < inputs:
            assert relerr(a, c) <= 1e-3, i
        else:  # parameters normwise (a key bias's gradient is 0 up to rounding)
            assert (a - c).abs().max() <= 1e-3 * norm, i


class _GraphTransformer(torch.nn.Module):
    """Two PyG TransformerConv layers (4 heads x 16 concatenated, then 2 heads x 8 averaged),
    joined by a GELU: a ReLU's kink flips wherever a pre-activation lies within rounding of zero,
    and among the 10^5-10^7 activations of the larger graphs a float32 run flips one against
    float64 (deezer_egos, snap_ca_grqc: x.grad 2e-2 off for PyG's float32 model and ours alike)."""

    def __init__(self):
        super().__init__()
        self.conv1 = pyg_nn.TransformerConv(32, 16, heads=4)
        self.conv2 = pyg_nn.TransformerConv(64, 8, heads=2, concat=False, beta=True)

    def forward(self, x, edge_index):
        return self.conv2(torch.nn.functional.gelu(self.conv1(x, edge_index)), edge_index)


def _swapped(model):
    """A copy of the model with each PyG TransformerConv replaced by trisparse.nn's, with the
    same constructor arguments and state_dict."""
    model = copy.deepcopy(model)
    for name, conv in list(model.named_children()):
        ours = trisparse.nn.TransformerConv(
            conv.in_channels,
            conv.out_channels,
            heads=conv.heads,
            concat=conv.concat,
            beta=conv.beta,
        ).to(next(conv.parameters()).device)
        ours.load_state_dict(conv.state_dict())
        setattr(model, name, ours)
    return model


@pytest.mark.parametrize("name", shared_graph_names())
def test_a_pyg_transformer_model_with_swapped_layers_matches_on_every_shared_graph(name):
    ei, n = load_shared_graph(name)
    torch.manual_seed(0)
    pyg = _GraphTransformer().cuda()
    ours = _swapped(pyg)
    x, ei = torch.randn(n, 32, device="cuda"), ei.cuda()
    # The reference is PyG's model in float64: its float32 run sums with atomics (so it may move
    # between runs), and is reported beside ours.
    o64, gx64, gp64 = run(copy.deepcopy(pyg).double(), x.double(), ei)
    (o, gx, gp), (o2, gx2, _) = run(ours, x, ei), run(pyg, x, ei)
    pyg_err = (
        f"PyG's float32: out {relerr(o2.double(), o64):.1e}, "
        f"x.grad {relerr(gx2.double(), gx64):.1e}"
    )
    assert relerr(o.double(), o64) <= 1e-4, pyg_err
    assert relerr(gx.double(), gx64) <= 1e-4, pyg_err
    assert gp.keys() == gp64.keys()
    norm = max(float(b.abs().max()) for b in gp64.values())
    for key in gp64:
        assert (gp[key].double() - gp64[key]).abs().max() <= 1e-4 * norm, (key, pyg_err)
    assert torch.equal(run(ours, x, ei)[1], gx)  # deterministic gradients


@pytest.mark.parametrize("layer", ["TransformerConv", "GATConv"])
def test_attention_dropout_gradients_repeat_bit_for_bit_on_cuda(layer):
    ei, n = load_shared_graph("cora")
    torch.manual_seed(1)
    conv = getattr(trisparse.nn, layer)(32, 8, heads=4, dropout=0.3).cuda().train()
    x, ei = torch.randn(n, 32, device="cuda"), ei.cuda()

    def step():
        torch.manual_seed(2)  # the same dropout draws
        return run(conv, x, ei)

    (o, gx, gp), (o2, gx2, gp2) = step(), step()
    assert torch.equal(o, o2) and torch.equal(gx, gx2)
    for key in gp:
        assert torch.equal(gp[key], gp2[key]), key


@pytest.mark.parametrize(
    "dtype, heads, c",
    [
        (torch.float32, 8, 8),
        (torch.float16, 8, 8),
        (torch.bfloat16, 1, 64),
        (torch.float32, 3, 100),
        (torch.float16, 2, 512),
    ],
)
@pytest.mark.parametrize("dropout", [False, True])
def test_gat_attention_matches_the_float64_cpu_op_on_cuda(dtype, heads, c, dropout):
    ei = random_edge_index(500, 400, 9, seed=11)  # empty rows and columns
    p = trisparse.Pattern.from_edge_index(ei, size=(500, 400))
    g = torch.Generator().manual_seed(12)
    x = torch.randn(500, heads, c, generator=g)
    src, dst = 2 * torch.randn(500, heads, generator=g), 2 * torch.randn(400, heads, generator=g)
    keep = (torch.rand(p.nnz, heads, generator=g) > 0.3).float() / 0.7 if dropout else None
    dout = torch.randn(400, heads, c, generator=g)

    def grads(x, src, dst, keep, dout):
        x, src, dst = (t.detach().clone().requires_grad_() for t in (x, src, dst))
        out = trisparse.gat_attention(x, src, dst, p, 0.2, keep)
        return (out, *torch.autograd.grad(out, (x, src, dst), dout.to(out.dtype)))

    want = grads(x.double(), src.double(), dst.double(), keep, dout.double())
    dev = [None if t is None else t.cuda() for t in (x.to(dtype), src, dst, keep, dout)]
    got = grads(*dev)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b, what in zip(got, want, ("out", "dx", "da_src", "da_dst")):
        assert relerr(a.double().cpu(), b) <= tol, what
    again = grads(*dev)
    for a, b in zip(got, again):
        assert torch.equal(a, b)  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, c", [(8, 16), (3, 100), (40, 4), (2, 512)])
def test_gat_attention_draws_its_dropout_as_the_cpu_op(dtype, heads, c):
    """Attention dropout drawn in GAT's plain-graph kernels (forward and column pass; keyed by
    keep_order's input edges, or the entries) equals the CPU op's draws from the same {seed,
    offset}: output and gradients against the float64 CPU op, hub rows and columns cut into
    chunks, heads over more than one warp (40 x 4); bitwise repeatable. And the draws are the
    multigraph kernels' (edge_gat_attention, for the heads they take) for the same input edges
    and CUDA seed."""
    n = 600
    g = torch.Generator().manual_seed(31)
    ei = random_edge_index(n, n, 9, seed=32)
    hub = torch.stack([torch.randint(0, n, (700,), generator=g), torch.full((700,), 5)])
    fan = torch.stack([torch.full((500,), 7), torch.randint(0, n, (500,), generator=g)])
    ei = torch.cat([ei, hub, fan], dim=1).unique(dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=g)]
    p = trisparse.Pattern.from_edge_index(ei, size=(n, n))
    order = p.input_order(torch.device("cpu"))[1]
    x = torch.randn(n, heads, c, generator=g)
    src, dst = 2 * torch.randn(n, heads, generator=g), 2 * torch.randn(n, heads, generator=g)
    dout = torch.randn(n, heads, c, generator=g)
    state = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, generator=g)
    op = torch.ops.trisparse.gat_attention

    def grads(device, dt, keep_order):
        ft = torch.float64 if dt == torch.float64 else torch.float32
        xs = (x.to(device, dt), src.to(device, ft), dst.to(device, ft))
        xs = [t.detach().clone().requires_grad_() for t in xs]
        ko = None if keep_order is None else keep_order.to(device)
        out, _lse = op(*xs, None, ko, p.id, 0.2, 0.3, state.to(device))
        return [out, *torch.autograd.grad(out, xs, dout.to(device, out.dtype))]

    for keep_order in (None, order):
        want = grads("cpu", torch.float64, keep_order)
        got = grads("cuda", dtype, keep_order)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for a, b, what in zip(got, want, ("out", "dx", "da_src", "da_dst")):
            assert relerr(a.double().cpu(), b.detach()) <= tol, what
        for a, b in zip(got, grads("cuda", dtype, keep_order)):
            assert torch.equal(a, b)
    xs = [t.cuda() for t in (x, src, dst)]
    if not edge_attention_supported(p, xs[0]):
        return  # (heads the multigraph kernels do not take)
    torch.cuda.manual_seed(9)
    plain = trisparse.gat_attention(*xs, p, 0.2, keep_order=order.cuda(), dropout=0.3)
    torch.cuda.manual_seed(9)
    multi = trisparse.edge_gat_attention(*xs, p, 0.2, None, 0.3)
    assert relerr(plain.double().cpu(), multi.double().cpu()) <= 1e-5


def _attention_step(q, k, v, dout, pattern):
    out = trisparse.sparse_attention(q, k, v, pattern)
    return torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_training_step_replays_from_a_cuda_graph(dtype):
    ei = random_edge_index(400, 400, 12, seed=6)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(400, 400))
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (
        torch.randn(400, 4, 32, device="cuda", generator=g, dtype=dtype) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: builds and caches the plan
        for _ in range(2):
            _attention_step(q, k, v, dout, pattern)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _attention_step(q, k, v, dout, pattern)
    for _ in range(2):  # new inputs written in place, then a replay against an eager step
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, device="cuda", generator=g, dtype=dtype))
        graph.replay()
        eager = _attention_step(q, k, v, dout, pattern)
        torch.cuda.synchronize()
        for a, b in zip(captured, eager, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_on_cuda(backend):
    ei = random_edge_index(256, 256, 8, seed=16)
    pattern = trisparse.Pattern.of(ei, num_nodes=256)
    lin = torch.nn.Linear(16, 3 * 2 * 32).cuda()

    def model(x):
        q, k, v = lin(x).view(-1, 3, 2, 32).unbind(1)
        return trisparse.sparse_attention(q, k, v, pattern).square().sum()

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(256, 16, device="cuda")
    try:
        assert torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        gx = torch.autograd.grad(compiled(x.requires_grad_()), x)[0]
        ge = torch.autograd.grad(model(x), x)[0]
        assert torch.allclose(gx, ge, rtol=1e-5, atol=1e-6)
    finally:
        # The compiled graphs hold the pattern (and its CUDA plan) in torch's caches, which
        # would otherwise outlive the extension module at exit (nanobind reports a leak).
        torch._dynamo.reset()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, d, g", [(torch.float16, 64, 64), (torch.bfloat16, 128, 32)])
def test_block_sparse_gradients_on_cuda(dtype, d, g, causal):
    """The CUDA block-sparse backward against the CPU float64 one, bitwise repeatable, and the
    same gradients from FlexAttention's BlockMask as from ours."""
    b, h, n_q, n_k = 2, 3, 300, 250
    gen = torch.Generator().manual_seed(17)
    blocks = torch.rand(b, h, -(-n_q // g), -(-n_k // g), generator=gen) < 0.5
    mask = trisparse.BlockMask(blocks, block_size=g, causal=causal)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen) for n in (n_q, n_k, n_k, n_q))

    def grads(device, dt):
        leaves = [t.to(device, dt).requires_grad_() for t in (q, k, v)]
        out = trisparse.block_sparse_attention(*leaves, mask)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, dout.to(device, dt)))

    want = grads("cpu", torch.float64)
    got = grads("cuda", dtype)
    for a, w in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        err = float((a.double().cpu() - w).abs().max() / w.abs().max())
        assert err <= (8e-3 if dtype == torch.float16 else 3e-2), err
    for a, c in zip(got, grads("cuda", dtype), strict=True):
        assert torch.equal(a, c)
    # Without a gradient to compute, no log-sum-exp is written, and the output is the same.
    with torch.no_grad():
        plain = trisparse.block_sparse_attention(*(t.to("cuda", dtype) for t in (q, k, v)), mask)
    assert torch.equal(plain, got[0])


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_ragged_packed_batch_on_cuda(causal):
    """cu_seqlens on CUDA (lengths 0, 1, 300, 517 and 64; keys differ): output and gradients
    against the CPU float64 ones."""
    h, d, g = 2, 64, 64
    lq, lk = [0, 1, 300, 517, 64], [40, 1, 250, 517, 100]
    cu_q = [sum(lq[:i]) for i in range(6)]
    cu_k = [sum(lk[:i]) for i in range(6)]
    gen = torch.Generator().manual_seed(19)
    blocks = torch.rand(5, h, -(-517 // g), -(-517 // g), generator=gen) < 0.5
    mask = trisparse.BlockMask(blocks, block_size=g, causal=causal)
    q, dout = (torch.randn(cu_q[-1], h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(cu_k[-1], h, d, generator=gen) for _ in range(2))

    def grads(device, dt):
        leaves = [t.to(device, dt).requires_grad_() for t in (q, k, v)]
        out = trisparse.block_sparse_attention(
            *leaves, mask, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor(cu_k, device=device)
        )
        return [out.detach()] + list(torch.autograd.grad(out, leaves, dout.to(device, dt)))

    want = grads("cpu", torch.float64)
    for a, w in zip(grads("cuda", torch.bfloat16), want, strict=True):
        assert torch.isfinite(a).all()
        assert float((a.double().cpu() - w).abs().max() / w.abs().max()) <= 3e-2


def test_block_sparse_training_step_with_flex_block_mask_on_cuda():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    b, h, n, d, g = 1, 2, 512, 64, 128

    def local(b_, h_, q_idx, kv_idx):  # block-granular: the same blocks in both libraries
        return (q_idx // g - kv_idx // g).abs() <= 1

    flex_mask = fa.create_block_mask(local, b, h, n, n, device="cuda", BLOCK_SIZE=g)
    gen = torch.Generator(device="cuda").manual_seed(18)
    q, k, v, dout = (
        torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = trisparse.block_sparse_attention(*leaves, flex_mask)
    got = [out] + list(torch.autograd.grad(out, leaves, dout))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    i = torch.arange(n, device="cuda")
    allowed = local(0, 0, i[:, None], i[None, :])
    s = (leaves[0] @ leaves[1].transpose(-1, -2)) / math.sqrt(d)
    out = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1) @ leaves[2]
    want = [out] + list(torch.autograd.grad(out, leaves, dout.double()))
    for a, w in zip(got, want, strict=True):
        assert float((a.double() - w).abs().max() / w.abs().max()) <= 3e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_block_masks_on_the_device_match_host_masks(causal, shared):
    """A BlockMask whose blocks are on the GPU (lists built there) gives the outputs and
    gradients of the same mask on the host, on a ragged packed batch, bitwise repeatable."""
    h, d, g = 2, 64, 32
    lq, lk = [0, 1, 300, 517, 64], [40, 1, 250, 517, 100]
    cu_q = [sum(lq[:i]) for i in range(6)]
    cu_k = [sum(lk[:i]) for i in range(6)]
    gen = torch.Generator().manual_seed(23)
    shape = (1, 1) if shared else (5, h)
    blocks = torch.rand(*shape, -(-517 // g), -(-517 // g), generator=gen) < 0.4
    q, dout = (torch.randn(cu_q[-1], h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(cu_k[-1], h, d, generator=gen) for _ in range(2))

    def grads(mask):
        leaves = [t.to("cuda", torch.float16).requires_grad_() for t in (q, k, v)]
        out = trisparse.block_sparse_attention(*leaves, mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        grads = torch.autograd.grad(out, leaves, dout.to("cuda", torch.float16))
        return [out.detach().float()] + [x.float() for x in grads]

    on_device = trisparse.BlockMask(blocks.cuda(), block_size=g, causal=causal)
    got = grads(on_device)
    for a, c in zip(got, grads(on_device), strict=True):
        assert torch.equal(a, c)
    for a, w in zip(
        got, grads(trisparse.BlockMask(blocks, block_size=g, causal=causal)), strict=True
    ):
        assert torch.isfinite(a).all()
        assert float((a - w).abs().max() / w.abs().max().clamp_min(1e-30)) <= 4e-3


def test_masks_on_the_device_train_without_a_host_synchronisation():
    """A top-k mask and a FlexAttention BlockMask, selected and converted on the GPU, run forward
    and backward while the GPU still sleeps on earlier work: nothing waited for it (and torch's
    sync debug mode raises on none of its own synchronisations)."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    b, h, n, d, g = 1, 2, 1024, 64, 64

    def local(b_, h_, q_idx, kv_idx):
        return (q_idx // g - kv_idx // g).abs() <= 2

    flex_mask = fa.create_block_mask(local, b, h, n, n, device="cuda", BLOCK_SIZE=g)
    gen = torch.Generator(device="cuda").manual_seed(29)
    q, k, v, dout = (
        torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    # A top-k plan of this shape, built (a synchronisation, once per shape) and pooled.
    trisparse.block_sparse_attention(q, k, v, trisparse.topk_block_mask(q, k, g, 3, causal=True))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the GPU's time
    torch.cuda.set_sync_debug_mode("error")
    try:
        for make in (
            lambda: trisparse.topk_block_mask(q, k, g, top_k=3, causal=True),
            lambda: flex_mask,
        ):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = trisparse.block_sparse_attention(*leaves, make())
            torch.autograd.grad(out, leaves, dout)
        busy = not torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert busy, "the host waited for the GPU"
    torch.cuda.synchronize()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("folded", [True, False])
def test_topk_masks_run_on_the_librarys_gpu_plan(causal, folded):
    """topk_block_mask on CUDA selects with the library's plan and block_sparse_attention runs it:
    the blocks are the definition's (torch's selection, in float64), forward and gradients equal
    the same blocks given as a BlockMask, bitwise the same on a second run; the plan returns to
    its pool when the mask is freed and serves the next selection. Heads folded ([B, H, N, D]
    contiguous) or not ([B, N, H, D] transposed: the plan over packed sequences)."""
    import gc
    import time

    from trisparse.block_mask import _topk_pool, _TopkMask
    from trisparse.ops.block_sparse import _topk_blocks_on_device

    b, h, n, d, g, top = 2, 3, 640, 64, 64, 3
    gen = torch.Generator(device="cuda").manual_seed(31)

    def make():
        t = torch.randn(b, n, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        return t.transpose(1, 2).contiguous() if folded else t.transpose(1, 2)

    q, k, v, dout = make(), make(), make(), make()
    mask = trisparse.topk_block_mask(q, k, g, top, causal=causal)
    assert isinstance(mask, _TopkMask) and mask.shape == (b, h, n // g, n // g)
    packed = [t.transpose(1, 2).reshape(-1, h, d) for t in (q, k)]
    want = _topk_blocks_on_device(*packed, b, g, top, causal, True)
    assert torch.equal(mask.blocks, want)
    same = trisparse.BlockMask(want.clone(), g, causal=causal)

    def step(m):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = trisparse.block_sparse_attention(*leaves, m)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

    got, again, ref = step(mask), step(mask), step(same)
    for x, y, z in zip(got, again, ref, strict=True):
        assert torch.equal(x, y)
        assert relerr(x.double(), z.double()) <= 1e-2
    plan = mask._held["plan"]
    del mask
    # The plan goes back to its pool once the last reference is gone; the autograd engine's worker
    # thread may drop the graph (and the mask it saved) just after grad returns, so wait for it.
    for _ in range(200):
        gc.collect()
        if any(plan in free for free in _topk_pool.values()):
            break
        time.sleep(0.01)
    assert trisparse.topk_block_mask(q, k, g, top, causal=causal)._held["plan"] is plan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("order", ["fused", "unfused"])
@pytest.mark.parametrize("f_in, f_out", [(24, 80), (96, 40)])
def test_gcn_conv_orders_and_gradients_on_cuda(dtype, order, f_in, f_out):
    """The fused GCN layer in both orders against float64: out, and the gradients of x, the
    weight and the bias through the ReLU mask; bitwise repeatable. The reference's ReLU takes
    the layer's own decisions (out > 0): outputs within rounding of 0 may fall either way, and a
    flipped one moves the gradients by a whole upstream value."""
    n = 3000
    g = torch.Generator().manual_seed(f_in)
    row, col = (
        torch.randint(0, n, (30000,), generator=g),
        torch.randint(0, n, (30000,), generator=g),
    )
    row = torch.cat([row, torch.full((2500,), 7)])  # a row whose window is cut into chunks
    col = torch.cat([col, torch.arange(2500)])
    val = torch.rand(row.numel(), generator=g) / 8
    m = trisparse.SparseMatrix(row, col, val, n, n)
    x = torch.randn(n, f_in, generator=g)
    w = torch.randn(f_out, f_in, generator=g) / f_in**0.5
    b = torch.randn(f_out, generator=g) / 4
    up = torch.randn(n, f_out, generator=g)
    a = torch.zeros(n, n, dtype=torch.float64).index_put_((row, col), val.double(), accumulate=True)

    def grads(keep=None):
        dev, dt = ("cpu", torch.float64) if keep is not None else ("cuda", dtype)
        xs, ws, bs = (t.to(dev, dt).requires_grad_() for t in (x, w, b))
        if keep is not None:
            z = a @ (xs @ ws.t()) + bs
            out, ref_out = z * keep, torch.relu(z)
        else:
            out = trisparse.gcn_conv(m, xs, ws, bs, relu=True, order=order)
            ref_out = out
        out.backward(up.to(dev, out.dtype))
        return [t.detach().double().cpu() for t in (ref_out, xs.grad, ws.grad, bs.grad)]

    got = grads()
    want = grads(keep=(got[0] > 0).double())
    tol = 3e-3 if dtype == torch.float32 else 2e-2
    for name, g_, w_ in zip(["out", "dx", "dw", "db"], got, want):
        assert relerr(g_, w_) <= tol, name
    assert all(torch.equal(p, q) for p, q in zip(got, grads()))


def test_gcn_conv_layer_with_fused_relu_matches_pyg_on_cuda():
    ei, n = load_shared_graph("cora")
    torch.manual_seed(0)
    pyg = pyg_nn.GCNConv(64, 128, cached=True).cuda()
    ours = trisparse.nn.GCNConv(64, 128, cached=True, fuse_relu=True).cuda()
    ours.load_state_dict(pyg.state_dict())
    ei = ei.cuda()
    x = torch.randn(n, 64, device="cuda")
    out, gx, gp = run(ours, x, ei)
    # PyG's layer with the ReLU decisions of ours (see the test above).
    x2 = x.detach().clone().requires_grad_()
    ref = pyg(x2, ei) * (out > 0)
    gen = torch.Generator(device="cuda").manual_seed(99)
    ref.backward(torch.randn(ref.shape, generator=gen, device="cuda"))
    assert relerr(out, torch.relu(pyg(x, ei)).detach()) <= 2e-3
    assert relerr(gx, x2.grad) <= 2e-3
    assert relerr(gp["lin.weight"], pyg.lin.weight.grad) <= 2e-3
    assert relerr(gp["bias"], pyg.bias.grad) <= 2e-3


def test_gcn_conv_learned_edge_weights_on_cuda_match_pyg():
    """An edge_weight that requires grad on a multigraph (repeated edges, self loops): out and the
    gradients of x, the weights and every parameter against PyG's layer (whose gcn_norm both
    run: its degree sums add with atomics on CUDA, so no bitwise check here). Self loops are not
    repeated: gcn_norm keeps one weight of a node's loops, on CUDA which one is undefined."""
    n = 3000
    ei = random_edge_index(n, n, 12, seed=44, self_loops=True)
    again = ei[:, ::5]
    ei = torch.cat([ei, again[:, again[0] != again[1]]], 1).cuda()
    torch.manual_seed(0)
    pyg = pyg_nn.GCNConv(32, 48).cuda()
    ours = trisparse.nn.GCNConv(32, 48).cuda()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, 32, device="cuda")
    w = torch.rand(ei.shape[1], device="cuda") + 0.5
    up = torch.randn(n, 48, device="cuda")

    def step(layer):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = layer(xs, ei, ws)
        out.backward(up)
        grads = [out.detach(), xs.grad, ws.grad, layer.lin.weight.grad, layer.bias.grad]
        grads = [g.clone() for g in grads]
        layer.zero_grad()
        return grads

    got, want = step(ours), step(pyg)
    for name, a, b in zip(["out", "dx", "dw", "dlin", "dbias"], got, want):
        assert relerr(a, b) <= 1e-3, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, d, shared", [(8, 16, False), (2, 64, True), (4, 32, False)])
def test_biased_attention_on_cuda_matches_the_float64_cpu_op(dtype, heads, d, shared):
    """A per-entry bias on CUDA (the row-wise kernels): out and the gradients of q, k, v and the
    bias against the float64 CPU reference; bitwise repeatable; a hub row and column cut into
    chunks."""
    n = 900
    ei = random_edge_index(n, n, 9, seed=41, self_loops=True)
    hub = torch.stack([torch.arange(600), torch.full((600,), 7)])
    ei = torch.cat([ei, hub, hub.flip(0)], dim=1)
    pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=n)
    g = torch.Generator().manual_seed(42)
    q, k, v = (torch.randn(n, heads, d, generator=g) for _ in range(3))
    bias = 2 * torch.randn((pattern.nnz,) if shared else (pattern.nnz, heads), generator=g)
    dout = torch.randn(n, heads, d, generator=g)

    def step(device, dt):
        ts = [t.to(device, dt).requires_grad_() for t in (q, k, v)]
        b = bias.to(device, torch.float64 if dt == torch.float64 else torch.float32)
        b.requires_grad_()
        out = trisparse.sparse_attention(*ts, pattern, bias=b)
        grads = torch.autograd.grad(out, [*ts, b], dout.to(device, out.dtype))
        return [t.double().cpu() for t in (out, *grads)]

    want = step("cpu", torch.float64)
    got = step("cuda", dtype)
    again = step("cuda", dtype)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for name, a, b, c in zip(("out", "dq", "dk", "dv", "dbias"), got, again, want):
        assert torch.equal(a, b), name
        assert relerr(a, c) <= tol, name


@pytest.mark.parametrize(
    "layer, kwargs",
    [
        ("TransformerConv", {"heads": 4}),
        ("TransformerConv", {"heads": 4, "edge_dim": 6}),
        ("GATConv", {"heads": 4}),
        ("GATConv", {"heads": 4, "edge_dim": 6}),
        ("GATConv", {"heads": 4, "edge_dim": 6, "fill_value": "add"}),
        ("GATConv", {"heads": 4, "edge_dim": 6, "fill_value": 0.5}),
    ],
)
def test_layers_on_multigraphs_with_edge_features_on_cuda(layer, kwargs):
    """Repeated edges, self loops, nodes without incoming edges and edge features on CUDA in
    float32 against PyG's layer in float64 on the CPU: outputs and the gradients of x, edge_attr
    and every parameter, no fallback. The per-edge path's SpMM multiplies f32 on tf32 tensor cores
    (its SDDMM in three tf32 products): 1e-3."""
    n = 400
    g = torch.Generator().manual_seed(43)
    ei = random_edge_index(n, n, 8, seed=44, self_loops=True)
    ei = ei[:, ei[1] >= 10]  # nodes 0-9: no incoming edge (GATConv's "mean" fill gives them 0)
    picks = torch.randint(0, ei.shape[1], (ei.shape[1] // 4,), generator=g)
    ei = torch.cat([ei, ei[:, picks]], dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=g)]
    torch.manual_seed(0)
    pyg = getattr(pyg_nn, layer)(24, 16, **kwargs).double()
    ours = getattr(trisparse.nn, layer)(24, 16, **kwargs).cuda()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, 24, generator=g)
    ea = torch.randn(ei.shape[1], 6, generator=g) if "edge_dim" in kwargs else None

    def grads(model, device, dt):
        xs = x.to(device, dt).requires_grad_()
        extra = {}
        if ea is not None:
            extra["edge_attr"] = ea.to(device, dt).requires_grad_()
        out = model(xs, ei.to(device), **extra)
        out.backward(
            torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device, dt)
        )
        res = [out.detach(), xs.grad] + ([extra["edge_attr"].grad] if extra else [])
        res += [p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None]
        model.zero_grad()
        return [t.double().cpu() for t in res]

    import warnings

    # torch warns once when a backward thread first meets cuBLAS: not ours, let it pass first.
    torch.ones(2, 2, device="cuda", requires_grad=True).matmul(
        torch.ones(2, 2, device="cuda")
    ).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads(ours, "cuda", torch.float32)
    want = grads(pyg, "cpu", torch.float64)
    assert len(got) == len(want)
    norm = max(float(b.abs().max()) for b in want[2:])
    for i, (a, b) in enumerate(zip(got, want)):
        if i >= 3 or (i == 2 and ea is None):  # parameters: normwise over all of them
            assert (a - b).abs().max() <= 1e-3 * norm, i
        else:
            assert relerr(a, b) <= 1e-3, i


@pytest.mark.parametrize(
    "layer, kwargs, repeats",
    [
        ("TransformerConv", {"heads": 4}, True),
        ("TransformerConv", {"heads": 4, "edge_dim": 6}, True),
        ("GATConv", {"heads": 4, "edge_dim": 6}, True),
        ("GATConv", {"heads": 4}, False),
    ],
)
def test_attention_dropout_with_pyg_draws_drops_what_pyg_drops(layer, kwargs, repeats):
    """With PyG's draws (``pyg_dropout=True``), attention dropout in the fused kernels (the
    multigraph kernels; GAT's plain-graph kernel) applies F.dropout over [E, H] in the input's
    edge order, as PyG's layers drop their weights: with the same CUDA seed, the output and the
    gradients of x, edge_attr and every parameter equal PyG's layer on CUDA (float32), so the
    same edges were dropped; no fallback."""
    n = 300
    ei, g = _shuffled_multigraph(n, 53, repeats)
    torch.manual_seed(0)
    pyg = getattr(pyg_nn, layer)(24, 16, dropout=0.3, **kwargs).cuda().train()
    ours = getattr(trisparse.nn, layer)(24, 16, dropout=0.3, **kwargs, pyg_dropout=True)
    ours = ours.cuda().train()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, 24, generator=g)
    ea = torch.randn(ei.shape[1], 6, generator=g) if "edge_dim" in kwargs else None
    dout = torch.randn(n, 64, generator=g)

    def grads(model):
        xs = x.cuda().requires_grad_()
        extra = {} if ea is None else {"edge_attr": ea.cuda().requires_grad_()}
        torch.cuda.manual_seed(77)
        out = model(xs, ei.cuda(), **extra)
        out.backward(dout.cuda())
        res = [out.detach(), xs.grad] + ([extra["edge_attr"].grad] if extra else [])
        res += [p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None]
        return [t.double().cpu() for t in res]

    import warnings

    # torch warns once when a backward thread first meets cuBLAS: not ours, let it pass first.
    torch.ones(2, 2, device="cuda", requires_grad=True).matmul(
        torch.ones(2, 2, device="cuda")
    ).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads(ours)
    want = grads(pyg)
    assert len(got) == len(want)
    norm = max(float(b.abs().max()) for b in want[2:])
    for i, (a, b) in enumerate(zip(got, want)):
        if i >= 3 or (i == 2 and ea is None):
            assert (a - b).abs().max() <= 1e-4 * norm, i
        else:
            assert relerr(a, b) <= 1e-4, i


def _molecule_batch(g: torch.Generator, graphs: int = 40):
    """A mini-batch of `graphs` small random graphs (1 - 59 nodes, 2 edges a node, within each):
    its batch vector and edge_index."""
    sizes = torch.randint(1, 60, (graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(graphs), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    ei = torch.cat(
        [torch.randint(0, int(s), (2, 2 * int(s)), generator=g) + o for s, o in zip(sizes, starts)],
        dim=1,
    )
    return batch, ei


def _gps(cls, channels: int, edge_dim: int | None = None):
    """A GPSConv (PyG's or ours) of 4 heads over a GIN local MPNN (GINE with edge features)."""
    mlp = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.ReLU())
    local = pyg_nn.GINEConv(mlp, edge_dim=edge_dim) if edge_dim else pyg_nn.GINConv(mlp)
    return cls(channels, local, heads=4)


def test_gps_conv_on_cuda_matches_pyg_in_float64():
    """GPSConv's packed global attention on CUDA in float32 (a GINE local MPNN with bond-like
    edge features) against PyG's GPSConv in float64 on the CPU."""
    g = torch.Generator().manual_seed(7)
    batch, ei = _molecule_batch(g)
    n, channels = batch.numel(), 64
    torch.manual_seed(0)

    pyg = _gps(pyg_nn.GPSConv, channels, edge_dim=3).double()
    ours = _gps(trisparse.nn.GPSConv, channels, edge_dim=3).cuda()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, channels, generator=g)
    ea = torch.randn(ei.shape[1], 3, generator=g)
    dout = torch.randn(n, channels, generator=g)

    def result(layer, device, dt):
        xs = x.to(device, dt).requires_grad_()
        out = layer(xs, ei.to(device), batch.to(device), edge_attr=ea.to(device, dt))
        out.backward(dout.to(device, dt))
        grads = [p.grad for _, p in sorted(layer.named_parameters())]
        return [t.double().cpu() for t in (out.detach(), xs.grad, *grads)]

    got, want = result(ours, "cuda", torch.float32), result(pyg, "cpu", torch.float64)
    # Normwise over the parameters: some gradients are zero up to rounding (a key bias shifts
    # every score of a row alike, which the softmax cancels).
    norm = max(float(b.abs().max()) for b in want[2:])
    assert relerr(got[0], want[0]) <= 1e-3 and relerr(got[1], want[1]) <= 1e-3
    for i, (a, b) in enumerate(zip(got[2:], want[2:])):
        assert (a - b).abs().max() <= 1e-3 * norm, i


@pytest.mark.parametrize("autocast", [False, True])
def test_gps_conv_edge_bias_on_cuda_matches_float64(autocast):
    """GPSConv(edge_bias=True, edge_dim=3) on CUDA (float32: the multigraph kernels; bf16
    autocast with 16-channel heads: the segment kernels with the edges' bias) against the same layer in
    float64 on the CPU (equal to PyG's with the dense bias: test_nn), repeated edges included;
    the gradients, the bias's too, the same bits on a second run."""
    g = torch.Generator().manual_seed(9)
    batch, ei = _molecule_batch(g)
    ei = torch.cat([ei, ei[:, :50], ei[:, :20]], dim=1)  # pairs with two and three edges
    n, channels = batch.numel(), 64
    torch.manual_seed(0)
    exact = trisparse.nn.GPSConv(channels, None, heads=4, edge_bias=True, edge_dim=3).double()
    ours = copy.deepcopy(exact).float().cuda()
    x = torch.randn(n, channels, generator=g)
    ea = torch.randn(ei.shape[1], 3, generator=g)
    dout = torch.randn(n, channels, generator=g)

    def result(layer, device):
        dt = torch.float64 if device == "cpu" else torch.float32
        xs, eas = x.to(device, dt).requires_grad_(), ea.to(device, dt).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and device == "cuda"):
            out = layer(xs, ei.to(device), batch.to(device), edge_attr=eas)
        out.float().backward(dout.to(device, out.dtype).float())
        grads = [p.grad.clone() for _, p in sorted(layer.named_parameters()) if p.grad is not None]
        layer.zero_grad()
        return [t.double().cpu() for t in (out.detach(), xs.grad, eas.grad, *grads)]

    want, got = result(exact, "cpu"), result(ours, "cuda")
    tol = 3e-2 if autocast else 1e-4
    for i in range(3):  # out, x's and edge_attr's gradients
        # (edge_attr's: each pair's dS from bf16 P and dP, through lin_edge_bias: 3.02 % on an H100)
        assert relerr(got[i], want[i]) <= (4e-2 if autocast and i == 2 else tol), i
    # Normwise over the parameters: some gradients are zero up to rounding (BatchNorm cancels
    # out_proj's bias). Under autocast the MLP's weight gradients sum products of bf16 activations
    # downstream of the attention and two norms (H100: mlp.0.weight 3.1 % of the largest).
    norm = max(float(w.abs().max()) for w in want[3:])
    for i, (a, w) in enumerate(zip(got[3:], want[3:])):
        assert (a - w).abs().max() <= (5e-2 if autocast else tol) * norm, i
    again = result(ours, "cuda")
    assert all(torch.equal(a, b) for a, b in zip(got[1:], again[1:]))


@pytest.mark.parametrize("dim", [32, 64])
def test_batch_attention_plan_built_on_the_gpu(dim):
    """A mini-batch's block-diagonal pattern made on the GPU: its plan with gradients is built
    there (no host copy of the pattern), the fused 3S forward and tensor-core backward in bf16
    against float64 dense attention per graph; the same bits on a second run."""
    g = torch.Generator().manual_seed(dim)
    sizes = torch.randint(1, 70, (50,), generator=g)
    batch = torch.repeat_interleave(torch.arange(50), sizes).cuda()
    n, heads = batch.numel(), 2
    q, k, v, dout = (torch.randn(n, heads, dim, generator=g) for _ in range(4))

    def run():
        pattern = trisparse.Pattern.from_batch(batch)
        xs = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
        out = trisparse.sparse_attention(*xs, pattern)
        out.backward(dout.cuda().bfloat16())
        assert torch.device("cpu") not in pattern._copies  # built from the device copy
        return [t.double().cpu() for t in (out.detach(), *(x.grad for x in xs))]

    got = run()
    for a, b in zip(got, _dense_per_graph(q, k, v, dout, sizes, 1 / math.sqrt(dim))):
        assert relerr(a, b) <= 2e-2
    assert all(torch.equal(a, b) for a, b in zip(got, run()))


def _dense_per_graph(q, k, v, dout, sizes, scale):
    """out, dq, dk, dv in float64 of dense attention within each graph (consecutive rows of
    `sizes`)."""
    xs = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    outs = []
    for a, b in zip(ptr[:-1].tolist(), ptr[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in xs)
        w = torch.softmax(scale * qs @ ks.transpose(1, 2), -1)
        outs.append((w @ vs).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.double().cpu())
    return [out.detach(), *(x.grad for x in xs)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 32, 64, 128])
def test_segment_attention_matches_float64(dim, dtype):
    """segment_attention's kernels (q, k, v strided views of one projection, as GPS makes them;
    graphs of 1 - 40 nodes and two of 150 and 300, ids with gaps, int64 and int32) against
    float64 dense attention per graph, forward and gradients; the same bits on a second run."""
    g = torch.Generator().manual_seed(dim)
    sizes = torch.randint(1, 41, (80,), generator=g)
    sizes[20], sizes[60] = 150, 300
    ids = torch.cumsum(torch.randint(1, 3, (80,), generator=g), 0)  # gaps: empty graphs
    batch = torch.repeat_interleave(ids, sizes).cuda()
    n, heads = batch.numel(), 3
    qkv = torch.randn(n, 3, heads, dim, generator=g)
    dout = torch.randn(n, heads, dim, generator=g)
    scale = 0.7 / math.sqrt(dim)

    def run(ids_dtype):
        x = qkv.cuda().to(dtype).requires_grad_()
        q, k, v = x.unbind(1)
        assert trisparse.segment_attention_supported(q)
        out = trisparse.segment_attention(q, k, v, batch.to(ids_dtype), scale)
        out.backward(dout.cuda().to(dtype))
        return [t.double().cpu() for t in (out.detach(), *x.grad.unbind(1))]

    got = run(torch.int64)
    want = _dense_per_graph(*qkv.unbind(1), dout, sizes, scale)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relerr(a, b) <= (2e-2 if dtype == torch.bfloat16 else 4e-3), i
    assert all(torch.equal(a, b) for a, b in zip(got, run(torch.int32)))


def _biased_per_graph(xs, ptr, scale, bias_of, dropout, state):
    """float64 attention within each graph [a, b) of ptr with the score bias bias_of(a, b) ([H or
    1, b - a, b - a]) and, with dropout, the kernels' draws (Philox, computed here)."""
    heads, outs = xs[0].shape[1], []
    for a, b in itertools.pairwise(ptr):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in xs)
        w = torch.softmax(scale * qs @ ks.transpose(1, 2) + bias_of(a, b), -1)
        if dropout > 0:
            ii, jj = torch.meshgrid(torch.arange(a, b), torch.arange(a, b), indexing="ij")
            f = philox_factors(ii.flatten(), jj.flatten(), range(heads), state.cpu(), dropout)
            w = w * f.T.reshape(heads, b - a, b - a)
        outs.append((w @ vs).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dim, dropout", [(16, 0.0), (32, 0.0), (64, 0.2), (128, 0.0)])
def test_segment_attention_pair_bias_matches_float64(dim, dropout, shared):
    """The segment kernels with a score bias per pair (Graphormer's encodings; per head or shared
    by the heads) against float64 dense attention per graph with the same bias (and, with
    dropout, the kernels' draws computed here independently): the output and the gradients of
    q, k, v and the bias; places of no pair get a zero gradient; the same bits on a second run."""
    g = torch.Generator().manual_seed(50 + dim)
    sizes = torch.randint(1, 41, (50,), generator=g)
    sizes[7], sizes[30] = 130, 70
    batch = torch.repeat_interleave(torch.arange(50), sizes).cuda()
    n, heads, m = batch.numel(), 2, 140
    qkv = torch.randn(n, 3, heads, dim, generator=g)
    bias0 = 2 * torch.randn(n, 1 if shared else heads, m, generator=g)
    dout = torch.randn(n, heads, dim, generator=g)
    scale = 0.8 / math.sqrt(dim)
    state = torch.tensor([0x0DDB_A11, 99], dtype=torch.int64, device="cuda")
    from trisparse.autograd.segment_attention import _call

    def run():
        x = qkv.cuda().bfloat16().requires_grad_()
        bias = bias0.cuda().requires_grad_()
        out, _ = _call(*x.unbind(1), batch, scale, dropout, state, bias, None)
        out.backward(dout.cuda().bfloat16())
        return [t.double().cpu() for t in (out.detach(), *x.grad.unbind(1), bias.grad)]

    got = run()
    xs = [t.double().requires_grad_() for t in qkv.bfloat16().unbind(1)]
    bias = bias0.double().requires_grad_()
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]).tolist()
    out = _biased_per_graph(
        xs, ptr, scale, lambda a, b: bias[a:b, :, : b - a].transpose(0, 1), dropout, state
    )
    out.backward(dout.bfloat16().double())
    want = [out.detach(), *(x.grad for x in xs), bias.grad]
    for i, (a, b) in enumerate(zip(got, want)):
        assert relerr(a, b) <= 2e-2, i
    lengths = torch.repeat_interleave(sizes, sizes)
    unused = torch.arange(m)[None, :] >= lengths[:, None]
    assert bool((got[4].transpose(1, 2)[unused] == 0).all())
    assert all(torch.equal(a, b) for a, b in zip(got, run()))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dim, dropout", [(16, 0.0), (32, 0.2), (64, 0.0), (128, 0.2)])
def test_segment_attention_edge_bias_matches_float64(dim, dropout, shared):
    """The segment kernels with a score bias per edge (GPS's bonds; per head or shared) against
    float64 dense attention per graph with each pair's edges summed: repeated edges, self loops,
    a hub row whose edges span tiles (every node of a 130-node graph to its first), edges
    between graphs (no pair: no score, zero gradient); the output and the gradients of q, k, v
    and every edge's bias (with dropout, the kernels' draws computed here); the same bits on a
    second run; no edges at all as no bias."""
    g = torch.Generator().manual_seed(70 + dim)
    sizes = torch.randint(1, 41, (50,), generator=g)
    sizes[7], sizes[30] = 130, 70
    batch = torch.repeat_interleave(torch.arange(50), sizes).cuda()
    n, heads = batch.numel(), 2
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]).tolist()
    parts = [torch.randint(0, int(m), (2, 3 * int(m)), generator=g) + a for a, m in zip(ptr, sizes)]
    hub = ptr[7]
    parts.append(torch.stack([torch.arange(hub, hub + 130), torch.full((130,), hub)]))
    parts.append(torch.tensor([[0, 5, 5, n - 1], [n - 1, 5, 5, 2]]))  # cross, self loop twice
    ei = torch.cat(parts, dim=1)
    ei = ei[:, torch.randperm(ei.shape[1], generator=g)]
    eb0 = 2 * torch.randn(ei.shape[1], 1 if shared else heads, generator=g)
    qkv = torch.randn(n, 3, heads, dim, generator=g)
    dout = torch.randn(n, heads, dim, generator=g)
    scale = 0.8 / math.sqrt(dim)

    def run(edges=ei, bias0=eb0):
        torch.manual_seed(5)  # the kernels' dropout state
        x = qkv.cuda().bfloat16().requires_grad_()
        eb = bias0.cuda().requires_grad_()
        out = trisparse.segment_attention(
            *x.unbind(1), batch, scale, dropout_p=dropout, edge_index=edges.cuda(), edge_bias=eb
        )
        out.backward(dout.cuda().bfloat16())
        return [t.double().cpu() for t in (out.detach(), *x.grad.unbind(1), eb.grad)]

    got = run()
    torch.manual_seed(5)
    state = trisparse._tensors.new_dropout_state(dropout, torch.device("cuda"))
    xs = [t.double().requires_grad_() for t in qkv.bfloat16().unbind(1)]
    eb = eb0.double().requires_grad_()
    local = batch.cpu()[ei[0]] == batch.cpu()[ei[1]]
    pair = torch.zeros(n, n, eb.shape[1], dtype=torch.float64)
    pair = pair.index_put((ei[1, local], ei[0, local]), eb[local], accumulate=True)
    out = _biased_per_graph(
        xs, ptr, scale, lambda a, b: pair[a:b, a:b].permute(2, 0, 1), dropout, state
    )
    out.backward(dout.bfloat16().double())
    want = [out.detach(), *(x.grad for x in xs), eb.grad]
    for i, (a, b) in enumerate(zip(got, want)):
        assert relerr(a, b) <= 2e-2, i
    assert bool((got[4][~local] == 0).all()) and bool((got[4][local] != 0).any())
    assert all(torch.equal(a, b) for a, b in zip(got, run()))
    none = run(ei[:, :0], eb0[:0])
    torch.manual_seed(5)
    x = qkv.cuda().bfloat16()
    plain = trisparse.segment_attention(*x.unbind(1), batch, scale, dropout_p=dropout)
    assert torch.equal(none[0], plain.double().cpu()) and none[4].shape == (0, eb0.shape[1])


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_segment_attention_dropout_matches_float64(dim):
    """Attention dropout inside the segment kernels: forward and gradients equal float64 dense
    attention per graph with the kernels' draws (Philox, computed here independently); the same
    bits for the same state, other bits for another; about 1 - p of the weights kept."""
    g = torch.Generator().manual_seed(30 + dim)
    sizes = torch.randint(1, 41, (60,), generator=g)
    sizes[10] = 200
    batch = torch.repeat_interleave(torch.arange(60), sizes).cuda()
    n, heads, p = batch.numel(), 2, 0.3
    qkv = torch.randn(n, 3, heads, dim, generator=g)
    dout = torch.randn(n, heads, dim, generator=g)
    scale = 1 / math.sqrt(dim)
    state = torch.tensor([0x1234_5678_9ABC_DEF0, -77], dtype=torch.int64, device="cuda")
    from trisparse.autograd.segment_attention import _call

    def run(st):
        x = qkv.cuda().bfloat16().requires_grad_()
        out, _ = _call(*x.unbind(1), batch, scale, p, st, None, None)
        out.backward(dout.cuda().bfloat16())
        return [t.double().cpu() for t in (out.detach(), *x.grad.unbind(1))]

    got = run(state)
    xs = [t.double().requires_grad_() for t in qkv.bfloat16().unbind(1)]
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]).tolist()
    outs, kept = [], []
    for a, b in itertools.pairwise(ptr):
        ii, jj = torch.meshgrid(torch.arange(a, b), torch.arange(a, b), indexing="ij")
        m = philox_factors(ii.flatten(), jj.flatten(), range(heads), state.cpu(), p)
        m = m.T.reshape(heads, b - a, b - a)
        kept.append((m > 0).flatten())
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in xs)
        w = torch.softmax(scale * qs @ ks.transpose(1, 2), -1)
        outs.append(((w * m) @ vs).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.bfloat16().double())
    for i, (a, b) in enumerate(zip(got, [out.detach(), *(x.grad for x in xs)])):
        assert relerr(a, b) <= 2e-2, i
    assert abs(torch.cat(kept).double().mean().item() - (1 - p)) < 0.01
    assert all(torch.equal(a, b) for a, b in zip(got, run(state)))
    other = run(torch.tensor([5, 6], dtype=torch.int64, device="cuda"))
    assert not torch.equal(got[0], other[0])


@pytest.mark.parametrize("g, causal", [(64, False), (128, True), (32, True)])
def test_block_sparse_dropout_matches_float64(g, causal):
    """Attention dropout inside the block-sparse kernels (mma.sync plans at G 32, wgmma plans at
    64 and 128 on sm_90): forward and gradients equal float64 masked attention with the kernels'
    draws (computed here independently); bitwise repeatable; the same draws whether the batch
    comes as [B, H, N, D] (heads folded) or with rows outermost (packed)."""
    b, h, n_q, n_k, d, p = 2, 3, 300, 250, 64, 0.2
    gen = torch.Generator().manual_seed(40 + g)
    blocks = torch.rand(b, h, -(-n_q // g), -(-n_k // g), generator=gen) < 0.5
    mask = trisparse.BlockMask(blocks, block_size=g, causal=causal)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen) for n in (n_q, n_k, n_k, n_q))

    def run(packed):
        leaves = []
        for t in (q, k, v):
            x = t.cuda().bfloat16()
            if packed:  # [B, N, H, D] in memory
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            leaves.append(x.requires_grad_())
        torch.cuda.manual_seed(11)
        out = trisparse.block_sparse_attention(*leaves, mask, dropout_p=p)
        grads = torch.autograd.grad(out, leaves, dout.cuda().bfloat16())
        return [t.double().cpu() for t in (out.detach(), *grads)]

    torch.cuda.manual_seed(11)
    state = trisparse._tensors.new_dropout_state(p, torch.device("cuda")).cpu()
    ins = [t.bfloat16().double() for t in (q, k, v, dout)]
    want = block_dropout_reference(*ins, blocks, g, causal, state, p)
    got = run(False)
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert relerr(a, w) <= 3e-2, i
    assert all(torch.equal(a, c) for a, c in zip(got, run(False), strict=True))
    for i, (a, c) in enumerate(zip(got, run(True), strict=True)):
        assert relerr(a, c) <= 2e-2, i


def test_gps_conv_dropout_takes_the_segment_kernels(monkeypatch):
    """GPSConv training with attention dropout under bf16 autocast runs the segment kernels (no
    per-batch pattern is built); its gradients are finite and another seed drops other weights."""
    from trisparse.nn.conv import gps_conv

    def no_pattern(*args, **kwargs):
        raise AssertionError("a per-batch pattern was built")

    monkeypatch.setattr(gps_conv._BatchPatterns, "get", no_pattern)
    g = torch.Generator().manual_seed(9)
    batch, ei = _molecule_batch(g)
    n, channels = batch.numel(), 64
    mlp = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.ReLU())
    layer = trisparse.nn.GPSConv(
        channels, pyg_nn.GINConv(mlp), heads=4, attn_kwargs={"dropout": 0.5}
    )
    layer = layer.cuda().train()
    layer.dropout = 0.0  # only the attention's dropout differs between runs
    x = torch.randn(n, channels, generator=g).cuda()
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x, ei.cuda(), batch.cuda())
        out.float().sum().backward()
        assert all(p.grad.isfinite().all() for p in layer.parameters() if p.grad is not None)
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("channels", [64, 128])
def test_gps_conv_under_autocast_is_as_close_as_pygs(channels):
    """GPSConv with heads of 16 and 32 channels under bf16 autocast (the segment kernels): as
    close to PyG's float64 GPSConv as PyG's own bf16 run is."""
    g = torch.Generator().manual_seed(8)
    batch, ei = _molecule_batch(g)
    n = batch.numel()
    torch.manual_seed(0)

    exact = _gps(pyg_nn.GPSConv, channels).double()
    pyg, ours = _gps(pyg_nn.GPSConv, channels).cuda(), _gps(trisparse.nn.GPSConv, channels).cuda()
    pyg.load_state_dict(exact.state_dict())
    ours.load_state_dict(exact.state_dict())
    x = torch.randn(n, channels, generator=g)
    dout = torch.randn(n, channels, generator=g)

    def result(layer, device, autocast):
        xs = x.to(device, torch.float64 if device == "cpu" else torch.float32).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = layer(xs, ei.to(device), batch.to(device))
        out.float().backward(dout.to(device, out.dtype).float())
        grads = [p.grad for _, p in sorted(layer.named_parameters())]
        return [t.double().cpu() for t in (out.detach(), xs.grad, *grads)]

    want = result(exact, "cpu", False)
    got, theirs = result(ours, "cuda", True), result(pyg, "cuda", True)
    for i, (a, b, w) in enumerate(zip(got, theirs, want)):
        assert relerr(a, w) <= 2 * relerr(b, w) + 1e-3, i


def test_transformer_conv_edge_features_under_autocast_is_as_close_as_pygs():
    """TransformerConv(edge_dim=16), 8 heads of 16, under bf16 autocast on a multigraph of 6,000
    nodes (its per-head W_e products on the float32 kernels, cast in and out): the output and the
    gradients of x, edge_attr and every parameter as close to PyG's float64 layer as PyG's own bf16
    run is."""
    n, heads, c, f = 6000, 8, 16, 16
    g = torch.Generator().manual_seed(9)
    ei = random_edge_index(n, n, 6, seed=10, self_loops=True)
    picks = torch.randint(0, ei.shape[1], (ei.shape[1] // 8,), generator=g)
    ei = torch.cat([ei, ei[:, picks]], dim=1)  # repeated edges
    torch.manual_seed(0)
    exact = pyg_nn.TransformerConv(32, c, heads=heads, edge_dim=f).double()
    pyg = pyg_nn.TransformerConv(32, c, heads=heads, edge_dim=f).cuda()
    ours = trisparse.nn.TransformerConv(32, c, heads=heads, edge_dim=f).cuda()
    pyg.load_state_dict(exact.state_dict())
    ours.load_state_dict(exact.state_dict())
    x = torch.randn(n, 32, generator=g)
    ea = torch.randn(ei.shape[1], f, generator=g)
    dout = torch.randn(n, heads * c, generator=g)

    def result(layer, device, autocast):
        dt = torch.float64 if device == "cpu" else torch.float32
        xs, eas = (t.to(device, dt).requires_grad_() for t in (x, ea))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = layer(xs, ei.to(device), eas)
        out.float().backward(dout.to(device).float() if autocast else dout.to(device, dt))
        grads = [p.grad for _, p in sorted(layer.named_parameters())]
        return [t.double().cpu() for t in (out.detach(), xs.grad, eas.grad, *grads)]

    want = result(exact, "cpu", False)
    got, theirs = result(ours, "cuda", True), result(pyg, "cuda", True)
    assert len(got) == len(want)
    for i, (a, b, w) in enumerate(zip(got, theirs, want)):
        assert relerr(a, w) <= 2 * relerr(b, w) + 1e-3, i


@pytest.mark.parametrize("dropout, pyg", [(0.0, False), (0.3, False), (0.3, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, c, f", [(8, 16, 16), (2, 64, 3), (3, 4, 5), (1, 256, 0)])
def test_edge_attention_matches_float64_on_multigraphs(dtype, heads, c, f, dropout, pyg):
    """trisparse.edge_attention on CUDA against the float64 per-edge oracle: outputs and the
    gradients of q, k, v, r and a on a multigraph with repeated pairs, empty rows, a hub row and a
    hub column (the heavy lines' kernels), with attention dropout drawn per input edge and head
    in the kernels (the oracle recomputes the draws: forward and backward saw the same mask, and
    the kept fraction is 1 - p within 3 standard errors) or, with pyg, as F.dropout over [E, H];
    the same bits on a second run."""
    rows, cols = 300, 250
    g = torch.Generator().manual_seed(11)
    ei = hub_multigraph(cols, rows, 7, 12, g)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(cols, rows))
    scale = 1 / math.sqrt(c)
    q, dout = (torch.randn(rows, heads, c, generator=g) for _ in range(2))
    k, v = (torch.randn(cols, heads, c, generator=g) for _ in range(2))
    r = torch.randn(rows, heads, f, generator=g) if f else None
    a = torch.randn(ei.shape[1], f, generator=g) if f else None
    dedge = torch.randn(rows, heads, f, generator=g) if f else None
    inputs = [t for t in (q, k, v, r, a) if t is not None]
    keep = edge_dropout_draws(13, ei.shape[1], heads, dropout, pyg, "cuda")
    if keep is not None:
        kept, n = float((keep > 0).double().mean()), keep.numel()
        assert abs(kept - (1 - dropout)) <= 3 * math.sqrt(dropout * (1 - dropout) / n)

    def step(device, dt):
        xs = [t.to(device, dt).requires_grad_() for t in inputs]
        qs, ks, vs = xs[:3]
        rs, as_ = (xs[3], xs[4]) if f else (None, None)
        if device == "cpu":
            out, out_edge = edge_attention_oracle(qs, ks, vs, rs, as_, ei, rows, scale, keep)
        else:
            torch.cuda.manual_seed(13)
            out, out_edge = trisparse.edge_attention(
                qs, ks, vs, pattern, scale, rs, as_, dropout=dropout, pyg_dropout=pyg
            )
        loss = (out * dout.to(device, out.dtype)).sum()
        if f:
            loss = loss + (out_edge * dedge.to(device, out_edge.dtype)).sum()
        loss.backward()
        res = [out.detach()] + ([out_edge.detach()] if f else []) + [x.grad for x in xs]
        return [t.double().cpu() for t in res]

    got, again = step("cuda", dtype), step("cuda", dtype)
    want = step("cpu", torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (x, y, z) in enumerate(zip(got, again, want)):
        assert torch.equal(x, y), i
        assert relerr(x, z) <= tol, i


def test_sparse_attention_past_2_31_entries_takes_the_multigraph_kernels(monkeypatch):
    """sparse_attention over a pattern of 2^31 entries or more runs the multigraph kernels (the
    threshold lowered here): out, lse and the gradients equal the fused path's within bf16."""
    from trisparse import attention as attention_module

    n = 2000
    ei = random_edge_index(n, n, 9, seed=51, self_loops=True).cuda()
    pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=n)
    q, k, v = (torch.randn(n, 4, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    up = torch.randn(n, 4, 32, device="cuda", dtype=torch.bfloat16)
    runs = []
    for threshold in (2**31 - 1, 0):
        monkeypatch.setattr(attention_module, "_WIDE_ENTRIES", threshold)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = trisparse.sparse_attention(*leaves, pattern, return_lse=True)
        grads = torch.autograd.grad(out, leaves, up)
        runs.append([out, lse, *grads])
    for a, b in zip(*runs, strict=True):
        assert relerr(a.float(), b.float()) <= 2e-2
    bias = torch.zeros(pattern.nnz, device="cuda")
    with pytest.raises(ValueError, match="2\\^31"):
        trisparse.sparse_attention(q, k, v, pattern, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, channels", [(1, 64), (4, 16), (1, 48), (2, 300)])
def test_neighbor_sum_on_cuda_against_float64(dtype, heads, channels):
    """The multigraph kernels' neighbour sum, both directions, on a multigraph with a hub (a
    heavy line of a block) against float64 on the CPU; x's gradient; bitwise repeatable."""
    n = 700
    ei = random_edge_index(n, n, 6, seed=31, self_loops=True)
    hub = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)])  # row 0 reads all
    ei = torch.cat([ei, ei[:, ::4], hub, hub.flip(0)], 1)
    p = trisparse.Pattern.from_edge_index(ei.cuda(), num_nodes=n)
    x = torch.randn(n, heads, channels, device="cuda").to(dtype)
    ref = x.double().cpu()
    for transposed in (False, True):
        at, of = (ei[0], ei[1]) if transposed else (ei[1], ei[0])
        want = torch.zeros_like(ref).index_add_(0, at, ref[of])
        got = trisparse.neighbor_sum(x, p, transposed)
        assert got.dtype == dtype
        assert relerr(got.double().cpu(), want) <= (1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(got, trisparse.neighbor_sum(x, p, transposed))
    xs = x.clone().requires_grad_()
    up = torch.randn(n, heads, channels, device="cuda").to(dtype)
    (dx,) = torch.autograd.grad(trisparse.neighbor_sum(xs, p), xs, up)
    want = torch.zeros_like(ref).index_add_(0, ei[0], up.double().cpu()[ei[1]])
    assert relerr(dx.double().cpu(), want) <= (1e-6 if dtype == torch.float32 else 1e-2)


def test_gcn_conv_over_a_pattern_on_cuda_matches_pyg():
    """GCNConv given a Pattern (the neighbour-sum path) on CUDA against PyG's over the same pairs:
    a multigraph with a hub and self loops, and an undirected from_sorted_csr pattern."""
    n = 3000
    ei = random_edge_index(n, n, 12, seed=45, self_loops=True)
    ei = torch.cat([ei, ei[:, ::7], torch.stack([torch.arange(n), torch.zeros(n).long()])], 1)
    ei = ei.cuda()
    torch.manual_seed(0)
    pyg = pyg_nn.GCNConv(32, 48).cuda()
    ours = trisparse.nn.GCNConv(32, 48).cuda()
    ours.load_state_dict(pyg.state_dict())
    x = torch.randn(n, 32, device="cuda")
    up = torch.randn(n, 48, device="cuda")
    pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=n)
    undirected = trisparse.Pattern.from_sorted_csr(pattern.rowptr, pattern.col, n).undirected()
    for graph, pairs in ((pattern, ei), (undirected, undirected.edge_index())):
        got, want = [], []
        for layer, g, into in ((ours, graph, got), (pyg, pairs, want)):
            xs = x.clone().requires_grad_()
            out = layer(xs, g)
            out.backward(up)
            into += [out.detach(), xs.grad, layer.lin.weight.grad.clone(), layer.bias.grad.clone()]
            layer.zero_grad()
        for a, b in zip(got, want, strict=True):
            assert relerr(a, b) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_edge_attention_reads_a_sorted_csr_in_place(dtype, dropout):
    """A pattern from Pattern.from_sorted_csr (no input pairs) runs edge_attention's forward on
    a plan without the by-source side (the CSR read in place, edge ids = positions) until a
    backward asks for the whole plan; outputs and gradients (in q's dtype, rounded once from the
    kernels' float32 sums) equal the same graph's given as edge_index, bit for bit, with dropout
    drawn per edge alike (input edge e = CSR position e)."""
    rows, cols, heads, c = 300, 250, 4, 16
    g = torch.Generator().manual_seed(31)
    ei = random_edge_index(cols, rows, 7, seed=32)
    hub = torch.stack([torch.randperm(cols, generator=g)[:200], torch.full((200,), 5)])
    ref = trisparse.Pattern.from_edge_index(torch.cat([ei, hub], dim=1), size=(cols, rows))
    in_csr = ref.edge_index().cuda()  # the graph's pairs in CSR order: input e = position e
    by_pairs = trisparse.Pattern.from_edge_index(in_csr, size=(cols, rows))
    p = trisparse.Pattern.from_sorted_csr(ref.rowptr.cuda(), ref.col.cuda(), cols)
    q = torch.randn(rows, heads, c, generator=g).cuda().to(dtype)
    k, v = (torch.randn(cols, heads, c, generator=g).cuda().to(dtype) for _ in range(2))
    dout = torch.randn(rows, heads, c, generator=g).cuda().to(dtype)

    def run(pattern, grad):
        xs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        torch.cuda.manual_seed(5)
        out, _ = trisparse.edge_attention(*xs, pattern, 0.25, dropout=dropout)
        if not grad:
            return [out]
        out.backward(dout)
        assert all(x.grad.dtype == dtype for x in xs)
        return [out.detach()] + [x.grad for x in xs]

    dev = torch.device("cuda", torch.cuda.current_device())
    forward_only = run(p, False)
    assert ("edge_attention_forward_plan", dev) in p._per_device
    assert ("edge_attention_plan", dev) not in p._per_device
    whole = run(p, True)
    assert ("edge_attention_plan", dev) in p._per_device
    want = run(by_pairs, True)
    assert torch.equal(forward_only[0], want[0])
    for i, (x, y) in enumerate(zip(whole, want, strict=True)):
        assert torch.equal(x, y), i


def test_edge_attention_runs_past_2_31_entries():
    """The multigraph forward over 2^31 + 2^19 entries (64-bit positions and offsets): 2^16 rows,
    each attending every one of 2^15 + 8 keys, read in place from a sorted CSR (8.6 GB of
    column ids). Rows whose entries lie past position 2^31 (the last ones) and the first rows
    equal float64 attention over all keys."""
    free, _total = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip(f"needs 16 GiB of free GPU memory, has {free / 2**30:.1f}")
    rows, keys, c = 1 << 16, (1 << 15) + 8, 4
    rowptr = torch.arange(rows + 1, dtype=torch.int64, device="cuda") * keys
    col = torch.arange(keys, dtype=torch.int32, device="cuda").repeat(rows)
    assert col.numel() > 2**31
    p = trisparse.Pattern.from_sorted_csr(rowptr, col, keys, check=False)
    g = torch.Generator().manual_seed(41)
    q = torch.randn(rows, 1, c, generator=g).cuda()
    k, v = (torch.randn(keys, 1, c, generator=g).cuda() for _ in range(2))
    with torch.no_grad():
        out, _ = trisparse.edge_attention(q, k, v, p, 0.5)
    del col, p
    picks = torch.tensor([0, 1, 2, rows - 3, rows - 2, rows - 1])
    s = 0.5 * q[picks, 0].double() @ k[:, 0].double().T
    want = torch.softmax(s, -1) @ v[:, 0].double()
    assert relerr(out[picks, 0].double(), want) <= 1e-5


def test_edge_attention_names_bad_arguments():
    ei = random_edge_index(20, 20, 3, seed=1)
    pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=20)
    q = torch.randn(20, 2, 16, device="cuda")
    r = torch.randn(20, 2, 4, device="cuda")
    with pytest.raises(ValueError, match="a must be"):
        trisparse.edge_attention(
            q, q, q, pattern, 0.25, r, torch.randn(ei.shape[1], 5, device="cuda")
        )
    with pytest.raises(ValueError, match="rows"):
        trisparse.edge_attention(q, q, q, pattern, 0.25, r, torch.randn(3, 4, device="cuda"))
    with pytest.raises(ValueError, match="r and a"):
        trisparse.edge_attention(q, q, q, pattern, 0.25, r, None)
    with pytest.raises(ValueError, match="dropout"):
        trisparse.edge_attention(q, q, q, pattern, 0.25, dropout=1.5)


def test_edge_attention_keeps_its_pattern_until_the_backward():
    """A Pattern made inside the call and dropped by the caller stays alive for the backward
    (GPS builds one per mini-batch)."""
    import gc

    ei = random_edge_index(30, 30, 4, seed=2)
    q = torch.randn(30, 2, 16, device="cuda", requires_grad=True)
    out, _ = trisparse.edge_attention(
        q, q, q, trisparse.Pattern.from_edge_index(ei, num_nodes=30), 0.25, dropout=0.2
    )
    gc.collect()
    out.sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, c, edge_term, dropout",
    [(8, 8, True, 0.0), (3, 16, True, 0.0), (2, 64, False, 0.0), (3, 16, True, 0.4)],
)
def test_edge_gat_attention_matches_float64_on_multigraphs(dtype, heads, c, edge_term, dropout):
    """GAT's attention over a multigraph (each copy its own term, a per-edge score term) on CUDA
    against the float64 per-edge oracle: outputs and the gradients of x, a_src, a_dst and a_edge,
    with heavy rows and columns and attention dropout; the same bits on a second run."""
    rows, cols = 260, 240
    g = torch.Generator().manual_seed(21)
    ei = hub_multigraph(cols, rows, 6, 22, g, hub=(3, 700), fan=(9, 300))
    pattern = trisparse.Pattern.from_edge_index(ei, size=(cols, rows))
    x = torch.randn(cols, heads, c, generator=g)
    a_src, a_dst = torch.randn(cols, heads, generator=g), torch.randn(rows, heads, generator=g)
    a_edge = torch.randn(ei.shape[1], heads, generator=g) if edge_term else None
    dout = torch.randn(rows, heads, c, generator=g)
    inputs = [t for t in (x, a_src, a_dst, a_edge) if t is not None]
    keep = edge_dropout_draws(23, ei.shape[1], heads, dropout, False, "cuda")

    def step(device, dt):
        xs = [
            t.to(
                device, dt if i == 0 else torch.float64 if dt == torch.float64 else torch.float32
            ).requires_grad_()
            for i, t in enumerate(inputs)
        ]
        ae = xs[3] if edge_term else None
        if device == "cpu":
            src, dst = ei
            z = xs[2][dst] + xs[1][src] + (0 if ae is None else ae)
            s = torch.nn.functional.leaky_relu(z, 0.2)
            m = torch.full((rows, heads), -math.inf, dtype=s.dtype)
            m = m.scatter_reduce(0, dst[:, None].expand_as(s), s, "amax")
            w = (s - m[dst]).exp()
            alpha = w / torch.zeros(rows, heads, dtype=s.dtype).index_add(0, dst, w)[dst]
            alpha = alpha if keep is None else alpha * keep
            out = torch.zeros(rows, heads, c, dtype=s.dtype).index_add(
                0, dst, alpha[..., None] * xs[0][src]
            )
        else:
            torch.cuda.manual_seed(23)
            out = trisparse.edge_gat_attention(xs[0], xs[1], xs[2], pattern, 0.2, ae, dropout)
        (out * dout.to(device, out.dtype)).sum().backward()
        return [t.double().cpu() for t in [out.detach()] + [t.grad for t in xs]]

    got, again = step("cuda", dtype), step("cuda", dtype)
    want = step("cpu", torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (a, b, w) in enumerate(zip(got, again, want)):
        assert torch.equal(a, b), i
        assert relerr(a, w) <= tol, i


def _captured_gps(channels, heads, dropout, recompute=False, edge_bias=False):
    """Two GPSConv layers (GINE over 3 edge features, BatchNorm; with edge_bias the edge features
    as the attention's bias too) and a graph-level linear head."""
    from torch_geometric.nn import global_add_pool

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.edge = torch.nn.Linear(3, channels)
            self.convs = torch.nn.ModuleList(
                trisparse.nn.GPSConv(
                    channels,
                    pyg_nn.GINEConv(torch.nn.Sequential(torch.nn.Linear(channels, channels))),
                    heads=heads,
                    attn_kwargs={"dropout": dropout},
                    recompute=recompute,
                    edge_bias=edge_bias,
                    edge_dim=channels if edge_bias else None,
                )
                for _ in range(2)
            )
            self.head = torch.nn.Linear(channels, 1)

        def forward(self, x, edge_index, edge_attr, batch, node_mask, num_graphs):
            e = self.edge(edge_attr)
            for conv in self.convs:
                x = conv(x, edge_index, batch, edge_attr=e, node_mask=node_mask)
            return self.head(global_add_pool(x, batch, size=num_graphs))

    return Model().cuda()


def _padded_batches(channels):
    """Four padded mini-batches of random molecules-sized graphs, two shapes, on the CPU."""
    from torch_geometric.data import Batch, Data
    from trisparse.nn.capture import pad_batch

    g = torch.Generator().manual_seed(11)
    out = []
    for count in (20, 31, 24, 29):
        graphs = []
        for _ in range(count):
            n = int(torch.randint(2, 40, (1,), generator=g))
            e = torch.randint(0, n, (2, 2 * n), generator=g)
            graphs.append(
                Data(
                    x=torch.randn(n, channels, generator=g),
                    edge_index=e,
                    edge_attr=torch.randn(2 * n, 3, generator=g),
                    y=torch.randn(1, 1, generator=g),
                )
            )
        data = Batch.from_data_list(graphs)
        big = count > 25  # two shapes
        p = pad_batch(data, 1536 if big else 1024, 3072 if big else 2048, 96 if big else 64)
        out.append((p.x, p.edge_index, p.edge_attr, p.batch, p.y, p.node_mask))
    return out


def _gps_step(model, opt):
    def step(x, edge_index, edge_attr, batch, y, node_mask):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            out = model(x, edge_index, edge_attr, batch, node_mask, y.size(0)).float()
        keep = ~torch.isnan(y)
        loss = torch.where(keep, out - torch.where(keep, y, 0.0), 0.0).square().sum() / keep.sum()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


@pytest.mark.parametrize("recompute, edge_bias", [(False, False), (True, False), (False, True)])
def test_captured_gps_training_step_equals_the_eager_steps(recompute, edge_bias):
    """trisparse.nn.capture: a GPS training step (GINE, segment attention under bf16 autocast,
    masked BatchNorm, Adam) captured per padded shape and replayed over four batches of two shapes
    gives the eager steps' losses and parameters (the warm-up leaves no trace: the first step
    starts from the same state), with two graphs captured; also with the captured layers'
    activations recomputed in the backward (GPSConv(recompute=True)), and with the edges as the
    attention's bias (the segment kernels' edge bias, its lists made in the graph)."""
    from trisparse.nn.capture import CapturedStep

    channels = 64
    torch.manual_seed(0)
    eager = _captured_gps(channels, heads=4, dropout=0.0, edge_bias=edge_bias)
    model = copy.deepcopy(eager)
    for conv in model.convs:
        conv.recompute = recompute
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, capturable=True) for m in (eager, model)]
    captured = CapturedStep(_gps_step(model, opts[1]), model, opts[1])
    eager_step = _gps_step(eager, opts[0])
    start = [p.detach().clone() for p in model.parameters()]
    for inputs in _padded_batches(channels):
        opts[0].zero_grad()
        want = eager_step(*(t.cuda() for t in inputs))
        got = captured(*inputs).clone()
        assert torch.isfinite(got) and abs(float(got - want)) <= 1e-2 * abs(float(want)) + 1e-5
    assert captured.num_graphs == 2
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3), name
    assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_captured_gps_step_redraws_attention_dropout():
    """Replays of one captured step (learning rate 0: the parameters stay) draw new attention
    dropout each time: the losses differ between replays of the same batch."""
    from trisparse.nn.capture import CapturedStep

    torch.manual_seed(0)
    model = _captured_gps(64, heads=4, dropout=0.5)
    for conv in model.convs:
        conv.dropout = 0.0  # only the attention's dropout
    opt = torch.optim.Adam(model.parameters(), lr=0.0, capturable=True)
    captured = CapturedStep(_gps_step(model, opt), model, opt)
    inputs = _padded_batches(64)[0]
    losses = [float(captured(*inputs)) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses) and len(set(losses)) == 3


def test_gps_recompute_redraws_the_same_attention_dropout_on_cuda():
    """GPSConv(recompute=True) on CUDA under bf16 autocast with attention dropout (the segment
    kernels' draws from torch's CUDA generator): the recomputation sees the forward's draws, so
    the gradients equal the plain layers' for the same seed."""
    torch.manual_seed(0)
    plain = _captured_gps(64, heads=4, dropout=0.5)
    twin = copy.deepcopy(plain)
    for conv in twin.convs:
        conv.recompute = True
    x, ei, ea, batch, y, mask = (t.cuda() for t in _padded_batches(64)[1])
    grads = []
    for model in (plain, twin):
        torch.manual_seed(5)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, ei, ea, batch, mask, y.size(0)).float()
        out[: int((~y.isnan()).sum())].square().sum().backward()
        grads.append([p.grad.float() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-4)


def test_captured_steps_of_successive_models_hold_no_memory_after_they_go():
    """Training one model after another in a process (seeds, sweeps), each with its CapturedStep:
    once a model, its optimizer and its step are gone, the memory they held is free again; the
    third model's leaves what the second's left (no cuBLAS workspace or graph kept per step)."""
    import gc

    from trisparse.nn.capture import CapturedStep

    inputs = _padded_batches(64)[:2]
    held = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = _captured_gps(64, heads=4, dropout=0.0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
        captured = CapturedStep(_gps_step(model, opt), model, opt)
        for batch in inputs:
            assert math.isfinite(float(captured(*batch)))
        del model, opt, captured
        gc.collect()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert held[2] <= held[1], held


_EVALUATE_ON_THE_CAPTURE_STREAM = """
import sys
import torch, trisparse.nn
from torch_geometric.nn import GINEConv
from trisparse.nn.capture import CapturedStep, capture_stream, pad_batch
from torch_geometric.data import Batch, Data

torch.manual_seed(0)
conv = trisparse.nn.GPSConv(64, GINEConv(torch.nn.Linear(64, 64), edge_dim=3), heads=4)
model = torch.nn.ModuleDict({"conv": conv, "head": torch.nn.Linear(64, 1)}).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
g = torch.Generator().manual_seed(3)
graphs = []
for _ in range(24):
    n = int(torch.randint(2, 30, (1,), generator=g))
    graphs.append(Data(x=torch.randn(n, 64, generator=g), edge_attr=torch.randn(2 * n, 3,
        generator=g), edge_index=torch.randint(0, n, (2, 2 * n), generator=g), y=torch.randn(1, 1)))
p = pad_batch(Batch.from_data_list(graphs), 1024, 2048, 64)

def forward(x, edge_index, edge_attr, batch, node_mask, graphs):
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        x = model["conv"](x, edge_index, batch, edge_attr=edge_attr, node_mask=node_mask)
    pooled = torch.zeros(graphs, 64, device=x.device).index_add_(0, batch, x.float())
    return model["head"](pooled)

def step(x, edge_index, edge_attr, batch, y, node_mask):
    out = forward(x, edge_index, edge_attr, batch, node_mask, y.size(0))
    loss = torch.where(y.isnan(), 0.0, out - y.nan_to_num()).square().sum()
    loss.backward()
    opt.step()
    return loss.detach()

captured = CapturedStep(step, model, opt)
inputs = (p.x, p.edge_index, p.edge_attr, p.batch, p.y, p.node_mask)
for _ in range(2):
    captured(*inputs)
torch.cuda.synchronize()

def evaluate():
    model.eval()
    with torch.no_grad():
        d = [t.cuda() for t in (p.x, p.edge_index, p.edge_attr, p.batch, p.node_mask)]
        out = forward(*d, p.y.size(0)).float().cpu()
    model.train()
    torch.cuda.synchronize()
    return out

held = torch.cuda.memory_allocated()
with capture_stream():
    on_side = evaluate()
side = torch.cuda.memory_allocated()
on_default = evaluate()
default = torch.cuda.memory_allocated()
assert torch.allclose(on_side, on_default, rtol=1e-3, atol=1e-4), "either stream, one result"
# An eager backward on autograd's device thread, on the captured steps' stream: a workspace of
# its own, unless the captured steps' backward ran on that thread.
with capture_stream():
    out = forward(*[t.cuda() for t in (p.x, p.edge_index, p.edge_attr, p.batch, p.node_mask)],
        p.y.size(0))
    out.nan_to_num().square().sum().backward()
torch.cuda.synchronize()
threaded = torch.cuda.memory_allocated()
print((side - held) / 2**20, (default - side) / 2**20, (threaded - default) / 2**20)
"""


def test_captured_steps_and_their_evaluation_share_one_cublas_workspace():
    """trisparse.nn.capture (in a fresh process): a model trained by a CapturedStep and evaluated
    under capture_stream holds no more memory afterwards, where the same evaluation on the
    default stream holds torch's cuBLAS workspace for that stream (the control; skipped where
    this torch keeps none), and an eager backward on autograd's device thread on the captured
    steps' stream makes one too (the captured backward ran on the calling thread, sharing the
    forward's); both evaluations give the same outputs."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _EVALUATE_ON_THE_CAPTURE_STREAM],
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    side_mib, default_mib, threaded_mib = map(float, child.stdout.split()[-3:])
    if default_mib < 8.0:
        pytest.skip(f"no cuBLAS workspace per stream in this torch ({default_mib} MiB)")
    assert side_mib < 1.0, (side_mib, default_mib, threaded_mib)
    assert threaded_mib >= 8.0, (side_mib, default_mib, threaded_mib)


@pytest.mark.parametrize("heads,a,b", [(8, 16, 16), (3, 5, 7), (4, 32, 8)])
def test_head_product_kernels_equal_float64(heads, a, b):
    """TransformerConv's per-head W_e products on CUDA (`_per_head`, `_head_outer`: trisparse's
    kernels for float32 widths up to 32) on a strided view as the projection's split gives it,
    rows past several 1,024-row chunks: within float32 rounding of float64, the weight gradient
    bitwise the same on a second run, and the autograd Function's gradients equal float64's."""
    from trisparse.nn.conv import _common

    gen = torch.Generator(device="cuda").manual_seed(11)
    rows = 5000
    y = torch.randn(rows, heads * a * 3, generator=gen, device="cuda")
    x = y[:, heads * a : 2 * heads * a].view(rows, heads, a)  # a strided view, like a split
    w = torch.randn(heads, a, b, generator=gen, device="cuda")
    g = torch.randn(rows, heads, b, generator=gen, device="cuda")
    assert _common._library_takes(x, a, b)
    got = _common._per_head(x, w)
    want = torch.einsum("nha,hab->nhb", x.double(), w.double())
    assert relerr(got.double(), want) < 1e-6
    dw = _common._head_outer(x, g)
    assert relerr(dw.double(), torch.einsum("nha,nhb->hab", x.double(), g.double())) < 1e-5
    assert torch.equal(dw, _common._head_outer(x, g))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    _common._HeadProduct.apply(xg, wg).backward(g)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    torch.einsum("nha,hab->nhb", x64, w64).backward(g.double())
    assert relerr(xg.grad.double(), x64.grad) < 1e-6
    assert relerr(wg.grad.double(), w64.grad) < 1e-5


def test_projection_under_autocast_keeps_x_in_float32():
    """TransformerConv's projection of many rows under bf16 autocast (_linear): the output bitwise
    F.linear's under autocast, with x saved for the backward as the float32 input (no [N, in]
    16-bit copy kept); the gradients of x, the weight and the bias written in float32 by the
    products themselves (the bias's as a column of the weight's): within float32 accumulation of
    the float64 products of the same 16-bit operands, where autocast's are rounded to bf16."""
    from trisparse.nn.conv import _common

    gen = torch.Generator(device="cuda").manual_seed(21)
    rows = _common._AUTOCAST_KERNEL_ROWS + 5
    x = torch.randn(rows, 32, generator=gen, device="cuda")
    w = torch.randn(64, 32, generator=gen, device="cuda")
    b = torch.randn(64, generator=gen, device="cuda")
    g = torch.randn(rows, 64, generator=gen, device="cuda").bfloat16()

    def run(linear):
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
            out = linear(*leaves)
        out.backward(g)
        return [out.detach()] + [t.grad for t in leaves], saved

    got, saved = run(_common._linear)
    want, saved_autocast = run(torch.nn.functional.linear)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    g64, x16, w16 = g.double(), x.bfloat16().double(), w.bfloat16().double()
    exact = [g64 @ w16, g64.t() @ x16, g64.sum(0)]  # dx, dw, db of the 16-bit operands
    for ours, autocast, e in zip(got[1:], want[1:], exact, strict=True):
        assert ours.dtype == autocast.dtype == torch.float32 and ours.shape == autocast.shape
        assert relerr(ours.double(), e) < 1e-5 <= relerr(autocast.double(), e)
    assert (torch.bfloat16, (rows, 32)) in saved_autocast
    assert (torch.bfloat16, (rows, 32)) not in saved and (torch.float32, (rows, 32)) in saved


def test_head_product_under_autocast_takes_the_float32_kernels_on_few_rows():
    """Under bf16 autocast a product over 4,096 to 65,535 rows runs the float32 kernels (cast in,
    result in x's dtype): the result and the gradients of x and w within bf16 rounding of float64's,
    in the dtypes the block-diagonal GEMM gives (x's, w's)."""
    from trisparse.nn.conv import _common

    gen = torch.Generator(device="cuda").manual_seed(12)
    rows, heads, a, b = 5000, 8, 16, 16
    x = torch.randn(rows, heads, a, generator=gen, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(heads, a, b, generator=gen, device="cuda", requires_grad=True)
    g = torch.randn(rows, heads, b, generator=gen, device="cuda").bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert _common._few_rows_under_autocast(x, w)
        out = _common._head_product(x, w)
    assert out.dtype == torch.bfloat16
    out.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.einsum("nha,hab->nhb", x64, w64)
    want.backward(g.double())
    assert relerr(out.detach().double(), want.detach()) < 1e-2
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert relerr(x.grad.double(), x64.grad) < 1e-2
    assert relerr(w.grad.double(), w64.grad) < 1e-5
