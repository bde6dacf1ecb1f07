#pragma once
// What the fused block-sparse kernels (mma.sync, kernel.cuh; wgmma, kernel_sm90.cuh) share: the
// shared-memory tile layout and its cp.async loader, the walk over a query tile's active key
// tiles, the online softmax of a 16-row warp slice and the epilogue.
//
// Shared-memory tiles hold rows of D 16-bit values as D / 64 panels of 64 columns (D < 64: one
// panel, its columns past D unused); panel p of a ROWS-row tile starts at p * ROWS * 128 bytes,
// and the 16-byte chunk c of row r of a panel sits at chunk c ^ (r % 8) (the 128-byte swizzle
// wgmma reads, and conflict-free for ldmatrix).
//
// A walk (tile_walk here, key_walk in backward.cuh, segments::segment_walk) gives a thread block
// its stationary rows (row0, the sequence's q0 / k0, lq / lk, head h), its streamed tiles (next())
// and its mask: masks(j0) says whether the tile of BN streamed rows from j0 needs masking at all,
// hides(i, j, r) whether query i and key j are apart (r: the thread's stationary row slot, 0 for
// rows i_lo, 1 for i_lo + 8).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/arch/copy.cuh"
#include "../../common/arch/mma.cuh"
#include "../../common/dependent_launch.cuh"
#include "../../common/online_softmax.cuh"
#include "params.hpp"
#include "trisparse/core/dropout.hpp"

namespace trisparse::cuda::block_sparse {

/// Bytes of one row of a shared-memory tile: D 16-bit values, at least one 128-byte panel.
template <int D>
__host__ __device__ constexpr int row_bytes() {
  return (D < 64 ? 64 : D) * 2;
}

/// The address of 16-byte chunk `chunk` (0 .. 7) of panel `panel` of row `row` in a ROWS-row tile
/// at `base` (callers pass the panel apart, a compile-time 0 at D = 64).
template <int ROWS>
__device__ __forceinline__ std::uint32_t swizzled(std::uint32_t base, int row, int panel,
                                                  int chunk) {
  return base + static_cast<std::uint32_t>(((panel * ROWS + row) * 8 + (chunk ^ (row & 7))) * 16);
}

/// Copies `ROWS` rows of D 16-bit values (row r from src + r * stride) into the tile at `base`;
/// rows at or past `valid` are zero-filled without being read. Thread x (of the THREADS that
/// copy: threadIdx.x % THREADS) copies chunk x % (D/8) of rows x / (D/8) + i * (THREADS / (D/8)):
/// one chunk column, so addresses that step by a constant.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(std::uint32_t base, const char* src, std::int64_t stride,
                                          int valid) {
  constexpr int kPerRow = D / 8, kStep = THREADS / kPerRow;
  static_assert(THREADS % kPerRow == 0 && ROWS % kStep == 0);
  const int x = static_cast<int>(threadIdx.x) % THREADS, row = x / kPerRow, chunk = x % kPerRow;
  const char* from = src + (row * stride + chunk * 8) * 2;
  const std::int64_t step = kStep * stride * 2;
#pragma unroll
  for (int i = 0; i < ROWS / kStep; ++i) {
    const bool ok = row + i * kStep < valid;
    arch::cp_async_16(swizzled<ROWS>(base, row + i * kStep, chunk / 8, chunk % 8), ok ? from : src,
                      ok);
    from += step;
  }
}

/// The A fragments (m16n8k16, D / 16 k steps) of the 16 rows from `row` of the swizzled ROWS-row
/// tile at `tile`, by ldmatrix: what tile_scores takes.
template <int D, int ROWS>
__device__ __forceinline__ void load_a_fragments(std::uint32_t (&a)[D / 16][4], std::uint32_t tile,
                                                 int row) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    arch::ldmatrix_x4(a[kk],
                      swizzled<ROWS>(tile, row + lane % 16, kk / 4, 2 * (kk % 4) + lane / 16));
}

/// S = A Bᵀ for a warp's 16 stationary rows, A as D / 16 k16 fragments in registers, and the BN
/// rows of the swizzled tile at `b` (ldmatrix, two m16n8k16 products a 16-row slice), in the
/// m16n8 accumulator layout.
template <class T, int D, int BN>
__device__ __forceinline__ void tile_scores(float (&s)[BN / 8][4],
                                            const std::uint32_t (&a)[D / 16][4], std::uint32_t b) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < BN / 16; ++np) {
      std::uint32_t f[4];
      arch::ldmatrix_x4(f, swizzled<BN>(b, np * 16 + lane % 8 + 8 * (lane / 16), kk / 4,
                                        2 * (kk % 4) + (lane / 8) % 2));
      arch::mma_16x8x16_f32<T>(s[2 * np], a[kk], {f[0], f[1]});
      arch::mma_16x8x16_f32<T>(s[2 * np + 1], a[kk], {f[2], f[3]});
    }
  }
}

/// The block holding row (or key) x of a sequence, for the block bias: a shift where the block
/// is a power of two (an integer division costs ~20 instructions a tile in the softmax's loop).
__device__ __forceinline__ int bias_block(const params& p, int x) {
  return p.bias_block_log2 >= 0 ? x >> p.bias_block_log2 : x / p.block;
}

/// The block bias of head h at sequence seq's block (query block r, key block c) in log2 units
/// (params::block_bias; 0 without one).
__device__ __forceinline__ float block_bias2(const params& p, int seq, int h, int r, int c) {
  if (p.block_bias == nullptr) return 0.f;
  return p.block_bias[(std::int64_t{seq} * p.bias_qb + r) * p.bias_row + h * p.bias_head + c] *
         1.4426950408889634f;
}

/// Where a thread block's tile lies (block x = head * num + tile index): its head, its
/// sequence's query and key offsets and lengths, its first row, and the mask list it walks
/// (entries e .. e_end of `ptr`, from `lists`' offset for its sequence and head, at its row
/// block): what tile_walk and key_walk share. The arrays are named as members of P and read
/// where they are used.
struct tile_place {
  int h, lq, lk, row0, seq;
  std::int64_t q0, k0;
  int shift;  // causal: key j is visible to row i iff j <= i + shift
  int e, e_end;

  template <class P>
  __device__ __forceinline__ tile_place(const P& p, const tile* P::*tiles, std::int32_t P::*num,
                                        const std::int32_t* P::*ptr,
                                        const std::int32_t* P::*lists) {
    h = static_cast<int>(blockIdx.x / p.*num);
    const tile t = (p.*tiles)[blockIdx.x % p.*num];
    row0 = t.row0;
    seq = t.seq;
    q0 = p.cu_q[t.seq];
    k0 = p.cu_k[t.seq];
    lq = static_cast<int>(p.cu_q[t.seq + 1] - q0);
    lk = static_cast<int>(p.cu_k[t.seq + 1] - k0);
    shift = lk - lq;
    const std::int32_t* list =
        p.*ptr + (p.*lists)[t.seq * p.mask_heads + (p.mask_heads == 1 ? 0 : h)] + t.row0 / p.block;
    e = list[0];
    e_end = list[1];
  }
};

/// The query tile of this thread block (block x = head * tiles + tile) and the key tiles of BN
/// keys it visits: those of its block row's active key blocks up to the last key any of its rows
/// sees, in ascending order, or descending in the odd waves of blocks (params::down_wave; next()
/// walks them).
template <int BM, int BN>
struct tile_walk : tile_place {
  const params& p;
  int kmax;    // the last key any row of the tile sees
  int kall;    // the last key every row of the tile sees (no masking up to it)
  int u, sub;  // the walk: block e (of the block row's e .. e_end), key tile u of sub
  bool down;   // walking from the last block to the first (e_end - 1 down to e)

  __device__ __forceinline__ explicit tile_walk(const params& params)
      : tile_place(params, &block_sparse::params::tiles, &block_sparse::params::num_tiles,
                   &block_sparse::params::row_ptr, &block_sparse::params::mask_row),
        p(params) {
    sub = p.block / BN;
    down = p.down_wave > 0 && (blockIdx.x / p.down_wave) % 2 == 1;
    u = down ? sub - 1 : 0;
    const int last_row = min(row0 + BM, lq) - 1;
    kmax = p.causal ? min(lk - 1, last_row + shift) : lk - 1;
    kall = p.causal ? min(lk - 1, row0 + shift) : lk - 1;
    // Launched as a dependent (launch_kernel), the block may start while the kernel before it
    // runs (a top-k selection writing col_idx, or whatever wrote Q, K, V). Everything above reads
    // only the plan's own arrays, written when it was built; the walk, the inputs and the output
    // come after this wait.
    arch::wait_for_primary();
  }

  /// Whether key tile j0 needs masking: keys past what every row sees.
  __device__ __forceinline__ bool masks(int j0) const { return j0 + BN - 1 > kall; }
  /// The block bias (log2 units) of the key tile from j0 (a tile lies in one block).
  __device__ __forceinline__ float bias2(int j0) const {
    return block_bias2(p, seq, h, bias_block(p, row0), bias_block(p, j0));
  }
  /// Key j is past the sequence or the causal limit of row i.
  __device__ __forceinline__ bool hides(int i, int j, int) const {
    return j >= lk || (p.causal && j > i + shift);
  }

  /// The first key of the next key tile, or -1 past the end (then not to be called again).
  __device__ __forceinline__ int next() {
    if (down) {
      // Key tiles past kmax (causal limits, a top-k row's unused slots) are skipped.
      while (e < e_end) {
        const int j = p.col_idx[e_end - 1] * p.block + u * BN;
        if (--u < 0) {
          u = sub - 1;
          --e_end;
        }
        if (j <= kmax) return j;
      }
      return -1;
    }
    if (e >= e_end) return -1;
    const int j = p.col_idx[e] * p.block + u * BN;
    if (++u == sub) {
      u = 0;
      ++e;
    }
    return j <= kmax ? j : -1;
  }
};

/// Q's fragments negated (the sign bits of both 16-bit halves) where the scale is negative, so
/// that the softmax sees S negated and a scale >= 0 (params::scale_log2).
template <int N>
__device__ __forceinline__ void apply_score_sign(std::uint32_t (&qa)[N][4], const params& p) {
  if (!p.negate_scores) return;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) qa[i][j] ^= 0x80008000u;
}

/// Walks whose pairs carry a score bias of their own (segments/walk.cuh: kPairBias, with
/// pair_bias2(i, j, r) in log2 units and, for the dq pass, store_dpair(i, j, r, dS)).
template <class Walk>
inline constexpr bool pair_biased = requires {
  requires Walk::kPairBias;
};

/// Walks whose pairs carry the sum of their edges' biases (segments/walk.cuh: kEdgeBias, with
/// add_edge_bias(s, j0) once a tile on the scaled scores, and for the dq pass
/// store_edge_grads(dS, j0) after it).
template <class Walk>
inline constexpr bool edge_biased = requires {
  requires Walk::kEdgeBias;
};

/// softmax_step's work after the masking: masked elements of s are NaN (which fmaxf skips), and
/// with MASKED their P is set to 0. The scale c >= 0 (apply_score_sign) is folded into the
/// exponent's FMA: max_j c s_j = c max_j s_j; with BIAS so is the tile's block bias b2 (log2
/// units: a kernel of its own, the unbiased kernels as they were).
template <bool MASKED, int BN, bool BIAS>
__device__ __forceinline__ void softmax_rows(float (&s)[BN / 8][4], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], float c, float b2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = kNegInf;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], BIAS ? fmaf(mx, c, b2) : mx * c);  // NaN (c = 0) leaves m
    const float base = safe_max(m_new), shift = BIAS ? b2 - base : -base;
    alpha[r] = exp2_approx(m[r] - base);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        const float x = exp2_approx(fmaf(s[n][e], c, shift));
        s[n][e] = MASKED && s[n][e] != s[n][e] ? 0.f : x;
        sum += s[n][e];
      }
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

/// One online-softmax step for a warp's 16 rows: s holds S = Q Kᵀ for keys j0 .. j0 + BN - 1 in
/// the m16n8 accumulator layout (rows i_lo and i_lo + 8, i_lo = the thread's first row). Masks
/// the keys the walk hides, updates the running max m (log2 units, scale
/// applied) and this thread's partial sums l, leaves P = exp2(scale log2(e) s - m) in s and in
/// alpha the factor the output rows must be rescaled by (rescale()). BIAS: b2 is the tile's
/// block bias (w.bias2(j0)), read by the caller ahead of the tile's S, off the critical path.
template <int BN, bool BIAS = false, class Walk>
__device__ __forceinline__ void softmax_step(float (&s)[BN / 8][4], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], const Walk& w, int j0, int i_lo,
                                             float b2 = 0.f) {
  const int tq = static_cast<int>(threadIdx.x) % 4;
  if constexpr (edge_biased<Walk>) {  // s = c S, masked, plus the edges' biases, then c = 1
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + n * 8 + 2 * tq + (e & 1), i = i_lo + (e >> 1) * 8;
        s[n][e] = w.hides(i, j, e >> 1) ? __int_as_float(0x7fffffff) : s[n][e] * w.p.scale_log2;
      }
    }
    w.add_edge_bias(s, j0);
    return softmax_rows<true, BN, BIAS>(s, m, l, alpha, 1.f, b2);
  }
  if constexpr (pair_biased<Walk>) {  // s = c S + the pair's bias (log2 units), then c = 1
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + n * 8 + 2 * tq + (e & 1), i = i_lo + (e >> 1) * 8;
        s[n][e] = w.hides(i, j, e >> 1) ? __int_as_float(0x7fffffff)
                                        : fmaf(s[n][e], w.p.scale_log2, w.pair_bias2(i, j, e >> 1));
      }
    }
    return softmax_rows<true, BN, BIAS>(s, m, l, alpha, 1.f, b2);
  }
  if (!w.masks(j0)) return softmax_rows<false, BN, BIAS>(s, m, l, alpha, w.p.scale_log2, b2);
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + n * 8 + 2 * tq + (e & 1);
      const int i = i_lo + (e >> 1) * 8;
      if (w.hides(i, j, e >> 1)) s[n][e] = __int_as_float(0x7fffffff);
    }
  }
  softmax_rows<true, BN, BIAS>(s, m, l, alpha, w.p.scale_log2, b2);
}

/// Attention dropout's factors (params::dropout_state): 0 or 1 / (1 - p) per (query, key, head),
/// from the 16-bit draws of the pair's group (trisparse/core/dropout.hpp: four queries by two
/// keys, one Philox call), so the forward and both backward kernels draw the same factors whatever
/// their layouts. Rows are the sequence's own, the head is seq * heads + h (head_of): the same
/// draws whether B sequences of H heads come packed as [B N, H, D] or folded as [N, B H, D].
struct dropout_draws {
  std::uint64_t seed, offset;
  std::uint32_t below;  // drop_below16 << 16: a half compared in the high 16 bits
  float keep_scale;

  __device__ __forceinline__ explicit dropout_draws(const params& p)
      : seed(p.dropout_state[0]),
        offset(p.dropout_state[1]),
        below(p.drop_below << 16),
        keep_scale(p.dropout_scale) {}

  /// The factor of a word's low (odd = 0) or high half: 0 where the draw is below p 2^16.
  __device__ __forceinline__ float factor(std::uint32_t word, int odd) const {
    return (odd != 0 ? word : word << 16) < below ? 0.f : keep_scale;
  }
  // A thread of the m16n8 layout holds rows r and r + 8 (r = its lane / 4 within the warp's 16,
  // r % 16 < 8) and two adjacent columns of each fragment; the lanes of rows r and r ^ 1 (lane ^ 4)
  // together hold two groups of every pair of fragments n, n + 1 (columns c, c + 1 and c + 8,
  // c + 9): each lane draws one and hands the other lane the two words it needs, so one Philox
  // call serves eight pairs. Rows r of even lanes are even, the first column is even and, for the
  // dk/dv pass, a multiple of 16 plus 2 tq (streamed tiles start at multiples of 16). Both give
  // w[a][m]: the word of row slot a (rows r, r + 8) for fragment n + m, whose low half is column
  // c's draw and high half column c + 1's (factor(w[a][m], column & 1)); words, not factors, to
  // keep four registers live.

  /// Queries i + 8 a as rows (i the thread's first row), keys j, j + 1 (m = 0) and j + 8, j + 9
  /// (m = 1; j even) as columns: the forward's and the dq pass's layout. The even lane draws the
  /// group of keys j, the odd lane that of keys j + 8; each hands over its partner's rows' words.
  __device__ __forceinline__ void rows_by_keys(int i, int j, int h,
                                               std::uint32_t (&f)[2][2]) const {
    const bool even = (i & 1) == 0;
    const philox::words w = philox::group(i, even ? j : j + 8, h, seed, offset);
    // Words: queries i & ~1, i | 1, (i & ~1) + 8, (i | 1) + 8; halves: the two keys.
    const std::uint32_t mine0 = even ? w.x[0] : w.x[1], mine1 = even ? w.x[2] : w.x[3];
    const std::uint32_t got0 = __shfl_xor_sync(0xffffffffu, even ? w.x[1] : w.x[0], 4);
    const std::uint32_t got1 = __shfl_xor_sync(0xffffffffu, even ? w.x[3] : w.x[2], 4);
    f[0][0] = even ? mine0 : got0;  // keys j, j + 1
    f[1][0] = even ? mine1 : got1;
    f[0][1] = even ? got0 : mine0;  // keys j + 8, j + 9
    f[1][1] = even ? got1 : mine1;
  }

  /// Keys j + 8 a as rows (j the thread's first row), queries i, i + 1 (m = 0) and i + 8, i + 9
  /// (m = 1; i % 16 < 8, even) as columns: the dk/dv pass's layout. The even lane draws the group
  /// of keys j, j + 1, the odd lane that of keys j + 7, j + 8; each keeps its key's halves of the
  /// four query words and hands over the other key's, packed by twos.
  __device__ __forceinline__ void keys_by_queries(int i, int j, int h,
                                                  std::uint32_t (&f)[2][2]) const {
    const bool even = (j & 1) == 0;
    const philox::words w = philox::group(i, even ? j : j + 8, h, seed, offset);
    const std::uint32_t keep_half = even ? 0x5410u : 0x7632u, give_half = even ? 0x7632u : 0x5410u;
    const std::uint32_t mine0 = __byte_perm(w.x[0], w.x[1], keep_half);  // queries i, i + 1
    const std::uint32_t mine1 = __byte_perm(w.x[2], w.x[3], keep_half);  // i + 8, i + 9
    const std::uint32_t got0 =
        __shfl_xor_sync(0xffffffffu, __byte_perm(w.x[0], w.x[1], give_half), 4);
    const std::uint32_t got1 =
        __shfl_xor_sync(0xffffffffu, __byte_perm(w.x[2], w.x[3], give_half), 4);
    f[0][0] = even ? mine0 : got0;  // key j
    f[0][1] = even ? mine1 : got1;
    f[1][0] = even ? got0 : mine0;  // key j + 8
    f[1][1] = even ? got1 : mine1;
  }
};

/// A kernel's dropout draws: dropout_draws(p) with DROPOUT, else a placeholder never read.
template <bool DROPOUT>
__device__ __forceinline__ auto draws_if([[maybe_unused]] const params& p) {
  if constexpr (DROPOUT)
    return dropout_draws(p);
  else
    return 0;
}

/// The head a walk's dropout draws are counted by.
template <class Walk>
__device__ __forceinline__ int head_of(const Walk& w) {
  return w.seq * w.p.heads + w.h;
}

/// P *= the dropout factors, for s in the m16n8 accumulator layout of the warp's rows (queries
/// i_lo, i_lo + 8) and the keys j0 .. j0 + BN - 1 (sequence-local).
template <int BN, class Walk>
__device__ __forceinline__ void drop(float (&s)[BN / 8][4], const dropout_draws& d, const Walk& w,
                                     int j0, int i_lo) {
  const int tq = static_cast<int>(threadIdx.x) % 4;
  static_assert(BN % 16 == 0);
#pragma unroll
  for (int n = 0; n < BN / 8; n += 2) {  // fragments n and n + 1: one group each
    std::uint32_t f[2][2];
    d.rows_by_keys(i_lo, j0 + n * 8 + 2 * tq, head_of(w), f);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] *= d.factor(f[e >> 1][0], e & 1);
      s[n + 1][e] *= d.factor(f[e >> 1][1], e & 1);
    }
  }
}

/// o *= alpha row-wise (skipped when no row of the warp changed its max).
template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 8][4], const float (&alpha)[2]) {
  if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f))
    scale_rows(o, alpha[0], alpha[1]);
}

/// P's A fragment for keys 16 kp .. 16 kp + 15, straight from the m16n8 accumulators.
template <class T, int BN>
__device__ __forceinline__ void p_fragment(std::uint32_t (&pa)[4], const float (&s)[BN / 8][4],
                                           int kp) {
  pa[0] = arch::pack2<T>(s[2 * kp][0], s[2 * kp][1]);
  pa[1] = arch::pack2<T>(s[2 * kp][2], s[2 * kp][3]);
  pa[2] = arch::pack2<T>(s[2 * kp + 1][0], s[2 * kp + 1][1]);
  pa[3] = arch::pack2<T>(s[2 * kp + 1][2], s[2 * kp + 1][3]);
}

template <class O>
__device__ __forceinline__ void store_pair(O* dst, float a, float b) {
  if constexpr (sizeof(O) == 4) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    *reinterpret_cast<std::uint32_t*>(dst) = arch::pack2<O>(a, b);
  }
}

/// Writes O / l for the thread's rows i_lo and i_lo + 8 (rows with no key, l = 0, give zeros),
/// and where asked (params::lse) their log-sum-exp from m and l.
template <class O, int D, class Walk>
__device__ __forceinline__ void store_rows(const float (&o)[D / 8][4], const float (&m)[2],
                                           const float (&l)[2], const Walk& w, int i_lo) {
  const int tq = static_cast<int>(threadIdx.x) % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int i = i_lo + 8 * r;
    if (i >= w.lq) continue;
    if (w.p.lse != nullptr && tq == 0)
      w.p.lse[(w.q0 + i) * w.p.lse_row + w.h * w.p.lse_head] = natural_lse(m[r], sum);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    O* dst = static_cast<O*>(w.p.out) + (w.q0 + i) * w.p.o_row + w.h * w.p.o_head + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair(dst + 8 * n, o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }
}

}  // namespace trisparse::cuda::block_sparse
