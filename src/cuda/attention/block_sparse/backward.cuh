#pragma once
// Block-sparse attention backward: FlashAttention-2's algorithm over the block mask, with no
// atomics. Three kernels, in order on one stream:
//  1. terms: per query row and head, lse2 = the forward's lse in log2 units and
//     dterm = <dO, O> (fp32, head-major, in the workspace).
//  2. dq: a block per (query tile of BM rows, head) walks the tile's key tiles as the forward
//     does (tile_walk): S = Q Kᵀ, dP = dO Vᵀ, P = 2^(c S - lse2), dS = P (dP - dterm),
//     dQ += dS K; dq = scale dQ.
//  3. dk/dv: a block per (key tile of BM keys, head) walks the query tiles of the query blocks
//     whose mask rows hold its key block (the transposed mask, key_walk): Sᵀ = K Qᵀ,
//     dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q; dk = scale dK.
// Kernels 2 and 3 are one template: the stationary operands X1, X2 (BM rows: Q and dO, or K and
// V) stay in shared memory, a warp per 16 of their rows; the streamed ones Y1, Y2 (BN rows: K and
// V, or Q and dO) come through two cp.async stages; mma m16n8k16 with fp32 accumulators. Each
// gradient row is summed by one warp in the walk's fixed order: bitwise deterministic.
#include <type_traits>

#include "../../common/convert.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "importance.cuh"
#include "tile.cuh"
#include "trisparse/core/dtype.hpp"

namespace trisparse::cuda::block_sparse {

template <int D, int BM, int BN, bool KV>
__host__ __device__ constexpr int backward_shared_bytes() {
  return (2 * BM + 4 * BN) * row_bytes<D>() + (KV ? 4 * BN * 4 : 0);
}

/// A warp per (query row, head): terms[h * rows_q + row] = lse * log2(e) and
/// terms[(heads + h) * rows_q + row] = <dout, out> over the `dim` columns.
template <class T, class Out>
__global__ void backward_terms_kernel(const __grid_constant__ backward_params p, int dim,
                                      float* terms) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t item =
      std::int64_t{blockIdx.x} * (blockDim.x / 32) + static_cast<int>(threadIdx.x) / 32;
  if (item >= p.rows_q * p.heads) return;
  const std::int64_t row = item / p.heads;
  const int h = static_cast<int>(item % p.heads);
  const T* dout = static_cast<const T*>(p.dout) + row * p.do_row + h * p.do_head;
  const Out* out = static_cast<const Out*>(p.out) + row * p.o_row + h * p.o_head;
  float acc = 0.f;
  for (int d = lane; d < dim; d += 32) acc += convert<float>(dout[d]) * convert<float>(out[d]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) {
    terms[h * p.rows_q + row] = p.lse[row * p.lse_row + h * p.lse_head] * 1.4426950408889634f;
    terms[(p.heads + h) * p.rows_q + row] = acc;
  }
}

/// backward_terms_kernel's result with L lanes an item (dim = 8 L; 16-byte aligned rows): lane
/// reads of 8 elements (16 bytes of dout, 16 or 32 of out), items head-major so that a warp's
/// 32 / L items are consecutive rows of one head and its writes of the terms are contiguous.
template <class T, class Out, int L>
__global__ void backward_terms_vector_kernel(const __grid_constant__ backward_params p,
                                             float* terms) {
  const std::int64_t thread = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::int64_t item = thread / L;
  if (item >= p.rows_q * p.heads) return;  // whole groups of L lanes leave together
  const int h = static_cast<int>(item / p.rows_q);
  const std::int64_t row = item % p.rows_q;
  const int d0 = 8 * static_cast<int>(thread % L);
  const T* dout = static_cast<const T*>(p.dout) + row * p.do_row + h * p.do_head + d0;
  const Out* out = static_cast<const Out*>(p.out) + row * p.o_row + h * p.o_head + d0;
  alignas(16) T g[8];
  alignas(16) Out o[8];
  *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(dout);
#pragma unroll
  for (int c = 0; c < static_cast<int>(sizeof(o) / 16); ++c)
    reinterpret_cast<uint4*>(o)[c] = reinterpret_cast<const uint4*>(out)[c];
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) acc += convert<float>(g[c]) * convert<float>(o[c]);
  // The item's L lanes only: items past the end have left (a group leaves whole).
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned group = L == 32 ? 0xffffffffu : ((1u << L) - 1u) << (lane & ~(L - 1));
#pragma unroll
  for (int o2 = L / 2; o2 > 0; o2 /= 2) acc += __shfl_xor_sync(group, acc, o2);
  if (thread % L == 0) {
    terms[h * p.rows_q + row] = p.lse[row * p.lse_row + h * p.lse_head] * 1.4426950408889634f;
    terms[(p.heads + h) * p.rows_q + row] = acc;
  }
}

/// Whether dout and out (elements of `dout_bytes` and `out_bytes`) sit in 16-byte aligned rows
/// of `dim` = 8 L elements, L a power of two up to 32: backward_terms_vector_kernel's case.
inline bool terms_vectorise(const backward_params& p, int dim, int dout_bytes, int out_bytes) {
  const auto aligned = [](const void* ptr, std::int64_t row, std::int64_t head, int bytes) {
    return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0 && (row * bytes) % 16 == 0 &&
           (head * bytes) % 16 == 0;
  };
  const int lanes = dim / 8;
  return dim % 8 == 0 && lanes >= 1 && lanes <= 32 && (lanes & (lanes - 1)) == 0 &&
         aligned(p.dout, p.do_row, p.do_head, dout_bytes) &&
         aligned(p.out, p.o_row, p.o_head, out_bytes);
}

/// Launches the terms over the p.rows_q x p.heads (row, head) items, `out` f32 or T, into terms
/// (p.lse2 and p.dterm point into it): the vector kernel where terms_vectorise, else a warp an
/// item.
template <class T>
void launch_backward_terms(const backward_params& p, dtype out, int dim, float* terms,
                           cudaStream_t s) {
  constexpr int kThreads = 256;
  const std::int64_t items = p.rows_q * p.heads;
  if (items == 0) return;
  const bool f32 = out == dtype::f32;
  if (terms_vectorise(p, dim, sizeof(T), f32 ? 4 : 2)) {
    const auto vector = [&]<class Out>() {
      const auto run = [&]<int L>() {
        const auto blocks = static_cast<unsigned>((items * L + kThreads - 1) / kThreads);
        backward_terms_vector_kernel<T, Out, L><<<blocks, kThreads, 0, s>>>(p, terms);
      };
      with_value<1, 2, 4, 8, 16, 32>(dim / 8, "the terms kernel's lanes a head", run);
    };
    if (f32)
      vector.template operator()<float>();
    else
      vector.template operator()<T>();
  } else {
    const auto blocks = static_cast<unsigned>((items + kThreads / 32 - 1) / (kThreads / 32));
    if (f32)
      backward_terms_kernel<T, float><<<blocks, kThreads, 0, s>>>(p, dim, terms);
    else
      backward_terms_kernel<T, T><<<blocks, kThreads, 0, s>>>(p, dim, terms);
  }
  TRISPARSE_CUDA_TRY(cudaGetLastError());
}

/// The key tile of this block (block x = head * num_key_tiles + tile) and the query tiles of BN
/// rows it visits: those of the query blocks listed for its key block, ascending, that hold a
/// row seeing one of its keys.
template <int BM, int BN>
struct key_walk : tile_place {
  const backward_params& p;
  int u, sub;
  int first_row;   // causal: rows before it see none of the tile's keys
  int entry = -1;  // the transposed entry (kept block) of the tile next() returned last

  __device__ __forceinline__ explicit key_walk(const backward_params& params)
      : tile_place(params, &backward_params::key_tiles, &backward_params::num_key_tiles,
                   &backward_params::t_ptr, &backward_params::t_mask_col),
        p(params) {
    sub = p.block / BN;
    u = 0;
    first_row = p.causal ? row0 - shift : 0;
    arch::wait_for_primary();  // as tile_walk: the terms kernel's output is read after this
  }

  /// Whether query tile i0 needs masking: rows or keys past the sequences, or the causal limit
  /// (keys past the sequence too: their P enters the block importance).
  __device__ __forceinline__ bool masks(int i0) const {
    return i0 + BN > lq || row0 + BM > lk || (p.causal && row0 + BM - 1 > i0 + shift);
  }
  __device__ __forceinline__ bool hides(int i, int j, int) const {
    return i >= lq || j >= lk || (p.causal && j > i + shift);
  }
  /// The block bias (log2 units) of the query tile from i0 (in one block) and this key tile.
  __device__ __forceinline__ float bias2(int i0) const {
    return block_bias2(p, seq, h, bias_block(p, i0), bias_block(p, row0));
  }

  /// The first query row of the next query tile, or -1 past the end.
  __device__ __forceinline__ int next() {
    while (e < e_end) {
      const int at = e, i = p.t_idx[e] * p.block + u * BN;
      if (++u == sub) {
        u = 0;
        ++e;
      }
      if (i < lq && min(i + BN, lq) - 1 >= first_row) {
        entry = at;
        return i;
      }
    }
    return -1;
  }
};

/// Writes f * acc's rows (the thread's r_lo and r_lo + 8, those below `valid`) at `base` (row i
/// at base + i * row_stride elements), as G.
template <class G, int D>
__device__ __forceinline__ void store_gradient(void* base, std::int64_t row_stride,
                                               const float (&acc)[D / 8][4], float f, int r_lo,
                                               int valid) {
  const int tq = static_cast<int>(threadIdx.x) % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = r_lo + 8 * r;
    if (i >= valid) continue;
    G* dst = static_cast<G*>(base) + i * row_stride + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair(dst + 8 * n, acc[n][2 * r] * f, acc[n][2 * r + 1] * f);
  }
}

/// What a dq (KV = false) or dk/dv (KV) pass reads, for the mma.sync and wgmma kernels alike:
/// the stationary rows X1, X2 (Q and dO, or K and V) from row x0 of the sequence on and the
/// streamed rows Y1, Y2 (K and V, or Q and dO) from row y0 on; strides in elements.
template <bool KV>
struct pass_rows {
  const char* x1g;
  const char* x2g;
  const char* y1g;
  const char* y2g;
  std::int64_t x1s, x2s, y1s, y2s, x1h, x2h, y1h, y2h, x0, y0;
  int x_len, y_len;

  template <class Walk>
  __device__ __forceinline__ pass_rows(const backward_params& p, const Walk& w)
      : x1g(static_cast<const char*>(KV ? p.k : p.q)),
        x2g(static_cast<const char*>(KV ? p.v : p.dout)),
        y1g(static_cast<const char*>(KV ? p.q : p.k)),
        y2g(static_cast<const char*>(KV ? p.dout : p.v)),
        x1s(KV ? p.k_row : p.q_row),
        x2s(KV ? p.v_row : p.do_row),
        y1s(KV ? p.q_row : p.k_row),
        y2s(KV ? p.do_row : p.v_row),
        x1h(KV ? p.k_head : p.q_head),
        x2h(KV ? p.v_head : p.do_head),
        y1h(KV ? p.q_head : p.k_head),
        y2h(KV ? p.do_head : p.v_head),
        x0(KV ? w.k0 : w.q0),
        y0(KV ? w.q0 : w.k0),
        x_len(KV ? w.lk : w.lq),
        y_len(KV ? w.lq : w.lk) {}

  /// The stationary tiles (BM rows from the walk's row0) into sx1 and sx2, as one cp.async group.
  template <int D, int BM, int THREADS, class Walk>
  __device__ __forceinline__ void load_stationary(std::uint32_t sx1, std::uint32_t sx2,
                                                  const Walk& w) const {
    load_rows<D, BM, THREADS>(sx1, x1g + ((x0 + w.row0) * x1s + w.h * x1h) * 2, x1s,
                              x_len - w.row0);
    load_rows<D, BM, THREADS>(sx2, x2g + ((x0 + w.row0) * x2s + w.h * x2h) * 2, x2s,
                              x_len - w.row0);
    arch::cp_async_commit();
  }
};

/// A pass's accumulators zeroed (dq; or dk, dv) and, for dq, the terms (lse2, dterm) of the
/// thread's query rows r_lo and r_lo + 8 (zeros for dk/dv, which reads its queries' per stage).
template <bool KV, int D, int ACC, class Walk>
__device__ __forceinline__ void start_pass(float (&acc)[ACC][D / 8][4], float (&row_lse)[2],
                                           float (&row_dterm)[2], const backward_params& p,
                                           const Walk& w, int r_lo) {
#pragma unroll
  for (int a = 0; a < ACC; ++a)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[a][n][0] = acc[a][n][1] = acc[a][n][2] = acc[a][n][3] = 0.f;
  row_lse[0] = row_lse[1] = row_dterm[0] = row_dterm[1] = 0.f;
  if constexpr (!KV) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r_lo + 8 * r < w.lq) {
        row_lse[r] = p.lse2[w.h * p.rows_q + w.q0 + r_lo + 8 * r];
        row_dterm[r] = p.dterm[w.h * p.rows_q + w.q0 + r_lo + 8 * r];
      }
    }
  }
}

/// A pass's gradients from its accumulators: dq = scale acc[0]; or dk = scale acc[0] and
/// dv = acc[1]; in f32 or T as the run asks.
template <bool KV, class T, int D, int ACC, class Walk>
__device__ __forceinline__ void store_pass(const backward_params& p, const Walk& w,
                                           const float (&acc)[ACC][D / 8][4], int r_lo) {
  const auto store = [&]<class G>() {
    if constexpr (KV) {
      store_gradient<G, D>(static_cast<G*>(p.dk) + (w.k0 * p.dk_row + w.h * p.dk_head), p.dk_row,
                           acc[0], p.scale, r_lo, w.lk);
      store_gradient<G, D>(static_cast<G*>(p.dv) + (w.k0 * p.dv_row + w.h * p.dv_head), p.dv_row,
                           acc[ACC - 1], 1.f, r_lo, w.lk);
    } else {
      store_gradient<G, D>(static_cast<G*>(p.dq) + (w.q0 * p.dq_row + w.h * p.dq_head), p.dq_row,
                           acc[0], p.scale, r_lo, w.lq);
    }
  };
  if (p.grads_f32)
    store.template operator()<float>();
  else
    store.template operator()<T>();
}

/// The backward's elementwise step, shared by the mma.sync and wgmma kernels (both hold S and T in
/// the m16n8 accumulator layout: the thread's stationary rows r_lo and r_lo + 8, streamed rows
/// y + 8 n + 2 tq + {0, 1}): from S = X1 Y1ᵀ and T = dP (or dPᵀ), P = 2^(c S - lse2) into s and
/// dS = P (m dP - dterm) into t, masked pairs exact zeros; BIAS: the block bias added to the
/// scores. With DROPOUT, m the forward's factors (regenerated) and, for dk/dv (KV), s = m P (dV's
/// operand). The terms: dq's row_lse/row_dterm per stationary row; dk/dv's from `terms` (the
/// stage's BN lse2 values, then BN dterm values).
template <int BN, bool KV, bool DROPOUT, bool BIAS, class Walk, class Draws>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[BN / 8][4], float (&t)[BN / 8][4],
                                                     const Walk& w, const Draws& drops, int y,
                                                     int r_lo, const float* terms,
                                                     const float (&row_lse)[2],
                                                     const float (&row_dterm)[2], float c,
                                                     float b2) {
  const int tq = static_cast<int>(threadIdx.x) % 4;
  // BIAS: the tile's block bias b2 (w.bias2(y), log2 units, read by the caller ahead of the
  // tile's products) enters as lse2 - b2: per row for dq, per streamed query for dk/dv (a kernel
  // of its own: the unbiased kernels' registers stay as they were).
  const float lse_rows[2] = {row_lse[0] - b2, row_lse[1] - b2};
  if constexpr (edge_biased<Walk>) {  // s = c S plus the edges' biases, then c = 1
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= c;
    w.add_edge_bias(s, y);
    c = 1.f;
  }
  // Two copies of the loop, with and without the per-pair test: most tiles need none, and a test
  // inside the loop would cost a branch per pair there too.
  const auto step = [&]<bool MASKED>() {
    static_assert(BN % 16 == 0);
#pragma unroll
    for (int n2 = 0; n2 < BN / 8; n2 += 2) {      // fragments n2, n2 + 1: one dropout group each
      [[maybe_unused]] std::uint32_t keep[2][2];  // [stationary row slot][fragment]: the words
      if constexpr (DROPOUT) {
        const int first = y + n2 * 8 + 2 * tq;  // the thread's first streamed row
        if constexpr (KV)
          drops.keys_by_queries(first, r_lo, head_of(w), keep);
        else
          drops.rows_by_keys(r_lo, first, head_of(w), keep);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int n = n2 + half;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n * 8 + 2 * tq + (e & 1), r = e >> 1;
          const float lse = KV ? terms[col] - b2 : lse_rows[r];
          const float dterm = KV ? terms[BN + col] : row_dterm[r];
          float pv = exp2_approx(fmaf(s[n][e], c, -lse));
          if constexpr (MASKED && !pair_biased<Walk>) {
            const int i = KV ? y + col : r_lo + 8 * r;  // query
            const int j = KV ? r_lo + 8 * r : y + col;  // key
            if (w.hides(i, j, r)) pv = 0.f;
          }
          float m = 1.f;
          if constexpr (DROPOUT) m = drops.factor(keep[r][half], e & 1);
          if constexpr (pair_biased<Walk>) {  // every pair tested; the dq pass writes dS
            const int i = KV ? y + col : r_lo + 8 * r, j = KV ? r_lo + 8 * r : y + col;
            const bool hidden = w.hides(i, j, r);
            pv = hidden ? 0.f : exp2_approx(fmaf(s[n][e], c, w.pair_bias2(i, j, r) - lse));
            if constexpr (!KV)
              if (!hidden) w.store_dpair(i, j, r, pv * (m * t[n][e] - dterm));
          }
          t[n][e] = pv * (m * t[n][e] - dterm);
          s[n][e] = pv * m;
        }
      }
    }
  };
  if (w.masks(y))
    step.template operator()<true>();
  else
    step.template operator()<false>();
  if constexpr (edge_biased<Walk> && !KV) w.store_edge_grads(t, y);
}

/// Walk: void for the block mask's (tile_walk for dq, key_walk for dk/dv), or another walk with
/// their interface (tile.cuh) for both. DROPOUT: the forward's dropout factors m regenerated:
/// dS = P (m dP - dterm) (dterm = <dO, O> of the dropped output), dV += (m P)ᵀ dO.
template <class T, int D, int BM, int BN, bool KV, class Walk = void, bool DROPOUT = false,
          bool BIAS = false>
__global__ void __launch_bounds__(BM / 16 * 32)
    backward_kernel(const __grid_constant__ backward_params p) {
  static_assert(D % 16 == 0 && BM % 16 == 0 && BN % 16 == 0);
  constexpr int kThreads = BM / 16 * 32;
  constexpr int kStage = BN * row_bytes<D>();
  extern __shared__ uint4 shared_raw[];
  const std::uint32_t sx1 = arch::shared_address(shared_raw);
  const std::uint32_t sx2 = sx1 + BM * row_bytes<D>(), sy1 = sx2 + BM * row_bytes<D>(),
                      sy2 = sy1 + 2 * kStage;
  // KV: per stage, the BN queries' lse2 then their dterm.
  const std::uint32_t sterm = sy2 + 2 * kStage;
  const float* terms = reinterpret_cast<const float*>(reinterpret_cast<const char*>(shared_raw) +
                                                      (2 * BM * row_bytes<D>() + 4 * kStage));

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  using walk =
      std::conditional_t<std::is_void_v<Walk>,
                         std::conditional_t<KV, key_walk<BM, BN>, tile_walk<BM, BN>>, Walk>;
  walk w(p);
  const pass_rows<KV> o(p, w);
  const auto load_stage = [&](int stage, int y) {
    load_rows<D, BN, kThreads>(sy1 + stage * kStage, o.y1g + ((o.y0 + y) * o.y1s + w.h * o.y1h) * 2,
                               o.y1s, o.y_len - y);
    load_rows<D, BN, kThreads>(sy2 + stage * kStage, o.y2g + ((o.y0 + y) * o.y2s + w.h * o.y2h) * 2,
                               o.y2s, o.y_len - y);
    if constexpr (KV) {
      for (int x = static_cast<int>(threadIdx.x); x < 2 * BN; x += kThreads) {
        const int r = x % BN;
        const float* src = (x < BN ? p.lse2 : p.dterm) + w.h * p.rows_q + w.q0 + y + r;
        arch::cp_async_4(sterm + static_cast<std::uint32_t>((stage * 2 * BN + x) * 4), src,
                         y + r < w.lq);
      }
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
    __syncthreads();
    const std::uint32_t y1 = sy1 + stage * kStage, y2 = sy2 + stage * kStage;

    // S = X1 Y1ᵀ and T = X2 Y2ᵀ (dP, or dPᵀ) for this warp's 16 rows and the BN streamed rows.
    float s[BN / 8][4], t[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = t[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t a1[4], a2[4];
      const int a_row = warp * 16 + lane % 16, a_chunk = 2 * (kk % 4) + lane / 16;
      arch::ldmatrix_x4(a1, swizzled<BM>(sx1, a_row, kk / 4, a_chunk));
      arch::ldmatrix_x4(a2, swizzled<BM>(sx2, a_row, kk / 4, a_chunk));
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        const int b_row = np * 16 + lane % 8 + 8 * (lane / 16),
                  b_chunk = 2 * (kk % 4) + (lane / 8) % 2;
        std::uint32_t b[4];
        arch::ldmatrix_x4(b, swizzled<BN>(y1, b_row, kk / 4, b_chunk));
        arch::mma_16x8x16_f32<T>(s[2 * np], a1, {b[0], b[1]});
        arch::mma_16x8x16_f32<T>(s[2 * np + 1], a1, {b[2], b[3]});
        arch::ldmatrix_x4(b, swizzled<BN>(y2, b_row, kk / 4, b_chunk));
        arch::mma_16x8x16_f32<T>(t[2 * np], a2, {b[0], b[1]});
        arch::mma_16x8x16_f32<T>(t[2 * np + 1], a2, {b[2], b[3]});
      }
    }

    probabilities_and_ds<BN, KV, DROPOUT, BIAS>(s, t, w, drops, y_cur, r_lo, terms + stage * 2 * BN,
                                                row_lse, row_dterm, c, b2);
    if constexpr (KV) {
      if (p.imp_partial != nullptr) {  // the walk is the block's: uniform
        imp.add(s, t, p.imp_signed);
        if (y_next < 0 || e_next != e_cur) imp.flush(e_cur);
      }
    }

    // dq += dS K; or dk += dSᵀ Q and dv += Pᵀ dO: A from the accumulators, B by ldmatrix.trans.
#pragma unroll
    for (int kp = 0; kp < BN / 16; ++kp) {
      std::uint32_t da[4], pa[4];
      p_fragment<T, BN>(da, t, kp);
      if constexpr (KV) p_fragment<T, BN>(pa, s, kp);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int b_row = kp * 16 + lane % 8 + 8 * ((lane / 8) % 2),
                  b_chunk = 2 * (dp % 4) + lane / 16;
        std::uint32_t b[4];
        arch::ldmatrix_x4_trans(b, swizzled<BN>(y1, b_row, dp / 4, b_chunk));
        arch::mma_16x8x16_f32<T>(acc[0][2 * dp], da, {b[0], b[1]});
        arch::mma_16x8x16_f32<T>(acc[0][2 * dp + 1], da, {b[2], b[3]});
        if constexpr (KV) {
          arch::ldmatrix_x4_trans(b, swizzled<BN>(y2, b_row, dp / 4, b_chunk));
          arch::mma_16x8x16_f32<T>(acc[kAcc - 1][2 * dp], pa, {b[0], b[1]});
          arch::mma_16x8x16_f32<T>(acc[kAcc - 1][2 * dp + 1], pa, {b[2], b[3]});
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    y_cur = y_next;
    e_cur = e_next;
  }

  store_pass<KV, T, D>(p, w, acc, r_lo);
}

}  // namespace trisparse::cuda::block_sparse
