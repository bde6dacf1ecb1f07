#pragma once
// Row softmax over the row-interleaved BCSR scores (base-2 units), in place: a warp per part of
// rows of about equal weight (the report's static partitioning by row weight); each scalar row is
// contiguous, so both passes (an online max and sum, then the normalised weights) are coalesced.
// Rows with no kept key (all -inf) get zeros.
#include <cstdint>

#include "../../../common/online_softmax.cuh"
#include "../../../formats/interleaved_bcsr.cuh"

namespace trisparse::cuda::interleaved {

constexpr int kSoftmaxWarps = 8;

__global__ void __launch_bounds__(kSoftmaxWarps * 32) softmax_kernel(params p, work w) {
  const std::int64_t i = std::int64_t{blockIdx.x} * kSoftmaxWarps + threadIdx.x / 32;
  if (i >= items_in_launch(p, w)) return;
  const item_at at = decode<part>(p, w, i);
  const auto* parts = static_cast<const part*>(w.items);
  const part to = parts[at.index + 1];
  float* base = p.scores + at.slot * p.slot;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (part at_row = parts[at.index]; at_row.row < to.row || at_row.t < to.t;) {
    const block_row r = p.rows[at_row.row];
    const int width = r.count * p.block;
    float* s = base + r.value0 + std::int64_t{at_row.t} * width;
    float m = kNegInf, sum = 0.0f;
    for (int x = lane; x < width; x += 32) {
      const float v = s[x];
      if (v > m) {
        sum = sum * exp2_approx(m - v) + 1.0f;
        m = v;
      } else if (v != kNegInf) {
        sum += exp2_approx(v - m);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float m2 = __shfl_xor_sync(~0u, m, o), s2 = __shfl_xor_sync(~0u, sum, o);
      const float mn = fmaxf(m, m2);
      if (mn != kNegInf) sum = sum * exp2_approx(m - mn) + s2 * exp2_approx(m2 - mn);
      m = mn;
    }
    const float inv = m == kNegInf ? 0.0f : 1.0f / sum, mx = safe_max(m);
    for (int x = lane; x < width; x += 32) s[x] = exp2_approx(s[x] - mx) * inv;
    if (++at_row.t == r.rows) {
      ++at_row.row;
      at_row.t = 0;
    }
  }
}

}  // namespace trisparse::cuda::interleaved
