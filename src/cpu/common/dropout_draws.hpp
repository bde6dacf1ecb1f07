#pragma once
// Attention dropout's factors for the CPU engine's loops: the draws of trisparse/core/dropout.hpp
// (one Philox4x32-10 call per group of 4 x 2 (query, key) pairs), the last group remembered, so
// that a loop walking a row's keys in order draws each group once for the pairs it visits in a
// row. One per thread.
#include <algorithm>
#include <cstdint>

#include "compute_type.hpp"
#include "trisparse/core/dropout.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cpu {

class dropout_draws {
 public:
  explicit dropout_draws(const attention_dropout& d)
      : on_(d.p > 0),
        seed_(on_ ? d.state[0] : 0),
        offset_(on_ ? d.state[1] : 0),
        below_(on_ ? philox::drop_below16(d.p) : 0),
        scale_(on_ ? 1.0 / (1.0 - d.p) : 1.0) {}

  /// Pair (i, j)'s factor in head h (dropout_factor's): 0 or 1 / (1 - p); 1 without dropout.
  double factor(std::int64_t i, std::int64_t j, std::int32_t h) {
    if (!on_) return 1.0;
    const std::int64_t set = philox::query_set(i);
    if (set != group_i_ || (j >> 1) != group_j_ || h != head_) {
      words_ = philox::group(i, j, h, seed_, offset_);
      group_i_ = set;
      group_j_ = j >> 1;
      head_ = h;
    }
    return philox::pair_half(words_.x[philox::pair_word(i)], j) < below_ ? 0.0 : scale_;
  }

 private:
  bool on_;
  std::uint64_t seed_, offset_;
  std::uint32_t below_;
  double scale_;
  std::int64_t group_i_ = -1, group_j_ = -1;  // the group words_ holds
  std::int32_t head_ = -1;
  philox::words words_{};
};

/// Attention dropout's edge-keyed factors for the CPU engines: [n, H, 1] in T, row e's for input
/// edge index[e] (or e) in each head (edge_dropout_factor's draws, the CUDA kernels'), one Philox
/// call per edge and four heads (philox::edge_group). Read with no index.
template <class T>
host_tensor drawn_edge_keep(std::int64_t n, std::int64_t heads, const attention_dropout& d,
                            const std::int64_t* index) {
  host_tensor keep(dtype_of<T>, n, heads, 1);
  auto* f = reinterpret_cast<T*>(keep.data());
  const std::uint64_t seed = d.state[0], offset = d.state[1];
  const std::uint32_t below = philox::drop_below(d.p);
  const auto kept = static_cast<T>(1.0 / (1.0 - d.p));
#pragma omp parallel for schedule(static)
  for (std::int64_t e = 0; e < n; ++e) {
    const std::int64_t u = index != nullptr ? index[e] : e;
    for (std::int64_t h0 = 0; h0 < heads; h0 += 4) {
      const philox::words w = philox::edge_group(u, static_cast<std::int32_t>(h0), seed, offset);
      for (std::int64_t h = h0; h < std::min(h0 + 4, heads); ++h)
        f[e * heads + h] = w.x[h - h0] < below ? T{0} : kept;
    }
  }
  return keep;
}

}  // namespace trisparse::cpu
