"""trisparse.distributed: partitions; the layers over a partitioned graph (the whole graph or a
sharded load; community, hub and skewed graphs, a rank owning no edge) and context-parallel
block-sparse attention on two to four processes (Gloo on the CPU in float64; NCCL on two GPUs
where there are) against one process: outputs, the gradients of the inputs and of every weight,
bitwise repeatable; the Planetoid example over two processes."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import trisparse
import trisparse.nn
from conftest import datasets_dir
from trisparse.distributed import DistributedPattern, partition, partition_stats

N, F, E = 70, 8, 360


def _graph(seed: int = 3):
    """A multigraph of two communities (80 % of the edges inside one) with repeated edges, self
    loops and isolated nodes (the last five)."""
    gen = torch.Generator().manual_seed(seed)
    half = (N - 5) // 2
    src = torch.randint(0, N - 5, (E,), generator=gen)
    inside = src // half * half + torch.randint(0, half, (E,), generator=gen)
    anywhere = torch.randint(0, N - 5, (E,), generator=gen)
    dst = torch.where(torch.rand(E, generator=gen) < 0.8, inside.clamp_max(N - 6), anywhere)
    dst[:40] = src[:40]  # self loops
    ei = torch.stack([src, dst])
    ei = torch.cat([ei, ei[:, 50:80]], dim=1)  # repeated edges
    return ei, torch.randn(ei.shape[1], 3, generator=gen, dtype=torch.float64)


def _hub_graph(seed: int = 4):
    """Node 0 receives an edge from every node and sends to half of them (a hub row and a hub
    column), over a sparse random tail, with repeated edges and self loops."""
    gen = torch.Generator().manual_seed(seed)
    everyone = torch.arange(N - 5)
    into = torch.stack([everyone, torch.zeros_like(everyone)])
    out_of = torch.stack([torch.zeros(N // 2, dtype=torch.int64), torch.arange(N // 2)])
    tail = torch.randint(0, N - 5, (2, E // 2), generator=gen)
    ei = torch.cat([into, out_of, tail, tail[:, :20]], dim=1)
    return ei, torch.randn(ei.shape[1], 3, generator=gen, dtype=torch.float64)


def _skewed_graph(seed: int = 6):
    """Power-law-like degrees: sources and targets drawn as floor(n u^3), ids shuffled (a few
    heavy rows and columns, many light ones), repeated edges included."""
    gen = torch.Generator().manual_seed(seed)
    n = N - 5
    ids = torch.randperm(n, generator=gen)
    src = ids[(n * torch.rand(E, generator=gen) ** 3).long()]
    dst = ids[(n * torch.rand(E, generator=gen) ** 3).long()]
    ei = torch.stack([src, dst])
    return ei, torch.randn(E, 3, generator=gen, dtype=torch.float64)


def _uniform_graph(seed: int = 7):
    """Sources and targets drawn uniformly (a few repeated edges and self loops by chance)."""
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, N - 5, (2, E), generator=gen)
    return ei, torch.randn(E, 3, generator=gen, dtype=torch.float64)


GRAPHS = {
    "communities": _graph,
    "hub": _hub_graph,
    "skewed": _skewed_graph,
    "uniform": _uniform_graph,
}


def _layers():
    torch.manual_seed(11)
    nn = trisparse.nn
    return {
        "transformer": (nn.TransformerConv(F, 4, heads=2, beta=True), False, False),
        "transformer_edge": (nn.TransformerConv(F, 4, heads=2, edge_dim=3), False, True),
        "gat": (nn.GATConv(F, 4, heads=2), True, False),
        "gat_edge": (
            nn.GATConv((F, F), 4, heads=2, add_self_loops=False, edge_dim=3, residual=True),
            False,
            True,
        ),
        "gcn": (nn.GCNConv(F, 5), False, False),
        "gcn_improved": (nn.GCNConv(F, 8, improved=True), False, False),
    }


def _worker(rank: int, world: int, path: str, backend: str, dtype_name: str, method: str):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"file://{path}.init", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dtype = getattr(torch, dtype_name)
    data = torch.load(f"{path}.inputs", weights_only=False)
    ei, attr, x, w_out = (data[k].to(device) for k in ("edge_index", "edge_attr", "x", "w_out"))
    part = data["part"]
    results = {}
    patterns = {}
    mine = part.to(device)[ei[1]] == rank  # the edges into this rank's rows: a sharded load
    for name, (layer, loops, edges) in _layers().items():
        layer = layer.to(device, dtype)
        for sharded in (False, True):
            if (loops, sharded) not in patterns:
                # Without loops the rows are split (interior, then boundary after the exchange);
                # with them, every row waits for the exchange.
                patterns[loops, sharded] = DistributedPattern.build(
                    ei[:, mine] if sharded else ei,
                    part,
                    N,
                    add_self_loops=loops,
                    min_interior=1.0 if loops else 0.0,
                    local_edges=sharded,
                )
            dp = patterns[loops, sharded]
            edge_attr = (attr[mine] if sharded else attr).to(dtype)
            grads = []
            for _ in range(2):  # twice: the gradients must repeat bitwise
                layer.zero_grad()
                x_own = dp.local(x).to(dtype).requires_grad_()
                out = layer(x_own, dp, edge_attr) if edges else layer(x_own, dp)
                (out.double() * dp.local(w_out)[:, : out.shape[1]]).sum().backward()
                params = torch.cat([p.grad.reshape(-1) for p in layer.parameters()]).double()
                dist.all_reduce(params)
                grads.append((out.detach(), x_own.grad, params))
            same = all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
            results[name + ("_sharded" if sharded else "")] = {
                "owned": dp.owned.cpu(),
                "out": grads[0][0].double().cpu(),
                "dx": grads[0][1].double().cpu(),
                "dparams": grads[0][2].cpu(),
                "repeatable": same,
                "interior": dp.num_interior,
            }
    torch.save(results, f"{path}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _single_process(data):
    """Each layer over the whole graph in one process (float64, the CPU)."""
    out = {}
    for name, (layer, loops, edges) in _layers().items():
        layer = layer.double()
        x = data["x"].clone().requires_grad_()
        y = (
            layer(x, data["edge_index"], data["edge_attr"])
            if edges
            else layer(x, data["edge_index"])
        )
        (y * data["w_out"][:, : y.shape[1]]).sum().backward()
        out[name] = (
            y.detach(),
            x.grad,
            torch.cat([p.grad.reshape(-1) for p in layer.parameters()]),
        )
    return out


def _parts(ei, world: int, method: str):
    """Each node's rank: a partition method's, or "idle": the last rank owns only the isolated
    nodes (no edge into or out of its rows)."""
    if method != "idle":
        return partition(ei, world, num_nodes=N, method=method)
    part = torch.arange(N) % (world - 1)
    part[N - 5 :] = world - 1
    return part


def _run(tmp_path, backend, dtype, method, tol, world=2, graph="communities"):
    """The layers over `world` processes against one process (method: as _parts')."""
    ei, attr = GRAPHS[graph]()
    gen = torch.Generator().manual_seed(5)
    part = _parts(ei, world, method)
    data = {
        "edge_index": ei,
        "edge_attr": attr,
        "part": part,
        "x": torch.randn(N, F, generator=gen, dtype=torch.float64),
        "w_out": torch.randn(N, 8, generator=gen, dtype=torch.float64),
    }
    path = str(tmp_path / "run")
    torch.save(data, f"{path}.inputs")
    mp.spawn(_worker, args=(world, path, backend, dtype, method), nprocs=world, join=True)
    expected = _single_process(data)
    ranks = [torch.load(f"{path}.rank{r}", weights_only=False) for r in range(world)]
    expected |= {f"{k}_sharded": v for k, v in expected.items()}
    for name, (out, dx, dparams) in expected.items():
        owned = torch.cat([r[name]["owned"] for r in ranks])
        assert torch.equal(owned.sort().values, torch.arange(N)), "the ranks must own every node"
        got_out = torch.cat([r[name]["out"] for r in ranks])
        got_dx = torch.cat([r[name]["dx"] for r in ranks])
        scale = max(1.0, float(out.abs().max()))
        assert (got_out - out[owned]).abs().max() <= tol * scale, name
        assert (got_dx - dx[owned]).abs().max() <= tol * max(1.0, float(dx.abs().max())), name
        for r in ranks:
            assert torch.allclose(r[name]["dparams"], dparams, atol=tol * 10, rtol=tol), name
            assert r[name]["repeatable"], f"{name}: gradients differ between two runs"
            if graph != "communities" or world != 2:
                continue
            if not name.startswith("gat") or name.startswith("gat_edge"):  # no loops: rows split
                assert 0 < r[name]["interior"] < int(r[name]["owned"].numel()), "no split"
            else:
                assert r[name]["interior"] == 0


def test_layers_over_two_processes_equal_one_process_float64(tmp_path):
    _run(tmp_path, "gloo", "float64", "community", 1e-10)


@pytest.mark.parametrize(
    "world,graph,method",
    [
        (4, "communities", "community"),
        (4, "hub", "random"),
        (2, "skewed", "random"),
        (3, "skewed", "idle"),
    ],
)
def test_layers_over_several_processes_equal_one_process_float64(tmp_path, world, graph, method):
    """Four processes, a hub row and column, skewed degrees, and a rank that owns no edge."""
    _run(tmp_path, "gloo", "float64", method, 1e-10, world=world, graph=graph)


def _attention_worker(rank: int, world: int, path: str):
    dist.init_process_group("gloo", init_method=f"file://{path}.init", rank=rank, world_size=world)
    data = torch.load(f"{path}.inputs", weights_only=False)
    ei, part = data["edge_index"], data["part"]
    results = {}
    for sharded in (False, True):
        mine = part[ei[1]] == rank
        dp = DistributedPattern.build(ei[:, mine] if sharded else ei, part, N, local_edges=sharded)
        for dtype in (torch.float32, torch.float64):
            runs = []
            for _ in range(2):  # twice: the same bits
                q, k, v = (dp.local(data[t]).to(dtype).requires_grad_() for t in "qkv")
                out = dp.sparse_attention(q, k, v)
                (out * dp.local(data["w"]).to(dtype)).sum().backward()
                runs.append([out.detach(), q.grad, k.grad, v.grad])
            results[sharded, str(dtype)] = {
                "owned": dp.owned,
                "values": runs[0],
                "repeatable": all(torch.equal(a, b) for a, b in zip(*runs)),
            }
    torch.save(results, f"{path}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "world,graph,method",
    [
        (2, "communities", "community"),
        (4, "uniform", "random"),
        (4, "hub", "random"),
        (2, "skewed", "random"),
        (3, "skewed", "idle"),
    ],
)
def test_attention_over_processes_equals_one_process_bitwise(tmp_path, world, graph, method):
    """DistributedPattern.sparse_attention (CPU engine, float32 and float64, the whole graph or a
    sharded load, 2 - 4 processes; communities, a uniform random graph, a hub, skewed degrees, a
    rank that owns no edge): the output and the gradients of q, k and v equal one process's bit
    for bit."""
    ei, _ = GRAPHS[graph]()
    part = _parts(ei, world, method)
    gen = torch.Generator().manual_seed(9)
    data = {t: torch.randn(N, 2, 8, generator=gen, dtype=torch.float64) for t in "qkvw"}
    data |= {"edge_index": ei, "part": part}
    path = str(tmp_path / "attention")
    torch.save(data, f"{path}.inputs")
    mp.spawn(_attention_worker, args=(world, path), nprocs=world, join=True)
    ranks = [torch.load(f"{path}.rank{r}", weights_only=False) for r in range(world)]
    pattern = trisparse.Pattern.from_edge_index(ei, num_nodes=N)
    for dtype in (torch.float32, torch.float64):
        q, k, v = (data[t].to(dtype).requires_grad_() for t in "qkv")
        out = trisparse.sparse_attention(q, k, v, pattern)
        (out * data["w"].to(dtype)).sum().backward()
        want = [out.detach(), q.grad, k.grad, v.grad]
        for sharded in (False, True):
            key = (sharded, str(dtype))
            owned = torch.cat([r[key]["owned"] for r in ranks])
            assert torch.equal(owned.sort().values, torch.arange(N))
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                got = torch.cat([r[key]["values"][i] for r in ranks])
                assert torch.equal(got, want[i][owned]), (name, key)
            assert all(r[key]["repeatable"] for r in ranks), key


@pytest.mark.skipif(
    not trisparse.cuda_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_layers_over_two_gpus_nccl(tmp_path):
    _run(tmp_path, "nccl", "float32", "random", 2e-3)


def _planted(parts: int = 4, size: int = 50, seed: int = 2):
    """Communities of `size` nodes, 95 % of the edges inside one, ids shuffled."""
    gen = torch.Generator().manual_seed(seed)
    n = parts * size
    src = torch.randint(0, n, (4000,), generator=gen)
    inside = torch.rand(4000, generator=gen) < 0.95
    dst = torch.where(
        inside, src // size * size + torch.randint(0, size, (4000,), generator=gen), src.flip(0)
    )
    ids = torch.randperm(n, generator=gen)
    return torch.stack([ids[src], ids[dst]]), n


@pytest.mark.parametrize("method", ["community", "metis"])
def test_partitions_are_balanced_and_cut_less_than_random(method):
    if method == "metis":
        pytest.importorskip("pymetis", reason="pymetis is not installed")
    ei, n = _planted()
    part = partition(ei, 4, num_nodes=n, method=method)
    assert part.shape == (n,) and int(part.min()) == 0 and int(part.max()) == 3
    ours = partition_stats(ei, part, 4)
    random = partition_stats(ei, partition(ei, 4, num_nodes=n, method="random"), 4)
    assert ours["edge_cut"] < 0.5 * random["edge_cut"]
    assert ours["halo"] < random["halo"]
    assert ours["node_balance"] < 1.3 and ours["edge_balance"] < 1.3
    assert random["node_balance"] == 1.0


def test_partition_rejects_bad_arguments():
    ei, n = _planted()
    with pytest.raises(ValueError, match="method"):
        partition(ei, 2, num_nodes=n, method="spectral")
    with pytest.raises(ValueError, match="num_parts"):
        partition(ei, 0, num_nodes=n)
    with pytest.raises(ValueError, match="outside"):
        partition(ei, 2, num_nodes=10, method="random")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedPattern.build(ei, partition(ei, 2, n, method="random"), n)


SEQ, BLOCK = 256, 16


def _cp_masks():
    """A random per-head mask (contiguous split) and a causal one (zigzag split), 16 x 16 blocks;
    the random one leaves rank 0's rows reading nothing of rank 1's last block."""
    gen = torch.Generator().manual_seed(21)
    nb = SEQ // BLOCK
    rand = torch.rand(1, 2, nb, nb, generator=gen) < 0.4
    rand[..., :8, 15] = False
    causal = (torch.rand(2, 1, nb, nb, generator=gen) < 0.5) & torch.ones(nb, nb).tril().bool()
    causal |= torch.eye(nb, dtype=torch.bool)  # every row keeps its diagonal block
    return {"random": (rand, False), "causal": (causal, True)}


def _cp_cases():
    """(name, (blocks, causal), ring): each mask gathered at once and as a ring."""
    return [
        (name + (" ring" if ring else ""), spec, ring)
        for name, spec in _cp_masks().items()
        for ring in (False, True)
    ]


def _cp_worker(rank: int, world: int, path: str, backend: str):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"file://{path}.init", rank=rank, world_size=world)
    device, dtype = torch.device("cpu"), torch.float64
    if backend == "nccl":
        device, dtype = torch.device("cuda", rank), torch.bfloat16
        torch.cuda.set_device(device)
    data = torch.load(f"{path}.inputs", weights_only=False)
    data = {t: x.to(device, dtype) for t, x in data.items()}
    results = {}
    for name, (blocks, causal), ring in _cp_cases():
        mask = trisparse.BlockMask(blocks.to(device), BLOCK, causal=causal)
        cp = trisparse.distributed.ContextParallel.build(mask, SEQ)
        q, k, v = (cp.shard(data[t]).requires_grad_() for t in ("q", "k", "v"))
        out = cp.attention(q, k, v, ring=ring)
        (out * cp.shard(data["w"])).sum().backward()
        results[name] = {
            "tokens": cp.shard(torch.arange(SEQ).view(1, 1, SEQ, 1)).view(-1),
            "out": out.detach().double().cpu(),
            "grads": [t.grad.double().cpu() for t in (q, k, v)],
            "received": cp.halo_blocks.tolist(),
            "owned": cp.owned_blocks.tolist(),
        }
    torch.save(results, f"{path}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _context_parallel(tmp_path, backend: str, dim: int, tol: float, world: int = 2):
    gen = torch.Generator().manual_seed(8)
    data = {t: torch.randn(2, 2, SEQ, dim, generator=gen, dtype=torch.float64) for t in "qkvw"}
    path = str(tmp_path / "cp")
    torch.save(data, f"{path}.inputs")
    mp.spawn(_cp_worker, args=(world, path, backend), nprocs=world, join=True)
    ranks = [torch.load(f"{path}.rank{r}", weights_only=False) for r in range(world)]
    for name, (blocks, causal), _ring in _cp_cases():
        mask = trisparse.BlockMask(blocks, BLOCK, causal=causal)
        q, k, v = (data[t].clone().requires_grad_() for t in "qkv")
        out = trisparse.block_sparse_attention(q, k, v, mask)
        (out * data["w"]).sum().backward()
        tokens = torch.cat([r[name]["tokens"] for r in ranks])
        assert torch.equal(tokens.sort().values, torch.arange(SEQ))
        got = torch.cat([r[name]["out"] for r in ranks], dim=2)
        assert (got - out.detach()[:, :, tokens]).abs().max() <= tol, name
        for i, ref in enumerate((q.grad, k.grad, v.grad)):
            got = torch.cat([r[name]["grads"][i] for r in ranks], dim=2)
            assert (got - ref[:, :, tokens]).abs().max() <= tol * max(1, ref.abs().max()), (name, i)
        reads = blocks.any(dim=(0, 1))
        for r in ranks:  # exactly the other ranks' blocks that this rank's rows read
            owned = torch.tensor(r[name]["owned"])
            wanted = reads[owned].any(dim=0).nonzero().view(-1).tolist()
            assert sorted(r[name]["received"]) == [b for b in wanted if b not in owned.tolist()]
    zigzag = ranks[0]["causal"]["owned"]
    assert zigzag[0] == 0 and zigzag[-1] == SEQ // BLOCK - 1, "zigzag: both ends on rank 0"
    assert 15 not in ranks[0]["random"]["received"]


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process_float64(tmp_path, world):
    _context_parallel(tmp_path, "gloo", 8, 1e-12, world)


@pytest.mark.skipif(
    not trisparse.cuda_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_context_parallel_over_two_gpus_nccl(tmp_path):
    _context_parallel(tmp_path, "nccl", 64, 5e-2)


def test_planetoid_example_trains_over_two_processes():
    """examples/python/train_planetoid_distributed.py: GCN on the real Cora over two processes
    (Gloo, DDP, METIS or community parts) learns what one process learns (about 81 %)."""
    d = datasets_dir()
    if d is None or not (d / "planetoid" / "ind.cora.x").exists():
        pytest.skip("../shared/datasets/planetoid not found (set TRISPARSE_DATASETS): skipping")
    pytest.importorskip("scipy")
    script = pathlib.Path(__file__).parents[2] / "examples" / "python"
    args = ["--model", "gcn", "--epochs", "60", "--nprocs", "2", "--device", "cpu"]
    args += ["--port", str(29700 + os.getpid() % 200), "--root", str(d / "planetoid")]
    run = subprocess.run(
        [sys.executable, str(script / "train_planetoid_distributed.py"), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["processes"] == 2 and result["test_acc"] > 0.75, result
