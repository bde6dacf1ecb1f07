#pragma once
// The operands of an attention kernel as it reads them (plain data, no CUDA headers): q, k, v and
// out with their row and head strides in elements. Kernel parameter blocks derive from it.
#include <cstdint>

#include "trisparse/core/tensor.hpp"

namespace trisparse::cuda {

struct attention_io {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  std::int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head;  // element strides
};

inline attention_io attention_io_of(const tensor_view& q, const tensor_view& k,
                                    const tensor_view& v, const tensor_view& out) {
  return {q.data,       k.data,        v.data,         out.data,
          q.row_stride, q.head_stride, k.row_stride,   k.head_stride,
          v.row_stride, v.head_stride, out.row_stride, out.head_stride};
}

}  // namespace trisparse::cuda
