#!/usr/bin/env python3
"""Graph attention across GPUs (trisparse.distributed), one process a GPU, NCCL:

    python3 bench/python/distributed.py link --gpus 2          # the link's alpha-beta
    python3 bench/python/distributed.py weak --gpus 1 2 --edges-per-gpu 25000000
    python3 bench/python/distributed.py strong --gpus 1 2 --edges 65000000
    python3 bench/python/distributed.py strong --gpus 1 2 --graph data/snap_web_notredame.el.xz
    python3 bench/python/distributed.py partition --parts 2 4 8 --graph data/*.el.xz   # CPU
    python3 bench/python/distributed.py context --gpus 1 2 --seq 262144 1048576

link: NCCL all_to_all_single (each rank sends size / world to every rank) and send/recv between
ranks 0 and 1, 4 KB - 1 GB, CUDA-event medians; the alpha (latency) and beta (bytes/s) fitted to
the sizes >= 1 MB and below 64 KB. weak / strong: one trisparse.nn.TransformerConv layer (in 128,
heads x channels --heads x --channels) forward + backward on each rank's rows of a generated
graph (R-MAT a = 0.57, b = c = 0.19, or uniform, ids as drawn) or a graph file, the graph
partitioned by --partition; fp32 and bf16 (the features in bf16, autocast). Reported per
(graph, GPUs, dtype): the step (the slowest rank's median), its parts measured apart on each rank
(the layer over its rows with the halo already there: compute; the halo exchange forward and
backward alone: exchange), the halo, and for GPUs > 1 the efficiency against the same graph
(strong) or the one-GPU graph (weak) on one GPU without any exchange (a plain Pattern). One JSON
line each. NCCL_NVLS_ENABLE=0 is set for every process (NVLink multicast stays off).
context: block-sparse attention over one sequence split across the GPUs
(trisparse.distributed.ContextParallel), forward + backward, B = 1, H = 8, D = 64, bf16, G =
--block, a random per-head mask keeping 1 - --sparsity of the blocks (causal: of the lower
triangle, diagonal kept) against block_sparse_attention on one GPU (strong scaling); with
--ring also ContextParallel.attention(ring=True) (one owner's blocks at a time).
partition (no GPU): each method of trisparse.distributed.partition on each --graph into each
--parts: edge cut, halo, balance (partition_stats) and seconds.
"""

import argparse
import copy
import functools
import itertools
import json
import math
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import events_ms
from pyg_sparse_cpu import median_ms


def rmat(n_log2: int, edges: int, seed: int) -> torch.Tensor:
    """R-MAT (a 0.57, b 0.19, c 0.19, d 0.05) edge_index [2, edges] over 2^n_log2 ids."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.zeros(edges, dtype=torch.int64)
    dst = torch.zeros(edges, dtype=torch.int64)
    for _ in range(n_log2):
        r = torch.rand(edges, generator=gen)
        src = src * 2 + (r >= 0.76).long()  # c or d quadrant: source bit 1
        dst = dst * 2 + (((r >= 0.57) & (r < 0.76)) | (r >= 0.95)).long()
    return torch.stack([src, dst])


def uniform(nodes: int, edges: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, nodes, (2, edges), generator=gen)


def graph_of(spec: dict) -> tuple[torch.Tensor, int]:
    if spec["kind"] == "file":
        import trisparse.datasets

        return trisparse.datasets.read_graph(spec["path"])
    if spec["kind"] == "rmat":
        n_log2 = max(1, math.ceil(math.log2(spec["nodes"])))
        return rmat(n_log2, spec["edges"], spec["seed"]), 1 << n_log2
    return uniform(spec["nodes"], spec["edges"], spec["seed"]), spec["nodes"]


def wall_ms(fn, repeat):
    """Median milliseconds of fn() (CUDA events; on the CPU --smoke runs, the wall clock)."""
    return events_ms(fn, repeat) if torch.cuda.is_available() else median_ms(fn, repeat)


def profiled(fn, label):
    """With --profile: the CUDA kernels of one fn() (torch.profiler), the top 15, to stderr."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=15, max_name_column_width=70
    )
    print(f"== {label}\n{table}", file=sys.stderr, flush=True)


def timed(fn, repeat):
    """wall_ms of a collective step: the slowest rank's."""
    t = torch.tensor([wall_ms(fn, repeat)], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run over Gloo


def init(rank, world):
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=rank, world_size=world)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)


def link_worker(rank, world, args, queue):
    init(rank, world)
    size = 4096
    while size <= args.max_bytes:
        buf = torch.empty(size // 2, dtype=torch.bfloat16, device=DEVICE)
        out = torch.empty_like(buf)
        a2a = timed(lambda: dist.all_to_all_single(out, buf), args.repeat)

        def sendrecv():
            if rank == 0:
                dist.send(buf, 1)
            elif rank == 1:
                dist.recv(out, 0)

        p2p = timed(sendrecv, args.repeat)
        if rank == 0:
            queue.put({"op": "all_to_all", "bytes": size, "ms": a2a, "gpus": world})
            queue.put({"op": "send_recv", "bytes": size, "ms": p2p, "gpus": world})
        size *= 4
    dist.destroy_process_group()


class _Arrived:
    def wait(self):
        pass


def step_worker(rank, world, args, spec, queue):
    import trisparse.nn
    from trisparse.distributed import DistributedPattern, partition, partition_stats

    init(rank, world)
    ei, n = graph_of(spec)
    start = time.perf_counter()
    part = partition(ei, world, num_nodes=n, method=args.partition)
    part_s = time.perf_counter() - start
    start = time.perf_counter()
    dp = DistributedPattern.build(ei.to(DEVICE), part, n)
    torch.cuda.synchronize() if DEVICE == "cuda" else None
    build_s = time.perf_counter() - start
    torch.manual_seed(0)
    layer = trisparse.nn.TransformerConv(128, args.channels, heads=args.heads).to(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(1 + rank)
    for dtype in args.dtypes:
        autocast = dtype == "bfloat16"
        x = torch.randn(dp.num_owned, 128, device=DEVICE, generator=gen).to(getattr(torch, dtype))
        x.requires_grad_()
        dout = torch.randn(dp.num_owned, args.heads * args.channels, device=DEVICE, generator=gen)

        def step(graph=dp, x=x, dout=dout, autocast=autocast):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                out = layer(x, graph)
            out.backward(dout.to(out.dtype))

        # The step with the halo already there (no exchange): its compute alone.
        resident = copy.copy(dp)
        halo = dp.exchange(x.detach())
        resident.start_exchange = lambda _x, halo=halo: (halo, _Arrived())
        compute = functools.partial(step, resident)

        def exchange(x=x):
            h = dp.exchange(x)
            h.backward(torch.ones_like(h))

        if args.profile and rank == 0:
            profiled(step, f"step {spec['kind']} {dtype} {world} GPUs")
            profiled(compute, f"compute {spec['kind']} {dtype} {world} GPUs")
        ms = timed(step, args.repeat)
        compute_ms = wall_ms(compute, args.repeat)
        exchange_ms = wall_ms(exchange, args.repeat)
        parts = torch.tensor([compute_ms, exchange_ms], device=DEVICE)
        gathered = [torch.zeros_like(parts) for _ in range(world)]
        dist.all_gather(gathered, parts)
        if rank == 0:
            queue.put(
                {
                    **spec,
                    "gpus": world,
                    "dtype": dtype,
                    "partition": args.partition,
                    "heads": args.heads,
                    "channels": args.channels,
                    "edges": int(ei.shape[1]),
                    "nodes": n,
                    "step_ms": ms,
                    "compute_ms": [float(g[0]) for g in gathered],
                    "exchange_ms": [float(g[1]) for g in gathered],
                    "halo_rows": dp.num_halo,
                    "owned_rows": dp.num_owned,
                    "interior_rows": dp.num_interior,
                    "partition_s": part_s,
                    "build_s": build_s,
                    **({} if world == 1 else partition_stats(ei, part, world)),
                }
            )
    dist.destroy_process_group()


def single_gpu(args, spec):
    """The layer on one GPU over the whole graph, no exchange: the efficiency's reference."""
    import trisparse
    import trisparse.nn

    ei, n = graph_of(spec)
    pattern = trisparse.Pattern.from_edge_index(ei.to(DEVICE), num_nodes=n)
    torch.manual_seed(0)
    layer = trisparse.nn.TransformerConv(128, args.channels, heads=args.heads).to(DEVICE)
    out = {}
    for dtype in args.dtypes:
        autocast = dtype == "bfloat16"
        x = torch.randn(n, 128, device=DEVICE).to(getattr(torch, dtype)).requires_grad_()
        dout = torch.randn(n, args.heads * args.channels, device=DEVICE)

        def step(x=x, dout=dout, autocast=autocast):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                y = layer(x, pattern)
            y.backward(dout.to(y.dtype))

        if args.profile:
            profiled(step, f"one GPU {spec['kind']} {dtype}")
        out[dtype] = wall_ms(step, args.repeat)
    return out


def context_mask(seq, args, causal):
    nb = seq // args.block
    gen = torch.Generator().manual_seed(3)
    blocks = torch.rand(1, 8, nb, nb, generator=gen) < 1 - args.sparsity
    if causal:
        blocks &= torch.ones(nb, nb, dtype=torch.bool).tril()
        blocks |= torch.eye(nb, dtype=torch.bool)
    return blocks


def context_worker(rank, world, args, seq, causal, ring, queue):
    import trisparse
    from trisparse.distributed import ContextParallel, _start_halo

    init(rank, world)
    mask = trisparse.BlockMask(context_mask(seq, args, causal).to(DEVICE), args.block, causal)
    start = time.perf_counter()
    cp = ContextParallel.build(mask, seq)
    build_s = time.perf_counter() - start
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q, k, v, dout = (
        cp.shard(torch.randn(1, 8, seq, 64, device=DEVICE, generator=gen, dtype=dtype))
        for _ in range(4)
    )
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        cp.attention(*leaves, ring=ring).backward(dout)

    # The exchange alone, both ways: this rank's key and value blocks out, the halo's gradient back.
    kv = torch.cat([k, v], dim=-1).detach().permute(2, 0, 1, 3)  # [n, B, H, 2D]: as attention()
    kv = kv.reshape(-1, args.block, *kv.shape[1:])
    kv.requires_grad_()

    def exchange():
        halo, arrived = _start_halo(kv, cp)
        arrived.wait()
        halo.backward(torch.ones_like(halo))

    reset_peak()
    ms = timed(step, args.repeat)
    parts = torch.tensor(
        [wall_ms(exchange, args.repeat), float(cp.mask.blocks.sum()), peak_gb()], device=DEVICE
    )
    gathered = [torch.zeros_like(parts) for _ in range(world)]
    dist.all_gather(gathered, parts)
    if rank == 0:
        queue.put(
            {
                "seq": seq,
                "causal": causal,
                "gpus": world,
                "layout": cp.layout,
                "ring": ring,
                "step_ms": ms,
                "exchange_ms": [float(g[0]) for g in gathered],
                "kept_blocks": [int(g[1]) for g in gathered],  # over heads, this rank's rows
                "peak_gb": [float(g[2]) for g in gathered],
                "received_blocks": cp.num_halo,
                "owned_blocks": int(cp.owned_blocks.numel()),
                "build_s": build_s,
            }
        )
    dist.destroy_process_group()


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb():
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0


def context_single(args, seq, causal):
    import trisparse

    mask = trisparse.BlockMask(context_mask(seq, args, causal).to(DEVICE), args.block, causal)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q, k, v, dout = (torch.randn(1, 8, seq, 64, device=DEVICE, dtype=dtype) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        trisparse.block_sparse_attention(*leaves, mask).backward(dout)

    reset_peak()
    ms = wall_ms(step, args.repeat)
    return ms, int(mask.blocks.sum()), peak_gb()


def partition_quality(args):
    import trisparse.datasets
    from trisparse.distributed import PARTITION_METHODS, partition, partition_stats

    for path in args.graph:
        ei, n = trisparse.datasets.read_graph(path)
        for parts in args.parts:
            for method in PARTITION_METHODS:
                start = time.perf_counter()
                part = partition(ei, parts, num_nodes=n, method=method)
                seconds = time.perf_counter() - start
                stats = partition_stats(ei, part, parts)
                emit(
                    {
                        "graph": os.path.basename(path).split(".")[0],
                        "nodes": n,
                        "edges": int(ei.shape[1]),
                        "parts": parts,
                        "method": method,
                        "seconds": seconds,
                        **stats,
                    }
                )


def spawn(fn, world, *args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29600 + int(time.time()) % 300)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(fn, args=(world, *args, queue), nprocs=world, join=True)
    results = []
    while not queue.empty():
        results.append(queue.get())
    return results


def emit(record):
    print(json.dumps(record), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["link", "weak", "strong", "partition", "context"])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kinds", nargs="*", default=["rmat", "uniform"])
    ap.add_argument("--edges-per-gpu", type=int, default=25_000_000)
    ap.add_argument("--edges", type=int, default=65_000_000)
    ap.add_argument("--degree", type=float, default=12.5, help="edges per node, generated graphs")
    ap.add_argument("--graph", nargs="*", default=[])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--partition", choices=["metis", "community", "random"], default="random")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="kernel tables to stderr")
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seq", type=int, nargs="+", default=[262144, 1048576])
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--ring", action="store_true", help="context: also the ring form")
    args = ap.parse_args()
    if args.mode == "partition":
        partition_quality(args)
        return
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)"
    if args.mode == "context":
        for seq in args.seq:
            for causal in (False, True):
                one, kept, peak = context_single(args, seq, causal)
                for world, ring in itertools.product(
                    [g for g in args.gpus if g > 1], (False, True) if args.ring else (False,)
                ):
                    for r in spawn(context_worker, world, args, seq, causal, ring):
                        r.update(one_gpu_ms=one, one_gpu_kept_blocks=kept, one_gpu_peak_gb=peak)
                        r.update(efficiency=one / (world * r["step_ms"]))
                        emit({**r, "mode": "context", "device": device})
        return
    if args.mode == "link":
        for world in [g for g in args.gpus if g > 1]:
            for r in spawn(link_worker, world, args):
                emit({**r, "device": device})
        return
    specs = []
    for world in args.gpus:
        for kind in args.kinds:
            edges = args.edges_per_gpu * world if args.mode == "weak" else args.edges
            nodes = int(edges / args.degree)
            specs.append((world, {"kind": kind, "edges": edges, "nodes": nodes, "seed": 7}))
        for path in args.graph:
            specs.append((world, {"kind": "file", "path": path}))
    references = {}
    for world, spec in specs:
        base = spec  # the one-GPU reference: the same graph (strong), one GPU's share (weak)
        if args.mode == "weak" and spec["kind"] != "file":
            nodes = int(args.edges_per_gpu / args.degree)
            base = {**spec, "edges": args.edges_per_gpu, "nodes": nodes}
        key = json.dumps(base, sort_keys=True)
        if key not in references:
            references[key] = single_gpu(args, base)
        for r in spawn(step_worker, world, args, spec):
            one = references[key][r["dtype"]]
            r["one_gpu_ms"] = one
            per_gpu = r["step_ms"] * (1 if args.mode == "weak" else world)
            r["efficiency"] = one / per_gpu
            emit({**r, "mode": args.mode, "device": device})


if __name__ == "__main__":
    main()
