"""trisparse.edge_spmm, sddmm, edge_softmax and edge_scores: against dense float64 sums and
PyG's softmax, gradcheck, opcheck, bitwise-repeatable gradients (CPU and CUDA), bad inputs."""

import math

import pytest
import torch
import trisparse
from conftest import (
    edge_attention_oracle,
    edge_dropout_draws,
    hub_multigraph,
    philox_edge_factors,
    random_edge_index,
)


def pattern_and_entries(num_src, num_dst, seed):
    ei = random_edge_index(num_src, num_dst, 6, seed=seed)  # empty rows and columns
    p = trisparse.Pattern.from_edge_index(ei, size=(num_src, num_dst))
    row, col = p.entries(torch.device("cpu"))
    return p, row, col


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed", [False, True])
def test_edge_spmm_matches_the_sum_over_entries(dtype, transposed):
    p, row, col = pattern_and_entries(37, 29, 3)
    heads, c = 3, 5
    g = torch.Generator().manual_seed(4)
    values = torch.randn(p.nnz, heads, generator=g).to(dtype)
    n_in = p.num_rows if transposed else p.num_cols
    b = torch.randn(n_in, heads, c, generator=g).to(dtype)
    out = trisparse.edge_spmm(values, b, p, transposed=transposed)
    dst, src = (col, row) if transposed else (row, col)
    n_out = p.num_cols if transposed else p.num_rows
    want = torch.zeros(n_out, heads, c, dtype=torch.float64)
    want.index_add_(0, dst, values.double()[:, :, None] * b.double()[src])
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6)


def test_sddmm_matches_the_dot_products():
    p, row, col = pattern_and_entries(40, 33, 5)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(33, 2, 7, generator=g), torch.randn(40, 2, 7, generator=g)
    s = trisparse.sddmm(x, y, p)
    assert s.shape == (p.nnz, 2)
    assert torch.allclose(s.double(), (x.double()[row] * y.double()[col]).sum(-1), atol=1e-5)


def test_gradients():
    p, _, _ = pattern_and_entries(23, 19, 7)
    g = torch.Generator().manual_seed(8)
    values = torch.randn(p.nnz, 2, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(23, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bt = torch.randn(19, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(19, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, m: trisparse.edge_spmm(v, m, p), (values, b))
    assert torch.autograd.gradcheck(lambda v, m: trisparse.edge_spmm(v, m, p, True), (values, bt))
    assert torch.autograd.gradcheck(lambda a, m: trisparse.sddmm(a, m, p), (x, b))
    torch.library.opcheck(torch.ops.trisparse.edge_spmm.default, (values, b, p.id, False))
    torch.library.opcheck(torch.ops.trisparse.sddmm.default, (x, b, p.id))


def test_gradients_repeat_bit_for_bit():
    p, _, _ = pattern_and_entries(300, 300, 9)
    g = torch.Generator().manual_seed(10)
    values = torch.randn(p.nnz, 4, generator=g)
    b = torch.randn(300, 4, 16, generator=g)
    dout = torch.randn(300, 4, 16, generator=g)

    def grads():
        v, m = values.clone().requires_grad_(), b.clone().requires_grad_()
        trisparse.edge_spmm(v, m, p).backward(dout)
        return v.grad, m.grad

    for a, c in zip(grads(), grads(), strict=True):
        assert torch.equal(a, c)


def test_edge_softmax_and_scores_match_pyg_and_gradcheck():
    softmax = pytest.importorskip("torch_geometric.utils").softmax
    p, row, col = pattern_and_entries(31, 27, 13)  # rows without entries too
    g = torch.Generator().manual_seed(14)
    s = torch.randn(p.nnz, 3, generator=g, dtype=torch.float64, requires_grad=True)
    dst = torch.randn(27, 3, generator=g, dtype=torch.float64, requires_grad=True)
    src = torch.randn(31, 3, generator=g, dtype=torch.float64, requires_grad=True)
    want = softmax(s, row, num_nodes=p.num_rows)
    assert torch.allclose(trisparse.edge_softmax(s, p), want, rtol=1e-12, atol=1e-15)
    assert torch.equal(trisparse.edge_scores(dst, src, p), dst[row] + src[col])
    assert torch.autograd.gradcheck(lambda t: trisparse.edge_softmax(t, p), (s,))
    assert torch.autograd.gradcheck(lambda a, b: trisparse.edge_scores(a, b, p), (dst, src))


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_and_score_gradients_repeat_bit_for_bit(device):
    # One hub row of 3,000 entries, so that a reduction in another order would show.
    ei = random_edge_index(3000, 400, 8, seed=15)
    hub = torch.stack([torch.arange(3000), torch.zeros(3000, dtype=torch.int64)])
    p = trisparse.Pattern.from_edge_index(torch.cat([ei, hub], 1).unique(dim=1), size=(3000, 400))
    g = torch.Generator().manual_seed(16)
    dst, src = torch.randn(400, 4, generator=g), torch.randn(3000, 4, generator=g)
    dp = torch.randn(p.nnz, 4, generator=g).to(device)

    def grads():
        a, b = dst.to(device).requires_grad_(), src.to(device).requires_grad_()
        trisparse.edge_softmax(trisparse.edge_scores(a, b, p), p).backward(dp)
        return a.grad, b.grad

    for a, c in zip(grads(), grads(), strict=True):
        assert torch.equal(a, c)


def test_bad_inputs_name_the_argument():
    p, _, _ = pattern_and_entries(10, 8, 11)
    b = torch.randn(10, 2, 3)
    with pytest.raises(ValueError, match="values"):
        trisparse.edge_spmm(torch.randn(p.nnz + 1, 2), b, p)
    with pytest.raises(ValueError, match="b must have shape"):
        trisparse.edge_spmm(torch.randn(p.nnz, 2), torch.randn(9, 2, 3), p)
    with pytest.raises(TypeError, match="pattern"):
        trisparse.edge_spmm(torch.randn(p.nnz, 2), b, "not a pattern")
    with pytest.raises(ValueError, match="x and y"):
        trisparse.sddmm(torch.randn(8, 2, 3), torch.randn(10, 2, 4), p)
    with pytest.raises(ValueError, match="scores"):
        trisparse.edge_softmax(torch.randn(p.nnz + 1, 2), p)
    with pytest.raises(ValueError, match="dst must have"):
        trisparse.edge_scores(torch.randn(9, 2), torch.randn(10, 2), p)


def _gat_by_hand(x, src, dst, p, slope, keep):
    """GAT's attention from the definition: per target, PyG's softmax of the LeakyReLU'd scores."""
    from torch_geometric.utils import softmax

    row, col = p.entries(torch.device("cpu"))
    e = torch.nn.functional.leaky_relu(dst[row] + src[col], slope)
    a = softmax(e, row, num_nodes=p.num_rows)
    if keep is not None:
        a = a * keep
    out = torch.zeros(p.num_rows, *x.shape[1:], dtype=x.dtype)
    return out.index_add_(0, row, a[:, :, None] * x[col])


@pytest.mark.parametrize("dropout", [False, True])
def test_gat_attention_matches_its_definition_and_gradcheck(dropout):
    pytest.importorskip("torch_geometric")
    p, _row, _col = pattern_and_entries(31, 26, 13)
    g = torch.Generator().manual_seed(14)
    heads, c = 3, 4
    x = torch.randn(31, heads, c, generator=g, dtype=torch.float64, requires_grad=True)
    src = torch.randn(31, heads, generator=g, dtype=torch.float64, requires_grad=True)
    dst = torch.randn(26, heads, generator=g, dtype=torch.float64, requires_grad=True)
    keep = (torch.rand(p.nnz, heads, generator=g) > 0.4).double() / 0.6 if dropout else None
    out = trisparse.gat_attention(x, src, dst, p, 0.2, keep)
    assert torch.allclose(out, _gat_by_hand(x, src, dst, p, 0.2, keep), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x, s, d: trisparse.gat_attention(x, s, d, p, 0.2, keep), (x, src, dst)
    )
    out32 = trisparse.gat_attention(x.float(), src.float(), dst.float(), p, 0.2, keep)
    assert out32.dtype == torch.float32
    assert torch.allclose(out32.double(), out, rtol=1e-5, atol=1e-6)
    if keep is not None:  # the same factors stored in another row order, with keep_order
        perm = torch.randperm(p.nnz, generator=g)
        order = torch.empty_like(perm)
        order[perm] = torch.arange(p.nnz)
        again = trisparse.gat_attention(x, src, dst, p, 0.2, keep[perm], keep_order=order)
        assert torch.equal(again, out)
    args = (x.detach().float(), src.detach().float(), dst.detach().float(), None, None, p.id, 0.2)
    torch.library.opcheck(torch.ops.trisparse.gat_attention.default, (*args, 0.0, None))
    state = torch.tensor([5, 6], dtype=torch.int64)
    torch.library.opcheck(torch.ops.trisparse.gat_attention.default, (*args, 0.25, state))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gat_attention_draws_its_dropout(dtype):
    """gat_attention(dropout=p) on the CPU draws as the CUDA kernels do (Philox: the entry's
    input edge u = keep_order[e], or e, in head h: philox_edge_factors), from a state taken from torch's
    generator: the output and gradients equal the definition with those factors recomputed here,
    forward and backward see the same draws (gradcheck given the seed), and the kept fraction is
    1 - p within 3 standard errors."""
    pytest.importorskip("torch_geometric")
    p, _row, _col = pattern_and_entries(200, 150, 21)
    g = torch.Generator().manual_seed(22)
    heads, c, drop = 3, 4, 0.3
    x = torch.randn(200, heads, c, generator=g, dtype=torch.float64, requires_grad=True)
    src = torch.randn(200, heads, generator=g, dtype=torch.float64, requires_grad=True)
    dst = torch.randn(150, heads, generator=g, dtype=torch.float64, requires_grad=True)
    order = p.input_order(torch.device("cpu"))[1]
    for keep_order, u in ((None, torch.arange(p.nnz)), (order, order)):
        torch.manual_seed(23)
        state = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)
        keep = philox_edge_factors(u, heads, state, drop)
        kept, n = float((keep > 0).double().mean()), keep.numel()
        assert abs(kept - (1 - drop)) <= 3 * math.sqrt(drop * (1 - drop) / n)
        want = _gat_by_hand(x, src, dst, p, 0.2, keep)
        dout = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, (x, src, dst), dout)

        def run(x, s, d, keep_order=keep_order):
            torch.manual_seed(23)
            return trisparse.gat_attention(x, s, d, p, 0.2, keep_order=keep_order, dropout=drop)

        xs = [t.detach().to(dtype).requires_grad_() for t in (x, src, dst)]
        out = run(*xs)
        grads = torch.autograd.grad(out, xs, dout.to(dtype))
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for a, b in zip((out, *grads), (want, *want_grads)):
            assert torch.allclose(a.double(), b, rtol=tol, atol=tol)
        if dtype == torch.float64:
            assert torch.autograd.gradcheck(run, (x, src, dst))
    with pytest.raises(ValueError, match="not both"):
        trisparse.gat_attention(x, src, dst, p, keep=torch.ones(p.nnz, heads), dropout=0.1)
    with pytest.raises(ValueError, match="dropout must be in"):
        trisparse.gat_attention(x, src, dst, p, dropout=1.0)


def test_gat_attention_names_bad_inputs():
    p, _row, _col = pattern_and_entries(31, 26, 13)
    x, src, dst = torch.randn(31, 2, 4), torch.randn(31, 2), torch.randn(26, 2)
    with pytest.raises(ValueError, match="a_dst must have 26 rows"):
        trisparse.gat_attention(x, src, torch.randn(31, 2), p)
    with pytest.raises(ValueError, match="keep must be"):
        trisparse.gat_attention(x, src, dst, p, keep=torch.ones(3, 2))
    with pytest.raises(TypeError, match="trisparse.Pattern"):
        trisparse.gat_attention(x, src, dst, None)


@pytest.mark.parametrize("dropout, pyg", [(0.0, False), (0.3, False), (0.3, True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, c, f", [(8, 16, 16), (3, 5, 7), (2, 12, 0)])
def test_edge_attention_on_the_cpu_matches_float64(dtype, heads, c, f, dropout, pyg):
    """trisparse.edge_attention's CPU engine against the float64 per-edge oracle: outputs and the
    gradients of q, k, v, r and a on a multigraph with repeated pairs, empty rows and a hub row
    and column, any head width and feature count; attention dropout drawn as the CUDA kernels
    draw it (the oracle recomputes the draws: forward and backward saw the same mask) or, with
    pyg, as F.dropout over [E, H]; the same bits on a second run."""
    rows, cols = 90, 70
    g = torch.Generator().manual_seed(21)
    ei = hub_multigraph(cols, rows, 6, 22, g, hub=(5, 200), fan=(7, 150))
    ei = ei[:, ei[1] % 11 != 3]  # targets without edges
    pattern = trisparse.Pattern.from_edge_index(ei, size=(cols, rows))
    scale = 1 / math.sqrt(c)
    q, dout = (torch.randn(rows, heads, c, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(cols, heads, c, generator=g, dtype=torch.float64) for _ in range(2))
    r = torch.randn(rows, heads, f, generator=g, dtype=torch.float64) if f else None
    a = torch.randn(ei.shape[1], f, generator=g, dtype=torch.float64) if f else None
    dedge = torch.randn(rows, heads, f, generator=g, dtype=torch.float64) if f else None
    inputs = [t for t in (q, k, v, r, a) if t is not None]
    draws = torch.float64 if dtype == torch.float64 else torch.float32
    keep = edge_dropout_draws(13, ei.shape[1], heads, dropout, pyg, "cpu", draws)

    def step(dt, oracle=False):
        xs = [t.to(dt).requires_grad_() for t in inputs]
        qs, ks, vs = xs[:3]
        rs, as_ = (xs[3], xs[4]) if f else (None, None)
        if oracle:
            out, out_edge = edge_attention_oracle(qs, ks, vs, rs, as_, ei, rows, scale, keep)
        else:
            torch.manual_seed(13)
            out, out_edge = trisparse.edge_attention(
                qs, ks, vs, pattern, scale, rs, as_, dropout=dropout, pyg_dropout=pyg
            )
        loss = (out * dout.to(out.dtype)).sum()
        if f:
            loss = loss + (out_edge * dedge.to(out_edge.dtype)).sum()
        loss.backward()
        res = [out.detach()] + ([out_edge.detach()] if f else []) + [x.grad for x in xs]
        return [t.double() for t in res]

    got, again, want = step(dtype), step(dtype), step(torch.float64, oracle=True)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for i, (x, y, z) in enumerate(zip(got, again, want)):
        assert torch.equal(x, y), i
        assert ((x - z).norm() / z.norm()).item() <= tol, i


@pytest.mark.parametrize("shared, features", [(False, 0), (True, 0), (False, 3)])
def test_edge_attention_bias_equals_sparse_attentions_bias(shared, features):
    """edge_attention(bias=) (the score term with one-hot r and the bias as a) against
    sparse_attention(bias=) over a graph without repeated pairs, the bias moved to the entries'
    order, in float64: outputs and the gradients of q, k, v and the bias (and with edge features,
    those of r and a unchanged by the bias's columns)."""
    heads, c, n = 3, 8, 40
    ei = random_edge_index(n, n, 6, seed=11)
    pattern = trisparse.Pattern.from_edge_index(ei, n)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, heads, c, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(ei.shape[1], *(() if shared else (heads,)), generator=g).double()
    r = torch.randn(n, heads, features, generator=g, dtype=torch.float64)
    a = torch.randn(ei.shape[1], features, generator=g, dtype=torch.float64)
    dout = torch.randn(n, heads, c, generator=g, dtype=torch.float64)
    entry = pattern.entries_of(ei)

    def run(fn, *tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    def ours(q, k, v, b, *ra):
        out, out_edge = trisparse.edge_attention(
            q, k, v, pattern, 0.3, *(ra or (None, None)), bias=b
        )
        assert out_edge is None if not ra else out_edge.shape == (n, heads, features)
        return out

    def theirs(q, k, v, b, *ra):
        if ra:  # the features' score term as a bias too: r_i . a_e per head
            b = b.expand(ei.shape[1], heads) + torch.einsum("ehf,ef->eh", ra[0][ei[1]], ra[1])
        at = torch.empty_like(b).index_copy_(0, entry, b)
        return trisparse.sparse_attention(q, k, v, pattern, scale=0.3, bias=at)

    got = run(ours, q, k, v, bias)
    for x, y in zip(got, run(theirs, q, k, v, bias)):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    if features:
        got = run(ours, q, k, v, bias, r, a)
        for x, y in zip(got, run(theirs, q, k, v, bias, r, a)):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"bias must be \[E\] or \[E, heads\]"):
        trisparse.edge_attention(q, k, v, pattern, 0.3, bias=bias[:-1])
