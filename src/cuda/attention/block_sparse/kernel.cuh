#pragma once
// Fused block-sparse attention (flash-attention style) over a BCSR block mask at granularity G:
// a thread block owns a tile of BM query rows (inside one query block) for one head, keeps Q in
// registers, and streams the K and V rows of the active key blocks through shared memory in tiles
// of BN keys (cp.async, two stages), computing S = Q Kᵀ (mma m16n8k16), the online softmax in
// fp32 (exp2, scale folded in) and O += P V (P from the S accumulators in registers, V through
// ldmatrix.trans). Each warp owns 16 query rows. No score matrix in memory.
//
// Shared-memory tiles: tile.cuh.
#include "tile.cuh"

namespace trisparse::cuda::block_sparse {

/// Shared-memory bytes of one instantiation: Q tile and two stages of K and V tiles.
template <int D, int BM, int BN>
__host__ __device__ constexpr int shared_bytes() {
  return (BM + 4 * BN) * row_bytes<D>();
}

/// Threads of an instantiation: a warp per 16 query rows.
template <int BM>
__host__ __device__ constexpr int threads() {
  return BM / 16 * 32;
}

/// Blocks per SM the registers are held to: 128 registers a thread at D <= 64 (16 warps of 4 per
/// SM), 255 at D = 128 (its accumulators alone take 96).
template <int D, int BM>
__host__ __device__ constexpr int min_blocks() {
  const int per_sm = (D <= 64 ? 512 : 256) / threads<BM>();
  return per_sm > 1 ? per_sm : 1;
}

/// Walk: tile_walk (the block mask's key tiles), or another walk with its interface (tile.cuh).
/// DROPOUT: P times params' dropout factors on the way to O (the normaliser keeps every P).
template <class T, int D, class O, int BM, int BN, class Walk = tile_walk<BM, BN>,
          bool DROPOUT = false, bool BIAS = false>
__global__ void __launch_bounds__(threads<BM>(), (min_blocks<D, BM>()))
    block_sparse_kernel(const __grid_constant__ params p) {
  static_assert(D % 16 == 0 && BM % 16 == 0 && BN % 16 == 0);
  constexpr int kThreads = threads<BM>();
  constexpr int kStage = BN * row_bytes<D>();
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t sq = arch::shared_address(shared_raw);
  const std::uint32_t sk = sq + BM * row_bytes<D>(), sv = sk + 2 * kStage;

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  Walk w(p);
  const char* qg = static_cast<const char*>(p.q) + ((w.q0 + w.row0) * p.q_row + w.h * p.q_head) * 2;
  const char* kg = static_cast<const char*>(p.k) + (w.k0 * p.k_row + w.h * p.k_head) * 2;
  const char* vg = static_cast<const char*>(p.v) + (w.k0 * p.v_row + w.h * p.v_head) * 2;
  int j_cur = w.next();
  if (j_cur >= 0) {
    load_rows<D, BM, kThreads>(sq, qg, p.q_row, w.lq - w.row0);
    arch::cp_async_commit();
    load_rows<D, BN, kThreads>(sk, kg + j_cur * p.k_row * 2, p.k_row, w.lk - j_cur);
    load_rows<D, BN, kThreads>(sv, vg + j_cur * p.v_row * 2, p.v_row, w.lk - j_cur);
    arch::cp_async_commit();
  }

  std::uint32_t qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // Running max (log2 units) and this thread's partial sum of its rows i_lo and i_lo + 8.
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const int i_lo = w.row0 + warp * 16 + lane / 4;
  [[maybe_unused]] const auto drops = draws_if<DROPOUT>(p);

  for (int it = 0; j_cur >= 0; ++it) {
    const int stage = static_cast<int>(it & 1);
    const float b2 = BIAS ? w.bias2(j_cur) : 0.f;  // (its load under the tile's wait and S)
    const int j_next = w.next();
    if (j_next >= 0) {
      const std::uint32_t off = (stage ^ 1) * kStage;
      load_rows<D, BN, kThreads>(sk + off, kg + j_next * p.k_row * 2, p.k_row, w.lk - j_next);
      load_rows<D, BN, kThreads>(sv + off, vg + j_next * p.v_row * 2, p.v_row, w.lk - j_next);
    }
    arch::cp_async_commit();
    arch::cp_async_wait<1>();
    __syncthreads();
    if (it == 0) {
      load_a_fragments<D, BM>(qa, sq, warp * 16);
      apply_score_sign(qa, p);
    }
    const std::uint32_t ks = sk + stage * kStage, vs = sv + stage * kStage;

    // S = Q Kᵀ for this warp's 16 rows and the tile's BN keys.
    float s[BN / 8][4];
    tile_scores<T, D, BN>(s, qa, ks);
    float alpha[2];
    softmax_step<BN, BIAS>(s, m, l, alpha, w, j_cur, i_lo, b2);
    rescale<D>(o, alpha);
    if constexpr (DROPOUT) {
      drop<BN>(s, drops, w, j_cur, i_lo);
    }
    // O += P V: P's A fragments straight from the S accumulators, V through ldmatrix.trans.
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) {
      std::uint32_t pa[4];
      p_fragment<T, BN>(pa, s, kp);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t b[4];
        arch::ldmatrix_x4_trans(b, swizzled<BN>(vs, kp * 16 + lane % 8 + 8 * ((lane / 8) % 2),
                                                dp / 4, 2 * (dp % 4) + lane / 16));
        arch::mma_16x8x16_f32<T>(o[2 * dp], pa, {b[0], b[1]});
        arch::mma_16x8x16_f32<T>(o[2 * dp + 1], pa, {b[2], b[3]});
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    j_cur = j_next;
  }
  store_rows<O, D>(o, m, l, w, i_lo);
}

}  // namespace trisparse::cuda::block_sparse
