#pragma once
// The fused GAT attention's kernels (plan.hpp; launched by launch.cu).
//
// Lanes and heads: head groups (../common/head_lanes.cuh), F = 4 or 16 floats a lane (C <= 512).
//
// Forward: a warp per (target row, head group). Per entry, the lane's head's score, an online
// softmax (running max and sum, the accumulators rescaled) and keep * x[j] into the
// accumulators: each source row is read once and the [E, H] scores are never stored. The loads of
// 2-4 entries are issued before their updates. The row's log-sum-exp is kept for the backward.
//
// keep_ij: attention dropout's factor, read from keep or drawn per 32-entry batch (drop_bits; the
// kernels with DRAWN, so that those without are unchanged).
//
// Backward, with dp_ij = keep_ij <dout_i, x_j> and D_i = sum_j p_ij dp_ij = <dout_i, out_i>:
//   1. D per (row, head), packed with a_dst and the lse into one 16-byte record per (row, head)
//      that the column pass reads for each entry: row_dot_kernel.
//   2. A warp per (source column, head group) over the transposed pattern: p_ij from the lse,
//      dx_j = sum_i p_ij keep_ij dout_i, de_ij = p_ij (dp_ij - D_i) LeakyReLU'(s_ij),
//      da_src_j = sum_i de_ij in the column's row order, de_ij stored per entry: column_kernel.
//   3. da_dst_i = sum_j de_ij in entry order: row_sum_kernel, a warp a row.
//
// Rows (forward) and columns (backward) of more than kChunk entries are cut into chunks of kChunk,
// each a warp's; their partial results (max, sum and accumulators; dx and da_src) go to the
// workspace and a merge kernel adds them in chunk order. Every sum has a fixed order: the same
// bits on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../common/convert.cuh"
#include "../../common/head_lanes.cuh"
#include "trisparse/core/dropout.hpp"
#include "tuning.hpp"

namespace trisparse::cuda::gat {

using namespace head_lanes;

inline constexpr float kLog2e = 1.4426950408889634f;

// Attention dropout drawn in the kernels (gat_args::dropout): state null without.
struct draws {
  const std::uint64_t* state = nullptr;  // {seed, offset} on the device
  std::uint32_t below = 0;               // a word below it is a drop
  float scale = 1.0f;                    // 1 / (1 - p)
};

// The drops of a batch of n <= 32 entries for the lane's head: bit e set where entry e, of input
// edge u_e = __shfl(mine_u, e), is dropped in the lane's head (philox::edge_word, as
// edge_attention's kernels draw it). One Philox call gives an edge's words for four heads
// (philox::edge_group): the warp's heads lie in `quads` such fours, and quads times n items are
// drawn once each, 32 a round; each round's drops reach the heads' lanes by four ballots, one a
// word: ceil(quads n / 32) calls a lane, not n.
__device__ __forceinline__ std::uint32_t drop_bits(const draws& d, std::uint64_t seed,
                                                   std::uint64_t offset, std::int64_t mine_u, int n,
                                                   const lanes& l, int group) {
  const int lane = static_cast<int>(threadIdx.x & 31), per_warp = 32 / l.per_head;
  const int h0 = group * per_warp, hw = min(per_warp, l.heads - h0);
  const int t0 = h0 >> 2, quads = ((h0 + hw - 1) >> 2) - t0 + 1, items = quads * n;
  const int head = h0 + lane / l.per_head, word = head & 3;
  const int lo = ((head >> 2) - t0) * n;  // this lane's quad's first item
  std::uint64_t mine = 0;
  for (int r = 0; r * 32 < items; ++r) {
    const int it = r * 32 + lane, q = min(it, items - 1) / n, e = min(it, items - 1) % n;
    const std::int64_t u = __shfl_sync(0xffffffffu, mine_u, e);
    bool dropped[4] = {false, false, false, false};
    if (it < items) {
      const philox::words w = philox::edge_group(u, (t0 + q) << 2, seed, offset);
#pragma unroll
      for (int k = 0; k < 4; ++k) dropped[k] = w.x[k] < d.below;
    }
    std::uint32_t bits = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t b = __ballot_sync(0xffffffffu, dropped[k]);
      bits = k == word ? b : bits;
    }
    const int shift = r * 32 - lo;  // item r * 32 + b is this quad's entry b + shift
    if (shift >= 0 && shift < n)
      mine |= std::uint64_t{bits} << shift;
    else if (shift < 0 && shift > -32)
      mine |= bits >> -shift;
  }
  return static_cast<std::uint32_t>(mine);  // (entries past n: not read)
}

// An entry's keep factor in the lane's head: read from keep at row kr (or 1 without keep), or
// the batch's entry e drawn (bits from drop_bits).
__device__ __forceinline__ float read_keep(const operand& keep, std::int64_t kr, int head) {
  return keep.data == nullptr ? 1.0f : *keep.at<float>(kr, head);
}
__device__ __forceinline__ float drawn_keep(const draws& d, std::uint32_t bits, int e) {
  return (bits >> e) & 1u ? 0.0f : d.scale;
}

// What the kernels read of a chunk list.
struct chunks {
  std::int64_t lines = 0, count = 0;
  const std::int32_t* line = nullptr;
  const std::int64_t* first = nullptr;
  const std::int32_t* chunk_line = nullptr;
  const std::int64_t* chunk_begin = nullptr;
};

// The warp's share of a pass over lines (rows or columns): a whole line of at most kChunk
// entries (warps [0, lines * groups)), or one chunk of a longer line (the warps after them).
struct share {
  std::int64_t line, begin, end, chunk;  // chunk -1: the whole line
  int group;
  bool valid;
};

__device__ __forceinline__ share share_of(const std::int64_t* ptr, std::int64_t lines,
                                          const chunks& c, int groups) {
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  share w{};
  if (warp < lines * groups) {
    w.line = warp / groups;
    w.group = static_cast<int>(warp % groups);
    w.begin = ptr[w.line];
    w.end = ptr[w.line + 1];
    w.chunk = -1;
    w.valid = w.end - w.begin <= kChunk;
    return w;
  }
  const std::int64_t k = warp - lines * groups;
  w.chunk = k / groups;
  w.group = static_cast<int>(k % groups);
  w.valid = w.chunk < c.count;
  if (!w.valid) return w;
  w.line = c.chunk_line[w.chunk];
  w.begin = c.chunk_begin[w.chunk];
  w.end = min(w.begin + kChunk, ptr[w.line + 1]);
  return w;
}

struct forward_params {
  const std::int64_t* row_ptr;
  const std::int32_t* col;
  std::int64_t rows;
  chunks cut;
  lanes l;
  operand x, a_src, a_dst, keep;
  const std::int64_t* keep_index;
  out_operand out, lse;
  float* part_acc;  // [chunks, H, C]
  float* part_ml;   // [chunks, H, 2]: running max (log2 units) and sum
  float slope;
  draws drop;  // keyed by keep_index[e] (or e)
};

// The online softmax over entries [begin, end) of row i for the lane's head: m (log2 units), l
// and the unnormalised accumulators. U edges' loads are issued before their updates.
template <class T, int V, int K, int U, bool DRAWN>
__device__ __forceinline__ void attend(const forward_params& p, const place& q, int group,
                                       std::int64_t i, std::int64_t begin, std::int64_t end,
                                       float& m, float& l, float (&acc)[K][V]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const float ad = *p.a_dst.at<float>(i, q.load_head);
  const std::uint64_t seed = DRAWN ? p.drop.state[0] : 0, offset = DRAWN ? p.drop.state[1] : 0;
  for (std::int64_t base = begin; base < end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, end - base));
    const int mine = lane < n ? p.col[base + lane] : 0;
    // Each lane looks up one entry's keep row up front: per edge, one load less in the chain.
    const std::int64_t mine_keep =
        lane < n && p.keep_index != nullptr ? p.keep_index[base + lane] : base + lane;
    std::uint32_t bits = 0;  // DRAWN: the batch's drops, drawn under its first edges' loads
    for (int u = 0; u < n; u += U) {
      float t[U], kp[U], v[U][K][V];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const int e = min(u + b, n - 1);  // past the end: the last edge again, not applied
        const std::int64_t j = __shfl_sync(0xffffffffu, mine, e);
        const float s = ad + *p.a_src.at<float>(j, q.load_head);
        t[b] = (s > 0.0f ? s : s * p.slope) * kLog2e;
        if constexpr (!DRAWN)
          kp[b] = read_keep(p.keep, __shfl_sync(0xffffffffu, mine_keep, e), q.load_head);
        load_row<T, V, K>(p.x.at<T>(j, q.load_head), p.l, q.sub, v[b]);
      }
      if constexpr (DRAWN) {
        if (u == 0) bits = drop_bits(p.drop, seed, offset, mine_keep, n, p.l, group);
#pragma unroll
        for (int b = 0; b < U; ++b) kp[b] = drawn_keep(p.drop, bits, min(u + b, n - 1));
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        if (u + b >= n) break;
        const float mn = fmaxf(m, t[b]);
        const float rescale = exp2f(m - mn), e = exp2f(t[b] - mn);
        l = l * rescale + e;
        const float w = e * kp[b];
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int x = 0; x < V; ++x) acc[k][x] = fmaf(acc[k][x], rescale, w * v[b][k][x]);
        m = mn;
      }
    }
  }
}

template <class O, int V, int K>
__device__ __forceinline__ void finish_row(const forward_params& p, const place& q, std::int64_t i,
                                           float m, float l, float (&acc)[K][V]) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int x = 0; x < V; ++x) acc[k][x] *= inv;
  store_row<O, V, K>(p.out.at<O>(i, q.head), p.l, q.sub, acc);
  if (p.lse.data != nullptr && q.sub == 0)
    *p.lse.at<float>(i, q.head) = l > 0.0f ? (m + log2f(l)) / kLog2e : -INFINITY;
}

template <class T, class O, int V, int F, bool DRAWN>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks<V, F>)
    forward_kernel(const forward_params p) {
  constexpr int K = F / V;
  const share w = share_of(p.row_ptr, p.rows, p.cut, p.l.groups);
  if (!w.valid) return;
  const place q = place_of(p.l, w.group);
  float m = -INFINITY, l = 0.0f, acc[K][V] = {};
  attend<T, V, K, kUnroll<F>, DRAWN>(p, q, w.group, w.line, w.begin, w.end, m, l, acc);
  if (!q.active) return;
  if (w.chunk < 0) {
    finish_row<O, V, K>(p, q, w.line, m, l, acc);
    return;
  }
  const std::int64_t slot = w.chunk * p.l.heads + q.head;
  store_row<float, V, K>(p.part_acc + slot * p.l.width, p.l, q.sub, acc);
  if (q.sub == 0) {
    p.part_ml[2 * slot] = m;
    p.part_ml[2 * slot + 1] = l;
  }
}

// A cut row from its chunks' partial results, in chunk order.
template <class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) forward_merge_kernel(const forward_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.cut.lines * p.l.groups) return;
  const std::int64_t r = warp / p.l.groups;
  const place q = place_of(p.l, static_cast<int>(warp % p.l.groups));
  const std::int64_t first = p.cut.first[r], last = p.cut.first[r + 1];
  float m = -INFINITY;
  for (std::int64_t c = first; c < last; ++c)
    m = fmaxf(m, p.part_ml[2 * (c * p.l.heads + q.load_head)]);
  float l = 0.0f, acc[K][V] = {};
  for (std::int64_t c = first; c < last; ++c) {
    const std::int64_t slot = c * p.l.heads + q.load_head;
    const float f = exp2f(p.part_ml[2 * slot] - m);
    l = fmaf(p.part_ml[2 * slot + 1], f, l);
    float v[K][V];
    load_row<float, V, K>(p.part_acc + slot * p.l.width, p.l, q.sub, v);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int x = 0; x < V; ++x) acc[k][x] = fmaf(f, v[k][x], acc[k][x]);
  }
  if (q.active) finish_row<O, V, K>(p, q, p.cut.line[r], m, l, acc);
}

struct row_dot_params {
  std::int64_t rows;
  lanes l;
  operand dout, out, a_dst, lse;
  float4* rec;  // [rows, H]: (a_dst, lse, D, 0), what the column pass reads of a target row
};

template <class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) row_dot_kernel(const row_dot_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.rows * p.l.groups) return;
  const std::int64_t i = warp / p.l.groups;
  const place q = place_of(p.l, static_cast<int>(warp % p.l.groups));
  float g[K][V], o[K][V];
  load_row<O, V, K>(p.dout.at<O>(i, q.load_head), p.l, q.sub, g);
  load_row<O, V, K>(p.out.at<O>(i, q.load_head), p.l, q.sub, o);
  const float d = head_sum(lane_dot<V, K>(g, o), p.l);
  if (q.active && q.sub == 0)
    p.rec[i * p.l.heads + q.head] =
        make_float4(*p.a_dst.at<float>(i, q.head), *p.lse.at<float>(i, q.head), d, 0.0f);
}

struct column_params {
  const std::int64_t* col_ptr;
  const std::int32_t* row_idx;
  const std::int64_t* entry_of;
  std::int64_t cols;
  chunks cut;
  lanes l;
  operand x, a_src, keep, dout;
  const std::int64_t* keep_index;
  const float4* rec;  // [rows, H]: (a_dst, lse, D, 0)
  out_operand dx, da_src;
  float* de;        // [nnz, H]
  float* part_dx;   // [chunks, H, C]
  float* part_das;  // [chunks, H]
  float slope;
  draws drop;  // the forward's
};

template <class T, class G, int V, int F, bool DRAWN>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks<V, F>)
    column_kernel(const column_params p) {
  constexpr int K = F / V, U = kUnroll<F>;
  const share w = share_of(p.col_ptr, p.cols, p.cut, p.l.groups);
  if (!w.valid) return;
  const place q = place_of(p.l, w.group);
  const int lane = static_cast<int>(threadIdx.x & 31);
  float xj[K][V], dx[K][V] = {};
  load_row<T, V, K>(p.x.at<T>(w.line, q.load_head), p.l, q.sub, xj);
  const float as = *p.a_src.at<float>(w.line, q.load_head);
  float das = 0.0f;
  const std::uint64_t seed = DRAWN ? p.drop.state[0] : 0, offset = DRAWN ? p.drop.state[1] : 0;
  for (std::int64_t base = w.begin; base < w.end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, w.end - base));
    const int mine_row = lane < n ? p.row_idx[base + lane] : 0;
    const std::int64_t mine_entry = lane < n ? p.entry_of[base + lane] : 0;
    const std::int64_t mine_keep =
        lane < n && p.keep_index != nullptr ? p.keep_index[mine_entry] : mine_entry;
    std::uint32_t bits = 0;  // DRAWN: the batch's drops, drawn under its first entries' loads
    for (int u = 0; u < n; u += U) {
      float g[U][K][V], kp[U];
      float4 r[U];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const int e = min(u + b, n - 1);  // past the end: the last edge again, not applied
        const std::int64_t i = __shfl_sync(0xffffffffu, mine_row, e);
        load_row<G, V, K>(p.dout.at<G>(i, q.load_head), p.l, q.sub, g[b]);
        r[b] = p.rec[i * p.l.heads + q.load_head];
        if constexpr (!DRAWN)
          kp[b] = read_keep(p.keep, __shfl_sync(0xffffffffu, mine_keep, e), q.load_head);
      }
      if constexpr (DRAWN) {
        if (u == 0) bits = drop_bits(p.drop, seed, offset, mine_keep, n, p.l, w.group);
#pragma unroll
        for (int b = 0; b < U; ++b) kp[b] = drawn_keep(p.drop, bits, min(u + b, n - 1));
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const float dot = head_sum(lane_dot<V, K>(g[b], xj), p.l);  // every lane: shuffles
        if (u + b >= n) continue;
        const float s = as + r[b].x;
        const float t = s > 0.0f ? s : s * p.slope;
        const float pe = exp2f((t - r[b].y) * kLog2e);
        const float wgt = pe * kp[b];
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int x = 0; x < V; ++x) dx[k][x] = fmaf(wgt, g[b][k][x], dx[k][x]);
        const float de = pe * (kp[b] * dot - r[b].z) * (s > 0.0f ? 1.0f : p.slope);
        das += de;
        const std::int64_t entry = __shfl_sync(0xffffffffu, mine_entry, u + b);
        if (q.active && q.sub == 0) p.de[entry * p.l.heads + q.head] = de;
      }
    }
  }
  if (!q.active) return;
  if (w.chunk < 0) {
    store_row<G, V, K>(p.dx.at<G>(w.line, q.head), p.l, q.sub, dx);
    if (q.sub == 0) *p.da_src.at<float>(w.line, q.head) = das;
    return;
  }
  const std::int64_t slot = w.chunk * p.l.heads + q.head;
  store_row<float, V, K>(p.part_dx + slot * p.l.width, p.l, q.sub, dx);
  if (q.sub == 0) p.part_das[slot] = das;
}

// A cut column's dx and da_src: its chunks' partial sums added in chunk order.
template <class G, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) column_merge_kernel(const column_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.cut.lines * p.l.groups) return;
  const std::int64_t r = warp / p.l.groups;
  const place q = place_of(p.l, static_cast<int>(warp % p.l.groups));
  float dx[K][V] = {}, das = 0.0f;
  for (std::int64_t c = p.cut.first[r]; c < p.cut.first[r + 1]; ++c) {
    const std::int64_t slot = c * p.l.heads + q.load_head;
    float v[K][V];
    load_row<float, V, K>(p.part_dx + slot * p.l.width, p.l, q.sub, v);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int x = 0; x < V; ++x) dx[k][x] += v[k][x];
    das += p.part_das[slot];
  }
  if (!q.active) return;
  const std::int64_t j = p.cut.line[r];
  store_row<G, V, K>(p.dx.at<G>(j, q.head), p.l, q.sub, dx);
  if (q.sub == 0) *p.da_src.at<float>(j, q.head) = das;
}

// da_dst[i, h] = sum of row i's de[e, h] in entry order: a warp a row. Where H divides 32 each
// lane keeps one head's share of the row's contiguous [entries, H] values and the lanes of a
// head are added by a butterfly; else a lane a head walks the row.
__global__ void __launch_bounds__(kWarps * 32)
    row_sum_kernel(const std::int64_t* row_ptr, const float* de, std::int64_t rows, int heads,
                   out_operand da_dst) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= rows) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const std::int64_t begin = row_ptr[i] * heads, end = row_ptr[i + 1] * heads;
  if (32 % heads == 0) {
    float s = 0.0f;
    for (std::int64_t t = begin + lane; t < end; t += 32) s += de[t];
    for (int o = 16; o >= heads; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane < heads) *da_dst.at<float>(i, lane) = s;
    return;
  }
  for (int h = lane; h < heads; h += 32) {
    float s = 0.0f;
    for (std::int64_t t = begin + h; t < end; t += heads) s += de[t];
    *da_dst.at<float>(i, h) = s;
  }
}

}  // namespace trisparse::cuda::gat
