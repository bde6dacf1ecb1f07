// A pattern learner's tracked step (include/trisparse/ops/importance_fold.hpp): the argument
// checks, the CPU's loops, and the CUDA kernels' entry (src/cuda/block_pattern).
#include "trisparse/ops/importance_fold.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../cuda/block_pattern/importance_fold.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"

namespace trisparse {

namespace {

std::int64_t blocks_of(std::int64_t n, std::int64_t g) { return (n + g - 1) / g; }

// Each G-row block's mean row of x [N, H, D] in float64: [H][blocks][D], x's elements read by
// load(data, offset).
template <class Load>
std::vector<double> block_means(const tensor_view& x, std::int64_t g, Load load) {
  const std::int64_t nb = blocks_of(x.rows, g), d = x.dim;
  std::vector<double> means(static_cast<std::size_t>(x.heads * nb * d), 0.0);
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t h = 0; h < x.heads; ++h) {
    for (std::int64_t b = 0; b < nb; ++b) {
      double* m = means.data() + (h * nb + b) * d;
      const std::int64_t rows = std::min(g, x.rows - b * g);
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::int64_t at = x.offset(b * g + i, h, 0);
#pragma omp simd
        for (std::int64_t j = 0; j < d; ++j) m[j] += load(x.data, at + j);
      }
      for (std::int64_t j = 0; j < d; ++j) m[j] /= static_cast<double>(rows);
    }
  }
  return means;
}

std::vector<double> block_means(const tensor_view& x, std::int64_t g) {
  const auto bits = [](const void* p, std::int64_t i) {
    return static_cast<const std::uint16_t*>(p)[i];
  };
  switch (x.type) {
    case dtype::f16:
      return block_means(x, g, [&](const void* p, std::int64_t i) {
        return static_cast<double>(half_bits_to_float(bits(p, i)));
      });
    case dtype::bf16:
      return block_means(x, g, [&](const void* p, std::int64_t i) {
        return static_cast<double>(bf16_bits_to_float(bits(p, i)));
      });
    case dtype::f32:
      return block_means(x, g, [](const void* p, std::int64_t i) {
        return static_cast<double>(static_cast<const float*>(p)[i]);
      });
    case dtype::f64:
      break;
  }
  return block_means(
      x, g, [](const void* p, std::int64_t i) { return static_cast<const double*>(p)[i]; });
}

void pooled_block_mass_cpu(const tensor_view& q, const tensor_view& k, std::int64_t g, bool causal,
                           double scale, double* out) {
  const std::int64_t heads = q.heads, d = q.dim, qb = blocks_of(q.rows, g),
                     kb = blocks_of(k.rows, g);
  const std::vector<double> qm = block_means(q, g), km = block_means(k, g);
  std::vector<double> km_t(km.size());  // [H][D][kb]: a row's scores as axpy passes over c
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t c = 0; c < kb; ++c)
      for (std::int64_t j = 0; j < d; ++j) km_t[(h * d + j) * kb + c] = km[(h * kb + c) * d + j];
  std::vector<double> log_keys(static_cast<std::size_t>(kb));
  for (std::int64_t c = 0; c < kb; ++c)
    log_keys[c] = std::log(static_cast<double>(std::min(g, k.rows - c * g)));
  const double minus_inf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t r = 0; r < qb; ++r) {
      double* row = out + (h * qb + r) * kb;
      const double* a = qm.data() + (h * qb + r) * d;
      std::fill(row, row + kb, 0.0);
      for (std::int64_t j = 0; j < d; ++j) {  // the dot products, each summed over j in order
        const double* b = km_t.data() + (h * d + j) * kb;
#pragma omp simd
        for (std::int64_t c = 0; c < kb; ++c) row[c] += a[j] * b[c];
      }
      // Key blocks past the one holding the last key the block row's last query sees (causal,
      // aligned at the bottom right) are excluded.
      const std::int64_t last = std::min((r + 1) * g, q.rows) - 1 + k.rows - q.rows;
      const std::int64_t seen = causal ? std::clamp<std::int64_t>(last / g + 1, 0, kb) : kb;
      if (last < 0 && causal) {  // no key block: zeros
        std::fill(row, row + kb, 0.0);
        continue;
      }
      double top = minus_inf;
      for (std::int64_t c = 0; c < seen; ++c) {
        row[c] = scale * row[c] + log_keys[c];
        top = std::max(top, row[c]);
      }
      double sum = 0.0;
      for (std::int64_t c = 0; c < seen; ++c) {
        row[c] = std::exp(row[c] - top);
        sum += row[c];
      }
      for (std::int64_t c = 0; c < seen; ++c) row[c] /= sum;
      std::fill(row + seen, row + kb, 0.0);
    }
  }
}

void fold_block_importance_cpu(const importance_fold_args& a) {
  const std::int64_t kb = a.kb;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t h = 0; h < a.heads; ++h) {
    for (std::int64_t r = 0; r < a.qb; ++r) {
      const std::int64_t base = (h * a.qb + r) * kb;
      double kept = 0.0;
      for (std::int64_t c = 0; c < kb; ++c)
        if (a.keep[base + c]) kept += a.pooled[base + c];
      const bool seen = a.seen == nullptr || a.seen[r];
      for (std::int64_t c = 0; c < kb; ++c) {
        double fresh = a.pooled[base + c];
        if (a.keep[base + c]) {
          double mass = 0.0;
          for (std::int64_t b = 0; b < a.batch; ++b)
            mass += a.mass[b * a.mass_strides[0] + h * a.mass_strides[1] + r * a.mass_strides[2] +
                           c * a.mass_strides[3]];
          fresh = mass / static_cast<double>(a.batch) * kept;
        }
        double& s = a.state[base + c];
        s = seen ? s * a.decay + (1.0 - a.decay) * fresh : fresh;
      }
    }
  }
}

void prune_block_importance_cpu(const block_prune_args& a) {
  const bool global = a.scope == prune_scope::global;
  const std::int64_t length = global ? a.qb * a.kb : a.kb;
  const std::int64_t segments = global ? a.heads : a.heads * a.qb;
  const std::uint64_t forced_key = prune_rank_key(std::numeric_limits<double>::infinity());
#pragma omp parallel for schedule(static)
  for (std::int64_t s = 0; s < segments; ++s) {
    const std::int64_t base = s * length, forced0 = global ? 0 : (s % a.qb) * a.kb;
    std::vector<std::uint64_t> key(static_cast<std::size_t>(length));
    std::vector<std::int64_t> order(static_cast<std::size_t>(length));
    for (std::int64_t i = 0; i < length; ++i) {
      const bool forced = a.forced != nullptr && a.forced[forced0 + i];
      key[i] = forced ? forced_key : prune_rank_key(a.importance[base + i]);
      order[i] = i;
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int64_t x, std::int64_t y) { return key[x] > key[y]; });
    bool* keep = a.keep + base;
    for (std::int64_t i = 0; i < length; ++i)
      keep[i] = a.forced != nullptr && a.forced[forced0 + i];
    for (std::int64_t i = 0; i < std::min(a.budget, length); ++i) keep[order[i]] = true;
  }
}

}  // namespace

std::size_t pooled_block_mass_workspace_bytes(std::int64_t heads, std::int64_t n_q,
                                              std::int64_t n_k, std::int64_t dim,
                                              std::int64_t block) {
  TRISPARSE_EXPECTS_INPUT(block >= 1 && heads >= 0 && n_q >= 0 && n_k >= 0 && dim >= 0,
                          "pooled_block_mass: block must be >= 1 and the sizes >= 0");
  return static_cast<std::size_t>(heads * (blocks_of(n_q, block) + blocks_of(n_k, block)) * dim) *
         sizeof(double);
}

void pooled_block_mass(const tensor_view& q, const tensor_view& k, std::int64_t block, bool causal,
                       double scale, double* out, void* workspace, std::size_t workspace_bytes,
                       stream_ref stream, const bool* due) {
  TRISPARSE_EXPECTS_INPUT(block >= 1,
                          "pooled_block_mass: block must be >= 1, got " + std::to_string(block));
  check_view(q, "pooled_block_mass: q", -1, -1, -1);
  check_view(k, "pooled_block_mass: k", -1, q.heads, q.dim);
  TRISPARSE_EXPECTS_INPUT(q.where == k.where && q.device_id == k.device_id,
                          "pooled_block_mass: q and k must be on one device");
  const std::int64_t qb = blocks_of(q.rows, block), kb = blocks_of(k.rows, block);
  if (q.heads * qb * kb == 0) return;
  TRISPARSE_EXPECTS_INPUT(out != nullptr, "pooled_block_mass: out is null");
  if (scale <= 0.0) scale = 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(q.dim, 1)));
  if (q.where == device_kind::cpu) {
    if (due == nullptr || *due) pooled_block_mass_cpu(q, k, block, causal, scale, out);
    return;
  }
  const std::size_t need = pooled_block_mass_workspace_bytes(q.heads, q.rows, k.rows, q.dim, block);
  TRISPARSE_EXPECTS_INPUT(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                          "pooled_block_mass: the workspace holds " +
                              std::to_string(workspace_bytes) + " bytes, it needs " +
                              std::to_string(need));
  cuda::pooled_block_mass(q, k, block, causal, scale, out, static_cast<double*>(workspace), due,
                          stream);
}

void importance_fold_args::check() const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && qb >= 0 && kb >= 0,
                          "fold_block_importance: heads, qb and kb must be >= 0");
  TRISPARSE_EXPECTS_INPUT(
      batch >= 1, "fold_block_importance: batch must be >= 1, got " + std::to_string(batch));
  TRISPARSE_EXPECTS_INPUT(
      decay >= 0.0 && decay < 1.0,
      "fold_block_importance: decay must be in [0, 1), got " + std::to_string(decay));
  if (heads * qb * kb == 0) return;
  TRISPARSE_EXPECTS_INPUT(
      state != nullptr && mass != nullptr && keep != nullptr && pooled != nullptr,
      "fold_block_importance: state, mass, keep and pooled must be given");
  TRISPARSE_EXPECTS_INPUT(
      std::all_of(mass_strides, mass_strides + 4, [](std::int64_t s) { return s >= 0; }),
      "fold_block_importance: mass_strides must be >= 0");
}

void fold_block_importance(const importance_fold_args& args, stream_ref stream) {
  args.check();
  if (args.heads * args.qb * args.kb == 0) return;
  if (args.where != device_kind::cpu)
    cuda::fold_block_importance(args, stream);
  else if (args.due == nullptr || *args.due)
    fold_block_importance_cpu(args);
}

void learner_schedule_args::check() const {
  TRISPARSE_EXPECTS_INPUT(steps != nullptr && flags != nullptr,
                          "advance_learner_schedule: steps and flags must be given");
  TRISPARSE_EXPECTS_INPUT(warmup >= 0 && every >= 1 && track_every >= 1,
                          "advance_learner_schedule: warmup must be >= 0, every and track_every "
                          ">= 1, got " +
                              std::to_string(warmup) + ", " + std::to_string(every) + ", " +
                              std::to_string(track_every));
}

void advance_learner_schedule(const learner_schedule_args& args, stream_ref stream) {
  args.check();
  if (args.where != device_kind::cpu) {
    cuda::advance_learner_schedule(args, stream);
    return;
  }
  const learner_flags f =
      schedule_flags(*args.steps, args.warmup, args.every, args.track_every, args.freeze_after);
  args.flags[0] = f.prune;
  args.flags[1] = f.fold;
  args.flags[2] = f.track;
  *args.steps += 1;
}

void block_prune_args::check() const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && qb >= 0 && kb >= 0,
                          "prune_block_importance: heads, qb and kb must be >= 0");
  TRISPARSE_EXPECTS_INPUT(
      budget >= 1, "prune_block_importance: budget must be >= 1, got " + std::to_string(budget));
  TRISPARSE_EXPECTS_INPUT(scope == prune_scope::row || scope == prune_scope::global,
                          "prune_block_importance: scope must be row or global");
  if (heads * qb * kb == 0) return;
  TRISPARSE_EXPECTS_INPUT(importance != nullptr && keep != nullptr,
                          "prune_block_importance: importance and keep must be given");
}

std::size_t prune_block_importance_workspace_bytes(std::int64_t heads, std::int64_t qb,
                                                   std::int64_t kb, prune_scope scope) {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && qb >= 0 && kb >= 0,
                          "prune_block_importance: heads, qb and kb must be >= 0");
  const std::int64_t words = heads * prune_words_per_head(prune_chunks(qb, kb, scope));
  return static_cast<std::size_t>(words) * sizeof(std::uint64_t);
}

void prune_block_importance(const block_prune_args& args, stream_ref stream) {
  args.check();
  if (args.heads * args.qb * args.kb == 0) return;
  if (args.where == device_kind::cpu) {
    if (args.due == nullptr || *args.due) prune_block_importance_cpu(args);
    return;
  }
  const std::size_t need =
      prune_block_importance_workspace_bytes(args.heads, args.qb, args.kb, args.scope);
  TRISPARSE_EXPECTS_INPUT(args.workspace_bytes >= need && (need == 0 || args.workspace != nullptr),
                          "prune_block_importance: the workspace holds " +
                              std::to_string(args.workspace_bytes) + " bytes, it needs " +
                              std::to_string(need) + " (prune_block_importance_workspace_bytes)");
  cuda::prune_block_importance(args, stream);
}

}  // namespace trisparse
