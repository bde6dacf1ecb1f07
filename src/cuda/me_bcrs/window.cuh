#pragma once
// Where the ME-BCRS format keeps a window's values (src/cuda/formats/me_bcrs_build.cuh), on the
// device.
#include <cstdint>

#include "params.hpp"

namespace trisparse::cuda::me_bcrs {

/// Slot of row r of vector v (counted from the window's first vector) in a window of n vectors
/// starting at vector `start` (me_bcrs_build.cuh).
template <int kHeight>
__device__ __forceinline__ std::int64_t slot_of(std::int64_t start, std::int64_t n, std::int64_t v,
                                                int r) {
  const std::int64_t block = v / 8 * 8;
  const std::int64_t width = n - block < 8 ? n - block : 8;
  return (start + block) * kHeight + r * width + (v - block);
}

/// The pattern row (of x, c) that window row `row` stands for.
__device__ __forceinline__ std::int64_t pattern_row(const format_ref& f, std::int64_t row) {
  return f.row_map != nullptr ? __ldg(f.row_map + row) : row;
}

}  // namespace trisparse::cuda::me_bcrs
