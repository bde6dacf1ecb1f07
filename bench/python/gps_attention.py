#!/usr/bin/env python3
"""GPS's global attention alone (forward + backward, bf16): each graph of a mini-batch attends
within itself. Four implementations on the same q, k, v [N, H, D] (packed nodes):

- trisparse_segment: ``segment_attention`` over the batch vector (the segment kernels, GPSConv's
  path for 16-bit heads without attention dropout): no pattern, nothing built per batch;

- trisparse: ``sparse_attention`` over ``Pattern.from_batch(batch)`` (no padding; the fused 3S
  kernels; its plan, built on the GPU, timed apart: ``trisparse_plan_ms``); trisparse_build: the
  same with ``from_batch`` and the plan's build inside every step, as GPSConv pays them;
- trisparse_edge: ``edge_attention`` (the multigraph kernels, GPSConv's path on CUDA) over the
  same pattern, its multigraph grouped on the GPU (``edge_plan_ms``); trisparse_edge_build: the
  same with ``from_batch`` and that grouping inside every step, as a training loop pays them;
- flex: FlexAttention (compiled) over [1, H, N, D] with a document mask, its block mask built for
  each batch (timed apart: ``mask_ms``); flex_build: the mask's build inside every step;
- pyg_padded: what PyG's GPSConv does, ``to_dense_batch`` to [B, n_max, H, D] then
  scaled_dot_product_attention with the key padding mask, and the real rows gathered back;
- with --dropout p: trisparse_segment_dropout (the segment kernels drawing attention dropout
  themselves) and pyg_padded_dropout (SDPA's dropout_p), as training pays them.

    python3 bench/python/gps_attention.py data/tu_nci1.graph_ptr.xz --graphs 0 128 1024 \
        --heads-dims 4x16 4x32 4x64 > gps_attention.jsonl

--graphs: batch sizes in graphs (0 = the whole set as one batch; others: consecutive batches,
the first of that size). Times: CUDA-event medians of --repeat steps after warm-ups. Error: max
|x - ref| / max |ref| over out and the gradients against a float32 dense reference per graph.
"""

import argparse
import json
import lzma
import os
import sys

import torch
import torch.nn.functional as F
import trisparse
from torch_geometric.utils import to_dense_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_training import events_ms


def read_ptr(path):
    with lzma.open(path, "rt") if path.endswith(".xz") else open(path) as f:
        return torch.tensor([int(line) for line in f if line.strip()], dtype=torch.int64)


def ours(pattern):
    def attend(q, k, v):
        return trisparse.sparse_attention(q, k, v, pattern)

    return attend


def ours_with_build(batch):
    def attend(q, k, v):
        return ours(trisparse.Pattern.from_batch(batch))(q, k, v)

    return attend


def segment(batch, dropout=0.0):
    def attend(q, k, v):
        return trisparse.segment_attention(q, k, v, batch, assume_sorted=True, dropout_p=dropout)

    return attend


def edge(pattern):
    def attend(q, k, v):
        return trisparse.edge_attention(q, k, v, pattern, q.shape[-1] ** -0.5)[0]

    return attend


def edge_with_build(batch):
    def attend(q, k, v):
        return edge(trisparse.Pattern.from_batch(batch))(q, k, v)

    return attend


def padded(batch, dropout=0.0):
    def attend(q, k, v):
        n, h, d = q.shape
        dense = [to_dense_batch(t.reshape(n, h * d), batch)[0] for t in (q, k, v)]
        mask = to_dense_batch(q[:, 0, 0], batch)[1]  # [B, n_max] real nodes
        qd, kd, vd = (t.view(t.shape[0], t.shape[1], h, d).transpose(1, 2) for t in dense)
        o = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask[:, None, None, :], dropout_p=dropout
        )
        return o.transpose(1, 2)[mask]

    return attend


def flex(batch, compiled):
    from torch.nn.attention.flex_attention import create_block_mask

    n = batch.numel()
    pad = (-n) % 128
    doc = torch.cat([batch, batch.new_full((pad,), -1)])

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = create_block_mask(
        document, None, None, n + pad, n + pad, device=batch.device, _compile=True
    )

    def attend(q, k, v):
        qf, kf, vf = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for t in (q, k, v))
        return compiled(qf, kf, vf, block_mask=mask)[0].transpose(0, 1)[:n]

    return attend


def reference(q, k, v, ptr, dout):
    """float32 dense attention per graph and its gradients."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    outs = []
    for g in range(ptr.numel() - 1):
        a, b = int(ptr[g]), int(ptr[g + 1])
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in leaves)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.float())
    return [out.detach(), *(t.grad for t in leaves)]


def rel(got, want):
    return max(
        float((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-12))
        for g, w in zip(got, want)
    )


def step_of(attend, q, k, v, dout, *more):
    """(step, result) of attend(q, k, v, *more) and its backward from dout: result gives the
    output and the gradients of every input."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, *more)]

    def step():
        for t in leaves:
            t.grad = None
        out = attend(*leaves)
        out.backward(dout)
        return out

    def result():
        out = step()
        return [out.detach(), *(t.grad for t in leaves)]

    return step, result


def inputs(n, heads, dim, dev):
    """(the generator, seed 1 on dev, that drew them; bf16 q, k, v and dout [n, heads, dim])."""
    g = torch.Generator(device=dev).manual_seed(1)
    tensors = [
        torch.randn(n, heads, dim, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(4)
    ]
    return g, tensors


def time_cases(rec, cases, args, want, repeat):
    """rec[name] = step_ms, peak_mib (beyond what was allocated before) and rel_error against
    want (None for names ending _dropout) of each (name, attend) of cases, stepped by
    step_of(attend, *args); an error's first line where one fails."""
    for name, attend in cases:
        try:
            step, result = step_of(attend, *args)
            got = result()  # also leaves the gradients allocated, as in the others
            err = None if name.endswith("_dropout") else rel(got, want)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = events_ms(step, repeat)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            rec[name] = {"step_ms": ms, "peak_mib": peak, "rel_error": err}
        except Exception as e:  # noqa: BLE001 - out of memory, a compile failure
            rec[name] = {"error": str(e).splitlines()[0][:200]}
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ptr_files", nargs="+")
    ap.add_argument("--graphs", type=int, nargs="+", default=[0, 128, 1024])
    ap.add_argument("--heads-dims", nargs="+", default=["4x16", "4x32", "4x64"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="also time attention dropout p (as training pays it): the segment kernels drawing it "
        "themselves, and PyG's padded path (SDPA's dropout_p); no error for these",
    )
    a = ap.parse_args()
    dev = torch.device("cuda")
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    for path in a.ptr_files:
        full = read_ptr(path)
        for graphs in a.graphs:
            ptr = full if graphs == 0 or graphs >= full.numel() - 1 else full[: graphs + 1]
            ptr = ptr - ptr[0]
            sizes = ptr.diff()
            batch = torch.repeat_interleave(torch.arange(sizes.numel()), sizes).to(dev)
            n = int(ptr[-1])
            for hd in a.heads_dims:
                heads, dim = (int(v) for v in hd.split("x"))
                _, (q, k, v, dout) = inputs(n, heads, dim, dev)
                rec = {"set": os.path.basename(path).split(".")[0], "graphs": sizes.numel()}
                rec.update(nodes=n, max_nodes=int(sizes.max()), heads=heads, dim=dim)
                rec.update(pairs=int((sizes * sizes).sum()), dtype="bf16")
                rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
                want = reference(q, k, v, ptr.to(dev), dout)
                torch.cuda.synchronize()
                start, mid, stop = (torch.cuda.Event(True) for _ in range(3))
                start.record()
                pattern = trisparse.Pattern.from_batch(batch)
                mid.record()
                pattern.plan(dev, gradients=True)
                stop.record()
                stop.synchronize()
                rec["trisparse_pattern_ms"] = start.elapsed_time(mid)
                rec["trisparse_plan_ms"] = mid.elapsed_time(stop)
                start.record()
                pattern.edge_attention_plan(dev)
                stop.record()
                stop.synchronize()
                rec["edge_plan_ms"] = start.elapsed_time(stop)
                cases = [("trisparse_segment", segment(batch))]
                cases += [("trisparse", ours(pattern)), ("pyg_padded", padded(batch))]
                cases += [("trisparse_build", ours_with_build(batch))]
                cases += [("trisparse_edge", edge(pattern))]
                cases += [("trisparse_edge_build", edge_with_build(batch))]
                if a.dropout > 0:
                    cases += [("trisparse_segment_dropout", segment(batch, a.dropout))]
                    cases += [("pyg_padded_dropout", padded(batch, a.dropout))]
                try:
                    start.record()
                    attend = flex(batch, compiled)
                    stop.record()
                    stop.synchronize()
                    rec["flex_mask_ms"] = start.elapsed_time(stop)
                    cases.append(("flex", attend))
                    cases.append(("flex_build", lambda *t: flex(batch, compiled)(*t)))
                except Exception as e:  # noqa: BLE001 - reported in the row, then the others
                    rec["flex"] = {"error": str(e).splitlines()[0][:200]}
                time_cases(rec, cases, (q, k, v, dout), want, a.repeat)
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
