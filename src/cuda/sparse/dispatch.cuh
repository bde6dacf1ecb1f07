#pragma once
// Run-time dtypes -> device element types, shared by the ME-BCRS dispatch points.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "trisparse/core/dtype.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse::cuda::me {

/// f(T{}) with T = __half, __nv_bfloat16 or float for t = f16, bf16, f32.
/// @throws invalid_input naming `what` for any other dtype.
template <class F>
void with_element_type(dtype t, const std::string& what, F&& f) {
  switch (t) {
    case dtype::f16:
      return f(__half{});
    case dtype::bf16:
      return f(__nv_bfloat16{});
    case dtype::f32:
      return f(float{});
    default:
      throw invalid_input(what + " takes f32, f16 or bf16, not " + std::string(to_string(t)));
  }
}

/// f(O{}) for an output dtype that is f32 or the input's own 16-bit type T.
/// @throws invalid_input naming `what` otherwise.
template <class T, class F>
void with_output_type(dtype out, const std::string& what, F&& f) {
  if (out == dtype::f32) return f(float{});
  if constexpr (!std::is_same_v<T, float>) {
    if (out == (std::is_same_v<T, __half> ? dtype::f16 : dtype::bf16)) return f(T{});
  }
  throw invalid_input(what + " is written as f32 or in the input's dtype, not " +
                      std::string(to_string(out)));
}

}  // namespace trisparse::cuda::me
