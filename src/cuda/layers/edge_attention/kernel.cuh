#pragma once
// TransformerConv's and GAT's attention over a multigraph: the kernels (plan.hpp; launched by
// launch.cu).
//
// Lanes: a warp takes a line (target, or source in the backward's column pass); its 32 lanes form
// 32 / L groups of L lanes, each lane NC channels of a head and NF features (C = L NC, F = L NF).
// The groups take `warp_heads` heads side by side and, per head, `edge_groups` edges at a time.
// Heavy lines (listed in the multigraph view) get a thread block per head instead, the groups of
// its kWarps warps side by side over the edges (a hub's serial chain of dependent loads is
// kWarps * 32 / L times shorter). A group's partial dots are summed over its lanes by xor
// shuffles; at the end a head's edge groups merge by an xor butterfly, whose combine is symmetric,
// so every lane holds the same bits and the order is fixed; a heavy line's warps then merge
// through shared memory in warp order (heavy_merge).
//
// Forward: per edge p = (i <- j) the score s = scale q_i.k_j + r_i.a_p (GAT: LeakyReLU(a_dst_i +
// a_src_j + a_edge_p); log2 units), an online softmax, and v_j and a_p into the accumulators
// with the edge's keep factor m_p (attention dropout; 1 without) on its weight, the normaliser
// without it; out, out_edge and the lse per (row, head).
// Backward, with dp = m_p (dout_i.v_j + dout_edge_i.a_p) and D_i = dout_i.out_i +
// dout_edge_i.out_edge_i (= sum_p P dp, as out holds the kept weights):
//   1. per target and head: P = exp(s - lse), dS = P (dp - D); dq_i = scale sum dS k_j,
//      dr_i = sum dS a_p; m_p P and dS per (edge, head) into the workspace (bf16 where the
//      gradients are 16-bit: ws_16): row_kernel.
//   2. per source and head, over by_source: dk_j = scale sum dS q_i, dv_j = sum m P dout_i:
//      column_kernel.
//   3. a thread per (edge, feature): da_p = sum_h dS r_i + m P dout_edge_i: feature_kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../common/convert.cuh"
#include "trisparse/core/dropout.hpp"
#include "trisparse/ops/layer_args.hpp"
#include "tuning.hpp"

namespace trisparse::cuda::edge_attention_kernels {

using edge_attention_tuning::kWarps;
inline constexpr float kLog2e = 1.4426950408889634f;

// A [rows, H, width] operand: element (r, h, c) at data[r * rs + h * hs + c].
struct mat {
  const void* data = nullptr;
  std::int64_t rs = 0, hs = 0;
  template <class T>
  __device__ __forceinline__ const T* at(std::int64_t r, int h) const {
    return static_cast<const T*>(data) + r * rs + h * hs;
  }
};
struct out_mat {
  void* data = nullptr;
  std::int64_t rs = 0, hs = 0;
  template <class T>
  __device__ __forceinline__ T* at(std::int64_t r, int h) const {
    return static_cast<T*>(data) + r * rs + h * hs;
  }
};
// A lane's columns of one head of an operand, its head and lane offsets added once a line: row
// r's at base + r * rs (TransformerConv's row passes; two registers more than whole addresses).
template <class T>
struct lane_cols {
  const T* base;
  std::int64_t rs;
  __device__ __forceinline__ lane_cols(const mat& m, int h, int offset)
      : base(m.at<T>(0, h) + offset), rs(m.rs) {}
  __device__ __forceinline__ const T* row(std::int64_t r) const { return base + r * rs; }
};

struct params {
  multigraph_view g;
  // lanes: L, a group's; a warp's groups take `warp_heads` heads side by side (a power of two)
  // and, per head, `edge_groups` edges at a time (their product is 32 / L); a line (row or
  // column) takes `line_warps` warps.
  int heads = 1, lanes = 1, warp_heads = 1, edge_groups = 1, line_warps = 1;
  float scale = 1.0f;
  mat q, k, v, r, a, out_in, out_edge_in, lse_in, dout, dout_edge;
  mat keep;  // [edges, H, 1] f32 by input edge id, or none
  // Or attention dropout drawn here (dropout_state: {seed, offset} on the device, or null).
  const std::uint64_t* dropout_state = nullptr;
  std::uint32_t drop_below = 0;
  float dropout_scale = 1.0f;
  out_mat out, out_edge, lse, dq, dk, dv, dr, da;
  // The backward's workspace, [edges, H] each, f32 or (ws_16) bf16: ws_load / ws_store.
  void* prob = nullptr;    // m P
  void* dscore = nullptr;  // dL/ds (GAT: dL/dz, before the LeakyReLU)
  bool ws_16 = false;      // bf16 (16-bit runs whose gradients are 16-bit), else f32
  // GAT: z = a_dst_i + a_src_j + a_edge_p, s = LeakyReLU(z); v holds x.
  mat a_src, a_dst, a_edge;
  out_mat da_src, da_dst, da_edge;
  float slope = 0.2f;
  bool grads_in_t = false;  // dq, dk, dv, dr and da (GAT: dx) in the operands' dtype T, else f32
  bool edge_in_t = false;   // out_edge (the backward's out_edge and dout_edge) in T, else f32
};

// Element x of the workspace array w (p.prob or p.dscore), read or written as f32; bf16 storage
// where p.ws_16 (never for T = float or GAT, G: their kernels keep their code).
template <class T, bool G = false>
__device__ __forceinline__ float ws_load(const params& p, const void* w, std::int64_t x) {
  if constexpr (sizeof(T) == 2 && !G) {
    if (p.ws_16) return __bfloat162float(static_cast<const __nv_bfloat16*>(w)[x]);
  }
  return static_cast<const float*>(w)[x];
}
template <class T, bool G = false>
__device__ __forceinline__ void ws_store(const params& p, void* w, std::int64_t x, float value) {
  if constexpr (sizeof(T) == 2 && !G) {
    if (p.ws_16) {
      static_cast<__nv_bfloat16*>(w)[x] = __float2bfloat16_rn(value);
      return;
    }
  }
  static_cast<float*>(w)[x] = value;
}

// The input edge at position e (the multigraph's `edge`; null: the positions are the input's).
__device__ __forceinline__ std::int64_t input_edge(const params& p, std::int64_t e) {
  return p.g.edge != nullptr ? p.g.edge[e] : e;
}
// GAT's pre-activation score of edge e (target i, source j, head h) and its score in log2 units.
__device__ __forceinline__ float gat_z(const params& p, std::int64_t i, std::int32_t j,
                                       std::int64_t e, int h) {
  float z = *p.a_dst.at<float>(i, h) + *p.a_src.at<float>(j, h);
  if (p.a_edge.data != nullptr) z += *p.a_edge.at<float>(input_edge(p, e), h);
  return z;
}
// Attention dropout's word for edge e and head h: input edge u = edge[e]'s (philox::edge_word),
// the same in the forward and the backward.
__device__ __forceinline__ std::uint32_t dropout_word(const params& p, std::int64_t e, int h) {
  return philox::edge_word(input_edge(p, e), h, p.dropout_state[0], p.dropout_state[1]);
}
__device__ __forceinline__ float keep_of(const params& p, std::uint32_t word) {
  return word < p.drop_below ? 0.0f : p.dropout_scale;
}
__device__ __forceinline__ float leaky_log2(float z, float slope) {
  return (z > 0.0f ? z : z * slope) * kLog2e;
}

// N elements of T from p (aligned to N * sizeof(T) where that is 4, 8 or 16 bytes) as floats.
template <class T, int N>
__device__ __forceinline__ void load(const T* p, float (&x)[N], float f = 1.0f) {
  constexpr int bytes = N * static_cast<int>(sizeof(T));
  T t[N];
  if constexpr (bytes == 16) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    memcpy(t, &w, bytes);
  } else if constexpr (bytes == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    memcpy(t, &w, bytes);
  } else if constexpr (bytes == 4) {
    const unsigned w = *reinterpret_cast<const unsigned*>(p);
    memcpy(t, &w, bytes);
  } else {
#pragma unroll
    for (int n = 0; n < N; ++n) t[n] = p[n];
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0 && bytes >= 4) {
    // A pair's halves as floats by a shift and a mask (a bf16 is a float's upper half).
    unsigned w[N / 2];
    memcpy(w, t, bytes);
#pragma unroll
    for (int n = 0; n < N / 2; ++n) {
      x[2 * n] = __uint_as_float(w[n] << 16) * f;
      x[2 * n + 1] = __uint_as_float(w[n] & 0xffff0000u) * f;
    }
  } else {
#pragma unroll
    for (int n = 0; n < N; ++n) x[n] = convert<float>(t[n]) * f;
  }
}

template <class T, int N>
__device__ __forceinline__ void store(T* p, const float (&x)[N], float f) {
#pragma unroll
  for (int n = 0; n < N; ++n) p[n] = convert<T>(x[n] * f);
}

// N elements at (r, h) + offset of a matrix held in T (in_t) or f32.
template <class T, int N>
__device__ __forceinline__ void load_either(bool in_t, const mat& m, std::int64_t r, int h,
                                            int offset, float (&x)[N]) {
  if (in_t) {
    load<T, N>(m.at<T>(r, h) + offset, x);
  } else {
    load<float, N>(m.at<float>(r, h) + offset, x);
  }
}
template <class T, int N>
__device__ __forceinline__ void store_either(bool in_t, const out_mat& m, std::int64_t r, int h,
                                             int offset, const float (&x)[N], float f) {
  if (in_t) {
    store<T, N>(m.at<T>(r, h) + offset, x, f);
  } else {
    store<float, N>(m.at<float>(r, h) + offset, x, f);
  }
}
// A gradient's elements at (r, h) + offset, f32 or (grads_in_t) T.
template <class T, int N>
__device__ __forceinline__ void store_grad(const params& p, const out_mat& m, std::int64_t r, int h,
                                           int offset, const float (&x)[N], float f) {
  store_either<T, N>(p.grads_in_t, m, r, h, offset, x, f);
}

// 2^x (ex2.approx with subnormal results flushed to zero: weights far below any sum's rounding).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int N>
__device__ __forceinline__ float dot(const float (&x)[N], const float (&y)[N]) {
  float s = 0.0f;
#pragma unroll
  for (int n = 0; n < N; ++n) s = fmaf(x[n], y[n], s);
  return s;
}

// The sum over a group's lanes (xor offsets below L): LT > 0, L fixed by the dispatch (unrolled
// shuffles); else the runtime `lanes`.
template <int LT>
__device__ __forceinline__ float group_sum(float x, int lanes) {
  if constexpr (LT > 0) {
#pragma unroll
    for (int off = 1; off < LT; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  } else {
    for (int off = 1; off < lanes; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  }
  return x;
}

template <int N>
__device__ __forceinline__ void butterfly_sum(float (&x)[N], int from) {
  for (int off = from; off < 32; off <<= 1)
#pragma unroll
    for (int n = 0; n < N; ++n) x[n] += __shfl_xor_sync(0xffffffffu, x[n], off);
}

// A lane's place: the warp's line (row or column), the lane's head (valid: < H), its group's
// edge slot among the head's `groups`, its slot in the group, and the xor offset from which the
// edge groups merge.
struct place {
  std::int64_t line;
  int head, group, groups, slot, merge;
  bool valid;
};

// Light lines: a warp a line (its heads side by side), heavy lines left to the heavy launch;
// heavy: a thread block per (listed line, head), the groups of its warps side by side over the
// edges (group g of warp w is edge slot w * 32 / L + g: warp 0's first group is group 0).
__device__ __forceinline__ bool place_of(const params& p, bool heavy, std::int64_t lines,
                                         const std::int64_t* ptr, const std::int32_t* list,
                                         std::int64_t listed, place& at) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (heavy) {
    const std::int64_t unit = blockIdx.x;  // the launch has listed * heads blocks
    if (unit >= listed * p.heads) return false;
    const int per_warp = 32 / p.lanes;
    at = {list[unit / p.heads],
          static_cast<int>(unit % p.heads),
          static_cast<int>(threadIdx.x / 32) * per_warp + lane / p.lanes,
          kWarps * per_warp,
          lane % p.lanes,
          p.lanes,
          true};
    return true;
  }
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= lines * p.line_warps) return false;
  const std::int64_t line = warp / p.line_warps;
  if (p.g.heavy > 0 && ptr[line + 1] - ptr[line] > p.g.heavy) return false;
  const int group = lane / p.lanes;
  const int head = static_cast<int>(warp % p.line_warps) * p.warp_heads + group % p.warp_heads;
  at = {line,           head < p.heads ? head : 0, group / p.warp_heads, p.edge_groups,
        lane % p.lanes, p.lanes * p.warp_heads,    head < p.heads};
  return true;
}

// A heavy line's thread block stages its warps' states (each warp's merged state in its lanes
// [0, L)) in dynamic shared memory (kHeavyStageBytes: at most kStageFloats a lane), and warp 0's
// lanes [0, L) combine them in warp order. Every thread of the block calls the merges.
inline constexpr int kStageFloats = 18;  // NC + NF + 2 for NC, NF <= 8
inline constexpr std::size_t kHeavyStageBytes = kWarps * 32 * kStageFloats * sizeof(float);
__device__ __forceinline__ float* heavy_stage(int warp, int lane, int floats) {
  extern __shared__ float edge_stage[];
  return edge_stage + (warp * 32 + lane) * floats;
}

// x and y summed over the warps (a sum: dq and dr, dk and dv).
template <int A, int B>
__device__ __forceinline__ void heavy_sum(const params& p, float (&x)[A], float (&y)[B]) {
  static_assert(A + B <= kStageFloats);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x & 31);
  if (warp != 0 && lane < p.lanes) {
    float* s = heavy_stage(warp, lane, A + B);
#pragma unroll
    for (int n = 0; n < A; ++n) s[n] = x[n];
#pragma unroll
    for (int n = 0; n < B; ++n) s[A + n] = y[n];
  }
  __syncthreads();
  if (warp != 0 || lane >= p.lanes) return;
  for (int w = 1; w < kWarps; ++w) {
    const float* s = heavy_stage(w, lane, A + B);
#pragma unroll
    for (int n = 0; n < A; ++n) x[n] += s[n];
#pragma unroll
    for (int n = 0; n < B; ++n) y[n] += s[A + n];
  }
}

// The forward's online-softmax states (m, l, acc, acc_a) combined over the warps.
template <int NC, int MF>
__device__ __forceinline__ void heavy_softmax(const params& p, float& m, float& l, float (&acc)[NC],
                                              float (&acc_a)[MF]) {
  constexpr int N = NC + MF + 2;
  static_assert(N <= kStageFloats);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x & 31);
  if (warp != 0 && lane < p.lanes) {
    float* s = heavy_stage(warp, lane, N);
    s[0] = m;
    s[1] = l;
#pragma unroll
    for (int n = 0; n < NC; ++n) s[2 + n] = acc[n];
#pragma unroll
    for (int n = 0; n < MF; ++n) s[2 + NC + n] = acc_a[n];
  }
  __syncthreads();
  if (warp != 0 || lane >= p.lanes) return;
  for (int w = 1; w < kWarps; ++w) {
    const float* s = heavy_stage(w, lane, N);
    const float mn = fmaxf(m, s[0]);
    const float c1 = m == -INFINITY ? 0.0f : exp2f(m - mn);
    const float c2 = s[0] == -INFINITY ? 0.0f : exp2f(s[0] - mn);
    l = l * c1 + s[1] * c2;
#pragma unroll
    for (int n = 0; n < NC; ++n) acc[n] = acc[n] * c1 + s[2 + n] * c2;
#pragma unroll
    for (int n = 0; n < MF; ++n) acc_a[n] = acc_a[n] * c1 + s[2 + NC + n] * c2;
    m = mn;
  }
}

__device__ __forceinline__ bool row_place(const params& p, bool heavy, place& at) {
  return place_of(p, heavy, p.g.rows, p.g.row_ptr, p.g.heavy_rows, p.g.heavy_row_count, at);
}

__device__ __forceinline__ bool column_place(const params& p, bool heavy, place& at) {
  return place_of(p, heavy, p.g.cols, p.g.col_ptr, p.g.heavy_cols, p.g.heavy_col_count, at);
}

// An edge's keep factor for the lane's head along a line's loop (1 without dropout): given per
// input edge, or drawn (dropout_word). A group's lanes share the draws: every L-th step lane s of
// a group draws the word of the group's edge s steps ahead, and each step the group reads its
// word from the lane of that step, so a line costs one Philox call per edge and head, not L.
// Called by every lane at every step (it shuffles). DRAWN: the instantiation for draws (where
// p.dropout_state is set); those without them (!DRAWN) leave the draws' code out.
struct line_keeps {
  std::uint32_t mine = 0;
  int step = 0;
  template <bool DRAWN>
  __device__ __forceinline__ float next(const params& p, const place& at, std::int64_t base,
                                        std::int64_t end) {
    const std::int64_t e = base + at.group;
    if (!DRAWN || p.dropout_state == nullptr) {
      if (p.keep.data == nullptr || !at.valid || e >= end) return 1.0f;
      return *p.keep.at<float>(input_edge(p, e), at.head);
    }
    const int phase = step++ & (p.lanes - 1);
    if (phase == 0) {
      const std::int64_t ahead = e + static_cast<std::int64_t>(at.slot) * at.groups;
      mine = at.valid && ahead < end ? dropout_word(p, ahead, at.head) : 0u;
    }
    const int lane = static_cast<int>(threadIdx.x & 31);
    return keep_of(p, __shfl_sync(0xffffffffu, mine, (lane & ~(p.lanes - 1)) | phase));
  }
};

// NF = 0: no edge features (arrays of one unused element).
template <int NF>
inline constexpr int kSlots = NF > 0 ? NF : 1;

// G: GAT's scores (q, k, r, a unused). LT: the group's lanes where the dispatch fixed them (0:
// p.lanes). DRAWN: attention dropout drawn here (line_keeps).
template <class T, int NC, int NF, bool G, int LT, bool DRAWN>
__global__ void __launch_bounds__(kWarps * 32, edge_attention_tuning::forward_blocks(NC, NF, G))
    forward_kernel(const params p, bool heavy) {
  constexpr int MF = kSlots<NF>;
  place at;
  if (!row_place(p, heavy, at)) return;
  const std::int64_t i = at.line;
  const int h = at.head;
  float qi[NC] = {}, ri[MF] = {}, acc[NC] = {}, acc_a[MF] = {};
  if constexpr (!G) load<T, NC>(p.q.at<T>(i, h) + at.slot * NC, qi, p.scale * kLog2e);
  if constexpr (NF > 0) load<T, NF>(p.r.at<T>(i, h) + at.slot * NF, ri, kLog2e);
  const lane_cols<T> k(p.k, h, at.slot * NC), v(p.v, h, at.slot * NC), a(p.a, 0, at.slot * NF);
  const bool keyed = (DRAWN && p.dropout_state != nullptr) || p.keep.data != nullptr;
  float m = -INFINITY, l = 0.0f;
  line_keeps keeps;
  const std::int64_t begin = p.g.row_ptr[i], end = p.g.row_ptr[i + 1];
  for (std::int64_t base = begin; base < end; base += at.groups) {
    const std::int64_t e = base + at.group;
    const bool on = at.valid && e < end;
    const float keep = keyed ? keeps.template next<DRAWN>(p, at, base, end) : 1.0f;
    float kj[NC] = {}, vj[NC] = {}, ae[MF] = {}, s = 0.0f;
    if (on) {
      const std::int32_t j = p.g.src[e];
      if constexpr (G) s = leaky_log2(gat_z(p, i, j, e, h), p.slope);
      if constexpr (!G) load<T, NC>(k.row(j), kj);
      load<T, NC>(G ? p.v.at<T>(j, h) + at.slot * NC : v.row(j), vj);
      if constexpr (NF > 0) load<T, NF>(a.row(input_edge(p, e)), ae);
    }
    if constexpr (!G) {
      s = dot(qi, kj);
      if constexpr (NF > 0) s += dot(ri, ae);
      s = group_sum<LT>(s, p.lanes);
    }
    if (on) {
      const float mn = fmaxf(m, s);
      const float c = m == -INFINITY ? 0.0f : exp2_ftz(m - mn);
      const float w = exp2_ftz(s - mn);
      l = fmaf(l, c, w);
      const float wk = w * keep;
#pragma unroll
      for (int n = 0; n < NC; ++n) acc[n] = fmaf(acc[n], c, wk * vj[n]);
#pragma unroll
      for (int n = 0; n < NF; ++n) acc_a[n] = fmaf(acc_a[n], c, wk * ae[n]);
      m = mn;
    }
  }
  // Merge the groups: (m, l, acc) combined symmetrically.
  for (int off = at.merge; off < 32; off <<= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, off);
    const float mn = fmaxf(m, m2);
    const float c1 = m == -INFINITY ? 0.0f : exp2f(m - mn);
    const float c2 = m2 == -INFINITY ? 0.0f : exp2f(m2 - mn);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int n = 0; n < NC; ++n)
      acc[n] = acc[n] * c1 + __shfl_xor_sync(0xffffffffu, acc[n], off) * c2;
#pragma unroll
    for (int n = 0; n < NF; ++n)
      acc_a[n] = acc_a[n] * c1 + __shfl_xor_sync(0xffffffffu, acc_a[n], off) * c2;
    m = mn;
  }
  if (heavy) heavy_softmax(p, m, l, acc, acc_a);
  if (at.group != 0 || !at.valid) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  store<T, NC>(p.out.at<T>(i, h) + at.slot * NC, acc, inv);
  if constexpr (NF > 0)
    store_either<T, NF>(p.edge_in_t, p.out_edge, i, h, at.slot * NF, acc_a, inv);
  if (at.slot == 0) *p.lse.at<float>(i, h) = l > 0.0f ? (m + log2f(l)) / kLog2e : -INFINITY;
}

template <class T, int NC, int NF, bool G, int LT, bool DRAWN>
__global__ void __launch_bounds__(kWarps * 32, edge_attention_tuning::row_blocks(NC, NF))
    row_kernel(const params p, bool heavy) {
  constexpr int MF = kSlots<NF>;
  place at;
  if (!row_place(p, heavy, at)) return;
  const std::int64_t i = at.line;
  const int h = at.head;
  float qi[NC] = {}, doi[NC], oi[NC], ri[MF] = {}, doa[MF] = {}, oa[MF] = {};
  if constexpr (!G) load<T, NC>(p.q.at<T>(i, h) + at.slot * NC, qi, p.scale * kLog2e);
  load<T, NC>(p.dout.at<T>(i, h) + at.slot * NC, doi);
  load<T, NC>(p.out_in.at<T>(i, h) + at.slot * NC, oi);
  if constexpr (NF > 0) {
    load<T, NF>(p.r.at<T>(i, h) + at.slot * NF, ri, kLog2e);
    load_either<T, NF>(p.edge_in_t, p.dout_edge, i, h, at.slot * NF, doa);
    load_either<T, NF>(p.edge_in_t, p.out_edge_in, i, h, at.slot * NF, oa);
  }
  const float D = group_sum<LT>(dot(doi, oi) + dot(doa, oa), p.lanes);
  const float lse2 = *p.lse_in.at<float>(i, h) * kLog2e;
  const lane_cols<T> k(p.k, h, at.slot * NC), v(p.v, h, at.slot * NC), a(p.a, 0, at.slot * NF);
  const bool keyed = (DRAWN && p.dropout_state != nullptr) || p.keep.data != nullptr;
  float dq[NC] = {}, dr[MF] = {}, dz_sum[1] = {};
  line_keeps keeps;
  const std::int64_t begin = p.g.row_ptr[i], end = p.g.row_ptr[i + 1];
  for (std::int64_t base = begin; base < end; base += at.groups) {
    const std::int64_t e = base + at.group;
    const bool on = at.valid && e < end;
    const float keep = keyed ? keeps.template next<DRAWN>(p, at, base, end) : 1.0f;
    float kj[NC] = {}, vj[NC] = {}, ae[MF] = {}, z = 0.0f;
    if (on) {
      const std::int32_t j = p.g.src[e];
      if constexpr (G) z = gat_z(p, i, j, e, h);
      if constexpr (!G) load<T, NC>(k.row(j), kj);
      load<T, NC>(G ? p.v.at<T>(j, h) + at.slot * NC : v.row(j), vj);
      if constexpr (NF > 0) load<T, NF>(a.row(input_edge(p, e)), ae);
    }
    float s = G ? leaky_log2(z, p.slope) : dot(qi, kj) + dot(ri, ae);
    float dp = dot(doi, vj) + dot(doa, ae);
    if constexpr (!G) s = group_sum<LT>(s, p.lanes);
    dp = group_sum<LT>(dp, p.lanes);
    if (on) {
      const float prob = exp2_ftz(s - lse2);
      float ds = prob * (dp * keep - D);
      if constexpr (G) {
        ds *= z > 0.0f ? 1.0f : p.slope;  // dL/dz
        dz_sum[0] += ds;
        if (at.slot == 0 && p.da_edge.data != nullptr)
          *p.da_edge.at<float>(input_edge(p, e), h) = ds;
      }
      if (at.slot == 0) {
        ws_store<T, G>(p, p.prob, e * p.heads + h, prob * keep);
        ws_store<T, G>(p, p.dscore, e * p.heads + h, ds);
      }
#pragma unroll
      for (int n = 0; n < NC; ++n) dq[n] = fmaf(ds, kj[n], dq[n]);
#pragma unroll
      for (int n = 0; n < NF; ++n) dr[n] = fmaf(ds, ae[n], dr[n]);
    }
  }
  if constexpr (G) {
    butterfly_sum(dz_sum, at.merge);
    if (heavy) heavy_sum(p, dz_sum, dq);  // (dq: zeros, unused by GAT)
    if (at.group == 0 && at.valid && at.slot == 0) *p.da_dst.at<float>(i, h) = dz_sum[0];
    return;
  }
  butterfly_sum(dq, at.merge);
  if constexpr (NF > 0) butterfly_sum(dr, at.merge);
  if (heavy) heavy_sum(p, dq, dr);
  if (at.group != 0 || !at.valid) return;
  store_grad<T>(p, p.dq, i, h, at.slot * NC, dq, p.scale);
  if constexpr (NF > 0) store_grad<T>(p, p.dr, i, h, at.slot * NF, dr, 1.0f);
}

template <class T, int NC, bool G>
__global__ void __launch_bounds__(kWarps * 32) column_kernel(const params p, bool heavy) {
  place at;
  if (!column_place(p, heavy, at)) return;
  const std::int64_t j = at.line;
  const int h = at.head;
  float dk[NC] = {}, dv[NC] = {};
  const std::int64_t begin = p.g.col_ptr[j], end = p.g.col_ptr[j + 1];
  for (std::int64_t base = begin; base < end; base += at.groups) {
    const std::int64_t t = base + at.group;
    if (!at.valid || t >= end) break;  // no shuffles in this loop: groups may leave early
    const std::int64_t e = p.g.by_source[t];
    const std::int32_t i = p.g.dst[e];
    const float ds = ws_load<T, G>(p, p.dscore, e * p.heads + h);
    const float prob = ws_load<T, G>(p, p.prob, e * p.heads + h);
    float qi[NC] = {}, doi[NC];
    if constexpr (G) qi[0] = at.slot == 0 ? 1.0f : 0.0f;  // dk[0] sums dz: da_src
    if constexpr (!G) load<T, NC>(p.q.at<T>(i, h) + at.slot * NC, qi);
    load<T, NC>(p.dout.at<T>(i, h) + at.slot * NC, doi);
#pragma unroll
    for (int n = 0; n < NC; ++n) {
      dk[n] = fmaf(ds, qi[n], dk[n]);
      dv[n] = fmaf(prob, doi[n], dv[n]);
    }
  }
  butterfly_sum(dk, at.merge);
  butterfly_sum(dv, at.merge);
  if (heavy) heavy_sum(p, dk, dv);
  if (at.group != 0 || !at.valid) return;
  if constexpr (G) {
    if (at.slot == 0) *p.da_src.at<float>(j, h) = dk[0];
  } else {
    store_grad<T>(p, p.dk, j, h, at.slot * NC, dk, p.scale);
  }
  store_grad<T>(p, p.dv, j, h, at.slot * NC, dv, 1.0f);
}

// The neighbour sum: out_i = sum over line i's edges of x at the edge's other end (rows: the
// sources; COLUMNS: the targets, over by_source), f32 sums; a group's edges in line order, the
// groups and a heavy line's warps merged as the gradients are. x in p.v, out in p.dq.
template <class T, int NC, bool COLUMNS>
__global__ void __launch_bounds__(kWarps * 32) sum_kernel(const params p, bool heavy) {
  place at;
  if (!(COLUMNS ? column_place(p, heavy, at) : row_place(p, heavy, at))) return;
  const std::int64_t i = at.line;
  const int h = at.head;
  const std::int64_t* ptr = COLUMNS ? p.g.col_ptr : p.g.row_ptr;
  float acc[NC] = {}, none[1] = {};
  const std::int64_t begin = ptr[i], end = ptr[i + 1];
  for (std::int64_t base = begin; base < end; base += at.groups) {
    const std::int64_t t = base + at.group;
    if (!at.valid || t >= end) break;  // no shuffles in this loop: groups may leave early
    const std::int32_t j = COLUMNS ? p.g.dst[p.g.by_source[t]] : p.g.src[t];
    float xj[NC];
    load<T, NC>(p.v.at<T>(j, h) + at.slot * NC, xj);
#pragma unroll
    for (int n = 0; n < NC; ++n) acc[n] += xj[n];
  }
  butterfly_sum(acc, at.merge);
  if (heavy) heavy_sum(p, acc, none);
  if (at.group != 0 || !at.valid) return;
  store_grad<T>(p, p.dq, i, h, at.slot * NC, acc, 1.0f);
}

// da of edge position e, feature f: a thread each, the heads in order; W: the workspace's element
// type (float, or bf16 where p.ws_16), chosen at the launch.
template <class T, class W>
__global__ void feature_kernel(const params p, int features) {
  const std::int64_t x = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= p.g.edges * features) return;
  const std::int64_t e = x / features;
  const int f = static_cast<int>(x % features);
  const std::int32_t i = p.g.dst[e];
  const W* ds = static_cast<const W*>(p.dscore) + e * p.heads;
  const W* prob = static_cast<const W*>(p.prob) + e * p.heads;
  const auto sum = [&]<class E>() {  // E: dout_edge's element type
    float acc = 0.0f;
    for (int h = 0; h < p.heads; ++h) {
      acc = fmaf(convert<float>(ds[h]), convert<float>(p.r.at<T>(i, h)[f]), acc);
      acc = fmaf(convert<float>(prob[h]), convert<float>(p.dout_edge.at<E>(i, h)[f]), acc);
    }
    return acc;
  };
  const float da[1] = {p.edge_in_t ? sum.template operator()<T>()
                                   : sum.template operator()<float>()};
  store_grad<T>(p, p.da, input_edge(p, e), 0, f, da, 1.0f);
}

}  // namespace trisparse::cuda::edge_attention_kernels
