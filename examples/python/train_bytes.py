#!/usr/bin/env python3
"""The learned-pattern plan's evaluation (b): a byte-level causal transformer on real text every
machine has (the Python standard library's sources), dense attention against learned block
patterns.

    python3 examples/python/train_bytes.py --mode errors     # the error table (JSON lines)
    python3 examples/python/train_bytes.py --mode train      # bits per byte (JSON lines)

--mode errors trains the model with dense causal attention, then takes each layer's q, k, v on a
held-out sequence and, for each pattern and block sparsity, the relative L2 error of the attention
output against dense (trisparse.attention_error, causal), averaged over heads and layers. Patterns
at sparsity s keep, in each block row, the diagonal block and the best (1 - s) of the row's causal
blocks by: random scores; pooled q . k (topk: the routing rule of trisparse.topk_block_mask,
pooled_block_mass); the exact attention mass summed over --learn-samples training sequences
(learned: offline, then applied to the held-out sequence); a trisparse.BlockGate per layer trained
by distillation on the same samples (gate: --gate-steps Adam steps against their block mass, the
rate along --gate-schedule, its loss the cross-entropy plus --gate-rank-weight times
BlockGate.rank_loss, then applied to the held-out sequence's own pooled q and k;
gate_p<S>x<T>: the same with --gate-probes S x T, each block pooled as S query and T key
probes, a gate a rank weight: gate_p<S>x<T>_r<W> for each weight past the first); the held-out
sequence's own blocks for the output (output: trisparse.prune_blocks_by_output on its masses and
value sums, per sample as the oracle); the held-out sequence's own mass (oracle: how sparse its
attention really is; oracle_mass_kept is the mass its blocks hold). local_strided is a band of
blocks and every stride-th block below the diagonal, as close to (1 - s) of the causal blocks as
its parameters come.

--save-model PREFIX keeps the trained weights (bf16, files of at most 15 MiB) and --load-model PREFIX
takes them instead of training: the error table again, on another machine, without the training
(the text is that machine's standard library: another Python version's sources differ).

--mode train trains the same model with dense attention and with a trisparse.PatternLearner per
layer at each --sparsity (dense for --learner-warmup steps, then block-sparse under the pattern
learned from the kernels' block importance) and reports the held-out bits per byte of each;
--learner gate: a trisparse.GateLearner per layer instead (each input's own blocks, the gate
distilled every --learner-every steps for --gate-fit-steps Adam steps while the model trains).
On CUDA each row has step_ms, the median training step past the warm-up. --cuda-graph: the
steps past the warm-up are replays of one CUDA graph (the learners capturable: tracked every
--track-every steps and re-pruned inside the graph, the kernels told by flags on the device
whether their work is due); --mode cost --cuda-graph compares the
trained model's graph against a graph of the same step under the learned masks without the
learners (importance, fold and prune left out), replayed in alternating rounds; --mode errors
--cuda-graph trains its dense model so (about half the eager step's time at 8K tokens).

--mode cost (CUDA) times the importance tracking inside training: one model with a PatternLearner
per layer, the kernels measuring the mass at every step (every --cost-track-every steps) for
--cost-period steps and at none for as many, alternating; the two kinds of step's medians and
means, and the cost between them. Where the step is host-bound (8K tokens) that wall-clock cost
is mostly the host's noise: kernel_cost is the GPU's (every kernel's time, profiled over
--cost-profile-steps steps tracked at every step and as many untracked, after the training).
"""

import argparse
import functools
import json
import math
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import trisparse
from torch import nn


def corpus() -> tuple[torch.Tensor, int]:
    """The standard library's .py files (sorted by path) as one byte tensor, and the file count."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    data = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), len(files)


class Attention(nn.Module):
    def __init__(self, channels, heads, learner=None):
        super().__init__()
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)
        self.heads, self.learner, self.saved = heads, learner, None
        self.fixed_mask = None  # a BlockMask: attention under it, the learner left out

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        self.saved = (q.detach(), k.detach(), v.detach())  # [B, H, N, D] each
        if self.fixed_mask is not None:
            y = trisparse.block_sparse_attention(q, k, v, self.fixed_mask)
        elif self.learner is not None:
            y = self.learner(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, channels, heads, learner=None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.attn = Attention(channels, heads, learner)
        self.mlp = nn.Sequential(
            nn.Linear(channels, 4 * channels), nn.GELU(), nn.Linear(4 * channels, channels)
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteModel(nn.Module):
    def __init__(self, channels, heads, layers, seq, learners=None):
        super().__init__()
        self.embed = nn.Embedding(256, channels)
        self.pos = nn.Parameter(torch.zeros(seq, channels))
        learners = learners or [None] * layers
        self.blocks = nn.ModuleList(Block(channels, heads, ln) for ln in learners)
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, 256)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sequences(data, starts, seq):
    """Rows data[s : s + seq + 1] for each start: inputs and next-byte targets."""
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    rows = data[idx]
    return rows[:, :-1], rows[:, 1:]


def held_out_starts(args, data, split):
    """The --eval-sequences held-out sequences' starts, spread over the text past `split`."""
    return torch.linspace(split, data.numel() - args.seq - 2, args.eval_sequences).long()


def bits_per_byte(model, data, seq, starts, device, amp):
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), amp:
        for s in starts:
            x, y = sequences(data, s[None], seq)
            logits = model(x.to(device)).float()
            total += float(
                F.cross_entropy(logits.view(-1, 256), y.to(device).reshape(-1), reduction="sum")
            )
            count += y.numel()
    model.train()
    return total / count / math.log(2)


def graph_start(args, learners):
    """--cuda-graph: the first captured step (the learners' dense warm-up and two block-sparse
    steps eager before it, then three more on a side stream: the capture's own warm-up)."""
    return (args.learner_warmup + 2 if learners else 0) + 3


def train(args, data, split, learners=None, before_step=None, after=None):
    """Trains a model (dense attention, or the given learners per layer; `before_step(i)` called
    before step i; `after(model, step, capture, replaying)` once the steps are done, with a
    function that takes one more training step at the final learning rate and, with --cuda-graph,
    one that captures a step as the model is now and one that makes a graph's step, or with None
    an eager step); returns it, the held-out bits per byte and, on CUDA, each step's time (ms,
    CUDA events around it; None on the CPU). --cuda-graph: from graph_start() on, each step is a
    replay of one CUDA graph holding the forward, backward, clipping and the optimizer's step
    (capturable AdamW with a tensor learning rate, which the schedule sets between replays; the
    momentum is not cycled: floats the graph holds)."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = ByteModel(args.channels, args.heads, args.layers, args.seq, learners).to(device)
    graphed = args.cuda_graph
    lr = torch.tensor(args.lr, device=device) if graphed else args.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, capturable=graphed)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, args.lr, total_steps=args.steps, pct_start=0.1, cycle_momentum=not graphed
    )
    # (a capture must not keep autocast's cast weights across steps)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16, cache_enabled=not graphed)
    gen = torch.Generator().manual_seed(args.seed)
    timed = device.type == "cuda"
    events = []
    static = [torch.zeros(args.batch, args.seq, dtype=torch.long, device=device) for _ in "xy"]
    graph = None

    def compute(x, y):
        with amp:
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def one_step(scheduled=True, graph_of="current"):
        starts = torch.randint(0, split - args.seq - 1, (args.batch,), generator=gen)
        x, y = sequences(data, starts, args.seq)
        replayed = graph if graph_of == "current" else graph_of
        if replayed is None:
            compute(x.to(device), y.to(device))
        else:
            static[0].copy_(x)
            static[1].copy_(y)
            replayed.replay()
        if scheduled:
            sched.step()

    def capture():
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            compute(*static)
        return g

    start = graph_start(args, learners) if graphed else args.steps
    side = torch.cuda.Stream() if graphed else None
    for step in range(args.steps):
        if before_step is not None:
            before_step(step)
        if graphed and step == start:
            graph = capture()
        if timed:
            events.append(
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            )
            events[-1][0].record()
        if graphed and start - 3 <= step < start:  # the capture's warm-up, on a side stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                one_step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            one_step()
        if timed:
            events[-1][1].record()
    if after is not None:
        after(
            model,
            functools.partial(one_step, scheduled=False),
            capture if graphed else None,
            lambda g: functools.partial(one_step, scheduled=False, graph_of=g),
        )
    times = None
    if timed:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in events]
    bpb = bits_per_byte(model, data, args.seq, held_out_starts(args, data, split), device, amp)
    return model, bpb, times


def keep_per_row(score, sparsity):
    """Each causal block row's highest-scoring blocks ([H, qb, kb] bool): the diagonal, then up to
    (1 - sparsity) of the row's causal blocks (at least one)."""
    heads, nb, _ = score.shape
    allowed = torch.ones(nb, nb, dtype=torch.bool).tril()
    score = score.to(torch.float64).masked_fill(~allowed, float("-inf"))
    score = score.masked_fill(torch.eye(nb, dtype=torch.bool), float("inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    budget = torch.clamp(torch.round((1.0 - sparsity) * torch.arange(1, nb + 1)), min=1)
    kept_rank = torch.arange(nb)[None, :] < budget[:, None]
    keep = torch.zeros(heads, nb, nb, dtype=torch.bool)
    keep.scatter_(2, order, kept_rank.expand(heads, nb, nb))
    return keep & allowed


def local_strided(nb, keep):
    """Below the diagonal: a band plus every stride-th block, the parameters that come closest to
    `keep` of the causal blocks."""
    r, c = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    causal = c <= r
    best = None
    for window in range(nb):
        for stride in range(2, nb + 1):
            blocks = causal & (((r - c) <= window) | ((r - c) % stride == 0))
            gap = abs(float(blocks.sum() / causal.sum()) - keep)
            if best is None or gap < best[0]:
                best = (gap, blocks)
    return best[1]


def pattern_error(q, k, v, dense, g, blocks):
    """The mean over heads of the causal attention's relative L2 error under `blocks`."""
    heads, n = q.shape[0], q.shape[1]
    blocks = blocks.expand(heads, *blocks.shape[-2:]) if blocks.dim() == 2 else blocks
    p = trisparse.BlockPattern.from_blocks(blocks.contiguous(), g, n, n)
    return float(trisparse.attention_error(q, k, v, p, causal=True, dense=dense).mean())


def layer_qkv(model, tokens, device, amp):
    """Each layer's q, k, v ([H, N, D], first sequence) on `tokens` [B, N]."""
    model.eval()
    with torch.no_grad(), amp:
        model(tokens.to(device))
    return [tuple(t[0].float().cpu() for t in b.attn.saved) for b in model.blocks]


def save_model(model, prefix, shard_bytes=15 << 20):
    """The model's weights in bf16, in files `prefix`.<i>.pt of at most `shard_bytes` each (a
    device call brings back files of up to 16 MiB), tensors in state_dict order."""
    shards, size = [{}], 0
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.bfloat16 if t.is_floating_point() else t.dtype)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name], size = t, size + nbytes
    for i, shard in enumerate(shards):
        torch.save(shard, f"{prefix}.{i}.pt")


def load_model(args, prefix, device):
    """A ByteModel of the arguments' shape with save_model's weights (float32)."""
    model = ByteModel(args.channels, args.heads, args.layers, args.seq)
    state, i = {}, 0
    while Path(f"{prefix}.{i}.pt").exists():
        state.update(torch.load(f"{prefix}.{i}.pt", map_location="cpu"))
        i += 1
    if i == 0:
        raise SystemExit(f"--load-model: no file {prefix}.0.pt")
    model.load_state_dict({name: t.float() for name, t in state.items()})
    return model.to(device)


def error_table(args, data, split):
    start = time.perf_counter()
    device = torch.device(args.device)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16)
    if args.load_model:
        model = load_model(args, args.load_model, device)
        bpb = bits_per_byte(model, data, args.seq, held_out_starts(args, data, split), device, amp)
    else:
        model, bpb, _ = train(args, data, split)
        if args.save_model:
            save_model(model, args.save_model)
    trained_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(args.seed + 1)
    learn_starts = torch.randint(0, split - args.seq - 1, (args.learn_samples,), generator=gen)
    held = torch.tensor([split + (data.numel() - split - args.seq - 1) // 2])
    learn = [
        layer_qkv(model, sequences(data, s[None], args.seq)[0], device, amp) for s in learn_starts
    ]
    test = layer_qkv(model, sequences(data, held, args.seq)[0], device, amp)
    g, nb = args.block, -(-args.seq // args.block)
    print(
        json.dumps(
            {
                "bits_per_byte_dense": bpb,
                "trained_s": trained_s,
                "seq": args.seq,
                "block": g,
                "layers": args.layers,
                "heads": args.heads,
                "channels": args.channels,
                "steps": args.steps,
                "lr": args.lr,
                "seed": args.seed,
                "learn_samples": args.learn_samples,
                "gate_steps": args.gate_steps,
                "gate_probes": args.gate_probes,
                "gate_schedule": args.gate_schedule,
                "gate_rank_weight": args.gate_rank_weight,
                "device": args.device,
                "cuda_graph": args.cuda_graph,
                "loaded_from": args.load_model,
            }
        ),
        flush=True,
    )
    # Offline: the exact mass over the training samples' q and k, per layer.
    masses = [
        [trisparse.block_mass(x[layer][0], x[layer][1], g, True) for x in learn]
        for layer in range(args.layers)
    ]
    # A gate per layer and setting: "gate" the first distillation length, "gate_<steps>" the
    # others, "gate_p<S>x<T>" the first length with probes (S, T); with several rank weights the
    # probes' gates once a weight ("gate_p<S>x<T>_r<W>" past the first), the others the first.
    w0 = args.gate_rank_weight[0]
    settings = {"gate": (args.gate_steps[0], 1, w0)}
    settings.update({f"gate_{n}": (n, 1, w0) for n in args.gate_steps[1:]})
    for i, w in enumerate(args.gate_rank_weight):
        suffix = f"_r{w:g}" if i else ""
        settings.update(
            {f"gate_p{p[0]}x{p[1]}{suffix}": (args.gate_steps[0], p, w) for p in args.gate_probes}
        )
    methods = ("random", "local_strided", "topk", "learned", *settings, "output", "oracle")
    gates = {name: [] for name in settings}
    for layer in range(args.layers):
        q0 = learn[0][layer][0]
        samples = [
            (x[layer][0].to(device), x[layer][1].to(device), m.to(device))
            for x, m in zip(learn, masses[layer], strict=True)
        ]
        for name, (steps, probes, weight) in settings.items():
            gate = trisparse.BlockGate(q0.shape[0], q0.shape[2], g, causal=True, probes=probes)
            gate.to(device).fit(
                samples,
                steps=steps,
                schedule=args.gate_schedule,
                rank_weight=weight,
            )
            gates[name].append(gate)
    causal_blocks = torch.ones(nb, nb, dtype=torch.bool).tril()
    for s in args.sparsity:
        per = {m: [] for m in (*methods, "oracle_mass_kept", "density")}
        for layer, (q, k, v) in enumerate(test):
            heads = q.shape[0]
            dense = trisparse.dense_attention(q, k, v, causal=True)
            error = functools.partial(pattern_error, q, k, v, dense, g)

            rand = keep_per_row(torch.rand(heads, nb, nb, generator=gen), s)
            per["random"].append(error(rand))
            per["local_strided"].append(error(local_strided(nb, 1.0 - s)))
            per["topk"].append(error(keep_per_row(trisparse.pooled_block_mass(q, k, g, True), s)))
            per["learned"].append(error(keep_per_row(sum(masses[layer]), s)))
            for name, per_layer in gates.items():
                with torch.no_grad():
                    routed = per_layer[layer](q.to(device), k.to(device)).exp().cpu()
                per[name].append(error(keep_per_row(routed, s)))
            # Per sample, for the output: the blocks whose renormalised output comes nearest.
            stats = trisparse.block_value_mass(q, k, v, g, True)
            per["output"].append(error(trisparse.prune_blocks_by_output(*stats, s, causal=True)))
            true_mass = trisparse.block_mass(q, k, g, True)
            oracle = keep_per_row(true_mass, s)
            per["oracle"].append(error(oracle))
            per["oracle_mass_kept"].append(float((true_mass * oracle).sum(-1).mean()))
            per["density"].append(float(oracle.sum() / (heads * causal_blocks.sum())))
        row = {"sparsity": s, **{m: sum(x) / len(x) for m, x in per.items()}}
        print(json.dumps(row), flush=True)


def pattern_learners(args, sparsity):
    return [
        trisparse.PatternLearner(
            args.block,
            sparsity,
            every=args.learner_every,
            warmup=args.learner_warmup,
            causal=True,
            track_every=args.track_every,
            capturable=args.cuda_graph,
        )
        for _ in range(args.layers)
    ]


def graph_cost_row(args, data, split, s):
    """--mode cost --cuda-graph: the model trained with capturable learners (tracked every
    --track-every steps, re-pruned every --learner-every, in the graph), then the training
    graph's step against a
    graph of the same step under the learners' current masks without them (no importance, no
    fold, no prune), replayed in alternating rounds: the wall clock of replayed steps (no host
    time in them) and every kernel's time."""
    learners = pattern_learners(args, s)
    result = {}

    def after(model, step, capture, replaying, learners=learners):
        attentions = [m for m in model.modules() if isinstance(m, Attention)]
        for a, learner in zip(attentions, learners):
            a.fixed_mask = learner.mask()
        replaying(None)()  # the path's first run, eager (plans and autograd made)
        plain = replaying(capture())
        for a in attentions:
            a.fixed_mask = None
        steps = {True: step, False: plain}
        walls = {True: [], False: []}
        for _ in range(args.cost_rounds):
            for tracked in (True, False):
                walls[tracked].append(replay_ms(steps[tracked], args.cost_period))
        result["wall"] = {b: statistics.median(w) for b, w in walls.items()}
        result["kernels"] = {b: kernel_ms(steps[b], args.cost_profile_steps, True) for b in steps}

    _, bpb, times = train(args, data, split, learners, None, after)
    wall = result["wall"]
    (tracked, by_name), (untracked, without) = result["kernels"][True], result["kernels"][False]
    names = sorted(by_name, key=lambda n: without.get(n, 0.0) - by_name[n])[:8]
    kernels = {True: tracked, False: untracked}
    return {
        "mode": "cost",
        "cuda_graph": True,
        "sparsity": s,
        "tracked_ms": wall[True],
        "untracked_ms": wall[False],
        "cost": wall[True] / wall[False] - 1.0,
        "tracked_kernel_ms": kernels[True],
        "untracked_kernel_ms": kernels[False],
        "kernel_cost": kernels[True] / kernels[False] - 1.0,
        # where the difference goes: the kernels (names cut short) whose time grew most, ms a step
        "kernel_growth": {n[:90]: by_name[n] - without.get(n, 0.0) for n in names},
        "training_step_ms": statistics.median(times[graph_start(args, learners) + 1 :]),
        "rounds": args.cost_rounds,
        "steps_a_round": args.cost_period,
        "device_steps": learners[0].device_steps(),
        "track_every": args.track_every,
        "learner_every": args.learner_every,
        "bits_per_byte": bpb,
        **setting(args),
    }


def replay_ms(step, steps):
    """The mean time of `steps` back-to-back calls of `step` (ms, CUDA events around them)."""
    step()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def cost_table(args, data, split):
    """--mode cost (CUDA): one model trained with a PatternLearner per layer at each --sparsity,
    the kernels measuring the kept blocks' mass at every step for --cost-period steps, then at
    none for as many, alternating past the warm-up: the medians of the two kinds of step in one
    process (the same model, pattern and GPU state) and the tracking's cost between them."""
    for s in args.sparsity:
        if args.cuda_graph:
            print(json.dumps(graph_cost_row(args, data, split, s)), flush=True)
            continue
        learners = pattern_learners(args, s)

        def before_step(step, learners=learners):
            tracked = step < args.learner_warmup or (step // args.cost_period) % 2 == 0
            for learner in learners:
                learner.track_every = args.cost_track_every if tracked else args.steps + 1

        kernels = {}

        def after(_model, step, _capture, _replaying, learners=learners, kernels=kernels):
            for tracked in (True, False):
                for learner in learners:
                    learner.track_every = 1 if tracked else args.steps + 1
                kernels[tracked] = kernel_ms(step, args.cost_profile_steps)

        _, bpb, times = train(args, data, split, learners, before_step, after)
        first = args.learner_warmup + 2  # the first sparse steps build the pattern
        split_times = {True: [], False: []}
        for step in range(first, args.steps):
            split_times[(step // args.cost_period) % 2 == 0].append(times[step])
        tracked, untracked = (statistics.median(split_times[b]) for b in (True, False))
        means = [statistics.fmean(split_times[b]) for b in (True, False)]
        row = {
            "mode": "cost",
            "sparsity": s,
            "tracked_ms": tracked,
            "untracked_ms": untracked,
            "cost": tracked / untracked - 1.0,
            # (means: where the tracked phase measures one step in several, its median is an
            # untracked step's)
            "tracked_mean_ms": means[0],
            "untracked_mean_ms": means[1],
            "cost_of_means": means[0] / means[1] - 1.0,
            "cost_track_every": args.cost_track_every,
            # The GPU's work a step, host time aside (a host-bound step hides it): every kernel's
            # time, --cost-profile-steps steps tracked at every step, then as many untracked.
            "tracked_kernel_ms": kernels[True],
            "untracked_kernel_ms": kernels[False],
            "kernel_cost": kernels[True] / kernels[False] - 1.0,
            "steps_each": len(split_times[True]),
            "bits_per_byte": bpb,
            **setting(args),
        }
        print(json.dumps(row), flush=True)


def kernel_ms(step, steps, by_name=False):
    """The GPU time of every kernel (and copy) a call of `step` runs, the mean over `steps` calls
    after two unprofiled ones (ms, torch.profiler's CUDA activity); with `by_name`, also each
    kernel name's share."""
    step()
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    on_gpu = torch.autograd.DeviceType.CUDA
    names: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == on_gpu:
            names[e.name] = names.get(e.name, 0.0) + e.time_range.elapsed_us() / steps / 1e3
    total = sum(names.values())
    return (total, names) if by_name else total


def setting(args):
    return {
        "seq": args.seq,
        "block": args.block,
        "steps": args.steps,
        "lr": args.lr,
        "seed": args.seed,
        "device": args.device,
        "bf16": args.bf16,
        "layers": args.layers,
        "heads": args.heads,
        "channels": args.channels,
    }


def train_table(args, data, split):
    probes = args.gate_probes[0] if args.gate_probes else (1, 1)  # --learner gate's
    for s in ([] if args.skip_dense else [0.0]) + args.sparsity:
        learners = None
        if s > 0 and args.learner == "pattern":
            learners = pattern_learners(args, s)
        elif s > 0:  # a gate per layer, distilled while the model trains
            learners = [
                trisparse.GateLearner(
                    args.heads,
                    args.channels // args.heads,
                    args.block,
                    s,
                    causal=True,
                    warmup=args.learner_warmup,
                    fit_every=args.learner_every,
                    fit_steps=args.gate_fit_steps,
                    probes=probes,
                )
                for _ in range(args.layers)
            ]
        start = time.perf_counter()
        _, bpb, times = train(args, data, split, learners)
        # Past the warm-up (with --cuda-graph: the replayed steps, the learners' warm-up too)
        first = graph_start(args, learners) if args.cuda_graph else args.learner_warmup + 1
        row = {
            "mode": "dense" if s == 0 else "learned",
            "learner": args.learner if s > 0 else None,
            "sparsity": s,
            "bits_per_byte": bpb,
            "seconds": time.perf_counter() - start,
            "step_ms": None if times is None else statistics.median(times[first:]),
            "cuda_graph": args.cuda_graph,
            **setting(args),
        }
        if s > 0 and args.learner == "pattern":
            row["track_every"] = args.track_every
        elif s > 0:
            row["gate_fit_steps"] = args.gate_fit_steps
            row["gate_probes"] = list(probes)
        print(json.dumps(row), flush=True)


def probe_pair(text: str) -> tuple[int, int]:
    """--gate-probes' S or SxT."""
    parts = text.lower().split("x")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"probes are S or SxT (positive integers), got {text!r}")
    return (int(parts[0]), int(parts[-1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("errors", "train", "cost"), default="errors")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-sequences", type=int, default=4)
    ap.add_argument("--learn-samples", type=int, default=4, help="training sequences learned from")
    ap.add_argument(
        "--gate-steps",
        type=int,
        nargs="+",
        default=[300],
        help="BlockGate distillation steps (several: a gate each, columns gate_<steps>)",
    )
    ap.add_argument(
        "--gate-schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="--mode errors: the distillation's learning rate (BlockGate.fit's schedule)",
    )
    ap.add_argument(
        "--gate-rank-weight",
        type=float,
        nargs="+",
        default=[0.0],
        help="--mode errors: BlockGate.fit's rank_weight (the ranking loss beside the "
        "cross-entropy); several: the --gate-probes gates once each (columns gate_p<S>x<T>_r<W>)",
    )
    ap.add_argument(
        "--gate-probes",
        type=probe_pair,
        nargs="*",
        default=[],
        help="--mode errors: a gate each with BlockGate probes S or SxT (columns gate_p<S>x<T>); "
        "--mode train --learner gate: the GateLearners' probes (the first)",
    )
    ap.add_argument(
        "--learner",
        choices=("pattern", "gate"),
        default="pattern",
        help="--mode train: one learned pattern (PatternLearner) or a gate per input (GateLearner)",
    )
    ap.add_argument("--gate-fit-steps", type=int, default=10, help="GateLearner: Adam steps a fit")
    ap.add_argument("--learner-warmup", type=int, default=50)
    ap.add_argument("--learner-every", type=int, default=25)
    ap.add_argument(
        "--track-every",
        type=int,
        default=2,
        help="PatternLearner: the kernels measure the kept blocks' mass every this many steps",
    )
    ap.add_argument("--skip-dense", action="store_true", help="--mode train: no dense row")
    ap.add_argument(
        "--cost-period", type=int, default=50, help="--mode cost: steps tracked, then untracked"
    )
    ap.add_argument(
        "--cost-profile-steps",
        type=int,
        default=20,
        help="--mode cost: steps profiled for the kernels' time, tracked and untracked",
    )
    ap.add_argument(
        "--cost-track-every",
        type=int,
        default=1,
        help="--mode cost: the tracked steps' cadence (1: every step measured)",
    )
    ap.add_argument(
        "--save-model", help="--mode errors: the trained weights (bf16) to PREFIX.<i>.pt"
    )
    ap.add_argument(
        "--load-model", help="--mode errors: weights from --save-model's PREFIX, no training"
    )
    ap.add_argument(
        "--cost-rounds",
        type=int,
        default=5,
        help="--mode cost --cuda-graph: rounds of --cost-period replays of each step",
    )
    ap.add_argument(
        "--cuda-graph",
        action="store_true",
        help="CUDA: training steps replayed from a CUDA graph (--mode train / cost: "
        "capturable PatternLearners, their schedule kept on the device; --mode errors: the dense "
        "model's training)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA block kernels)")
    args = ap.parse_args()
    data, files = corpus()
    split = int(data.numel() * 0.95)
    print(json.dumps({"corpus_bytes": data.numel(), "files": files}), flush=True)
    modes = {"errors": error_table, "train": train_table, "cost": cost_table}
    if args.mode == "cost" and args.device == "cpu":
        ap.error("--mode cost times CUDA steps: give --device cuda")
    if args.cuda_graph and (args.device == "cpu" or args.load_model):
        ap.error("--cuda-graph replays CUDA training steps: --device cuda, no --load-model")
    if args.cuda_graph and args.mode == "train" and args.learner == "gate":
        ap.error("--cuda-graph: the PatternLearner only (a GateLearner's fits are not captured)")
    modes[args.mode](args, data, split)


if __name__ == "__main__":
    main()
