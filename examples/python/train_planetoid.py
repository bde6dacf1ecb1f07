#!/usr/bin/env python3
"""Trains a GCN, a GAT, a Graph Transformer or GPS on Cora or CiteSeer (the real Planetoid
features, labels and splits) with PyG's layers or trisparse's drop-ins, from the same script and
hyperparameters, and prints the test accuracy (at the best validation accuracy) and the time per
epoch.

    python3 examples/python/train_planetoid.py --dataset cora --model gcn --backend trisparse
    python3 examples/python/train_planetoid.py --model transformer --backend pyg --seeds 10

The two backends build the same parameters from the same seed (trisparse's layers are PyG's
subclasses) and draw the same feature dropout masks. GAT's attention dropout is drawn in
trisparse's kernels (other masks, the same distribution) unless --pyg-dropout asks for PyG's draws,
with which the two backends' runs differ only by rounding.
"""

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F
import trisparse
import trisparse.datasets
from torch import nn


def layers(backend, pyg_dropout=False):
    if backend == "pyg":
        import torch_geometric.nn as pyg

        return pyg.GCNConv, pyg.TransformerConv, pyg.GATConv
    import trisparse.nn

    gat = trisparse.nn.GATConv
    if pyg_dropout:
        gat = functools.partial(gat, pyg_dropout=True)
    return trisparse.nn.GCNConv, trisparse.nn.TransformerConv, gat


class GCN(nn.Module):
    """Kipf and Welling's two-layer GCN (hidden 16, dropout 0.5)."""

    def __init__(self, backend, features, classes, hidden=16, fuse_relu=False):
        super().__init__()
        conv, _, _ = layers(backend)
        # trisparse's layer can apply the ReLU in its own epilogue (fuse_relu).
        self.fused_relu = backend == "trisparse" and fuse_relu
        extra = {"fuse_relu": True} if self.fused_relu else {}
        self.conv1 = conv(features, hidden, cached=True, **extra)
        self.conv2 = conv(hidden, classes, cached=True)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, edge_index)
        x = x if self.fused_relu else F.relu(x)
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, edge_index)


class GAT(nn.Module):
    """Velickovic et al.'s two-layer GAT (8 heads x 8 hidden, one output head, dropout 0.6 on the
    features and on the attention weights)."""

    def __init__(
        self, backend, features, classes, hidden=8, heads=8, dropout=0.6, pyg_dropout=False
    ):
        super().__init__()
        _, _, conv = layers(backend, pyg_dropout)
        self.dropout = dropout
        self.conv1 = conv(features, hidden, heads=heads, dropout=dropout)
        self.conv2 = conv(hidden * heads, classes, heads=1, concat=False, dropout=dropout)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


class GraphTransformer(nn.Module):
    """TransformerConv blocks with residuals, layer norm and feed-forward blocks."""

    def __init__(self, backend, features, classes, hidden=128, heads=8, depth=4, dropout=0.5):
        super().__init__()
        _, conv, _ = layers(backend)
        self.dropout = dropout
        self.inp = nn.Linear(features, hidden)
        self.convs = nn.ModuleList(conv(hidden, hidden // heads, heads=heads) for _ in range(depth))
        self.norms1 = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(depth))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(depth)
        )
        self.norms2 = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        h = self.inp(x)
        for conv, n1, ffn, n2 in zip(self.convs, self.norms1, self.ffns, self.norms2, strict=True):
            h = n1(h + F.dropout(conv(h, edge_index), p=self.dropout, training=self.training))
            h = n2(h + F.dropout(ffn(h), p=self.dropout, training=self.training))
        return self.out(h)


class GPS(nn.Module):
    """GPS (Rampasek et al.) on one graph: GPSConv layers, each a GCN local MPNN beside global
    attention over all nodes (the graph is the batch's one element), between an input and an
    output linear map."""

    def __init__(self, backend, features, classes, hidden=64, heads=4, depth=2, dropout=0.5):
        super().__init__()
        gcn, _, _ = layers(backend)
        if backend == "pyg":
            from torch_geometric.nn import GPSConv
        else:
            from trisparse.nn import GPSConv
        self.dropout = dropout
        self.inp = nn.Linear(features, hidden)
        self.convs = nn.ModuleList(
            GPSConv(
                hidden,
                gcn(hidden, hidden),
                heads=heads,
                dropout=dropout,
                attn_kwargs={"dropout": dropout},
            )
            for _ in range(depth)
        )
        self.out = nn.Linear(hidden, classes)

    def forward(self, x, edge_index):
        h = self.inp(F.dropout(x, p=self.dropout, training=self.training))
        for conv in self.convs:
            h = conv(h, edge_index)
        return self.out(h)


GRAPH_AFTER = 3  # eager epochs before --cuda-graph captures the training step


def run(args, data, seed):
    torch.manual_seed(seed)
    classes = int(data.y.max()) + 1
    if args.model == "gcn":
        model, lr = GCN(args.backend, data.num_features, classes, fuse_relu=args.fuse_relu), 0.01
    elif args.model == "gat":
        gat = GAT(args.backend, data.num_features, classes, pyg_dropout=args.pyg_dropout)
        model, lr = gat, 0.005
    elif args.model == "gps":
        model, lr = GPS(args.backend, data.num_features, classes), 0.001
    else:
        model, lr = GraphTransformer(args.backend, data.num_features, classes), 0.001
    lr = args.lr if args.lr is not None else lr
    model = model.to(args.device, getattr(torch, args.dtype))
    # capturable: Adam's step counts on the device, so that a CUDA graph can hold its update.
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4, capturable=args.cuda_graph)

    # The training rows by index, not by boolean mask: the same rows in the same order, but a
    # gather, which a CUDA graph can hold (a mask's row count is a host synchronisation).
    train = data.train_mask.nonzero().view(-1)

    def step():
        opt.zero_grad(set_to_none=not args.cuda_graph)
        loss = F.cross_entropy(model(data.x, data.edge_index)[train], data.y[train])
        loss.backward()
        opt.step()

    best_val, test_at_best, times, graph = -1.0, 0.0, [], None
    side = torch.cuda.Stream() if args.cuda_graph else None
    for epoch in range(args.epochs):
        if args.cuda_graph and epoch == GRAPH_AFTER:
            # The whole training step as one CUDA graph, captured after GRAPH_AFTER eager epochs
            # on a side stream (PyTorch's recipe: lazy state such as cached graph normalisation
            # and trisparse's patterns and plans is built by then); each later epoch replays it.
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            model.train()
            with torch.cuda.graph(graph):
                step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.train()
        if graph is not None:
            graph.replay()
        elif side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.eval()
        with torch.no_grad():
            pred = model(data.x, data.edge_index).argmax(dim=-1)
        accs = [
            float((pred[m] == data.y[m]).float().mean()) for m in (data.val_mask, data.test_mask)
        ]
        if accs[0] > best_val:
            best_val, test_at_best = accs[0], accs[1]
    warm = times[min(args.warmup, len(times) - 1) :]
    return test_at_best, statistics.median(warm)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", choices=["cora", "citeseer"], default="cora")
    ap.add_argument("--model", choices=["gcn", "gat", "transformer", "gps"], default="gcn")
    ap.add_argument("--backend", choices=["pyg", "trisparse"], default="trisparse")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help="Adam's (GCN 0.01, GAT 0.005, transformer and GPS 0.001)",
    )
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument(
        "--warmup", type=int, default=10, help="first epochs left out of the time per epoch"
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="the model's and the features' dtype (GraphCUDA's GCN setting: float16, --warmup "
        "1000 --epochs 11000)",
    )
    ap.add_argument(
        "--fuse-relu",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="trisparse GCN: the first layer's ReLU in the layer's kernel (slower on Cora: the "
        "backward unpacks its mask in torch ops)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--cuda-graph",
        action="store_true",
        help=f"capture the training step (forward, backward, Adam) as one CUDA graph after "
        f"{GRAPH_AFTER} eager epochs and replay it (both backends; host overhead out of the epoch)",
    )
    ap.add_argument("--root", default=None, help="the Planetoid raw files (ind.<name>.*)")
    ap.add_argument(
        "--pyg-dropout",
        action="store_true",
        help="trisparse's GAT draws its attention dropout as PyG's (the same masks)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON line instead of text")
    args = ap.parse_args()
    if args.cuda_graph and args.device != "cuda":
        ap.error("--cuda-graph needs --device cuda")
    data = trisparse.datasets.planetoid(args.dataset, args.root)
    data.x = data.x / data.x.sum(dim=-1, keepdim=True).clamp_min(1)  # row-normalised features
    data.x = data.x.to(getattr(torch, args.dtype))
    data = data.to(args.device)
    accs, epoch_s = [], []
    for seed in range(args.seeds):
        acc, t = run(args, data, seed)
        accs.append(acc)
        epoch_s.append(t)
        if not args.json:
            print(f"seed {seed}: test accuracy {100 * acc:.1f} %, {1000 * t:.2f} ms per epoch")
    result = {
        "dataset": args.dataset,
        "model": args.model,
        "backend": args.backend,
        "device": args.device,
        "seeds": args.seeds,
        "epochs": args.epochs,
        "warmup": args.warmup,
        "dtype": args.dtype,
        "cuda_graph": args.cuda_graph,
        "pyg_dropout": args.pyg_dropout,
        "accuracy_mean": 100 * statistics.mean(accs),
        "accuracy_std": 100 * statistics.pstdev(accs),
        "epoch_ms_median": 1000 * statistics.median(epoch_s),
        "trisparse": trisparse.__version__,
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.dataset} {args.model} {args.backend} on {args.device}: "
            f"{result['accuracy_mean']:.1f} ± {result['accuracy_std']:.1f} % over {args.seeds} seeds, "
            f"{result['epoch_ms_median']:.2f} ms per training step"
        )


if __name__ == "__main__":
    main()
