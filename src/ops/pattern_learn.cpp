// Learning a block pattern offline (include/trisparse/ops/pattern_learn.hpp): exact block masses
// on the CPU, then pruning by the rules Python's prune_blocks applies.
#include "trisparse/ops/pattern_learn.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>

#include "../cpu/common/exp2.hpp"
#include "../cpu/common/online_softmax.hpp"
#include "trisparse/core/error.hpp"

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

}  // namespace

void prune_options::check() const {
  TRISPARSE_EXPECTS_INPUT(method == "row" || method == "global" || method == "threshold",
                          "prune method must be row, global or threshold, not '" + method + "'");
  TRISPARSE_EXPECTS_INPUT(sparsity >= 0.0 && sparsity < 1.0,
                          "sparsity must be in [0, 1), got " + std::to_string(sparsity));
  TRISPARSE_EXPECTS_INPUT(top_p > 0.0 && top_p <= 1.0,
                          "top_p must be in (0, 1], got " + std::to_string(top_p));
  TRISPARSE_EXPECTS_INPUT(window >= 0 && global_blocks >= 0,
                          "window and global_blocks must be >= 0");
}

std::vector<double> block_attention_mass(const tensor_view& q, const tensor_view& k,
                                         std::int64_t block, bool causal, double scale) {
  TRISPARSE_EXPECTS_INPUT(block >= 1, "block must be >= 1, got " + std::to_string(block));
  TRISPARSE_EXPECTS_INPUT(q.where == device_kind::cpu && k.where == device_kind::cpu,
                          "block_attention_mass: q and k must be on the CPU");
  TRISPARSE_EXPECTS_INPUT(
      k.heads == q.heads && k.dim == q.dim,
      "q and k must have the same heads and head dim: q " + q.describe() + ", k " + k.describe());
  const std::int64_t heads = q.heads, nq = q.rows, nk = k.rows, d = q.dim;
  const std::int64_t qb = (nq + block - 1) / block, kb = (nk + block - 1) / block;
  const float s2 =
      static_cast<float>((scale > 0.0 ? scale : 1.0 / std::sqrt(double(d))) * std::numbers::log2e);
  const cpu::f32_operand qf = cpu::as_f32(q), kf = cpu::as_f32(k);
  // Keys transposed per head, [H][D][N_k]: a query row's scores are D axpy passes over them.
  std::vector<float> kt(static_cast<std::size_t>(heads * d * nk));
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < nk; ++j)
      for (std::int64_t x = 0; x < d; ++x) kt[(h * d + x) * nk + j] = kf.row(j, h)[x];

  std::vector<double> mass(static_cast<std::size_t>(heads * qb * kb), 0.0);
#pragma omp parallel
  {
    std::vector<float> s(static_cast<std::size_t>(kRows * nk)),
        qs(static_cast<std::size_t>(kRows * d));
    std::vector<double> sums(static_cast<std::size_t>(kb));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < heads * qb; ++task) {
      const std::int64_t h = task / qb, r = task % qb;
      const std::int64_t i1 = std::min(nq, (r + 1) * block);
      double* out = mass.data() + task * kb;
      for (std::int64_t i0 = r * block; i0 < i1; i0 += kRows) {
        const std::int64_t rows = std::min(kRows, i1 - i0);
        // Scores (log2 units) of `rows` queries against every key, a chunk of keys at a time.
        for (std::int64_t a = 0; a < rows; ++a)
          for (std::int64_t x = 0; x < d; ++x) qs[a * d + x] = qf.row(i0 + a, h)[x] * s2;
        for (std::int64_t j0 = 0; j0 < nk; j0 += kKeys) {
          score_chunk(qs.data(), rows, d, &kt[h * d * nk + j0], nk, std::min(kKeys, nk - j0),
                      &s[j0], nk);
        }
        for (std::int64_t a = 0; a < rows; ++a) {
          const std::int64_t i = i0 + a;
          const std::int64_t last = causal ? std::min(nk - 1, i + (nk - nq)) : nk - 1;
          if (last < 0) continue;  // no key: no mass
          const float* sr = &s[a * nk];
          const float top = *std::max_element(sr, sr + last + 1);
          std::fill(sums.begin(), sums.end(), 0.0);
          const double total = block_sums(sr, last, block, top, sums.data());
          const double w = 1.0 / (total * static_cast<double>(i1 - r * block));
          for (std::int64_t c = 0; c < kb; ++c) out[c] += sums[static_cast<std::size_t>(c)] * w;
        }
      }
    }
  }
  return mass;
}

std::vector<std::uint8_t> prune_blocks(const std::vector<double>& importance, std::int64_t heads,
                                       std::int64_t qb, std::int64_t kb, const prune_options& o) {
  o.check();
  TRISPARSE_EXPECTS_INPUT(
      static_cast<std::int64_t>(importance.size()) == heads * qb * kb,
      "importance holds " + std::to_string(importance.size()) +
          " values, not heads x query blocks x key blocks = " + std::to_string(heads * qb * kb));
  const auto forced = [&](std::int64_t r, std::int64_t c) {
    return ((o.keep_diagonal || o.window > 0) && std::abs(r - c) <= o.window) ||
           (o.global_blocks > 0 && (c < o.global_blocks || r < o.global_blocks));
  };
  std::vector<std::uint8_t> keep(importance.size(), 0);
  const auto at = [&](std::int64_t h, std::int64_t r, std::int64_t c) {
    return static_cast<std::size_t>((h * qb + r) * kb + c);
  };
  // Ranks `n` candidates (index -> (r, c)) by score, highest first, ties to the lower index.
  std::vector<std::int64_t> order;
  const auto rank = [&](std::int64_t n, const auto& score) {
    order.resize(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int64_t a, std::int64_t b) { return score(a) > score(b); });
  };
  constexpr double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t h = 0; h < heads; ++h) {
    if (o.method == "global") {
      const auto budget =
          std::max<std::int64_t>(1, std::llrint((1.0 - o.sparsity) * static_cast<double>(qb * kb)));
      rank(qb * kb, [&](std::int64_t x) {
        return forced(x / kb, x % kb) ? inf : importance[at(h, x / kb, x % kb)];
      });
      for (std::int64_t x = 0; x < std::min(budget, qb * kb); ++x)
        keep[at(h, order[x] / kb, order[x] % kb)] = 1;
    } else {
      for (std::int64_t r = 0; r < qb; ++r) {
        if (o.method == "row") {
          const auto budget =
              std::max<std::int64_t>(1, std::llrint((1.0 - o.sparsity) * static_cast<double>(kb)));
          rank(kb, [&](std::int64_t c) { return forced(r, c) ? inf : importance[at(h, r, c)]; });
          for (std::int64_t x = 0; x < std::min(budget, kb); ++x) keep[at(h, r, order[x])] = 1;
        } else {  // threshold: the fewest blocks reaching top_p of the row's mass
          const auto imp = [&](std::int64_t c) { return std::max(0.0, importance[at(h, r, c)]); };
          double row = 0.0;
          for (std::int64_t c = 0; c < kb; ++c) row += imp(c);
          rank(kb, imp);
          double before = 0.0;
          for (const std::int64_t c : order) {
            if (!(before < o.top_p * row)) break;
            keep[at(h, r, c)] = 1;
            before += imp(c);
          }
        }
      }
    }
    for (std::int64_t r = 0; r < qb; ++r)
      for (std::int64_t c = 0; c < kb; ++c)
        if (forced(r, c)) keep[at(h, r, c)] = 1;
  }
  return keep;
}

block_pattern learn_block_pattern(const tensor_view& q, const tensor_view& k, std::int64_t block,
                                  const prune_options& options, bool causal) {
  options.check();
  const std::int64_t heads = q.heads;
  const std::int64_t qb = (q.rows + block - 1) / block, kb = (k.rows + block - 1) / block;
  const std::vector<double> mass = block_attention_mass(q, k, block, causal);
  const std::vector<std::uint8_t> keep = prune_blocks(mass, heads, qb, kb, options);
  block_pattern p;
  p.block = block;
  p.rows = q.rows;
  p.cols = k.rows;
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
  std::string made = "learned from attention mass of " + std::to_string(q.rows) + " queries x " +
                     std::to_string(k.rows) + " keys, " + std::to_string(heads) + " heads" +
                     (causal ? ", causal" : "") + "; prune " + options.method +
                     " sparsity=" + number(options.sparsity);
  if (options.method == "threshold") made += " top_p=" + number(options.top_p);
  made += " keep_diagonal=" + std::to_string(int{options.keep_diagonal}) +
          " window=" + std::to_string(options.window) +
          " global_blocks=" + std::to_string(options.global_blocks);
  p.made_by = std::move(made);
  p.check();
  return p;
}

}  // namespace trisparse
