#pragma once
// Fused block-sparse attention (flash-attention style) over a BCSR block mask at granularity G:
// a thread block owns a tile of BM query rows (inside one query block) for one head, keeps Q in
// registers, and streams the K and V rows of the active key blocks through shared memory in tiles
// of BN keys (cp.async, two stages), computing S = Q Kᵀ (mma m16n8k16), the online softmax in
// fp32 (exp2, scale folded in) and O += P V (P from the S accumulators in registers, V through
// ldmatrix.trans). Each warp owns 16 query rows. No score matrix in memory.
//
// Shared-memory rows are D 16-bit values; the 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) so that the 8 rows an ldmatrix phase reads fall in distinct banks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/arch/copy.cuh"
#include "../../common/arch/mma.cuh"
#include "params.hpp"

namespace trisparse::cuda::block_sparse {

constexpr float kNegInf = -__builtin_huge_valf();

/// Shared-memory bytes of one instantiation: Q tile and two stages of K and V tiles.
template <int D, int BM, int BN>
__host__ __device__ constexpr int shared_bytes() {
  return (BM + 4 * BN) * D * 2;
}

template <int D>
__device__ __forceinline__ std::uint32_t swizzled(std::uint32_t base, int row, int chunk) {
  return base + static_cast<std::uint32_t>((row * (D / 8) + (chunk ^ (row & 7))) * 16);
}

/// Copies `rows` rows of D 16-bit values (row r from src + r * stride) to shared memory at
/// `base`; rows at or past `valid` are zero-filled without being read. Thread x copies chunk
/// x % (D/8) of rows x / (D/8) + i * (THREADS / (D/8)): one chunk column, so one swizzle, and
/// addresses that step by a constant.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(std::uint32_t base, const char* src, std::int64_t stride,
                                          int valid) {
  constexpr int kPerRow = D / 8, kStep = THREADS / kPerRow;
  static_assert(THREADS % kPerRow == 0 && ROWS % kStep == 0);
  const int row = static_cast<int>(threadIdx.x) / kPerRow,
            chunk = static_cast<int>(threadIdx.x) % kPerRow;
  const char* from = src + (row * stride + chunk * 8) * 2;
  const std::int64_t step = kStep * stride * 2;
#pragma unroll
  for (int i = 0; i < ROWS / kStep; ++i) {
    const bool ok = row + i * kStep < valid;
    arch::cp_async_16(swizzled<D>(base, row + i * kStep, chunk), ok ? from : src, ok);
    from += step;
  }
}

template <class O>
__device__ __forceinline__ void store_pair(O* dst, float a, float b) {
  if constexpr (sizeof(O) == 4) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    *reinterpret_cast<std::uint32_t*>(dst) = arch::pack2<O>(a, b);
  }
}

/// 2^x for x <= 0 or -inf (MUFU.EX2, flushing subnormal results to zero).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// Threads of an instantiation: a warp per 16 query rows.
template <int BM>
__host__ __device__ constexpr int threads() {
  return BM / 16 * 32;
}

/// Blocks per SM the registers are held to: 128 registers a thread at D = 64 (16 warps of 4 per
/// SM), 255 at D = 128 (its accumulators alone take 96).
template <int D, int BM>
__host__ __device__ constexpr int min_blocks() {
  const int per_sm = (D == 64 ? 512 : 256) / threads<BM>();
  return per_sm > 1 ? per_sm : 1;
}

template <class T, int D, class O, int BM, int BN>
__global__ void __launch_bounds__(threads<BM>(), (min_blocks<D, BM>()))
    block_sparse_kernel(const __grid_constant__ params p) {
  static_assert(D % 64 == 0 && BM % 16 == 0 && BN % 16 == 0);
  constexpr int kThreads = threads<BM>();
  constexpr int kStage = BN * D * 2;
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t sq = arch::shared_address(shared_raw);
  const std::uint32_t sk = sq + BM * D * 2, sv = sk + 2 * kStage;

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int g = lane / 4, tq = lane % 4;
  const int h = static_cast<int>(blockIdx.x) % p.heads;
  const tile t = p.tiles[blockIdx.x / p.heads];
  const std::int64_t q0 = p.cu_q[t.seq], k0 = p.cu_k[t.seq];
  const int lq = static_cast<int>(p.cu_q[t.seq + 1] - q0),
            lk = static_cast<int>(p.cu_k[t.seq + 1] - k0);
  const int shift = lk - lq;  // causal: key j is visible to row i iff j <= i + shift
  const std::int32_t* row =
      p.row_ptr + p.mask_row[t.seq * p.mask_heads + (p.mask_heads == 1 ? 0 : h)] + t.row0 / p.block;
  const std::int32_t e0 = row[0], e1 = row[1];
  const int sub = p.block / BN;  // key tiles per key block
  const int last_row = min(t.row0 + BM, lq) - 1;
  // The last key any row of the tile sees, and the last every row sees (no masking up to it).
  const int kmax = p.causal ? min(lk - 1, last_row + shift) : lk - 1;
  const int kall = p.causal ? min(lk - 1, t.row0 + shift) : lk - 1;
  const int tiles = (e1 - e0) * sub;
  // Key start of the it-th tile, or -1 past the end (block lists ascend, so the causal limit
  // ends the walk).
  const auto key_start = [&](int it) -> int {
    if (it >= tiles) return -1;
    const int j = p.col_idx[e0 + it / sub] * p.block + (it % sub) * BN;
    return j <= kmax ? j : -1;
  };

  const char* qg = static_cast<const char*>(p.q) + ((q0 + t.row0) * p.q_row + h * p.q_head) * 2;
  const char* kg = static_cast<const char*>(p.k) + (k0 * p.k_row + h * p.k_head) * 2;
  const char* vg = static_cast<const char*>(p.v) + (k0 * p.v_row + h * p.v_head) * 2;
  int j_cur = key_start(0);
  if (j_cur >= 0) {
    load_rows<D, BM, kThreads>(sq, qg, p.q_row, lq - t.row0);
    arch::cp_async_commit();
    load_rows<D, BN, kThreads>(sk, kg + j_cur * p.k_row * 2, p.k_row, lk - j_cur);
    load_rows<D, BN, kThreads>(sv, vg + j_cur * p.v_row * 2, p.v_row, lk - j_cur);
    arch::cp_async_commit();
  }

  std::uint32_t qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // Running max (log2 units) and this thread's partial sum of its rows i_lo and i_lo + 8.
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const int i_lo = t.row0 + warp * 16 + g;

  for (int it = 0; j_cur >= 0; ++it) {
    const int stage = static_cast<int>(it & 1);
    const int j_next = key_start(it + 1);
    if (j_next >= 0) {
      const std::uint32_t off = (stage ^ 1) * kStage;
      load_rows<D, BN, kThreads>(sk + off, kg + j_next * p.k_row * 2, p.k_row, lk - j_next);
      load_rows<D, BN, kThreads>(sv + off, vg + j_next * p.v_row * 2, p.v_row, lk - j_next);
    }
    arch::cp_async_commit();
    arch::cp_async_wait<1>();
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        arch::ldmatrix_x4(qa[kk], swizzled<D>(sq, warp * 16 + lane % 16, 2 * kk + lane / 16));
    }
    const std::uint32_t ks = sk + stage * kStage, vs = sv + stage * kStage;

    // S = Q Kᵀ for this warp's 16 rows and the tile's BN keys.
    float s[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        std::uint32_t b[4];
        arch::ldmatrix_x4(
            b, swizzled<D>(ks, np * 16 + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
        arch::mma_16x8x16_f32<T>(s[2 * np], qa[kk], {b[0], b[1]});
        arch::mma_16x8x16_f32<T>(s[2 * np + 1], qa[kk], {b[2], b[3]});
      }
    }
    // Scale (into log2 units) and mask keys past the sequence or the causal limit.
    const bool masked = j_cur + BN - 1 > kall;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] *= p.scale_log2;
        if (masked) {
          const int j = j_cur + n * 8 + 2 * tq + (e & 1);
          const int i = i_lo + (e >> 1) * 8;
          if (j >= lk || (p.causal && j > i + shift)) s[n][e] = kNegInf;
        }
      }
    }
    // Online softmax of rows i_lo + 8 r.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = kNegInf;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == kNegInf ? 0.f : m_new;  // a row with no key yet stays at 0
      const float alpha = exp2_approx(m[r] - base);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        s[n][2 * r] = exp2_approx(s[n][2 * r] - base);
        s[n][2 * r + 1] = exp2_approx(s[n][2 * r + 1] - base);
        sum += s[n][2 * r] + s[n][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }
    // O += P V: P's A fragments straight from the S accumulators.
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) {
      const std::uint32_t pa[4] = {arch::pack2<T>(s[2 * kp][0], s[2 * kp][1]),
                                   arch::pack2<T>(s[2 * kp][2], s[2 * kp][3]),
                                   arch::pack2<T>(s[2 * kp + 1][0], s[2 * kp + 1][1]),
                                   arch::pack2<T>(s[2 * kp + 1][2], s[2 * kp + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t b[4];
        arch::ldmatrix_x4_trans(
            b, swizzled<D>(vs, kp * 16 + lane % 8 + 8 * ((lane / 8) % 2), 2 * dp + lane / 16));
        arch::mma_16x8x16_f32<T>(o[2 * dp], pa, {b[0], b[1]});
        arch::mma_16x8x16_f32<T>(o[2 * dp + 1], pa, {b[2], b[3]});
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    j_cur = j_next;
  }

  // O / l; rows with no key (l = 0) give zeros.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int i = i_lo + 8 * r;
    if (i >= lq) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    O* dst = static_cast<O*>(p.out) + (q0 + i) * p.o_row + h * p.o_head + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair(dst + 8 * n, o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }
}

}  // namespace trisparse::cuda::block_sparse
