#pragma once
// SpMM over ME-BCRS with FlashSparse's swap-and-transpose MMA: C^T = B^T A^T, so that the sparse
// 8-row window block (8 rows x 8 vectors) is the MMA's *right* operand (n = 8) and the gathered
// dense rows of B are the left one (m = 16 features). One warp computes one work item (a row
// window's blocks, or a share of a long window's) for one head and one chunk of 16 kTiles
// features.
//
// Thread mapping (lane = 4 g + t): the thread owns the 2 kTiles consecutive features
// [f, f + 2 kTiles), f = chunk start + 2 kTiles g, and vectors 2t, 2t + 1 of each block. MMA tile
// i's rows g and g + 8 stand for features f + 2i and f + 2i + 1, so the thread's B fragment is one
// contiguous piece of each of its two gathered rows (16-byte loads; 8 threads of a group cover
// 16 kTiles * sizeof(T) contiguous bytes) and its C fragment one contiguous piece of each of its
// output rows 2t, 2t + 1 -- the paper's memory-efficient mapping, widened from 2x2 to
// 2 x (2 kTiles) elements. 16-bit types use m16n8k8; fp32 uses tf32 m16n8k8 with the two k
// halves on vectors 2t and 2t + 1. kHeight = 16 (the 16x1 ablation) runs two n = 8 halves.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/arch/mma.cuh"
#include "../../common/fragments.cuh"
#include "../params.hpp"
#include "../window.cuh"

namespace trisparse::cuda::me_bcrs {

inline constexpr int kSpmmWarps = 4;

/// The MMA of one tile from the thread's two gathered rows (x0: vector 2t, x1: vector 2t + 1) and
/// its pair of sparse values.
template <class T>
struct spmm_mma {
  template <int kElems>
  __device__ __forceinline__ static void run(float (&acc)[4], const frags::frag<T, kElems>& x0,
                                             const frags::frag<T, kElems>& x1, int i,
                                             const std::uint32_t (&b)[2]) {
    const std::uint32_t a[2] = {arch::interleave_lo(x0.r[i], x1.r[i]),
                                arch::interleave_hi(x0.r[i], x1.r[i])};
    arch::mma_16x8x8_f32<T>(acc, a, b[0]);
  }
  __device__ __forceinline__ static void values(const T* v, bool full, int j, int width,
                                                std::uint32_t (&b)[2]) {
    if (full) {
      b[0] = *reinterpret_cast<const std::uint32_t*>(v + j);
    } else {
      b[0] = (j < width ? frags::raw_bits(v + j) : 0u) |
             ((j + 1 < width ? frags::raw_bits(v + j + 1) : 0u) << 16);
    }
  }
};

template <>
struct spmm_mma<float> {
  template <int kElems>
  __device__ __forceinline__ static void run(float (&acc)[4], const frags::frag<float, kElems>& x0,
                                             const frags::frag<float, kElems>& x1, int i,
                                             const std::uint32_t (&b)[2]) {
    const std::uint32_t a[4] = {arch::to_tf32(__uint_as_float(x0.r[2 * i])),
                                arch::to_tf32(__uint_as_float(x0.r[2 * i + 1])),
                                arch::to_tf32(__uint_as_float(x1.r[2 * i])),
                                arch::to_tf32(__uint_as_float(x1.r[2 * i + 1]))};
    arch::mma_16x8x8_f32_tf32(acc, a, b);
  }
  __device__ __forceinline__ static void values(const float* v, bool full, int j, int width,
                                                std::uint32_t (&b)[2]) {
    float lo = 0.0f, hi = 0.0f;
    if (full) {
      const float2 p = *reinterpret_cast<const float2*>(v + j);
      lo = p.x;
      hi = p.y;
    } else {
      if (j < width) lo = v[j];
      if (j + 1 < width) hi = v[j + 1];
    }
    b[0] = arch::to_tf32(lo);
    b[1] = arch::to_tf32(hi);
  }
};

/// One warp's share of a task: the task (item, head, feature chunk) and the thread's features.
struct spmm_task {
  work_item it;
  int h, chunk, valid_f;
  std::int64_t f;
};

template <int kTiles>
__device__ __forceinline__ spmm_task spmm_task_at(const spmm_params& p, std::int64_t task, int g) {
  const std::int64_t per_item = std::int64_t{p.heads} * p.chunks;
  spmm_task k;
  k.it = p.f.items[task / per_item];
  k.h = static_cast<int>(task / p.chunks % p.heads);
  k.chunk = static_cast<int>(task % p.chunks);
  k.f = p.f_begin + std::int64_t{k.chunk} * 16 * kTiles + 2 * kTiles * g;
  k.valid_f = static_cast<int>(max(std::int64_t{0}, min(std::int64_t{2 * kTiles}, p.n - k.f)));
  return k;
}

/// acc += the task's blocks first, first + step, ... (< it.end): per block, the 8 (or 16) rows of
/// the window times the gathered rows of B.
template <class T, int kHeight, int kTiles>
__device__ __forceinline__ void spmm_accumulate(const spmm_params& p, const spmm_task& k, int lane,
                                                std::int32_t first, std::int32_t step,
                                                float (&acc)[kHeight / 8][kTiles][4]) {
  constexpr int kSub = kHeight / 8;  // n = 8 halves of the window
  constexpr int kFeat = 2 * kTiles;  // features per thread
  const int j = 2 * (lane % 4);
  const work_item& it = k.it;
  const std::int64_t start = p.f.row_ptr[it.window];
  const std::int64_t nvec = p.f.row_ptr[it.window + 1] - start;
  const std::int64_t block0 = p.f.block_offset[it.window];
  const T* b = static_cast<const T*>(p.b.data) + k.h * p.b.head + k.f;
  const T* a = static_cast<const T*>(p.a.data) + k.h * p.a.head;

  // Software pipeline: block b + step's rows of B are in flight while block b's MMAs run, and
  // block b + 2 step's column indices while block b + step's rows load.
  struct block_meta {
    std::int64_t vec = 0;  // the block's first vector
    int width = 0, c0 = -1, c1 = -1;
  };
  const auto meta = [&](std::int32_t blk) {
    block_meta m;
    if (blk >= it.end) return m;
    const std::int64_t first_vec = (blk - block0) * 8;  // the block's first vector in the window
    m.width = static_cast<int>(min(std::int64_t{8}, nvec - first_vec));
    m.vec = start + first_vec;
    m.c0 = j < m.width ? p.f.col_idx[m.vec + j] : -1;
    m.c1 = j + 1 < m.width ? p.f.col_idx[m.vec + j + 1] : -1;
    return m;
  };
  const auto load_rows = [&](const block_meta& m, frags::frag<T, kFeat>& x0,
                             frags::frag<T, kFeat>& x1) {
    frags::load_frag(b + std::int64_t{m.c0 < 0 ? 0 : m.c0} * p.b.row, m.c0 < 0 ? 0 : k.valid_f,
                     p.aligned, x0);
    frags::load_frag(b + std::int64_t{m.c1 < 0 ? 0 : m.c1} * p.b.row, m.c1 < 0 ? 0 : k.valid_f,
                     p.aligned, x1);
  };
  block_meta cur = meta(first), next = meta(first + step);
  frags::frag<T, kFeat> x0, x1;
  load_rows(cur, x0, x1);
  for (std::int32_t blk = first; blk < it.end; blk += step) {
    frags::frag<T, kFeat> n0, n1;
    load_rows(next, n0, n1);  // nothing is read past the item (c = -1)
    const block_meta after = meta(blk + 2 * step);
    std::uint32_t bv[kSub][2];
#pragma unroll
    for (int s = 0; s < kSub; ++s)
      spmm_mma<T>::values(a + cur.vec * kHeight + (8 * s + lane / 4) * cur.width, cur.width == 8, j,
                          cur.width, bv[s]);
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i) spmm_mma<T>::run(acc[s][i], x0, x1, i, bv[s]);
    }
    x0 = n0;
    x1 = n1;
    cur = next;
    next = after;
  }
}

/// Elements [0, valid) of a split window's partial row (written by other thread blocks of this
/// launch: read through L2, never the non-coherent path); the rest are 0. `aligned`: src is
/// aligned to 16 bytes.
template <int kElems>
__device__ __forceinline__ void load_partial(const float* src, int valid, bool aligned,
                                             float (&out)[kElems]) {
  if constexpr (kElems % 4 == 0) {
    if (valid >= kElems && aligned) {
#pragma unroll
      for (int i = 0; i < kElems / 4; ++i) {
        spread(__ldcg(reinterpret_cast<const float4*>(src) + i), &out[4 * i]);
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < kElems; ++e) out[e] = e < valid ? __ldcg(src + e) : 0.0f;
}

/// Writes the task's tile of C from acc, or for a share of a split window its partial tile, the
/// last share to finish adding all shares in part order (deterministic) and writing C.
template <class O, int kHeight, int kTiles>
__device__ __forceinline__ void spmm_store(const spmm_params& p, const spmm_task& k, int lane,
                                           const float (&acc)[kHeight / 8][kTiles][4]) {
  constexpr int kSub = kHeight / 8;
  constexpr int kFeat = 2 * kTiles;
  const int t = lane % 4;
  // acc[s][i] = C(rows 8s + 2t, 8s + 2t + 1; features f + 2i, f + 2i + 1): per output row, the
  // thread's kFeat consecutive features.
  const auto row_values = [&](int s, int odd, float(&v)[kFeat]) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      v[2 * i] = acc[s][i][odd];
      v[2 * i + 1] = acc[s][i][2 + odd];
    }
  };
  const work_item& it = k.it;
  const std::int64_t row0 = std::int64_t{it.window} * kHeight;
  O* c = static_cast<O*>(p.c.data) + k.h * p.c.head + k.f;
  if (it.part < 0) {
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
#pragma unroll
      for (int odd = 0; odd < 2; ++odd) {
        const std::int64_t row = row0 + 8 * s + 2 * t + odd;
        if (row >= p.f.rows) continue;
        float v[kFeat];
        row_values(s, odd, v);
        frags::store_floats(c + pattern_row(p.f, row) * p.c.row, v, k.valid_f, p.aligned);
      }
    }
    return;
  }
  // Partial rows are 16-byte aligned when n is a multiple of 4 (k.f is a multiple of kFeat).
  const bool part_aligned = p.n % 4 == 0;
  float* part = p.part + (std::int64_t{it.part} * p.heads + k.h) * kHeight * p.n + k.f;
#pragma unroll
  for (int s = 0; s < kSub; ++s) {
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      float v[kFeat];
      row_values(s, odd, v);
      frags::store_floats(part + (8 * s + 2 * t + odd) * p.n, v, k.valid_f, part_aligned);
    }
  }
  __threadfence();
  __syncwarp();
  const split_window sw = p.f.splits[it.split];
  std::int32_t* counter =
      p.split_count + (std::int64_t{it.split} * p.heads + k.h) * p.chunks + k.chunk;
  int done = 0;
  if (lane == 0) done = atomicAdd(counter, 1);
  done = __shfl_sync(0xFFFFFFFFu, done, 0);
  if (done != sw.parts - 1) return;
  __threadfence();
  if (lane == 0) *counter = 0;  // ready for the next launch
#pragma unroll
  for (int s = 0; s < kSub; ++s) {
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      const int r = 8 * s + 2 * t + odd;
      const std::int64_t row = row0 + r;
      if (row >= p.f.rows) continue;
      // The shares' partial rows, added in part order (deterministic). kBatch parts are loaded
      // before they are added, so the merge costs parts / kBatch round trips, not parts.
      constexpr int kBatch = 4;
      const auto src = [&](int q) {
        return p.part + (std::int64_t{sw.first_part + q} * p.heads + k.h) * kHeight * p.n +
               r * p.n + k.f;
      };
      float v[kFeat] = {};
      for (int q0 = 0; q0 < sw.parts; q0 += kBatch) {
        float got[kBatch][kFeat];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          load_partial(src(q0 + b), q0 + b < sw.parts ? k.valid_f : 0, part_aligned, got[b]);
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
#pragma unroll
          for (int e = 0; e < kFeat; ++e) v[e] += got[b][e];
        }
      }
      frags::store_floats(c + pattern_row(p.f, row) * p.c.row, v, k.valid_f, p.aligned);
    }
  }
}

/// Tasks (item, head, feature chunk). The first team_items x heads x chunks thread blocks take one
/// task each, its blocks dealt round-robin to the kSpmmWarps warps (one chain of dependent gathers
/// per warp, a quarter as long), whose tiles are added in shared memory in warp order; the rest
/// take kSpmmWarps tasks each, one per warp.
template <class T, class O, int kHeight, int kTiles>
__global__ void __launch_bounds__(kSpmmWarps * 32) spmm_kernel(const spmm_params p) {
  constexpr int kAcc = kHeight / 8 * kTiles * 4;  // accumulators per thread
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t per_item = std::int64_t{p.heads} * p.chunks;
  const std::int64_t team_tasks = p.f.team_items * per_item;
  const bool team = blockIdx.x < team_tasks;
  const std::int64_t task =
      team ? std::int64_t{blockIdx.x}
           : team_tasks + (blockIdx.x - team_tasks) * std::int64_t{kSpmmWarps} + warp;
  if (task >= p.f.num_items * per_item) return;  // never for a team (no early exit before sync)
  const spmm_task k = spmm_task_at<kTiles>(p, task, lane / 4);
  float acc[kHeight / 8][kTiles][4] = {};
  spmm_accumulate<T, kHeight, kTiles>(p, k, lane, k.it.begin + (team ? warp : 0),
                                      team ? kSpmmWarps : 1, acc);
  if (team) {
    __shared__ float shared[kSpmmWarps - 1][kAcc][32];  // lane-minor: no bank conflicts
    const auto each = [&](auto&& f) {
#pragma unroll
      for (int s = 0; s < kHeight / 8; ++s) {
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
#pragma unroll
          for (int q = 0; q < 4; ++q) f(acc[s][i][q], (s * kTiles + i) * 4 + q);
        }
      }
    };
    if (warp > 0) each([&](float& x, int e) { shared[warp - 1][e][lane] = x; });
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < kSpmmWarps - 1; ++w)
      each([&](float& x, int e) { x += shared[w][e][lane]; });
  }
  spmm_store<O, kHeight, kTiles>(p, k, lane, acc);
}

}  // namespace trisparse::cuda::me_bcrs
