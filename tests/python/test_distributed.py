"""trisparse.distributed: partitions, and the layers over a partitioned graph on two processes
(Gloo on the CPU in float64; NCCL on two GPUs where there are) against one process over the whole
graph: outputs, the gradients of the inputs and of every weight, bitwise repeatable."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import trisparse
import trisparse.nn
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


def _layers():
    torch.manual_seed(11)
    nn = trisparse.nn
    return {
        "transformer": (nn.TransformerConv(F, 4, heads=2, beta=True), False, False),
        "transformer_edge": (nn.TransformerConv(F, 4, heads=2, edge_dim=3), False, True),
        "gat": (nn.GATConv(F, 4, heads=2), True, False),
        "gcn": (nn.GCNConv(F, 5), False, False),
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
    part = partition(data["edge_index"], world, num_nodes=N, method=method)
    results = {}
    patterns = {}
    for name, (layer, loops, edges) in _layers().items():
        layer = layer.to(device, dtype)
        if loops not in patterns:
            # Without loops the rows are split (interior, then boundary after the exchange); with
            # them, every row waits for the exchange.
            patterns[loops] = DistributedPattern.build(
                ei, part, N, add_self_loops=loops, min_interior=1.0 if loops else 0.0
            )
        dp = patterns[loops]
        grads = []
        for _ in range(2):  # twice: the gradients must repeat bitwise
            layer.zero_grad()
            x_own = dp.local(x).to(dtype).requires_grad_()
            out = layer(x_own, dp, attr.to(dtype)) if edges else layer(x_own, dp)
            (out.double() * dp.local(w_out)[:, : out.shape[1]]).sum().backward()
            params = torch.cat([p.grad.reshape(-1) for p in layer.parameters()]).double()
            dist.all_reduce(params)
            grads.append((out.detach(), x_own.grad, params))
        same = all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
        results[name] = {
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


def _run(tmp_path, backend: str, dtype: str, method: str, tol: float):
    ei, attr = _graph()
    gen = torch.Generator().manual_seed(5)
    data = {
        "edge_index": ei,
        "edge_attr": attr,
        "x": torch.randn(N, F, generator=gen, dtype=torch.float64),
        "w_out": torch.randn(N, 8, generator=gen, dtype=torch.float64),
    }
    path = str(tmp_path / "run")
    torch.save(data, f"{path}.inputs")
    mp.spawn(_worker, args=(2, path, backend, dtype, method), nprocs=2, join=True)
    expected = _single_process(data)
    ranks = [torch.load(f"{path}.rank{r}", weights_only=False) for r in range(2)]
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
            if name != "gat":
                assert 0 < r[name]["interior"] < int(r[name]["owned"].numel()), "no split"
            else:
                assert r[name]["interior"] == 0


def test_layers_over_two_processes_equal_one_process_float64(tmp_path):
    _run(tmp_path, "gloo", "float64", "community", 1e-10)


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
