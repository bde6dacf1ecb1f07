"""Time per training epoch, peak memory and (Graph Transformer) inference time of the three
example models (examples/python/train_planetoid.py: GCN, GAT, Graph Transformer) with PyG's layers
and with trisparse's drop-ins, on graph files and on generated uniform random graphs, with random
features and labels. One JSON line per (graph, model, backend).

    python3 bench/python/gnn_epoch.py --graphs data/reddit10k.el.xz --generate 1000000:10 \\
        --models gcn gat transformer --backends pyg trisparse > results.jsonl

Epoch: forward, cross-entropy on every node, backward, Adam step; the median over --epochs after
two warm-up epochs (CUDA-synchronised wall clock). Peak memory: torch.cuda.max_memory_allocated
during the timed epochs beyond what was allocated before them (model, inputs, optimizer state).
Inference: model.eval() forward under torch.no_grad(). A backend that runs out of memory is
reported as such ("error"), not skipped. --autocast bf16 runs the forwards under
torch.autocast(bfloat16) (parameters and Adam in fp32), as mixed-precision training does.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import trisparse
import trisparse.datasets

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")
)
from train_planetoid import GAT, GCN, GraphTransformer

MODELS = {"gcn": GCN, "gat": GAT, "transformer": GraphTransformer}


def uniform_graph(n, degree, seed):
    """Every node attends `degree` uniformly drawn nodes (repeats merged): [2, E] (j -> i)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (n * degree,), generator=g)
    dst = torch.arange(n).repeat_interleave(degree)
    key = torch.unique(dst * n + src)
    return torch.stack([key % n, key // n])


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat):
    times = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(model_name, backend, x, y, edge_index, classes, args, device):
    torch.manual_seed(0)
    model = MODELS[model_name](backend, x.shape[1], classes).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            return model(x, edge_index)

    def epoch():
        model.train()
        opt.zero_grad()
        F.cross_entropy(forward().float(), y).backward()
        opt.step()

    r = {}
    for _ in range(2):
        epoch()
    synchronize(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    r["epoch_ms"] = timed(epoch, device, args.epochs)
    if device.type == "cuda":
        r["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if args.profile:  # one more epoch under torch.profiler: its top CUDA kernels, to stderr
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            epoch()
            synchronize(device)
        print(f"# {model_name} {backend} {args.autocast}", file=sys.stderr)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), file=sys.stderr)
    if model_name == "transformer":
        model.eval()
        with torch.no_grad():
            forward()  # warm-up
            r["inference_ms"] = timed(forward, device, args.epochs)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", nargs="*", default=[], help="graph files (trisparse.datasets)")
    ap.add_argument("--generate", nargs="*", default=[], help="uniform graphs N:DEGREE")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--backends", nargs="+", default=["pyg", "trisparse"])
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true", help="kernel times of one epoch to stderr")
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none")
    args = ap.parse_args()
    device = torch.device(args.device)
    inputs = [
        (os.path.basename(p), lambda p=p: trisparse.datasets.read_graph(p)) for p in args.graphs
    ]
    for spec in args.generate:
        n, degree = (int(v) for v in spec.split(":"))
        inputs.append((f"uniform_{n}_{degree}", lambda n=n, d=degree: (uniform_graph(n, d, 1), n)))
    for name, load in inputs:
        edge_index, n = load()
        g = torch.Generator().manual_seed(2)
        x = torch.rand(n, args.features, generator=g).to(device)
        y = torch.randint(0, args.classes, (n,), generator=g).to(device)
        edge_index = edge_index.to(device)
        for model_name in args.models:
            for backend in args.backends:
                r = {"graph": name, "nodes": n, "edges": edge_index.shape[1], "model": model_name}
                r.update(backend=backend, device=str(device), features=args.features)
                r.update(precision="fp32" if args.autocast == "none" else "bf16 autocast")
                try:
                    r.update(
                        measure(model_name, backend, x, y, edge_index, args.classes, args, device)
                    )
                except torch.OutOfMemoryError as e:
                    r["error"] = "out of memory: " + str(e).splitlines()[0][:160]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                r.update(torch=torch.__version__, trisparse=trisparse.__version__)
                print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
