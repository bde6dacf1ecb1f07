#pragma once
// The fused GCN layer's kernels, GraphCUDA's A·X·W (plan.hpp; launched by launch.cu): one thread
// block per 16-row window.
//
// 1. Â x: warps take 32-feature slices of x; per TCB (a k8 slice of the window's compacted
//    columns) an m16n8k8 product with A = Â's 16x8 values (from the bitmap) and B = the TCB's 8
//    gathered rows of x. Lane (g, t) loads 4 consecutive features of its two rows, so tile i's
//    column n stands for feature 4n + i of the slice: whole-sector loads, and the lane ends up
//    with 8 consecutive features of rows g and g + 8, stored to shared memory (in x's dtype for
//    f16/bf16, fp32 for tf32). Cut windows instead add their chunks' partial rows (partial_kernel)
//    in chunk order.
// 2. (Â x) w: warps take 32-column slices of w; A from shared memory, B = 4 consecutive columns
//    of w's rows, with the contraction permuted alike in A and B (16-bit: positions 2t, 2t + 1,
//    2t + 8, 2t + 9 are rows 4t .. 4t + 3; tf32: t, t + 4 are 2t, 2t + 1).
// 3. Epilogue: bias, ReLU, the mask (a byte per lane, OR-ed over the 4 lanes of a group).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../../common/arch/mma.cuh"
#include "../../common/fragments.cuh"
#include "plan.hpp"
#include "tuning.hpp"

namespace trisparse::cuda::gcn_fused_kernels {

using namespace gcn_fused_tuning;

struct format_args {
  const std::int64_t* tcb_offset;
  const std::int32_t* col_idx;
  const std::uint64_t* bitmap;
  const std::int64_t* value_offset;
  const float* values;
  std::int64_t rows;
};

struct dense_args {
  const void* x;
  std::int64_t x_row;
  int f_in;
  bool x_vec;  // x's rows allow the fragments' vector loads
};

struct fused_args {
  format_args f;
  dense_args in;
  const std::int32_t* order;  // windows, heaviest first
  const std::int32_t* split_first;
  const std::int32_t* split_count;
  const float* partial;  // [slots][16][f_in]
  const void* w;
  std::int64_t w_row;
  int f_out;
  bool w_vec;
  const void* bias;
  bool bias_f32, relu;
  void* out;
  std::int64_t out_row;
  bool out_vec;
  std::uint32_t* mask;
  int mask_words;
  void* ax;
  std::int64_t ax_row;
  int stride;  // shared-memory row, elements
  int stage_bytes;
};

struct partial_args {
  format_args f;
  dense_args in;
  const gcn_chunk* chunks;
  float* partial;
};

// Element type of the shared (Â x) rows.
template <class T>
using stage_t = std::conditional_t<sizeof(T) == 2, T, float>;

template <class T>
inline int stage_stride(std::int64_t f_in) {
  // Rows 32 bytes off a multiple of 128: the phase-2 loads (8 bytes a lane) are conflict-free.
  return sizeof(T) == 2 ? static_cast<int>((f_in + 63) / 64 * 64 + 16)
                        : static_cast<int>((f_in + 31) / 32 * 32 + 8);
}

template <class T>
inline std::size_t stage_bytes(std::int64_t f_in) {
  return std::size_t{16} * stage_stride<T>(f_in) * sizeof(stage_t<T>);
}

// Â's value at bit (row * 8 + column) of a TCB, 0 where the bitmap is clear.
__device__ __forceinline__ float tcb_value(const float* v, std::uint64_t w0, std::uint64_t w1,
                                           int bit) {
  if (bit < 64) {
    const std::uint64_t below = (std::uint64_t{1} << bit) - 1;
    return (w0 >> bit) & 1u ? __ldg(v + __popcll(w0 & below)) : 0.0f;
  }
  bit -= 64;
  const std::uint64_t below = (std::uint64_t{1} << bit) - 1;
  return (w1 >> bit) & 1u ? __ldg(v + __popcll(w0) + __popcll(w1 & below)) : 0.0f;
}

// What a lane needs of one TCB, loaded ahead of its use: the columns of its two B rows, the
// bitmap and the offset of the TCB's values. tcb_meta{} (columns -1) stands for "past the end".
struct tcb_meta {
  std::int32_t c0 = -1, c1 = -1;
  std::uint64_t w0 = 0, w1 = 0;
  std::int64_t voff = 0;
};

template <class T>
__device__ __forceinline__ tcb_meta load_meta(const format_args& f, std::int64_t tcb,
                                              std::int64_t e, int t) {
  if (tcb >= e) return {};
  constexpr bool k16 = sizeof(T) == 2;
  const int k0 = k16 ? 2 * t : t, k1 = k16 ? 2 * t + 1 : t + 4;
  return {__ldg(f.col_idx + tcb * 8 + k0), __ldg(f.col_idx + tcb * 8 + k1),
          __ldg(f.bitmap + 2 * tcb), __ldg(f.bitmap + 2 * tcb + 1), __ldg(f.value_offset + tcb)};
}

// The lane's A fragment (Â's values) of a TCB: 2 registers (16-bit) or 4 (tf32); zeros past the
// end.
template <class T>
__device__ __forceinline__ void load_a(const format_args& f, const tcb_meta& m, int g, int t,
                                       std::uint32_t (&a)[4]) {
  const float* v = f.values + m.voff;
  if constexpr (sizeof(T) == 2) {
    a[0] = arch::pack2<T>(tcb_value(v, m.w0, m.w1, g * 8 + 2 * t),
                          tcb_value(v, m.w0, m.w1, g * 8 + 2 * t + 1));
    a[1] = arch::pack2<T>(tcb_value(v, m.w0, m.w1, (g + 8) * 8 + 2 * t),
                          tcb_value(v, m.w0, m.w1, (g + 8) * 8 + 2 * t + 1));
  } else {
    a[0] = arch::to_tf32(tcb_value(v, m.w0, m.w1, g * 8 + t));
    a[1] = arch::to_tf32(tcb_value(v, m.w0, m.w1, (g + 8) * 8 + t));
    a[2] = arch::to_tf32(tcb_value(v, m.w0, m.w1, g * 8 + t + 4));
    a[3] = arch::to_tf32(tcb_value(v, m.w0, m.w1, (g + 8) * 8 + t + 4));
  }
}

template <class T>
struct b_rows {
  frags::frag<T, kTiles> x0, x1;
};

template <class T>
__device__ __forceinline__ b_rows<T> load_b(const dense_args& in, const tcb_meta& m, int feat) {
  const T* x = static_cast<const T*>(in.x);
  const int valid = in.f_in - feat;
  b_rows<T> r;
  frags::load_frag(x + std::int64_t{m.c0 < 0 ? 0 : m.c0} * in.x_row + feat, m.c0 < 0 ? 0 : valid,
                   in.x_vec, r.x0);
  frags::load_frag(x + std::int64_t{m.c1 < 0 ? 0 : m.c1} * in.x_row + feat, m.c1 < 0 ? 0 : valid,
                   in.x_vec, r.x1);
  return r;
}

// acc += (Â x) over TCBs b, b + step, ... < e for the slice of features starting at fb:
// acc[i][0..1] are row g's features fb + 8t + i and fb + 8t + 4 + i, acc[i][2..3] row g + 8's.
// Metadata two TCBs ahead, the B rows and A values one ahead: an iteration waits for one load.
template <class T>
__device__ __forceinline__ void accumulate_ax(const format_args& f, const dense_args& in,
                                              std::int64_t b, std::int64_t e, int step, int fb,
                                              int lane, float (&acc)[kTiles][4]) {
  const int g = lane / 4, t = lane % 4;
  const int feat = fb + kTiles * g;
  tcb_meta next = load_meta<T>(f, b + step, e, t);
  const tcb_meta first = load_meta<T>(f, b, e, t);
  b_rows<T> x = load_b<T>(in, first, feat);
  std::uint32_t a[4];
  load_a<T>(f, first, g, t, a);
  for (std::int64_t tcb = b; tcb < e; tcb += step) {
    const tcb_meta after = load_meta<T>(f, tcb + 2 * step, e, t);
    const b_rows<T> x_next = load_b<T>(in, next, feat);
    std::uint32_t a_next[4];
    load_a<T>(f, next, g, t, a_next);
    if constexpr (sizeof(T) == 2) {
      const std::uint32_t a2[2] = {a[0], a[1]};
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const std::uint32_t bi = i % 2 == 0 ? arch::interleave_lo(x.x0.r[i / 2], x.x1.r[i / 2])
                                            : arch::interleave_hi(x.x0.r[i / 2], x.x1.r[i / 2]);
        arch::mma_16x8x8_f32<T>(acc[i], a2, bi);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const std::uint32_t bi[2] = {arch::to_tf32(__uint_as_float(x.x0.r[i])),
                                     arch::to_tf32(__uint_as_float(x.x1.r[i]))};
        arch::mma_16x8x8_f32_tf32(acc[i], a, bi);
      }
    }
    x = x_next;
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = a_next[i];
    next = after;
  }
}

// The lane's 8 consecutive values of row g (half = 0) or g + 8 (half = 1) from a slice's
// accumulators, in column order.
__device__ __forceinline__ void lane_run(const float (&acc)[kTiles][4], int half, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    v[i] = acc[i][2 * half];
    v[kTiles + i] = acc[i][2 * half + 1];
  }
}

// How a block's warps share (Â x) of 16 rows: feature slices, and where there are fewer slices
// than warps, groups of TCBs (group q takes every groups-th TCB from the q-th), whose fp32
// partial rows are then added in group order in shared memory (`part`, groups x 16 x k_pad).
__host__ __device__ constexpr int tcb_groups(int k_pad) {
  const int slices = k_pad / kSlice;
  return slices >= kWarps || slices == 0 ? 1 : kWarps / slices;
}

// (Â x) of TCBs [b, e) for features [0, k_pad): sink.put8(r, col, v) takes 8 consecutive values
// from registers, sink.put(r, col, v) one (the group sums). All threads of the block call it.
template <class T, class Sink>
__device__ __forceinline__ void block_ax(const format_args& f, const dense_args& in, std::int64_t b,
                                         std::int64_t e, int k_pad, float* part, Sink& sink) {
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, t = lane % 4;
  const int slices = k_pad / kSlice, groups = tcb_groups(k_pad);
  if (groups == 1) {
    for (int s = warp; s < slices; s += kWarps) {
      float acc[kTiles][4] = {};
      accumulate_ax<T>(f, in, b, e, 1, s * kSlice, lane, acc);
      for (int half = 0; half < 2; ++half) {
        float v[8];
        lane_run(acc, half, v);
        sink.put8(g + 8 * half, s * kSlice + 8 * t, v);
      }
    }
    return;
  }
  if (warp < slices * groups) {
    const int s = warp % slices, q = warp / slices;
    float acc[kTiles][4] = {};
    accumulate_ax<T>(f, in, b + q, e, groups, s * kSlice, lane, acc);
    for (int half = 0; half < 2; ++half) {
      float v[8];
      lane_run(acc, half, v);
      frags::store_floats<float, 8>(part + (q * 16 + g + 8 * half) * k_pad + s * kSlice + 8 * t, v,
                                    8, true);
    }
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < 16 * k_pad; i += kWarps * 32) {
    float sum = 0.0f;
    for (int q = 0; q < groups; ++q) sum += part[q * 16 * k_pad + i];
    sink.put(i / k_pad, i % k_pad, sum);
  }
}

// Shared (Â x) rows in S (the fused kernel's stage).
template <class S>
struct stage_sink {
  S* stage;
  int stride;
  __device__ void put8(int r, int col, const float (&v)[8]) {
    frags::store_floats<S, 8>(stage + r * stride + col, v, 8, true);
  }
  __device__ void put(int r, int col, float v) { stage[r * stride + col] = convert<S>(v); }
};

// fp32 partial rows of a chunk in global memory, [16][f_in].
struct partial_sink {
  float* rows;
  int f_in;
  bool vec;
  __device__ void put8(int r, int col, const float (&v)[8]) {
    frags::store_floats<float, 8>(rows + r * f_in + col, v, f_in - col, vec);
  }
  __device__ void put(int r, int col, float v) {
    if (col < f_in) rows[r * f_in + col] = v;
  }
};

// Shared memory of the TCB groups' partial rows.
inline std::size_t group_bytes(std::int64_t f_in) {
  const int k_pad = static_cast<int>((f_in + kSlice - 1) / kSlice * kSlice);
  const int groups = tcb_groups(k_pad);
  return groups == 1 ? 0 : std::size_t{16} * groups * k_pad * 4;
}

template <class T>
__global__ void __launch_bounds__(kWarps * 32) partial_kernel(const partial_args a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const gcn_chunk c = a.chunks[blockIdx.x];
  const int k_pad = (a.in.f_in + kSlice - 1) / kSlice * kSlice;
  partial_sink sink{a.partial + std::int64_t{c.slot} * 16 * a.in.f_in, a.in.f_in,
                    a.in.f_in % 4 == 0};
  block_ax<T>(a.f, a.in, c.begin, c.end, k_pad, reinterpret_cast<float*>(smem_raw), sink);
}

template <class T, class O>
__global__ void __launch_bounds__(kWarps * 32) fused_kernel(const fused_args a) {
  using S = stage_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* stage = reinterpret_cast<S*>(smem_raw);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, t = lane % 4;
  const std::int64_t win = a.order[blockIdx.x];
  const int f_in = a.in.f_in, k_pad = (f_in + kSlice - 1) / kSlice * kSlice;
  const int first = a.split_first == nullptr ? -1 : a.split_first[win];

  // 1. (Â x) of the window's 16 rows into shared memory, zero beyond f_in up to k_pad.
  if (first < 0) {
    stage_sink<S> sink{stage, a.stride};
    block_ax<T>(a.f, a.in, a.f.tcb_offset[win], a.f.tcb_offset[win + 1], k_pad,
                reinterpret_cast<float*>(smem_raw + a.stage_bytes), sink);
  } else {
    const int n = a.split_count[win];
    for (int i = static_cast<int>(threadIdx.x); i < 16 * k_pad; i += kWarps * 32) {
      const int r = i / k_pad, col = i % k_pad;
      float sum = 0.0f;
      if (col < f_in) {
        for (int c = 0; c < n; ++c)
          sum += a.partial[(std::int64_t{first + c} * 16 + r) * f_in + col];
      }
      stage[r * a.stride + col] = convert<S>(sum);
    }
  }
  __syncthreads();
  const std::int64_t row0 = win * 16;
  if (a.ax != nullptr) {
    T* ax = static_cast<T*>(a.ax);
    for (int i = static_cast<int>(threadIdx.x); i < 16 * f_in; i += kWarps * 32) {
      const int r = i / f_in, col = i % f_in;
      if (row0 + r < a.f.rows)
        ax[(row0 + r) * a.ax_row + col] = convert<T>(stage[r * a.stride + col]);
    }
  }

  // 2. (Â x) w per 32-column slice of w, then the epilogue.
  const T* w = static_cast<const T*>(a.w);
  constexpr bool k16 = sizeof(T) == 2;
  for (int nb = warp * kSlice; nb < a.f_out; nb += kWarps * kSlice) {
    float acc[kTiles][4] = {};
    const int col = nb + kTiles * g;
    const int valid = a.f_out - col;
    if constexpr (k16) {
      for (int kb = 0; kb < k_pad; kb += 16) {
        const uint2 lo = *reinterpret_cast<const uint2*>(stage + g * a.stride + kb + 4 * t);
        const uint2 hi = *reinterpret_cast<const uint2*>(stage + (g + 8) * a.stride + kb + 4 * t);
        const std::uint32_t am[4] = {lo.x, hi.x, lo.y, hi.y};
        frags::frag<T, kTiles> wr[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int k = kb + 4 * t + j;
          frags::load_frag(w + std::int64_t{k < f_in ? k : 0} * a.w_row + col, k < f_in ? valid : 0,
                           a.w_vec, wr[j]);
        }
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const std::uint32_t b[2] = {
              i % 2 == 0 ? arch::interleave_lo(wr[0].r[i / 2], wr[1].r[i / 2])
                         : arch::interleave_hi(wr[0].r[i / 2], wr[1].r[i / 2]),
              i % 2 == 0 ? arch::interleave_lo(wr[2].r[i / 2], wr[3].r[i / 2])
                         : arch::interleave_hi(wr[2].r[i / 2], wr[3].r[i / 2])};
          arch::mma_16x8x16_f32<T>(acc[i], am, b);
        }
      }
    } else {
      for (int kb = 0; kb < k_pad; kb += 8) {
        const float2 lo = *reinterpret_cast<const float2*>(stage + g * a.stride + kb + 2 * t);
        const float2 hi = *reinterpret_cast<const float2*>(stage + (g + 8) * a.stride + kb + 2 * t);
        const std::uint32_t am[4] = {arch::to_tf32(lo.x), arch::to_tf32(hi.x), arch::to_tf32(lo.y),
                                     arch::to_tf32(hi.y)};
        frags::frag<float, kTiles> wr[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = kb + 2 * t + j;
          frags::load_frag(w + std::int64_t{k < f_in ? k : 0} * a.w_row + col, k < f_in ? valid : 0,
                           a.w_vec, wr[j]);
        }
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const std::uint32_t b[2] = {arch::to_tf32(__uint_as_float(wr[0].r[i])),
                                      arch::to_tf32(__uint_as_float(wr[1].r[i]))};
          arch::mma_16x8x8_f32_tf32(acc[i], am, b);
        }
      }
    }
    // Epilogue: the lane's 8 columns nb + 8t .. of rows g and g + 8.
    const int oc = nb + 8 * t;
    for (int half = 0; half < 2; ++half) {
      float v[8];
      lane_run(acc, half, v);
      std::uint32_t bits = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (oc + j < a.f_out) {
          if (a.bias != nullptr) {
            v[j] += a.bias_f32 ? static_cast<const float*>(a.bias)[oc + j]
                               : convert<float>(static_cast<const T*>(a.bias)[oc + j]);
          }
          if (v[j] > 0.0f) bits |= 1u << j;
          if (a.relu) v[j] = fmaxf(v[j], 0.0f);
        }
      }
      const std::int64_t row = row0 + g + 8 * half;
      if (row < a.f.rows && oc < a.f_out) {
        frags::store_floats<O, 8>(static_cast<O*>(a.out) + row * a.out_row + oc, v, a.f_out - oc,
                                  a.out_vec);
      }
      if (a.mask != nullptr) {
        std::uint32_t word = bits << (8 * t);
        word |= __shfl_xor_sync(0xFFFFFFFFu, word, 1);
        word |= __shfl_xor_sync(0xFFFFFFFFu, word, 2);
        if (t == 0 && row < a.f.rows) a.mask[row * a.mask_words + nb / 32] = word;
      }
    }
  }
}

// One warp per 32 columns of a row: the epilogue of the unfused order.
template <class O>
__global__ void bias_relu_kernel(const float* z, std::int64_t z_row, const void* bias,
                                 dtype bias_type, bool relu, O* out, std::int64_t out_row,
                                 std::uint32_t* mask, int mask_words, std::int64_t rows, int dim) {
  const std::int64_t item = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row = item / mask_words;
  const int col = static_cast<int>(item % mask_words) * 32 + lane;
  if (row >= rows) return;
  float v = 0.0f;
  if (col < dim) {
    v = z[row * z_row + col];
    if (bias != nullptr) {
      v += bias_type == dtype::f32 ? static_cast<const float*>(bias)[col]
           : bias_type == dtype::f16
               ? __half2float(static_cast<const __half*>(bias)[col])
               : __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[col]);
    }
  }
  const std::uint32_t bits = __ballot_sync(0xFFFFFFFFu, col < dim && v > 0.0f);
  if (col < dim) out[row * out_row + col] = convert<O>(relu ? fmaxf(v, 0.0f) : v);
  if (mask != nullptr && lane == 0) mask[row * mask_words + col / 32] = bits;
}

// dz = dout ∘ mask and each block's column sums of dz (rows [blockIdx.y · R, +R), 32 columns
// from blockIdx.x · 32; 8 row lanes a column, added in lane order).
template <class I, class T>
__global__ void __launch_bounds__(256)
    relu_grad_kernel(const I* dout, std::int64_t dout_row, const std::uint32_t* mask, int words,
                     T* dz, std::int64_t dz_row, float* sums, std::int64_t rows, int dim) {
  __shared__ float part[8][33];
  const int tx = static_cast<int>(threadIdx.x % 32), ty = static_cast<int>(threadIdx.x / 32);
  const int col = static_cast<int>(blockIdx.x) * 32 + tx;
  const std::int64_t first = std::int64_t{blockIdx.y} * kGradRowsPerBlock;
  const std::int64_t last = first + kGradRowsPerBlock < rows ? first + kGradRowsPerBlock : rows;
  float sum = 0.0f;
  if (col < dim) {
    for (std::int64_t r = first + ty; r < last; r += 8) {
      float v = convert<float>(dout[r * dout_row + col]);
      if (mask != nullptr && ((mask[r * words + col / 32] >> (col % 32)) & 1u) == 0) v = 0.0f;
      const T rounded = convert<T>(v);
      dz[r * dz_row + col] = rounded;
      sum += convert<float>(rounded);
    }
  }
  part[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < dim && sums != nullptr) {
    float total = 0.0f;
    for (int i = 0; i < 8; ++i) total += part[i][tx];
    sums[std::int64_t{blockIdx.y} * dim + col] = total;
  }
}

// dbias[c] = the blocks' sums of column c, in block order.
template <class B>
__global__ void add_sums_kernel(const float* sums, std::int64_t blocks, int dim, B* dbias) {
  const int col = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (col >= dim) return;
  float total = 0.0f;
  for (std::int64_t b = 0; b < blocks; ++b) total += sums[b * dim + col];
  dbias[col] = convert<B>(total);
}

}  // namespace trisparse::cuda::gcn_fused_kernels
