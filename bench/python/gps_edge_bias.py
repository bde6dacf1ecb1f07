#!/usr/bin/env python3
"""GPS's global attention with the local edges as a learned score bias (GPSConv(edge_bias=True),
Graphormer's edge encoding for adjacent nodes), forward + backward in bf16: each graph of a
mini-batch attends within itself, a pair joined by an edge adding that edge's per-head score
(a leaf [E, H], learned: its gradient is part of the step). The same q, k, v [N, H, D] and scores:

- trisparse_build: as GPSConv pays it, inside every step: ``Pattern.from_batch(batch)``, the
  edges' entries (``Pattern.entries_of``), the bias [nnz, H] summed from the scores, then
  ``sparse_attention(..., bias=)`` (the fused 3S kernels with the bias on the tensor cores);
  trisparse: the pattern, its plan and the entries made once (the kernels' and the bias's cost);
- trisparse_edge_build: GPSConv's path on CUDA, the same with ``edge_attention(..., bias=)``
  (the multigraph kernels, the pattern grouped on the GPU) in place of sparse_attention;
  trisparse_edge: its pattern and grouping made once;
- trisparse_segments: the scores summed into a pair bias [N, H, n_max] inside every step (no
  pattern), then ``segment_attention(..., bias=)`` (the segment kernels add it to the scores;
  their dq pass writes its gradient): GPSConv's path for 16-bit heads before the edge lists;
- trisparse_edges: GPSConv's path for 16-bit heads, ``segment_attention(..., edge_index=,
  edge_bias=)``: the edges' two sorted lists made in the step, the kernels reading each row's
  edges through them (nothing [N, H, n_max]; each edge's gradient written by the dq pass);
- pyg_padded: PyG's GPSConv path with the bias as ``nn.MultiheadAttention`` takes one:
  ``to_dense_batch`` to [B, n_max, H, D], the edges' scores scattered into a dense float mask
  [B, H, n_max, n_max] (-inf at padded keys) and scaled_dot_product_attention;
- flex: FlexAttention (compiled) over [1, H, N, D] with the document mask and a ``score_mod``
  adding the bias read from [B, H, n_max, n_max] (built per step from the scores, as its
  gradient needs); the block mask made once per batch (``flex_mask_ms``), flex_build: inside.

    python3 bench/python/gps_edge_bias.py data/tu_nci1.el.xz data/tu_nci1.graph_ptr.xz \
        --graphs 0 128 1024 --heads-dims 4x16 4x64 > gps_edge_bias.jsonl

Times: CUDA-event medians of --repeat steps after warm-ups. Error: max |x - ref| / max |ref|
over out and the gradients of q, k, v and the scores against float32 dense attention per graph.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import trisparse
import trisparse.datasets
from torch_geometric.utils import to_dense_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gps_attention import inputs, read_ptr, time_cases


def dense_bias(scores, edge_index, batch, start, n_max):
    """[B, H, n_max, n_max]: each graph's edges' scores summed at (target, source)."""
    heads = scores.shape[1]
    graph = batch[edge_index[1]]
    dst, src = edge_index[1] - start[graph], edge_index[0] - start[graph]
    flat = ((graph * heads)[:, None] + torch.arange(heads, device=scores.device)) * n_max
    flat = (flat + dst[:, None]) * n_max + src[:, None]
    count = int(start.numel()) * heads * n_max * n_max
    out = scores.new_zeros(count).index_put((flat.reshape(-1),), scores.reshape(-1), True)
    return out.view(-1, heads, n_max, n_max)


def _three_s(q, k, v, pattern, bias):
    return trisparse.sparse_attention(q, k, v, pattern, bias=bias)


def _multigraph(q, k, v, pattern, bias):
    return trisparse.edge_attention(q, k, v, pattern, q.shape[-1] ** -0.5, bias=bias)[0]


def biased(op, pattern, entries):
    """op (_three_s or _multigraph) with the scores summed into a bias [nnz, H] at the entries."""

    def attend(q, k, v, scores):
        bias = scores.new_zeros(pattern.nnz, scores.shape[1])
        return op(q, k, v, pattern, bias.index_put((entries,), scores, accumulate=True))

    return attend


def biased_with_build(op, batch, edge_index):
    def attend(q, k, v, scores):
        pattern = trisparse.Pattern.from_batch(batch)
        return biased(op, pattern, pattern.entries_of(edge_index))(q, k, v, scores)

    return attend


def segments(batch, edge_index, n_max):
    """segment_attention with the scores summed into a pair bias [N, H, n_max] in the step."""

    def attend(q, k, v, scores):
        n, heads = q.shape[0], q.shape[1]
        first = torch.searchsorted(batch, batch)
        src, dst = edge_index[0], edge_index[1]
        place = (dst * heads)[:, None] * n_max + (src - first[dst])[:, None]
        place = place + torch.arange(heads, device=q.device) * n_max
        flat = scores.new_zeros(n * heads * n_max)
        bias = flat.index_put((place.flatten(),), scores.flatten(), accumulate=True)
        return trisparse.segment_attention(
            q, k, v, batch, assume_sorted=True, bias=bias.view(n, heads, n_max)
        )

    return attend


def edges(batch, edge_index):
    """segment_attention with the edges' bias (their lists made in the step)."""

    def attend(q, k, v, scores):
        return trisparse.segment_attention(
            q, k, v, batch, assume_sorted=True, edge_index=edge_index, edge_bias=scores
        )

    return attend


def padded(batch, edge_index, start, n_max):
    def attend(q, k, v, scores):
        n, h, d = q.shape
        dense = [
            to_dense_batch(t.reshape(n, h * d), batch, max_num_nodes=n_max)[0] for t in (q, k, v)
        ]
        real = to_dense_batch(q[:, 0, 0], batch, max_num_nodes=n_max)[1]  # [B, n_max]
        qd, kd, vd = (t.view(t.shape[0], n_max, h, d).transpose(1, 2) for t in dense)
        mask = dense_bias(scores, edge_index, batch, start, n_max)
        mask = mask.masked_fill(~real[:, None, None, :], -torch.inf).to(q.dtype)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
        return o.transpose(1, 2)[real]

    return attend


def flex(batch, edge_index, start, n_max, compiled):
    from torch.nn.attention.flex_attention import create_block_mask

    n = batch.numel()
    pad = (-n) % 128
    doc = torch.cat([batch, batch.new_full((pad,), -1)])
    local = torch.cat([torch.arange(n, device=batch.device) - start[batch], doc.new_zeros(pad)])

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = create_block_mask(
        document, None, None, n + pad, n + pad, device=batch.device, _compile=True
    )

    def attend(q, k, v, scores):
        table = dense_bias(scores, edge_index, batch, start, n_max)

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + table[doc[q_idx].clamp(min=0), h, local[q_idx], local[kv_idx]]

        qf, kf, vf = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for t in (q, k, v))
        out = compiled(qf, kf, vf, score_mod=add_bias, block_mask=mask)
        return out[0].transpose(0, 1)[:n]

    return attend


def reference(q, k, v, scores, edge_index, batch, ptr, dout):
    """float32 dense attention per graph with the bias, and the gradients."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, scores)]
    n_max = int(ptr.diff().max())
    table = dense_bias(leaves[3], edge_index, batch, ptr[:-1], n_max)
    outs = []
    for g in range(ptr.numel() - 1):
        a, b = int(ptr[g]), int(ptr[g + 1])
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in leaves[:3])
        bias = table[g, :, : b - a, : b - a]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.float())
    return [out.detach(), *(t.grad for t in leaves)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graph", help="the union graph's edge list (tu_nci1.el.xz)")
    ap.add_argument("ptr", help="its graphs' node offsets (tu_nci1.graph_ptr.xz)")
    ap.add_argument("--graphs", type=int, nargs="+", default=[0, 128, 1024])
    ap.add_argument("--heads-dims", nargs="+", default=["4x16", "4x64"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--cases", nargs="+", help="only these columns (e.g. trisparse_edges)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    full_ei, _ = trisparse.datasets.read_graph(a.graph)
    full = read_ptr(a.ptr)
    for graphs in a.graphs:
        ptr = full if graphs == 0 or graphs >= full.numel() - 1 else full[: graphs + 1]
        n = int(ptr[-1])
        ei = full_ei[:, (full_ei < n).all(0)].to(dev)
        sizes = ptr.diff()
        batch = torch.repeat_interleave(torch.arange(sizes.numel()), sizes).to(dev)
        start, n_max = ptr[:-1].to(dev), int(sizes.max())
        for hd in a.heads_dims:
            heads, dim = (int(v) for v in hd.split("x"))
            g, (q, k, v, dout) = inputs(n, heads, dim, dev)
            scores = torch.randn(ei.shape[1], heads, generator=g, device=dev)
            rec = {"set": "tu_nci1", "graphs": sizes.numel(), "nodes": n, "edges": ei.shape[1]}
            rec.update(max_nodes=n_max, heads=heads, dim=dim, pairs=int((sizes * sizes).sum()))
            rec.update(dtype="bf16", device=torch.cuda.get_device_name(), torch=torch.__version__)
            want = reference(q, k, v, scores, ei, batch, ptr.to(dev), dout)
            pattern = trisparse.Pattern.from_batch(batch)
            pattern.plan(dev, gradients=True)
            entries = pattern.entries_of(ei)
            pattern.edge_attention_plan(dev)
            cases = [("trisparse", biased(_three_s, pattern, entries))]
            cases += [("trisparse_build", biased_with_build(_three_s, batch, ei))]
            cases += [("trisparse_edge", biased(_multigraph, pattern, entries))]
            cases += [("trisparse_edge_build", biased_with_build(_multigraph, batch, ei))]
            cases += [("trisparse_segments", segments(batch, ei, n_max))]
            cases += [("trisparse_edges", edges(batch, ei))]
            cases += [("pyg_padded", padded(batch, ei, start, n_max))]
            if a.cases:
                cases = [c for c in cases if c[0] in a.cases]
            try:
                if a.cases and "flex" not in a.cases:
                    raise RuntimeError("not asked for (--cases)")
                begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
                begin.record()
                attend = flex(batch, ei, start, n_max, compiled)
                end.record()
                end.synchronize()
                rec["flex_mask_ms"] = begin.elapsed_time(end)
                cases.append(("flex", attend))
                cases.append(("flex_build", lambda *t: flex(batch, ei, start, n_max, compiled)(*t)))
            except Exception as e:  # noqa: BLE001 - reported in the row, then the others
                rec["flex"] = {"error": str(e).splitlines()[0][:200]}
            time_cases(rec, cases, (q, k, v, dout, scores), want, a.repeat)
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
