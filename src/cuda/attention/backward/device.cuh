#pragma once
// The CUDA attention backward's device-side pieces shared by its CUDA-core (launch.cu) and
// tensor-core (tensor_core.cuh) kernels: work chunks, tensor views, partial rows, row terms.
#include <cstdint>

#include "../../common/convert.cuh"
#include "tuning.hpp"

namespace trisparse::cuda::attention_backward {

// Entries [begin, end) of one row; slot < 0: the chunk is the whole row and writes the gradient,
// else it writes partial sums to partial row `slot`.
struct chunk {
  std::int32_t row, slot;
  std::int64_t begin, end;
};

// A row cut into `count` chunks whose partial rows are first, first + 1, ...
struct split_row {
  std::int32_t row, first, count, pad;
};

// TCBs [begin, end) of BSB window `window`; slot < 0: the chunk is the whole window and writes the
// gradient rows, else row r of the window goes to partial row slot + r * stride.
struct tc_chunk {
  std::int32_t window, slot, stride, pad;
  std::int64_t begin, end;
};

// A [rows, heads, dim] view as the kernels read it: element (r, h, d) at r*rs + h*hs + d.
template <class T>
struct view {
  T* data;
  std::int64_t rs, hs;
  int dim;
  __device__ T* at(std::int64_t r, std::int64_t h) const { return data + r * rs + h * hs; }
};

template <class T>
view<T> view_of(const tensor_view& t) {
  return {static_cast<T*>(t.data), t.row_stride, t.head_stride, static_cast<int>(t.dim)};
}

// Partial rows in the workspace: row `slot`, head h at (slot * heads + h) * dim.
struct partials {
  float* data;
  int heads, dim;
  __device__ float* at(std::int64_t slot, int h) const {
    return data + (slot * heads + h) * static_cast<std::int64_t>(dim);
  }
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// This lane's elements lane, lane + 32, ... of a row, as floats (0 past dim).
template <class T>
__device__ __forceinline__ void load(const T* row, int dim, int lane, float (&x)[kMaxChunks]) {
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const int d = lane + 32 * c;
    x[c] = d < dim ? convert<float>(row[d]) : 0.0f;
  }
}

template <class T>
__device__ __forceinline__ void store(T* row, int dim, int lane, const float (&x)[kMaxChunks],
                                      float factor) {
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const int d = lane + 32 * c;
    if (d < dim) row[d] = convert<T>(x[c] * factor);
  }
}

// This lane's share of <a, b> (the warp sums it).
__device__ __forceinline__ float lane_dot(const float (&a)[kMaxChunks],
                                          const float (&b)[kMaxChunks]) {
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) s += a[c] * b[c];
  return s;
}

// A chunk's sums: the gradient row itself (scaled by `factor`) or an unscaled partial row.
template <class G>
__device__ __forceinline__ void finish(const chunk& w, int h, int lane,
                                       const float (&acc)[kMaxChunks], float factor, view<G> out,
                                       partials part) {
  if (w.slot < 0) {
    store(out.at(w.row, h), out.dim, lane, acc, factor);
  } else {
    store(part.at(w.slot, h), out.dim, lane, acc, 1.0f);
  }
}

struct row_terms {
  float* lse;    // [rows * heads]: the given or recomputed log-sum-exp
  float* delta;  // [rows * heads]: D = <dout, out>
};

}  // namespace trisparse::cuda::attention_backward
