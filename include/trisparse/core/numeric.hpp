#pragma once
/// @file Host-side conversions between float and the 16-bit storage types (round to nearest even).
#include <cstdint>
#include <cstring>

#include "trisparse/core/dtype.hpp"

namespace trisparse {

/// IEEE binary16 bits of f (round to nearest even; overflow gives infinity; NaN stays NaN).
std::uint16_t float_to_half_bits(float f);
/// The float that binary16 bits h represent (exact).
float half_bits_to_float(std::uint16_t h);
/// bfloat16 bits of f (round to nearest even; NaN stays NaN).
std::uint16_t float_to_bf16_bits(float f);
/// The float that bfloat16 bits b represent (exact).
inline float bf16_bits_to_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Reads element i of a buffer of type t as double.
inline double load_as_double(const void* base, dtype t, std::int64_t i) {
  switch (t) {
    case dtype::f16:
      return half_bits_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case dtype::bf16:
      return bf16_bits_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case dtype::f32:
      return static_cast<const float*>(base)[i];
    case dtype::f64:
      return static_cast<const double*>(base)[i];
  }
  return 0.0;
}

/// Writes x (rounded to t) into element i of a buffer of type t.
inline void store_from_double(void* base, dtype t, std::int64_t i, double x) {
  switch (t) {
    case dtype::f16:
      static_cast<std::uint16_t*>(base)[i] = float_to_half_bits(static_cast<float>(x));
      return;
    case dtype::bf16:
      static_cast<std::uint16_t*>(base)[i] = float_to_bf16_bits(static_cast<float>(x));
      return;
    case dtype::f32:
      static_cast<float*>(base)[i] = static_cast<float>(x);
      return;
    case dtype::f64:
      static_cast<double*>(base)[i] = x;
      return;
  }
}

/// Unit roundoff of t (2^-11 for f16, 2^-8 for bf16, 2^-24 for f32, 2^-53 for f64).
constexpr double unit_roundoff(dtype t) {
  switch (t) {
    case dtype::f16:
      return 1.0 / 2048.0;
    case dtype::bf16:
      return 1.0 / 256.0;
    case dtype::f32:
      return 5.9604644775390625e-08;
    case dtype::f64:
      return 1.1102230246251565e-16;
  }
  return 0.0;
}

}  // namespace trisparse
