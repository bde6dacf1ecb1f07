#pragma once
// Row softmax over ME-BCRS slot values: out = exp(s - max_row) / sum_row over each row's entries
// (max-stabilised, fp32), 0 in slots without an entry. One warp per work item and head; lane
// (q, r) = (lane / kHeight, lane % kHeight) visits vectors q, q + 32 / kHeight, ... of the item
// for window row r, keeping an online (max, sum); lanes of one row combine by shuffles.
// Windows split across items run in two launches: the first writes each share's (max, sum), the
// second combines a window's shares and writes its values.
#include <cmath>
#include <cstdint>
#include <numbers>

#include "../../common/fragments.cuh"
#include "../params.hpp"
#include "../window.cuh"

namespace trisparse::cuda::me_bcrs {

inline constexpr int kSoftmaxWarps = 4;
inline constexpr float kLog2e = std::numbers::log2e_v<float>;

struct row_stats {
  float m = -INFINITY;  // running max (-inf: no entry yet)
  float s = 0.0f;       // sum of exp(x - m)

  __device__ __forceinline__ void add(float x) {
    if (x > m) {
      s = s * exp2f((m - x) * kLog2e) + 1.0f;
      m = x;
    } else {
      s += exp2f((x - m) * kLog2e);
    }
  }
  __device__ __forceinline__ void merge(row_stats o) {
    if (o.m == m) {  // also both empty
      s += o.s;
    } else if (o.m > m) {
      s = s * exp2f((m - o.m) * kLog2e) + o.s;
      m = o.m;
    } else {
      s += o.s * exp2f((o.m - m) * kLog2e);
    }
  }
};

template <class In, class Out, int kHeight, bool kSecond>
__global__ void __launch_bounds__(kSoftmaxWarps * 32) softmax_kernel(const softmax_params p) {
  constexpr int kPhases = 32 / kHeight;
  const int lane = static_cast<int>(threadIdx.x % 32), r = lane % kHeight, q = lane / kHeight;
  const std::int64_t task = blockIdx.x * std::int64_t{kSoftmaxWarps} + threadIdx.x / 32;
  if (task >= p.f.num_items * p.heads) return;
  const work_item it = p.f.items[task / p.heads];
  if (kSecond && it.part < 0) return;
  const auto h = static_cast<int>(task % p.heads);
  const std::int64_t start = p.f.row_ptr[it.window];
  const std::int64_t nvec = p.f.row_ptr[it.window + 1] - start;
  const std::int64_t block0 = p.f.block_offset[it.window];
  const std::int64_t first = (it.begin - block0) * 8;
  const std::int64_t last = min(nvec, (it.end - block0) * std::int64_t{8});
  const In* in = static_cast<const In*>(p.in.data) + h * p.in.head;
  Out* out = static_cast<Out*>(p.out.data) + h * p.out.head;

  row_stats st;
  if (!kSecond) {
    for (std::int64_t v = first + q; v < last; v += kPhases) {
      if ((p.f.mask[start + v] >> r & 1u) != 0u)
        st.add(frags::to_float(in[slot_of<kHeight>(start, nvec, v, r)]));
    }
#pragma unroll
    for (int off = kHeight; off < 32; off *= 2) {
      row_stats o;
      o.m = __shfl_xor_sync(0xFFFFFFFFu, st.m, off);
      o.s = __shfl_xor_sync(0xFFFFFFFFu, st.s, off);
      st.merge(o);
    }
    if (it.part >= 0) {  // a share of a split window: its stats, for the second launch
      if (q == 0) {
        float* dst = p.part_stats + ((std::int64_t{it.part} * p.heads + h) * kHeight + r) * 2;
        dst[0] = st.m;
        dst[1] = st.s;
      }
      return;
    }
  } else {
    const split_window sw = p.f.splits[it.split];
    for (int i = 0; i < sw.parts; ++i) {
      const float* src =
          p.part_stats + ((std::int64_t{sw.first_part + i} * p.heads + h) * kHeight + r) * 2;
      row_stats o;
      o.m = src[0];
      o.s = src[1];
      st.merge(o);
    }
  }
  const float inv = st.s > 0.0f ? 1.0f / st.s : 0.0f;
  for (std::int64_t v = first + q; v < last; v += kPhases) {
    const std::int64_t slot = slot_of<kHeight>(start, nvec, v, r);
    const bool entry = (p.f.mask[start + v] >> r & 1u) != 0u;
    out[slot] = frags::from_float<Out>(
        entry ? exp2f((frags::to_float(in[slot]) - st.m) * kLog2e) * inv : 0.0f);
  }
}

}  // namespace trisparse::cuda::me_bcrs
