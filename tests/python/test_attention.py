"""trisparse.sparse_attention and its torch ops: forward and gradients against a dense float64
oracle, opcheck, gradcheck, torch.compile, bad inputs."""

import math

import pytest
import torch
import trisparse
from conftest import dense_attention, dense_attention_in, load_shared_graph, random_edge_index


def qkv(n_dst, n_src, heads, d, dv, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n_dst, heads, d, generator=g) * scale).to(dtype)
    k = (torch.randn(n_src, heads, d, generator=g) * scale).to(dtype)
    v = torch.randn(n_src, heads, dv, generator=g).to(dtype)
    return q, k, v


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def relerr(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 40, 1, 16, 16), (37, 53, 3, 32, 8), (1, 17, 2, 8, 24)])
def test_forward_and_gradients_match_dense_float64(dtype, shape):
    n_dst, n_src, heads, d, dv = shape
    ei = random_edge_index(n_src, n_dst, 9, seed=n_dst + heads)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(n_src, n_dst))
    q, k, v = qkv(n_dst, n_src, heads, d, dv, dtype, seed=7)
    dout = torch.randn(n_dst, heads, dv, generator=torch.Generator().manual_seed(8)).to(dtype)
    scale = 1 / math.sqrt(d)
    got = grads(lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern), q, k, v, dout)
    want = grads(lambda a, b, c: dense_attention(a, b, c, ei, scale), q, k, v, dout.double())
    # The house rule: within 2x the error of the same computation done densely by PyTorch in the
    # input precision (float64 against the oracle itself: to rounding).
    if dtype == torch.float64:
        tols = [1e-12] * 4
    else:
        same = grads(lambda a, b, c: dense_attention_in(a, b, c, ei, scale), q, k, v, dout)
        tols = [2 * relerr(s, w) + 1e-6 for s, w in zip(same, want)]
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, tols):
        assert g.dtype == dtype, name
        assert torch.isfinite(g).all(), name
        assert relerr(g, w) <= tol, (name, relerr(g, w), tol)
    # Rows without edges: zero output and zero dq; columns without edges: zero dk and dv.
    empty_rows = torch.bincount(ei[1], minlength=n_dst) == 0
    empty_cols = torch.bincount(ei[0], minlength=n_src) == 0
    assert empty_rows.any() or n_dst == 1
    assert (got[0][empty_rows] == 0).all() and (got[1][empty_rows] == 0).all()
    if empty_cols.any():
        assert (got[2][empty_cols] == 0).all() and (got[3][empty_cols] == 0).all()


def test_gradients_are_bitwise_deterministic():
    ei = random_edge_index(300, 300, 40, seed=3)
    pattern = trisparse.Pattern.of(ei, num_nodes=300)
    q, k, v = qkv(300, 300, 4, 32, 32, torch.float32, seed=4)
    dout = torch.randn(300, 4, 32)
    runs = [
        grads(lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern), q, k, v, dout)
        for _ in range(3)
    ]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)


def test_gradcheck_float64():
    ei = random_edge_index(12, 9, 5, seed=5, self_loops=True)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(12, 9))
    q, k, v = (t.requires_grad_() for t in qkv(9, 12, 2, 6, 5, torch.float64, seed=6))
    assert torch.autograd.gradcheck(
        lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern, scale=0.7), (q, k, v)
    )


def test_log_sum_exp():
    ei = random_edge_index(50, 50, 6, seed=9)
    pattern = trisparse.Pattern.of(ei, num_nodes=50)
    q, k, v = qkv(50, 50, 2, 16, 16, torch.float64, seed=10)
    _out, lse = trisparse.sparse_attention(q, k, v, pattern, scale=0.25, return_lse=True)
    mask = torch.zeros(50, 50, dtype=torch.bool)
    mask[ei[1], ei[0]] = True
    s = (torch.einsum("ihd,jhd->ihj", q, k) * 0.25).masked_fill(~mask[:, None, :], -math.inf)
    want = torch.logsumexp(s, dim=-1)
    assert lse.shape == (50, 2) and lse.dtype == torch.float64
    assert torch.equal(torch.isinf(lse), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(lse[finite], want[finite], rtol=1e-12, atol=1e-12)
    _out32, lse32 = trisparse.sparse_attention(q.float(), k.float(), v.float(), pattern, 0.25, True)
    assert lse32.dtype == torch.float32
    assert torch.allclose(lse32[finite].double(), want[finite], rtol=1e-5, atol=1e-5)


def test_scores_near_1e4_and_a_heavy_row():
    # One target with every source (a hub), scores of size ~1e4: no overflow, no NaN.
    n = 3000
    src = torch.arange(n)
    ei = torch.cat(
        [torch.stack([src, torch.zeros(n, dtype=torch.long)]), random_edge_index(n, n, 3, seed=11)],
        dim=1,
    )
    key = torch.unique(ei[1] * n + ei[0])
    ei = torch.stack([key % n, key // n])
    pattern = trisparse.Pattern.of(ei, num_nodes=n)
    q, k, v = qkv(n, n, 1, 16, 16, torch.float32, seed=12, scale=25.0)
    dout = torch.randn(n, 1, 16)
    got = grads(
        lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern, scale=1.0), q, k, v, dout
    )
    want = grads(lambda a, b, c: dense_attention(a, b, c, ei, 1.0), q, k, v, dout.double())
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert relerr(g, w) <= 1e-3


def test_shared_graph_cora():
    ei, n = load_shared_graph("cora")
    pattern = trisparse.Pattern.of(ei, num_nodes=n)
    q, k, v = qkv(n, n, 2, 32, 32, torch.float32, seed=13)
    dout = torch.randn(n, 2, 32)
    got = grads(lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern), q, k, v, dout)
    want = grads(
        lambda a, b, c: dense_attention(a, b, c, ei, 1 / math.sqrt(32)), q, k, v, dout.double()
    )
    for g, w in zip(got, want):
        assert relerr(g, w) <= 2e-5


def test_opcheck():
    ei = random_edge_index(20, 20, 5, seed=14)
    pattern = trisparse.Pattern.of(ei, num_nodes=20)
    for dtype in (torch.float32, torch.float64):
        bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        for bias in (None, torch.randn(pattern.nnz, 2, dtype=bias_dtype, requires_grad=True)):
            q, k, v = (t.requires_grad_() for t in qkv(20, 20, 2, 8, 8, dtype, seed=15))
            args = (q, k, v, bias, pattern.id, 0.5, True, True)
            torch.library.opcheck(torch.ops.trisparse.sparse_attention.default, args)
            out, lse = torch.ops.trisparse.sparse_attention(*args)
            dout = torch.randn_like(out)
            b = None if bias is None else bias.detach()
            torch.library.opcheck(
                torch.ops.trisparse.sparse_attention_backward.default,
                (
                    q.detach(),
                    k.detach(),
                    v.detach(),
                    out.detach(),
                    lse,
                    dout,
                    b,
                    pattern.id,
                    0.5,
                    b is not None,
                ),
            )


@pytest.mark.parametrize("shared", [False, True])
def test_bias_gradcheck(shared):
    """A per-entry score bias ([nnz, H], or [nnz] shared by the heads) in float64: gradcheck of
    q, k, v and the bias through the reference."""
    ei = random_edge_index(14, 11, 4, seed=31)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(14, 11))
    q, k, v = (t.requires_grad_() for t in qkv(11, 14, 2, 5, 3, torch.float64, seed=32))
    shape = (pattern.nnz,) if shared else (pattern.nnz, 2)
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: trisparse.sparse_attention(a, b, c, pattern, scale=0.6, bias=d),
        (q, k, v, bias),
    )


def dense_biased(q, k, v, pattern, bias, scale):
    """softmax(scale q k^T + bias) v over the pattern, densely in float64 (bias [nnz, H])."""
    row, col = pattern.entries(torch.device("cpu"))
    heads = q.shape[1]
    s = torch.full((heads, pattern.num_rows, pattern.num_cols), -math.inf, dtype=torch.float64)
    sc = scale * torch.einsum("rhd,chd->hrc", q.double(), k.double())
    s[:, row, col] = sc[:, row, col] + bias.double().t()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hrc,chd->rhd", p, v.double())


def test_bias_engine_matches_reference_and_repeats_count():
    """The float32 CPU engine with a bias against a dense float64 computation (forward, and the
    gradients of q, k, v and bias, bitwise repeatable); a log-count bias equals the pattern with
    each entry repeated (each copy a softmax term)."""
    ei = random_edge_index(40, 30, 6, seed=33)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(40, 30))
    q, k, v = (t.requires_grad_() for t in qkv(30, 40, 3, 16, 8, torch.float32, seed=34))
    bias = torch.randn(pattern.nnz, 3, requires_grad=True)

    def step():
        out = trisparse.sparse_attention(q, k, v, pattern, bias=bias)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        return [out, *torch.autograd.grad(out, (q, k, v, bias), dout)]

    got = step()
    for a, b in zip(got, step()):
        assert torch.equal(a, b)
    qd, kd, vd, bd = (t.detach().double().requires_grad_() for t in (q, k, v, bias))
    want = dense_biased(qd, kd, vd, pattern, bd, 0.25)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(5)).double()
    wants = [want, *torch.autograd.grad(want, (qd, kd, vd, bd), dout)]
    for g, w in zip(got, wants):
        assert relerr(g.double(), w) <= 2e-5
    # Repeats: entry e three times == a bias of log 3 on it.
    twice = torch.cat([ei, ei[:, :5], ei[:, :5]], dim=1)
    multi = trisparse.Pattern.from_edge_index(twice, size=(40, 30))
    assert multi.duplicates == 10 and int(multi.multiplicity(torch.device("cpu")).max()) == 3
    with torch.no_grad():
        a = trisparse.sparse_attention(q, k, v, multi, bias=multi.log_multiplicity(q.device))
        b = dense_biased(
            q, k, v, multi, multi.log_multiplicity(q.device)[:, None].expand(-1, 3), 0.25
        )
    assert relerr(a.double(), b) <= 2e-6


def test_bad_bias_is_named():
    ei = random_edge_index(10, 10, 3, seed=35)
    pattern = trisparse.Pattern.of(ei, num_nodes=10)
    q, k, v = qkv(10, 10, 2, 8, 8, torch.float32, seed=36)
    with pytest.raises(ValueError, match="bias must have shape"):
        trisparse.sparse_attention(q, k, v, pattern, bias=torch.zeros(pattern.nnz + 1))
    with pytest.raises(ValueError, match="bias must have shape"):
        trisparse.sparse_attention(q, k, v, pattern, bias=torch.zeros(pattern.nnz, 3))
    with pytest.raises(TypeError, match="bias must be a float"):
        trisparse.sparse_attention(
            q, k, v, pattern, bias=torch.zeros(pattern.nnz, dtype=torch.int32)
        )
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        trisparse.sparse_attention(q, k, v, pattern, bias=[0.0] * pattern.nnz)


def test_torch_compile_fullgraph():
    ei = random_edge_index(64, 64, 8, seed=16)
    pattern = trisparse.Pattern.of(ei, num_nodes=64)
    lin = torch.nn.Linear(16, 3 * 2 * 8)

    def model(x):
        q, k, v = lin(x).view(-1, 3, 2, 8).unbind(1)
        return trisparse.sparse_attention(q, k, v, pattern).sum()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (64,):
        x = torch.randn(n, 16)
        assert torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        gx = torch.autograd.grad(compiled(x.requires_grad_()), x)[0]
        ge = torch.autograd.grad(model(x), x)[0]
        assert torch.allclose(gx, ge, rtol=1e-5, atol=1e-6)


def test_bad_inputs_name_the_argument():
    ei = random_edge_index(10, 10, 3, seed=17)
    pattern = trisparse.Pattern.of(ei, num_nodes=10)
    q, k, v = qkv(10, 10, 2, 8, 8, torch.float32, seed=18)
    with pytest.raises(ValueError, match="q has 9 rows"):
        trisparse.sparse_attention(q[:9], k, v, pattern)
    with pytest.raises(ValueError, match="source nodes"):
        trisparse.sparse_attention(q, k[:9], v[:9], pattern)
    with pytest.raises(TypeError, match="k has dtype"):
        trisparse.sparse_attention(q, k.double(), v, pattern)
    with pytest.raises(TypeError, match="q must be float16"):
        trisparse.sparse_attention(q.int(), k, v, pattern)
    with pytest.raises(ValueError, match=r"q must have shape \[nodes, heads, channels\]"):
        trisparse.sparse_attention(q[0], k, v, pattern)
    with pytest.raises(ValueError, match="head count"):
        trisparse.sparse_attention(q, k[:, :1], v, pattern)
    with pytest.raises(ValueError, match="edge_index must have shape"):
        trisparse.Pattern.from_edge_index(ei[:1])
    with pytest.raises(ValueError, match="out of range"):
        trisparse.Pattern.from_edge_index(ei, num_nodes=3)
    with pytest.raises(ValueError, match="out of range"):
        trisparse.Pattern.from_edge_index(torch.tensor([[0, -1], [1, 1]]), num_nodes=3)
    with pytest.raises(TypeError, match="edge_index must hold int32 or int64"):
        trisparse.Pattern.from_edge_index(ei.float())
    with pytest.raises(TypeError, match="adj must be"):
        trisparse.Pattern.of([1, 2])
    with pytest.raises(ValueError, match="rowptr must start at 0"):
        trisparse.Pattern.from_csr(torch.tensor([0, 2, 1]), torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match="scale must be finite"):
        trisparse.sparse_attention(q, k, v, pattern, scale=math.inf)
    with pytest.raises(ValueError, match="head dim must be >= 1"):  # (the default scale's)
        trisparse.sparse_attention(q[..., :0], k[..., :0], v, pattern)


def test_every_pattern_source_agrees():
    ei = random_edge_index(30, 25, 6, seed=19)
    ref = trisparse.Pattern.from_edge_index(ei, size=(30, 25))
    n_dst, n_src = 25, 30
    coo = torch.sparse_coo_tensor(
        torch.stack([ei[1], ei[0]]), torch.ones(ei.shape[1]), (n_dst, n_src)
    )
    shuffled = ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(1))]
    repeated = torch.cat([ei, ei[:, :5]], dim=1)
    for p in (
        trisparse.Pattern.of(coo),
        trisparse.Pattern.of(coo.to_sparse_csr()),
        trisparse.Pattern.of((ref.rowptr, ref.col), num_nodes=n_src),
        trisparse.Pattern.from_edge_index(shuffled, size=(n_src, n_dst)),
        trisparse.Pattern.from_edge_index(repeated, size=(n_src, n_dst)),
    ):
        assert torch.equal(p.rowptr, ref.rowptr) and torch.equal(p.col, ref.col)
        assert (p.num_rows, p.num_cols) == (n_dst, n_src)
    assert trisparse.Pattern.from_edge_index(repeated, size=(n_src, n_dst)).duplicates == 5
    try:
        from torch_geometric import EdgeIndex
    except ImportError:
        return
    e = EdgeIndex(ei, sparse_size=(n_src, n_dst))
    p = trisparse.Pattern.of(e)
    assert torch.equal(p.rowptr, ref.rowptr) and torch.equal(p.col, ref.col)


@pytest.mark.parametrize("chunk", [1 << 28, 1, 2, 3, 7])
def test_a_sorted_csr_is_taken_in_place_and_checked(monkeypatch, chunk):
    """Pattern.from_sorted_csr takes a canonical CSR as it is (the same arrays, no copy) and
    equals from_csr's; every violation is found, wherever the check's chunks cut the entries."""
    from trisparse import pattern as pattern_module

    monkeypatch.setattr(pattern_module, "_CSR_CHECK_CHUNK", chunk)
    ei = random_edge_index(40, 30, 5, seed=23)
    ref = trisparse.Pattern.from_edge_index(ei, size=(40, 30))
    rowptr, col = ref.rowptr.clone(), ref.col.clone()
    p = trisparse.Pattern.from_sorted_csr(rowptr, col, 40)
    assert p.rowptr is rowptr and p.col is col and (p.num_rows, p.num_cols) == (30, 40)
    assert p.duplicates == 0 and p.nnz == ref.nnz
    starts = rowptr[:-1][rowptr.diff() >= 2]
    a = int(starts[3])  # a row of two or more entries
    for edit, what in (
        (lambda c: c.__setitem__(a + 1, c[a]), "unique"),  # a repeat
        (lambda c: c.__setitem__(slice(a, a + 2), c[a : a + 2].flip(0)), "ascending"),
        (lambda c: c.__setitem__(-1, 40), "lie in"),
        (lambda c: c.__setitem__(0, -1), "lie in"),
    ):
        bad = col.clone()
        edit(bad)
        with pytest.raises(ValueError, match=what):
            trisparse.Pattern.from_sorted_csr(rowptr, bad, 40)
    with pytest.raises(ValueError, match="rowptr"):
        trisparse.Pattern.from_sorted_csr(rowptr[:-1], col, 40)
    with pytest.raises(TypeError, match="int32"):
        trisparse.Pattern.from_sorted_csr(rowptr, col.long(), 40)
    # Rows may start below where the previous one ended: no false alarm at any chunk cut.
    trisparse.Pattern.from_sorted_csr(rowptr, col, 40)


@pytest.mark.parametrize("chunk, piece", [(1 << 27, 1 << 30), (1, 7), (13, 1), (40, 64)])
def test_undirected_is_the_union_with_the_transpose(monkeypatch, chunk, piece):
    """Pattern.undirected: A | A^T as a canonical CSR (repeats, self loops and isolated nodes
    included), wherever its row ranges (chunk) and column pieces cut the entries."""
    from trisparse import pattern as pattern_module

    monkeypatch.setattr(pattern_module, "_UNDIRECTED_PIECE", piece)
    n = 37
    ei = torch.cat([random_edge_index(n, n, 4, seed=29), torch.tensor([[3, 3, 5], [3, 9, 9]])], 1)
    p = trisparse.Pattern.from_edge_index(ei, num_nodes=n)
    u = p.undirected(chunk=chunk)
    dense = torch.zeros(n, n, dtype=torch.bool)
    dense[ei[1], ei[0]] = True
    want = trisparse.Pattern.from_edge_index(torch.nonzero(dense | dense.T).T.flip(0), num_nodes=n)
    assert torch.equal(u.rowptr, want.rowptr) and torch.equal(u.col, want.col)
    assert u.duplicates == 0 and u.col.dtype == torch.int32
    trisparse.Pattern.from_sorted_csr(u.rowptr, u.col, n)  # canonical
    empty = trisparse.Pattern.from_sorted_csr(torch.zeros(4, dtype=torch.int64), p.col[:0], 3)
    assert empty.undirected().nnz == 0
    with pytest.raises(ValueError, match="square"):
        trisparse.Pattern.from_edge_index(ei, size=(n, n + 1)).undirected()


def test_a_freed_pattern_is_reported():
    ei = random_edge_index(10, 10, 3, seed=20)
    pid = trisparse.Pattern.of(ei, num_nodes=10).id
    q, k, v = qkv(10, 10, 1, 8, 8, torch.float32, seed=21)
    with pytest.raises(ValueError, match="was freed"):
        torch.ops.trisparse.sparse_attention(q, k, v, None, pid, 0.5, False, False)


def test_the_cuda_padding_changes_nothing():
    # What sparse_attention does on CUDA for head dims the fused kernel lacks, checked on the CPU.
    from trisparse.attention import _padded_for_cuda

    ei = random_edge_index(40, 30, 6, seed=25)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(40, 30))
    q, k, v = qkv(30, 40, 2, 16, 24, torch.float64, seed=26)
    dout = torch.randn(30, 2, 24, dtype=torch.float64)

    def padded(a, b, c):
        pa, pb, pc = _padded_for_cuda(a, b, c)
        assert pa.shape[2] == pb.shape[2] == pc.shape[2] == 32
        return trisparse.sparse_attention(pa, pb, pc, pattern, scale=0.25)[..., :24]

    got = grads(padded, q, k, v, dout)
    want = grads(
        lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern, scale=0.25), q, k, v, dout
    )
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-12, atol=1e-14)


@pytest.mark.gpu
# float16/bfloat16: the fused 3S kernel; float32: the row-wise float32 kernel.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_forward_and_gradients_match_dense(dtype):
    ei = random_edge_index(500, 400, 20, seed=22)
    pattern = trisparse.Pattern.from_edge_index(ei, size=(500, 400))
    # D = 16 and Dv = 24: padded to the kernel's 32 (as TransformerConv's 16 channels per head).
    q, k, v = qkv(400, 500, 4, 16, 24, torch.float32, seed=23)
    dout = torch.randn(400, 4, 24, generator=torch.Generator().manual_seed(24))
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    got = grads(
        lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern),
        *(t.cuda() for t in (q, k, v)),
        dout.cuda(),
    )
    want = grads(lambda a, b, c: dense_attention(a, b, c, ei, 1 / 4), q, k, v, dout.double())
    same = grads(lambda a, b, c: dense_attention_in(a, b, c, ei, 1 / 4), q, k, v, dout)
    for name, g, w, s in zip(("out", "dq", "dk", "dv"), got, want, same, strict=True):
        assert g.dtype == dtype and g.is_cuda, name
        assert relerr(g.cpu(), w) <= 2 * relerr(s, w) + 1e-5, (name, relerr(g.cpu(), w))
    again = grads(
        lambda a, b, c: trisparse.sparse_attention(a, b, c, pattern),
        *(t.cuda() for t in (q, k, v)),
        dout.cuda(),
    )
    for a, b in zip(got, again, strict=True):
        assert torch.equal(a, b)
    _, lse = trisparse.sparse_attention(q.cuda(), k.cuda(), v.cuda(), pattern, return_lse=True)
    _, want_lse = trisparse.sparse_attention(
        q.double(), k.double(), v.double(), pattern, None, True
    )
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert torch.allclose(lse.cpu()[finite].double(), want_lse[finite], rtol=1e-4, atol=1e-4)
