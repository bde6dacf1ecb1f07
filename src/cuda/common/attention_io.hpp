#pragma once
// The operands of an attention kernel as it reads them (plain data, no CUDA headers): q, k, v and
// out with their row and head strides in elements. Kernel parameter blocks derive from it.
#include <cstdint>
#include <numbers>

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

/// The same over a ragged batch packed along the rows: sequence b's queries are rows
/// [cu_q[b], cu_q[b + 1]), its keys [cu_k[b], cu_k[b + 1]).
struct ragged_attention_io : attention_io {
  const std::int64_t* cu_q;  // [batch + 1]
  const std::int64_t* cu_k;  // [batch + 1]
};

inline ragged_attention_io ragged_io_of(const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, const tensor_view& out,
                                        const std::int64_t* cu_q, const std::int64_t* cu_k) {
  return {attention_io_of(q, k, v, out), cu_q, cu_k};
}

/// The kernels' softmax runs in base 2: scores are scaled by scale * log2(e).
inline float scale_log2(double scale) { return static_cast<float>(scale * std::numbers::log2e); }

}  // namespace trisparse::cuda
