#pragma once
// The pooling: block means of Q and K as digit rows (params.hpp), by persistent warps.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "../../common/arch/copy.cuh"
#include "../../common/dependent_launch.cuh"
#include "tuning.hpp"

namespace trisparse::cuda::topk {

using arch::load_streaming;

// Persistent warps: warp w of the grid pools tasks w, w + warps, ... (task = block b of the plan's
// table, q_blocks query blocks first, and head h: task b heads + h), each alone (no barrier: a
// warp's reduction overlaps the others' loads). A head's row is chunks = dim / 8 pieces of 8
// values (16-byte loads); lane l sums piece l % chunks of rows l / chunks, + groups, ... (groups
// = 32 / chunks row groups), or with more pieces than lanes, pieces l, l + 32, ... of every row;
// kPoolLoads of its rows are loaded before any is added (the loads in flight set the read's
// speed). The row groups' sums are added in a fixed order after, through the warp's shared
// memory, so the means, and the selection, are deterministic; then the warp writes the row in
// pooled_dim's format.
template <class T>
__global__ void __launch_bounds__(kPoolThreads, 2)
    pool_kernel(const __grid_constant__ pool_params p) {
  // The selection may be placed as soon as every pooling block has started (dependent_launch).
  arch::launch_dependents();
  constexpr int kWarps = kPoolThreads / 32;
  extern __shared__ float pool_shared[];  // kWarps x pool_warp_floats(pdim)
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const unsigned all = 0xffffffffu;
  float* sums = pool_shared + warp * pool_warp_floats(p.pdim);
  const int chunks = p.dim / 8, groups = max(1, 32 / chunks), group = lane / chunks;
  const int tasks = p.blocks_total * p.heads;
  for (int task = static_cast<int>(blockIdx.x) * kWarps + warp; task < tasks;
       task += static_cast<int>(gridDim.x) * kWarps) {
    const int b = task / p.heads, h = task - b * p.heads;
    const bool is_q = b < p.q_blocks;
    const int x = b - (is_q ? 0 : p.q_blocks);
    const pool_block block = p.blocks[b];
    const int rows = block.rows;
    const T* src = static_cast<const T*>(is_q ? p.q : p.k);
    const std::int64_t row_stride = is_q ? p.q_row : p.k_row;
    const T* head = src + block.row0 * row_stride + h * (is_q ? p.q_head : p.k_head);
    for (int chunk = lane % chunks; chunk < chunks && group < groups; chunk += 32) {
      // This lane's next row, and the bytes from one of its rows to the next.
      const char* next = reinterpret_cast<const char*>(head + group * row_stride + chunk * 8);
      const std::int64_t step = std::int64_t{groups} * row_stride * static_cast<int>(sizeof(T));
      float acc[8] = {};
      for (int b0 = group; b0 < rows; b0 += kPoolLoads * groups) {
        const int loads = (rows - b0 + groups - 1) / groups;  // this lane's, here
        uint4 raw[kPoolLoads];
#pragma unroll
        for (int u = 0; u < kPoolLoads; ++u) {
          raw[u] = u < loads ? load_streaming(next) : make_uint4(0u, 0u, 0u, 0u);
          next += step;
        }
#pragma unroll
        for (int u = 0; u < kPoolLoads; ++u) {
          const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += static_cast<float>(v[e]);
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sums[group * p.dim + chunk * 8 + e] = acc[e];
    }
    __syncwarp();
    // Mean d into place d (only this lane reads or writes dim d's sums), and the largest |mean|
    // (a non-negative float orders as its bits; NaN's are above infinity's).
    const float inv = 1.f / static_cast<float>(rows);
    unsigned top = 0u;
    for (int d = lane; d < p.dim; d += 32) {
      float acc = 0.f;
      for (int g = 0; g < groups; ++g) acc += sums[g * p.dim + d];
      sums[d] = acc * inv;
      top = max(top, __float_as_uint(fabsf(acc * inv)));
    }
    const float most = __uint_as_float(__reduce_max_sync(all, top));
    __syncwarp();
    const bool finite = most <= FLT_MAX;
    // e: the largest |mean| is 2^(e + 21) ... 2^(e + 22); m = mean 2^-e by one product where
    // 2^-e is a normal float (most >= 2^-105), else by scalbnf.
    const int e = most > 0.f && finite ? ilogbf(most) - 21 : 0;
    const bool product = e >= -126 && e <= 126;
    const float inverse = product ? __int_as_float((127 - e) << 23) : 0.f;
    std::uint8_t* row =
        (is_q ? p.pooled_q : p.pooled_k) + (std::int64_t{x} * p.heads + h) * pooled_bytes(p.pdim);
    for (int d = 4 * lane; d < p.pdim; d += 128) {  // dims d ... d + 3
      std::uint32_t plane[3] = {0u, 0u, 0u};        // their d2, d1, d0
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = d + j < p.dim && finite ? sums[d + j] : 0.f;
        const int m = __float2int_rn(product ? v * inverse : scalbnf(v, -e));  // |m| <= 2^22
        const int d0 = ((m + 128) & 255) - 128, m1 = (m - d0) >> 8;
        const int d1 = ((m1 + 128) & 255) - 128, d2 = (m1 - d1) >> 8;
        plane[0] |= (static_cast<std::uint32_t>(d2) & 255u) << (8 * j);
        plane[1] |= (static_cast<std::uint32_t>(d1) & 255u) << (8 * j);
        plane[2] |= (static_cast<std::uint32_t>(d0) & 255u) << (8 * j);
      }
#pragma unroll
      for (int k = 0; k < 3; ++k)
        *reinterpret_cast<std::uint32_t*>(row + digit_offset(d, k)) = plane[k];
    }
    if (lane == 0) {
      *reinterpret_cast<float*>(row + 3 * p.pdim) = !finite      ? __int_as_float(0x7fc00000)
                                                    : most > 0.f ? ldexpf(1.f, e + 8)
                                                                 : 0.f;
    }
    __syncwarp();  // read before the next task writes
  }
}

}  // namespace trisparse::cuda::topk
