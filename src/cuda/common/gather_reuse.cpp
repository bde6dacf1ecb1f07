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

void settle_head_orders(gather_reuse& reuse, std::int64_t l2_bytes) {
  constexpr std::int64_t kMostHeads = 4096;
  for (std::size_t i = 0; i < reuse.min_heads.size(); ++i) {
    const std::int64_t dim = std::int64_t{32} << i;
    const auto enough = [&](std::int64_t heads) {
      return heads_outer_saving(reuse, heads, dim, 2, l2_bytes) >= kHeadsOuterSaving;
    };
    if (!enough(kMostHeads)) {
      reuse.min_heads[i] = 0;
      continue;
    }
    std::int64_t lo = 1, hi = kMostHeads;  // enough(hi), not enough(lo): one head saves nothing
    while (hi - lo > 1) {
      const std::int64_t mid = (lo + hi) / 2;
      (enough(mid) ? hi : lo) = mid;
    }
    reuse.min_heads[i] = hi;
  }
}

bool heads_outer(head_order asked, const gather_reuse& reuse, std::int64_t heads,
                 std::int64_t head_dim) {
  if (heads <= 1 || asked == head_order::by_window) return false;
  if (asked == head_order::by_head) return true;
  const int i = std::countr_zero(static_cast<std::uint64_t>(head_dim)) - 5;  // 32 << i
  if (head_dim <= 0 || !std::has_single_bit(static_cast<std::uint64_t>(head_dim)) || i < 0 ||
      i >= static_cast<int>(reuse.min_heads.size()))
    return false;
  const std::int64_t least = reuse.min_heads[static_cast<std::size_t>(i)];
  return least > 0 && heads >= least;
}

}  // namespace trisparse::cuda
