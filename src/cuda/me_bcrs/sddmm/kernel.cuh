#pragma once
// SDDMM over ME-BCRS with swap-and-transpose: for 16 vectors of a window (two 8-vector blocks),
// S^T (16 vectors x 8 rows) = Y_cols (16 x d) X_window^T (d x 8), so the window's 8 rows are the
// MMA's n = 8 and the gathered rows of Y the m = 16. S goes straight into the slot layout the
// SpMM reads (the paper's output splitting), scaled and masked by the pattern's values; slots
// without an entry get 0. One warp computes one work item for one head.
//
// Thread mapping (lane = 4 g + t): the reduction dimension d is walked in chunks of 32, thread t
// owning d [8t, 8t + 8) of each chunk (one 16-byte load of 16-bit rows) and feeding those
// positions to the MMA's k slots in an order both operands share. X's window rows stay in
// registers for d <= 32 kChunks; longer d is walked in passes that reload them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/arch/mma.cuh"
#include "../../common/fragments.cuh"
#include "../params.hpp"
#include "../window.cuh"

namespace trisparse::cuda::me_bcrs {

inline constexpr int kSddmmWarps = 4;

template <class T>
struct sddmm_mma {  // 16-bit: two m16n8k16 steps per 32-d chunk (`split` is for f32 only)
  __device__ __forceinline__ static void chunk(float (&acc)[4], const frags::frag<T, 8>& ya,
                                               const frags::frag<T, 8>& yb,
                                               const frags::frag<T, 8>& x, bool /*split*/) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const std::uint32_t a[4] = {ya.r[2 * k], yb.r[2 * k], ya.r[2 * k + 1], yb.r[2 * k + 1]};
      const std::uint32_t b[2] = {x.r[2 * k], x.r[2 * k + 1]};
      arch::mma_16x8x16_f32<T>(acc, a, b);
    }
  }
};

// f32 as tf32: four m16n8k8 steps per 32-d chunk. split: each operand as a tf32 high part plus
// its (exact) remainder rounded to tf32, and three products per step -- low x high, high x low,
// high x high (the small ones first) -- for about float32 accuracy at three times the MMAs.
template <>
struct sddmm_mma<float> {
  __device__ __forceinline__ static void chunk(float (&acc)[4], const frags::frag<float, 8>& ya,
                                               const frags::frag<float, 8>& yb,
                                               const frags::frag<float, 8>& x, bool split) {
    const auto tf = [](std::uint32_t bits) { return arch::to_tf32(__uint_as_float(bits)); };
    const auto hi = [](std::uint32_t bits) {
      return __float_as_uint(arch::tf32_high(__uint_as_float(bits)));
    };
    const auto lo = [](std::uint32_t bits) {
      const float v = __uint_as_float(bits);
      return arch::to_tf32(v - arch::tf32_high(v));
    };
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t ra[4] = {ya.r[2 * k], yb.r[2 * k], ya.r[2 * k + 1], yb.r[2 * k + 1]};
      const std::uint32_t rb[2] = {x.r[2 * k], x.r[2 * k + 1]};
      if (split) {
        const std::uint32_t a_hi[4] = {hi(ra[0]), hi(ra[1]), hi(ra[2]), hi(ra[3])};
        const std::uint32_t a_lo[4] = {lo(ra[0]), lo(ra[1]), lo(ra[2]), lo(ra[3])};
        const std::uint32_t b_hi[2] = {hi(rb[0]), hi(rb[1])};
        const std::uint32_t b_lo[2] = {lo(rb[0]), lo(rb[1])};
        arch::mma_16x8x8_f32_tf32(acc, a_lo, b_hi);
        arch::mma_16x8x8_f32_tf32(acc, a_hi, b_lo);
        arch::mma_16x8x8_f32_tf32(acc, a_hi, b_hi);
      } else {
        const std::uint32_t a[4] = {tf(ra[0]), tf(ra[1]), tf(ra[2]), tf(ra[3])};
        const std::uint32_t b[2] = {tf(rb[0]), tf(rb[1])};
        arch::mma_16x8x8_f32_tf32(acc, a, b);
      }
    }
  }
};

/// 16-bit 8x1 kernels at d <= 32 are held to 64 registers (8 blocks of 4 warps per SM): they are
/// latency-bound, and warps in flight set their speed.
template <class T, int kHeight, int kChunks>
constexpr int sddmm_min_blocks() {
  return sizeof(T) == 2 && kHeight == 8 && kChunks == 1 ? 8 : 0;  // 0: no bound
}

template <class T, class O, int kHeight, int kChunks>
__global__ void __launch_bounds__(kSddmmWarps * 32, sddmm_min_blocks<T, kHeight, kChunks>())
    sddmm_kernel(const sddmm_params p) {
  constexpr int kSub = kHeight / 8;
  const int lane = static_cast<int>(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  const std::int64_t task = blockIdx.x * std::int64_t{kSddmmWarps} + threadIdx.x / 32;
  if (task >= p.f.num_items * p.heads) return;
  const work_item it = p.f.items[task / p.heads];
  const auto h = static_cast<int>(task % p.heads);
  const std::int64_t start = p.f.row_ptr[it.window];
  const std::int64_t nvec = p.f.row_ptr[it.window + 1] - start;
  const std::int64_t block0 = p.f.block_offset[it.window];
  const std::int64_t row0 = std::int64_t{it.window} * kHeight;
  const T* x = static_cast<const T*>(p.x.data) + h * p.x.head;
  const T* y = static_cast<const T*>(p.y.data) + h * p.y.head;
  O* out = static_cast<O*>(p.out.data) + h * p.out.head;
  constexpr std::int64_t kPass = 32 * kChunks;  // d per register pass
  const std::int64_t passes = (p.d + kPass - 1) / kPass;

  frags::frag<T, 8> xr[kSub][kChunks];
  const auto load_x = [&](std::int64_t pass) {
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      const std::int64_t row = row0 + 8 * s + g;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const std::int64_t d0 = pass * kPass + 32 * c + 8 * t;
        const int valid = row < p.f.rows ? static_cast<int>(max(std::int64_t{0}, p.d - d0)) : 0;
        frags::load_frag(x + (row < p.f.rows ? pattern_row(p.f, row) : 0) * p.x.row + d0, valid,
                         p.aligned, xr[s][c]);
      }
    }
  };
  if (passes == 1) load_x(0);

  // Tiles of 16 vectors: blocks (blk, blk + 1) of the item; vectors va (rows g) and vb (g + 8).
  // The entry masks (and for valued patterns the values) of the thread's slots are loaded with
  // the column ids, so that they arrive while Y's rows do and the stores wait for nothing else.
  constexpr int kOut = kSub * 2;  // slots per vector of the thread: rows 8s + 2t + odd
  for (std::int32_t blk = it.begin; blk < it.end; blk += 2) {
    const std::int64_t first = (blk - block0) * 8;
    const bool has_b = blk + 1 < it.end;
    // Per half (block blk + half): its vector g, the slot of row r being base + r * width.
    std::int64_t base[2];
    int width[2];
    bool live[2];
    int col[2];
    std::uint32_t mask[2];
    float value[2][kOut];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t block = first + 8 * half;
      width[half] = static_cast<int>(min(std::int64_t{8}, nvec - block));
      live[half] = (half == 0 || has_b) && g < width[half];
      base[half] = (start + block) * kHeight + g;
      col[half] = live[half] ? p.f.col_idx[start + block + g] : -1;
      mask[half] = live[half] ? p.f.mask[start + block + g] : 0u;
#pragma unroll
      for (int o = 0; o < kOut; ++o) {
        const int r = 8 * (o / 2) + 2 * t + o % 2;
        value[half][o] =
            p.f.binary || !live[half] ? 1.0f : p.f.values[base[half] + r * width[half]];
      }
    }
    float acc[kSub][4] = {};
    for (std::int64_t pass = 0; pass < passes; ++pass) {
      if (passes > 1) load_x(pass);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const std::int64_t d0 = pass * kPass + 32 * c + 8 * t;
        const int valid = static_cast<int>(max(std::int64_t{0}, p.d - d0));
        frags::frag<T, 8> ya, yb;
        frags::load_frag(y + std::int64_t{col[0] < 0 ? 0 : col[0]} * p.y.row + d0,
                         col[0] < 0 ? 0 : valid, p.aligned, ya);
        frags::load_frag(y + std::int64_t{col[1] < 0 ? 0 : col[1]} * p.y.row + d0,
                         col[1] < 0 ? 0 : valid, p.aligned, yb);
#pragma unroll
        for (int s = 0; s < kSub; ++s) sddmm_mma<T>::chunk(acc[s], ya, yb, xr[s][c], p.split_f32);
      }
    }
    // acc[s] = S^T(vector va: rows 8s + 2t, +1; vector vb: rows 8s + 2t, +1).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (!live[half]) continue;
#pragma unroll
      for (int o = 0; o < kOut; ++o) {
        const int r = 8 * (o / 2) + 2 * t + o % 2;
        const float v = (mask[half] >> r & 1u) != 0u
                            ? p.scale * value[half][o] * acc[o / 2][2 * half + o % 2]
                            : 0.0f;
        out[base[half] + r * width[half]] = frags::from_float<O>(v);
      }
    }
  }
}

}  // namespace trisparse::cuda::me_bcrs
