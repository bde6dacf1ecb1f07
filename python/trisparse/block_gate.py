"""trisparse.BlockGate: a learned router that picks each input's attention blocks (the learned
pattern for content-dependent attention: SeerAttention's gate, per head), trained by distillation
against the true block mass."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import _tensors
from .block_mask import BlockMask
from .block_pattern import block_mass, prune_blocks
from .block_sparse import block_sparse_attention

__all__ = ["BlockGate", "GateLearner"]


class _Layout(NamedTuple):
    """What a gate's scores depend on besides q and k: the sizes (BlockGate._layout)."""

    rows: Tensor  # [qb] query rows a block
    keys: Tensor  # [kb] keys a block
    slot: Tensor  # [qb, kb] each block's bias slot
    constant: Tensor  # [qb, kb] log(keys in c); -inf where causal excludes the block
    diagonal: Tensor  # [qb, kb] bool: the blocks selection always keeps
    allowed: Tensor | None  # [qb, kb] bool, causal: the blocks selection may keep
    # With probes (S, T) other than (1, 1), else None:
    probe_rows: Tensor | None  # [qb S] query rows a probe
    probe_keys: Tensor | None  # [kb T] keys a probe
    probe_weight: Tensor | None  # [qb, S, 1] log(rows of the probe / rows of its block)
    probe_constant: Tensor | None  # [qb or 1, S or 1, kb, T] log(keys a probe); none seen: low


class BlockGate(nn.Module):
    """Scores every (query block, key block) pair of an input from its pooled queries and keys,
    so that a block mask can be chosen per input (a sequence's own content), where a
    :class:`BlockPattern` is one mask for all inputs.

    Per head h, query block r and key block c:
    ``score = scale * (mean_q[r] Wq[h]) . ([mean_k, max_k, min_k][c] Wk[h]) + bias[h, r - c] +
    log(keys in c)``, causal blocks past the diagonal excluded, and the gate's estimate of block
    (r, c)'s attention mass is the softmax of the scores over c. ``Wq`` starts as the identity and
    ``Wk`` as the identity on the mean (and zero on max and min), ``bias`` (learned per block
    offset up to ``max_distance``, clamped beyond) at zero: untrained, the gate is
    :func:`pooled_block_mass`, the rule top-k block routing ranks by. :meth:`fit` trains it on
    attention samples by distillation (the cross-entropy of its estimate against
    :func:`block_mass`, each block row a distribution), so that it ranks blocks by the mass they
    really hold.

    ``probes`` (S or (S, T), each dividing block_size) pools finer: each query block as S probes
    of G / S rows and each key block as T probes of G / T keys, with the same weights. A probe's
    score for key block c is the log-sum-exp over c's key probes of the score above (its
    log-count that of the key probe, causal at the probes' rows) plus the bias; the block row's
    estimate is the mean of its probes' softmaxes over c, weighted by their rows, as the true
    block mass is the mean of its rows' (untrained, probes = G is :func:`block_mass` itself).
    It costs S T times the pooled scores ([H, qb S, kb T]).

    q and k are [H, N, D] (one input: a sequence, or a graph's nodes in a block-friendly order) or
    [B, H, N, D] (a batch, each sequence its own blocks). A selection is two small GEMMs over
    N / G pooled rows, a top-k per block row and some 20 torch ops: below 32K rows on an H200 the
    ops' host time, not the GPU, sets its cost (docs/notes/block_patterns.md). It keeps the last
    shape's constant term, one float [H, N_q / G, N_k / G] tensor (134 MB at 8 heads of 128K rows
    in blocks of 64)."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        block_size: int,
        causal: bool = False,
        max_distance: int = 64,
        scale: float | None = None,
        probes: int | tuple[int, int] = 1,
    ):
        super().__init__()
        if heads < 1 or head_dim < 1 or block_size < 1 or max_distance < 0:
            raise ValueError(
                f"heads, head_dim and block_size must be positive and max_distance >= 0, got "
                f"{heads}, {head_dim}, {block_size}, {max_distance}"
            )
        pair = (probes, probes) if isinstance(probes, int) else tuple(probes)
        if len(pair) != 2 or any(p < 1 or block_size % p for p in pair):
            raise ValueError(
                f"probes must be S or (S, T), each a positive divisor of block_size "
                f"{block_size}, got {probes}"
            )
        self.probes = (int(pair[0]), int(pair[1]))
        self.heads, self.head_dim, self.block_size = heads, head_dim, int(block_size)
        self.causal, self.max_distance = bool(causal), int(max_distance)
        self.scale = _tensors.resolve_scale(scale, head_dim)
        eye = torch.eye(head_dim).expand(heads, head_dim, head_dim)
        self.wq = nn.Parameter(eye.clone())
        self.wk = nn.Parameter(torch.cat([eye, torch.zeros(heads, 2 * head_dim, head_dim)], 1))
        self.bias = nn.Parameter(torch.zeros(heads, 2 * self.max_distance + 1))
        self._layouts: dict[tuple, _Layout] = {}
        self._select_cache: tuple | None = None

    def _check(self, q: Tensor, k: Tensor) -> None:
        want = (self.heads, self.head_dim)
        if (
            q.dim() not in (3, 4)
            or k.dim() != q.dim()
            or q.shape[:-3] != k.shape[:-3]
            or (q.shape[-3], q.shape[-1]) != want
            or (k.shape[-3], k.shape[-1]) != want
        ):
            raise ValueError(
                f"q and k must be [{self.heads}, N, {self.head_dim}] or [B, {self.heads}, N, "
                f"{self.head_dim}] alike (heads, rows, head_dim), got {tuple(q.shape)} and "
                f"{tuple(k.shape)}"
            )

    def _layout(self, n_q: int, n_k: int, device: torch.device) -> _Layout:
        """What depends on the sizes only, made once per (N_q, N_k, device): the query and key
        blocks' row counts, each block's bias slot (its offset, the square case's diagonal 0,
        clamped to max_distance), the scores' constant term (log of the keys in c; -inf where
        causal excludes the block), the diagonal that selection always keeps and, causal, the
        blocks it may keep (per dtype of the parameters, too)."""
        key = (n_q, n_k, device, self.wq.dtype)
        hit = self._layouts.get(key)
        if hit is None:
            g = self.block_size
            qb, kb = -(-n_q // g), -(-n_k // g)
            rows = torch.clamp(n_q - torch.arange(qb, device=device) * g, max=g)
            keys = torch.clamp(n_k - torch.arange(kb, device=device) * g, max=g)
            r = torch.arange(qb, device=device)[:, None]
            c = torch.arange(kb, device=device)[None, :]
            slot = torch.clamp(r + (n_k - n_q) // g - c, -self.max_distance, self.max_distance)
            constant = keys.to(self.wq.dtype).log().expand(qb, kb)
            if self.causal:  # block c holds a key the block row's last query sees
                last = torch.clamp((r + 1) * g, max=n_q) - 1 + (n_k - n_q)
                constant = constant.masked_fill(c * g > last, -math.inf)
            diagonal = torch.eye(qb, kb, dtype=torch.bool, device=device)
            allowed = torch.isfinite(constant) if self.causal else None
            hit = _Layout(
                rows,
                keys,
                slot + self.max_distance,
                constant.contiguous(),
                diagonal,
                allowed,
                *self._probe_layout(n_q, n_k, rows, device),
            )
            if len(self._layouts) >= 16:
                self._layouts.clear()
            self._layouts[key] = hit
        return hit

    def _probe_layout(self, n_q: int, n_k: int, rows: Tensor, device: torch.device) -> tuple:
        """_Layout's probe fields: each probe's rows or keys, the query probes' weights in their
        block (log of their share of its rows; -inf for a probe past the last row) and the key
        probes' log-counts, causal per probe (a key probe counts for a query probe where its
        first key is at or before the probe's last row; the diagonal block's first key probe
        always does). Excluded terms take a very low finite value, not -inf, so that the
        log-sum-exps' gradients stay finite; blocks causal excludes are set to -inf after. None
        of them without probes."""
        if self.probes == (1, 1):
            return (None,) * 4
        s, t = self.probes
        g, dtype = self.block_size, self.wq.dtype
        gs, gt = g // s, g // t
        qb, kb = rows.numel(), -(-n_k // g)
        q_start = torch.arange(qb * s, device=device) * gs
        k_start = torch.arange(kb * t, device=device) * gt
        probe_rows = torch.clamp(n_q - q_start, 0, gs)
        probe_keys = torch.clamp(n_k - k_start, 0, gt)
        weight = (probe_rows.view(qb, s).to(dtype) / rows.to(dtype)[:, None]).log()[..., None]
        low = torch.finfo(dtype).min / 4
        constant = probe_keys.to(dtype).log().clamp(min=low).view(1, 1, kb, t)
        if self.causal:
            last = torch.clamp(q_start + gs, max=n_q) - 1 + (n_k - n_q)
            seen = k_start[None, :] <= last[:, None]  # [qb s, kb t]
            constant = constant.expand(qb, s, kb, t).masked_fill(~seen.view(qb, s, kb, t), low)
        return probe_rows, probe_keys, weight, constant.contiguous()

    def _pooled(self, x: Tensor, counts: Tensor, with_extremes: bool, size: int = 0) -> Tensor:
        """Each block's (of `size` rows, default block_size) mean row (and max and min rows)
        [..., H, blocks, D or 3D] in the parameters' dtype, reduced from x's own dtype (no
        converted copy of x: the mean accumulates in the parameters' dtype, max and min are exact
        in any); zeros for a block past the last row."""
        g, lead, (n, d) = size or self.block_size, x.shape[:-2], x.shape[-2:]
        blocks, dtype = counts.numel(), self.wq.dtype
        pad = blocks * g - n
        if pad == 0:  # whole blocks: no padding rows to keep out of max and min
            grid = x.view(*lead, blocks, g, d)
            mean = grid.mean(-2, dtype=dtype)
            if not with_extremes:
                return mean
            return torch.cat([mean, grid.amax(-2).to(dtype), grid.amin(-2).to(dtype)], -1)
        grid = nn.functional.pad(x, (0, 0, 0, pad)).view(*lead, blocks, g, d)
        mean = grid.sum(-2, dtype=dtype) / counts.clamp(min=1).to(dtype)[:, None]
        if not with_extremes:
            return mean
        grid = nn.functional.pad(x, (0, 0, 0, pad), value=math.nan).view(*lead, blocks, g, d)
        high = grid.nan_to_num(-math.inf).amax(-2).to(dtype)
        low = grid.nan_to_num(math.inf).amin(-2).to(dtype)
        extremes = torch.cat([high, low], -1)
        if pad >= g:  # probes past the last row (their mean is 0 already)
            extremes = extremes.masked_fill((counts == 0)[:, None], 0.0)
        return torch.cat([mean, extremes], -1)

    def _scores(self, q: Tensor, k: Tensor, layout: _Layout, constant: Tensor) -> Tensor:
        """scale (q̄ Wq) · (k̄ Wk) + `constant` [H, qb, kb] (the bias and log-count terms): the
        product's scale on its small left factor, the sum in the product's epilogue where the
        shapes allow (one pass over the [.., H, qb, kb] scores)."""
        a = (self._pooled(q, layout.rows, False) @ self.wq) * self.scale
        b = (self._pooled(k, layout.keys, True) @ self.wk).transpose(-1, -2)
        if a.dim() == 3:
            return torch.baddbmm(constant, a, b)
        return torch.matmul(a, b) + constant

    def _probed(self, q: Tensor, k: Tensor, layout: _Layout) -> Tensor:
        """The log block mass with probes (S, T): [.., H, qb S, kb T] probe scores, the
        log-sum-exp over each key block's probes, the bias, a softmax over key blocks per query
        probe, the probes' row-weighted mean per block row; causal's excluded blocks -inf."""
        (s, t), g = self.probes, self.block_size
        qb, kb = layout.rows.numel(), layout.keys.numel()
        a = (self._pooled(q, layout.probe_rows, False, g // s) @ self.wq) * self.scale
        b = (self._pooled(k, layout.probe_keys, True, g // t) @ self.wk).transpose(-1, -2)
        scores = torch.matmul(a, b).unflatten(-1, (kb, t)).unflatten(-3, (qb, s))
        logits = torch.logsumexp(scores + layout.probe_constant, -1)  # [.., H, qb, s, kb]
        logits = logits + self.bias[:, layout.slot].unsqueeze(-2)
        logp = torch.logsumexp(torch.log_softmax(logits, -1) + layout.probe_weight, -2)
        return logp.masked_fill(~layout.allowed, -math.inf) if self.causal else logp

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        """The gate's log block mass [(B,) H, query blocks, key blocks] for q [(B,) H, N_q, D],
        k [(B,) H, N_k, D] (float32, or the parameters' dtype; excluded causal blocks -inf,
        each block row's exp summing to 1)."""
        self._check(q, k)
        layout = self._layout(q.shape[-2], k.shape[-2], q.device)
        if self.probes != (1, 1):
            return self._probed(q, k, layout)
        constant = self.bias[:, layout.slot] + layout.constant
        return torch.log_softmax(self._scores(q, k, layout, constant), -1)

    def loss(self, q: Tensor, k: Tensor, target: Tensor) -> Tensor:
        """The cross-entropy of the gate's block mass against `target` ([(B,) H, qb, kb], each
        block row's mass summing to 1, as :func:`block_mass` gives it), averaged over block
        rows."""
        logp = self._against(q, k, target)
        return self._cross_entropy(logp, target.to(logp.dtype))

    def _against(self, q: Tensor, k: Tensor, target: Tensor) -> Tensor:
        """The gate's log mass for (q, k), `target` checked against its shape."""
        logp = self(q, k)
        if target.shape != logp.shape:
            raise ValueError(
                f"target must be the block mass [(B,) H, qb, kb] = {list(logp.shape)}, got "
                f"{list(target.shape)}"
            )
        return logp

    @staticmethod
    def _cross_entropy(logp: Tensor, target: Tensor) -> Tensor:
        terms = torch.where(target > 0, target * logp, torch.zeros_like(logp))
        return -terms.sum(-1).mean()

    def rank_loss(self, q: Tensor, k: Tensor, target: Tensor, top: int = 32) -> Tensor:
        """A pairwise ranking loss of the gate's estimate against `target` (as for :meth:`loss`):
        per block row, each of the `top` blocks i of largest target mass against every block j,
        ``(m_i - m_j)+ * softplus(s_j - s_i)`` (s the gate's log mass), summed per row and averaged
        over rows. The cross-entropy weighs each block by its mass; this weighs the order of the
        blocks a selection keeps against the ones it drops, where the top-k choice is made.
        Costs a [(B,) H, qb, top, kb] tensor."""
        logp = self._against(q, k, target)
        return self._rank_terms(logp, target.to(logp.dtype), top)

    @staticmethod
    def _rank_terms(logp: Tensor, target: Tensor, top: int) -> Tensor:
        if top < 1:
            raise ValueError(f"top must be positive, got {top}")
        # Excluded causal blocks (-inf, no mass) ranked last at a finite score: no NaN terms.
        s = torch.where(torch.isfinite(logp), logp, torch.full_like(logp, -1e4))
        mass, rows = target.topk(min(top, target.shape[-1]), -1)
        weight = (mass.unsqueeze(-1) - target.unsqueeze(-2)).clamp_min(0)
        pairs = torch.nn.functional.softplus(s.unsqueeze(-2) - s.gather(-1, rows).unsqueeze(-1))
        return (weight * pairs).sum((-1, -2)).mean()

    def fit(
        self,
        samples: Iterable[Sequence[Tensor]],
        steps: int = 300,
        lr: float = 1e-2,
        schedule: str = "cosine",
        rank_weight: float = 0.0,
        rank_top: int = 32,
    ) -> list[float]:
        """Trains the gate by distillation on attention samples: each a (q, k) pair ([(B,) H, N,
        D], its targets the exact :func:`block_mass`, computed once) or (q, k, mass). Adam over
        the samples in turn for `steps` steps, its learning rate from `lr` down to zero along a
        cosine (`schedule="cosine"`: the last steps settle, where a constant rate leaves the
        gate wherever its last samples pushed it) or `"constant"`. `rank_weight` > 0 adds that
        much of :meth:`rank_loss` (over each row's `rank_top` blocks) to the cross-entropy;
        returns the losses."""
        if schedule not in ("cosine", "constant"):
            raise ValueError(f'schedule must be "cosine" or "constant", got {schedule!r}')
        if rank_weight < 0 or rank_top < 1:
            raise ValueError(
                f"rank_weight must be >= 0 and rank_top positive, got {rank_weight}, {rank_top}"
            )
        data = []
        for sample in samples:
            q, k = sample[0].detach(), sample[1].detach()
            self._check(q, k)
            if len(sample) > 2:
                mass = sample[2]
            elif q.dim() == 3:
                mass = block_mass(q, k, self.block_size, self.causal)
            else:
                mass = torch.stack(
                    [block_mass(a, b, self.block_size, self.causal) for a, b in zip(q, k)]
                )
            data.append((q, k, mass.to(self.wq.device, torch.float32)))
        if not data:
            raise ValueError("samples: give at least one (q, k) pair")
        opt = torch.optim.Adam(self.parameters(), lr=lr)
        decay = None
        if schedule == "cosine" and steps > 0:
            decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        losses = []
        for step in range(steps):
            q, k, mass = data[step % len(data)]
            losses.append(float(self._step(opt, q, k, mass, rank_weight, rank_top)))
            if decay is not None:
                decay.step()
        return losses

    def _step(
        self,
        opt: torch.optim.Optimizer,
        q: Tensor,
        k: Tensor,
        mass: Tensor,
        rank_weight: float = 0.0,
        rank_top: int = 32,
    ) -> Tensor:
        """One distillation step of `opt` on (q, k, mass), the cross-entropy plus `rank_weight`
        times the ranking loss; the loss before it (detached)."""
        logp = self(q, k)
        mass = mass.to(logp.dtype)
        loss = self._cross_entropy(logp, mass)
        if rank_weight > 0:
            loss = loss + rank_weight * self._rank_terms(logp, mass, rank_top)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    @torch.no_grad()
    def select(self, q: Tensor, k: Tensor, sparsity: float, method: str = "row", **keep_rules):
        """The blocks to keep for this input (bool [(B,) H, qb, kb]): the gate's block mass pruned
        by :func:`prune_blocks` (`method`, `sparsity`, keep rules; per input and head; "row"
        with the default rules by top-k, ties in any order), causal blocks past the diagonal
        never kept."""
        if method == "row" and not keep_rules:  # prune_blocks' rule in fewer passes: top-k
            if not 0.0 <= sparsity < 1.0:
                raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
            self._check(q, k)
            layout = self._layout(q.shape[-2], k.shape[-2], q.device)
            # Ranked by the scores themselves (the softmax keeps each row's order); the diagonal
            # forced by +inf in the constant term, made once per layout and parameters' version.
            if self.probes != (1, 1):  # ranked by the estimate itself, the diagonal forced
                scores = self._probed(q, k, layout).masked_fill(layout.diagonal, math.inf)
            else:
                scores = self._scores(q, k, layout, self._select_constant(layout))
            kb = scores.shape[-1]
            top = scores.topk(max(1, round((1.0 - sparsity) * kb)), -1).indices
            keep = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
            keep.scatter_(-1, top, True)
            return keep & layout.allowed if self.causal else keep
        logp = self(q, k)
        keep = prune_blocks(logp.exp().flatten(0, -3), sparsity, method, **keep_rules)
        keep = keep.view(logp.shape)
        return keep & torch.isfinite(logp) if self.causal else keep

    def _select_constant(self, layout: _Layout) -> Tensor:
        """bias[:, slot] + log-count terms with +inf on the diagonal [H, qb, kb], cached while
        neither the layout nor the bias changes (the bias's version counts its updates)."""
        key = (id(layout), self.bias._version, self.bias.data_ptr())
        if self._select_cache is None or self._select_cache[0] != key:
            constant = self.bias[:, layout.slot] + layout.constant
            constant = constant.masked_fill(layout.diagonal, math.inf)
            self._select_cache = (key, constant, layout)  # holds the layout: its id stays its own
        return self._select_cache[1]

    @torch.no_grad()
    def block_mask(self, q: Tensor, k: Tensor, sparsity: float, method: str = "row", **keep_rules):
        """:meth:`select` as a :class:`BlockMask` for :func:`block_sparse_attention` ([B or 1, H,
        qb, kb], causal as the gate), made on q's device: no host synchronisation on CUDA."""
        keep = self.select(q, k, sparsity, method, **keep_rules)
        keep = keep if keep.dim() == 4 else keep[None]
        density = 1.0 - sparsity if method == "row" else None
        return BlockMask(keep, self.block_size, causal=self.causal, density=density)


class GateLearner:
    """A :class:`BlockGate` learned while the model trains (the gate inside training), for one
    attention site whose blocks change with the input (text). Called in place of the site's
    attention, ``learner(q, k, v)`` with q, k, v [B, H, N, D] (causal as the learner):

    - every `fit_every`-th training step (the first included) the gate takes `fit_steps` Adam
      steps (`lr`) of distillation against the exact block mass of the step's first sequence
      (:func:`block_mass` of its detached q and k: dense work, H · N² · D, in float32 with
      autocast off), so that it follows the attention as the model changes;
    - the attention is dense (SDPA) through the first `warmup` steps, then block-sparse under each
      input's own blocks as the gate chooses them (:meth:`BlockGate.block_mask` at `sparsity`,
      the diagonal kept, from the detached q and k, autocast off).

    The gate is distilled, not trained by the model's loss: its parameters are the learner's own
    (``learner.gate``), not the model's, so keep the learner a plain attribute of the module (as
    :class:`PatternLearner`), out of the model's optimizer. Evaluation calls (no gradients)
    attend only: dense before the warm-up's end, block-sparse after. ``last_loss`` is the latest
    distillation loss (a device tensor: reading it synchronises). ``probes``: the gate's
    (:class:`BlockGate`)."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        block_size: int,
        sparsity: float,
        causal: bool = False,
        warmup: int = 0,
        fit_every: int = 10,
        fit_steps: int = 1,
        lr: float = 1e-2,
        max_distance: int = 64,
        probes: int | tuple[int, int] = 1,
    ):
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        if fit_every < 1 or fit_steps < 0 or warmup < 0:
            raise ValueError(
                f"fit_every must be >= 1, fit_steps and warmup >= 0, got {fit_every}, "
                f"{fit_steps}, {warmup}"
            )
        self.gate = BlockGate(heads, head_dim, block_size, causal, max_distance, probes=probes)
        self.sparsity, self.causal, self.warmup = sparsity, bool(causal), warmup
        self.fit_every, self.fit_steps, self.lr = fit_every, fit_steps, lr
        self.steps = 0
        self.last_loss: Tensor | None = None
        self._opt: torch.optim.Optimizer | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
        """The site's attention (see the class) and, with gradients on, one learning step."""
        if q.dim() != 4:
            raise ValueError(f"q, k, v must be [B, H, N, D], got q {tuple(q.shape)}")
        if self.gate.wq.device != q.device:
            self.gate.to(q.device)
            self._opt = None
        training = torch.is_grad_enabled()
        if training and self.steps % self.fit_every == 0 and self.fit_steps > 0:
            self._distil(q[0].detach(), k[0].detach())
        dense = self.steps < self.warmup
        if training:
            self.steps += 1
        if dense:
            return nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, scale=scale
            )
        with torch.autocast(q.device.type, enabled=False):
            mask = self.gate.block_mask(q.detach(), k.detach(), self.sparsity)
        return block_sparse_attention(q, k, v, mask, scale=scale)

    def _distil(self, q: Tensor, k: Tensor) -> None:
        if self._opt is None:
            self._opt = torch.optim.Adam(self.gate.parameters(), lr=self.lr)
        with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
            mass = block_mass(q, k, self.gate.block_size, self.causal).to(torch.float32)
            for _ in range(self.fit_steps):
                self.last_loss = self.gate._step(self._opt, q, k, mass)
