#!/usr/bin/env python3
"""How much of a real Graph Transformer's global attention a block pattern keeps (the
learned-pattern plan's evaluation (a), its error table): a model whose layers add dense global
attention over all nodes to a local TransformerConv is trained on Cora or CiteSeer (the real
Planetoid data and split); its global attention's q, k, v are taken per layer; for each
initialiser and each block sparsity, the relative L2 error ||O_pattern - O_dense|| / ||O_dense||
of the attention output, averaged over the heads and layers.

    python3 examples/python/pattern_error_planetoid.py --dataset cora --block 64 --json

With --train-learner, the accuracy side instead: the same model trained over --seeds seeds with
dense global attention and with each layer's global attention through a trisparse.PatternLearner
at each --sparsity (learned from the start: dense for --learner-warmup epochs, then block-sparse
with the kernels' block importance; --learner-method output: pruned for the output, the tracked
steps' statistics from torch ops), test accuracy at the best validation epoch per seed.

Patterns at sparsity s (the share of blocks dropped; every block row keeps its diagonal block):
random; local-strided (a band of blocks and every stride-th block, as close to s as its parameters
allow); community and knn (the graph's / features' community order, then the blocks holding the most
edges of that graph); topk (pooled q . k routing, trisparse.topk_block_mask's rule); learned (a
PatternLearner per layer, dense through the training, folding each step's exact block mass into its
moving average, pruned per block row); learned_output (the same learners' moving averages of the
masses and value sums, pruned for the output: PatternLearner(method="output")); output
(learn_block_pattern's "output" method on the very q, k, v: per block row the blocks whose
renormalised output comes nearest the dense one, chosen greedily from the blocks' masses and value
sums); oracle (the blocks of highest true attention mass
per block row, learn_block_pattern from the very q and k: how sparse the attention really is;
oracle_mass_kept is the attention mass its blocks hold).
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import trisparse
import trisparse.datasets
import trisparse.nn
from torch import nn


class Layer(nn.Module):
    """x + TransformerConv(x) over the edges + dense global attention over all nodes."""

    def __init__(self, channels, heads, learner=None):
        super().__init__()
        self.learner = learner
        self.local = trisparse.nn.TransformerConv(channels, channels // heads, heads=heads)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)
        self.heads = heads
        self.norm = nn.LayerNorm(channels)
        self.saved = None

    def forward(self, x, edge_index):
        n, c = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, c // self.heads).permute(1, 2, 0, 3)
        self.saved = (q.detach(), k.detach(), v.detach())  # [H, N, D] each
        if self.learner is not None:  # the learned pattern (dense while it warms up)
            glob = self.learner(q[None], k[None], v[None])[0]
        else:
            glob = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        glob = self.out(glob.permute(1, 0, 2).reshape(n, c))
        return self.norm(x + F.elu(self.local(x, edge_index)) + glob)


class Model(nn.Module):
    def __init__(self, features, classes, channels, heads, layers, dropout, learners=None):
        super().__init__()
        self.inp = nn.Linear(features, channels)
        learners = learners or [None] * layers
        self.layers = nn.ModuleList(Layer(channels, heads, ln) for ln in learners)
        self.head = nn.Linear(channels, classes)
        self.dropout = dropout

    def forward(self, x, edge_index):
        x = F.dropout(x, self.dropout, self.training)
        x = F.elu(self.inp(x))
        for layer in self.layers:
            x = F.dropout(layer(x, edge_index), self.dropout, self.training)
        return self.head(x)


def train(data, args, seed=None, learners=None):
    torch.manual_seed(args.seed if seed is None else seed)
    model = Model(
        data.num_features,
        int(data.y.max()) + 1,
        args.channels,
        args.heads,
        args.layers,
        0.5,
        learners,
    ).to(data.x.device)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, weight_decay=5e-4)
    amp = torch.autocast(data.x.device.type, torch.bfloat16, enabled=args.bf16)
    best, best_state = -1.0, None
    for _ in range(args.epochs):
        model.train()
        opt.zero_grad()
        with amp:
            loss = F.cross_entropy(
                model(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask]
            )
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad(), amp:
            pred = model(data.x, data.edge_index).argmax(1)
        val = float((pred[data.val_mask] == data.y[data.val_mask]).float().mean())
        if val > best:
            best = val
            best_state = {k: t.clone() for k, t in model.state_dict().items()}
    model.load_state_dict(best_state)
    model.eval()
    with torch.no_grad(), amp:
        pred = model(data.x, data.edge_index).argmax(1)
    test = float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())
    return model, best, test


def counts_in_order(edge_index, order, n, g):
    """[qb, kb] edge counts per block of the graph with its nodes in `order`."""
    where = torch.empty(n, dtype=torch.int64)
    where[order] = torch.arange(n)
    nb = -(-n // g)
    counts = torch.zeros(nb * nb, dtype=torch.float64)
    dst, src = where[edge_index[1]] // g, where[edge_index[0]] // g
    counts.index_add_(0, dst * nb + src, torch.ones(dst.numel(), dtype=torch.float64))
    return counts.view(nb, nb)


def local_strided(nb, keep):
    """A band plus every stride-th block, the stride chosen to come closest to `keep` blocks a
    row (at least the diagonal)."""
    r, c = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    best = None
    for window in range(nb):
        for stride in range(2, nb + 1):
            blocks = ((r - c).abs() <= window) | ((c - r) % stride == 0)
            gap = abs(float(blocks.float().mean()) - keep)
            if best is None or gap < best[0]:
                best = (gap, blocks)
    return best[1]


def errors(q, k, v, blocks, g, order=None):
    """Mean over heads of the relative L2 error of the attention over `blocks` ([H, qb, kb] or
    [qb, kb]) in node `order` against dense."""
    if order is not None:
        q, k, v = q[:, order], k[:, order], v[:, order]
    if blocks.dim() == 2:
        blocks = blocks.expand(q.shape[0], *blocks.shape)
    p = trisparse.BlockPattern.from_blocks(blocks.contiguous(), g, rows=q.shape[1], cols=k.shape[1])
    return float(trisparse.attention_error(q, k, v, p).mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="cora")
    ap.add_argument("--root", default=None)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON line per (method, sparsity)")
    ap.add_argument("--train-learner", action="store_true", help="the accuracy side (above)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--learner-warmup", type=int, default=20, help="dense epochs first")
    ap.add_argument(
        "--learner-method", default="row", help="PatternLearner's pruning: row or output"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA block kernels)")
    args = ap.parse_args()
    data = trisparse.datasets.planetoid(args.dataset, args.root).to(args.device)
    if args.train_learner:
        return train_with_learners(data, args)
    start = time.perf_counter()
    # Learners that stay dense for the whole run (the same training as plain SDPA) and observe
    # each step's exact block masses and value sums: the pattern learned from training, pruned at
    # each sparsity by the mass and for the output.
    observers = [
        trisparse.PatternLearner(args.block, 0.9, method="output", warmup=args.epochs + 1)
        for _ in range(args.layers)
    ]
    model, val, test = train(data, args, learners=observers)
    trained_s = time.perf_counter() - start
    with torch.no_grad():
        model(data.x, data.edge_index)
    saved = [layer.saved for layer in model.layers]
    n, g = data.num_nodes, args.block
    nb = -(-n // g)
    graph_order = trisparse.BlockPattern.community(data.edge_index, n, g).order
    # The 10 nearest neighbours by the cosine of the features (BlockPattern.knn's graph).
    unit = F.normalize(data.x, dim=1)
    sim = unit @ unit.T
    sim.fill_diagonal_(float("-inf"))
    knn_edges = torch.stack(
        [torch.topk(sim, 10, 1).indices.reshape(-1), torch.arange(n).repeat_interleave(10)]
    )
    knn_order = trisparse.BlockPattern.community(knn_edges, n, g).order
    graph_counts = counts_in_order(data.edge_index, graph_order, n, g)
    knn_counts = counts_in_order(knn_edges, knn_order, n, g)
    head = {
        "dataset": args.dataset,
        "nodes": n,
        "block": g,
        "blocks_a_side": nb,
        "layers": args.layers,
        "heads": args.heads,
        "val": val,
        "test": test,
        "trained_s": trained_s,
    }
    print(json.dumps(head) if args.json else head, flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    for s in args.sparsity:
        keep = 1.0 - s
        row = {"sparsity": s}
        methods = ("random", "local_strided", "community", "knn", "topk", "learned")
        methods = (*methods, "learned_output", "output", "oracle")
        per = {m: [] for m in (*methods, "oracle_mass_kept")}
        for (q, k, v), observer in zip(saved, observers, strict=True):
            q, k, v = q.double(), k.double(), v.double()
            heads = q.shape[0]
            rand = torch.rand(heads, nb, nb, generator=gen) < keep
            rand |= torch.eye(nb, dtype=torch.bool)
            per["random"].append(errors(q, k, v, rand, g))
            per["local_strided"].append(errors(q, k, v, local_strided(nb, keep), g))
            per["community"].append(
                errors(
                    q, k, v, trisparse.prune_blocks(graph_counts[None], s, "row")[0], g, graph_order
                )
            )
            per["knn"].append(
                errors(q, k, v, trisparse.prune_blocks(knn_counts[None], s, "row")[0], g, knn_order)
            )
            top_k = max(1, round(keep * nb))
            routed = trisparse.topk_block_mask(q[None].float(), k[None].float(), g, top_k)
            per["topk"].append(errors(q, k, v, routed.blocks[0], g))
            learned = trisparse.prune_blocks(observer.importance, s, "row")
            per["learned"].append(errors(q, k, v, learned, g))
            learned = trisparse.prune_blocks_by_output(observer.importance, observer.values, s)
            per["learned_output"].append(errors(q, k, v, learned, g))
            output = trisparse.learn_block_pattern(q, k, g, s, method="output", v=v)
            per["output"].append(float(trisparse.attention_error(q, k, v, output).mean()))
            oracle = trisparse.learn_block_pattern(q, k, g, s)
            per["oracle"].append(float(trisparse.attention_error(q, k, v, oracle).mean()))
            mass = trisparse.block_mass(q, k, g)  # each block row's share the oracle keeps
            per["oracle_mass_kept"].append(float((mass * oracle.blocks()).sum(-1).mean()))
        for m, xs in per.items():
            row[m] = sum(xs) / len(xs)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            cells = ", ".join(f"{m} {100 * x:.2f} %" for m, x in row.items() if m != "sparsity")
            print(f"sparsity {s:.2f}: {cells}", flush=True)


def train_with_learners(data, args):
    """Test accuracy over seeds: dense global attention, then a PatternLearner per layer at each
    sparsity (same seeds)."""
    for s in [0.0, *args.sparsity]:
        tests, start = [], time.perf_counter()
        for seed in range(args.seeds):
            learners = None
            if s > 0:
                learners = [
                    trisparse.PatternLearner(
                        args.block,
                        s,
                        method=args.learner_method,
                        every=10,
                        warmup=args.learner_warmup,
                        track_every=2,
                    )
                    for _ in range(args.layers)
                ]
            tests.append(train(data, args, seed, learners)[2])
        t = torch.tensor(tests)
        row = {
            "dataset": args.dataset,
            "mode": "dense" if s == 0 else "learned",
            "method": args.learner_method,
            "sparsity": s,
            "block": args.block,
            "channels": args.channels,
            "heads": args.heads,
            "bf16": args.bf16,
            "device": str(data.x.device),
            "seeds": args.seeds,
            "test_mean": float(t.mean()),
            "test_sd": float(t.std()) if len(tests) > 1 else 0.0,
            "tests": tests,
            "seconds": time.perf_counter() - start,
        }
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(
                f"{row['mode']} {s:.2f}: {100 * row['test_mean']:.2f} +- "
                f"{100 * row['test_sd']:.2f} % over {args.seeds} seeds",
                flush=True,
            )


if __name__ == "__main__":
    main()
