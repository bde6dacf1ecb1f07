#!/usr/bin/env python3
"""One TransformerConv (or --layer GATConv) layer's forward + backward, trisparse.nn against PyG's
own, with the same weights: per graph file (read as trisparse.datasets reads it) with at least
--min-edges edges, and per --random N:E uniform random multigraph (E edges drawn with repeats), in
float32 and under bfloat16 autocast; with --edge-dim F, random edge features of F columns; with
--dropout P, attention dropout P in training mode (our layers draw it in the kernels, so their
errors against PyG are left out; with --pyg-dropout both layers draw the same factors for the
compared step). --device cpu: float32 only, wall-clock medians, no memory column (our CPU layers
draw PyG's dropout factors).

    python3 bench/python/transformer_conv.py data/*.el.xz --heads 8 --channels 16 > results.jsonl
    python3 bench/python/transformer_conv.py --layer GATConv --edge-dim 16 --random 1000000:10000000

Step: the layer's forward on x [N, in] and backward of a fixed random dout (gradients of x and of
every parameter); CUDA-event medians of --repeat after 3 warm-ups. Peak memory: the step's
torch.cuda.max_memory_allocated beyond what was allocated before it. Error: max |ours - PyG| /
max |PyG| over the output and the gradients of x and the parameters, both in the same mode
(rel_error below). --f64 also runs PyG's layer in float64 on the same inputs and reports both
backends' fp32 errors against it (which side carries a difference). --profile adds, for our
layer and PyG's, the CUDA kernels' time per step (torch.profiler, top 24) to each record. --host
adds the step back to back (the host ahead of the GPU) and the host's enqueue time of the forward
and of the backward (medians, the GPU held busy meanwhile so that no call waits on it): where
their sum nears the GPU's step, the step from idle is the host's.
One JSON line per (graph, mode); a backend out of memory is reported ("error"), not skipped.
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch_geometric.nn
import trisparse
import trisparse.datasets
import trisparse.nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import back_to_back_ms, events_ms, wall_ms


def leaves_and_forward(layer, x, edge_index, edge_attr, autocast):
    """Fresh leaves x and {"edge_attr": ...} (or {}), and the layer's forward on them with every
    gradient cleared first (under bf16 autocast with `autocast`)."""
    x = x.detach().requires_grad_()
    extra = {} if edge_attr is None else {"edge_attr": edge_attr.detach().requires_grad_()}

    def forward():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        for t in extra.values():
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return layer(x, edge_index, **extra)

    return x, extra, forward


def run(layer, x, edge_index, edge_attr, dout, autocast, repeat):
    """Step time, peak memory beyond the inputs, and (output, gradients) of one step."""
    x, extra, forward = leaves_and_forward(layer, x, edge_index, edge_attr, autocast)

    def step():
        out = forward()
        out.backward(dout.to(out.dtype))
        return out

    cuda = x.is_cuda
    ms = events_ms(step, repeat) if cuda else wall_ms(step, repeat)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)  # both layers draw the same dropout factors (PyG's order)
    out = step()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    # Copies: float() of a float32 gradient is the gradient itself, which --profile's later
    # steps would keep accumulating into.
    tensors = [out.detach().float(), x.grad.float()] + [t.grad.float() for t in extra.values()]
    tensors = [t.clone() for t in tensors] + [p.grad.float().clone() for p in layer.parameters()]
    return {"step_ms": ms, "peak_mib": peak}, tensors


def host_times(layer, x, edge_index, edge_attr, dout, autocast, repeat):
    """Back-to-back ms a step and the host's enqueue ms of the forward and of the backward."""
    forward = leaves_and_forward(layer, x, edge_index, edge_attr, autocast)[2]

    def step():
        out = forward()
        out.backward(dout.to(out.dtype))

    rec = {"b2b_ms": back_to_back_ms(step, repeat)}
    fwd, bwd = [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued ahead of the step
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        out.backward(dout.to(out.dtype))
        t2 = time.perf_counter()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
    torch.cuda.synchronize()
    rec.update(host_fwd_ms=statistics.median(fwd), host_bwd_ms=statistics.median(bwd))
    return rec


def profile_top(layer, x, edge_index, edge_attr, dout, autocast, steps=3):
    """A step's CUDA time per kernel name (ms per step, calls per step), largest first."""
    from torch.profiler import ProfilerActivity, profile

    extra = {} if edge_attr is None else {"edge_attr": edge_attr.detach().requires_grad_()}
    x = x.detach().requires_grad_()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x, edge_index, **extra)
        out.backward(dout.to(out.dtype))

    step()
    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
    ) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    rows = [
        (e.key[:90], e.device_time_total / 1e3 / steps, e.count // steps)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
    ]
    ops = sorted(
        (e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")),
        key=lambda e: -e.self_device_time_total,
    )
    ops = [
        [e.key, str(e.input_shapes)[:80], round(e.self_device_time_total / 1e3 / steps, 3)]
        for e in ops[:16]
    ]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    gemm = sum(
        ms for n, ms, _ in rows if any(w in n for w in ("gemm", "nvjet", "cutlass", "splitK"))
    )
    return {
        "gpu_ms": round(total, 3),
        "gemm_ms": round(gemm, 3),
        "top": [[n, round(ms, 3), c] for n, ms, c in rows[:24]],
        "ops": ops,
    }


def rel_error(got, ref):
    """max |got - ref| / max |ref| over the tensors; lin_key's bias gradient is 0 in exact
    arithmetic (a bias on every key of a row leaves its softmax unchanged), so each denominator is
    at least 1e-3 of the largest tensor's."""
    if not all(torch.isfinite(g).all() for g in got):
        return float("nan")
    floor = 1e-3 * max(float(r.abs().max()) for r in ref)
    return max(
        float((g - r).abs().max()) / max(float(r.abs().max()), floor) for g, r in zip(got, ref)
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", nargs="*")
    ap.add_argument("--layer", default="TransformerConv", choices=["TransformerConv", "GATConv"])
    ap.add_argument("--edge-dim", type=int, default=0, help="edge feature columns (0: none)")
    ap.add_argument("--random", action="append", default=[], metavar="N:E")
    ap.add_argument("--min-edges", type=int, default=200_000)
    ap.add_argument("--in-channels", type=int, default=128)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--f64", action="store_true", help="both fp32 runs against PyG in float64")
    ap.add_argument("--profile", action="store_true", help="each step's kernels (torch.profiler)")
    ap.add_argument(
        "--host", action="store_true", help="also back to back and the host's enqueue times"
    )
    ap.add_argument(
        "--dropout", type=float, nargs="+", default=[0.0], help="attention dropouts (training)"
    )
    ap.add_argument(
        "--pyg-dropout",
        action="store_true",
        help="PyG's dropout draws (else the kernels'; no error vs PyG then)",
    )
    ap.add_argument(
        "--negative-slope",
        type=float,
        default=None,
        help="GATConv's LeakyReLU slope (PyG's 0.2 by default; 1.0 removes the kink, where "
        "scores within rounding of 0 take either slope, from --f64's comparison)",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    dev = torch.device(a.device)
    modes = (("fp32", False), ("bf16_autocast", True)) if dev.type == "cuda" else (("fp32", False),)
    device_name = (
        torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    )
    for path in [*a.graphs, *(f"random:{spec}" for spec in a.random)]:
        if path.startswith("random:"):
            n, e = (int(v) for v in path.split(":")[1:])
            g = torch.Generator().manual_seed(7)
            edge_index, graph = torch.randint(0, n, (2, e), generator=g), f"random_{n}_{e}"
        else:
            edge_index, n = trisparse.datasets.read_graph(path)
            graph = os.path.basename(path).split(".")[0]
        if edge_index.shape[1] < a.min_edges:
            continue
        edge_index = edge_index.to(dev)
        x = torch.randn(n, a.in_channels, device=dev)
        edge_attr = torch.randn(edge_index.shape[1], a.edge_dim, device=dev) if a.edge_dim else None
        dout = torch.randn(n, a.heads * a.channels, device=dev)
        for dropout, (mode, autocast) in itertools.product(a.dropout, modes):
            kwargs = {"heads": a.heads, "dropout": dropout}
            if a.negative_slope is not None:
                kwargs["negative_slope"] = a.negative_slope
            if a.edge_dim:
                kwargs["edge_dim"] = a.edge_dim
            torch.manual_seed(0)
            pyg = getattr(torch_geometric.nn, a.layer)(a.in_channels, a.channels, **kwargs)
            # Our layers draw their dropout in the kernels unless asked for PyG's draws (always on
            # the CPU for TransformerConv).
            exact = a.pyg_dropout or dropout == 0 or (dev.type == "cpu" and a.layer != "GATConv")
            mine = {"pyg_dropout": True} if a.pyg_dropout else {}
            ours = getattr(trisparse.nn, a.layer)(a.in_channels, a.channels, **kwargs, **mine)
            pyg, ours = pyg.to(dev), ours.to(dev)
            ours.load_state_dict(pyg.state_dict())
            rec = {"graph": graph, "layer": a.layer, "edge_dim": a.edge_dim, "nodes": n}
            rec.update(edges=int(edge_index.shape[1]), heads=a.heads, channels=a.channels)
            rec.update(dropout=dropout, pyg_dropout=a.pyg_dropout)
            rec.update(mode=mode, device=device_name, torch=torch.__version__)
            ref = None

            def f64_tensors(layer):
                """PyG's layer with layer's weights, in float64, on the same inputs."""
                ref64 = getattr(torch_geometric.nn, a.layer)(a.in_channels, a.channels, **kwargs)
                ref64.load_state_dict(layer.state_dict())
                ref64 = ref64.to(dev).double()
                attr = None if edge_attr is None else edge_attr.double()
                _, t64 = run(ref64, x.double(), edge_index, attr, dout.double(), False, 1)
                del ref64
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                return t64

            for name, layer in (("pyg", pyg), ("trisparse", ours)):
                try:
                    r, tensors = run(layer, x, edge_index, edge_attr, dout, autocast, a.repeat)
                except torch.OutOfMemoryError as e:
                    rec[name] = {"error": "out of memory: " + str(e).splitlines()[0][:160]}
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                if name == "pyg":
                    ref = tensors
                elif ref is not None and exact:
                    r["rel_error_vs_pyg"] = rel_error(tensors, ref)
                    # Per tensor (output, x, edge_attr, then the parameters in order): which one
                    # sets the maximum.
                    r["rel_error_by_tensor"] = [rel_error([g], [w]) for g, w in zip(tensors, ref)]
                if a.f64 and not autocast and dropout == 0:
                    t64 = f64_tensors(layer)
                    r["rel_error_vs_f64"] = rel_error(tensors, t64)
                    r["rel_error_vs_f64_by_tensor"] = [
                        rel_error([g], [w]) for g, w in zip(tensors, t64)
                    ]
                if a.profile:
                    r["profile"] = profile_top(layer, x, edge_index, edge_attr, dout, autocast)
                if a.host and dev.type == "cuda":
                    r.update(host_times(layer, x, edge_index, edge_attr, dout, autocast, a.repeat))
                rec[name] = r
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
