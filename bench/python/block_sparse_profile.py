"""Where a block-sparse training step's time goes: for trisparse and compiled flex_attention
(the same random per-head blocks, bf16 [1, H, N, D]), the kernels of one forward + backward
(torch.profiler, microseconds a step), the span of the last step against its kernels' busy time,
the wall time a step with 50 steps queued (the GPU idles where the host is slower), the host
time of the forward and of the backward alone (enqueue only), and of the C++ plan's run and
backward alone and the ops' Python implementations around them.

  python3 bench/python/block_sparse_profile.py [--n 32768] [--block 128] [--sparsity 0.99 0.95]
      [--bias] [--importance]
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import trisparse
from torch.nn.attention.flex_attention import flex_attention
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_sparse import block_mask_from


def report(name, fn, leaves, dout, steps=5):
    def step():
        return torch.autograd.grad(fn(*leaves), leaves, dout)

    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"== {name}")
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name[:90]] = per_name.get(e.name[:90], 0.0) + e.device_time / steps
    for kernel, us in sorted(per_name.items(), key=lambda x: -x[1]):
        print(f"  {us:8.1f} us a step  {kernel}")
    last = sorted(kernels, key=lambda e: e.time_range.start)[-(len(kernels) // steps) :]
    span = last[-1].time_range.end - last[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in last)
    print(f"  last step: span {span:.1f} us, kernels busy {busy:.1f} us")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    print(f"  wall a step (50 queued): {(time.perf_counter() - t) / 50 * 1e6:.1f} us")
    t = time.perf_counter()
    outs = [fn(*leaves) for _ in range(30)]
    forward = (time.perf_counter() - t) / 30
    torch.cuda.synchronize()
    t = time.perf_counter()
    for out in outs:
        torch.autograd.grad(out, leaves, dout)
    backward = (time.perf_counter() - t) / 30
    torch.cuda.synchronize()
    print(f"  host: forward {forward * 1e6:.1f} us, backward {backward * 1e6:.1f} us")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_breakdown(q, k, v, dout, mask, repeat=100):
    """Host time a call (enqueue only) of the C++ plan's run and backward alone and of the ops'
    Python implementations around them, on [1, H, N, D] q, k, v, dout seen as [N, H, D]: where a
    small step's host time goes below the autograd layer."""
    from trisparse import _tensors
    from trisparse.ops import block_sparse as ops

    qf, kf, vf, df = (t[0].transpose(0, 1) for t in (q, k, v, dout))
    n, heads, dim = qf.shape
    cu, scale, dev = [0, n], dim**-0.5, q.device
    plan = ops._plan(qf, mask.id, cu, cu)
    out, lse = ops._forward._init_fn(qf, kf, vf, mask.id, cu, cu, scale, True)
    grads = [torch.empty_like(t) for t in (qf, kf, vf)]
    _fwd_owner, fws, fws_bytes = _tensors.workspace(plan.workspace_bytes(heads, dim), dev)
    _bwd_owner, bws, bws_bytes = _tensors.workspace(
        plan.backward_workspace_bytes(heads, False), dev
    )
    stream = _tensors.stream(dev)
    io = [_tensors.view(t) for t in (qf, kf, vf, out)]
    lse_view = _tensors.view(lse.unsqueeze(-1))
    grad_io = [_tensors.view(t) for t in (df, *grads)]

    calls = {
        "plan.run": lambda: plan.run(*io, lse_view, scale, stream, fws, fws_bytes, 0.0, 0),
        "forward op implementation": lambda: ops._forward._init_fn(
            qf, kf, vf, mask.id, cu, cu, scale, True
        ),
        "plan.backward": lambda: plan.backward(
            *io[:3], io[3], lse_view, *grad_io, scale, stream, bws, bws_bytes, None, None, 0.0, 0
        ),
        "backward op implementation": lambda: ops._backward_op._init_fn(
            qf, kf, vf, out, lse, df, mask.id, cu, cu, scale
        ),
    }
    for name, call in calls.items():
        call()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(repeat):
            call()
        host = (time.perf_counter() - t) / repeat
        _sync(dev)
        print(f"  host: {name} {host * 1e6:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.99, 0.95])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument(
        "--bias", action="store_true", help="also a learnable per-head block bias's step"
    )
    ap.add_argument(
        "--importance",
        action="store_true",
        help="also the step with the block masses tracked (BlockImportance(measure_grad=False), "
        "as PatternLearner tracks them)",
    )
    args = ap.parse_args()
    compiled = torch.compile(flex_attention, dynamic=False)
    h, d, g, n = args.heads, args.dim, args.block, args.n
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H {h}, D {d}, G {g}, N {n}")
    for p in args.sparsity:
        q, k, v, dout = (
            torch.rand(1, h, n, d, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(4)
        )
        blocks = np.random.default_rng(n + g + int(1000 * p)).random((h, n // g, n // g)) >= p
        ours = trisparse.BlockMask(torch.from_numpy(blocks)[None], block_size=g)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        report(
            f"trisparse p={p}",
            lambda a, b, c: trisparse.block_sparse_attention(a, b, c, ours),
            leaves,
            dout,
        )
        host_breakdown(q, k, v, dout, ours)
        if args.bias:
            table = torch.randn(1, h, n // g, n // g, device="cuda", requires_grad=True)
            report(
                f"trisparse with a block bias p={p}",
                lambda a, b, c: trisparse.block_sparse_attention(a, b, c, ours, bias=table),
                leaves,
                dout,
            )
        if args.importance:
            tracker = trisparse.BlockImportance(measure_grad=False)
            report(
                f"trisparse with the block masses p={p}",
                lambda a, b, c: trisparse.block_sparse_attention(a, b, c, ours, importance=tracker),
                leaves,
                dout,
            )
        if not args.no_flex:
            flex_mask = block_mask_from(blocks, n, g, q.device)
            report(
                f"flex p={p}",
                lambda a, b, c: compiled(a, b, c, block_mask=flex_mask),
                leaves,
                dout,
            )


if __name__ == "__main__":
    main()
