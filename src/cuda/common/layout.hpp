#pragma once
// Layout checks shared by the kernels that move rows in 16-byte pieces (host code).
#include <cstdint>
#include <string>

#include "trisparse/core/error.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cuda {

/// @throws invalid_input unless `t` has 16-byte aligned data and row and head strides that are
/// multiples of 8 elements.
inline void check_16byte_rows(const tensor_view& t, const char* what) {
  const auto misaligned = [](std::int64_t x) { return x % 8 != 0; };
  if (misaligned(t.row_stride) || misaligned(t.head_stride) ||
      reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0) {
    throw invalid_input(
        std::string(what) + " " + t.describe() +
        ": the CUDA kernel needs 16-byte aligned data and row/head strides that are "
        "multiples of 8 elements");
  }
}

/// @throws not_supported unless q, k and v are all f16 or all bf16 (other dtypes are valid
/// requests that the row-wise kernels or the CPU serve).
inline void check_16bit_inputs(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                               const char* kernel) {
  if (q.type != k.type || q.type != v.type || (q.type != dtype::f16 && q.type != dtype::bf16)) {
    throw not_supported(std::string(kernel) + " takes q, k, v all f16 or all bf16 (got " +
                        std::string(to_string(q.type)) + ", " + std::string(to_string(k.type)) +
                        ", " + std::string(to_string(v.type)) + ")");
  }
}

/// The fused attention kernels' operands: q, k, v all f16 or all bf16, v's dim equal to q's, and
/// every operand in 16-byte rows. @throws not_supported for other dtypes, invalid_input naming
/// what else is wrong.
inline void check_attention_operands(const tensor_view& q, const tensor_view& k,
                                     const tensor_view& v, const tensor_view& out,
                                     const char* kernel) {
  check_16bit_inputs(q, k, v, kernel);
  if (v.dim != q.dim) {
    throw invalid_input(std::string(kernel) + " needs v's dim equal to q's (" +
                        std::to_string(q.dim) + ")");
  }
  check_16byte_rows(q, "q");
  check_16byte_rows(k, "k");
  check_16byte_rows(v, "v");
  check_16byte_rows(out, "out");
}

}  // namespace trisparse::cuda
