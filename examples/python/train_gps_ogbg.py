#!/usr/bin/env python3
"""Trains a GPS Graph Transformer (PyG's GPSConv: a GINE local MPNN over the bonds plus global
attention within each molecule) on an OGB molecule set (ogbg-molbace, -molbbbp: ROC-AUC;
ogbg-molesol, -molfreesolv: RMSE) with its scaffold split, with PyG's GPSConv or trisparse's
drop-in, from the same script and hyperparameters; prints the test metric at the best validation
epoch, the time per epoch (and the loader's share) and the peak memory; --profile adds the GPU's
busy time and kernel count over one epoch.

    python3 examples/python/train_gps_ogbg.py --dataset ogbg-molbace --backend trisparse
    python3 examples/python/train_gps_ogbg.py --dataset ogbg-molesol --backend pyg --seeds 10

The data is read from OGB's raw files (trisparse.datasets.ogbg; --root, default
../shared/datasets/ogbg). Both backends build the same parameters from the same seed (trisparse's
GPSConv is PyG's subclass) and see the same batches; PyG pads each mini-batch's graphs to the
largest for nn.MultiheadAttention, trisparse attends within each graph with no padding.
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
import trisparse.datasets
from torch import nn
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINEConv, global_add_pool


class GPS(nn.Module):
    """Atom and bond embeddings (a table per OGB feature column, summed), `layers` GPSConv layers
    with a GINE local MPNN, sum pooling and a two-layer head."""

    def __init__(
        self,
        backend,
        tasks,
        channels=64,
        layers=4,
        heads=4,
        attn_dropout=0.5,
        recompute=False,
        edge_bias=False,
    ):
        super().__init__()
        if backend == "pyg":
            from torch_geometric.nn import GPSConv
        else:
            from functools import partial

            from trisparse.nn import GPSConv

            bias = {"edge_bias": True, "edge_dim": channels} if edge_bias else {}
            GPSConv = partial(GPSConv, recompute=recompute, **bias)
        self.atoms = nn.ModuleList(nn.Embedding(128, channels) for _ in range(9))
        self.bonds = nn.ModuleList(nn.Embedding(16, channels) for _ in range(3))
        self.convs = nn.ModuleList()
        for _ in range(layers):
            mlp = nn.Sequential(
                nn.Linear(channels, channels), nn.ReLU(), nn.Linear(channels, channels)
            )
            self.convs.append(
                GPSConv(
                    channels,
                    GINEConv(mlp),
                    heads=heads,
                    attn_kwargs={"dropout": attn_dropout},
                )
            )
        self.head = nn.Sequential(
            nn.Linear(channels, channels // 2), nn.ReLU(), nn.Linear(channels // 2, tasks)
        )

    def forward(self, data):
        x = sum(emb(data.x[:, i]) for i, emb in enumerate(self.atoms))
        edge_attr = sum(emb(data.edge_attr[:, i]) for i, emb in enumerate(self.bonds))
        # a batch padded for a captured step (--cuda-graph) names its real nodes
        mask = {"node_mask": data.node_mask} if "node_mask" in data else {}
        for conv in self.convs:
            x = conv(x, data.edge_index, data.batch, edge_attr=edge_attr, **mask)
        return self.head(global_add_pool(x, data.batch, size=data.num_graphs))


def roc_auc(score, label):
    """Area under the ROC curve of one task (ties share their rank), NaN labels dropped."""
    keep = ~torch.isnan(label)
    score, label = score[keep].double(), label[keep].double()
    pos, neg = int(label.sum()), int((1 - label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(score)
    ranks = torch.empty_like(score)
    ranks[order] = torch.arange(1, score.numel() + 1, dtype=torch.float64)
    for v in torch.unique(score):  # average ranks of ties
        tie = score == v
        if int(tie.sum()) > 1:
            ranks[tie] = ranks[tie].mean()
    return float((ranks[label == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def autocast(device, bf16: bool):
    """bfloat16 autocast on CUDA where asked (--bf16), else nothing."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and device.type == "cuda")


def evaluate(model, loader, regression, device, bf16=False):
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for data in loader:
            data = data.to(device)
            with autocast(device, bf16):
                preds.append(model(data).float().cpu())
            labels.append(data.y.float().cpu())
    p, y = torch.cat(preds), torch.cat(labels)
    if regression:
        keep = ~torch.isnan(y)
        return float(((p[keep] - y[keep]) ** 2).mean().sqrt())
    scores = [roc_auc(p[:, t], y[:, t]) for t in range(y.shape[1])]
    scores = [s for s in scores if not math.isnan(s)]
    return sum(scores) / len(scores)


def run(args, graphs, split, seed, device):
    regression = args.dataset.endswith(("esol", "freesolv"))
    torch.manual_seed(seed)
    tasks = graphs[0].y.shape[1]
    model = GPS(
        args.backend,
        tasks,
        args.channels,
        args.layers,
        args.heads,
        args.attn_dropout,
        args.recompute,
        args.edge_bias,
    )
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, capturable=args.cuda_graph)
    step = captured_step(model, opt, regression, args.bf16) if args.cuda_graph else None
    gen = torch.Generator().manual_seed(seed)
    if args.loader == "packed":
        train = PackedLoader([graphs[i] for i in split["train"]], args.batch_size, gen)
    else:
        train = DataLoader(
            [graphs[i] for i in split["train"]],
            batch_size=args.batch_size,
            shuffle=True,
            generator=gen,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
        )
    valid = DataLoader([graphs[i] for i in split["valid"]], batch_size=512)
    test = DataLoader([graphs[i] for i in split["test"]], batch_size=512)
    best, best_test, times, loads = None, None, [], []
    cuda = device.type == "cuda"
    peaks = {"train": 0.0, "all": 0.0}  # MiB: the training epochs', and with evaluation
    held = None

    def peak(phase):
        if cuda:
            now = torch.cuda.max_memory_allocated() / 2**20
            peaks[phase], peaks["all"] = max(peaks[phase], now), max(peaks["all"], now)
            torch.cuda.reset_peak_memory_stats()

    def evaluated(loader):
        if step is None:
            return evaluate(model, loader, regression, device, args.bf16)
        from trisparse.nn.capture import capture_stream

        with capture_stream(device):  # the captured steps' stream: no second cuBLAS workspace
            return evaluate(model, loader, regression, device, args.bf16)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.epochs):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loads.append(train_epoch(model, opt, train, regression, device, args.bf16, step))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peak("train")
        if cuda:  # what stays between steps: weights, optimizer state, data, workspaces, graphs
            held = torch.cuda.memory_allocated() / 2**20
        val = evaluated(valid)
        if best is None or (val < best if regression else val > best):
            best, best_test = val, evaluated(test)
        peak("all")
    result = {
        "seed": seed,
        "valid": best,
        "test": best_test,
        "epoch_s": statistics.median(times[1:] if len(times) > 1 else times),
        "load_s": statistics.median(loads[1:] if len(loads) > 1 else loads),
        "peak_mib": peaks["all"] if cuda else None,
        "train_peak_mib": peaks["train"] if cuda else None,
        "held_mib": held,
        "cuda_graph": args.cuda_graph,
        "captured_shapes": step.num_graphs if step is not None else None,
    }
    if args.profile and device.type == "cuda":
        result.update(profile_epoch(model, opt, train, regression, device, args.bf16, step))
    return result


class PackedLoader:
    """--loader packed: shuffled mini-batches collated by trisparse.nn.capture.PackedGraphs
    (whole-dataset tensors and index gathers; the same batches' contents as PyG's DataLoader)."""

    def __init__(self, graphs, batch_size, generator):
        from trisparse.nn.capture import PackedGraphs

        self.packed, self.batch_size, self.generator = PackedGraphs(graphs), batch_size, generator

    def __iter__(self):
        return self.packed.batches(self.batch_size, shuffle=True, generator=self.generator)


def masked_loss(out, y, regression):
    """The loss over the targets that are not NaN, without boolean indexing (no host sync)."""
    keep = ~torch.isnan(y)
    y, out = torch.where(keep, y, 0.0), torch.where(keep, out, 0.0)  # (no 0 * inf gradients)
    if regression:
        each = (out - y).square()
    else:
        each = F.binary_cross_entropy_with_logits(out, y, reduction="none")
    return torch.where(keep, each, 0.0).sum() / keep.sum()


def captured_step(model, opt, regression, bf16):
    """--cuda-graph: the training step (forward, loss, backward, Adam) as a CUDA graph per padded
    batch shape (trisparse.nn.capture; trisparse's GPSConv with bf16 autocast)."""
    from torch_geometric.data import Data
    from trisparse.nn.capture import CapturedStep

    def step(x, edge_index, edge_attr, batch, y, node_mask):
        data = Data(x=x, edge_index=edge_index, edge_attr=edge_attr, batch=batch)
        data.node_mask, data.num_graphs = node_mask, y.size(0)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            out = model(data).float()
        loss = masked_loss(out, y.float(), regression)
        loss.backward()
        opt.step()
        return loss.detach()

    return CapturedStep(step, model, opt)


def padded(data, batch_size):
    """The mini-batch padded to bucketed sizes (trisparse.nn.capture.pad_batch): a few shapes,
    one captured graph each."""
    from trisparse.nn.capture import bucket, pad_batch

    nodes = bucket(data.num_nodes)
    return pad_batch(data, nodes, bucket(data.edge_index.size(1)), batch_size + -(-nodes // 32))


def train_epoch(model, opt, train, regression, device, bf16=False, step=None):
    """One pass over the training batches (with ``step``: the captured step over padded
    batches); returns the host time spent collating them and copying them to the device."""
    model.train()
    load = 0.0
    batches = iter(train)
    while True:
        t0 = time.perf_counter()
        data = next(batches, None)
        if data is None:
            return load
        if step is not None:
            p = padded(data, train.batch_size)
            load += time.perf_counter() - t0
            step(p.x, p.edge_index, p.edge_attr, p.batch, p.y, p.node_mask)  # (copied in)
            continue
        data = data.to(device)
        load += time.perf_counter() - t0
        with autocast(device, bf16):
            out = model(data).float()
        y = data.y.float()
        keep = ~torch.isnan(y)
        if regression:
            loss = F.mse_loss(out[keep], y[keep])
        else:
            loss = F.binary_cross_entropy_with_logits(out[keep], y[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()


def profile_epoch(model, opt, train, regression, device, bf16=False, step=None):
    """One more epoch under torch.profiler: the GPU's busy time (the sum of the kernels' times)
    and the kernel count, against the epoch's wall time; a busy time far below it means the
    epoch waits on the host (Python, launches, the loader), not on the kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        train_epoch(model, opt, train, regression, device, bf16, step)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    return {
        "profiled_epoch_s": wall,
        "gpu_busy_s": sum(e.self_device_time_total for e in kernels) / 1e6,
        "kernels": sum(e.count for e in kernels),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="ogbg-molbace")
    ap.add_argument("--backend", choices=["pyg", "trisparse"], default="trisparse")
    ap.add_argument("--root", default=None)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. + seeds - 1")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--attn-dropout", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--workers", type=int, default=0, help="DataLoader worker processes collating batches"
    )
    ap.add_argument(
        "--loader",
        choices=["pyg", "packed"],
        default="pyg",
        help="training batches from PyG's DataLoader or trisparse.nn.capture.PackedGraphs (both "
        "backends alike)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    ap.add_argument(
        "--profile", action="store_true", help="CUDA: one more epoch under torch.profiler"
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="CUDA: bfloat16 autocast, both backends (trisparse: the segment kernels, attention "
        "dropout drawn inside them)",
    )
    ap.add_argument(
        "--cuda-graph",
        action="store_true",
        help="CUDA, trisparse with --bf16: the training step captured as a CUDA graph per padded "
        "batch shape (trisparse.nn.capture)",
    )
    ap.add_argument(
        "--recompute",
        action="store_true",
        help="trisparse: GPSConv(recompute=True), the layers' activations recomputed in the "
        "backward",
    )
    ap.add_argument(
        "--edge-bias",
        action="store_true",
        help="trisparse: GPSConv(edge_bias=True, edge_dim=channels), the embedded bonds also a "
        "learned score bias of the global attention between bonded atoms",
    )
    args = ap.parse_args()
    if (args.recompute or args.edge_bias) and args.backend != "trisparse":
        ap.error("--recompute and --edge-bias are trisparse's GPSConv arguments")
    if args.cuda_graph and (args.backend != "trisparse" or not args.bf16):
        ap.error(
            "--cuda-graph needs --backend trisparse and --bf16 (PyG's GPSConv pads each "
            "batch on the host, which a CUDA graph cannot replay)"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graphs, split = trisparse.datasets.ogbg(args.dataset, args.root)
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        r = run(args, graphs, split, seed, device)
        r.update(dataset=args.dataset, backend=args.backend, epochs=args.epochs)
        r.update(batch_size=args.batch_size, attn_dropout=args.attn_dropout, bf16=args.bf16)
        r.update(workers=args.workers, loader=args.loader, recompute=args.recompute)
        r.update(edge_bias=args.edge_bias)
        r.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
    tests = [r["test"] for r in results]
    spread = statistics.stdev(tests) if len(tests) > 1 else 0.0
    metric = "RMSE" if args.dataset.endswith(("esol", "freesolv")) else "ROC-AUC"
    print(
        f"{args.dataset} {args.backend}: test {metric} {statistics.mean(tests):.4f} +- "
        f"{spread:.4f} over {len(tests)} seeds; epoch {results[0]['epoch_s'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
