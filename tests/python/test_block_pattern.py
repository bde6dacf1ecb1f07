"""trisparse.BlockPattern: built from blocks and layouts, its statistics, its file (a bitwise round
trip, named errors), and the masks it gives the attention."""

import math

import pytest
import torch
import trisparse
from conftest import CUDA


def random_blocks(heads, qb, kb, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(heads, qb, kb, generator=g) < density


def test_from_blocks_keeps_every_block_and_the_order():
    blocks = random_blocks(3, 7, 7, 0.4, seed=1)
    order = torch.randperm(7 * 16 - 3, generator=torch.Generator().manual_seed(2))
    p = trisparse.BlockPattern.from_blocks(
        blocks, 16, rows=109, cols=109, order=order, made_by="test"
    )
    assert p.num_heads == 3 and p.shape == (109, 109) and p.block_size == 16
    assert torch.equal(p.blocks(), blocks)
    assert torch.equal(p.order, order)
    assert p.made_by == "test"
    s = p.stats()
    for h in range(3):
        assert s["density"][h] == pytest.approx(float(blocks[h].float().mean()))
        rows = blocks[h].float().mean(-1)
        assert s["row_min_density"][h] == pytest.approx(float(rows.min()))
        assert s["row_max_density"][h] == pytest.approx(float(rows.max()))


def test_save_and_load_round_trip_bitwise(tmp_path):
    p = trisparse.BlockPattern.layout("bigbird", 1000, block_size=32, heads=4, seed=5)
    p.save(tmp_path / "a.tsbp")
    q = trisparse.BlockPattern.load(tmp_path / "a.tsbp")
    assert torch.equal(q.blocks(), p.blocks()) and q.made_by == p.made_by
    q.save(tmp_path / "b.tsbp")
    assert (tmp_path / "a.tsbp").read_bytes() == (tmp_path / "b.tsbp").read_bytes()


def test_bad_files_name_the_file(tmp_path):
    p = trisparse.BlockPattern.layout("window", 500, block_size=64)
    p.save(tmp_path / "good.tsbp")
    data = (tmp_path / "good.tsbp").read_bytes()
    (tmp_path / "cut.tsbp").write_bytes(data[:-30])
    with pytest.raises(ValueError, match="cut.tsbp: truncated"):
        trisparse.BlockPattern.load(tmp_path / "cut.tsbp")
    flipped = bytearray(data)
    flipped[-10] ^= 4
    (tmp_path / "flip.tsbp").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="flip.tsbp: checksum"):
        trisparse.BlockPattern.load(tmp_path / "flip.tsbp")
    with pytest.raises(ValueError, match="missing.tsbp"):
        trisparse.BlockPattern.load(tmp_path / "missing.tsbp")
    (tmp_path / "folder.tsbp").mkdir()
    with pytest.raises(ValueError, match="folder.tsbp: is a directory"):
        trisparse.BlockPattern.load(tmp_path / "folder.tsbp")


def test_rectangular_patterns_and_bad_orders():
    blocks = random_blocks(1, 3, 5, 0.5, seed=6)
    assert trisparse.BlockPattern.from_blocks(blocks, 8).shape == (24, 40)
    with pytest.raises(ValueError, match="square"):
        trisparse.BlockPattern.from_blocks(blocks, 8, order=torch.arange(24))
    with pytest.raises(ValueError, match="permutation"):
        trisparse.BlockPattern.from_blocks(blocks[:, :, :3], 8, order=torch.zeros(24))


def test_union_and_layouts():
    window = trisparse.BlockPattern.layout("window", 640, block_size=64, window=1)
    glob = trisparse.BlockPattern.layout("global", 640, block_size=64, global_blocks=1)
    u = trisparse.BlockPattern.union(window, glob).blocks()[0]
    assert bool(u[:, 0].all()) and bool(u[0, :].all())
    assert bool(torch.diagonal(u).all()) and bool(torch.diagonal(u, 1).all())
    with pytest.raises(ValueError, match="kind"):
        trisparse.BlockPattern.layout("spiral", 640)


def test_block_mask_from_a_pattern_runs_the_attention():
    """The pattern's mask gives the dense oracle's attention over its blocks."""
    blocks = random_blocks(2, 4, 4, 0.5, seed=3)
    blocks[:, :, 0] = True
    p = trisparse.BlockPattern.from_blocks(blocks, 16)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out = trisparse.block_sparse_attention(q, k, v, p.to_block_mask())
    m = blocks.repeat_interleave(16, 1).repeat_interleave(16, 2)[None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    want = torch.softmax(s.masked_fill(~m, -math.inf), -1) @ v
    assert torch.allclose(out, want, atol=1e-12)


def test_community_pattern_of_planted_cliques():
    """Four cliques of 32 nodes under shuffled ids: in community order each sits in its own
    diagonal block."""
    n, size = 128, 32
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(8))
    edges = [
        (int(ids[g * size + a]), int(ids[g * size + b]))
        for g in range(4)
        for a in range(size)
        for b in range(size)
        if a != b
    ]
    edge_index = torch.tensor(edges).t()
    p = trisparse.BlockPattern.community(edge_index, n, block_size=size, heads=2)
    blocks = p.blocks()
    assert blocks.shape == (2, 4, 4)
    assert torch.equal(blocks[0], torch.eye(4, dtype=torch.bool))
    where = torch.empty(n, dtype=torch.int64)
    where[p.order] = torch.arange(n)
    for g in range(4):
        pos = where[ids[g * size : (g + 1) * size]]
        assert int(pos.max() - pos.min()) == size - 1
    with pytest.raises(ValueError, match="outside"):
        trisparse.BlockPattern.community(edge_index, 10)


def test_png_shows_each_head_with_kept_blocks_dark(tmp_path):
    image = pytest.importorskip("PIL.Image")
    blocks = random_blocks(3, 8, 16, 0.3, seed=11)
    p = trisparse.BlockPattern.from_blocks(blocks, 4)
    p.to_png(tmp_path / "p.png", columns=2)
    import numpy as np

    img = torch.from_numpy(np.asarray(image.open(tmp_path / "p.png")).astype(np.int64))
    up = 256 // 16  # 16 pixels a block
    assert tuple(img.shape) == (2 * 8 * up + 4, 2 * 16 * up + 4)
    for h in range(3):
        y, x = (h // 2) * (8 * up + 4), (h % 2) * (16 * up + 4)
        panel = img[y : y + 8 * up : up, x : x + 16 * up : up]  # a pixel a block
        assert torch.equal(panel == 0, blocks[h]) and torch.equal(panel == 255, ~blocks[h])
    # A large pattern is pooled: 3000 x 3000 blocks into cells of 3 blocks a side.
    big = trisparse.BlockPattern.layout("window", 3000 * 16, block_size=16, window=0)
    big.to_png(tmp_path / "big.png")
    assert image.open(tmp_path / "big.png").size == (1000, 1000)


@pytest.mark.parametrize("causal", [False, True])
def test_block_mass_equals_float64_dense_attention(causal):
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 70, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 90, 8, generator=g, dtype=torch.float64)
    mass = trisparse.block_mass(q, k, 16, causal=causal)
    s = (q.double() @ k.double().transpose(1, 2)) / math.sqrt(8)
    if causal:
        s = s.masked_fill(torch.arange(90)[None, :] > torch.arange(70)[:, None] + 20, -math.inf)
    p = torch.softmax(s, -1)
    want = torch.zeros(2, 5, 6, dtype=torch.float64)
    for r in range(5):
        for c in range(6):
            want[:, r, c] = p[:, 16 * r : 16 * r + 16, 16 * c : 16 * c + 16].sum((1, 2))
        want[:, r] /= min(16, 70 - 16 * r)
    assert torch.allclose(mass, want, atol=1e-12)
    assert torch.allclose(mass.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    single = trisparse.block_mass(q.float(), k.float(), 16, causal=causal)  # float32 scores
    assert single.dtype == torch.float64 and torch.allclose(single, want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_block_value_mass_equals_float64_dense_attention(causal):
    """block_value_mass: the masses equal block_mass's, the value sums each block's softmax weights
    times the keys' values summed over the block and averaged over its rows (float64 against a
    dense computation; float32 inputs within float32's rounding), so that a block row's value
    sums add up to its rows' mean attention output."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 70, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 90, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 90, 5, generator=g, dtype=torch.float64)
    mass, value = trisparse.block_value_mass(q, k, v, 16, causal=causal)
    s = (q @ k.transpose(1, 2)) / math.sqrt(8)
    if causal:
        s = s.masked_fill(torch.arange(90)[None, :] > torch.arange(70)[:, None] + 20, -math.inf)
    p = torch.softmax(s, -1)
    want = torch.zeros(2, 5, 6, 5, dtype=torch.float64)
    for r in range(5):
        rows = slice(16 * r, min(70, 16 * r + 16))
        for c in range(6):
            keys = slice(16 * c, 16 * c + 16)
            want[:, r, c] = (p[:, rows, keys] @ v[:, keys]).sum(1) / (rows.stop - rows.start)
    assert torch.equal(mass, trisparse.block_mass(q, k, 16, causal=causal))
    assert torch.allclose(value, want, atol=1e-12)
    out = p @ v
    means = torch.stack([out[:, 16 * r : 16 * r + 16].mean(1) for r in range(5)], 1)
    assert torch.allclose(value.sum(2), means, atol=1e-12)
    single = trisparse.block_value_mass(q.float(), k.float(), v.float(), 16, causal=causal)[1]
    assert single.dtype == torch.float64 and torch.allclose(single, want, atol=1e-5)
    with pytest.raises(ValueError, match="v must be"):
        trisparse.block_value_mass(q, k, v[:, :80], 16)


def _even_attention_over_block_values(n=512, d=8, block=32):
    """q, k, v [2, n, d] float64: attention spread evenly (q near zero), values that differ by key
    block (an offset a block plus small noise)."""
    g = torch.Generator().manual_seed(22)
    q = 1e-3 * torch.randn(2, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, n, d, generator=g, dtype=torch.float64)
    offsets = torch.randn(2, n // block, 1, d, generator=g, dtype=torch.float64)
    v = (offsets + 0.1 * torch.randn(2, n // block, block, d, generator=g)).reshape(2, n, d)
    return q, k, v


def test_prune_blocks_by_output_keeps_the_output_where_the_mass_cannot():
    """Attention spread evenly (every block holds the same mass) over values that differ by key
    block: the blocks of highest mass (ties: the first ones) leave a biased output, the blocks
    chosen for the output average to the dropped ones, with the same count a row and the
    diagonal kept (causal: nothing past it); with nothing dropped the output is exact."""
    block = 32
    q, k, v = _even_attention_over_block_values(block=block)
    mass, value = trisparse.block_value_mass(q, k, v, block)
    keep = trisparse.prune_blocks_by_output(mass, value, 0.75)
    assert torch.equal(keep.sum(-1), torch.full((2, 16), 4)) and keep.diagonal(0, 1, 2).all()
    by_output = trisparse.learn_block_pattern(q, k, block, 0.75, method="output", v=v)
    assert torch.equal(by_output.blocks(), keep)
    by_mass = trisparse.learn_block_pattern(q, k, block, 0.75)
    err_output = trisparse.attention_error(q, k, v, by_output)
    err_mass = trisparse.attention_error(q, k, v, by_mass)
    assert (err_output < 0.5 * err_mass).all(), (err_output, err_mass)
    stats = trisparse.block_value_mass(q, k, v, block, causal=True)
    causal = trisparse.prune_blocks_by_output(*stats, 0.75)
    # no block past the diagonal (no mass): the first rows keep what they see
    assert not causal.triu(1).any() and torch.equal(causal.sum(-1)[0, :4], torch.arange(1, 5))
    causal = trisparse.prune_blocks_by_output(*stats, 0.75, causal=True)  # 1/4 of what a row sees
    want = torch.round(0.25 * torch.arange(1, 17)).clamp(min=1).long()
    assert not causal.triu(1).any() and torch.equal(causal.sum(-1), want.expand(2, 16))
    full = trisparse.learn_block_pattern(q, k, block, 0.0, method="output", v=v)
    assert float(trisparse.attention_error(q, k, v, full).max()) < 1e-12
    with pytest.raises(ValueError, match="needs the values"):
        trisparse.learn_block_pattern(q, k, block, 0.75, method="output")
    with pytest.raises(ValueError, match="over the same blocks"):
        trisparse.prune_blocks_by_output(mass, value[:, 1:], 0.75)


def test_prune_blocks_methods():
    g = torch.Generator().manual_seed(13)
    imp = torch.rand(3, 10, 20, generator=g)
    row = trisparse.prune_blocks(imp, 0.8, "row", keep_diagonal=False)
    assert torch.equal(row.sum(-1), torch.full((3, 10), 4))
    top4 = torch.topk(imp, 4, dim=-1).indices
    assert bool(row.gather(-1, top4).all())
    glob = trisparse.prune_blocks(imp, 0.9, "global", keep_diagonal=False)
    assert torch.equal(glob.sum((1, 2)), torch.full((3,), 20))
    for h in range(3):
        assert float(imp[h][glob[h]].min()) >= float(imp[h][~glob[h]].max())
    thr = trisparse.prune_blocks(imp, 0.0, "threshold", keep_diagonal=False, top_p=0.5)
    kept = (imp * thr).sum(-1) / imp.sum(-1)
    assert bool((kept >= 0.5).all())
    forced = trisparse.prune_blocks(imp, 0.95, "row", window=1, global_blocks=1)
    r, c = torch.arange(10)[:, None], torch.arange(20)[None, :]
    assert bool(forced[:, ((r - c).abs() <= 1) | (c < 1) | (r < 1)].all())
    with pytest.raises(ValueError, match="method"):
        trisparse.prune_blocks(imp, 0.5, "random")


def test_bad_arguments_are_named():
    """Block sizes, pruning methods, sparsities and keep rules are checked where they are given
    (ValueError or TypeError naming the argument), on the CPU's library path and torch's alike."""
    q, k = torch.randn(2, 100, 16), torch.randn(2, 100, 16)
    imp = torch.rand(2, 4, 4)
    bad = [
        (ValueError, "block_size must be >= 1", lambda: trisparse.block_mass(q, k, 0)),
        (TypeError, "block_size must be an int", lambda: trisparse.block_mass(q, k, 2.5)),
        (ValueError, "block_size", lambda: trisparse.block_value_mass(q, k, k, 0)),
        (ValueError, "block_size", lambda: trisparse.learn_block_pattern(q, k, 0, 0.5)),
        (ValueError, "block_size", lambda: trisparse.PatternLearner(0, 0.5)),
        (ValueError, "sparsity", lambda: trisparse.PatternLearner(16, 1.0)),
        (ValueError, "method", lambda: trisparse.PatternLearner(16, 0.5, method="top")),
        (TypeError, "unknown keep rules", lambda: trisparse.PatternLearner(16, 0.5, band=2)),
        (ValueError, "window must be >= 0", lambda: trisparse.prune_blocks(imp, 0.5, window=-1)),
        (ValueError, "global_blocks", lambda: trisparse.prune_blocks(imp, 0.5, global_blocks=-1)),
        (ValueError, "top_p", lambda: trisparse.prune_blocks(imp, 0.5, "threshold", top_p=0.0)),
    ]
    for h in (torch.float32, torch.float64):  # the library's learner and torch's path
        bad.append(
            (
                ValueError,
                "window must be >= 0",
                lambda h=h: trisparse.learn_block_pattern(q.to(h), k.to(h), 16, 0.5, window=-2),
            )
        )
    for error, match, call in bad:
        with pytest.raises(error, match=match):
            call()


def _planted(heads, n, g, d, gen):
    """(planted blocks, q, k): block row r of head h attends the keys of two planted key blocks."""
    nb = n // g
    planted = torch.zeros(heads, nb, nb, dtype=torch.bool)
    for h in range(heads):
        for r in range(nb):
            planted[h, r, torch.randperm(nb, generator=gen)[:2]] = True
    basis = torch.eye(d)[:nb]
    k = basis.repeat_interleave(g, 0).expand(heads, n, d) + 0.1 * torch.randn(
        heads, n, d, generator=gen
    )
    q = 20.0 * (planted.float() @ basis).repeat_interleave(g, 1)
    return planted, q + 0.1 * torch.randn(heads, n, d, generator=gen), k


def test_learner_recovers_a_planted_pattern():
    """Queries of block row r point at the keys of two planted key blocks per head: the learned
    pattern at 2 of 16 key blocks a row recovers at least 95 % of the planted blocks."""
    heads, n, g, d = 2, 512, 32, 32
    nb = n // g
    planted, q, k = _planted(heads, n, g, d, torch.Generator().manual_seed(14))
    p = trisparse.learn_block_pattern(q, k, g, sparsity=1 - 2 / nb, keep_diagonal=False)
    learned = p.blocks()
    recovered = (learned & planted).sum() / planted.sum()
    assert float(recovered) >= 0.95
    assert "learned" in p.made_by


def test_knn_pattern_groups_feature_clusters():
    """Three well separated feature clusters of 64 nodes under shuffled ids: each node's
    neighbours are in its cluster, so the pattern keeps only the clusters' own blocks."""
    gen = torch.Generator().manual_seed(15)
    centers = torch.eye(3, 8) * 10
    ids = torch.randperm(192, generator=gen)
    x = torch.empty(192, 8)
    x[ids] = centers.repeat_interleave(64, 0) + torch.randn(192, 8, generator=gen)
    p = trisparse.BlockPattern.knn(x, 8, block_size=64)
    assert torch.equal(p.blocks()[0], torch.eye(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="k must"):
        trisparse.BlockPattern.knn(x, 192)


def test_attention_error_is_zero_for_dense_and_grows_with_sparsity():
    gen = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(2, 256, 16, generator=gen) for _ in range(3))
    dense = trisparse.BlockPattern.layout("dense", 256, block_size=32, heads=2)
    assert float(trisparse.attention_error(q, k, v, dense).max()) < 1e-12
    errors = []
    for keep in (0.5, 0.25):
        p = trisparse.learn_block_pattern(q, k, 32, sparsity=1 - keep)
        err = trisparse.attention_error(q, k, v, p)
        assert err.shape == (2,) and bool((err > 0).all())
        errors.append(float(err.mean()))
    assert errors[0] < errors[1]


def test_causal_attention_error_against_masked_dense_attention():
    """causal: the pattern's mask is causal and so is the dense reference (bottom-right aligned
    where the query count differs); a pattern holding every block has no error, and the error
    equals one computed by hand from masked dense attention."""
    gen = torch.Generator().manual_seed(26)
    q, k, v = (torch.randn(2, 200, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    full = trisparse.BlockPattern.layout("dense", 200, block_size=32, heads=2)
    assert float(trisparse.attention_error(q, k, v, full, causal=True).max()) < 1e-12
    p = trisparse.learn_block_pattern(q, k, 32, sparsity=0.5, causal=True)
    keep = p.blocks().repeat_interleave(32, 1).repeat_interleave(32, 2)[:, :200, :200]
    allowed = keep & torch.ones(200, 200, dtype=torch.bool).tril()
    by_hand = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    dense = trisparse.dense_attention(q, k, v, causal=True)
    want = (by_hand - dense).flatten(1).norm(dim=1) / dense.flatten(1).norm(dim=1)
    got = trisparse.attention_error(q, k, v, p, causal=True, dense=dense)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    # Fewer queries than keys: the last query row sees every key (bottom-right alignment).
    tail = trisparse.dense_attention(q[:, 150:], k, v, causal=True)
    assert torch.allclose(tail[:, -1], trisparse.dense_attention(q[:, -1:], k, v)[:, 0])
    # More queries than keys: the first ones see no key and get zeros, as the kernels give them.
    wide = trisparse.dense_attention(q, k[:, :120], v[:, :120], causal=True)
    assert wide[:, :80].abs().max() == 0 and bool(torch.isfinite(wide).all())
    assert torch.allclose(wide[:, 80], v[:, 0])


def test_flex_block_mask_holds_the_same_blocks():
    pytest.importorskip("torch.nn.attention.flex_attention")
    blocks = random_blocks(2, 6, 6, 0.4, seed=17)
    p = trisparse.BlockPattern.from_blocks(blocks, 128)
    flex = p.to_flex()
    assert torch.equal(flex.to_dense()[0].bool(), blocks)
    back = trisparse.BlockMask.from_flex(flex)
    assert torch.equal(back.blocks[0], blocks) and back.block_size == 128


def test_pattern_learner_schedule_and_recovery():
    """Dense through the warm-up, then the pattern from the moving average of sampled block
    masses: it recovers the planted blocks, refreshes every `every` steps, and stops changing
    once frozen."""
    torch.manual_seed(18)  # the learner's row samples
    heads, n, g = 2, 512, 32
    planted, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(18))
    learner = trisparse.PatternLearner(
        g,
        sparsity=1 - 2 / 16,
        every=3,
        warmup=2,
        freeze_after=9,
        sample_blocks=8,
        keep_diagonal=False,
    )
    masks = []
    for _ in range(12):
        learner.observe(q, k)
        masks.append(learner.mask())
    assert masks[0] is None and masks[1] is None and masks[2] is not None
    assert masks[3] is masks[2] and masks[4] is masks[2]  # refreshed every 3 steps
    assert masks[5] is not masks[4]
    assert masks[11] is masks[8] or torch.equal(masks[11].blocks, masks[8].blocks)  # frozen
    learned = learner.pattern(n, n).blocks()
    recovered = (learned & planted).sum() / planted.sum()
    assert float(recovered) >= 0.95
    assert "PatternLearner" in learner.pattern(n, n).made_by


def test_pattern_learner_sampled_mass_equals_block_mass():
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(2, 100, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 100, 8, generator=gen, dtype=torch.float64)
    learner = trisparse.PatternLearner(16, sparsity=0.5, every=1, decay=0.0)
    learner.observe(q, k)
    assert torch.allclose(learner.importance, trisparse.block_mass(q, k, 16), atol=1e-12)


def test_pooled_block_mass_is_a_distribution_over_allowed_blocks():
    gen = torch.Generator().manual_seed(20)
    q, k = torch.randn(2, 100, 8, generator=gen), torch.randn(2, 130, 8, generator=gen)
    est = trisparse.pooled_block_mass(q, k, 32, causal=True)
    assert est.shape == (2, 4, 5) and est.dtype == torch.float64
    torch.testing.assert_close(est.sum(-1), torch.ones(2, 4, dtype=torch.float64))
    # Causal, aligned at the bottom right (30 more keys): block row 0's last query sees key 61.
    assert float(est[:, 0, 2:].abs().max()) == 0.0 and bool((est[:, 0, :2] > 0).all())
    # Identical pooled rows give each block a share by its keys.
    flat = trisparse.pooled_block_mass(torch.zeros(1, 64, 4), torch.zeros(1, 80, 4), 32)
    torch.testing.assert_close(flat[0, 0], torch.tensor([32, 32, 16], dtype=torch.float64) / 80)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(256, 256), (100, 130), (130, 100), (96, 20), (1100, 900)])
def test_pooled_block_mass_equals_the_pooled_scores_softmax(device, dtype, causal, n_q, n_k):
    """Against the definition in float64, block by block: full and partial blocks, causal
    aligned at the bottom right (n_k < n_q leaves the first block rows no key: zeros), more block
    rows than a CUDA thread block scores (1100: 35 rows); a strided q (heads a view of
    [N, H, D]); the inputs' dtype read as it is; the same bits on a second call."""
    g, d = 32, 8
    gen = torch.Generator().manual_seed(n_q + n_k)
    q = torch.randn(n_q, 3, d, generator=gen).to(dtype).transpose(0, 1)
    k = torch.randn(3, n_k, d, generator=gen).to(dtype)
    qb, kb = -(-n_q // g), -(-n_k // g)
    want = torch.zeros(3, qb, kb, dtype=torch.float64)
    for r in range(qb):
        qm = q[:, r * g : (r + 1) * g].double().mean(1)
        last = min((r + 1) * g, n_q) - 1 + n_k - n_q
        scores = torch.full((3, kb), -torch.inf, dtype=torch.float64)
        for c in range(kb):
            if causal and c * g > last:
                continue
            keys = k[:, c * g : (c + 1) * g].double()
            scores[:, c] = (qm * keys.mean(1)).sum(-1) / math.sqrt(d) + math.log(keys.shape[1])
        if bool(torch.isfinite(scores).any()):
            want[:, r] = torch.softmax(scores, -1)
    got = trisparse.pooled_block_mass(q.to(device), k.to(device), g, causal)
    assert got.device.type == device and got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)
    assert torch.equal(trisparse.pooled_block_mass(q.to(device), k.to(device), g, causal), got)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("batch", [1, 3])
def test_pattern_learner_folds_the_kernels_mass_as_defined(device, batch):
    """observe_importance's one-call fold (float32 mass, "ema") against its definition in float64:
    kept blocks get their measured mass (the batch's mean, from a strided view as the tracker
    gives it) times the row's pooled total over the kept blocks, dropped blocks their pooled
    estimate; rows seen before blend with the average, unseen rows take the new value; a second
    fold blends every row."""
    heads, qb, kb, decay = 2, 37, 45, 0.8
    gen = torch.Generator().manual_seed(batch)
    learner = trisparse.PatternLearner(32, sparsity=0.5, decay=decay)
    learner._start(heads, qb, kb, torch.device(device))
    state = torch.rand(heads, qb, kb, dtype=torch.float64, generator=gen)
    learner.importance.copy_(state)
    seen = torch.rand(qb, generator=gen) < 0.5
    learner._seen.copy_(seen)
    want = state.clone()
    for _ in range(2):
        raw = torch.rand(batch, qb, heads, kb, generator=gen)  # the op's [B, QB, H, KB]
        mass = raw.permute(0, 2, 1, 3)
        keep = torch.rand(heads, qb, kb, generator=gen) < 0.3
        pooled = torch.softmax(torch.randn(heads, qb, kb, generator=gen, dtype=torch.float64), -1)
        share = (pooled * keep).sum(-1, keepdim=True)
        fresh = torch.where(keep, mass.double().mean(0) * share, pooled)
        want = torch.where(seen[None, :, None], decay * want + (1 - decay) * fresh, fresh)
        seen[:] = True
        learner.observe_importance(mass.to(device), keep.to(device), pooled.to(device))
        torch.testing.assert_close(learner.importance.cpu(), want, rtol=1e-12, atol=1e-14)
    assert bool(learner._seen.all())


def _diagonal_start_learner(n, g):
    """A learner sparse from its first step under the diagonal blocks only, 3 of 16 key blocks a
    row once learned, the kernels measuring every step."""
    diagonal = trisparse.BlockPattern.layout("window", n, block_size=g, window=0)
    return trisparse.PatternLearner(
        g,
        sparsity=1 - 3 / 16,
        every=1,
        decay=0.5,
        initial=diagonal,
        keep_diagonal=True,
        track_every=1,
    )


def _learner_steps(learner, q, k, v, steps):
    """`steps` training steps of the learner as a model calls it: attention, a loss, backward."""
    masks = []
    for _ in range(steps):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        learner(*leaves).square().sum().backward()
        masks.append(learner.mask())
    return masks


def test_pattern_learner_learns_from_the_kernels_importance():
    """Called in place of the attention, sparse from the first step under a bad initial pattern
    (the diagonal only), with the kernels measuring the kept blocks (BlockImportance) in each
    backward: the dropped blocks' pooled estimates bring the planted ones in, and the learned
    pattern recovers >= 95 % of them."""
    heads, n, g = 2, 512, 32
    planted, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(21))
    v = torch.randn(heads, n, 32, generator=torch.Generator().manual_seed(22))
    q, k, v = q[None], k[None], v[None]
    learner = _diagonal_start_learner(n, g)
    masks = _learner_steps(learner, q, k, v, 8)
    assert learner.tracker.steps == 8  # sparse from the first step, each one measured
    learned = learner.pattern(n, n).blocks()
    assert float((learned & planted).sum() / planted.sum()) >= 0.95
    # The kernels measured the blocks of the mask they ran under, and nothing else.
    assert learner.tracker.mass.shape == (1, heads, 16, 16)
    assert bool(((learner.tracker.mass[0] > 0) <= masks[-2].blocks[0]).all())


def test_pattern_learner_of_a_frozen_model_learns_from_the_light_pass():
    """Inputs that need no gradient (a frozen model: no backward to measure in): the light pass
    after each forward measures the kept blocks' mass, so the learner takes the same steps as
    one trained with backwards (on the CPU both masses are the same float64 sums: the same
    bits) and recovers the planted blocks."""
    heads, n, g = 2, 512, 32
    planted, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(21))
    v = torch.randn(heads, n, 32, generator=torch.Generator().manual_seed(22))
    q, k, v = q[None], k[None], v[None]
    trained = _diagonal_start_learner(n, g)
    _learner_steps(trained, q, k, v, 8)
    frozen = _diagonal_start_learner(n, g)
    for _ in range(8):
        frozen(q, k, v)
    assert frozen.tracker.steps == 8 and frozen.tracker.grad is None
    assert torch.equal(frozen.importance, trained.importance)
    learned = frozen.pattern(n, n).blocks()
    assert float((learned & planted).sum() / planted.sum()) >= 0.95


def test_pattern_learner_tracks_every_nth_step():
    heads, n, g = 1, 256, 32
    _, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(23))
    v = torch.randn_like(q)
    learner = trisparse.PatternLearner(g, sparsity=0.5, every=1, track_every=3)
    _learner_steps(learner, q[None], k[None], v[None], 7)
    assert learner.tracker.steps == 2  # steps 3 and 6 (step 0 is dense: no pattern yet)


@pytest.mark.parametrize("causal", [False, True])
def test_cpp_selection_for_the_output_equals_the_torch_path(causal):
    """The library's CPU statistics and selection for the output (float32 inputs, and its greedy
    on float64 statistics) against the torch path on the same values in float64: masses and value
    sums within 1e-5, the same blocks (the greedy's steps well separated: values that differ by
    key block), causal budgets too; more keys than queries and partial last blocks."""
    q, k, v = _even_attention_over_block_values(n=520, block=40)
    q = 300.0 * q[:, :500]  # attention that is not flat: the masses differ
    mass, value = trisparse.block_value_mass(q.float(), k.float(), v.float(), 32, causal)
    want_mass, want_value = trisparse.block_value_mass(q, k, v, 32, causal)
    torch.testing.assert_close(mass, want_mass, rtol=0, atol=1e-5)
    torch.testing.assert_close(value, want_value, rtol=0, atol=1e-5)
    rules = {"window": 1, "global_blocks": 1}
    got = trisparse.learn_block_pattern(
        q.float(), k.float(), 32, 0.5, "output", causal, v=v.float(), **rules
    )
    # The torch ops CUDA runs, on the CPU here.
    want = trisparse.block_pattern._prune_by_output_torch(
        want_mass, want_value, 0.5, True, 1, 1, causal
    )
    assert torch.equal(got.blocks(), want) and got.shape == (500, 520)
    on_cpu = trisparse.prune_blocks_by_output(want_mass, want_value, 0.5, causal=causal, **rules)
    assert torch.equal(on_cpu, want)  # the library's greedy on float64 statistics
    by_mass = trisparse.learn_block_pattern(q.float(), k.float(), 32, 0.5, "row", causal, **rules)
    assert int((got.blocks() != by_mass.blocks()).sum()) > 100  # the greedy chose most blocks
    assert "mass and values" in got.made_by and "output" in got.made_by
    with pytest.raises(ValueError, match="needs the values"):
        trisparse.learn_block_pattern(q.float(), k.float(), 32, 0.75, "output")


@pytest.mark.parametrize("aggregate", ["ema", "mean"])
def test_pattern_learner_for_the_output_equals_the_offline_choice(aggregate):
    """PatternLearner(method="output") observing q, k, v aggregates the blocks' exact masses and
    value sums (block_value_mass's, sampled rows too) and prunes them as learn_block_pattern's
    "output" method does; it needs the values and averages them (no max)."""
    block = 32
    q, k, v = _even_attention_over_block_values(n=500, block=20)  # a partial last block
    learner = trisparse.PatternLearner(
        block, sparsity=0.75, method="output", every=1, aggregate=aggregate, window=3
    )
    for _ in range(3):
        learner.observe(q, k, v)
    mass, value = trisparse.block_value_mass(q, k, v, block)
    torch.testing.assert_close(learner.importance, mass, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(learner.values, value, rtol=1e-12, atol=1e-15)
    want = trisparse.learn_block_pattern(q, k, block, 0.75, method="output", v=v)
    assert torch.equal(learner.pattern(500, 500).blocks(), want.blocks())
    torch.manual_seed(30)  # sampled block rows: the same statistics for the rows drawn
    sampled = trisparse.PatternLearner(block, 0.75, method="output", sample_blocks=5, decay=0.0)
    sampled.observe(q, k, v)
    rows = sampled._seen.nonzero()[:, 0]
    assert rows.numel() == 5
    torch.testing.assert_close(sampled.values[:, rows], value[:, rows], rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="observes the values"):
        sampled.observe(q, k)
    with pytest.raises(ValueError, match="ema"):
        trisparse.PatternLearner(block, 0.75, method="output", aggregate="max")


def test_pattern_learner_for_the_output_in_training_steps():
    """Called in place of the attention from a diagonal-only start, the output learner takes each
    tracked step's exact statistics and reaches the offline output choice; on attention spread
    evenly over values that differ by key block its pattern's error is less than half of the
    mass learner's."""
    n, g = 512, 32
    q, k, v = _even_attention_over_block_values(n=n, block=g)
    diagonal = trisparse.BlockPattern.layout("window", n, block_size=g, window=0)
    make = lambda method: trisparse.PatternLearner(
        g, sparsity=0.75, method=method, every=1, decay=0.5, initial=diagonal, track_every=2
    )
    by_output, by_mass = make("output"), make("row")
    for learner in (by_output, by_mass):
        _learner_steps(learner, q[None], k[None], v[None], 6)
    assert by_output.tracker.steps == 0  # no kernel importance: the sampled statistics
    want = trisparse.learn_block_pattern(q, k, g, 0.75, method="output", v=v)
    got = by_output.pattern(n, n)
    assert torch.equal(got.blocks(), want.blocks()) and "prune output" in got.made_by
    err_output = trisparse.attention_error(q, k, v, got)
    err_mass = trisparse.attention_error(q, k, v, by_mass.pattern(n, n))
    assert (err_output < 0.5 * err_mass).all(), (err_output, err_mass)


@pytest.mark.gpu
def test_selection_for_the_output_on_cuda_equals_the_cpu():
    """block_value_mass and prune_blocks_by_output as torch ops on CUDA (float64): the same
    statistics and the same blocks as on the CPU, causal too."""
    q, k, v = _even_attention_over_block_values()
    for causal in (False, True):
        want = trisparse.block_value_mass(q, k, v, 32, causal=causal)
        got = trisparse.block_value_mass(q.cuda(), k.cuda(), v.cuda(), 32, causal=causal)
        for a, b in zip(got, want, strict=True):
            assert a.is_cuda and torch.allclose(a.cpu(), b, rtol=1e-12, atol=1e-15)
        keep = trisparse.prune_blocks_by_output(*got, 0.75)
        assert keep.is_cuda and torch.equal(
            keep.cpu(), trisparse.prune_blocks_by_output(*want, 0.75)
        )


@pytest.mark.gpu
def test_pattern_learner_learns_from_the_kernels_importance_on_cuda():
    heads, n, g = 2, 1024, 64
    planted, q, k = _planted(heads, n, g, 64, torch.Generator().manual_seed(24))
    v = torch.randn(heads, n, 64, generator=torch.Generator().manual_seed(25))
    q, k, v = (t[None].to("cuda", torch.bfloat16) for t in (q, k, v))
    learner = _diagonal_start_learner(n, g)
    _learner_steps(learner, q, k, v, 8)
    assert learner.tracker.steps == 8 and learner.tracker.mass.is_cuda
    learned = learner.pattern(n, n).blocks()
    assert float((learned & planted).sum() / planted.sum()) >= 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["row", "output"])
def test_pattern_learner_steps_under_cuda_graph_capture(method):
    """observe() captured once in a CUDA graph and replayed on new inputs follows the eager
    learner step for step: the same importance (and value sums) to rounding, the same pattern."""
    heads, n, g = 2, 512, 32
    _, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(26))
    q, k = q.cuda(), k.cuda()
    v = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(31))
    make = lambda: trisparse.PatternLearner(g, sparsity=0.75, method=method, every=1, decay=0.5)
    eager, graphed = make(), make()
    static_q, static_k = q.clone(), k.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-ups outside the graph, on a side stream
        for _ in range(2):
            graphed.observe(static_q, static_k, v)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        eager.observe(q, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.observe(static_q, static_k, v)
    gen = torch.Generator(device="cuda").manual_seed(27)
    for _ in range(4):
        step_q = q + 2.0 * torch.randn(q.shape, device="cuda", generator=gen)
        static_q.copy_(step_q)
        graph.replay()
        eager.observe(step_q, k, v)
    torch.cuda.synchronize()
    torch.testing.assert_close(graphed.importance, eager.importance, rtol=1e-12, atol=1e-12)
    if method == "output":
        torch.testing.assert_close(graphed.values, eager.values, rtol=1e-12, atol=1e-12)
    assert torch.equal(graphed._keep, eager._keep)


def _scheduled_learner(g, method, track_every, capturable, sparsity=0.5, freeze_after=11):
    """A learner whose warm-up is dense for 2 steps, re-pruned every 3 steps, then frozen."""
    return trisparse.PatternLearner(
        g,
        sparsity=sparsity,
        method=method,
        every=3,
        warmup=2,
        freeze_after=freeze_after,
        decay=0.5,
        track_every=track_every,
        capturable=capturable,
        **({"top_p": 0.5} if method == "threshold" else {}),
    )


def _capturable_pair(g, method, track_every=1):
    """A capturable learner and the default one it must equal."""
    return (_scheduled_learner(g, method, track_every, c) for c in (True, False))


def _moving_steps(learner, q, k, v, steps, seed):
    """Training steps on inputs that drift (the planted pattern fading into noise), so that the
    pattern changes at the re-prunes; the outputs and the masks' blocks after each step."""
    gen = torch.Generator(q.device).manual_seed(seed)
    outs, blocks = [], []
    for i in range(steps):
        noise = torch.randn(q.shape, generator=gen, device=q.device, dtype=q.dtype)
        leaves = [(q + 0.5 * i * noise).detach().requires_grad_(), k.detach(), v.detach()]
        leaves[1].requires_grad_(), leaves[2].requires_grad_()
        out = learner(*leaves)
        out.float().square().sum().backward()
        outs.append(out.detach().clone())
        blocks.append(None if learner._keep is None else learner._keep.clone())
    return outs, blocks


@pytest.mark.parametrize("track_every", [1, 2])
@pytest.mark.parametrize("method", ["row", "global", "threshold"])
@pytest.mark.parametrize("batch", [1, 2])
def test_capturable_pattern_learner_equals_the_default_learner(method, batch, track_every):
    """capturable=True (the prune moved to the next step's start, the schedule counted on the
    device and the tracking, pruning and refill kernels told by flags whether they are due, the
    pattern and its mask's plans updated in place) takes the default learner's steps: the same
    outputs, patterns and importance, bit for bit, across re-prunes and the freeze."""
    heads, n, g = 2, 256, 32
    _, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(40))
    v = torch.randn(heads, n, 32, generator=torch.Generator().manual_seed(41))
    q, k, v = (t[None].expand(batch, -1, -1, -1).contiguous() for t in (q, k, v))
    capturable, default = _capturable_pair(g, method, track_every)
    got = _moving_steps(capturable, q, k, v, 16, seed=42)
    want = _moving_steps(default, q, k, v, 16, seed=42)
    for a, b in zip(got[0], want[0]):
        assert torch.equal(a, b)
    # The default learner prunes at the end of a step, the capturable one at the next start.
    for a, b in zip(got[1][3:], want[1][2:]):
        assert torch.equal(a, b)
    assert torch.equal(capturable.importance, default.importance)
    assert capturable.steps == default.steps == 16 and capturable.device_steps() == 16
    changes = sum(not torch.equal(a, b) for a, b in zip(want[1][2:], want[1][3:]))
    assert changes >= 1  # the pattern moved at a re-prune, before the freeze


def test_capturable_pattern_learner_arguments():
    with pytest.raises(ValueError, match="capturable"):
        trisparse.PatternLearner(32, 0.5, method="output", capturable=True)
    with pytest.raises(ValueError, match="capturable"):
        trisparse.PatternLearner(32, 0.5, aggregate="max", capturable=True)
    assert trisparse.PatternLearner(32, 0.5, capturable=True).track_every == 4
    assert trisparse.PatternLearner(32, 0.5, track_every=1, capturable=True).track_every == 1


def _check_prune_kernel(device):
    """The library's prune (what a capturable learner and prune_blocks on CUDA run) against
    prune_blocks' torch ops on the CPU: "row" and "global", keep rules, ties (importance rounded to a few values, or none), NaN and -0; heads
    of more than 16,384 blocks (the global prune over many thread blocks on CUDA, ties across
    its chunks); nothing written where the flag says it is not due."""
    from trisparse import _C, _tensors
    from trisparse.block_pattern import _forced_blocks, _prune_budget

    gen = torch.Generator().manual_seed(46)
    shapes = ((3, 7, 5, 4), (2, 40, 37, 4), (1, 3, 600, 4), (2, 131, 150, 4), (1, 150, 131, 0))
    for heads, qb, kb, levels in shapes:
        imp = torch.rand(heads, qb, kb, generator=gen, dtype=torch.float64)
        if levels:
            imp = (imp * levels).round() / levels
        imp[0, 0, :2] = torch.tensor([float("nan"), -0.0])
        imp = imp.to(device)
        for method, rules, sparsity in (
            ("row", {}, 0.5),
            ("row", {"window": 1, "global_blocks": 1}, 0.8),
            ("global", {}, 0.7),
            ("global", {"keep_diagonal": False}, 0.95),
        ):
            want = trisparse.prune_blocks(imp.cpu(), sparsity, method, **rules).to(device)
            # (on CUDA prune_blocks runs the kernels; on the CPU the torch ops, the reference)
            assert torch.equal(trisparse.prune_blocks(imp, sparsity, method, **rules), want)
            r = {"keep_diagonal": True, "window": 0, "global_blocks": 0, **rules}
            forced = _forced_blocks(qb, kb, imp.device, *r.values()).expand(qb, kb).contiguous()
            budget = _prune_budget(sparsity, kb * (qb if method == "global" else 1))
            nbytes = _C.prune_block_importance_workspace_bytes(heads, qb, kb, method)
            assert (nbytes > 0) == (method == "global" and qb * kb > 16384)
            ws = torch.full((nbytes,), 255, dtype=torch.uint8, device=device)  # (poisoned)
            for due in (True, False):
                keep = torch.zeros(heads, qb, kb, dtype=torch.bool, device=device)
                flag = torch.tensor(due, device=device)
                args = (forced.data_ptr(), keep.data_ptr(), flag.data_ptr(), heads, qb, kb)
                dev = _tensors.device_index(imp.device)
                stream = _tensors.stream(imp.device)
                _C.prune_block_importance(
                    imp.data_ptr(), *args, budget, method, dev, stream, ws.data_ptr(), nbytes
                )
                assert torch.equal(keep, want if due else torch.zeros_like(keep)), (method, rules)
            if nbytes > 0 and device != "cpu":  # (the CPU takes none)
                with pytest.raises(ValueError, match="workspace holds 0 bytes"):
                    _C.prune_block_importance(
                        imp.data_ptr(), *args, budget, method, dev, stream, 0, 0
                    )


def test_prune_kernel_equals_prune_blocks():
    _check_prune_kernel("cpu")


@pytest.mark.gpu
def test_prune_kernel_equals_prune_blocks_on_the_gpu():
    _check_prune_kernel("cuda")


def test_block_mask_refresh_follows_new_blocks():
    """refresh_ after writing new blocks in place: the attention runs under the new mask (the
    host plan made again), its fold for a batch too."""
    g, n = 32, 128
    gen = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(2, 2, n, 32, generator=gen) for _ in range(3))
    blocks = torch.rand(1, 2, 4, 4, generator=gen) < 0.5
    blocks |= torch.eye(4, dtype=torch.bool)
    mask = trisparse.BlockMask(blocks.clone(), g)
    trisparse.block_sparse_attention(q, k, v, mask)
    new = ~blocks | torch.eye(4, dtype=torch.bool)
    mask.blocks.copy_(new)
    mask.refresh_()
    want = trisparse.block_sparse_attention(q, k, v, trisparse.BlockMask(new, g))
    assert torch.equal(trisparse.block_sparse_attention(q, k, v, mask), want)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, shared", [(1, False), (2, False), (2, True)])
def test_block_mask_refresh_rewrites_the_device_plan(batch, shared):
    """A mask on the GPU rewritten in place: refresh_ rewrites its plan's lists (and its fold's)
    by kernels; forward and gradients equal a new mask's, bitwise, at G 64 and 128, causal or
    not."""
    for g, causal in ((64, False), (128, True), (64, True)):
        n = 1000
        nb = -(-n // g)
        gen = torch.Generator("cuda").manual_seed(g + causal)
        q, k, v = (
            torch.randn(batch, 4, n, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(3)
        )
        heads = 1 if shared else 4
        first = torch.rand(1, heads, nb, nb, generator=gen, device="cuda") < 0.3
        second = torch.rand(1, heads, nb, nb, generator=gen, device="cuda") < 0.3
        mask = trisparse.BlockMask(first.clone(), g, causal=causal)
        want = trisparse.block_sparse_attention(q, k, v, mask)
        mask.blocks.copy_(second)
        mask.refresh_(torch.tensor(False, device="cuda"))  # not due: the plan stays
        assert torch.equal(trisparse.block_sparse_attention(q, k, v, mask), want)
        mask.refresh_(torch.tensor(True, device="cuda"))
        fresh = trisparse.BlockMask(second, g, causal=causal)
        for m in (mask, fresh):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = trisparse.block_sparse_attention(*leaves, m)
            out.float().square().sum().backward()
            got = (out, *(t.grad for t in leaves))
            if m is mask:
                ours = got
        for a, b in zip(ours, got):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("method, track_every", [("row", 1), ("global", 3), ("threshold", 2)])
def test_capturable_pattern_learner_under_cuda_graph_capture(method, track_every):
    """A training step with a capturable PatternLearner (forward, backward, an optimizer's
    step) captured once in a CUDA graph and replayed follows the same learner run eagerly and
    the default learner: the same importance and patterns (tracked, re-pruned at the replays
    where due, then frozen), bit for bit, and the weights to the GEMMs' rounding."""
    heads, n, g, d = 2, 1024, 64, 64
    _, q0, k0 = _planted(heads, n, g, d, torch.Generator().manual_seed(44))
    base = torch.cat([q0, k0], -1).transpose(0, 1).reshape(n, 2 * heads * d).cuda()

    def model_and_learner(capturable=True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(2 * heads * d, 3 * heads * d, device="cuda")
        learner = _scheduled_learner(g, method, track_every, capturable, 0.75, freeze_after=14)
        opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
        return lin, learner, opt

    def step(lin, learner, opt, x):
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            qkv = lin(x).view(1, n, 3, heads, d).permute(2, 0, 3, 1, 4)
            out = learner(qkv[0], qkv[1], qkv[2])
            loss = out.float().square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    gen = torch.Generator("cuda").manual_seed(45)
    inputs = [base + 0.5 * torch.randn(base.shape, device="cuda", generator=gen) for _ in range(18)]
    eager, default = model_and_learner(), model_and_learner(capturable=False)
    for x in inputs:
        step(*eager, x)
        step(*default, x)
    assert torch.equal(eager[1]._keep, default[1]._keep)
    torch.testing.assert_close(eager[1].importance, default[1].importance, rtol=0, atol=0)
    graphed = model_and_learner()
    static_x = inputs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # dense warm-up and two sparse steps, eagerly
        for x in inputs[:4]:
            static_x.copy_(x)
            step(*graphed, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*graphed, static_x)
    for x in inputs[4:]:
        static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    assert graphed[1].device_steps() == 18
    assert torch.equal(graphed[1]._keep, eager[1]._keep)
    torch.testing.assert_close(graphed[1].importance, eager[1].importance, rtol=0, atol=0)
    for a, b in zip(graphed[0].parameters(), eager[0].parameters()):  # (GEMMs may differ)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method", ["row", "global", "threshold"])
def test_cpp_learner_equals_the_torch_path(method, causal):
    """The library's CPU learner (float32 inputs) against the torch path on the same values in
    float64: block masses within 1e-5, the same kept blocks (well separated planted masses)."""
    heads, n, g = 2, 320, 32
    _, q, k = _planted(heads, n, g, 32, torch.Generator().manual_seed(28))
    q = q[:, :300]  # a partial last query block, more keys than queries
    fast = trisparse.block_mass(q, k, g, causal)
    exact = trisparse.block_mass(q.double(), k.double(), g, causal)
    torch.testing.assert_close(fast, exact, rtol=0, atol=1e-5)
    rules = {"window": 1, "global_blocks": 1, "top_p": 0.8}
    got = trisparse.learn_block_pattern(q, k, g, 0.75, method, causal, **rules)
    keep = trisparse.prune_blocks(exact, 0.75, method, **rules)
    assert torch.equal(got.blocks(), keep) and got.shape == (300, 320)
    assert "learned" in got.made_by and method in got.made_by
    with pytest.raises(TypeError, match="unknown keep rules"):
        trisparse.learn_block_pattern(q, k, g, 0.75, method, window_size=3)


@pytest.mark.parametrize("aggregate", ["ema", "mean", "max"])
def test_pattern_learner_aggregates_over_a_window(aggregate):
    """Each observation's exact mass folds in as `aggregate` says: the mean or the max of each
    block row's last `window` observations (older ones forgotten), or the moving average."""
    gen = torch.Generator().manual_seed(29)
    obs = [
        tuple(torch.randn(2, 96, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        for _ in range(5)
    ]
    learner = trisparse.PatternLearner(
        32, sparsity=0.5, every=1, aggregate=aggregate, window=3, decay=0.5
    )
    masses = []
    for q, k in obs:
        learner.observe(q, k)
        masses.append(trisparse.block_mass(q, k, 32))
    last = torch.stack(masses[-3:])
    want = {
        "mean": last.mean(0),
        "max": last.amax(0),
        "ema": masses[0],
    }[aggregate]
    if aggregate == "ema":
        for m in masses[1:]:
            want = 0.5 * want + 0.5 * m
    torch.testing.assert_close(learner.importance, want, rtol=1e-12, atol=1e-12)
    assert aggregate in learner.pattern(96, 96).made_by
    with pytest.raises(ValueError, match="aggregate"):
        trisparse.PatternLearner(32, 0.5, aggregate="median")
