#pragma once
// The selection: key-block means staged through shared memory, scores as integer products on
// tensor cores, then a warp's selection per row (warp_select.cuh).
#include <cstdint>

#include "../../common/arch/copy.cuh"
#include "../../common/arch/mma.cuh"
#include "../../common/dependent_launch.cuh"
#include "tuning.hpp"
#include "warp_select.cuh"

namespace trisparse::cuda::topk {

// A block per (group of `rows` <= 32 consecutive query blocks of one sequence, head), with 8 warps
// per row tile of 16 of them (select_threads): the key-block means are staged once for all its
// rows, so 32 rows a block read half the means from L2 that 16 do. Scores on tensor cores as
// integer products of the means' digits (pooled_dim; six m16n8k32 s8 products per 32 dims, in
// three accumulators by weight): the key rows staged through shared memory in chunks of 64
// (cp.async, the next chunks in flight while this one is scored), warp w computing the 16 x 8 tile
// of row tile w / 8 and keys 8 (w % 8) ... 8 (w % 8) + 7 of the chunk against the group's query
// rows (A fragments read from global memory; rows past the group are zero). Then warp w selects
// rows w and w + warps, then the next pair (select_rows). With PDIM (the pooled dim) known at
// compile time, a warp holds its A fragments in registers for all chunks; PDIM = 0 reads them at
// every k-step (any pooled dim).
template <int R, int PDIM>
__global__ void __launch_bounds__(select_threads(kMaxRows), 1)
    select_kernel(const __grid_constant__ select_params p) {
  // The attention after it (launched as a dependent) may take the SMs this grid leaves and set
  // up; it waits for this grid before it reads the mask.
  arch::launch_dependents();
  extern __shared__ uint4 shared4[];
  auto* shared = reinterpret_cast<std::uint8_t*>(shared4);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int threads = static_cast<int>(blockDim.x);
  const int g = lane / 4, t = lane % 4;            // the MMA fragments' row group and column
  const int tile = warp / kTileWarps * kTileRows;  // the warp's first row
  const int h = static_cast<int>(blockIdx.x) % p.heads;
  const int pdim = PDIM > 0 ? PDIM : p.pdim;
  const select_group group = p.groups[blockIdx.x / p.heads];
  const int lq = group.lq, lk = group.lk;
  const int row_bytes = pooled_bytes(pdim), stride = key_stride(pdim),
            stage_bytes = kChunk * stride;
  float* scores = reinterpret_cast<float*>(shared + kStages * stage_bytes);
  const int score_stride = score_floats(R, p.max_k_blocks);
  // x / block for x >= 0: a shift where block is a power of two.
  const auto in_blocks = [&](int x) {
    return p.block_shift >= 0 ? x >> p.block_shift : x / p.block;
  };
  const int nbq = in_blocks(lq + p.block - 1), nbk = in_blocks(lk + p.block - 1);
  const int rows = min(p.rows, nbq - group.first);  // the group's query blocks
  // The key blocks row i of the group may attend (0 past the group); the last row's (the most: it
  // grows with the row) bounds the staging loop.
  const auto allowed_of = [&](int i) {
    if (i >= rows) return 0;
    if (!p.causal) return nbk;
    const int last_row = min(lq, (group.first + i + 1) * p.block) - 1;
    const int last = min(last_row + lk - lq, lk - 1);
    return last < 0 ? 0 : in_blocks(last) + 1;
  };
  const int most = allowed_of(rows - 1);
  const std::int64_t k_stride = std::int64_t{p.heads} * row_bytes;
  const std::uint8_t* kp = p.pooled_k + (std::int64_t{group.k_base} * p.heads + h) * row_bytes;
  const int pieces = row_bytes / 16;  // 16-byte pieces a row (with PDIM: a constant divisor)
  // Thread i copies the pieces i, i + threads, ... of a chunk's rows.
  const auto stage = [&](int c0) {  // commits a group, empty past the last chunk
    std::uint8_t* to = shared + (c0 / kChunk % kStages) * stage_bytes;
    const std::uint8_t* from = kp + c0 * k_stride;
    const int n = min(kChunk, most - c0) * pieces;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += threads) {
      const int row = i / pieces, piece = i - row * pieces;
      arch::cp_async_16(arch::shared_address(to + row * stride + 16 * piece),
                        from + row * k_stride + 16 * piece, true);
    }
    arch::cp_async_commit();
  };
  // Launched as a dependent of the pooling (dependent_launch): the means are complete from here.
  arch::wait_for_primary();
  // A ring of kStages chunks, kStages - 1 in flight: the staging waited on L2 latency with one.
  // Issued first, so that the key rows are on their way while the query rows are read.
  for (int i = 0; i < kStages - 1; ++i) stage(i * kChunk);
  // The warp's query rows tile + g and tile + g + 8 (null past the group) and their scales.
  const std::uint8_t* qs =
      p.pooled_q + ((std::int64_t{group.q_base} + group.first) * p.heads + h) * row_bytes;
  const std::int64_t q_stride = std::int64_t{p.heads} * row_bytes;
  const std::uint8_t* q_row[2] = {tile + g < rows ? qs + (tile + g) * q_stride : nullptr,
                                  tile + g + 8 < rows ? qs + (tile + g + 8) * q_stride : nullptr};
  float q_scale[2];
  for (int i = 0; i < 2; ++i)
    q_scale[i] = q_row[i] ? __ldg(reinterpret_cast<const float*>(q_row[i] + 3 * pdim)) : 0.f;
  // The A fragment of k-step s, digit plane k: rows g, g + 8 at dims 4t.., then 16 + 4t...
  const auto a_fragment = [&](int s, int k, std::uint32_t(&a)[4]) {
    uint2 v[2] = {};
    for (int i = 0; i < 2; ++i)
      if (q_row[i])
        v[i] = __ldg(reinterpret_cast<const uint2*>(q_row[i] + s * 96 + k * 32 + 8 * t));
    a[0] = v[0].x;
    a[1] = v[1].x;
    a[2] = v[0].y;
    a[3] = v[1].y;
  };
  std::uint32_t a_held[PDIM > 0 ? PDIM / 32 : 1][3][4];
  if constexpr (PDIM > 0) {
#pragma unroll
    for (int s = 0; s < PDIM / 32; ++s)
#pragma unroll
      for (int k = 0; k < 3; ++k) a_fragment(s, k, a_held[s][k]);
  }
  const int allowed_lo = allowed_of(tile + g), allowed_hi = allowed_of(tile + g + 8);
  for (int c0 = 0; c0 < most; c0 += kChunk) {
    arch::cp_async_wait<kStages - 2>();  // this thread's copies of chunk c0 have landed
    // Every thread's copies have landed and every thread is done with the chunk before: its
    // stage takes the chunk kStages - 1 ahead.
    __syncthreads();
    stage(c0 + (kStages - 1) * kChunk);
    const int column = 8 * (warp % kTileWarps), c = c0 + column;  // the warp's first key block
    if (c < most && tile < rows) {
      // B: key block c + g (rows past the chunk hold stale values whose scores are not stored).
      const std::uint8_t* chunk = shared + (c0 / kChunk % kStages) * stage_bytes;
      const std::uint8_t* key = chunk + (column + g) * stride + 8 * t;
      // The digit products by weight: 2^32 (d2 d2), 2^24 (d2 d1, d1 d2), 2^16 (d2 d0, d1 d1,
      // d0 d2); those below (a relative 2^-22 at most) are left out.
      int w32[4] = {}, w24[4] = {}, w16[4] = {};
#pragma unroll 2
      for (int s = 0; s < pdim / 32; ++s) {
        std::uint32_t b[3][2];
#pragma unroll
        for (int k = 0; k < 3; ++k) {
          const uint2 v = *reinterpret_cast<const uint2*>(key + s * 96 + k * 32);
          b[k][0] = v.x;
          b[k][1] = v.y;
        }
        const auto products = [&](const std::uint32_t(&a)[3][4]) {
          arch::mma_16x8x32_s32_s8(w32, a[0], b[0]);
          arch::mma_16x8x32_s32_s8(w24, a[0], b[1]);
          arch::mma_16x8x32_s32_s8(w16, a[0], b[2]);
          arch::mma_16x8x32_s32_s8(w24, a[1], b[0]);
          arch::mma_16x8x32_s32_s8(w16, a[1], b[1]);
          arch::mma_16x8x32_s32_s8(w16, a[2], b[0]);
        };
        if constexpr (PDIM > 0) {
          products(a_held[s]);
        } else {
          std::uint32_t a[3][4];
          for (int k = 0; k < 3; ++k) a_fragment(s, k, a[k]);
          products(a);
        }
      }
      // The scales of key blocks c + 2 t and c + 2 t + 1 (the accumulators' columns).
      const std::uint8_t* k_scale = chunk + (column + 2 * t) * stride + 3 * pdim;
      const float k_scales[2] = {*reinterpret_cast<const float*>(k_scale),
                                 *reinterpret_cast<const float*>(k_scale + stride)};
      float acc[4];
      for (int e = 0; e < 4; ++e) {
        const float sum = fmaf(fmaf(static_cast<float>(w32[e]), 256.f, static_cast<float>(w24[e])),
                               256.f, static_cast<float>(w16[e]));
        acc[e] = sum * q_scale[e / 2] * k_scales[e % 2];
      }
      // acc: rows tile + g (0, 1) and tile + g + 8 (2, 3), key blocks c + 2 t and c + 2 t + 1:
      // one 8-byte store a row where both are attended.
      for (int half = 0; half < 2; ++half) {
        const int allowed = half == 0 ? allowed_lo : allowed_hi, col = c + 2 * t;
        float* to = scores + (tile + g + 8 * half) * score_stride + col;
        if (col + 1 < allowed)
          *reinterpret_cast<float2*>(to) = make_float2(acc[2 * half], acc[2 * half + 1]);
        else if (col < allowed)
          to[0] = acc[2 * half];
      }
    }
  }
  arch::cp_async_wait<0>();  // the empty groups past the last chunk
  __syncthreads();           // every score is in place
  // Warp w selects rows w and w + warps together (select_rows), then the next pair.
  const int warps = threads / 32;
  const auto job = [&](int i) {
    const int r = group.first + i;
    // The block holding the key aligned with the query block's last row (< allowed).
    const int aligned = min(lq, (r + 1) * p.block) - 1 + lk - lq;
    const int diagonal =
        p.keep_diagonal && aligned >= 0 && lk > 0 ? in_blocks(min(aligned, lk - 1)) : -1;
    return row_job{
        scores + i * score_stride, allowed_of(i), diagonal,
        p.col_idx + (std::int64_t{group.q_base} * p.heads + std::int64_t{h} * nbq + r) * p.cap};
  };
  for (int i = warp; i < rows; i += 2 * warps) {
    const int j = i + warps;
    if constexpr (R > 0) {
      if (j < rows) {
        select_rows<R, 2>({job(i), job(j)}, p.top_k, p.cap, nbk);
        continue;
      }
    }
    select_rows<R, 1>({job(i)}, p.top_k, p.cap, nbk);
    if (j < rows) select_rows<R, 1>({job(j)}, p.top_k, p.cap, nbk);
  }
}

}  // namespace trisparse::cuda::topk
