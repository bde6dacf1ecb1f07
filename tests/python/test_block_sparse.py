"""trisparse.block_sparse_attention: our masks and FlexAttention's, forward and gradients against a
dense float64 oracle and against flex_attention."""

import contextlib
import gc
import math
import random

import pytest
import torch
import trisparse
from conftest import block_dropout_reference


def dense_block_attention(q, k, v, blocks, g, causal, scale):
    """The oracle: the block table expanded to elements, masked dense softmax in float64."""
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[2], k.shape[2]
    m = blocks.repeat_interleave(g, 2).repeat_interleave(g, 3)[..., :n_q, :n_k]
    if causal:
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_k)[None, :]
        m = m & (j <= i + (n_k - n_q))
    s = (q @ k.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~m, -math.inf), dim=-1).nan_to_num(0.0)
    return p @ v


def inputs(b, h, n_q, n_k, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for n in (n_q, n_k, n_k))


def with_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [(2, 3, 96, 96, 16, 32, 1, 1), (1, 2, 70, 100, 8, 16, 1, 2), (3, 1, 64, 64, 32, 16, 3, 1)],
)
def test_matches_dense_float64(shape, dtype, causal):
    b, h, n_q, n_k, d, g, mask_b, mask_h = shape
    gen = torch.Generator().manual_seed(b * 7 + h)
    blocks = torch.rand(mask_b, mask_h, math.ceil(n_q / g), math.ceil(n_k / g), generator=gen) < 0.5
    mask = trisparse.BlockMask(blocks, g, causal=causal)
    q, k, v = inputs(b, h, n_q, n_k, d, dtype, seed=1)
    dout = torch.randn(b, h, n_q, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)
    full = blocks.expand(b, h, *blocks.shape[2:])
    got = with_grads(lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask), q, k, v, dout)
    want = with_grads(
        lambda a, c, e: dense_block_attention(a, c, e, full, g, causal, scale),
        q,
        k,
        v,
        dout.double(),
    )
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert x.dtype == dtype and torch.isfinite(x).all(), name
        err = float((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-30))
        assert err <= tol, (name, err)


def _laid_out(t, layout):
    """t [B, H, N, D] with the same values in another memory layout: "bhnd" (contiguous),
    "bnhd" (sequence-major, as a [B, N, H, D] tensor transposed), "wide" (a slice of [B, H, N,
    2D]: rows 2D apart) or "hbnd" (heads outermost: neither layout the kernels fold without a
    copy)."""
    if layout == "bhnd":
        return t.contiguous()
    if layout == "bnhd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "wide":
        return torch.cat([t, torch.zeros_like(t)], dim=-1)[..., : t.shape[-1]]
    return t.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "wide", "hbnd"])
def test_any_layout_with_a_unit_last_stride_matches_dense(layout, device):
    """[B, H, N, D] tensors in any layout give the oracle's output and gradients, the output in
    q's layout (contiguous for contiguous q, sequence-major for sequence-major q)."""
    b, h, n, g = 2, 3, 256, 64
    d = 64
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(5)
    blocks = torch.rand(b, h, n // g, n // g, generator=gen) < 0.5
    blocks[..., 0] = True
    mask = trisparse.BlockMask(blocks.to(device), g)
    q, k, v = inputs(b, h, n, n, d, dtype, seed=6)
    dout = torch.randn(b, h, n, d, generator=gen).to(dtype)
    want = with_grads(
        lambda a, c, e: dense_block_attention(a, c, e, blocks, g, False, d**-0.5),
        q,
        k,
        v,
        dout.double(),
    )
    leaves = [_laid_out(t.to(device), layout).requires_grad_() for t in (q, k, v)]
    out = trisparse.block_sparse_attention(*leaves, mask)
    if layout == "bhnd":
        assert out.is_contiguous()
    if layout == "bnhd":
        assert out.transpose(1, 2).is_contiguous()
    out.backward(dout.to(device))
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for name, x, y in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], want):
        err = float((x.detach().double().cpu() - y).abs().max() / y.abs().max())
        assert err <= tol, (name, err)


def test_gradcheck_float64():
    blocks = torch.tensor([[[[True, False], [True, True]]]])
    mask = trisparse.BlockMask(blocks, 4, causal=True)
    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 8, 8, 3, torch.float64, seed=2))
    assert torch.autograd.gradcheck(
        lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask, scale=0.8), (q, k, v)
    )


def test_flex_attention_block_mask_gives_flex_attentions_output():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    b, h, n, d, g = 2, 2, 256, 32, 128
    gen = torch.Generator().manual_seed(3)
    table = torch.rand(b, h, n // g, n // g, generator=gen) < 0.6
    table[..., 0, 0] = True

    def block_granular(bi, hi, qi, ki):
        return table[bi, hi, qi // g, ki // g]

    def causal(bi, hi, qi, ki):
        return qi >= ki

    q, k, v = inputs(b, h, n, n, d, torch.float32, seed=4)
    for mask_mod, is_causal in ((block_granular, False), (causal, True)):
        flex_mask = fa.create_block_mask(mask_mod, b, h, n, n, device="cpu", BLOCK_SIZE=g)
        with torch.no_grad():
            want = fa.flex_attention(q, k, v, block_mask=flex_mask)
            ours = trisparse.block_sparse_attention(
                q, k, v, trisparse.BlockMask.from_flex(flex_mask, causal=is_causal)
            )
        assert float((ours - want).abs().max()) <= 1e-5
    # Passed directly, a FlexAttention mask is converted (block-granular mask_mod).
    flex_mask = fa.create_block_mask(block_granular, b, h, n, n, device="cpu", BLOCK_SIZE=g)
    with torch.no_grad():
        want = fa.flex_attention(q, k, v, block_mask=flex_mask)
        assert (
            float((trisparse.block_sparse_attention(q, k, v, flex_mask) - want).abs().max()) <= 1e-5
        )
    # The conversion is kept on the FlexAttention mask, alive through the backward.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = trisparse.block_sparse_attention(*leaves, flex_mask)
    assert flex_mask._trisparse_mask is not None
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert all(bool(torch.isfinite(x).all()) for x in grads)


def test_opcheck():
    blocks = torch.rand(1, 1, 2, 2, generator=torch.Generator().manual_seed(5)) < 0.7
    mask = trisparse.BlockMask(blocks, 8)
    for dtype in (torch.float32, torch.float64):
        q, k, v = (t.transpose(1, 2).reshape(-1, 2, 4) for t in inputs(2, 2, 16, 16, 4, dtype, 6))
        q, k, v = (t.contiguous().requires_grad_() for t in (q, k, v))
        cu = [0, 16, 32]
        torch.library.opcheck(
            torch.ops.trisparse.block_sparse_attention.default,
            (q, k, v, mask.id, cu, cu, 0.5, True),
        )
        ragged = [0, 5, 5, 16, 32]  # lengths 5, 0, 11 and 16 under the same 2 x 2 blocks
        per_sequence = trisparse.BlockMask(blocks.expand(4, 1, 2, 2), 8)
        torch.library.opcheck(
            torch.ops.trisparse.block_sparse_attention.default,
            (
                q,
                k,
                v,
                per_sequence.id,
                ragged,
                ragged,
                0.5,
                True,
            ),
        )
        # [B, H, N, D] seen as [N, B * H, D], and one sequence's [1, N, H, D] transposed: the
        # output's layout as the fake's.
        for batch, layout in ((2, "bhnd"), (1, "bnhd")):
            folded = [_laid_out(t, layout) for t in inputs(batch, 2, 16, 16, 4, dtype, 7)]
            folded = [t.requires_grad_() for t in folded]
            torch.library.opcheck(
                torch.ops.trisparse.block_sparse_attention.default,
                (*folded, mask.id, [0, 16], [0, 16], 0.5, True),
            )


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_torch_compile_fullgraph_matches_eager(layout):
    """torch.compile(fullgraph=True) of a model calling block_sparse_attention on [B, H, N, D]
    (heads folded by the op, or sequence-major rows packed): outputs and gradients as eager."""
    blocks = torch.rand(2, 2, 3, 3, generator=torch.Generator().manual_seed(8)) < 0.6
    blocks[..., 0] = True
    mask = trisparse.BlockMask(blocks, 16, causal=True)
    lin = torch.nn.Linear(8, 3 * 2 * 16)

    def model(x):  # x [B, N, 8] -> q, k, v [B, H, N, D]
        q, k, v = lin(x).view(2, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)
        if layout == "bhnd":
            q, k, v = (t.contiguous() for t in (q, k, v))
        return trisparse.block_sparse_attention(q, k, v, mask).square().sum()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 40, 8, requires_grad=True)
    try:
        got, want = compiled(x), model(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        gx = torch.autograd.grad(compiled(x), x)[0]
        ge = torch.autograd.grad(model(x), x)[0]
        assert torch.allclose(gx, ge, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("causal", [False, True])
def test_packed_ragged_batch_matches_each_sequence(causal):
    """cu_seqlens: sequences of lengths 37/50, 0/20, 100/100, 64/30 (queries/keys) packed, each
    under the top left blocks of its own mask, against the float64 oracle per sequence: outputs
    and gradients."""
    h, d, g = 2, 8, 16
    lq, lk = [37, 0, 100, 64], [50, 20, 100, 30]
    cu_q = [sum(lq[:i]) for i in range(5)]
    cu_k = [sum(lk[:i]) for i in range(5)]
    gen = torch.Generator().manual_seed(31)
    q, dout = (torch.randn(cu_q[-1], h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(cu_k[-1], h, d, generator=gen) for _ in range(2))
    blocks = torch.rand(4, h, -(-100 // g), -(-100 // g), generator=gen) < 0.6
    mask = trisparse.BlockMask(blocks, g, causal=causal)
    out, dq, dk, dv = with_grads(
        lambda q_, k_, v_: trisparse.block_sparse_attention(
            q_, k_, v_, mask, cu_seqlens_q=torch.tensor(cu_q), cu_seqlens_k=cu_k
        ),
        q,
        k,
        v,
        dout,
    )
    assert out.shape == (cu_q[-1], h, d)
    scale = 1 / math.sqrt(d)
    for i in range(4):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        one = [t.transpose(0, 1)[None].double() for t in (q[sq], k[sk], v[sk], dout[sq])]
        sub = blocks[i : i + 1, :, : -(-lq[i] // g), : -(-lk[i] // g)]
        want = with_grads(
            lambda q_, k_, v_, sub=sub: dense_block_attention(q_, k_, v_, sub, g, causal, scale),
            *one,
        )
        got = [out[sq], dq[sq], dk[sk], dv[sk]]
        for x, w in zip(got, want, strict=True):
            if x.numel():  # the empty sequence: no rows of out and dq; its keys' dk, dv are 0
                assert float((x.double() - w[0].transpose(0, 1)).abs().max()) <= 1e-5


def test_bad_inputs_name_the_argument():
    mask = trisparse.BlockMask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 8)
    q, k, v = inputs(1, 2, 16, 16, 4, torch.float32, seed=7)
    with pytest.raises(ValueError, match="do not cover"):
        trisparse.block_sparse_attention(q[:, :, :8], k, v, mask)
    with pytest.raises(ValueError, match=r"must have shape \[B, H, N, D\]"):
        trisparse.block_sparse_attention(q[0], k, v, mask)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    with pytest.raises(ValueError, match="cu_seqlens end at"):
        trisparse.block_sparse_attention(*packed, mask, cu_seqlens_q=[0, 8])
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        trisparse.block_sparse_attention(*packed, mask, cu_seqlens_q=[0, 12, 8, 16])
    with pytest.raises(ValueError, match="cu_seqlens_k needs cu_seqlens_q"):
        trisparse.block_sparse_attention(q, k, v, mask, cu_seqlens_k=[0, 16])
    with pytest.raises(TypeError, match="q's dtype"):
        trisparse.block_sparse_attention(q, k.double(), v, mask)
    with pytest.raises(ValueError, match="heads' masks"):
        trisparse.block_sparse_attention(
            q, k, v, trisparse.BlockMask(torch.ones(1, 3, 2, 2, dtype=torch.bool), 8)
        )
    with pytest.raises(TypeError, match="blocks must be a bool tensor"):
        trisparse.BlockMask(torch.ones(1, 1, 2, 2), 8)
    with pytest.raises(TypeError, match="mask must be"):
        trisparse.block_sparse_attention(q, k, v, "causal")


def test_topk_block_mask_selects_the_highest_scoring_blocks():
    b, h, n, d, g, top = 2, 3, 200, 16, 32, 2
    q, k, v = inputs(b, h, n, n, d, torch.float32, seed=21)
    mask = trisparse.topk_block_mask(q, k, g, top, keep_diagonal=True)
    nb = -(-n // g)
    assert mask.blocks.shape == (b, h, nb, nb) and mask.block_size == g
    # The definition: block means of q and k, the top_k scores per row (ties to the lower
    # block), plus the diagonal block.
    pad = nb * g - n
    counts = torch.full((nb,), float(g))
    counts[-1] = g - pad
    mq = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(b, h, nb, g, d).sum(3) / counts[:, None]
    mk = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(b, h, nb, g, d).sum(3) / counts[:, None]
    scores = mq @ mk.transpose(-1, -2)
    want = torch.zeros_like(mask.blocks)
    want.scatter_(-1, torch.topk(scores, top, dim=-1).indices, True)
    want |= torch.eye(nb, dtype=torch.bool)
    assert torch.equal(mask.blocks, want)
    out = trisparse.block_sparse_attention(q, k, v, mask)
    ref = dense_block_attention(q, k, v, mask.blocks, g, False, 1 / math.sqrt(d))
    assert float((out.double() - ref).abs().max()) <= 1e-5


def test_topk_block_mask_causal_and_op():
    b, h, n, d, g = 1, 2, 256, 8, 32
    q, k, _ = inputs(b, h, n, n, d, torch.float32, seed=22)
    mask = trisparse.topk_block_mask(q, k, g, 3, causal=True)
    nb = n // g
    assert mask.causal
    assert not (mask.blocks & torch.ones(nb, nb, dtype=torch.bool).triu(1)).any()  # none above
    assert mask.blocks.diagonal(dim1=-2, dim2=-1).all()
    assert (mask.blocks.sum(-1) <= 4).all()
    args = (q.transpose(1, 2).reshape(-1, h, d), k.transpose(1, 2).reshape(-1, h, d), b, g, 3)
    torch.library.opcheck(torch.ops.trisparse.topk_blocks.default, (*args, True, True))
    with pytest.raises(ValueError, match="block_size"):
        trisparse.topk_block_mask(q, k, 0, 3)


def test_a_mask_made_for_one_step_lives_until_the_backward():
    """A top-k mask passed inline (no reference kept by the caller) still serves the backward."""
    b, h, n, d, g = 1, 2, 128, 8, 32
    q, k, v = (t.requires_grad_() for t in inputs(b, h, n, n, d, torch.float32, seed=23))
    out = trisparse.block_sparse_attention(
        q, k, v, trisparse.topk_block_mask(q.detach(), k.detach(), g, 2)
    )
    gc.collect()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in grads)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keep_diagonal", [False, True])
@pytest.mark.parametrize(
    "n_q, n_k, top_k", [(200, 130, 2), (130, 200, 3), (96, 96, 10), (64, 64, 0)]
)
def test_topk_selection_with_torch_ops_matches_the_library(causal, keep_diagonal, n_q, n_k, top_k):
    """The device selection (torch's ops, what CUDA runs) against the library's CPU selection:
    rectangular and ragged last blocks, causal alignment, top_k past the block count, zero."""
    from trisparse.ops.block_sparse import _topk_blocks_on_device

    b, h, d, g = 2, 3, 8, 32
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(b * n_q, h, d, generator=gen)
    k = torch.randn(b * n_k, h, d, generator=gen)
    k[: n_k // 2] = k[0]  # equal key blocks: ties go to the lower block
    args = (b, g, top_k, causal, keep_diagonal)
    want = torch.ops.trisparse.topk_blocks(q, k, *args)
    assert torch.equal(_topk_blocks_on_device(q, k, *args), want)
    if torch.cuda.is_available():
        assert torch.equal(torch.ops.trisparse.topk_blocks(q.cuda(), k.cuda(), *args).cpu(), want)


def dense_block_importance(q, k, v, dout, blocks, g, causal, scale):
    """The float64 oracle of BlockImportance: P and dS = P (dP - rowsum(P dP)) of the masked
    dense softmax, summed per G x G block ([B, H, QB, KB]); mass divided by the block's rows."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    n_q, n_k = q.shape[2], k.shape[2]
    m = blocks.repeat_interleave(g, 2).repeat_interleave(g, 3)[..., :n_q, :n_k]
    if causal:
        m = m & (torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q))
    s = (q @ k.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~m, -math.inf), dim=-1).nan_to_num(0.0)
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    qb, kb = blocks.shape[2], blocks.shape[3]

    def block_sums(x):
        x = torch.nn.functional.pad(x, (0, kb * g - n_k, 0, qb * g - n_q))
        return x.view(*x.shape[:2], qb, g, kb, g).sum((3, 5))

    rows = torch.clamp(n_q - torch.arange(qb) * g, max=g).double()
    return block_sums(p) / rows[:, None], block_sums(ds.abs())


def check_importance(q, k, v, dout, mask, blocks, causal, tol, **kwargs):
    """BlockImportance after a backward against the oracle, kept blocks only (dropped: 0), and
    the same gradients as without it."""
    b, h = q.shape[0], q.shape[1]
    scale = 1 / math.sqrt(q.shape[3])
    imp = trisparse.BlockImportance()
    got = with_grads(
        lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask, importance=imp, **kwargs),
        q,
        k,
        v,
        dout,
    )
    plain = with_grads(
        lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask, **kwargs), q, k, v, dout
    )
    for x, y in zip(got, plain, strict=True):
        assert torch.equal(x, y), "importance changed the results"
    full = blocks.expand(b, h, *blocks.shape[2:]).cpu()
    want = dense_block_importance(
        q.cpu(), k.cpu(), v.cpu(), dout.cpu(), full, mask.block_size, causal, scale
    )
    assert imp.steps == 1
    for name, x, y in zip(("mass", "grad"), (imp.mass, imp.grad), want, strict=True):
        assert x.shape == y.shape and x.dtype == torch.float32, (name, x.shape)
        x = x.cpu().double()
        assert torch.equal(x[~full], torch.zeros_like(x[~full])), f"{name}: dropped blocks"
        err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
        assert err <= tol, (name, err)
    # A second backward gives the same bits.
    first = imp.mass.clone(), imp.grad.clone()
    with_grads(
        lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask, importance=imp, **kwargs),
        q,
        k,
        v,
        dout,
    )
    assert imp.steps == 2
    assert torch.equal(first[0], imp.mass) and torch.equal(first[1], imp.grad)
    # The mass alone (as PatternLearner asks): the same bits, no |dS| sums.
    alone = trisparse.BlockImportance(measure_grad=False)
    with_grads(
        lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask, importance=alone, **kwargs),
        q,
        k,
        v,
        dout,
    )
    assert alone.grad is None and torch.equal(alone.mass, imp.mass)
    # Without gradients (torch.no_grad, then inputs that need none): the light pass after the
    # forward, the mass alone, the same output; the same bits twice.
    light = trisparse.BlockImportance()
    masses = []
    for step in range(2):
        with torch.no_grad() if step == 0 else contextlib.nullcontext():
            out = trisparse.block_sparse_attention(q, k, v, mask, importance=light, **kwargs)
        assert torch.equal(out, got[0]), "the light pass changed the output"
        assert light.steps == step + 1 and light.grad is None
        masses.append(light.mass)
    assert torch.equal(masses[0], masses[1]), "the light pass differs between runs"
    x = masses[0].cpu().double()
    assert x.shape == want[0].shape and masses[0].dtype == torch.float32
    assert torch.equal(x[~full], torch.zeros_like(x[~full])), "light pass: dropped blocks"
    err = float((x - want[0]).abs().max() / want[0].abs().max().clamp_min(1e-30))
    assert err <= min(tol, 1e-4), ("light pass", err)
    return imp


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 96, 96, 16, 32, 1, 3), (1, 2, 70, 100, 8, 16, 1, 1)])
def test_block_importance_matches_float64(shape, dtype, causal):
    b, h, n_q, n_k, d, g, mask_b, mask_h = shape
    gen = torch.Generator().manual_seed(n_q + h)
    blocks = torch.rand(mask_b, mask_h, math.ceil(n_q / g), math.ceil(n_k / g), generator=gen) < 0.6
    q, k, v = inputs(b, h, n_q, n_k, d, dtype, seed=5)
    dout = torch.randn(b, h, n_q, d, generator=gen).to(dtype)
    mask = trisparse.BlockMask(blocks, g, causal=causal)
    check_importance(q, k, v, dout, mask, blocks, causal, 1e-5)


def test_block_importance_of_a_full_mask_sums_to_one_per_block_row():
    q, k, v = inputs(1, 2, 80, 80, 8, torch.float32, seed=9)
    mask = trisparse.BlockMask(torch.ones(1, 1, 5, 5, dtype=torch.bool), 16)
    imp = trisparse.BlockImportance()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    trisparse.block_sparse_attention(*leaves, mask, importance=imp).sum().backward()
    torch.testing.assert_close(imp.mass.sum(-1), torch.ones(1, 2, 5), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="importance must be a trisparse.BlockImportance"):
        trisparse.block_sparse_attention(q, k, v, mask, importance=object())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("dtype", "d", "g"),
    [
        (torch.bfloat16, 64, 64),
        (torch.float16, 64, 128),
        (torch.bfloat16, 128, 32),
        (torch.bfloat16, 128, 128),
    ],
)
def test_block_importance_on_cuda(dtype, d, g, causal):
    b, h, n = 2, 2, 700
    gen = torch.Generator().manual_seed(d + g)
    nb = math.ceil(n / g)
    blocks = torch.rand(b, h, nb, nb, generator=gen) < 0.5
    q, k, v = (t.to("cuda") for t in inputs(b, h, n, n, d, dtype, seed=3))
    dout = torch.randn(b, h, n, d, generator=gen).to("cuda", dtype)
    for on_device in (False, True):  # a host mask, and one the device's kernels read
        mask = trisparse.BlockMask(blocks.to("cuda") if on_device else blocks, g, causal=causal)
        check_importance(q, k, v, dout, mask, blocks, causal, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_block_mass_without_a_backward_under_a_topk_mask(causal):
    """The light pass under a top-k mask the GPU selects (the top-k plan's block_mass): the
    backward's masses (which sum P rounded to bf16) within 2e-3 of the largest; zeros where
    the selection dropped a block."""
    b, h, n, d, g = 2, 2, 600, 64, 64
    q, k, v = (t.to("cuda") for t in inputs(b, h, n, n, d, torch.bfloat16, seed=8))
    dout = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(8)).to(q)
    mask = trisparse.topk_block_mask(q, k, g, 3, causal=causal)
    imp = trisparse.BlockImportance(measure_grad=False)
    with_grads(
        lambda a, c, e: trisparse.block_sparse_attention(a, c, e, mask, importance=imp),
        q,
        k,
        v,
        dout,
    )
    light = trisparse.BlockImportance()
    with torch.no_grad():
        trisparse.block_sparse_attention(q, k, v, mask, importance=light)
    assert light.grad is None and light.mass.shape == imp.mass.shape
    assert torch.equal(light.mass == 0, imp.mass == 0)
    assert relerr(light.mass, imp.mass) <= 2e-3


def relerr(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("g, causal", [(16, False), (32, True)])
def test_block_sparse_dropout_on_the_cpu_matches_float64(dtype, g, causal):
    """Attention dropout drawn by the CPU engine (the CUDA kernels' Philox draws, computed here
    independently): forward and gradients equal float64 masked attention with those draws; the
    same bits on a second run; the same draws whether the batch comes as [B, H, N, D] or with
    rows outermost; another seed drops other weights."""
    b, h, n_q, n_k, d, p = 2, 3, 70, 50, 16, 0.25
    gen = torch.Generator().manual_seed(60 + g)
    blocks = torch.rand(b, h, -(-n_q // g), -(-n_k // g), generator=gen) < 0.6
    mask = trisparse.BlockMask(blocks, block_size=g, causal=causal)
    q, k, v, dout = (
        torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype)
        for n in (n_q, n_k, n_k, n_q)
    )

    def run(seed=5, packed=False):
        leaves = []
        for t in (q, k, v):
            x = t.transpose(1, 2).contiguous().transpose(1, 2) if packed else t.clone()
            leaves.append(x.requires_grad_())
        torch.manual_seed(seed)
        out = trisparse.block_sparse_attention(*leaves, mask, dropout_p=p)
        return [t.double() for t in (out.detach(), *torch.autograd.grad(out, leaves, dout))]

    torch.manual_seed(5)
    state = trisparse._tensors.new_dropout_state(p, torch.device("cpu"))
    want = block_dropout_reference(q, k, v, dout, blocks, g, causal, state, p)
    got = run()
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert relerr(a, w) <= tol, i
    assert all(torch.equal(a, c) for a, c in zip(got, run(), strict=True))
    for i, (a, c) in enumerate(zip(got, run(packed=True), strict=True)):
        assert relerr(a, c) <= tol, i
    assert not torch.equal(got[0], run(seed=6)[0])


def dense_biased_attention(q, k, v, blocks, bias, g, causal, scale):
    """The oracle with a block bias: bias [B|1, H|1, QB, KB] expanded to elements and added to
    the scores before the mask."""
    n_q, n_k = q.shape[2], k.shape[2]
    m = blocks.repeat_interleave(g, 2).repeat_interleave(g, 3)[..., :n_q, :n_k]
    if causal:
        m = m & (torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q))
    b = bias.repeat_interleave(g, 2).repeat_interleave(g, 3)[..., :n_q, :n_k]
    s = (q.double() @ k.double().transpose(-1, -2)) * scale + b
    p = torch.softmax(s.masked_fill(~m, -math.inf), dim=-1).nan_to_num(0.0)
    return p @ v.double()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["bhnd", "hbnd"])  # heads folded into one sequence, or not
@pytest.mark.parametrize("bias_shape", [(2, 3), (1, 3), (1, 1), (2, 1)])
@pytest.mark.parametrize("n_q", [70, 10])  # 10: one query block (a broadcast bias's zero stride)
def test_block_bias_matches_dense_float64(n_q, bias_shape, layout, dtype, causal):
    """A learnable [B|1, H|1, QB, KB] bias: output and the gradients of q, k, v and the bias
    (summed over broadcast dimensions; zeros on dropped blocks) against the float64 oracle."""
    b, h, n_k, d, g = 2, 3, 100, 8, 16
    gen = torch.Generator().manual_seed(sum(bias_shape) + causal)
    qb, kb = math.ceil(n_q / g), math.ceil(n_k / g)
    blocks = torch.rand(b, h, qb, kb, generator=gen) < 0.6
    mask = trisparse.BlockMask(blocks, g, causal=causal)
    q, k, v = (_laid_out(t, layout) for t in inputs(b, h, n_q, n_k, d, dtype, seed=4))
    dout = torch.randn(b, h, n_q, d, generator=gen).to(dtype)
    bias = torch.randn(*bias_shape, qb, kb, generator=gen, dtype=torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.to(dtype).requires_grad_()
    out = trisparse.block_sparse_attention(*leaves, mask, bias=bias_leaf)
    out.backward(dout)
    want_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    want = dense_biased_attention(*want_leaves[:3], blocks, want_leaves[3], g, causal, d**-0.5)
    want.backward(dout.double())
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    got = [out, *(t.grad for t in leaves), bias_leaf.grad]
    for name, x, y in zip(("out", "dq", "dk", "dv", "dbias"), got, [want] + [
        t.grad for t in want_leaves
    ]):  # fmt: skip
        assert x.dtype == dtype and x.shape == y.shape, name
        err = float((x.detach().double() - y.detach()).abs().max() / y.abs().max())
        assert err <= tol, (name, err)
    dropped = ~blocks.any(0, keepdim=True) if bias_shape[0] == 1 else ~blocks
    dropped = dropped.all(1, keepdim=True) if bias_shape[1] == 1 else dropped
    assert bool((bias_leaf.grad[dropped.expand_as(bias_leaf.grad)] == 0).all())


@pytest.mark.parametrize("seed", range(24))
def test_random_configurations_match_dense_float64(seed):
    """Drawn configurations, float64: batch, heads, query and key lengths (partial blocks, one
    block, G = 1), D != Dv, causal, masks shared or per sequence and head, a block bias of any
    broadcast shape or none, [B, H, N, D] or [B, N, H, D] strides: output and every gradient
    equal the dense oracle's."""
    rng = random.Random(seed)
    b, h, g = rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([1, 4, 16, 64])
    n_q = rng.randint(1, 90)
    n_k = rng.choice([n_q, rng.randint(1, 90)])
    d, dv = rng.choice([8, 16, 64]), rng.choice([8, 16])
    causal = rng.random() < 0.4
    qb, kb = math.ceil(n_q / g), math.ceil(n_k / g)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.rand(rng.choice([1, b]), rng.choice([1, h]), qb, kb, generator=gen) < 0.6
    mask = trisparse.BlockMask(blocks, g, causal=causal)
    bias = None
    if rng.random() < 0.5:
        bias_shape = (rng.choice([1, b]), rng.choice([1, h]), qb, kb)
        bias = torch.randn(*bias_shape, generator=gen, dtype=torch.float64)

    def laid_out(n, width):
        if rng.random() < 0.5:
            return torch.randn(b, n, h, width, generator=gen, dtype=torch.float64).transpose(1, 2)
        return torch.randn(b, h, n, width, generator=gen, dtype=torch.float64)

    q, k, v = laid_out(n_q, d), laid_out(n_k, d), laid_out(n_k, dv)
    dout = torch.randn(b, h, n_q, dv, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [] if bias is None else [bias.clone().requires_grad_()]
    )
    out = trisparse.block_sparse_attention(
        *leaves[:3], mask, bias=leaves[3] if bias is not None else None
    )
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    refs = [t.clone().requires_grad_() for t in leaves]
    full = blocks.expand(b, h, qb, kb)
    zero = torch.zeros(1, 1, qb, kb, dtype=torch.float64)
    want = dense_biased_attention(
        *refs[:3], full, refs[3] if bias is not None else zero, g, causal, d**-0.5
    )
    want = [want, *torch.autograd.grad(want, refs, dout)]
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert x.shape == y.shape, i
        err = float((x.detach() - y.detach()).abs().max() / y.abs().max().clamp_min(1.0))
        assert err <= 1e-11, (i, err)


def test_block_bias_gradcheck_packed_ragged():
    """gradcheck in float64 through q, k, v and a per-sequence, per-head bias on a packed ragged
    batch (lengths 9/12, 0/5, 16/16; blocks of 4, causal)."""
    h, d, g = 2, 3, 4
    cu_q, cu_k = [0, 9, 9, 25], [0, 12, 17, 33]
    gen = torch.Generator().manual_seed(8)
    blocks = torch.rand(3, h, 4, 4, generator=gen) < 0.7
    mask = trisparse.BlockMask(blocks, g, causal=True)
    q = torch.randn(cu_q[-1], h, d, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (
        torch.randn(cu_k[-1], h, d, generator=gen, dtype=torch.float64).requires_grad_()
        for _ in range(2)
    )
    bias = torch.randn(3, h, 4, 4, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, c, e, f: trisparse.block_sparse_attention(
            a, c, e, mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, bias=f
        ),
        (q, k, v, bias),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_bias_with_dropout_on_the_cpu(dtype):
    """A learnable bias with attention dropout (the CPU engine's draws): out and the gradients of
    q, k, v and the bias against float64 with the same draws."""
    b, h, n, d, g, p = 2, 2, 45, 8, 16, 0.3
    gen = torch.Generator().manual_seed(21)
    nb = math.ceil(n / g)
    blocks = torch.rand(b, h, nb, nb, generator=gen) < 0.7
    mask = trisparse.BlockMask(blocks, g, causal=True)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(4))
    bias = torch.randn(1, h, nb, nb, generator=gen, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, bias)]
    torch.manual_seed(3)
    out = trisparse.block_sparse_attention(*leaves[:3], mask, dropout_p=p, bias=leaves[3])
    got = [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype))]
    torch.manual_seed(3)
    state = trisparse._tensors.new_dropout_state(p, torch.device("cpu"))
    want = block_dropout_reference(q, k, v, dout, blocks, g, True, state, p, bias)
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    for name, a, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want, strict=True):
        assert relerr(a.double(), w) <= tol, name


def test_block_bias_without_its_gradient():
    """A bias that needs no gradient (a fixed encoding): the same q, k, v gradients as a learnable
    one, no dB computed, and the backward op's bias_grad=False returns an empty dB."""
    b, h, n, d, g = 1, 2, 40, 8, 8
    gen = torch.Generator().manual_seed(11)
    blocks = torch.rand(b, h, 5, 5, generator=gen) < 0.6
    mask = trisparse.BlockMask(blocks, g, causal=True)
    q, k, v = inputs(b, h, n, n, d, torch.float64, seed=12)
    bias = torch.randn(1, h, 5, 5, generator=gen, dtype=torch.float64)
    grads = []
    for learnable in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        bias_leaf = bias.clone().requires_grad_(learnable)
        trisparse.block_sparse_attention(*leaves, mask, bias=bias_leaf).square().sum().backward()
        assert (bias_leaf.grad is not None) == learnable
        grads.append([t.grad for t in leaves])
    for x, y in zip(*grads, strict=True):
        assert torch.equal(x, y)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    out, lse = torch.ops.trisparse.block_sparse_attention(
        *packed, mask.id, [0, n], [0, n], d**-0.5, True, 0, 0.0, None, bias[0].transpose(0, 1)
    )
    *_, dbias = torch.ops.trisparse.block_sparse_attention_backward(
        *packed, out, lse, torch.ones_like(out), mask.id, [0, n], [0, n], d**-0.5, 0, 0.0, None,
        bias[0].transpose(0, 1).contiguous(), False,
    )  # fmt: skip
    assert dbias.numel() == 0


def test_block_bias_opcheck_and_errors():
    blocks = torch.rand(1, 1, 2, 2, generator=torch.Generator().manual_seed(5)) < 0.7
    blocks[0, 0, 0, 0] = True
    mask = trisparse.BlockMask(blocks, 8)
    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 16, 16, 4, torch.float32, 6))
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
    bias = torch.randn(2, 2, 2).requires_grad_()  # [QB, H, KB], the kernels' layout
    torch.library.opcheck(
        torch.ops.trisparse.block_sparse_attention.default,
        (*packed, mask.id, [0, 16], [0, 16], 0.5, True, 0, 0.0, None, bias),
    )
    with pytest.raises(ValueError, match=r"bias must be \[1 or 1, 2 or 1, 2, 2\]"):
        trisparse.block_sparse_attention(q, k, v, mask, bias=torch.zeros(1, 2, 3, 2))
    with pytest.raises(ValueError, match="importance and bias"):
        trisparse.block_sparse_attention(
            q, k, v, mask, bias=torch.zeros(1, 1, 2, 2), importance=trisparse.BlockImportance()
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("d", "g"), [(64, 64), (128, 128), (64, 32)])
def test_block_bias_on_cuda(d, g, causal, dropout):
    """bf16 on the tensor-core kernels: output and gradients (q, k, v, a per-head bias shared by
    the batch) against the float64 oracle, with attention dropout (the kernels' draws) or
    without; the bias gradient bitwise repeatable."""
    b, h, n = 2, 2, 600
    gen = torch.Generator().manual_seed(d + g + causal)
    nb = math.ceil(n / g)
    blocks = torch.rand(b, h, nb, nb, generator=gen) < 0.5
    blocks[..., 0] = True
    q, k, v = inputs(b, h, n, n, d, torch.bfloat16, seed=2)
    dout = torch.randn(b, h, n, d, generator=gen).to(torch.bfloat16)
    bias = torch.randn(1, h, nb, nb, generator=gen, dtype=torch.float64)
    torch.cuda.manual_seed(4)
    state = trisparse._tensors.new_dropout_state(dropout, torch.device("cuda"))
    if dropout:
        want = block_dropout_reference(q, k, v, dout, blocks, g, causal, state.cpu(), dropout, bias)
    else:
        want_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
        out = dense_biased_attention(*want_leaves[:3], blocks, want_leaves[3], g, causal, d**-0.5)
        want = [out, *torch.autograd.grad(out, want_leaves, dout.double())]
    mask = trisparse.BlockMask(blocks.to("cuda"), g, causal=causal)
    runs = []
    for _ in range(2):
        leaves = [t.to("cuda").requires_grad_() for t in (q, k, v)]
        bias_leaf = bias.float().to("cuda").requires_grad_()
        torch.cuda.manual_seed(4)
        out = trisparse.block_sparse_attention(*leaves, mask, dropout_p=dropout, bias=bias_leaf)
        out.backward(dout.to("cuda"))
        runs.append([out, *(t.grad for t in leaves), bias_leaf.grad])
    for name, x, y in zip(("out", "dq", "dk", "dv", "dbias"), runs[0], want, strict=True):
        err = float((x.detach().double().cpu() - y.detach()).abs().max() / y.abs().max())
        assert err <= 2e-2, (name, err)
    assert torch.equal(runs[0][4], runs[1][4])
