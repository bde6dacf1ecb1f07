#!/usr/bin/env python3
"""Trains train_planetoid.py's GCN, GAT or Graph Transformer on Cora or CiteSeer over several
processes: the graph partitioned (trisparse.distributed.partition), each process computing its
part's rows (its layers given a DistributedPattern), the weights replicated by DDP. Gloo on the
CPU, NCCL with one GPU a process. Prints the test accuracy at the best validation accuracy and
the time per epoch.

    python3 examples/python/train_planetoid_distributed.py --nprocs 2 --model gat
    torchrun --nproc-per-node 2 examples/python/train_planetoid_distributed.py --model gcn

The loss is the mean over all training nodes (each process sums its own, scaled so that DDP's
average of the gradients is the whole graph's gradient).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import trisparse
import trisparse.datasets
from torch.nn.parallel import DistributedDataParallel
from trisparse.distributed import DistributedPattern, partition, partition_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_planetoid import GAT, GCN, GraphTransformer

# NVLink multicast stays off (the GPU machines' rule), also in processes started here.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def train(rank: int, world: int, args) -> None:
    cuda = args.device == "cuda"
    if "RANK" not in os.environ:  # started by --nprocs, not torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    data = trisparse.datasets.planetoid(args.dataset, args.root)
    x = data.x / data.x.sum(dim=-1, keepdim=True).clamp_min(1)
    part = partition(data.edge_index, world, num_nodes=x.shape[0], method=args.partition)
    # GAT adds self loops: to the whole graph, once, in its pattern.
    dp = DistributedPattern.build(
        data.edge_index.to(device), part, x.shape[0], add_self_loops=args.model == "gat"
    )
    x, y = dp.local(x.to(device)), dp.local(data.y.to(device))
    masks = [dp.local(m.to(device)) for m in (data.train_mask, data.val_mask, data.test_mask)]
    train_rows = masks[0].nonzero().view(-1)
    total_train = int(data.train_mask.sum())

    torch.manual_seed(args.seed)  # the same initial weights on every process
    classes = int(data.y.max()) + 1
    model, lr = {
        "gcn": (lambda: GCN("trisparse", x.shape[1], classes), 0.01),
        "gat": (lambda: GAT("trisparse", x.shape[1], classes), 0.005),
        "transformer": (lambda: GraphTransformer("trisparse", x.shape[1], classes), 0.001),
    }[args.model]
    model = DistributedDataParallel(model().to(device), device_ids=[device] if cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
    torch.manual_seed(args.seed + rank)  # dropout: each process its own rows' draws

    best_val, test_at_best, times = -1.0, 0.0, []
    for _ in range(args.epochs):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.train()
        opt.zero_grad()
        out = model(x, dp)
        loss = F.cross_entropy(out[train_rows], y[train_rows], reduction="sum")
        (loss * world / total_train).backward()  # DDP averages over the processes
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.eval()
        with torch.no_grad():
            pred = model(x, dp).argmax(dim=-1)
        counts = torch.tensor(
            [[float((pred[m] == y[m]).sum()), float(m.sum())] for m in masks[1:]], device=device
        )
        dist.all_reduce(counts)
        val, test = (counts[:, 0] / counts[:, 1]).tolist()
        if val > best_val:
            best_val, test_at_best = val, test
    if rank == 0:
        result = {
            "dataset": args.dataset,
            "model": args.model,
            "processes": world,
            "device": args.device,
            "partition": args.partition,
            **partition_stats(data.edge_index, part, world),
            "test_acc": test_at_best,
            "epoch_ms": 1e3 * statistics.median(times[min(args.warmup, len(times) - 1) :]),
        }
        print(json.dumps(result))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", choices=["cora", "citeseer"], default="cora")
    ap.add_argument("--model", choices=["gcn", "gat", "transformer"], default="gcn")
    ap.add_argument(
        "--nprocs", type=int, default=2, help="processes to start (ignored under torchrun)"
    )
    ap.add_argument("--partition", choices=["metis", "community", "random"], default="community")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--root", default=None, help="the Planetoid raw files (ind.<name>.*)")
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        mp.spawn(train, args=(args.nprocs, args), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
