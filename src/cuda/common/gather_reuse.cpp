#include "gather_reuse.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

namespace trisparse::cuda {

namespace {

// Bin of a distance d >= 1: its octave o = floor(log2 d) and the quarter of [2^o, 2^(o+1)) it
// lies in.
int bin_of(std::int64_t d) {
  const int octave = static_cast<int>(std::bit_width(static_cast<std::uint64_t>(d))) - 1;
  const auto quarter = static_cast<int>(((static_cast<std::uint64_t>(d) << 2) >> octave) & 3u);
  return std::min(gather_reuse::kBins - 1, 4 * octave + quarter);
}

// A distance in the middle of bin b.
double distance_of(int bin) { return std::ldexp(1.0 + ((bin % 4) + 0.5) / 4.0, bin / 4); }

}  // namespace

gather_reuse gather_reuse_of(const csr_graph& pattern, std::span<const std::int64_t> order) {
  gather_reuse r;
  r.rows = pattern.rows;
  r.cols = pattern.cols;
  r.windows = (pattern.rows + 15) / 16;
  std::vector<std::int64_t> last(static_cast<std::size_t>(pattern.cols), -1);
  for (std::int64_t w = 0; w < r.windows; ++w) {
    for (std::int64_t i = w * 16; i < std::min(pattern.rows, w * 16 + 16); ++i) {
      const std::int64_t row = order.empty() ? i : order[static_cast<std::size_t>(i)];
      for (std::int64_t e = pattern.row_ptr[row]; e < pattern.row_ptr[row + 1]; ++e) {
        std::int64_t& seen = last[static_cast<std::size_t>(pattern.col_idx[e])];
        if (seen == w) continue;
        if (seen >= 0) ++r.by_distance[static_cast<std::size_t>(bin_of(w - seen))];
        seen = w;
        ++r.gathers;
      }
    }
  }
  return r;
}

double heads_outer_saving(const gather_reuse& reuse, std::int64_t heads, std::int64_t head_dim,
                          std::int64_t element_bytes, std::int64_t l2_bytes) {
  if (reuse.gathers == 0 || heads <= 1) return 0.0;
  const double cols = static_cast<double>(reuse.cols);
  const double per_window = static_cast<double>(reuse.gathers) / static_cast<double>(reuse.windows);
  const double row_bytes = 2.0 * static_cast<double>(head_dim * element_bytes);  // two tensors
  const double budget = kReuseL2Share * static_cast<double>(l2_bytes);
  // What one head's tasks touch over d windows: the distinct gathered rows and the windows' own.
  const auto touched = [&](double d) {
    return row_bytes * (cols * -std::expm1(-d * per_window / cols) + 16.0 * d);
  };
  double saved = 0;
  for (int b = 0; b < gather_reuse::kBins; ++b) {
    if (reuse.by_distance[static_cast<std::size_t>(b)] == 0) continue;
    const double one = touched(distance_of(b));
    if (one <= budget && static_cast<double>(heads) * one > budget)
      saved += static_cast<double>(reuse.by_distance[static_cast<std::size_t>(b)]);
  }
  return saved / static_cast<double>(reuse.rows + reuse.gathers);
}

bool heads_outer(head_order asked, const gather_reuse& reuse, std::int64_t heads,
                 std::int64_t head_dim, std::int64_t element_bytes, std::int64_t l2_bytes) {
  if (heads <= 1 || asked == head_order::by_window) return false;
  return asked == head_order::by_head ||
         heads_outer_saving(reuse, heads, head_dim, element_bytes, l2_bytes) >= kHeadsOuterSaving;
}

}  // namespace trisparse::cuda
