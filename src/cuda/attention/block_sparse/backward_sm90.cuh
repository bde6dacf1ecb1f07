#pragma once
// The Hopper version of the block-sparse backward's dq and dk/dv kernels (sm_90a; backward.cuh
// has the algorithm, the walks and the terms): a warpgroup per 64 stationary rows (Q and dO for
// dq, K and V for dk/dv) and every product as wgmma m64n64k16 from shared memory:
//   S = X1 Y1ᵀ and T = X2 Y2ᵀ (dP, or dPᵀ) with both operands read K-major from the tiles,
//   acc += dS Y1 (dq += dS K, or dk += dSᵀ Q) and, for dk/dv, acc += P Y2 (dv += Pᵀ dO) with
//   dS and P as A fragments from the S and T accumulators and Y read N-major (transposed),
// through the forward's 128-byte-swizzle tiles and descriptors; the softmax terms, the masking
// and the epilogue are backward_kernel's (the accumulators have its m16n8 layout). The streamed
// tiles (64 rows) come through two cp.async stages, as in backward_kernel. Each gradient row is
// summed by one warpgroup in the walk's fixed order: bitwise deterministic.
#include "../../common/arch/wgmma.cuh"
#include "backward.cuh"
#include "kernel_sm90.cuh"

namespace trisparse::cuda::block_sparse::sm90 {

constexpr int kBackwardRows = 64;  // stationary and streamed rows per tile: one warpgroup

/// Shared-memory bytes: two stationary tiles, two stages of two streamed tiles, the dk/dv pass's
/// per-stage query terms, and 1024 bytes to align the tiles to the swizzle pattern.
template <int D, bool KV>
__host__ __device__ constexpr int backward_shared_bytes() {
  return block_sparse::backward_shared_bytes<D, kBackwardRows, kBackwardRows, KV>() + 1024;
}

/// acc (+)= A B over k = 64 rows: A from shared memory at `a` (64 rows, K-major, D / 64 panels of
/// 64 rows), B the 64-row tile at `b` read K-major; one k16 step reads 32 bytes further into a
/// panel. acc's old values are dropped.
template <class T, int D>
__device__ __forceinline__ void issue_products(float (&acc)[8][4], std::uint32_t a,
                                               std::uint32_t b) {
  const std::uint64_t da = arch::sw128_descriptor(a), db = arch::sw128_descriptor(b);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const std::uint32_t step = (kk / 4) * kBackwardRows * 128 + (kk % 4) * 32;
    arch::wgmma_64x64x16_ss<T>(reinterpret_cast<float(&)[32]>(acc), arch::sw128_advance(da, step),
                               arch::sw128_advance(db, step), kk > 0);
  }
}

/// acc += F Y for F's A fragments fa (64 x 64: four k16 steps over Y's rows) and the 64-row tile
/// at `y` read N-major: step kp takes rows 16 kp.. (2048 bytes a step), output columns 64 dp..
/// come from panel dp.
template <class T, int D>
__device__ __forceinline__ void issue_accumulate(float (&acc)[D / 8][4],
                                                 const std::uint32_t (&fa)[4][4], std::uint32_t y) {
  const std::uint64_t dy = arch::sw128_descriptor(y);
#pragma unroll
  for (int kp = 0; kp < 4; ++kp) {
#pragma unroll
    for (int dp = 0; dp < D / 64; ++dp) {
      const std::uint32_t at = dp * kBackwardRows * 128 + kp * 2048;
      arch::wgmma_64x64x16<T, 1>(reinterpret_cast<float(&)[32]>(acc[8 * dp]), fa[kp],
                                 arch::sw128_advance(dy, at), true);
    }
  }
}

/// The streamed tiles' copies for one thread (load_rows' split: chunk x % (D / 8) of rows
/// x / (D / 8) + i * kStep), its first chunk's address and the step between its rows computed once
/// per kernel: a tile at row y costs one multiply-add and a 64-bit add a chunk. Rows at or past
/// `valid` are zero-filled (the predicated copy reads nothing).
template <int D, int ROWS, int THREADS>
struct row_stream {
  static constexpr int kPerRow = D / 8, kStep = THREADS / kPerRow;
  static_assert(THREADS % kPerRow == 0 && ROWS % kStep == 0);
  const char* first;  // row 0's chunk of this thread
  std::int64_t row_bytes, step;
  int row, chunk;

  __device__ row_stream(const char* src, std::int64_t stride) {
    const int x = static_cast<int>(threadIdx.x) % THREADS;
    row = x / kPerRow;
    chunk = x % kPerRow;
    row_bytes = stride * 2;
    step = kStep * row_bytes;
    first = src + row * row_bytes + chunk * 16;
  }
  __device__ __forceinline__ void load(std::uint32_t base, int y, int valid) const {
    const char* from = first + y * row_bytes;
#pragma unroll
    for (int i = 0; i < ROWS / kStep; ++i) {
      arch::cp_async_16(swizzled<ROWS>(base, row + i * kStep, chunk / 8, chunk % 8), from,
                        row + i * kStep < valid - y);
      from += step;
    }
  }
};

/// dq (KV = false: a block per query tile) or dk and dv (KV: a block per key tile); DROPOUT: the
/// forward's dropout factors regenerated (backward_kernel's terms); MIN_BLOCKS: the blocks per SM
/// the registers are held to (heuristics.hpp).
template <class T, int D, bool KV, bool DROPOUT = false, int MIN_BLOCKS = 2, bool BIAS = false>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
    backward_wgmma_kernel(const __grid_constant__ backward_params p) {
  static_assert(D % 64 == 0);
  constexpr int BM = kBackwardRows, BN = kBackwardRows, kThreads = 128;
  constexpr int kStage = BN * D * 2;
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t raw = arch::shared_address(shared_raw);
  const std::uint32_t sx1 = (raw + 1023u) & ~1023u;
  const std::uint32_t sx2 = sx1 + BM * D * 2, sy1 = sx2 + BM * D * 2, sy2 = sy1 + 2 * kStage;
  // KV: per stage, the BN queries' lse2 then their dterm.
  const std::uint32_t sterm = sy2 + 2 * kStage;
  const float* terms =
      reinterpret_cast<const float*>(reinterpret_cast<const char*>(shared_raw) + (sterm - raw));

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  using walk = std::conditional_t<KV, key_walk<BM, BN>, tile_walk<BM, BN>>;
  walk w(p);
  const block_sparse::pass_rows<KV> o(p, w);
  const row_stream<D, BN, kThreads> y1r(o.y1g + (o.y0 * o.y1s + w.h * o.y1h) * 2, o.y1s),
      y2r(o.y2g + (o.y0 * o.y2s + w.h * o.y2h) * 2, o.y2s);
  const auto load_stage = [&](int stage, int y) {
    y1r.load(sy1 + stage * kStage, y, o.y_len);
    y2r.load(sy2 + stage * kStage, y, o.y_len);
    if constexpr (KV) {  // a thread per value: lse2 of the BN queries, then their dterm
      static_assert(2 * BN == kThreads);
      const int x = static_cast<int>(threadIdx.x), r = x % BN;
      const float* src = (x < BN ? p.lse2 : p.dterm) + w.h * p.rows_q + w.q0 + y + r;
      arch::cp_async_4(sterm + static_cast<std::uint32_t>((stage * 2 * BN + x) * 4), src,
                       y + r < w.lq);
    }
  };

  int y_cur = w.next();
  [[maybe_unused]] int e_cur =
      walk_entry(w);  // dk/dv: the kept block being walked (block importance)
  [[maybe_unused]] importance_sums<BN> imp(p, w.h, w.row0);
  if (y_cur >= 0) {
    o.template load_stationary<D, BM, kThreads>(sx1, sx2, w);
    load_stage(0, y_cur);
    arch::cp_async_commit();
  }

  constexpr int kAcc = KV ? 2 : 1;  // dq; or dk, dv
  float acc[kAcc][D / 8][4], row_lse[2], row_dterm[2];
  const int r_lo = w.row0 + warp * 16 + lane / 4;  // the thread's first stationary row
  start_pass<KV, D>(acc, row_lse, row_dterm, p, w, r_lo);
  const float c = p.negate_scores ? -p.scale_log2 : p.scale_log2;
  [[maybe_unused]] const auto drops = draws_if<DROPOUT>(p);

  for (int it = 0; y_cur >= 0; ++it) {
    const int stage = it & 1;
    const float b2 = BIAS ? w.bias2(y_cur) : 0.f;  // (its load under the tile's wait and products)
    const int y_next = w.next();
    [[maybe_unused]] const int e_next = walk_entry(w);
    if (y_next >= 0) load_stage(stage ^ 1, y_next);
    arch::cp_async_commit();
    arch::cp_async_wait<1>();
    arch::fence_proxy_async();  // this thread's copies, before the tensor cores read them
    __syncthreads();
    const std::uint32_t y1 = sy1 + stage * kStage, y2 = sy2 + stage * kStage;

    float s[BN / 8][4], t[BN / 8][4];
    arch::wgmma_fence();
    issue_products<T, D>(s, sx1, y1);
    issue_products<T, D>(t, sx2, y2);
    arch::wgmma_commit();
    arch::wgmma_wait<0>();
    arch::fence_operands(flat(s));
    arch::fence_operands(flat(t));

    probabilities_and_ds<BN, KV, DROPOUT, BIAS>(s, t, w, drops, y_cur, r_lo, terms + stage * 2 * BN,
                                                row_lse, row_dterm, c, b2);

    // dq += dS K; or dk += dSᵀ Q and dv += Pᵀ dO.
    std::uint32_t da[BN / 16][4], pa[KV ? BN / 16 : 1][4];
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) {
      p_fragment<T, BN>(da[kp], t, kp);
      if constexpr (KV) p_fragment<T, BN>(pa[kp], s, kp);
    }
    if constexpr (KV) {  // before the products read pa and da
      if (imp.out != nullptr) imp.template add_fragments<T>(pa, da, p.imp_grad, p.imp_signed);
    }
    arch::wgmma_fence();
    issue_accumulate<T, D>(acc[0], da, y1);
    if constexpr (KV) issue_accumulate<T, D>(acc[kAcc - 1], pa, y2);
    arch::wgmma_commit();
    if constexpr (KV) {  // the warp's reduction while the tensor cores accumulate
      if (imp.out != nullptr && (y_next < 0 || e_next != e_cur))
        imp.template flush<true>(e_cur, p.imp_grad);
    }
    arch::wgmma_wait<0>();
#pragma unroll
    for (int a = 0; a < kAcc; ++a) arch::fence_operands(flat(acc[a]));
    __syncthreads();  // every warp is done with this stage before it is refilled
    y_cur = y_next;
    e_cur = e_next;
  }

  store_pass<KV, T, D>(p, w, acc, r_lo);
}

}  // namespace trisparse::cuda::block_sparse::sm90
