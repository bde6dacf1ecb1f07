#pragma once
// The CUDA-core attention kernels (the f32 forward, the terms, and the backward of inputs the
// tensor cores do not take): a warp per (work chunk, head group), the heads of a row spread over
// the warp in lane groups (../../common/head_lanes.cuh), so that a row of H heads of D channels is
// read in one coalesced sweep whatever D. fp32 accumulation; every sum in a fixed order.
//
//   forward:    out_i = sum_j softmax_j(scale q_i . k_j) v_j by online softmax, and the lse;
//   terms:      D_i = <dout_i, out_i> (and the lse recomputed where not given);
//   row pass:   dq_i = scale sum_j P_ij (dout_i . v_j - D_i) k_j;
//   column pass (over the transpose): dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dout_i;
//   reduce:     a cut line's partial rows added in chunk order.
// P = exp(scale q.k - lse) in base 2: q (or k) is scaled by scale * log2(e) once per warp.
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/head_lanes.cuh"
#include "device.cuh"
#include "tuning.hpp"

namespace trisparse::cuda::attention_backward {

using head_lanes::lanes;
using head_lanes::operand;
using head_lanes::out_operand;
using head_lanes::place;

inline constexpr float kCoreLog2e = 1.4426950408889634f;

// Entries whose loads a warp issues together: U for F floats a lane of a head.
template <int F>
inline constexpr int kCoreUnroll = F <= 4 ? 4 : 2;

// What every CUDA-core kernel reads: its work, the head layout and the operands.
struct core_params {
  const chunk* chunks = nullptr;
  std::int64_t n_chunks = 0;
  const split_row* splits = nullptr;  // the reduce kernels' cut lines
  std::int64_t n_splits = 0;
  const std::int64_t* row_ptr = nullptr;  // the terms' lse recompute
  const std::int32_t* col = nullptr;      // the pass's column indices
  lanes l;
  int wq = 0, wv = 0;  // q's (and k's) width, v's (and out's)
  operand q, k, v, out, dout, lse_in;
  row_terms terms;
  out_operand o1, o2, lse_out;  // forward: out; row pass: dq; column pass: dk, dv
  out_operand rounded;          // terms: dout rounded to q's dtype, where data != nullptr
  float* part1 = nullptr;       // partial rows [slots, H, l.width]
  float* part2 = nullptr;
  float* part_ml = nullptr;  // forward: [slots, H, 2] running max (log2 units) and sum
  float scale = 1.0f, scale_log2 = 1.0f;
  // The score bias, element (e, h) at bias[e * bias_rs + h * bias_hs] (bias_hs = 0: shared by the
  // heads) for entry e of the pattern; nullptr: none. The column pass finds the pattern's entry of
  // its (transposed) entry t at entry[t].
  const float* bias = nullptr;
  std::int64_t bias_rs = 0, bias_hs = 0;
  const std::int64_t* entry = nullptr;
  // The row pass: dL/dS of entry e, head h, at dbias[e * dbias_rs + h * dbias_hs]; nullptr: none.
  float* dbias = nullptr;
  std::int64_t dbias_rs = 0, dbias_hs = 0;
};

// The bias of entry e, head h, in log2 units (0 without a bias).
__device__ __forceinline__ float bias_log2(const core_params& p, std::int64_t e, int h) {
  return p.bias == nullptr ? 0.0f : p.bias[e * p.bias_rs + h * p.bias_hs] * kCoreLog2e;
}

struct core_work {
  chunk w;
  place at;
};

__device__ __forceinline__ bool work_of(const core_params& p, core_work& out) {
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.n_chunks * p.l.groups) return false;
  out.w = p.chunks[warp / p.l.groups];
  out.at = head_lanes::place_of(p.l, static_cast<int>(warp % p.l.groups));
  return true;
}

template <int V, int K>
__device__ __forceinline__ void scale_by(float (&x)[K][V], float f) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int c = 0; c < V; ++c) x[k][c] *= f;
}

// The partial row of (slot, head).
__device__ __forceinline__ float* partial(float* base, const lanes& l, std::int64_t slot, int h) {
  return base + (slot * l.heads + h) * static_cast<std::int64_t>(l.width);
}

template <class O, int V, int K>
__device__ __forceinline__ void finish_forward(const core_params& p, const place& at,
                                               std::int64_t i, float m, float l,
                                               float (&acc)[K][V]) {
  scale_by<V, K>(acc, l > 0.0f ? 1.0f / l : 0.0f);
  head_lanes::store_row<O, V, K>(p.o1.at<O>(i, at.head), p.l, at.sub, p.wv, acc);
  if (p.lse_out.data != nullptr && at.sub == 0)
    *p.lse_out.at<float>(i, at.head) = l > 0.0f ? (m + log2f(l)) / kCoreLog2e : -INFINITY;
}

template <class T, class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) core_forward(const core_params p) {
  constexpr int K = F / V, U = kCoreUnroll<F>;
  core_work cw;
  if (!work_of(p, cw)) return;
  const chunk& w = cw.w;
  const place& at = cw.at;
  const int lane = static_cast<int>(threadIdx.x & 31);
  float qi[K][V], acc[K][V] = {};
  head_lanes::load_row<T, V, K>(p.q.at<T>(w.row, at.load_head), p.l, at.sub, p.wq, qi);
  scale_by<V, K>(qi, p.scale_log2);
  float m = -INFINITY, l = 0.0f;
  for (std::int64_t base = w.begin; base < w.end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, w.end - base));
    const int mine = lane < n ? p.col[base + lane] : 0;
    for (int u = 0; u < n; u += U) {
      float s[U], vx[U][K][V];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const std::int64_t j = __shfl_sync(0xffffffffu, mine, min(u + b, n - 1));
        float kx[K][V];
        head_lanes::load_row<T, V, K>(p.k.at<T>(j, at.load_head), p.l, at.sub, p.wq, kx);
        head_lanes::load_row<T, V, K>(p.v.at<T>(j, at.load_head), p.l, at.sub, p.wv, vx[b]);
        s[b] = head_lanes::lane_dot<V, K>(qi, kx);
      }
      float mn = m;
#pragma unroll
      for (int b = 0; b < U; ++b) {
        s[b] = u + b < n
                   ? head_lanes::head_sum(s[b], p.l) + bias_log2(p, base + u + b, at.load_head)
                   : -INFINITY;
        mn = fmaxf(mn, s[b]);
      }
      const float rescale = exp2f(m - mn);  // mn is finite: entry u is in the row
      l *= rescale;
      scale_by<V, K>(acc, rescale);
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const float e = exp2f(s[b] - mn);  // 0 past the end
        l += e;
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int c = 0; c < V; ++c) acc[k][c] = fmaf(e, vx[b][k][c], acc[k][c]);
      }
      m = mn;
    }
  }
  if (!at.active) return;
  if (w.slot < 0) {
    finish_forward<O, V, K>(p, at, w.row, m, l, acc);
    return;
  }
  head_lanes::store_row<float, V, K>(partial(p.part1, p.l, w.slot, at.head), p.l, at.sub, p.wv,
                                     acc);
  if (at.sub == 0) {
    const std::int64_t slot = w.slot * p.l.heads + at.head;
    p.part_ml[2 * slot] = m;
    p.part_ml[2 * slot + 1] = l;
  }
}

// A cut row of the forward from its chunks' (max, sum, accumulators), in chunk order.
template <class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) core_forward_merge(const core_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.n_splits * p.l.groups) return;
  const split_row sr = p.splits[warp / p.l.groups];
  const place at = head_lanes::place_of(p.l, static_cast<int>(warp % p.l.groups));
  float m = -INFINITY;
  for (int c = 0; c < sr.count; ++c)
    m = fmaxf(m, p.part_ml[2 * ((sr.first + c) * std::int64_t{p.l.heads} + at.load_head)]);
  float l = 0.0f, acc[K][V] = {};
  for (int c = 0; c < sr.count; ++c) {
    const std::int64_t slot = (sr.first + c) * std::int64_t{p.l.heads} + at.load_head;
    const float f = exp2f(p.part_ml[2 * slot] - m);
    l = fmaf(p.part_ml[2 * slot + 1], f, l);
    float x[K][V];
    head_lanes::load_row<float, V, K>(partial(p.part1, p.l, sr.first + c, at.load_head), p.l,
                                      at.sub, p.wv, x);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[k][e] = fmaf(f, x[k][e], acc[k][e]);
  }
  if (at.active) finish_forward<O, V, K>(p, at, sr.row, m, l, acc);
}

// A warp per (row i, head group): D_i = <dout_i, out_i> and the lse (given, or recomputed over the
// row). Where p.rounded.data is set (the tensor-core kernels take dout in T), dout rounded to T is
// stored there and D is taken of the rounded values, so that dP - D cancels as in exact arithmetic.
template <class T, class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) core_terms(const core_params p, std::int64_t rows) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= rows * p.l.groups) return;
  const std::int64_t i = warp / p.l.groups;
  const place at = head_lanes::place_of(p.l, static_cast<int>(warp % p.l.groups));
  float g[K][V], o[K][V];
  head_lanes::load_row<O, V, K>(p.dout.at<O>(i, at.load_head), p.l, at.sub, p.wv, g);
  if (p.rounded.data != nullptr) {
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int c = 0; c < V; ++c) g[k][c] = convert<float>(convert<T>(g[k][c]));
    if (at.active)
      head_lanes::store_row<T, V, K>(p.rounded.at<T>(i, at.head), p.l, at.sub, p.wv, g);
  }
  head_lanes::load_row<O, V, K>(p.out.at<O>(i, at.load_head), p.l, at.sub, p.wv, o);
  const float delta = head_lanes::head_sum(head_lanes::lane_dot<V, K>(g, o), p.l);
  float lse;
  if (p.lse_in.data != nullptr) {
    lse = *p.lse_in.at<float>(i, at.load_head);
  } else {
    float qi[K][V], kx[K][V];
    head_lanes::load_row<T, V, K>(p.q.at<T>(i, at.load_head), p.l, at.sub, p.wq, qi);
    scale_by<V, K>(qi, p.scale_log2);
    float m = -INFINITY, l = 0.0f;
    const std::int64_t begin = p.row_ptr[i], end = p.row_ptr[i + 1];
    for (std::int64_t e = begin; e < end; ++e) {
      head_lanes::load_row<T, V, K>(p.k.at<T>(p.col[e], at.load_head), p.l, at.sub, p.wq, kx);
      const float s = head_lanes::head_sum(head_lanes::lane_dot<V, K>(qi, kx), p.l) +
                      bias_log2(p, e, at.load_head);
      const float mn = fmaxf(m, s);
      l = l * exp2f(m - mn) + exp2f(s - mn);
      m = mn;
    }
    lse = end > begin ? (m + log2f(l)) / kCoreLog2e : -INFINITY;
  }
  if (at.active && at.sub == 0) {
    const std::int64_t r = i * p.l.heads + at.head;
    p.terms.lse[r] = lse;
    p.terms.delta[r] = delta;
  }
}

// A warp per (chunk of row i, head group): dq_i's chunk sum (times scale where the chunk is the
// whole row, else unscaled into the partial row).
template <class T, class O, class G, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) core_row_pass(const core_params p) {
  constexpr int K = F / V, U = kCoreUnroll<F>;
  core_work cw;
  if (!work_of(p, cw)) return;
  const chunk& w = cw.w;
  const place& at = cw.at;
  const int lane = static_cast<int>(threadIdx.x & 31);
  float qi[K][V], gi[K][V], acc[K][V] = {};
  head_lanes::load_row<T, V, K>(p.q.at<T>(w.row, at.load_head), p.l, at.sub, p.wq, qi);
  scale_by<V, K>(qi, p.scale_log2);
  head_lanes::load_row<O, V, K>(p.dout.at<O>(w.row, at.load_head), p.l, at.sub, p.wv, gi);
  const std::int64_t r = std::int64_t{w.row} * p.l.heads + at.load_head;
  const float lse = p.terms.lse[r] * kCoreLog2e, delta = p.terms.delta[r];
  for (std::int64_t base = w.begin; base < w.end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, w.end - base));
    const int mine = lane < n ? p.col[base + lane] : 0;
    for (int u = 0; u < n; u += U) {
      float kx[U][K][V], s[U], dp[U];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const std::int64_t j = __shfl_sync(0xffffffffu, mine, min(u + b, n - 1));
        float vx[K][V];
        head_lanes::load_row<T, V, K>(p.k.at<T>(j, at.load_head), p.l, at.sub, p.wq, kx[b]);
        head_lanes::load_row<T, V, K>(p.v.at<T>(j, at.load_head), p.l, at.sub, p.wv, vx);
        s[b] = head_lanes::lane_dot<V, K>(qi, kx[b]);
        dp[b] = head_lanes::lane_dot<V, K>(gi, vx);
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        s[b] = head_lanes::head_sum(s[b], p.l);
        dp[b] = head_lanes::head_sum(dp[b], p.l);
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        if (u + b >= n) break;
        const std::int64_t e = base + u + b;
        const float ds = exp2f(s[b] + bias_log2(p, e, at.load_head) - lse) * (dp[b] - delta);
        if (p.dbias != nullptr && at.active && at.sub == 0)
          p.dbias[e * p.dbias_rs + at.head * p.dbias_hs] = ds;
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int c = 0; c < V; ++c) acc[k][c] = fmaf(ds, kx[b][k][c], acc[k][c]);
      }
    }
  }
  if (!at.active) return;
  if (w.slot < 0) {
    scale_by<V, K>(acc, p.scale);
    head_lanes::store_row<G, V, K>(p.o1.at<G>(w.row, at.head), p.l, at.sub, p.wq, acc);
  } else {
    head_lanes::store_row<float, V, K>(partial(p.part1, p.l, w.slot, at.head), p.l, at.sub, p.wq,
                                       acc);
  }
}

// A warp per (chunk of key j, head group), over row j of the transpose (the queries i that attend
// j): dk_j (times scale) and dv_j, or their unscaled partial rows.
template <class T, class O, class G, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) core_column_pass(const core_params p) {
  constexpr int K = F / V, U = kCoreUnroll<F>;
  core_work cw;
  if (!work_of(p, cw)) return;
  const chunk& w = cw.w;
  const place& at = cw.at;
  const int lane = static_cast<int>(threadIdx.x & 31);
  float kj[K][V], vj[K][V], dk[K][V] = {}, dv[K][V] = {};
  head_lanes::load_row<T, V, K>(p.k.at<T>(w.row, at.load_head), p.l, at.sub, p.wq, kj);
  scale_by<V, K>(kj, p.scale_log2);
  head_lanes::load_row<T, V, K>(p.v.at<T>(w.row, at.load_head), p.l, at.sub, p.wv, vj);
  for (std::int64_t base = w.begin; base < w.end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, w.end - base));
    const int mine = lane < n ? p.col[base + lane] : 0;
    for (int u = 0; u < n; u += U) {
      float qx[U][K][V], gx[U][K][V], s[U], dp[U], lse[U], delta[U];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const std::int64_t i = __shfl_sync(0xffffffffu, mine, min(u + b, n - 1));
        const std::int64_t r = i * p.l.heads + at.load_head;
        head_lanes::load_row<T, V, K>(p.q.at<T>(i, at.load_head), p.l, at.sub, p.wq, qx[b]);
        head_lanes::load_row<O, V, K>(p.dout.at<O>(i, at.load_head), p.l, at.sub, p.wv, gx[b]);
        lse[b] = p.terms.lse[r] * kCoreLog2e;
        delta[b] = p.terms.delta[r];
        s[b] = head_lanes::lane_dot<V, K>(kj, qx[b]);
        dp[b] = head_lanes::lane_dot<V, K>(vj, gx[b]);
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        s[b] = head_lanes::head_sum(s[b], p.l);
        dp[b] = head_lanes::head_sum(dp[b], p.l);
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        if (u + b >= n) break;
        const float bias =
            p.bias == nullptr ? 0.0f : bias_log2(p, p.entry[base + u + b], at.load_head);
        const float pe = exp2f(s[b] + bias - lse[b]);
        const float ds = pe * (dp[b] - delta[b]);
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int c = 0; c < V; ++c) {
            dk[k][c] = fmaf(ds, qx[b][k][c], dk[k][c]);
            dv[k][c] = fmaf(pe, gx[b][k][c], dv[k][c]);
          }
      }
    }
  }
  if (!at.active) return;
  if (w.slot < 0) {
    scale_by<V, K>(dk, p.scale);
    head_lanes::store_row<G, V, K>(p.o1.at<G>(w.row, at.head), p.l, at.sub, p.wq, dk);
    head_lanes::store_row<G, V, K>(p.o2.at<G>(w.row, at.head), p.l, at.sub, p.wv, dv);
  } else {
    head_lanes::store_row<float, V, K>(partial(p.part1, p.l, w.slot, at.head), p.l, at.sub, p.wq,
                                       dk);
    head_lanes::store_row<float, V, K>(partial(p.part2, p.l, w.slot, at.head), p.l, at.sub, p.wv,
                                       dv);
  }
}

// A warp per (cut line, head group): the line's `width`-wide partial rows in `part` added in chunk
// order, times `factor`, into `out`.
template <class G, int V, int F>
__global__ void __launch_bounds__(kWarps * 32)
    core_reduce(const core_params p, const float* part, out_operand out, int width, float factor) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.n_splits * p.l.groups) return;
  const split_row sr = p.splits[warp / p.l.groups];
  const place at = head_lanes::place_of(p.l, static_cast<int>(warp % p.l.groups));
  float acc[K][V] = {}, x[K][V];
  for (int c = 0; c < sr.count; ++c) {
    head_lanes::load_row<float, V, K>(
        part + ((sr.first + c) * std::int64_t{p.l.heads} + at.load_head) * p.l.width, p.l, at.sub,
        width, x);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[k][e] += x[k][e];
  }
  if (!at.active) return;
  scale_by<V, K>(acc, factor);
  head_lanes::store_row<G, V, K>(out.at<G>(sr.row, at.head), p.l, at.sub, width, acc);
}

}  // namespace trisparse::cuda::attention_backward
