#pragma once
// The CUDA attention backward's device-side pieces shared by its CUDA-core (cuda_core.cuh) and
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
// gradient rows, else it is chunk `piece` of the window's `stride` and row r of the window goes to
// partial row slot + r * stride (the window's partial rows start at slot - piece).
struct tc_chunk {
  std::int32_t window, slot, stride, piece;
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

struct row_terms {
  float* lse;    // [rows * heads]: the given or recomputed log-sum-exp
  float* delta;  // [rows * heads]: D = <dout, out>
};

}  // namespace trisparse::cuda::attention_backward
