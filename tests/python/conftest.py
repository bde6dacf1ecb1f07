"""Shared helpers: random graphs of awkward shapes, a dense float64 oracle, the shared datasets."""

import math
import os
import pathlib

import numpy as np
import pytest
import torch

# Every workspace the ops take is poisoned (NaN) before they run: see trisparse._tensors. Set
# before trisparse is imported.
os.environ.setdefault("TRISPARSE_POISON_WORKSPACE", "1")


# "cuda" as a test parameter: the gpu marker's (skipped below without a device or a CUDA build).
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def pytest_collection_modifyitems(config, items):
    import trisparse  # (after the environment above)

    if not torch.cuda.is_available() or not trisparse.cuda_available():
        skip = pytest.mark.skip(reason="no CUDA device or build: skipping GPU tests")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def random_edge_index(num_src, num_dst, max_degree, seed, self_loops=False):
    """[2, E] in PyG's convention, unique edges; some targets get none (empty rows), some sources
    are never used (empty columns)."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, max_degree + 1, (num_dst,), generator=g)
    dst = torch.repeat_interleave(torch.arange(num_dst), deg)
    src = torch.randint(0, max(num_src, 1), (dst.numel(),), generator=g)
    if self_loops:
        n = min(num_src, num_dst)
        dst = torch.cat([dst, torch.arange(n)])
        src = torch.cat([src, torch.arange(n)])
    key = torch.unique(dst * max(num_src, 1) + src)
    return torch.stack([key % max(num_src, 1), key // max(num_src, 1)])


def dense_attention(q, k, v, edge_index, scale):
    """The oracle: masked dense softmax in float64 (rows without edges give zeros)."""
    return dense_attention_in(q.double(), k.double(), v.double(), edge_index, scale)


def dense_attention_in(q, k, v, edge_index, scale):
    """Masked dense softmax attention in q's precision (PyTorch's kernels, no upcast)."""
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    mask[edge_index[1], edge_index[0]] = True
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, v)


def datasets_dir():
    env = os.environ.get("TRISPARSE_DATASETS")
    d = (
        pathlib.Path(env)
        if env
        else pathlib.Path(__file__).resolve().parents[3] / "shared" / "datasets"
    )
    return d if (d / "MANIFEST.md").exists() else None


def shared_graph_names():
    """Names of the shared graphs (['cora'] when the datasets are absent: its test then skips)."""
    d = datasets_dir()
    return sorted(p.name[: -len(".el.xz")] for p in d.glob("*.el.xz")) if d else ["cora"]


def load_shared_graph(name):
    """edge_index of a shared graph in PyG's convention, made symmetric and unique (the package's
    reader); skips the test when ../shared/datasets is absent."""
    d = datasets_dir()
    if d is None or not (d / f"{name}.el.xz").exists():
        pytest.skip("../shared/datasets not found (set TRISPARSE_DATASETS): skipping")
    import trisparse.datasets

    return trisparse.datasets.read_graph(d / f"{name}.el.xz", undirected=True)


def _philox(c, seed):
    """Philox4x32-10 of the counters c (four uint64 arrays holding 32-bit values) under the 64-bit
    key `seed`: the four words, as trisparse/core/dropout.hpp's draw()."""
    mask = np.uint64(0xFFFFFFFF)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1]
        c.append(p0 & mask)
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c)


def philox_factors(rows_i, rows_j, heads, state, p: float):
    """Attention dropout's factors [pairs, len(heads)] (float64) for query rows rows_i and key
    rows rows_j of the head ids `heads` (sequence * H + head), as trisparse/core/dropout.hpp
    draws them from state = {seed, offset}: Philox4x32-10 counted by (query set, j / 2, head,
    offset), the query set 4 (i / 16) + (i % 8) / 2; 16-bit half j % 2 of word
    2 ((i / 8) % 2) + i % 2 against round(p 2^16)."""
    seed, offset = (int(x) % 2**64 for x in state.tolist())
    i, j = np.asarray(rows_i, np.int64), np.asarray(rows_j, np.int64)
    query_set = ((i >> 4) << 2) | ((i >> 1) & 3)
    pick = ((i >> 3) & 1) * 2 + (i & 1)
    t = p * 2.0**16
    below = 65535 if t >= 65535 else int(t + 0.5)
    out = []
    for h in heads:
        c = [query_set.astype(np.uint64), (j >> 1).astype(np.uint64)]
        c += [np.full_like(c[0], h), np.full_like(c[0], offset & 0xFFFFFFFF)]
        words = _philox(c, seed)[pick, np.arange(i.size)]
        draws = np.where(j & 1, words >> np.uint64(16), words & np.uint64(0xFFFF))
        out.append(np.where(draws < below, 0.0, 1.0 / (1.0 - p)))
    return torch.from_numpy(np.stack(out, 1))


def philox_edge_factors(edges, heads: int, state, p: float):
    """Attention dropout's factors [len(edges), heads] (float64) of input edges `edges`, as the
    multigraph and GAT kernels draw them (trisparse/core/dropout.hpp's edge_word): Philox4x32-10
    counted by (u's low and high 32 bits, head / 4, offset), word head % 4 against
    round(p 2^32)."""
    seed, offset = (int(x) % 2**64 for x in state.tolist())
    u = np.asarray(edges, np.int64).astype(np.uint64)
    t = p * 2.0**32
    below = 4294967295 if t >= 4294967295 else int(t + 0.5)
    out = []
    for h in range(heads):
        c = [u & np.uint64(0xFFFFFFFF), u >> np.uint64(32), np.full_like(u, h >> 2)]
        c.append(np.full_like(u, offset & 0xFFFFFFFF))
        words = _philox(c, seed)[h & 3]
        out.append(np.where(words < below, 0.0, 1.0 / (1.0 - p)))
    return torch.from_numpy(np.stack(out, 1))


def block_dropout_reference(q, k, v, dout, blocks, g, causal, state, p, bias=None):
    """float64 out, dq, dk, dv (and with `bias` [B|1, H|1, QB, KB], a score bias per block, its
    gradient) of block-sparse attention of q [B, H, N_q, D] under `blocks` [B, H, QB, KB] of size g
    (causal: at the bottom right) with attention dropout p drawn as the kernels draw it from state
    = {seed, offset} (head b * H + h, rows within the sequence)."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    xs = [
        t.detach().double().requires_grad_() for t in (q, k, v, *([] if bias is None else [bias]))
    ]
    qi, kj = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    allowed = blocks.repeat_interleave(g, 2).repeat_interleave(g, 3)[:, :, :n_q, :n_k]
    if causal:
        allowed = allowed & (kj <= qi + n_k - n_q)
    ii, jj = (t.expand(n_q, n_k).flatten() for t in (qi, kj))
    m = philox_factors(ii, jj, range(b * h), state, p).T.reshape(b, h, n_q, n_k)
    s = xs[0] @ xs[1].transpose(-1, -2) / d**0.5
    if bias is not None:
        s = s + xs[3].repeat_interleave(g, 2).repeat_interleave(g, 3)[..., :n_q, :n_k]
    s = s.masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(s, -1).nan_to_num(0.0) * m) @ xs[2]
    return [out.detach(), *torch.autograd.grad(out, xs, dout.double())]


def edge_dropout_draws(seed, edges, heads, p, pyg, device, dtype=torch.float32):
    """The factors [E, H] (float64, CPU) the multigraph attention applies for dropout p after
    seeding `device`'s generator with `seed`: with pyg, F.dropout over [E, H] ones of `dtype`
    (the call's: float64 for float64 on the CPU), as PyG's over its weights; else the kernels' own draws, recomputed here (input edge u's word of head h,
    philox_edge_factors) from the state the call takes from torch's generator."""
    if p == 0:
        return None
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    if pyg:
        ones = torch.ones(edges, heads, device=device, dtype=dtype)
        return torch.nn.functional.dropout(ones, p=p, training=True).double().cpu()
    state = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=device).cpu()
    return philox_edge_factors(torch.arange(edges), heads, state, p)


def edge_attention_oracle(q, k, v, r, a, edge_index, num_rows, scale, keep=None):
    """The edge-feature attention in float64 per edge (each copy of a pair its own term; `keep`:
    dropout factors [E, H] on the weights)."""
    src, dst = edge_index
    s = scale * (q[dst] * k[src]).sum(-1)
    if r is not None:
        s = s + (r[dst] * a[:, None, :]).sum(-1)
    heads = q.shape[1]
    m = torch.full((num_rows, heads), -math.inf, dtype=s.dtype)
    m = m.scatter_reduce(0, dst[:, None].expand_as(s), s, "amax")
    w = (s - m[dst]).exp()
    total = torch.zeros(num_rows, heads, dtype=s.dtype).index_add(0, dst, w)
    alpha = w / total[dst]
    if keep is not None:
        alpha = alpha * keep
    out = torch.zeros(num_rows, heads, q.shape[2], dtype=s.dtype)
    out = out.index_add(0, dst, alpha[..., None] * v[src])
    if r is None:
        return out, None
    out_edge = torch.zeros(num_rows, heads, a.shape[1], dtype=s.dtype)
    return out, out_edge.index_add(0, dst, alpha[..., None] * a[:, None, :])


def hub_multigraph(num_src, num_dst, degree, seed, g, hub=(5, 900), fan=(7, 400)):
    """[2, E] edge_index of a bipartite multigraph: random edges (random_edge_index), a third of
    them repeated, target hub[0] with hub[1] more incoming edges and source fan[0] with fan[1]
    more outgoing ones (heavy lines), shuffled; random draws from generator g."""
    ei = random_edge_index(num_src, num_dst, degree, seed=seed)
    picks = torch.randint(0, ei.shape[1], (ei.shape[1] // 3,), generator=g)
    (target, t_count), (source, s_count) = hub, fan
    into = torch.stack(
        [torch.randint(0, num_src, (t_count,), generator=g), torch.full((t_count,), target)]
    )
    out_of = torch.stack(
        [torch.full((s_count,), source), torch.randint(0, num_dst, (s_count,), generator=g)]
    )
    ei = torch.cat([ei, ei[:, picks], into, out_of], dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=g)]
