"""ogbn-papers100M's shape on one GPU: a power-law graph of 111M nodes and 1.6B edges generated on
the device as a canonical CSR, graph attention forward and backward over it (--heads x --dim,
default 1 x 64, bf16, the multigraph kernels: 64-bit positions and offsets; the backward where
it fits), and the attention forward over its symmetrised form A + A^T (Pattern.undirected, made
on the device: 3.2B entries, past 2^31, as PyG loads papers100M), then a GCN layer's training
step over it (trisparse.nn.GCNConv given the Pattern: neighbour sums, no per-edge values). Times (CUDA events, median of
--repeat), peak memory, build times; outputs, lse and gradients checked against float64 on sampled
rows and columns. One JSON line per stage on stdout.

Generator (deterministic from --seed): row i's in-degree d_i from a Pareto law (shape --alpha)
scaled to the edge count, capped at --max-degree; its sources y_k = N ((k + u_k) / d_i)^2 for
k < d_i (one uniform u_k in each of d_i strata, squared so that low ids are hubs), floored and
deduplicated, so columns come ascending and unique: Pattern.from_sorted_csr takes them in place.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import trisparse
from block_sparse import time_ms

PAPERS_NODES, PAPERS_EDGES = 111_059_956, 1_615_685_872


def degrees(n: int, edges: int, alpha: float, cap: int, g: torch.Generator, device) -> torch.Tensor:
    """In-degrees (int64 [n]) summing to `edges`, Pareto(alpha) shaped, each at most `cap`."""
    w = torch.rand(n, generator=g, device=device, dtype=torch.float64).clamp_min_(1e-12)
    w = w.pow_(-1.0 / alpha)
    d = torch.floor(w * (edges / float(w.sum()))).clamp_(max=cap).to(torch.int64)
    del w
    short = edges - int(d.sum())
    while short > 0:  # one more edge for rows below the cap, in a random order
        room = torch.nonzero(d < cap).flatten()
        pick = room[torch.randperm(room.numel(), generator=g, device=device)[:short]]
        d[pick] += 1
        short = edges - int(d.sum())
    return d


def generate(n: int, edges: int, alpha: float, cap: int, seed: int, device, chunk: int):
    """(rowptr int64 [n + 1], col int32 [nnz]): ascending unique sources per row."""
    g = torch.Generator(device=device).manual_seed(seed)
    deg = degrees(n, edges, alpha, cap, g, device)
    bound = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(deg, 0, out=bound[1:])
    col = torch.empty(edges, dtype=torch.int32, device=device)
    kept = torch.zeros(n, dtype=torch.int64, device=device)
    written, r0 = 0, 0
    while r0 < n:  # rows in chunks of about `chunk` entries
        r1 = int(torch.searchsorted(bound, bound[r0] + chunk, right=True)) - 1
        r1 = min(max(r1, r0 + 1), n)
        lo, hi = int(bound[r0]), int(bound[r1])
        d = deg[r0:r1]
        row = torch.repeat_interleave(torch.arange(r1 - r0, device=device), d, output_size=hi - lo)
        k = torch.arange(lo, hi, device=device) - bound[r0:r1][row]
        u = torch.rand(hi - lo, generator=g, device=device, dtype=torch.float64)
        y = ((k + u) / d[row]).square_().mul_(n).floor_().to(torch.int32)
        del k, u
        first = torch.ones_like(y, dtype=torch.bool)
        first[1:] = (y[1:] != y[:-1]) | (row[1:] != row[:-1])
        y = y[first]
        kept[r0:r1] = torch.bincount(row[first], minlength=r1 - r0)
        col[written : written + y.numel()] = y
        written += y.numel()
        del row, y, first
        r0 = r1
    rowptr = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(kept, 0, out=rowptr[1:])
    return rowptr, col[:written]


def wall(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    got = fn()
    torch.cuda.synchronize()
    return got, 1e3 * (time.perf_counter() - t)


def gib(nbytes: int) -> float:
    return nbytes / 2**30


def reference_rows(rowptr, col, x, scale, rows):
    """float64 (out [R, H, D], lse [R, H]) of `rows` over their sources (q = k = v = x)."""
    outs, lses = [], []
    for i in rows.tolist():
        src = col[int(rowptr[i]) : int(rowptr[i + 1])].long()
        xi, xs = x[i].double(), x[src].double()
        s = scale * torch.einsum("jhd,hd->jh", xs, xi)
        lses.append(torch.logsumexp(s, 0))  # (-inf for an empty row)
        outs.append(torch.einsum("jh,jhd->hd", torch.softmax(s, 0), xs))
    return torch.stack(outs).nan_to_num_(0.0), torch.stack(lses)


def check_forward(rowptr, col, x, out, lse, scale, rows):
    want, want_lse = reference_rows(rowptr, col, x, scale, rows)
    got = out[rows].double()
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    lse_err = float((lse[rows].double() - want_lse).abs().max())
    return err, lse_err


def check_backward(rowptr, col, x, out, grads, scale, rows, cols):
    """Relative errors of dq on `rows` and dk, dv on `cols` against float64, dout = out (the
    gradient of |out|^2 / 2), recomputing every row that reads a checked column."""
    dq, dk, dv = grads

    def xd(ids):  # rows of x, and of dout = out, in float64 (gathered: never all N)
        return x[ids].double()

    def dout(ids):
        return out[ids].double()

    def row_terms(i):
        src = col[int(rowptr[i]) : int(rowptr[i + 1])].long()
        xs, xi, di = xd(src), xd(i), dout(i)
        p = torch.softmax(scale * torch.einsum("jhd,hd->jh", xs, xi), 0)
        o = torch.einsum("jh,jhd->hd", p, xs)
        ds = p * (torch.einsum("jhd,hd->jh", xs, di) - (di * o).sum(-1))
        return src, xs, p, ds

    want_q = []
    for i in rows.tolist():
        _src, xs, _p, ds = row_terms(i)
        want_q.append(scale * torch.einsum("jh,jhd->hd", ds, xs))
    want_q = torch.stack(want_q)
    q_err = float((dq[rows].double() - want_q).abs().max() / want_q.abs().max())
    want_k = torch.zeros(len(cols), *x.shape[1:], dtype=torch.float64, device=x.device)
    want_v = torch.zeros_like(want_k)
    for c, j in enumerate(cols.tolist()):
        where = torch.nonzero(col == j).flatten()
        readers = torch.searchsorted(rowptr, where, right=True) - 1
        for i in readers.tolist():
            src, _xs, p, ds = row_terms(i)
            at = src == j
            want_k[c] += scale * ds[at].sum(0)[:, None] * xd(i)
            want_v[c] += p[at].sum(0)[:, None] * dout(i)
    k_err = float((dk[cols].double() - want_k).abs().max() / want_k.abs().max())
    v_err = float((dv[cols].double() - want_v).abs().max() / want_v.abs().max())
    return q_err, k_err, v_err


def sample_rows(rowptr, n, count, g, device):
    """Random rows and the longest one."""
    rows = torch.randint(0, n, (count,), generator=g, device=device)
    return torch.cat([rows, rowptr.diff().argmax().view(1)])


def sample_cols(col, n, count, g, device, max_readers):
    """Random columns read by 1 to `max_readers` rows."""
    cols = []
    for j in torch.randint(0, n, (count * 8,), generator=g, device=device).tolist():
        if 0 < int((col == j).sum()) <= max_readers:
            cols.append(j)
        if len(cols) == count:
            break
    return torch.tensor(cols, device=device, dtype=torch.int64)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def attention_stage(args, graph, pattern, rowptr, col, x, scale, dev, g):
    """2. Forward and backward, q = k = v = x, dout = out (the ops, as the autograd calls them);
    the backward where its gradients (3 x's) and [E, H] workspace (8 bytes each) fit."""
    ops = torch.ops.trisparse
    torch.cuda.reset_peak_memory_stats(dev)

    def forward():
        return ops.edge_attention(x, x, x, None, None, None, pattern.id, scale, 0.0, None)

    out, _edge, lse = forward()
    fwd_ms = time_ms(forward, args.repeat)
    empty_edge = torch.empty(args.nodes, args.heads, 0, device=dev)
    need = 3 * x.numel() * x.element_size() + 8 * pattern.nnz * args.heads
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    fits = need < torch.cuda.mem_get_info(dev)[0] + cached - 2**30

    def backward():
        return ops.edge_attention_backward(
            x, x, x, None, None, None, out, empty_edge, lse, out, empty_edge,
            pattern.id, scale, 0.0, None,
        )  # fmt: skip

    rows = sample_rows(rowptr, args.nodes, args.check_rows, g, dev)
    f_err, lse_err = check_forward(rowptr, col, x, out, lse, scale, rows)
    record = {
        **graph, "stage": "attention forward + backward", "forward_ms": fwd_ms,
        "rows_checked": rows.numel(), "out_rel_err": f_err, "lse_abs_err": lse_err,
    }  # fmt: skip
    grads = None
    if fits:
        bwd_ms = time_ms(backward, args.repeat)  # (the timed calls' results are dropped at once)
        grads = backward()[:3]
        cols = sample_cols(col, args.nodes, args.check_rows, g, dev, 64)
        q_err, k_err, v_err = check_backward(rowptr, col, x, out, grads, scale, rows, cols)
        record.update(
            backward_ms=bwd_ms, cols_checked=cols.numel(), dq_rel_err=q_err, dk_rel_err=k_err,
            dv_rel_err=v_err,
        )  # fmt: skip
    else:
        record["backward"] = (
            f"not run: its gradients and workspace need {gib(need):.1f} GiB, more than is free"
        )
    record["peak_gib"] = gib(torch.cuda.max_memory_allocated(dev))
    emit(record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=PAPERS_NODES)
    ap.add_argument("--edges", type=int, default=PAPERS_EDGES)
    ap.add_argument(
        "--wide",
        choices=["symmetrised", "generated", "none"],
        default="symmetrised",
        help="the 3.2B-entry stage: A + A^T of the graph, the generator at twice the edges, or none",
    )
    ap.add_argument(
        "--no-gcn", dest="gcn", action="store_false", help="skip the GCN layer over A + A^T"
    )
    ap.add_argument(
        "--skip-attention", action="store_true", help="only the graphs and the GCN layer"
    )
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64, help="channels per head")
    ap.add_argument("--alpha", type=float, default=1.5, help="Pareto shape of the in-degrees")
    ap.add_argument("--max-degree", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=1 << 27, help="entries generated at a time")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    base = {
        "device": name,
        "torch": torch.__version__,
        "nodes": args.nodes,
        "heads": args.heads,
        "dim": args.dim,
        "dtype": "bf16",
    }
    scale = args.dim**-0.5
    g = torch.Generator(device=dev).manual_seed(args.seed + 1)

    # 1. The graph, its pattern and the multigraph plan with its backward side.
    torch.cuda.reset_peak_memory_stats(dev)
    (rowptr, col), gen_ms = wall(
        lambda: generate(
            args.nodes, args.edges, args.alpha, args.max_degree, args.seed, dev, args.chunk
        )
    )
    pattern, check_ms = wall(lambda: trisparse.Pattern.from_sorted_csr(rowptr, col, args.nodes))
    _plan, build_ms = (
        (None, 0.0) if args.skip_attention else wall(lambda: pattern.edge_attention_plan(dev))
    )
    torch.cuda.empty_cache()
    deg = rowptr.diff()
    graph = {
        **base,
        "edges": pattern.nnz,
        "max_in_degree": int(deg.max()),
        "max_out_degree": int(torch.bincount(col).max()),
        "empty_rows": int((deg == 0).sum()),
        "generate_ms": gen_ms,
        "check_ms": check_ms,
        "plan_build_ms": build_ms,
        "build_peak_gib": gib(torch.cuda.max_memory_allocated(dev)),
        "after_build_gib": gib(torch.cuda.memory_allocated(dev)),
    }
    print(f"graph: {graph}", file=sys.stderr, flush=True)

    # 2. The attention's forward and backward (attention_stage).
    shape = (args.nodes, args.heads, args.dim)
    x = torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)
    ops = torch.ops.trisparse
    if not args.skip_attention:
        attention_stage(args, graph, pattern, rowptr, col, x, scale, dev, g)
    del _plan, pattern, deg
    torch.cuda.empty_cache()

    # 3. The forward over its symmetrised form A + A^T (as PyG loads papers100M: 3.2B entries,
    # past 2^31), made on the device by Pattern.undirected; its forward-only plan reads the CSR
    # in place. (--wide generated: the generator at twice the edges instead.)
    if args.wide == "none":
        return
    torch.cuda.reset_peak_memory_stats(dev)
    if args.wide == "symmetrised":
        directed = trisparse.Pattern.from_sorted_csr(rowptr, col, args.nodes, check=False)
        pattern, make_ms = wall(directed.undirected)
        del directed, rowptr, col
        rowptr, col = pattern.rowptr, pattern.col
        check_ms = wall(lambda: trisparse.Pattern.from_sorted_csr(rowptr, col, args.nodes))[1]
    else:
        del rowptr, col
        (rowptr, col), make_ms = wall(
            lambda: generate(
                args.nodes, 2 * args.edges, args.alpha, args.max_degree, args.seed + 7, dev,
                args.chunk,
            )
        )  # fmt: skip
        pattern, check_ms = wall(lambda: trisparse.Pattern.from_sorted_csr(rowptr, col, args.nodes))
    torch.cuda.empty_cache()
    make_peak = gib(torch.cuda.max_memory_allocated(dev))
    if args.skip_attention:
        return gcn_stage(args, base, pattern, rowptr, col, x.view(args.nodes, -1), dev, g)
    _plan, build_ms = wall(lambda: pattern.edge_attention_plan(dev, backward=False))

    def wide():
        return ops.edge_attention(x, x, x, None, None, None, pattern.id, scale, 0.0, None)

    out, _edge, lse = wide()
    ms = time_ms(wide, args.repeat)
    rows = sample_rows(rowptr, args.nodes, args.check_rows, g, dev)
    f_err, lse_err = check_forward(rowptr, col, x, out, lse, scale, rows)
    emit({
        **base, "stage": "attention forward, entries past 2^31", "graph": args.wide,
        "edges": pattern.nnz, "make_ms": make_ms, "make_peak_gib": make_peak, "check_ms": check_ms,
        "plan_build_ms": build_ms, "forward_ms": ms,
        "peak_gib": gib(torch.cuda.max_memory_allocated(dev)), "rows_checked": rows.numel(),
        "out_rel_err": f_err, "lse_abs_err": lse_err,
    })  # fmt: skip
    del out, lse, _edge
    if args.wide == "symmetrised" and args.gcn:
        gcn_stage(args, base, pattern, rowptr, col, x.view(args.nodes, -1), dev, g)


def gcn_stage(args, base, pattern, rowptr, col, x, dev, g):
    """4. A GCN layer's training step over the symmetrised graph: trisparse.nn.GCNConv (C -> C,
    bf16) given the Pattern (its neighbour sums, no per-edge values); forward + backward of the
    weights, timed; out checked against float64 on sampled rows (from the layer's own bf16
    x W and degrees)."""
    import trisparse.nn

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    layer = trisparse.nn.GCNConv(x.shape[1], x.shape[1]).to(dev, torch.bfloat16)
    _, counts_ms = wall(lambda: pattern.pair_counts(dev))
    up = torch.randn(args.nodes, x.shape[1], generator=g, device=dev, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            return layer(x, pattern)

    def step():
        out = layer(x, pattern)
        out.backward(up)
        layer.zero_grad(set_to_none=True)

    out = forward()
    fwd_ms = time_ms(forward, args.repeat)
    step_ms = time_ms(step, args.repeat)
    peak = gib(torch.cuda.max_memory_allocated(dev))
    # float64 reference on sampled rows: out_i = d_i^-1/2 (sum_j d_j^-1/2 h_j + [no loop] d_i^-1/2
    # h_i) + b, with h = x W as the layer rounds it (bf16) and its bf16 degrees' d^-1/2.
    in_deg, _out_deg, loops = pattern.pair_counts(dev)
    deg = in_deg - loops + 1
    dinv = deg.to(torch.bfloat16).pow(-0.5).double()
    w, b = layer.lin.weight, layer.bias.double()
    rows = sample_rows(rowptr, args.nodes, args.check_rows, g, dev)
    errs = []
    with torch.no_grad():
        for i in rows.tolist():
            src = col[int(rowptr[i]) : int(rowptr[i + 1])].long()
            h_src = (x[src] @ w.t()).double()
            h_i = (x[i : i + 1] @ w.t()).double()[0]
            s = (dinv[src, None] * h_src).sum(0) + (1 - int(loops[i])) * dinv[i] * h_i
            want = dinv[i] * s + b
            errs.append(float((out[i].double() - want).abs().max() / want.abs().max()))
    emit({
        **base, "stage": "GCN layer, entries past 2^31", "edges": pattern.nnz,
        "channels": x.shape[1], "pair_counts_ms": counts_ms, "forward_ms": fwd_ms,
        "forward_backward_ms": step_ms, "peak_gib": peak, "rows_checked": rows.numel(),
        "out_rel_err": max(errs),
    })  # fmt: skip


if __name__ == "__main__":
    main()
