#pragma once
// The per-head products' kernels (launch.cu launches them; include/trisparse/ops/head_product.hpp
// says what they compute).
//
// product (product_staged where heads lie side by side): a thread block takes 32 rows and
// kProductWarps heads, a warp a head and a lane a row,
// so that the block reads whole rows (all of its heads' columns) and every lane of a warp reads
// the same weight (a broadcast from shared memory, where the heads' weights sit zero-padded to
// M x M); the row's inputs in registers, M x M fused multiply-adds, each output summed over i in
// order.
// outer: a thread block per (chunk of kHeadOuterChunkRows rows, group of heads), a thread per unit
// of JB consecutive outputs (h, i, j..) (one load of x and JB / 4 of g a row from shared memory);
// tiles of kOuterTile rows of the group's columns of x and g staged in shared memory (a load a
// thread and row); each output's partial summed over the chunk's rows in order into the
// workspace. sum_chunks then adds a chunk's partials in a fixed order (warp
// w the chunks w, w + kSumWarps, ... in order, then the warps in order): no atomics, the same bits
// on every run.
#include <cstdint>

#include "trisparse/ops/head_product.hpp"
#include "tuning.hpp"

namespace trisparse::cuda::head_product_kernels {

using namespace head_product_tuning;

struct operand {
  const float* data;
  std::int64_t rs, hs;  // row and head strides (elements)
};
struct result {
  float* data;
  std::int64_t rs, hs;
};

// Elements [0, M) of p into v, zeros past `count` (VEC: 16-byte loads; count and p aligned).
template <int M, bool VEC>
__device__ __forceinline__ void load_row(const float* p, int count, float (&v)[M]) {
#pragma unroll
  for (int i = 0; i < M; i += 4) {
    if constexpr (VEC) {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (i < count) f = *reinterpret_cast<const float4*>(p + i);
      v[i] = f.x;
      v[i + 1] = f.y;
      v[i + 2] = f.z;
      v[i + 3] = f.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[i + e] = i + e < count ? p[i + e] : 0.f;
    }
  }
}

// The group's weights w[h0 + hh] into sw[hh], zero-padded to M x M.
template <int M>
__device__ __forceinline__ void stage_weights(float (*sw)[M * M], const operand& w, int h0,
                                              int group, int a, int b) {
  for (int t = static_cast<int>(threadIdx.x); t < group * M * M; t += kProductWarps * 32) {
    const int hh = t / (M * M), i = t % (M * M) / M, j = t % M;
    sw[hh][t % (M * M)] = i < a && j < b ? w.data[(h0 + hh) * w.rs + i * w.hs + j] : 0.f;
  }
}

// acc[j] = Σ_i xv[i] wh[i M + j], each sum in order of i (wh: the padded weight).
template <int M>
__device__ __forceinline__ void multiply(const float (&xv)[M], const float* wh, float (&acc)[M]) {
#pragma unroll
  for (int j = 0; j < M; ++j) acc[j] = 0.f;
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int j = 0; j < M; ++j) acc[j] = fmaf(xv[i], wh[i * M + j], acc[j]);
  }
}

template <int M, bool VEC>
__global__ void __launch_bounds__(kProductWarps * 32)
    product(operand x, operand w, result out, std::int64_t rows, int heads, int a, int b) {
  static_assert(M % 4 == 0);
  __shared__ __align__(16) float sw[kProductWarps][M * M];
  const int h0 = static_cast<int>(blockIdx.y) * kProductWarps;
  const int group = heads - h0 < kProductWarps ? heads - h0 : kProductWarps;
  stage_weights<M>(sw, w, h0, group, a, b);
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x % 32;
  if (warp >= group || n >= rows) return;
  const int h = h0 + warp;
  const float* wh = sw[warp];
  float xv[M], acc[M];
  load_row<M, VEC>(x.data + n * x.rs + h * x.hs, a, xv);
  multiply<M>(xv, wh, acc);
  float* o = out.data + n * out.rs + h * out.hs;
#pragma unroll
  for (int j = 0; j < M; j += 4) {
    if (j >= b) break;
    if constexpr (VEC) {
      *reinterpret_cast<float4*>(o + j) = make_float4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (j + e < b) o[j + e] = acc[j + e];
    }
  }
}

// product for rows whose heads lie side by side (head strides a and b, 16-byte rows; M <= 16):
// the block's 32 rows x group heads of x read into shared memory and its outputs written from
// there, both as whole 16-byte runs of consecutive columns (the direct kernel's lanes each touch
// another row: 32 rows' partial sectors an instruction, at about 1.7 TB/s on an H200).
template <int M>
__global__ void __launch_bounds__(kProductWarps * 32)
    product_staged(operand x, operand w, result out, std::int64_t rows, int heads, int a, int b) {
  static_assert(M % 4 == 0 && M <= 16);
  constexpr int kStride = kProductWarps * M + 4;  // floats a staged row (4 more: no bank conflicts)
  __shared__ __align__(16) float sw[kProductWarps][M * M];
  __shared__ __align__(16) float tile[32][kStride];
  const int h0 = static_cast<int>(blockIdx.y) * kProductWarps;
  const int group = heads - h0 < kProductWarps ? heads - h0 : kProductWarps;
  stage_weights<M>(sw, w, h0, group, a, b);
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.x) * 32;
  const int count = rows - n0 < 32 ? static_cast<int>(rows - n0) : 32;
  const auto copy = [&](int width, auto&& move) {  // width: floats a row, a multiple of 4
    const int quads = width / 4;
    for (int e = static_cast<int>(threadIdx.x); e < 32 * quads; e += kProductWarps * 32)
      if (e / quads < count) move(e / quads, e % quads * 4);
  };
  copy(group * a, [&](int r, int c) {
    *reinterpret_cast<float4*>(&tile[r][c]) =
        *reinterpret_cast<const float4*>(x.data + (n0 + r) * x.rs + h0 * a + c);
  });
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const bool active = warp < group && lane < count;
  float acc[M];
  if (active) {
    float xv[M];
    load_row<M, true>(&tile[lane][warp * a], a, xv);
    multiply<M>(xv, sw[warp], acc);
  }
  __syncthreads();  // every row read before the outputs take its place
  if (active) {
#pragma unroll
    for (int j = 0; j < M; j += 4)
      if (j < b)
        *reinterpret_cast<float4*>(&tile[lane][warp * b + j]) =
            make_float4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]);
  }
  __syncthreads();
  copy(group * b, [&](int r, int c) {
    *reinterpret_cast<float4*>(out.data + (n0 + r) * out.rs + h0 * b + c) =
        *reinterpret_cast<const float4*>(&tile[r][c]);
  });
}

// `outer`'s unit of work: JB consecutive outputs (h, i, j..j + JB - 1), JB the largest of 8, 4, 1
// dividing b; a thread takes up to outer_units(JB) units.
__host__ __device__ constexpr int outer_units(int jb) { return jb == 1 ? 4 : 1; }
__host__ __device__ constexpr int outer_block(int b) { return b % 8 == 0 ? 8 : b % 4 == 0 ? 4 : 1; }

// The heads a thread block of `outer` takes: its units at most kOuterThreads x outer_units, its
// staged columns (group (a + b) a row) at most kOuterThreads.
__host__ __device__ constexpr int outer_group(int heads, int a, int b) {
  const int jb = outer_block(b), per_head = a * (b / jb);
  int g = heads;
  if (g > kOuterThreads * outer_units(jb) / per_head)
    g = kOuterThreads * outer_units(jb) / per_head;
  if (g > kOuterThreads / (a + b)) g = kOuterThreads / (a + b);
  return g < 1 ? 1 : g;
}

// partials[(chunk * heads + h) * a * b + i * b + j].
template <int JB>
__global__ void __launch_bounds__(kOuterThreads)
    outer(operand x, operand g, std::int64_t rows, int heads, int a, int b, int group,
          float* __restrict__ partials) {
  constexpr int U = outer_units(JB);
  __shared__ __align__(16) float sx[kOuterTile][kOuterThreads], sg[kOuterTile][kOuterThreads];
  const int t = static_cast<int>(threadIdx.x), ab = a * b,
            h0 = static_cast<int>(blockIdx.y) * group;
  const int heads_here = heads - h0 < group ? heads - h0 : group, per_i = b / JB,
            units = heads_here * a * per_i;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kHeadOuterChunkRows;
  const std::int64_t last = first + kHeadOuterChunkRows < rows ? first + kHeadOuterChunkRows : rows;
  // The staged column this thread loads (x's while t < group a, g's while t < group b).
  const bool loads_x = t < heads_here * a, loads_g = t < heads_here * b;
  const std::int64_t x_at = loads_x ? (h0 + t / a) * x.hs + t % a : 0,
                     g_at = loads_g ? (h0 + t / b) * g.hs + t % b : 0;
  float acc[U][JB];
  int xo[U], go[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int unit = t + u * kOuterThreads, hh = unit < units ? unit / (a * per_i) : 0,
              rem = unit % (a * per_i);
    xo[u] = hh * a + rem / per_i;
    go[u] = hh * b + rem % per_i * JB;
#pragma unroll
    for (int j = 0; j < JB; ++j) acc[u][j] = 0.f;
  }
  // The next tile's values come into registers while this tile's are summed (all kOuterTile rows'
  // loads in flight at once).
  float nx[kOuterTile], ng[kOuterTile];
  const auto fetch = [&](std::int64_t r0) {
#pragma unroll
    for (int r = 0; r < kOuterTile; ++r) {
      const bool in = r0 + r < last;
      nx[r] = loads_x && in ? x.data[(r0 + r) * x.rs + x_at] : 0.f;
      ng[r] = loads_g && in ? g.data[(r0 + r) * g.rs + g_at] : 0.f;
    }
  };
  if (first < last) fetch(first);
  for (std::int64_t r0 = first; r0 < last; r0 += kOuterTile) {
    const int tile = static_cast<int>(last - r0 < kOuterTile ? last - r0 : kOuterTile);
#pragma unroll
    for (int r = 0; r < kOuterTile; ++r) {
      sx[r][t] = nx[r];
      sg[r][t] = ng[r];
    }
    __syncthreads();
    if (r0 + kOuterTile < last) fetch(r0 + kOuterTile);
    for (int r = 0; r < tile; ++r) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float xv = sx[r][xo[u]];
        float gv[JB];
        if constexpr (JB % 4 == 0) {
#pragma unroll
          for (int j = 0; j < JB; j += 4) {
            const float4 f = *reinterpret_cast<const float4*>(&sg[r][go[u] + j]);
            gv[j] = f.x;
            gv[j + 1] = f.y;
            gv[j + 2] = f.z;
            gv[j + 3] = f.w;
          }
        } else {
          gv[0] = sg[r][go[u]];
        }
#pragma unroll
        for (int j = 0; j < JB; ++j) acc[u][j] = fmaf(xv, gv[j], acc[u][j]);
      }
    }
    __syncthreads();
  }
  float* out = partials + (static_cast<std::int64_t>(blockIdx.x) * heads + h0) * ab;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int unit = t + u * kOuterThreads;
    if (unit >= units) continue;
    const int at = unit / per_i * b + unit % per_i * JB;  // (hh a + i) b + jb JB
#pragma unroll
    for (int j = 0; j < JB; ++j) out[at + j] = acc[u][j];
  }
}

// dw[h, i, j] = the chunks' partials of output e = (h a + i) b + j added in a fixed order: warp w
// the chunks w, w + kSumWarps, ... in order, then the warps' sums in order. A block takes 32
// consecutive outputs, a lane one.
__global__ void __launch_bounds__(kSumWarps * 32)
    sum_chunks(const float* __restrict__ partials, std::int64_t chunks, int heads, int a, int b,
               result dw) {
  __shared__ float part[kSumWarps][32];
  const int ab = a * b, warp = static_cast<int>(threadIdx.x) / 32,
            lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t outputs = static_cast<std::int64_t>(heads) * ab,
                     e = static_cast<std::int64_t>(blockIdx.x) * 32 + lane;
  float s = 0.f;
  if (e < outputs)
    for (std::int64_t c = warp; c < chunks; c += kSumWarps) s += partials[c * outputs + e];
  part[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || e >= outputs) return;
  float total = part[0][lane];
#pragma unroll
  for (int w = 1; w < kSumWarps; ++w) total += part[w][lane];
  const int h = static_cast<int>(e / ab), p = static_cast<int>(e % ab);
  dw.data[h * dw.rs + (p / b) * dw.hs + p % b] = total;
}

}  // namespace trisparse::cuda::head_product_kernels
