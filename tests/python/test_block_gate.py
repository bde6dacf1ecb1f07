"""trisparse.BlockGate: the learned block router. Untrained it is pooled top-k's estimate; trained
by distillation it finds planted attention blocks that pooled means cannot see, and its masks run
the block-sparse attention."""

import math

import pytest
import torch
import trisparse
from conftest import CUDA

H, D, G = 2, 32, 32


def planted(n, seed, offset=3, strength=4.0, dim=D):
    """q, k [H, n, D] whose attention sits at key block r - offset for query block r: in each such
    pair of blocks, rows alternate +u and -u (u a random unit vector per pair and head), so the
    blocks' mean rows cancel (pooled q . k cannot see the pair) while a query and the keys of its
    sign score strength^2 |u|^2."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(H, n, dim, generator=gen) * 0.3
    k = torch.randn(H, n, dim, generator=gen) * 0.3
    sign = torch.tensor([1.0, -1.0]).repeat(G // 2)[:, None]
    for r in range(offset, n // G):
        u = torch.nn.functional.normalize(torch.randn(H, 1, dim, generator=gen), dim=-1)
        c = r - offset
        q[:, r * G : (r + 1) * G] += strength * sign * u
        k[:, c * G : (c + 1) * G] += strength * sign * u
    return q, k


def planted_blocks(n, offset=3):
    nb = n // G
    want = torch.zeros(nb, nb, dtype=torch.bool)
    for r in range(offset, nb):
        want[r, r - offset] = True
    return want


@pytest.mark.parametrize("causal", [False, True])
def test_an_untrained_gate_is_the_pooled_estimate(causal):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(H, 200, D, generator=gen), torch.randn(H, 200, D, generator=gen)
    gate = trisparse.BlockGate(H, D, G, causal=causal)
    with torch.no_grad():
        got = gate(q, k).exp().double()
    want = trisparse.pooled_block_mass(q, k, G, causal)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(H, got.shape[1], dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, n_k", [(200, 200), (256, 256), (130, 190)])
def test_probes_of_one_row_are_the_true_block_mass(causal, n_q, n_k):
    """Untrained, probes pool finer: with a probe per row and per key the gate's estimate is the
    exact block mass (causal per row, ragged ends); probes (1, 1) are the plain gate."""
    gen = torch.Generator().manual_seed(n_q + n_k)
    q = torch.randn(H, n_q, D, generator=gen, dtype=torch.float64)
    k = torch.randn(H, n_k, D, generator=gen, dtype=torch.float64)
    gate = trisparse.BlockGate(H, D, G, causal=causal, probes=G).double()
    with torch.no_grad():
        got = gate(q, k).exp()
        plain = trisparse.BlockGate(H, D, G, causal=causal, probes=(1, 1)).double()(q, k)
        assert torch.equal(plain, trisparse.BlockGate(H, D, G, causal=causal).double()(q, k))
    torch.testing.assert_close(got, trisparse.block_mass(q, k, G, causal), rtol=0, atol=1e-12)
    # Coarser probes: each block row's estimate sums to 1, the blocks causal excludes stay
    # excluded, and the gradients are finite (no -inf inside the log-sum-exps).
    coarse = trisparse.BlockGate(H, D, G, causal=causal, probes=(4, 8)).double()
    logp = coarse(q, k)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(logp.shape[:-1], dtype=q.dtype))
    assert torch.equal(torch.isfinite(logp), torch.isfinite(plain))
    coarse.loss(q, k, trisparse.block_mass(q, k, G, causal)).backward()
    assert all(torch.isfinite(p.grad).all() for p in coarse.parameters())
    with pytest.raises(ValueError, match="probes"):
        trisparse.BlockGate(H, D, G, probes=(3, 1))


def test_distillation_finds_planted_blocks_pooled_means_miss():
    n = 1024
    samples = [planted(n, seed) for seed in range(4)]
    gate = trisparse.BlockGate(H, D, G, causal=True, max_distance=8)
    q, k = planted(n, seed=99)  # a fresh input: its own directions
    want = planted_blocks(n).expand(H, -1, -1)
    mass = trisparse.block_mass(q, k, G, causal=True)
    assert float((mass * want).sum() / want[:, :, 0].numel()) > 0.3  # the planted blocks matter
    losses = gate.fit(samples, steps=150, lr=3e-2)
    assert losses[-1] < losses[0]
    found = gate.select(q, k, sparsity=0.9)
    recovered = float((found & want).sum() / want.sum())
    pooled = trisparse.prune_blocks(trisparse.pooled_block_mass(q, k, G, True), 0.9)
    assert recovered >= 0.95, recovered
    assert float((pooled & want).sum() / want.sum()) < 0.5  # pooled q . k misses them
    # The trained estimate is closer to the fresh input's true mass than the untrained one.
    assert gate.loss(q, k, mass) < trisparse.BlockGate(H, D, G, causal=True).loss(q, k, mass)


def test_fit_decays_the_rate_along_a_cosine():
    q, k = planted(256, seed=1)
    mass = trisparse.block_mass(q, k, G, causal=True)
    gates = [trisparse.BlockGate(H, D, G, causal=True, max_distance=8) for _ in range(3)]
    for gate in gates[1:]:
        gate.load_state_dict(gates[0].state_dict())
    steps, lr = 6, 3e-2
    gates[0].fit([(q, k)], steps=steps, lr=lr)
    gates[1].fit([(q, k, mass)], steps=steps, lr=lr, schedule="constant")
    opt = torch.optim.Adam(gates[2].parameters(), lr=lr)
    for step in range(steps):  # the documented rate, step by step
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = gates[2].loss(q, k, mass)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for a, b in zip(gates[0].parameters(), gates[2].parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(gates[0].parameters(), gates[1].parameters()))
    with pytest.raises(ValueError, match="schedule"):
        gates[0].fit([(q, k)], steps=1, schedule="linear")


@pytest.mark.parametrize("causal", [False, True])
def test_rank_loss_matches_its_pairs_written_out(causal):
    q, k = planted(192, seed=4)
    gate = trisparse.BlockGate(H, D, G, causal=causal, max_distance=8, probes=(2, 4))
    with torch.no_grad():
        gate.wq.add_(0.05 * torch.randn(gate.wq.shape, generator=torch.Generator().manual_seed(1)))
    mass = trisparse.block_mass(q, k, G, causal=causal)
    logp = gate(q, k).detach().double()
    top = 3
    rows = []
    for h in range(H):
        for r in range(mass.shape[1]):
            m, s = mass[h, r].double(), logp[h, r]
            total = 0.0
            for i in m.argsort(descending=True, stable=True)[:top].tolist():
                for j in range(m.numel()):
                    w = max(float(m[i] - m[j]), 0.0)
                    if w > 0:  # j outside the causal blocks: m_j = 0 < m_i, s_j = -inf
                        total += w * float(torch.nn.functional.softplus(s[j] - s[i]))
            rows.append(total)
    got = gate.rank_loss(q, k, mass, top=top)
    assert torch.isfinite(got)
    assert math.isclose(float(got.detach()), sum(rows) / len(rows), rel_tol=1e-4, abs_tol=1e-6)
    got.backward()
    assert all(torch.isfinite(p.grad).all() for p in gate.parameters())
    with pytest.raises(ValueError, match="target"):
        gate.rank_loss(q, k, mass[:, 1:])
    with pytest.raises(ValueError, match="top"):
        gate.rank_loss(q, k, mass, top=0)


def test_fit_with_the_rank_loss_orders_the_planted_blocks_first():
    samples = [planted(1024, seed) for seed in range(4)]
    q, k = planted(1024, seed=98)
    mass = trisparse.block_mass(q, k, G, causal=True)
    gate = trisparse.BlockGate(H, D, G, causal=True, max_distance=8)
    untrained = float(gate.rank_loss(q, k, mass, top=4).detach())
    losses = gate.fit(samples, steps=150, lr=3e-2, rank_weight=1.0, rank_top=4)
    assert losses[-1] < losses[0]
    assert float(gate.rank_loss(q, k, mass, top=4).detach()) < 0.7 * untrained
    found = gate.select(q, k, sparsity=0.9)
    want = planted_blocks(1024).expand(H, -1, -1)
    assert float((found & want).sum() / want.sum()) >= 0.95
    with pytest.raises(ValueError, match="rank_weight"):
        gate.fit(samples, steps=1, rank_weight=-1.0)


def _gate_learner_steps(learner, inputs, v):
    """Training steps as a model calls the learner: attention on [1, H, N, D], a loss,
    backward; returns the last step's (mask the learner attended under, output, gradients)."""
    for q, k in inputs:
        leaves = [t[None].clone().requires_grad_() for t in (q, k, v)]
        out = learner(*leaves)
        out.square().sum().backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize(
    "device, probes", [("cpu", 1), ("cpu", (2, 4)), pytest.param("cuda", 1, marks=CUDA.marks)]
)
def test_gate_learner_distils_while_training_and_attends_under_its_blocks(device, probes):
    """A GateLearner called in place of the attention: dense through the warm-up, distilling
    the gate on each step's exact block mass; past it, block-sparse under each input's own
    blocks (the output and the gradients of q, k, v those of block_sparse_attention under the
    gate's mask); on a fresh input it finds >= 95 % of the planted blocks pooled q . k misses.
    Evaluation calls take no step. On CUDA (bf16 and head dim 64, which the block kernels take,
    as a model under autocast calls it) the gate's selection, fit and mask stay on the device."""
    n, dim = 1024, D if device == "cpu" else 64
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    learner = trisparse.GateLearner(
        H,
        dim,
        G,
        0.9,
        causal=True,
        warmup=4,
        fit_every=1,
        fit_steps=40,
        lr=3e-2,
        max_distance=8,
        probes=probes,
    )
    assert learner.gate.probes == ((probes, probes) if isinstance(probes, int) else probes)
    v = torch.randn(H, n, dim, generator=torch.Generator().manual_seed(7)).to(device, dtype)

    def on_device(seed):
        return tuple(t.to(device, dtype) for t in planted(n, seed, dim=dim))

    inputs = [on_device(seed) for seed in range(4)]
    out, _ = _gate_learner_steps(learner, inputs, v)
    assert learner.steps == 4 and float(learner.last_loss) > 0
    dense = torch.nn.functional.scaled_dot_product_attention(
        inputs[-1][0][None], inputs[-1][1][None], v[None], is_causal=True
    )
    torch.testing.assert_close(out, dense)  # the warm-up attends densely
    q, k = on_device(99)
    with torch.no_grad():
        learner(q[None], k[None], v[None])
    assert learner.steps == 4  # evaluation: no step
    want = planted_blocks(n).expand(H, -1, -1).to(device)
    found = learner.gate.select(q, k, sparsity=0.9)
    assert float((found & want).sum() / want.sum()) >= 0.95
    # Past the warm-up: block-sparse under the mask the gate (distilled first) gives this input.
    out, grads = _gate_learner_steps(learner, [(q, k)], v)
    assert learner.steps == 5
    chosen = learner.gate.block_mask(q, k, 0.9)
    assert chosen.blocks.device.type == device
    assert chosen.blocks.sum() < 0.2 * chosen.blocks.numel()
    leaves = [t[None].clone().requires_grad_() for t in (q, k, v)]
    want_out = trisparse.block_sparse_attention(*leaves, chosen)
    want_out.square().sum().backward()
    torch.testing.assert_close(out, want_out)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad)
    with pytest.raises(ValueError, match="sparsity"):
        trisparse.GateLearner(H, D, G, 1.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("probes", [1, (2, 4)])
def test_select_is_prune_blocks_of_the_gates_mass(causal, probes):
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, H, 1000, D, generator=gen), torch.randn(2, H, 1000, D, generator=gen)
    gate = trisparse.BlockGate(H, D, G, causal=causal, probes=probes)
    with torch.no_grad():
        gate.bias.normal_(generator=gen)
        logp = gate(q, k)
    for sparsity in (0.5, 0.8, 0.95):
        want = trisparse.prune_blocks(logp.exp().flatten(0, 1), sparsity).view(logp.shape)
        want = want & torch.isfinite(logp) if causal else want
        assert torch.equal(gate.select(q, k, sparsity), want)
    slow = gate.select(q, k, 0.8, method="row", window=0)  # the keep rules' path
    assert torch.equal(slow, gate.select(q, k, 0.8))


def test_select_keeps_causal_blocks_and_the_diagonal():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(H, 300, D, generator=gen), torch.randn(H, 300, D, generator=gen)
    gate = trisparse.BlockGate(H, D, G, causal=True)
    keep = gate.select(q, k, sparsity=0.7)
    nb = math.ceil(300 / G)
    assert keep.shape == (H, nb, nb)
    assert not (keep & ~torch.ones(nb, nb, dtype=torch.bool).tril()).any()
    assert keep.diagonal(dim1=1, dim2=2).all()
    mask = gate.block_mask(q, k, sparsity=0.7)
    assert mask.shape == (1, H, nb, nb) and mask.causal and torch.equal(mask.blocks[0], keep)
    # Its mask runs the attention: rows see only their kept blocks' keys.
    v = torch.randn(H, 300, D, generator=gen)
    out = trisparse.block_sparse_attention(
        q[None].double(), k[None].double(), v[None].double(), mask
    )[0]
    want = trisparse.dense_attention(q.double(), k.double(), v.double(), causal=True)
    assert out.shape == want.shape and torch.isfinite(out).all()


def test_a_batch_gets_each_sequences_own_blocks():
    n = 512
    pairs = [planted(n, seed) for seed in (7, 8)]
    q, k = (torch.stack(t) for t in zip(*pairs))  # [2, H, N, D]
    gate = trisparse.BlockGate(H, D, G, causal=True, max_distance=8)
    gate.fit([(q, k)], steps=60, lr=3e-2)
    keep = gate.select(q, k, sparsity=0.8)
    for b in range(2):
        assert torch.equal(keep[b], gate.select(q[b], k[b], sparsity=0.8))
    mass = torch.stack([trisparse.block_mass(q[b], k[b], G, True) for b in range(2)])
    with torch.no_grad():
        both = float(gate.loss(q, k, mass))
        each = [float(gate.loss(q[b], k[b], mass[b])) for b in range(2)]
    assert both == pytest.approx(sum(each) / 2, rel=1e-5)
    mask = gate.block_mask(q, k, sparsity=0.8)
    assert mask.shape == (2, H, n // G, n // G)
    v = torch.randn_like(q)
    out = trisparse.block_sparse_attention(q.double(), k.double(), v.double(), mask)
    for b in range(2):
        one = trisparse.block_sparse_attention(
            q[b : b + 1].double(),
            k[b : b + 1].double(),
            v[b : b + 1].double(),
            gate.block_mask(q[b], k[b], sparsity=0.8),
        )
        assert torch.allclose(out[b : b + 1], one)


def test_bad_shapes_name_the_arguments():
    gate = trisparse.BlockGate(H, D, G)
    with pytest.raises(ValueError, match="q and k must be"):
        gate(torch.randn(H + 1, 64, D), torch.randn(H + 1, 64, D))
    with pytest.raises(ValueError, match="target must be the block mass"):
        gate.loss(torch.randn(H, 64, D), torch.randn(H, 64, D), torch.ones(H, 3, 3))
    with pytest.raises(ValueError, match="heads, head_dim and block_size"):
        trisparse.BlockGate(0, D, G)
    with pytest.raises(ValueError, match="samples"):
        gate.fit([])


@pytest.mark.gpu
@pytest.mark.skipif(not trisparse.cuda_available(), reason="needs a CUDA device and build")
def test_a_gate_on_cuda_routes_the_tensor_core_kernels():
    n, dim = 2048, 64  # the CUDA block kernels take head dims 64 and 128
    q, k = (t.cuda() for t in planted(n, seed=5, dim=dim))
    gate = trisparse.BlockGate(H, dim, G, causal=True, max_distance=8).cuda()
    samples = [tuple(t.cuda() for t in planted(n, seed, dim=dim)) for seed in range(3)]
    gate.fit(samples, steps=100, lr=3e-2)
    want = planted_blocks(n).expand(H, -1, -1).cuda()
    found = gate.select(q, k, sparsity=0.9)
    assert float((found & want).sum() / want.sum()) >= 0.95
    mask = gate.block_mask(q, k, sparsity=0.9)
    assert mask.blocks.device.type == "cuda"
    v = torch.randn_like(q)
    args = [t[None].to(torch.bfloat16) for t in (q, k, v)]
    out = trisparse.block_sparse_attention(*args, mask)[0].float().cpu()
    ref = trisparse.block_sparse_attention(*[t.double().cpu() for t in args], mask)[0]
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()
