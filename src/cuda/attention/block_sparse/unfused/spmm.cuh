#pragma once
// SpMM O = P V over the row-interleaved BCSR probabilities, with the report's G-row tiles: a
// thread block computes up to 32 query rows of one block row (which share its key blocks, so each
// staged V row serves all of them) x 64 output columns, walking the row's positions 32 at a time.
// Block rows with no kept block write zeros.
#include <cstdint>

#include "../../../formats/interleaved_bcsr.cuh"

namespace trisparse::cuda::interleaved {

constexpr int kSpmmThreads = 128, kSpmmCols = 64, kSpmmKeys = 32;

/// Grid: x = the launch's tiles, y = ceil(dim / 64); 16 threads across the columns, 8 down, each
/// with RPT rows. dim: a multiple of 8.
template <class T, class O, int RPT>
__global__ void __launch_bounds__(kSpmmThreads) spmm_kernel(params p, work w) {
  constexpr int kRows = kSpmmThreadRows * RPT;
  __shared__ float sp[kRows][kSpmmKeys + 1];
  __shared__ __align__(16) float sv[kSpmmKeys][kSpmmCols + 4];
  const item_at at = decode<tile>(p, w, blockIdx.x);
  const tile t = static_cast<const tile*>(w.items)[at.index];
  const block_row r = p.rows[t.row];
  const int rows = min(kRows, r.rows - t.t0), width = r.count * p.block, head = p.h0 + at.slot;
  const std::int64_t k0 = p.cu_k[r.seq], lk = p.cu_k[r.seq + 1] - k0;
  const int tx = static_cast<int>(threadIdx.x) % 16, ty = static_cast<int>(threadIdx.x) / 16;
  const int col0 = static_cast<int>(blockIdx.y) * kSpmmCols;
  const float* prob = p.scores + at.slot * p.slot + r.value0 + std::int64_t{t.t0} * width;
  const T* v = static_cast<const T*>(p.v) + k0 * p.v_row + head * p.v_head + col0;
  float acc[RPT][4] = {};
  for (int x0 = 0; x0 < width; x0 += kSpmmKeys) {
    for (int e = static_cast<int>(threadIdx.x); e < kRows * kSpmmKeys; e += kSpmmThreads) {
      const int row = e / kSpmmKeys, x = x0 + e % kSpmmKeys;
      sp[row][e % kSpmmKeys] = row < rows && x < width ? prob[std::int64_t{row} * width + x] : 0.0f;
    }
    for (int e = static_cast<int>(threadIdx.x); e < kSpmmKeys * kSpmmCols / 8; e += kSpmmThreads) {
      const int kx = e / (kSpmmCols / 8), c = (e % (kSpmmCols / 8)) * 8, x = x0 + kx;
      float f[8] = {};
      if (x < width && col0 + c < p.dim) {
        const std::int32_t key = key_at(p, r, x);
        if (key < lk) load8(v + std::int64_t{key} * p.v_row + c, f);
      }
      auto* dst = reinterpret_cast<float4*>(&sv[kx][c]);
      dst[0] = make_float4(f[0], f[1], f[2], f[3]);
      dst[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kSpmmKeys; ++k) {
      const float4 b = *reinterpret_cast<const float4*>(&sv[k][tx * 4]);
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const float a = sp[ty + 8 * i][k];
        acc[i][0] += a * b.x;
        acc[i][1] += a * b.y;
        acc[i][2] += a * b.z;
        acc[i][3] += a * b.w;
      }
    }
    __syncthreads();
  }
  const int col = col0 + tx * 4;
  if (col >= p.dim) return;
  O* out = static_cast<O*>(p.out) + (p.cu_q[r.seq] + r.row0 + t.t0) * p.o_row + head * p.o_head;
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int row = ty + 8 * i;
    if (row >= rows) continue;
#pragma unroll
    for (int c = 0; c < 4; ++c) out[row * p.o_row + col + c] = frags::from_float<O>(acc[i][c]);
  }
}

}  // namespace trisparse::cuda::interleaved
