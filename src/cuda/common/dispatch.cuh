#pragma once
// The one dispatch mechanism of the CUDA kernels: where run-time values (dtype, head dim, tile
// shape) become template arguments. Each op's launch file calls these with its own lists; the head
// dims compiled at all come from CMake (TRISPARSE_HEAD_DIMS, default 32;64;128;256), so that a
// build can be pruned to the dims it needs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "trisparse/core/dtype.hpp"
#include "trisparse/core/error.hpp"

// Bit i: head dim 32 << i is compiled (CMake's TRISPARSE_HEAD_DIMS; all four by default).
#ifndef TRISPARSE_HEAD_DIM_MASK
#define TRISPARSE_HEAD_DIM_MASK 15
#endif

namespace trisparse::cuda {

/// The device element type of each dtype the kernels take.
template <class T>
inline constexpr dtype dtype_of = std::is_same_v<T, __half>          ? dtype::f16
                                  : std::is_same_v<T, __nv_bfloat16> ? dtype::bf16
                                                                     : dtype::f32;

/// Calls f.template operator()<T>() for the T among Ts whose dtype is t.
/// @throws not_supported for f64 (a dtype the library takes, on the CPU, but no CUDA kernel
/// computes in), invalid_input for another dtype outside Ts; both name `what` and the dtypes
/// it takes.
template <class... Ts, class F>
void with_type(dtype t, std::string_view what, F&& f) {
  const bool found = ((t == dtype_of<Ts> ? (f.template operator()<Ts>(), true) : false) || ...);
  if (!found) {
    std::string names;
    ((names += (names.empty() ? "" : ", ") + std::string(to_string(dtype_of<Ts>))), ...);
    const std::string message =
        std::string(what) + " takes " + names + ", not " + std::string(to_string(t));
    if (t == dtype::f64) throw not_supported(message + " (float64 runs on the CPU)");
    throw invalid_input(message);
  }
}

/// The element types of the tensor-core attention kernels, and of the sparse kernels (tf32 too).
template <class F>
void with_half_type(dtype t, std::string_view what, F&& f) {
  with_type<__half, __nv_bfloat16>(t, what, f);
}
template <class F>
void with_element_type(dtype t, std::string_view what, F&& f) {
  with_type<__half, __nv_bfloat16, float>(t, what, f);
}

/// Calls f.template operator()<O>() for an output dtype that is f32 or the input type T's own.
template <class T, class F>
void with_output_type(dtype out, std::string_view what, F&& f) {
  if constexpr (std::is_same_v<T, float>)
    with_type<float>(out, what, f);
  else
    with_type<float, T>(out, what, f);
}

/// Calls f.template operator()<V>() for the V among Vs equal to v.
/// @throws invalid_input naming `what` and the values it takes.
template <int... Vs, class F>
void with_value(std::int64_t v, std::string_view what, F&& f) {
  const bool found = ((v == Vs ? (f.template operator()<Vs>(), true) : false) || ...);
  if (!found) {
    std::string values;
    ((values += (values.empty() ? "" : ", ") + std::to_string(Vs)), ...);
    throw invalid_input(std::string(what) + " takes " + values + ", not " + std::to_string(v));
  }
}

/// True when head dim d is compiled into this build (TRISPARSE_HEAD_DIMS).
constexpr bool head_dim_built(int d) {
  for (int i = 0; i < 4; ++i)
    if (d == 32 << i) return ((TRISPARSE_HEAD_DIM_MASK >> i) & 1) != 0;
  return false;
}

/// with_value over the head dims Ds that an op supports; a supported dim this build left out
/// throws not_supported naming the CMake option.
template <int... Ds, class F>
void with_head_dim(std::int64_t d, std::string_view what, F&& f) {
  with_value<Ds...>(d, what, [&]<int D>() {
    if constexpr (head_dim_built(D))
      f.template operator()<D>();
    else
      throw not_supported(std::string(what) + ": head_dim " + std::to_string(D) +
                          " is not in this build (configure with TRISPARSE_HEAD_DIMS)");
  });
}

}  // namespace trisparse::cuda
