#pragma once
// The Hopper version of the fused block-sparse kernel (sm_90a): the same walk, tiles and online
// softmax as kernel.cuh, with a warpgroup (4 warps) per 64 query rows and both products as
// wgmma m64n64k16: S = Q Kᵀ with Q's fragments in registers and the K tile read K-major from
// shared memory, O += P V with P from the S accumulators and the V tile read N-major
// (transposed), both through 128-byte-swizzle descriptors; no ldmatrix for K or V.
#include "../../common/arch/wgmma.cuh"
#include "tile.cuh"

namespace trisparse::cuda::block_sparse::sm90 {

constexpr int kRows = 64;  // query rows per block: one warpgroup
constexpr int kKeys = 64;  // keys per step
constexpr int kThreads = 128;

/// Shared-memory bytes: the Q tile and two stages of K and V tiles, plus 1024 bytes to align the
/// tiles to the swizzle pattern.
template <int D>
__host__ __device__ constexpr int shared_bytes() {
  return (kRows + 4 * kKeys) * D * 2 + 1024;
}

/// Blocks per SM the registers are held to: 4 at D = 64 (128 registers), 2 at D = 128.
template <int D>
__host__ __device__ constexpr int min_blocks() {
  return D == 64 ? 4 : 2;
}

template <int N>
__device__ __forceinline__ float (&flat(float (&a)[N][4]))[4 * N] {
  return reinterpret_cast<float(&)[4 * N]>(a);
}

template <class T, int D, class O>
__global__ void __launch_bounds__(kThreads, min_blocks<D>())
    block_sparse_wgmma_kernel(const __grid_constant__ params p) {
  static_assert(D % 64 == 0);
  constexpr int kStage = kKeys * D * 2;
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t sq = (arch::shared_address(shared_raw) + 1023u) & ~1023u;
  const std::uint32_t sk = sq + kRows * D * 2, sv = sk + 2 * kStage;

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const tile_walk<kRows, kKeys> w(p);
  const char* qg = static_cast<const char*>(p.q) + ((w.q0 + w.row0) * p.q_row + w.h * p.q_head) * 2;
  const char* kg = static_cast<const char*>(p.k) + (w.k0 * p.k_row + w.h * p.k_head) * 2;
  const char* vg = static_cast<const char*>(p.v) + (w.k0 * p.v_row + w.h * p.v_head) * 2;
  int j_cur = w.key_start(0);
  if (j_cur >= 0) {
    load_rows<D, kRows, kThreads>(sq, qg, p.q_row, w.lq - w.row0);
    arch::cp_async_commit();
    load_rows<D, kKeys, kThreads>(sk, kg + j_cur * p.k_row * 2, p.k_row, w.lk - j_cur);
    load_rows<D, kKeys, kThreads>(sv, vg + j_cur * p.v_row * 2, p.v_row, w.lk - j_cur);
    arch::cp_async_commit();
  }

  std::uint32_t qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const int i_lo = w.row0 + warp * 16 + lane / 4;

  for (int it = 0; j_cur >= 0; ++it) {
    const int stage = static_cast<int>(it & 1);
    const int j_next = w.key_start(it + 1);
    if (j_next >= 0) {
      const std::uint32_t off = (stage ^ 1) * kStage;
      load_rows<D, kKeys, kThreads>(sk + off, kg + j_next * p.k_row * 2, p.k_row, w.lk - j_next);
      load_rows<D, kKeys, kThreads>(sv + off, vg + j_next * p.v_row * 2, p.v_row, w.lk - j_next);
    }
    arch::cp_async_commit();
    arch::cp_async_wait<1>();
    arch::fence_proxy_async();  // this thread's tile rows, visible to wgmma after the barrier
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        arch::ldmatrix_x4(
            qa[kk], swizzled<kRows>(sq, warp * 16 + lane % 16, kk / 4, 2 * (kk % 4) + lane / 16));
    }
    const std::uint32_t ks = sk + stage * kStage, vs = sv + stage * kStage;

    // S = Q Kᵀ: k16 step kk reads columns 16 kk.. of panel kk / 4 (32 bytes a step into it).
    float s[kKeys / 8][4];
    arch::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint32_t at = ks + (kk / 4) * kKeys * 128 + (kk % 4) * 32;
      arch::wgmma_64x64x16<T, 0>(flat(s), qa[kk], arch::sw128_descriptor(at), kk > 0);
    }
    arch::wgmma_commit();
    arch::wgmma_wait<0>();
    arch::fence_operands(flat(s));

    softmax_step<kKeys, D>(s, o, m, l, w, j_cur, i_lo);

    // O += P V: k16 step kp reads key rows 16 kp.. (two 8-row groups, 2048 bytes a step); the
    // output columns 64 dp.. come from panel dp.
    std::uint32_t pa[kKeys / 16][4];
#pragma unroll
    for (int kp = 0; kp < kKeys / 16; ++kp) p_fragment<T, kKeys>(pa[kp], s, kp);
    arch::wgmma_fence();
#pragma unroll
    for (int kp = 0; kp < kKeys / 16; ++kp) {
#pragma unroll
      for (int dp = 0; dp < D / 64; ++dp) {
        const std::uint32_t at = vs + dp * kKeys * 128 + kp * 2048;
        arch::wgmma_64x64x16<T, 1>(reinterpret_cast<float(&)[32]>(o[8 * dp]), pa[kp],
                                   arch::sw128_descriptor(at), true);
      }
    }
    arch::wgmma_commit();
    arch::wgmma_wait<0>();
    arch::fence_operands(flat(o));
    __syncthreads();  // every warp is done with this stage before it is refilled
    j_cur = j_next;
  }
  store_rows<O, D>(o, l, w, i_lo);
}

}  // namespace trisparse::cuda::block_sparse::sm90
