#pragma once
// The tensor-core attention backward over BSB (16-row windows, 16x8 TCBs with bitmaps; included
// by launch.cu, the shared pieces from device.cuh): a pass over the pattern's windows writes dq, a
// pass over the transposed pattern's windows (16 keys, TCBs of 8 queries) writes dk and dv. One
// warp per work chunk (a window's TCB range) and head; a window with more TCBs than a chunk is cut
// into chunks that leave fp32 partial rows, which the last of them to finish adds in chunk order:
// no floating-point atomics, bitwise repeatable.
//
// Per TCB the warp gathers each of the 8 columns' rows once for its 16 rows (the reuse the
// CUDA-core kernel lacks) and does the products on mma.sync: S = Q Kᵀ and dP = dO Vᵀ (m16n8k16,
// the contraction permuted alike in both operands: load_quarter), P = exp(S − lse) under the
// bitmap, dS = P ∘ (dP − D), then dQ += dS K (m16n8k8, A = dS straight from the S accumulators,
// B = K rows col[2t], col[2t+1] shuffled out of the K quarter-rows already in the registers, the
// output columns in the quarter layout: accumulate_quarters). It stores each entry's P and dS
// (16-bit, as the products take them) at the slot of the same pair in the transposed pattern's BSB
// (slots.cuh), so the transposed pass (keys as rows) recomputes nothing: it reads its own TCB's
// words in place and gathers only the Q and dO slices of dV += Pᵀ dO, dK += dSᵀ Q. dout comes in
// the inputs' 16-bit type (the terms pass rounds an f32 one into the workspace).
#include "../../common/arch/mma.cuh"
#include "../../common/fragment_io.cuh"
#include "../../formats/bsb_slots.cuh"
#include "device.cuh"

namespace trisparse::cuda::attention_backward {

// One pass's BSB (col_idx [tcbs * 8], -1 = padding; bitmap [tcbs * 2]: bit r * 8 + c of a TCB =
// row r, slot c) and its work chunks.
struct tc_args {
  const std::int32_t* col_idx;
  const std::uint64_t* bitmap;
  const tc_chunk* chunks;
  std::int64_t n_chunks;
  std::int64_t rows;           // rows of the pass's pattern
  const std::int32_t* row_of;  // [rows]: the row at each window position (null: the identity)
  int heads;
  float scale, scale_log2;
  const std::int32_t* first_slot;  // [tcbs]: the TCB's first slot
  const std::int32_t* target;      // [nnz]: the dk/dv pass's slot of each slot (the dq pass)
  std::uint32_t* pds;              // [heads, nnz]: P and dS (16-bit each) per slot
  std::int64_t nnz;
  std::uint32_t* arrivals;  // [cut windows, heads]: chunks done (zeroed before the pass)
  bool heads_outer;  // tasks head by head (item = head * n_chunks + chunk), not chunk by chunk
};

// A per-entry score bias and its gradient on the dq pass (the column pass reads P and dS as the
// dq pass stored them), in the pattern's entry order: bias[e * bias_rs + h * bias_hs] (natural
// units; bias_hs = 0: shared by the heads), dL/dS at dbias[e * dbias_rs + h * dbias_hs], each
// entry written once (by the chunk holding it); null: none.
struct tc_bias {
  const std::int32_t* entry = nullptr;  // [nnz]: the pattern's entry at each slot of A's BSB
  const float* bias = nullptr;
  std::int64_t bias_rs = 0, bias_hs = 0;
  float* dbias = nullptr;
  std::int64_t dbias_rs = 0, dbias_hs = 0;
};

// The pass's row at window position `at` (window * 16 + row in the window), or -1 past the last.
__device__ __forceinline__ std::int64_t window_row(const tc_args& a, std::int64_t at) {
  if (at >= a.rows) return -1;
  return a.row_of != nullptr ? std::int64_t{a.row_of[at]} : at;
}

// Row `r` of a view at head h, offset by `offset` elements, or nullptr for r < 0.
template <class T>
__device__ __forceinline__ const T* row_or_null(view<const T> x, std::int64_t r, int h,
                                                int offset) {
  return r >= 0 ? x.at(r, h) + offset : nullptr;
}

// acc [16 x 8] per 8 columns (A from the 16x8 block `a`, B the slices b0, b1 of rows 2t, 2t+1).
template <class T, int D>
__device__ __forceinline__ void accumulate(float (&acc)[D / 8][4], const std::uint32_t (&a)[2],
                                           const std::uint32_t (&b0)[D / 16],
                                           const std::uint32_t (&b1)[D / 16]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const std::uint32_t b = j % 2 == 0 ? arch::interleave_lo(b0[j / 2], b1[j / 2])
                                       : arch::interleave_hi(b0[j / 2], b1[j / 2]);
    arch::mma_16x8x8_f32<T>(acc[j], a, b);
  }
}

// acc [16 x 8] per 8 columns (A from the 16x8 block `a`) with B = the rows col[2t], col[2t+1] of
// the TCB taken from its quarter-rows kq, which the lanes hold by row g (row col[g], quarter t):
// B's element (2t, g) of block r is the b16 of row 2t at column 32 i + 8 (g/2) + 2 p + g%2
// (i = r/4, p = r%4), register r of lane (2t, g/2), and row 2t + 1's the same of lane
// (2t + 1, g/2). So block r's output columns 2t, 2t + 1 are columns 32 i + 8 t + 2 p + {0, 1}: the
// quarter layout (store_quarter), no second gather of the rows.
template <class T, int D>
__device__ __forceinline__ void accumulate_quarters(float (&acc)[D / 8][4],
                                                    const std::uint32_t (&a)[2],
                                                    const std::uint32_t (&kq)[D / 8], int g,
                                                    int t) {
  const int from0 = 8 * t + g / 2, from1 = from0 + 4;
  const unsigned halves = g % 2 != 0 ? 0x7632u : 0x5410u;  // both high or both low halves
#pragma unroll
  for (int r = 0; r < D / 8; ++r) {
    const std::uint32_t x0 = __shfl_sync(0xffffffffu, kq[r], from0),
                        x1 = __shfl_sync(0xffffffffu, kq[r], from1);
    const std::uint32_t b = __byte_perm(x0, x1, halves);
    arch::mma_16x8x8_f32<T>(acc[r], a, b);
  }
}

// c = A Bᵀ (16 x 8) over D: A rows (g, g+8) and B row g, quarters t, in two accumulation chains.
template <class T, int D>
__device__ __forceinline__ void product(float (&c)[4], const std::uint32_t (&a0)[D / 8],
                                        const std::uint32_t (&a1)[D / 8],
                                        const std::uint32_t (&b)[D / 8]) {
  float odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int st = 0; st < D / 16; ++st) {
    const std::uint32_t a[4] = {a0[2 * st], a1[2 * st], a0[2 * st + 1], a1[2 * st + 1]};
    const std::uint32_t bb[2] = {b[2 * st], b[2 * st + 1]};
    arch::mma_16x8x16_f32<T>(st % 2 == 0 ? c : odd, a, bb);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] += odd[i];
}

// A chunk's 16 x D accumulators (rows g, g+8) to the gradient rows (times `factor`) or to the
// chunk's partial rows: block j's columns 2t, 2t + 1 in the slice layout (store_slice) or, with
// Quarters, in the quarter layout (accumulate_quarters, store_quarter).
template <class G, int D, bool Quarters = false>
__device__ __forceinline__ void finish_window(const tc_chunk& w, const tc_args& a, int h, int g,
                                              int t, const float (&acc)[D / 8][4], float factor,
                                              view<G> out, partials part) {
  constexpr int kV = D / 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    const float f = w.slot < 0 ? factor : 1.0f;
    const auto put = [&]<class O>(O* dst) {
      if constexpr (Quarters) {
        float x[2 * kV];
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          x[2 * j] = acc[j][2 * half] * f;
          x[2 * j + 1] = acc[j][2 * half + 1] * f;
        }
        store_quarter<O, D>(dst, t, x);
      } else {
        float x0[kV], x1[kV];
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          x0[j] = acc[j][2 * half] * f;
          x1[j] = acc[j][2 * half + 1] * f;
        }
        store_slice<O, D>(dst, 2 * t, x0);
        store_slice<O, D>(dst, 2 * t + 1, x1);
      }
    };
    if (w.slot >= 0) {
      put(part.at(w.slot + static_cast<std::int64_t>(r) * w.stride, h));
    } else {
      const std::int64_t row = window_row(a, std::int64_t{w.window} * 16 + r);
      if (row >= 0) put(out.at(row, h));
    }
  }
}

// Whether the warp's chunk of a cut window is the last of the window's chunks (this head) to have
// stored its partial rows; then they are all visible to it. The window's counter is at its first
// partial row / 16.
__device__ __forceinline__ bool last_to_arrive(const tc_chunk& w, const tc_args& a, int h) {
  __threadfence();  // the lane's partial rows before the count
  __syncwarp();
  unsigned done = 0;
  if ((threadIdx.x & 31) == 0)
    done = atomicAdd(a.arrivals + (w.slot - w.piece) / 16 * std::int64_t{a.heads} + h, 1u);
  done = __shfl_sync(0xffffffffu, done, 0);
  if (done + 1 != static_cast<unsigned>(w.stride)) return false;
  __threadfence();  // the others' partial rows after their counts
  return true;
}

// A cut window's gradient rows (times `factor`): its chunks' partial rows added in chunk order (so
// the same bits whichever chunk comes last), read past L1 (other SMs wrote them).
template <class G, int D>
__device__ __forceinline__ void reduce_window(const tc_chunk& w, const tc_args& a, int h, int lane,
                                              float factor, view<G> out, partials part) {
  constexpr int kRuns = D / 8;             // 8-float runs of a row
  constexpr int kItems = 16 * kRuns / 32;  // the lane's runs of the window's 16 rows
  const std::int64_t first = w.slot - w.piece;
  float acc[kItems][8];
#pragma unroll
  for (int i = 0; i < kItems; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
  for (int c = 0; c < w.stride; ++c) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int f = i * 32 + lane, r = f / kRuns;
      const auto* src = reinterpret_cast<const float4*>(
          part.at(first + std::int64_t{r} * w.stride + c, h) + f % kRuns * 8);
      const float4 x0 = __ldcg(src), x1 = __ldcg(src + 1);
      const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] += x[e];
    }
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int f = i * 32 + lane;
    const std::int64_t row = window_row(a, std::int64_t{w.window} * 16 + f / kRuns);
    if (row < 0) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] *= factor;
    store_run<G, 8>(out.at(row, h) + f % kRuns * 8, acc[i]);
  }
}

constexpr float kLog2e = 1.4426950408889634f;

// Occupancy the register budget is held to: thread blocks of kWarps per SM.
template <int D>
inline constexpr int kTcMinBlocks = D <= 32   ? 4
                                    : D <= 64 ? 3
                                              : 2;
template <int D>
inline constexpr int kTcColumnMinBlocks = D <= 32   ? 5
                                          : D <= 64 ? 3
                                                    : 2;

// P under the bitmap (a product of exactly 0 is still an edge) from S and the base-2 log-sum-exp
// of each accumulator (la: columns 2t of both rows ... as the caller passes them).
__device__ __forceinline__ void probabilities(const tcb_meta& m, int bit, const float (&s)[4],
                                              float scale_log2, const float (&lse)[4],
                                              float (&p)[4]) {
  p[0] = (m.mask0 >> bit) & 1 ? exp2f(s[0] * scale_log2 - lse[0]) : 0.0f;
  p[1] = (m.mask0 >> (bit + 1)) & 1 ? exp2f(s[1] * scale_log2 - lse[1]) : 0.0f;
  p[2] = (m.mask1 >> bit) & 1 ? exp2f(s[2] * scale_log2 - lse[2]) : 0.0f;
  p[3] = (m.mask1 >> (bit + 1)) & 1 ? exp2f(s[3] * scale_log2 - lse[3]) : 0.0f;
}

// The dq pass's B rows of one TCB: K and V quarter-rows of col[g] (dQ's B operand is shuffled out
// of the K quarters: accumulate_quarters).
template <int D>
struct dq_rows {
  std::uint32_t kq[D / 8], vq[D / 8];
  std::int32_t target[4];  // the lane's entries' slots in the transpose (lane_targets)
  std::int32_t entry[4];   // with a bias: the lane's entries in the pattern (-1 where clear)
  float bias[4];           // their bias, base 2 (loaded a stage after `entry`: load_bias)
};

// The dk/dv pass's slots of the lane's entries of a TCB (-1 where clear): where the dq pass
// stores their P and dS.
// With kBias, also the lane's entries in the pattern.
template <bool kBias, int D>
__device__ __forceinline__ void lane_targets(const tc_args& a, const tc_bias& b, const tcb_meta& m,
                                             int bit, std::int32_t first, dq_rows<D>& r) {
  std::int32_t slot[4];
  lane_slots(m, bit, first, slot);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r.target[i] = slot[i] >= 0 ? __ldg(a.target + slot[i]) : -1;
    if constexpr (kBias) r.entry[i] = slot[i] >= 0 ? __ldg(b.entry + slot[i]) : -1;
  }
}

// The bias of the lane's entries (r.entry), base 2; 0 where clear or without a bias.
template <int D>
__device__ __forceinline__ void load_bias(const tc_bias& b, int h, dq_rows<D>& r) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    r.bias[i] = b.bias != nullptr && r.entry[i] >= 0
                    ? __ldg(b.bias + r.entry[i] * b.bias_rs + h * b.bias_hs) * kLog2e
                    : 0.0f;
}

template <class T>
__device__ __forceinline__ void store_pds(const tc_args& a, const std::int32_t (&target)[4], int h,
                                          const float (&p)[4], const float (&ds)[4]) {
  std::uint32_t* const out = a.pds + std::int64_t{h} * a.nnz;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (target[i] >= 0) out[target[i]] = arch::pack2<T>(p[i], ds[i]);
}

// The dk/dv pass's operands of one TCB (queries): the Q and dO slices of col[2t], col[2t+1] and
// the dq pass's P and dS words of the lane's four entries (0 where clear).
template <int D>
struct dkv_rows {
  std::uint32_t q0[D / 16], q1[D / 16], g0[D / 16], g1[D / 16], w[4];
};

template <class T, int D>
__device__ __forceinline__ void load_dkv_rows(const tcb_meta& m, const tc_args& a,
                                              std::int32_t first, view<const T> q,
                                              view<const T> dout, int h, int g, int t,
                                              dkv_rows<D>& r) {
  std::int32_t slot[4];
  lane_slots(m, g * 8 + 2 * t, first, slot);
  const std::uint32_t* const pds = a.pds + std::int64_t{h} * a.nnz;
#pragma unroll
  for (int i = 0; i < 4; ++i) r.w[i] = slot[i] >= 0 ? __ldg(pds + slot[i]) : 0u;
  load_slice<D>(row_or_null(q, m.c0, h, 0), g, r.q0);
  load_slice<D>(row_or_null(q, m.c1, h, 0), g, r.q1);
  load_slice<D>(row_or_null(dout, m.c0, h, 0), g, r.g0);
  load_slice<D>(row_or_null(dout, m.c1, h, 0), g, r.g1);
}

// A TCB's metadata and its first slot.
struct tcb_ahead {
  tcb_meta m;
  std::int32_t first = 0;
};

__device__ __forceinline__ tcb_ahead load_ahead(const tc_args& a, std::int64_t tcb, int g, int t) {
  return {load_tcb_meta(a.col_idx, a.bitmap, tcb, g, t), __ldg(a.first_slot + tcb)};
}

// The pass's TCB loop: metadata and first slots two TCBs ahead, the operands (`load`) one TCB
// ahead, `body` on each TCB's (meta, operands), then `late` on the next TCB's operands (loads
// that depend on what `load` read, in flight across the loop's turn). `start` runs once the first
// TCB's loads are issued (the dq pass's per-row terms, whose loads then overlap them).
template <class Rows, class Load, class Body, class Late, class Start>
__device__ __forceinline__ void tcb_loop(const tc_args& a, const tc_chunk& w, int g, int t,
                                         Load&& load, Body&& body, Late&& late, Start&& start) {
  tcb_ahead next1 = w.begin < w.end ? load_ahead(a, w.begin, g, t) : tcb_ahead{};
  tcb_ahead next2 = w.begin + 1 < w.end ? load_ahead(a, w.begin + 1, g, t) : tcb_ahead{};
  Rows next;
  if (w.begin < w.end) load(next1.m, next1.first, next);
  start();
  if (w.begin < w.end) late(next);
  for (std::int64_t tcb = w.begin; tcb < w.end; ++tcb) {
    const Rows cur = next;
    const tcb_meta m = next1.m;
    next1 = next2;
    if (tcb + 2 < w.end) next2 = load_ahead(a, tcb + 2, g, t);
    if (tcb + 1 < w.end) load(next1.m, next1.first, next);  // in flight during this TCB's products
    body(m, cur);
    if (tcb + 1 < w.end) late(next);
  }
}

// A warp's task: chunk `w` of head `h`, and the pass's rows g and g + 8 of the chunk's window
// (-1 past the last row).
struct window_task {
  tc_chunk w;
  int h;
  std::int64_t row0, row1;
};

// This warp's task (one per warp: item = chunk * heads + head, or head * n_chunks + chunk with
// heads_outer), false past the last.
__device__ __forceinline__ bool warp_task(const tc_args& a, int g, window_task& task) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= a.n_chunks * a.heads) return false;
  const bool outer = a.heads_outer;
  task.w = a.chunks[outer ? item % a.n_chunks : item / a.heads];
  task.h = static_cast<int>(outer ? item / a.n_chunks : item % a.heads);
  const std::int64_t r0 = std::int64_t{task.w.window} * 16 + g;
  task.row0 = window_row(a, r0);
  task.row1 = window_row(a, r0 + 8);
  return true;
}

// The A fragments of x's rows row0 and row1 (the task's) for the k16 products.
template <class T, int D>
__device__ __forceinline__ void load_a_rows(view<const T> x, const window_task& task, int t,
                                            std::uint32_t (&a0)[D / 8],
                                            std::uint32_t (&a1)[D / 8]) {
  load_quarter<D>(row_or_null(x, task.row0, task.h, 0), t, a0);
  load_quarter<D>(row_or_null(x, task.row1, task.h, 0), t, a1);
}

// Σ over the row of a · b, the row's quarters in the lane and its 3 neighbours t (the quad).
template <class T, int D>
__device__ __forceinline__ float quarter_dot(const std::uint32_t (&a)[D / 8],
                                             const std::uint32_t (&b)[D / 8]) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const float2 x = arch::unpack2<T>(a[j]), y = arch::unpack2<T>(b[j]);
    sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  return sum + __shfl_xor_sync(0xffffffffu, sum, 2);
}

// The per-row terms of the task's rows g and g + 8: the log-sum-exp (base 2) and D. From the
// forward's lse and D = <dout, out> (out in T, its quarters) where `out` is given, else from the
// terms pass; 0 past the last row (no entries there).
template <class T, int D>
__device__ __forceinline__ void row_terms_of(const window_task& task, int t, const tc_args& a,
                                             view<const T> out, view<const float> lse,
                                             const row_terms& terms,
                                             const std::uint32_t (&g0)[D / 8],
                                             const std::uint32_t (&g1)[D / 8], float (&l)[2],
                                             float (&d)[2]) {
  const std::int64_t rows[2] = {task.row0, task.row1};
  if (out.data != nullptr) {
    std::uint32_t o0[D / 8], o1[D / 8];
    load_a_rows<T, D>(out, task, t, o0, o1);
    d[0] = quarter_dot<T, D>(g0, o0);
    d[1] = quarter_dot<T, D>(g1, o1);
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = rows[i] >= 0 ? *lse.at(rows[i], task.h) * kLog2e : 0.0f;
    return;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const std::int64_t at = rows[i] * a.heads + task.h;
    l[i] = rows[i] >= 0 ? terms.lse[at] * kLog2e : 0.0f;
    d[i] = rows[i] >= 0 ? terms.delta[at] : 0.0f;
  }
}

// dq over the pattern's windows: one warp per (chunk, head). The per-row terms come from out and
// the forward's lse where `out` is given (no terms pass), else from `terms`. kBias: the scores
// take b's bias, and b's dbias (where set) gets each entry's dS.
template <class T, class G, int D, bool kBias>
__global__ void __launch_bounds__(kWarps * 32, kTcMinBlocks<D>)
    tc_row_pass(tc_args a, view<const T> q, view<const T> k, view<const T> v, view<const T> dout,
                view<const T> out, view<const float> lse_in, row_terms terms, view<G> dq,
                partials part, tc_bias b) {
  const int lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
  window_task task;
  if (!warp_task(a, g, task)) return;
  const tc_chunk& w = task.w;
  const int h = task.h;
  std::uint32_t q0[D / 8], q1[D / 8], g0[D / 8], g1[D / 8];
  load_a_rows<T, D>(q, task, t, q0, q1);
  load_a_rows<T, D>(dout, task, t, g0, g1);
  // The per-row terms (row_terms_of), set once the first TCB's loads are issued, so a short
  // window waits on two chains of loads before its first product, not three. With a bias they
  // come first, as before: moved, that kernel takes 16 more bytes of stack at D = 32.
  float lse[4] = {}, d0 = 0.0f, d1 = 0.0f;
  const auto row_terms_now = [&] {
    float l[2], d[2];
    row_terms_of<T, D>(task, t, a, out, lse_in, terms, g0, g1, l, d);
    lse[0] = lse[1] = l[0];
    lse[2] = lse[3] = l[1];
    d0 = d[0];
    d1 = d[1];
  };
  if constexpr (kBias) row_terms_now();
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int bit = g * 8 + 2 * t;
  tcb_loop<dq_rows<D>>(
      a, w, g, t,
      [&](const tcb_meta& m, std::int32_t first, dq_rows<D>& r) {
        load_quarter<D>(row_or_null(k, m.cb, h, 0), t, r.kq);
        load_quarter<D>(row_or_null(v, m.cb, h, 0), t, r.vq);
        lane_targets<kBias>(a, b, m, bit, first, r);
      },
      [&](const tcb_meta& m, const dq_rows<D>& r) {
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dp[4] = {0.0f, 0.0f, 0.0f, 0.0f}, p[4];
        product<T, D>(s, q0, q1, r.kq);
        product<T, D>(dp, g0, g1, r.vq);
        if constexpr (kBias) {
          // exp2(S scale log2 e + bias log2 e - lse log2 e): the bias taken off the lse.
          const float shifted[4] = {lse[0] - r.bias[0], lse[1] - r.bias[1], lse[2] - r.bias[2],
                                    lse[3] - r.bias[3]};
          probabilities(m, bit, s, a.scale_log2, shifted, p);
        } else {
          probabilities(m, bit, s, a.scale_log2, lse, p);
        }
        const float dsv[4] = {p[0] * (dp[0] - d0), p[1] * (dp[1] - d0), p[2] * (dp[2] - d1),
                              p[3] * (dp[3] - d1)};
        if constexpr (kBias) {
          if (b.dbias != nullptr) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
              if (r.entry[i] >= 0) b.dbias[r.entry[i] * b.dbias_rs + h * b.dbias_hs] = dsv[i];
          }
        }
        store_pds<T>(a, r.target, h, p, dsv);
        const std::uint32_t ds[2] = {arch::pack2<T>(dsv[0], dsv[1]),
                                     arch::pack2<T>(dsv[2], dsv[3])};
        accumulate_quarters<T, D>(acc, ds, r.kq, g, t);
      },
      [&](dq_rows<D>& r) {
        if constexpr (kBias) load_bias(b, h, r);
      },
      [&] {
        if constexpr (!kBias) row_terms_now();
      });
  finish_window<G, D, true>(w, a, h, g, t, acc, a.scale, dq, part);
  if (w.slot >= 0 && last_to_arrive(w, a, h)) reduce_window<G, D>(w, a, h, lane, a.scale, dq, part);
}

// dk, dv over the transposed pattern's windows (16 keys; TCBs of 8 queries), from the dq pass's
// P and dS: one warp per (chunk, head).
template <class T, class G, int D>
__global__ void __launch_bounds__(kWarps * 32, kTcColumnMinBlocks<D>)
    tc_column_pass(tc_args a, view<const T> q, view<const T> dout, view<G> dk, view<G> dv,
                   partials dk_part, partials dv_part) {
  const int lane = threadIdx.x & 31, g = lane / 4, t = lane % 4;
  window_task task;
  if (!warp_task(a, g, task)) return;
  const tc_chunk& w = task.w;
  const int h = task.h;
  float acc_k[D / 8][4], acc_v[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_k[j][i] = acc_v[j][i] = 0.0f;
  }
  tcb_loop<dkv_rows<D>>(
      a, w, g, t,
      [&](const tcb_meta& m, std::int32_t first, dkv_rows<D>& r) {
        load_dkv_rows<T, D>(m, a, first, q, dout, h, g, t, r);
      },
      [&](const tcb_meta&, const dkv_rows<D>& r) {
        // Rows g and g + 8 (keys), columns 2t and 2t + 1 (queries): P in the words' low halves,
        // dS in the high.
        const std::uint32_t pa[2] = {arch::interleave_lo(r.w[0], r.w[1]),
                                     arch::interleave_lo(r.w[2], r.w[3])};
        const std::uint32_t ds[2] = {arch::interleave_hi(r.w[0], r.w[1]),
                                     arch::interleave_hi(r.w[2], r.w[3])};
        accumulate<T, D>(acc_v, pa, r.g0, r.g1);
        accumulate<T, D>(acc_k, ds, r.q0, r.q1);
      },
      [](dkv_rows<D>&) {}, [] {});
  finish_window<G, D>(w, a, h, g, t, acc_k, a.scale, dk, dk_part);
  finish_window<G, D>(w, a, h, g, t, acc_v, 1.0f, dv, dv_part);
  if (w.slot >= 0 && last_to_arrive(w, a, h)) {
    reduce_window<G, D>(w, a, h, lane, a.scale, dk, dk_part);
    reduce_window<G, D>(w, a, h, lane, 1.0f, dv, dv_part);
  }
}

}  // namespace trisparse::cuda::attention_backward
