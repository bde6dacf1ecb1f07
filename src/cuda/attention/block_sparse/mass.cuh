#pragma once
// The block importance without a backward (block_sparse_attention_plan::block_mass): the dk/dv
// kernel's walk over the transposed mask (key_walk) with only S = K Qᵀ and P = 2^(c S - lse2)
// left, each kept block's sum of P added per thread, flushed per warp as the backward's
// (importance.cuh) and finished by the same last kernel. A thread block per (key tile of BM keys,
// head): K's fragments stay in registers, the query tiles and their lse come through two cp.async
// stages. Half the forward's FLOPs and one exponential a pair, no dO, V or dS work; it takes about
// a forward's time (block_patterns.md: the walk, copies and barriers of 64 x 64 tiles).
#include "backward.cuh"

namespace trisparse::cuda::block_sparse {

/// Shared-memory bytes: the key tile, two stages of query rows and two of their lse.
template <int D, int BM>
__host__ __device__ constexpr int mass_shared_bytes() {
  return 3 * BM * row_bytes<D>() + 2 * BM * 4;
}

template <class T, int D, int BM>
__global__ void __launch_bounds__(BM / 16 * 32)
    mass_kernel(const __grid_constant__ backward_params p) {
  static_assert(D % 16 == 0 && BM % 16 == 0);
  constexpr int BN = BM, kThreads = BM / 16 * 32, kStage = BN * row_bytes<D>();
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t sk = arch::shared_address(shared_raw);
  const std::uint32_t sq = sk + BM * row_bytes<D>(), slse = sq + 2 * kStage;
  const float* lse = reinterpret_cast<const float*>(reinterpret_cast<const char*>(shared_raw) +
                                                    3 * BM * row_bytes<D>());
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int tq = lane % 4;

  key_walk<BM, BN> w(p);
  const char* const qg = static_cast<const char*>(p.q) + (w.q0 * p.q_row + w.h * p.q_head) * 2;
  const char* const kg = static_cast<const char*>(p.k) + (w.k0 * p.k_row + w.h * p.k_head) * 2;
  const float* const lse_g = p.lse + w.q0 * p.lse_row + w.h * p.lse_head;
  const auto load_stage = [&](int stage, int y) {
    load_rows<D, BN, kThreads>(sq + stage * kStage, qg + std::int64_t{y} * p.q_row * 2, p.q_row,
                               w.lq - y);
    for (int x = static_cast<int>(threadIdx.x); x < BN; x += kThreads)
      arch::cp_async_4(slse + static_cast<std::uint32_t>((stage * BN + x) * 4),
                       lse_g + std::int64_t{y + x} * p.lse_row, y + x < w.lq);
  };

  int y_cur = w.next();
  int e_cur = w.entry;
  importance_sums<BN> imp(p, w.h, w.row0);
  if (y_cur >= 0) {
    load_rows<D, BM, kThreads>(sk, kg + std::int64_t{w.row0} * p.k_row * 2, p.k_row, w.lk - w.row0);
    arch::cp_async_commit();
    load_stage(0, y_cur);
    arch::cp_async_commit();
  }
  const int r_lo = w.row0 + warp * 16 + lane / 4;  // the thread's first key
  const float c = p.negate_scores ? -p.scale_log2 : p.scale_log2;
  std::uint32_t a[D / 16][4];  // the warp's 16 keys as A fragments, read once

  for (int it = 0; y_cur >= 0; ++it) {
    const int stage = it & 1;
    const int y_next = w.next();
    const int e_next = w.entry;
    if (y_next >= 0) load_stage(stage ^ 1, y_next);
    arch::cp_async_commit();
    arch::cp_async_wait<1>();
    __syncthreads();
    if (it == 0) load_a_fragments<D, BM>(a, sk, warp * 16);
    const std::uint32_t y1 = sq + stage * kStage;
    float s[BN / 8][4];
    tile_scores<T, D, BN>(s, a, y1);
    const float* tile_lse = lse + stage * BN;
    // As probabilities_and_ds: a copy of the loop with the per-pair test where the tile needs it.
    const auto add = [&]<bool MASKED>() {
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n * 8 + 2 * tq + (e & 1), r = e >> 1;
          float pv = exp2_approx(fmaf(s[n][e], c, -tile_lse[col] * kLog2e));
          if constexpr (MASKED) {
            if (w.hides(y_cur + col, r_lo + 8 * r, r)) pv = 0.f;
          }
          imp.mass += pv;
        }
      }
    };
    if (w.masks(y_cur))
      add.template operator()<true>();
    else
      add.template operator()<false>();
    if (y_next < 0 || e_next != e_cur) imp.flush(e_cur, false);
    __syncthreads();  // every warp is done with this stage before it is refilled
    y_cur = y_next;
    e_cur = e_next;
  }
}

}  // namespace trisparse::cuda::block_sparse
