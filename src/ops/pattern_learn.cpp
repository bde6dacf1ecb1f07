// Learning a block pattern offline (include/trisparse/ops/pattern_learn.hpp): exact block masses
// on the CPU, then pruning by the rules Python's prune_blocks applies.
#include "trisparse/ops/pattern_learn.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <memory>
#include <numbers>
#include <numeric>
#include <optional>
#include <span>

#include "../cpu/common/exp2.hpp"
#include "../cpu/common/online_softmax.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/ops/importance_fold.hpp"

namespace trisparse {

namespace {

constexpr std::int64_t kRows = 8;     // query rows a pass
constexpr std::int64_t kKeys = 1024;  // keys a chunk (kRows x kKeys scores stay in L1)

// s[a * ld + j] = sum_x q[a * d + x] kt[x * nk + j] for `rows` query rows and the keys [0, len) of
// kt (already offset to the chunk): d axpy passes the compiler vectorises, cloned for AVX2 + FMA
// where the CPU has them (the library is built for x86-64-v2).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void score_chunk(
    const float* q, std::int64_t rows, std::int64_t d, const float* kt, std::int64_t nk,
    std::int64_t len, float* s, std::int64_t ld) {
  for (std::int64_t a = 0; a < rows; ++a) std::fill_n(s + a * ld, len, 0.f);
  for (std::int64_t x = 0; x < d; ++x) {
    const float* kr = kt + x * nk;
    for (std::int64_t a = 0; a < rows; ++a) {
      const float qv = q[a * d + x];
      float* sr = s + a * ld;
#pragma omp simd
      for (std::int64_t j = 0; j < len; ++j) sr[j] += qv * kr[j];
    }
  }
}

// sums[c] = sum over the keys j of block c (j <= last) of 2^(s[j] - top); returns their total.
[[gnu::target_clones("arch=x86-64-v3", "default")]] double block_sums(const float* s,
                                                                      std::int64_t last,
                                                                      std::int64_t block, float top,
                                                                      double* sums) {
  double total = 0.0;
  for (std::int64_t c = 0; c * block <= last; ++c) {
    const std::int64_t end = std::min(last + 1, (c + 1) * block);
    float part = 0.f;
#pragma omp simd reduction(+ : part)
    for (std::int64_t j = c * block; j < end; ++j) part += cpu::exp2_nonpositive(s[j] - top);
    sums[c] = part;
    total += part;
  }
  return total;
}

// sum_j 2^(s[j] - top) over the keys j <= last, each s[j] replaced by its term.
[[gnu::target_clones("arch=x86-64-v3", "default")]] double key_weights(float* s, std::int64_t last,
                                                                       float top) {
  float total = 0.f;  // terms in (0, 1]: float partial sums, as block_sums keeps them
#pragma omp simd reduction(+ : total)
  for (std::int64_t j = 0; j <= last; ++j) {
    s[j] = cpu::exp2_nonpositive(s[j] - top);
    total += s[j];
  }
  return total;
}

// weight[j] += s[j] * w over the keys j <= last (a row's softmax weights into the block row's).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void add_weights(const float* s,
                                                                     std::int64_t last, float w,
                                                                     float* weight) {
#pragma omp simd
  for (std::int64_t j = 0; j <= last; ++j) weight[j] += s[j] * w;
}

// The scores (log2 units) of query rows against every key of a head, for block_attention_mass and
// block_value_mass: the keys transposed per head, [H][D][N_k], so a query row's scores are D
// axpy passes over them.
struct score_source {
  std::int64_t heads, nq, nk, d, block, qb, kb;
  float s2;  // the scale times log2 e
  cpu::f32_operand qf;
  std::vector<float> kt;

  score_source(const tensor_view& q, const tensor_view& k, std::int64_t g, double scale,
               const char* op)
      : heads(q.heads), nq(q.rows), nk(k.rows), d(q.dim), block(g) {
    TRISPARSE_EXPECTS_INPUT(block >= 1, "block must be >= 1, got " + std::to_string(block));
    TRISPARSE_EXPECTS_INPUT(q.where == device_kind::cpu && k.where == device_kind::cpu,
                            std::string(op) + ": q and k must be on the CPU");
    TRISPARSE_EXPECTS_INPUT(
        k.heads == q.heads && k.dim == q.dim,
        "q and k must have the same heads and head dim: q " + q.describe() + ", k " + k.describe());
    qb = (nq + block - 1) / block;
    kb = (nk + block - 1) / block;
    s2 = static_cast<float>((scale > 0.0 ? scale : 1.0 / std::sqrt(double(d))) *
                            std::numbers::log2e);
    qf = cpu::as_f32(q);
    const cpu::f32_operand kf = cpu::as_f32(k);
    kt.resize(static_cast<std::size_t>(heads * d * nk));
#pragma omp parallel for collapse(2) schedule(static)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t j = 0; j < nk; ++j)
        for (std::int64_t x = 0; x < d; ++x) kt[(h * d + x) * nk + j] = kf.row(j, h)[x];
  }

  // s[a * nk + j]: the scores of query rows i0 .. i0 + rows - 1 of head h (rows <= kRows; qs
  // holds kRows * d floats of scratch), a chunk of keys at a time.
  void scores(std::int64_t h, std::int64_t i0, std::int64_t rows, float* qs, float* s) const {
    for (std::int64_t a = 0; a < rows; ++a)
      for (std::int64_t x = 0; x < d; ++x) qs[a * d + x] = qf.row(i0 + a, h)[x] * s2;
    for (std::int64_t j0 = 0; j0 < nk; j0 += kKeys) {
      score_chunk(qs, rows, d, &kt[static_cast<std::size_t>(h * d * nk + j0)], nk,
                  std::min(kKeys, nk - j0), s + j0, nk);
    }
  }

  // The query rows of block row r (the last one may be partial).
  std::int64_t rows_of(std::int64_t r) const { return std::min(nq, (r + 1) * block) - r * block; }

  // visit(scores, last, top) for each query row of block row r of head h that sees a key (causal:
  // aligned at the bottom right): its scores (a row of s, writable), its last key and its highest
  // score. qs and s as scores() takes them.
  template <class Visit>
  void visit_rows(std::int64_t h, std::int64_t r, bool causal, float* qs, float* s,
                  Visit&& visit) const {
    const std::int64_t i1 = std::min(nq, (r + 1) * block);
    for (std::int64_t i0 = r * block; i0 < i1; i0 += kRows) {
      const std::int64_t rows = std::min(kRows, i1 - i0);
      scores(h, i0, rows, qs, s);
      for (std::int64_t a = 0; a < rows; ++a) {
        const std::int64_t i = i0 + a;
        const std::int64_t last = causal ? std::min(nk - 1, i + (nk - nq)) : nk - 1;
        if (last < 0) continue;  // no key: no mass
        float* sr = s + a * nk;
        visit(sr, last, *std::max_element(sr, sr + last + 1));
      }
    }
  }
};

// Whether the keep rules force block (r, c): the diagonal, the band, the global rows and columns.
bool forced_block(const prune_options& o, std::int64_t r, std::int64_t c) {
  return ((o.keep_diagonal || o.window > 0) && std::abs(r - c) <= o.window) ||
         (o.global_blocks > 0 && (c < o.global_blocks || r < o.global_blocks));
}

}  // namespace

void prune_options::check() const {
  TRISPARSE_EXPECTS_INPUT(
      method == "row" || method == "global" || method == "threshold" || method == "output",
      "prune method must be row, global, threshold or output, not '" + method + "'");
  TRISPARSE_EXPECTS_INPUT(sparsity >= 0.0 && sparsity < 1.0,
                          "sparsity must be in [0, 1), got " + std::to_string(sparsity));
  TRISPARSE_EXPECTS_INPUT(top_p > 0.0 && top_p <= 1.0,
                          "top_p must be in (0, 1], got " + std::to_string(top_p));
  TRISPARSE_EXPECTS_INPUT(window >= 0 && global_blocks >= 0,
                          "window and global_blocks must be >= 0");
}

std::vector<double> block_attention_mass(const tensor_view& q, const tensor_view& k,
                                         std::int64_t block, bool causal, double scale) {
  const score_source src(q, k, block, scale, "block_attention_mass");
  const std::int64_t heads = src.heads, nk = src.nk, qb = src.qb, kb = src.kb;
  std::vector<double> mass(static_cast<std::size_t>(heads * qb * kb), 0.0);
#pragma omp parallel
  {
    std::vector<float> s(static_cast<std::size_t>(kRows * nk)),
        qs(static_cast<std::size_t>(kRows * src.d));
    std::vector<double> sums(static_cast<std::size_t>(kb));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < heads * qb; ++task) {
      const std::int64_t h = task / qb, r = task % qb;
      const auto rows = static_cast<double>(src.rows_of(r));
      double* out = mass.data() + task * kb;
      src.visit_rows(
          h, r, causal, qs.data(), s.data(), [&](float* sr, std::int64_t last, float top) {
            std::fill(sums.begin(), sums.end(), 0.0);
            const double w = 1.0 / (block_sums(sr, last, block, top, sums.data()) * rows);
            for (std::int64_t c = 0; c < kb; ++c) out[c] += sums[static_cast<std::size_t>(c)] * w;
          });
    }
  }
  return mass;
}

block_value_statistics block_value_mass(const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, std::int64_t block, bool causal,
                                        double scale) {
  const score_source src(q, k, block, scale, "block_value_mass");
  TRISPARSE_EXPECTS_INPUT(
      v.where == device_kind::cpu && v.heads == k.heads && v.rows == k.rows,
      "v must be [N_k, H, Dv] on the CPU as k: v " + v.describe() + ", k " + k.describe());
  const std::int64_t heads = src.heads, nk = src.nk, qb = src.qb, kb = src.kb;
  block_value_statistics st{.heads = heads, .qb = qb, .kb = kb, .dv = v.dim};
  const std::int64_t dv = st.dv;
  st.mass.assign(static_cast<std::size_t>(heads * qb * kb), 0.0);
  st.value.assign(static_cast<std::size_t>(heads * qb * kb * dv), 0.0);
  const cpu::f32_operand vf = cpu::as_f32(v);
#pragma omp parallel
  {
    std::vector<float> s(static_cast<std::size_t>(kRows * nk)),
        qs(static_cast<std::size_t>(kRows * src.d));
    std::vector<float> weight(static_cast<std::size_t>(nk));  // each key's, over the block row
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < heads * qb; ++task) {
      const std::int64_t h = task / qb, r = task % qb;
      const auto rows = static_cast<double>(src.rows_of(r));
      std::fill(weight.begin(), weight.end(), 0.f);
      src.visit_rows(h, r, causal, qs.data(), s.data(),
                     [&](float* sr, std::int64_t last, float top) {
                       const double w = 1.0 / (key_weights(sr, last, top) * rows);
                       add_weights(sr, last, static_cast<float>(w), weight.data());
                     });
      // The block row's weights per key into each block's mass and value sum.
      double* mass = st.mass.data() + task * kb;
      double* value = st.value.data() + task * kb * dv;
      for (std::int64_t j = 0; j < nk; ++j) {
        const double wj = weight[static_cast<std::size_t>(j)];
        if (wj == 0.0) continue;  // keys past the causal limit of every row
        const std::int64_t c = j / block;
        mass[c] += wj;
        const float* vr = vf.row(j, h);
        for (std::int64_t x = 0; x < dv; ++x) value[c * dv + x] += wj * vr[x];
      }
    }
  }
  return st;
}

std::vector<std::uint8_t> prune_blocks(const std::vector<double>& importance, std::int64_t heads,
                                       std::int64_t qb, std::int64_t kb, const prune_options& o) {
  o.check();
  TRISPARSE_EXPECTS_INPUT(
      static_cast<std::int64_t>(importance.size()) == heads * qb * kb,
      "importance holds " + std::to_string(importance.size()) +
          " values, not heads x query blocks x key blocks = " + std::to_string(heads * qb * kb));
  TRISPARSE_EXPECTS_INPUT(o.method != "output",
                          "prune method 'output' needs the blocks' value sums: "
                          "prune_blocks_by_output");
  const auto forced = [&](std::int64_t r, std::int64_t c) { return forced_block(o, r, c); };
  std::vector<std::uint8_t> keep(importance.size(), 0);
  if (o.method != "threshold") {  // "row", "global": the learner's prune on the CPU
    const auto forced_rc = std::make_unique<bool[]>(static_cast<std::size_t>(qb * kb));
    for (std::int64_t r = 0; r < qb; ++r)
      for (std::int64_t c = 0; c < kb; ++c) forced_rc[r * kb + c] = forced(r, c);
    const auto kept = std::make_unique<bool[]>(importance.size());
    block_prune_args a;
    a.importance = importance.data();
    a.forced = forced_rc.get();
    a.keep = kept.get();
    a.heads = heads;
    a.qb = qb;
    a.kb = kb;
    a.scope = o.method == "global" ? prune_scope::global : prune_scope::row;
    a.budget = prune_budget(o.sparsity, a.scope == prune_scope::global ? qb * kb : kb);
    prune_block_importance(a);
    std::copy(kept.get(), kept.get() + importance.size(), keep.begin());
    return keep;
  }
  const auto at = [&](std::int64_t h, std::int64_t r, std::int64_t c) {
    return static_cast<std::size_t>((h * qb + r) * kb + c);
  };
  std::vector<std::int64_t> order;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t r = 0; r < qb; ++r) {  // the fewest blocks reaching top_p of the row's mass
      const auto imp = [&](std::int64_t c) { return std::max(0.0, importance[at(h, r, c)]); };
      double row = 0.0;
      for (std::int64_t c = 0; c < kb; ++c) row += imp(c);
      order.resize(static_cast<std::size_t>(kb));  // highest first, ties to the lower index
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::int64_t x, std::int64_t y) { return imp(x) > imp(y); });
      double before = 0.0;
      for (const std::int64_t c : order) {
        if (!(before < o.top_p * row)) break;
        keep[at(h, r, c)] = 1;
        before += imp(c);
      }
    }
    for (std::int64_t r = 0; r < qb; ++r)
      for (std::int64_t c = 0; c < kb; ++c)
        if (forced(r, c)) keep[at(h, r, c)] = 1;
  }
  return keep;
}

std::vector<std::uint8_t> prune_blocks_by_output(std::span<const double> mass,
                                                 std::span<const double> value, std::int64_t heads,
                                                 std::int64_t qb, std::int64_t kb, std::int64_t dv,
                                                 const prune_options& o, bool causal) {
  o.check();
  TRISPARSE_EXPECTS_INPUT(static_cast<std::int64_t>(mass.size()) == heads * qb * kb &&
                              static_cast<std::int64_t>(value.size()) == heads * qb * kb * dv,
                          "block statistics: " + std::to_string(mass.size()) + " masses and " +
                              std::to_string(value.size()) + " value sums for " +
                              std::to_string(heads) + " x " + std::to_string(qb) + " x " +
                              std::to_string(kb) + " blocks of " + std::to_string(dv));
  constexpr double tiny = std::numeric_limits<double>::min();
  std::vector<std::uint8_t> keep(mass.size(), 0);
#pragma omp parallel
  {
    std::vector<double> target(static_cast<std::size_t>(dv)), kept_u(target.size());
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < heads * qb; ++task) {
      const std::int64_t r = task % qb;
      const double* m = mass.data() + task * kb;
      const double* u = value.data() + task * kb * dv;
      std::uint8_t* kept = keep.data() + task * kb;
      // The row's full output, and the keep rules' blocks first.
      std::fill(target.begin(), target.end(), 0.0);
      std::fill(kept_u.begin(), kept_u.end(), 0.0);
      double total = 0.0, kept_m = 0.0;
      std::int64_t count = 0;
      for (std::int64_t c = 0; c < kb; ++c) {
        total += m[c];
        for (std::int64_t x = 0; x < dv; ++x) target[x] += u[c * dv + x];
        if (forced_block(o, r, c)) {
          kept[c] = 1;
          ++count;
          kept_m += m[c];
          for (std::int64_t x = 0; x < dv; ++x) kept_u[x] += u[c * dv + x];
        }
      }
      for (double& t : target) t /= std::max(total, tiny);
      const std::int64_t seen = causal ? std::clamp(r + 1 + kb - qb, std::int64_t{1}, kb) : kb;
      const auto budget = prune_budget(o.sparsity, seen);
      // One block at a time: the one whose addition brings the renormalised output nearest.
      for (; count < budget; ++count) {
        std::int64_t best = -1;
        double least = std::numeric_limits<double>::infinity();
        for (std::int64_t c = 0; c < kb; ++c) {
          if (kept[c] != 0 || !(m[c] > 0.0)) continue;  // no mass: never worth a slot
          const double denom = std::max(kept_m + m[c], tiny);
          double err = 0.0;
          for (std::int64_t x = 0; x < dv; ++x) {
            const double e = (kept_u[x] + u[c * dv + x]) / denom - target[x];
            err += e * e;
          }
          if (err < least) least = err, best = c;  // ties to the lower key block
        }
        if (best < 0) break;
        kept[best] = 1;
        kept_m += m[best];
        for (std::int64_t x = 0; x < dv; ++x) kept_u[x] += u[best * dv + x];
      }
    }
  }
  return keep;
}

namespace {

// The pattern of kept blocks `keep` [H][qb][kb] over rows x cols elements, and how it was made.
block_pattern pattern_of(const std::vector<std::uint8_t>& keep, std::int64_t heads,
                         std::int64_t block, std::int64_t rows, std::int64_t cols,
                         const prune_options& options, bool causal, const char* from) {
  const std::int64_t qb = (rows + block - 1) / block, kb = (cols + block - 1) / block;
  block_pattern p;
  p.block = block;
  p.rows = rows;
  p.cols = cols;
  for (std::int64_t h = 0; h < heads; ++h) {
    csr_graph g{.rows = qb, .cols = kb};
    g.row_ptr = {0};
    for (std::int64_t r = 0; r < qb; ++r) {
      for (std::int64_t c = 0; c < kb; ++c)
        if (keep[static_cast<std::size_t>((h * qb + r) * kb + c)] != 0)
          g.col_idx.push_back(static_cast<std::int32_t>(c));
      g.row_ptr.push_back(g.nnz());
    }
    p.heads.push_back(std::move(g));
  }
  // std::to_string and to_chars, not an ostream: iostreams crashed inside this call in the
  // GPU machine's Python (a locale facet of another libstdc++ in the process).
  const auto number = [](double x) {
    std::array<char, 32> buf{};
    const auto end = std::to_chars(buf.data(), buf.data() + buf.size(), x).ptr;
    return std::string(buf.data(), end);
  };
  std::string made = std::string("learned from ") + from + " of " + std::to_string(rows) +
                     " queries x " + std::to_string(cols) + " keys, " + std::to_string(heads) +
                     " heads" + (causal ? ", causal" : "") + "; prune " + options.method +
                     " sparsity=" + number(options.sparsity);
  if (options.method == "threshold") made += " top_p=" + number(options.top_p);
  made += " keep_diagonal=" + std::to_string(int{options.keep_diagonal}) +
          " window=" + std::to_string(options.window) +
          " global_blocks=" + std::to_string(options.global_blocks);
  p.made_by = std::move(made);
  p.check();
  return p;
}

}  // namespace

block_pattern learn_block_pattern(const tensor_view& q, const tensor_view& k, std::int64_t block,
                                  const prune_options& options, bool causal,
                                  const std::optional<tensor_view>& v) {
  TRISPARSE_EXPECTS_INPUT(block >= 1, "block must be >= 1, got " + std::to_string(block));
  options.check();
  if (options.method == "output") {
    TRISPARSE_EXPECTS_INPUT(v.has_value(), "prune method 'output' needs the values v [N_k, H, Dv]");
    const block_value_statistics st = block_value_mass(q, k, *v, block, causal);
    const std::vector<std::uint8_t> keep =
        prune_blocks_by_output(st.mass, st.value, st.heads, st.qb, st.kb, st.dv, options, causal);
    return pattern_of(keep, q.heads, block, q.rows, k.rows, options, causal,
                      "attention mass and values");
  }
  const std::int64_t qb = (q.rows + block - 1) / block, kb = (k.rows + block - 1) / block;
  const std::vector<double> mass = block_attention_mass(q, k, block, causal);
  return pattern_of(prune_blocks(mass, q.heads, qb, kb, options), q.heads, block, q.rows, k.rows,
                    options, causal, "attention mass");
}

}  // namespace trisparse
