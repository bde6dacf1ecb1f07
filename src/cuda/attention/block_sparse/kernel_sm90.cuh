#pragma once
// The Hopper version of the fused block-sparse kernel (sm_90a): the same walk, tiles and online
// softmax as kernel.cuh, with a warpgroup (4 warps) per 64 query rows and both products as
// wgmma m64n64k16: S = Q Kᵀ with the K tile read K-major from shared memory and Q's fragments in
// registers (or, at D = 64 with 64-key steps, Q read from shared memory too, so that four blocks
// fit an SM), O += P V with P from the S accumulators and the V tile read N-major (transposed),
// through 128-byte-swizzle descriptors; no ldmatrix for K or V.
//
// The softmax of key tile i + 1 overlaps the P V product of tile i: each step issues
// S_{i+1} = Q K_{i+1} and O += P_i V_i, waits for S_{i+1} alone, computes P_{i+1} while the tensor
// cores finish P_i V_i, then rescales O. Tile i + 2 loads during step i: K tiles through two
// shared-memory slots (K_i is free once S_i is done, a step before V_i), V tiles through three;
// the Q tile stays resident. A step takes BN keys: 64, or 128 (S as two 64-key wgmma halves;
// the two-warpgroup kernel below at D = 64 uses them). A K/V tile whose BN keys all lie in the
// sequence arrives by TMA (one thread issues it, a shared-memory barrier per V slot counts its
// bytes); the others, and every tile where K or V has no tensor map, through cp.async by all
// threads, rows past the sequence zero-filled.
#include <cuda.h>

#include "../../common/arch/tma.cuh"
#include "../../common/arch/wgmma.cuh"
#include "tile.cuh"

namespace trisparse::cuda::block_sparse::sm90 {

constexpr int kRows = 64;  // query rows per block: one warpgroup
constexpr int kThreads = 128;
constexpr int kSlotsK = 2, kSlotsV = 3;  // K and V tiles in shared memory

/// Shared-memory bytes: the Q tile, two K and three V tiles of BN keys, and 1024 bytes to align
/// them to the swizzle pattern (49 KB at D = 64 with 64-key steps: four blocks fit an SM).
template <int D, int BN>
__host__ __device__ constexpr int shared_bytes() {
  return kRows * D * 2 + (kSlotsK + kSlotsV) * BN * D * 2 + 1024;
}

/// Blocks per SM the registers are held to: 4 at D = 64 with 64-key steps (128 registers), else 2.
template <int D, int BN>
__host__ __device__ constexpr int min_blocks() {
  return D == 64 && BN == 64 ? 4 : 2;
}

/// K's and V's TMA descriptors: [rows, heads, D] as 3-D tensors, boxes of 64 keys x 1 head x 64
/// dims with the 128-byte swizzle (the tiles' layout); use = false where they could not be encoded.
struct tma_maps {
  CUtensorMap k, v;
  bool use;
};

template <int N>
__device__ __forceinline__ float (&flat(float (&a)[N][4]))[4 * N] {
  return reinterpret_cast<float(&)[4 * N]>(a);
}

/// S = Q Kᵀ for the K tile of BN keys at `k`, 64 keys (key rows 64 c.., 8 KB into each panel) at
/// a time into s[8 c ..]: k16 step kk reads columns 16 kk.. of panel kk / 4 (32 bytes a step into
/// it); one commit group. ONCE: K's descriptor built once and stepped (sw128_advance), else built
/// at every step.
template <class T, int D, int BN, bool ONCE = true>
__device__ __forceinline__ void issue_scores(float (&s)[BN / 8][4],
                                             const std::uint32_t (&qa)[D / 16][4],
                                             std::uint32_t k) {
  const std::uint64_t dk = arch::sw128_descriptor(k);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int c = 0; c < BN / 64; ++c) {
      const std::uint32_t at = (kk / 4) * BN * 128 + c * 64 * 128 + (kk % 4) * 32;
      arch::wgmma_64x64x16<T, 0>(
          reinterpret_cast<float(&)[32]>(s[8 * c]), qa[kk],
          ONCE ? arch::sw128_advance(dk, at) : arch::sw128_descriptor(k + at), kk > 0);
    }
  }
  arch::wgmma_commit();
}

/// The same with Q read from the 64-row Q tile at `q` in shared memory (laid out like K).
template <class T, int D, int BN>
__device__ __forceinline__ void issue_scores(float (&s)[BN / 8][4], std::uint32_t q,
                                             std::uint32_t k) {
  const std::uint64_t dq = arch::sw128_descriptor(q), dk = arch::sw128_descriptor(k);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const std::uint64_t a = arch::sw128_advance(dq, (kk / 4) * 64 * 128 + (kk % 4) * 32);
#pragma unroll
    for (int c = 0; c < BN / 64; ++c) {
      const std::uint32_t at = (kk / 4) * BN * 128 + c * 64 * 128 + (kk % 4) * 32;
      arch::wgmma_64x64x16_ss<T>(reinterpret_cast<float(&)[32]>(s[8 * c]), a,
                                 arch::sw128_advance(dk, at), kk > 0);
    }
  }
  arch::wgmma_commit();
}

/// Negates the ROWS x D tile at `base` in shared memory (the sign bits of every 16-bit value): the
/// Q tile where the scale is negative, so that the softmax sees S negated and a scale >= 0
/// (params::scale_log2). The tile must have landed (after a barrier); a barrier must follow
/// before the products read it.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void negate_tile(std::uint32_t base) {
  for (int i = static_cast<int>(threadIdx.x); i < ROWS * D / 8; i += THREADS)
    arch::xor_shared_16(base + 16 * static_cast<std::uint32_t>(i), 0x80008000u);
  arch::fence_proxy_async();
}

/// O += P V for the V tile of BN keys at `v`: k16 step kp reads key rows 16 kp.. (two 8-row
/// groups, 2048 bytes a step); the output columns 64 dp.. come from panel dp; one commit group;
/// ONCE as for issue_scores.
template <class T, int D, int BN, bool ONCE = true>
__device__ __forceinline__ void issue_values(float (&o)[D / 8][4],
                                             const std::uint32_t (&pa)[BN / 16][4],
                                             std::uint32_t v) {
  const std::uint64_t dv = arch::sw128_descriptor(v);
#pragma unroll
  for (int kp = 0; kp < BN / 16; ++kp) {
#pragma unroll
    for (int dp = 0; dp < D / 64; ++dp) {
      const std::uint32_t at = dp * BN * 128 + kp * 2048;
      arch::wgmma_64x64x16<T, 1>(
          reinterpret_cast<float(&)[32]>(o[8 * dp]), pa[kp],
          ONCE ? arch::sw128_advance(dv, at) : arch::sw128_descriptor(v + at), true);
    }
  }
  arch::wgmma_commit();
}

/// Issues one K tile and one V tile of BN keys by TMA (one thread): the rows from key `row` of
/// head `h` into `k_dst` and `v_dst` (D / 64 swizzled panels of BN x 64 each), completing on the
/// barrier at `bar`, which expects both tiles' bytes.
template <int D, int BN>
__device__ __forceinline__ void tma_load_kv_tile(std::uint32_t k_dst, std::uint32_t v_dst,
                                                 const tma_maps& maps, std::uint32_t bar, int h,
                                                 int row) {
  arch::mbarrier_arrive_expect_tx(bar, 2 * BN * D * 2);
#pragma unroll
  for (int panel = 0; panel < D / 64; ++panel) {
    arch::tma_load_3d(k_dst + panel * BN * 128, &maps.k, bar, 64 * panel, h, row);
    arch::tma_load_3d(v_dst + panel * BN * 128, &maps.v, bar, 64 * panel, h, row);
  }
}

/// BN keys per step (launched with 64; 128 needs blocks that are multiples of 128). DROPOUT: P
/// times params' dropout factors on the way to O (block_sparse_kernel's).
template <class T, int D, class O, int BN, bool DROPOUT = false, bool BIAS = false>
__global__ void __launch_bounds__(kThreads, min_blocks<D, BN>())
    block_sparse_wgmma_kernel(const __grid_constant__ params p,
                              const __grid_constant__ tma_maps maps) {
  static_assert(D % 64 == 0);
  constexpr int kTile = BN * D * 2;  // bytes of one K or V tile
  extern __shared__ uint4 shared_raw[];
  // The Q tile, then K tile t in slot t % 2 and V tile t in slot t % 3.
  const std::uint32_t q_tile = (arch::shared_address(shared_raw) + 1023u) & ~1023u;
  const auto k_tile = [&](int t) {
    return q_tile + static_cast<std::uint32_t>(kRows * D * 2 + (t % kSlotsK) * kTile);
  };
  const auto v_tile = [&](int t) {
    return q_tile + static_cast<std::uint32_t>(kRows * D * 2 + (kSlotsK + t % kSlotsV) * kTile);
  };

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  tile_walk<kRows, BN> w(p);
  const char* qg = static_cast<const char*>(p.q) + ((w.q0 + w.row0) * p.q_row + w.h * p.q_head) * 2;
  const char* kg = static_cast<const char*>(p.k) + (w.k0 * p.k_row + w.h * p.k_head) * 2;
  const char* vg = static_cast<const char*>(p.v) + (w.k0 * p.v_row + w.h * p.v_head) * 2;
  // Tile t's barrier (TMA tiles) is x = t % 3: bit x of `pending` says a TMA tile is in flight
  // there, bit x of `phases` the parity of its barrier's next phase.
  __shared__ alignas(8) std::uint64_t tile_bars[kSlotsV];
  const std::uint32_t bars = arch::shared_address(tile_bars);
  std::uint32_t pending = 0, phases = 0;
  if (maps.use) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int x = 0; x < kSlotsV; ++x) arch::mbarrier_init(bars + 8 * x, 1);
    }
    __syncthreads();
  }
  const auto load_tile = [&](int t, int j) {
    const int x = t % kSlotsV;
    if (maps.use && j + BN <= w.lk) {
      if (threadIdx.x == 0)
        tma_load_kv_tile<D, BN>(k_tile(t), v_tile(t), maps, bars + 8 * x, w.h,
                                static_cast<int>(w.k0 + j));
      pending |= 1u << x;
      return;
    }
    load_rows<D, BN, kThreads>(k_tile(t), kg + j * p.k_row * 2, p.k_row, w.lk - j);
    load_rows<D, BN, kThreads>(v_tile(t), vg + j * p.v_row * 2, p.v_row, w.lk - j);
  };
  // After cp_async_wait: tile t, if it came by TMA, has landed too.
  const auto wait_tma = [&](int t) {
    const int x = t % kSlotsV;
    if ((pending >> x & 1u) == 0) return;
    arch::mbarrier_wait(bars + 8 * x, phases >> x & 1u);
    phases ^= 1u << x;
    pending &= ~(1u << x);
  };

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const int i_lo = w.row0 + warp * 16 + lane / 4;
  [[maybe_unused]] const auto drops = draws_if<DROPOUT>(p);

  // Q's A operand from shared memory where that lets a fourth block fit an SM (D = 64 with 64-key
  // steps: 128 registers; +6-11% there), else from registers, loaded once by ldmatrix (1-4% faster
  // than from shared memory where the blocks per SM are the same). docs/notes/block_sparse.md.
  constexpr bool kQShared = min_blocks<D, BN>() == 4;
  std::uint32_t qa[kQShared ? 1 : D / 16][4];
  const auto issue_s = [&](float(&s)[BN / 8][4], int t) {
    if constexpr (kQShared)
      issue_scores<T, D, BN>(s, q_tile, k_tile(t));
    else
      issue_scores<T, D, BN>(s, qa, k_tile(t));
  };

  int j_cur = w.next();
  if (j_cur < 0) {
    store_rows<O, D>(o, m, l, w, i_lo);
    return;
  }
  int j_next = w.next();
  // The tiles' block biases are read a step ahead: their loads run under the waits and S.
  float b2 = BIAS ? w.bias2(j_cur) : 0.f;
  // Prologue: Q and tile 0, then tile 1; S_0 and P_0.
  load_rows<D, kRows, kThreads>(q_tile, qg, p.q_row, w.lq - w.row0);
  load_tile(0, j_cur);
  arch::cp_async_commit();
  if (j_next >= 0) load_tile(1, j_next);
  arch::cp_async_commit();
  arch::cp_async_wait<1>();
  wait_tma(0);
  arch::fence_proxy_async();
  __syncthreads();
  if constexpr (kQShared) {
    if (p.negate_scores) {
      negate_tile<kRows, D, kThreads>(q_tile);
      __syncthreads();
    }
  } else {
    load_a_fragments<D, kRows>(qa, q_tile, warp * 16);
    apply_score_sign(qa, p);
  }
  float s[BN / 8][4];
  float alpha[2];
  arch::wgmma_fence();
  issue_s(s, 0);
  arch::wgmma_wait<0>();
  arch::fence_operands(flat(s));
  softmax_step<BN, BIAS>(s, m, l, alpha, w, j_cur, i_lo, b2);
  if constexpr (DROPOUT) drop<BN>(s, drops, w, j_cur, i_lo);

  std::uint32_t pa[BN / 16][4];
  const auto issue_pv = [&](int t) { issue_values<T, D, BN>(o, pa, v_tile(t)); };

  int it = 0;
  for (;; ++it) {
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) p_fragment<T, BN>(pa[kp], s, kp);
    if (j_next < 0) break;
    const int j_after = w.next();
    if constexpr (BIAS) b2 = w.bias2(j_next);
    arch::cp_async_wait<0>();  // tile it + 1
    wait_tma(it + 1);
    arch::fence_proxy_async();
    // Tile it + 1 visible; every warp is past step it - 1: S_it (K slot of tile it + 2) and
    // P_{it-1} V_{it-1} (V slot of tile it + 2) are done.
    __syncthreads();
    if (j_after >= 0) load_tile(it + 2, j_after);
    arch::cp_async_commit();
    arch::wgmma_fence();
    issue_s(s, it + 1);
    issue_pv(it);
    arch::wgmma_wait<1>();  // S_{it+1}; P_it V_it may still run
    arch::fence_operands(flat(s));
    softmax_step<BN, BIAS>(s, m, l, alpha, w, j_next, i_lo, b2);
    if constexpr (DROPOUT) drop<BN>(s, drops, w, j_next, i_lo);
    arch::wgmma_wait<0>();
    arch::fence_operands(flat(o));
    rescale<D>(o, alpha);
    j_next = j_after;
  }
  arch::wgmma_fence();
  issue_pv(it);
  arch::wgmma_wait<0>();
  arch::fence_operands(flat(o));
  store_rows<O, D>(o, m, l, w, i_lo);
}

/// The two-warpgroup kernel (blocks that are multiples of 128): 128 query rows per block
/// (consumer warpgroup g owns rows 64 g ..), one K/V stream for both, loaded by a third, producer
/// warpgroup. Its first warp walks the block row's key tiles and loads each into the next of four
/// stages as soon as the stage is free; a stage's `full` barrier counts the bytes (TMA) or the
/// warp's arrival (cp.async), its `empty` barrier the eight consumer warps that finished their
/// P V product on it; the tile's first key goes with it (-1 after the last tile). setmaxnreg gives
/// the producer's registers to the consumers (24 and 240 a thread). The consumers take turns
/// issuing their products (named barriers 1 and 2, the ping-pong of FlashAttention-3), so that
/// one's exponentials run while the other's products use the tensor cores.
namespace pingpong {
constexpr int kRows = 128, kThreads = 256, kStages = 4;
constexpr int kBlockThreads = kThreads + 128;  // the consumers, then the producer warpgroup
// Registers per thread after setmaxnreg: a block of 384 threads starts at 168 (65,536 / 384,
// rounded down to 8), and what the producer gives up must cover what the consumers take.
constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
static_assert(128 * (168 - kProducerRegisters) >= kThreads * (kConsumerRegisters - 168));

/// Shared-memory bytes: the Q tile, four stages of K and V tiles of BN keys, and 1024 bytes to
/// align them to the swizzle pattern.
template <int D, int BN>
__host__ __device__ constexpr int shared_bytes() {
  return kRows * D * 2 + kStages * 2 * BN * D * 2 + 1024;
}
}  // namespace pingpong

template <class T, int D, class O, int BN, bool DROPOUT = false, bool BIAS = false>
__global__ void __launch_bounds__(pingpong::kBlockThreads, 1)
    block_sparse_pingpong_kernel(const __grid_constant__ params p,
                                 const __grid_constant__ tma_maps maps) {
  static_assert(D % 64 == 0);
  constexpr int kRows = pingpong::kRows, kThreads = pingpong::kThreads, kStages = pingpong::kStages;
  constexpr int kTile = BN * D * 2;  // bytes of one K or V tile
  // The wgmma descriptors built once a tile (sw128_advance) at D = 128 (1-2 % faster, H200);
  // at D = 64 built at every k16 step, which measured 1-3 % faster there (block_sparse.md).
  constexpr bool kOnce = D != 64;
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t q_tile = (arch::shared_address(shared_raw) + 1023u) & ~1023u;
  // Stage x: K tile at k_tile(x), V tile after it.
  const auto k_tile = [&](int x) {
    return q_tile + static_cast<std::uint32_t>(kRows * D * 2 + 2 * x * kTile);
  };
  const auto v_tile = [&](int x) { return k_tile(x) + kTile; };
  __shared__ alignas(8) std::uint64_t full_bars[kStages], empty_bars[kStages];
  __shared__ int tile_keys[kStages];  // the first key of the tile in stage x, -1: none left
  const std::uint32_t full = arch::shared_address(full_bars),
                      empty = arch::shared_address(empty_bars);

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  tile_walk<kRows, BN> w(p);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int x = 0; x < kStages; ++x) {
      arch::mbarrier_init(full + 8 * x, 1);
      arch::mbarrier_init(empty + 8 * x, kThreads / 32);
    }
  }
  __syncthreads();  // the barriers' initialisation visible to every warp

  if (warp >= kThreads / 32) {
    // The producer: tile t into stage t % kStages, whose barriers' phase there is t / kStages.
    arch::set_max_registers<true, pingpong::kProducerRegisters>();
    if (warp != kThreads / 32) return;
    for (int t = 0;; ++t) {
      const int j = w.next(), x = t % kStages;
      if (t >= kStages) arch::mbarrier_wait(empty + 8 * x, (t / kStages - 1) & 1);
      if (lane == 0) tile_keys[x] = j;
      if (j < 0) {
        __syncwarp();
        if (lane == 0) arch::mbarrier_arrive(full + 8 * x);
        return;
      }
      if (maps.use && j + BN <= w.lk) {
        // A tile whose BN keys all lie in the sequence: TMA (lane 0).
        if (lane == 0)
          tma_load_kv_tile<D, BN>(k_tile(x), v_tile(x), maps, full + 8 * x, w.h,
                                  static_cast<int>(w.k0 + j));
        continue;
      }
      // Others (and every tile where K or V has no tensor map): cp.async, rows past the sequence
      // zero-filled, then the warp arrives itself.
      const std::int64_t row = w.k0 + j;
      load_rows<D, BN, 32>(k_tile(x),
                           static_cast<const char*>(p.k) + (row * p.k_row + w.h * p.k_head) * 2,
                           p.k_row, w.lk - j);
      load_rows<D, BN, 32>(v_tile(x),
                           static_cast<const char*>(p.v) + (row * p.v_row + w.h * p.v_head) * 2,
                           p.v_row, w.lk - j);
      arch::cp_async_commit();
      arch::cp_async_wait<0>();
      arch::fence_proxy_async();
      __syncwarp();
      if (lane == 0) arch::mbarrier_arrive(full + 8 * x);
    }
  }

  arch::set_max_registers<false, pingpong::kConsumerRegisters>();
  const int group = warp / 4;
  const int i_lo = w.row0 + warp * 16 + lane / 4;
  [[maybe_unused]] const auto drops = draws_if<DROPOUT>(p);
  // Tile t's key, once its stage is full: read by lane 0 alone (a volatile read, so that it is not
  // made unconditional), whose arrival on the stage's `empty` barrier (release_tile) then orders
  // the read before the producer's next write there.
  const auto wait_tile = [&](int t) {
    arch::mbarrier_wait(full + 8 * (t % kStages), (t / kStages) & 1);
    const volatile int* key = tile_keys + t % kStages;
    return __shfl_sync(0xffffffffu, lane == 0 ? *key : 0, 0);
  };
  const auto release_tile = [&](int t) {
    if (lane == 0) arch::mbarrier_arrive(empty + 8 * (t % kStages));
  };
  // Warpgroup g issues its products after barrier 1 + g, then lets the other one go (barrier
  // 2 - g); warpgroup 1 skips its last hand-over, which nobody waits for.
  const auto turn_begin = [&] { arch::barrier_sync(1 + group, kThreads); };
  const auto turn_end = [&](bool last) {
    if (!last || group == 0) arch::barrier_arrive(2 - group, kThreads);
  };

  const char* qg = static_cast<const char*>(p.q) + ((w.q0 + w.row0) * p.q_row + w.h * p.q_head) * 2;
  load_rows<D, kRows, kThreads>(q_tile, qg, p.q_row, w.lq - w.row0);
  arch::cp_async_commit();
  arch::cp_async_wait<0>();
  arch::barrier_sync(3, kThreads);  // Q visible to every consumer warp
  std::uint32_t qa[D / 16][4];
  load_a_fragments<D, kRows>(qa, q_tile, warp * 16);
  apply_score_sign(qa, p);

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const int j_cur = wait_tile(0);
  if (j_cur < 0) {
    store_rows<O, D>(o, m, l, w, i_lo);
    return;
  }
  if (group == 1) arch::barrier_arrive(1, kThreads);  // warpgroup 0 goes first
  // Each tile's block bias is read before the turn's wait: its load runs under the wait and S.
  float b2 = BIAS ? w.bias2(j_cur) : 0.f;
  float s[BN / 8][4];
  float alpha[2];
  turn_begin();
  arch::wgmma_fence();
  issue_scores<T, D, BN, kOnce>(s, qa, k_tile(0));
  turn_end(false);
  arch::wgmma_wait<0>();
  arch::fence_operands(flat(s));
  softmax_step<BN, BIAS>(s, m, l, alpha, w, j_cur, i_lo, b2);
  if constexpr (DROPOUT) drop<BN>(s, drops, w, j_cur, i_lo);

  std::uint32_t pa[BN / 16][4];
  int it = 0;
  for (;; ++it) {
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) p_fragment<T, BN>(pa[kp], s, kp);
    const int j_next = wait_tile(it + 1);
    if (j_next < 0) break;
    if constexpr (BIAS) b2 = w.bias2(j_next);
    turn_begin();
    arch::wgmma_fence();
    issue_scores<T, D, BN, kOnce>(s, qa, k_tile((it + 1) % kStages));
    issue_values<T, D, BN, kOnce>(o, pa, v_tile(it % kStages));
    turn_end(false);
    arch::wgmma_wait<1>();  // S_{it+1}; P_it V_it may still run
    arch::fence_operands(flat(s));
    softmax_step<BN, BIAS>(s, m, l, alpha, w, j_next, i_lo, b2);
    if constexpr (DROPOUT) drop<BN>(s, drops, w, j_next, i_lo);
    arch::wgmma_wait<0>();
    arch::fence_operands(flat(o));
    release_tile(it);
    rescale<D>(o, alpha);
  }
  turn_begin();
  arch::wgmma_fence();
  issue_values<T, D, BN, kOnce>(o, pa, v_tile(it % kStages));
  turn_end(true);
  arch::wgmma_wait<0>();
  arch::fence_operands(flat(o));
  store_rows<O, D>(o, m, l, w, i_lo);
}

}  // namespace trisparse::cuda::block_sparse::sm90
