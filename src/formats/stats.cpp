#include "trisparse/formats/stats.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <tuple>

namespace trisparse {

namespace {
std::pair<double, double> mean_cv(const std::vector<double>& x) {
  if (x.empty()) return {0, 0};
  double s = 0, s2 = 0;
  for (const double v : x) {
    s += v;
    s2 += v * v;
  }
  const double n = static_cast<double>(x.size()), mean = s / n;
  const double sd = std::sqrt(std::max(0.0, s2 / n - mean * mean));
  return {mean, mean > 0 ? sd / mean : 0};
}

// Non-empty r x c blocks of the uncompacted matrix (plain BCSR's b).
std::int64_t plain_blocks(const csr_graph& g, int r, int c) {
  std::int64_t b = 0;
  std::vector<std::int32_t> cols;
  for (std::int64_t w = 0; w * r < g.rows; ++w) {
    cols.assign(g.col_idx.begin() + g.row_ptr[w * r],
                g.col_idx.begin() + g.row_ptr[std::min(g.rows, (w + 1) * r)]);
    for (auto& x : cols) x /= c;
    std::sort(cols.begin(), cols.end());
    b += std::unique(cols.begin(), cols.end()) - cols.begin();
  }
  return b;
}
}  // namespace

bsb_stats compute_stats(const bsb& f, std::int64_t nnz) {
  bsb_stats s;
  s.tcb_cols = f.tcb_cols;
  s.windows = f.windows();
  s.tcbs = f.tcbs();
  s.nnz = nnz;
  std::vector<double> per_window(s.windows), per_tcb(s.tcbs);
  std::vector<std::int64_t> counts(s.windows);
  for (std::int64_t w = 0; w < s.windows; ++w) {
    counts[w] = f.window_tcbs(w);
    per_window[w] = static_cast<double>(counts[w]);
  }
  const int words = f.words_per_tcb();
  for (std::int64_t t = 0; t < s.tcbs; ++t) {
    int bits = 0;
    for (int k = 0; k < words; ++k) bits += std::popcount(f.bitmap[t * words + k]);
    per_tcb[t] = bits;
  }
  std::tie(s.tcb_per_window_mean, s.tcb_per_window_cv) = mean_cv(per_window);
  std::tie(s.nnz_per_tcb_mean, s.nnz_per_tcb_cv) = mean_cv(per_tcb);
  std::sort(counts.begin(), counts.end());
  if (!counts.empty()) {
    s.max_tcbs_in_window = counts.back();
    const auto n = static_cast<std::int64_t>(counts.size());
    for (int d = 0; d < 10; ++d) {
      const std::int64_t lo = d * n / 10, hi = std::max(lo + 1, (d + 1) * n / 10);
      s.deciles.emplace_back(counts[std::min(lo, n - 1)], counts[std::min(hi, n) - 1]);
    }
  }
  return s;
}

std::vector<footprint> table3_footprints(const csr_graph& g) {
  constexpr double r = 16, c = 8;
  const bsb f = build_bsb(g, 8);
  const auto n = static_cast<double>(g.rows);
  const auto z = static_cast<double>(g.nnz());
  const auto b = static_cast<double>(f.tcbs());
  const auto b_plain = static_cast<double>(plain_blocks(g, 16, 8));
  const auto bytes = [](double bits) { return static_cast<std::int64_t>(std::ceil(bits / 8)); };
  return {
      {"CSR", bytes(32 * (n + 2 * z)), false},
      {"SR-BCSR", bytes(32 * (2 * n / r + b * c + b * r * c)), false},
      {"ME-BCRS", bytes(32 * (n / r + b * c + b * r * c)), false},
      {"BCSR", bytes(32 * (n / r + b_plain + b_plain * r * c)), false},
      {"TCF", bytes(32 * (n / r + n + 3 * z)), true},
      {"ME-TCF", bytes(32 * (n / r + b + z) + 8 * z), true},
      {"BitTCF", bytes(32 * (n / r + b + z) + z), true},
      {"BSB", bytes(32 * (n / r + b * c) + b * r * c), true},
  };
}

}  // namespace trisparse
