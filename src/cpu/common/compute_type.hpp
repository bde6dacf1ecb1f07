#pragma once
// The CPU engines' element type: float64 for float64 inputs (PyTorch's gradcheck), fp32 for the
// rest (f16 and bf16 widened on load).
#include <type_traits>

#include "trisparse/core/dtype.hpp"

namespace trisparse::cpu {

/// The dtype of an engine's element type T (float or double).
template <class T>
inline constexpr dtype dtype_of = std::is_same_v<T, double> ? dtype::f64 : dtype::f32;

/// Runs f.template operator()<T>() with T = double for float64 inputs, float otherwise.
template <class F>
void in_type_of(dtype t, F&& f) {
  if (t == dtype::f64)
    f.template operator()<double>();
  else
    f.template operator()<float>();
}

}  // namespace trisparse::cpu
