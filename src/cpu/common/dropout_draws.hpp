#pragma once
// Attention dropout's factors for the CPU engine's loops: the draws of trisparse/core/dropout.hpp
// (one Philox4x32-10 call per group of 4 x 2 (query, key) pairs), the last group remembered, so
// that a loop walking a row's keys in order draws each group once for the pairs it visits in a
// row. One per thread.
#include <cstdint>

#include "trisparse/core/dropout.hpp"

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

}  // namespace trisparse::cpu
