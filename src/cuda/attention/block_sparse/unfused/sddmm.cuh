#pragma once
// SDDMM over the row-interleaved BCSR, as the blocked-sparse report builds it: warps pull tiles
// from a global counter (dynamic tile scheduling, so a warp that lands on a short tile takes the
// next one at once) and compute <q, k> only at the tile's kept coordinates, writing them where
// the softmax and the SpMM read them. Coordinates a causal mask or the sequence's end removes are
// written as -inf.
#include <cstdint>

#include "../../../common/online_softmax.cuh"
#include "../../../formats/interleaved_bcsr.cuh"

namespace trisparse::cuda::interleaved {

constexpr int kSddmmWarps = 4;

/// Shared memory of one SDDMM block: each warp's R query rows as floats (rows padded by 4 floats,
/// keeping them 16-byte aligned and off each other's banks).
__host__ __device__ constexpr int sddmm_shared_bytes(int rows, int dim) {
  return kSddmmWarps * rows * (dim + 4) * static_cast<int>(sizeof(float));
}

/// A warp's tile: R query rows x kSddmmCoords / R positions; lane l owns positions p0 + l + 32 i
/// (i < 32 / R) for every row, so one key row loaded into registers serves R query rows from
/// shared memory (the reuse the report's G-aligned tiles buy). dim: a multiple of 8.
template <class T, int R>
__global__ void __launch_bounds__(kSddmmWarps * 32)
    sddmm_kernel(params p, work w, unsigned long long* counter) {
  constexpr int kPer = 32 / R;
  extern __shared__ float4 shared4[];
  const int lane = static_cast<int>(threadIdx.x) % 32, ld = p.dim + 4;
  float* sq = reinterpret_cast<float*>(shared4) + (threadIdx.x / 32) * R * ld;
  const std::int64_t total = items_in_launch(p, w);
  const auto* tiles = static_cast<const tile*>(w.items);
  for (;;) {
    unsigned long long next = 0;
    if (lane == 0) next = atomicAdd(counter, 1ull);
    const auto i = static_cast<std::int64_t>(__shfl_sync(~0u, next, 0));
    if (i >= total) return;
    const item_at at = decode<tile>(p, w, i);
    const tile t = tiles[at.index];
    const block_row r = p.rows[t.row];
    const int rows = min(R, r.rows - t.t0), width = r.count * p.block, head = p.h0 + at.slot;
    const std::int64_t q0 = p.cu_q[r.seq], k0 = p.cu_k[r.seq];
    const std::int64_t lq = p.cu_q[r.seq + 1] - q0, lk = p.cu_k[r.seq + 1] - k0;
    // The tile's query rows, as floats.
    const T* q = static_cast<const T*>(p.q) + (q0 + r.row0 + t.t0) * p.q_row + head * p.q_head;
    const int pieces = p.dim / 8;
    for (int c = lane; c < rows * pieces; c += 32) {
      const int row = c / pieces, x = (c % pieces) * 8;
      float f[8];
      load8(q + row * p.q_row + x, f);
      auto* dst = reinterpret_cast<float4*>(sq + row * ld + x);
      dst[0] = make_float4(f[0], f[1], f[2], f[3]);
      dst[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncwarp();
    // This lane's keys (lk: none).
    std::int32_t key[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int x = t.p0 + lane + 32 * j;
      key[j] = x < width ? key_at(p, r, x) : static_cast<std::int32_t>(lk);
    }
    const T* k = static_cast<const T*>(p.k) + k0 * p.k_row + head * p.k_head;
    float acc[R][kPer] = {};
#pragma unroll 2
    for (int d = 0; d < p.dim; d += 8) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        float kf[8] = {};
        if (key[j] < lk) load8(k + std::int64_t{key[j]} * p.k_row + d, kf);
#pragma unroll
        for (int row = 0; row < R; ++row) {
          if (row >= rows) break;
          const float4 a = *reinterpret_cast<const float4*>(sq + row * ld + d);
          const float4 b = *reinterpret_cast<const float4*>(sq + row * ld + d + 4);
          acc[row][j] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] +
                         b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
        }
      }
    }
    float* out = p.scores + at.slot * p.slot + r.value0 + std::int64_t{t.t0} * width;
#pragma unroll
    for (int row = 0; row < R; ++row) {
      if (row >= rows) break;
      const std::int64_t last = last_key(p, r.row0 + t.t0 + row, lq, lk);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int x = t.p0 + lane + 32 * j;
        if (x < width)
          out[std::int64_t{row} * width + x] =
              key[j] <= last ? acc[row][j] * p.scale_log2 : kNegInf;
      }
    }
    __syncwarp();  // the next tile overwrites sq
  }
}

}  // namespace trisparse::cuda::interleaved
