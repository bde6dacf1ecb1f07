// 2^x without a libm call, for the loops over scores that `omp simd` vectorises.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace trisparse::cpu {

/// 2^x for x <= 0 (scores minus their maximum): 0 below -126 (and for -inf), NaN for NaN, else
/// 2^floor(x) times a degree-6 polynomial of the fraction, fitted here for relative error on
/// [0, 1): within 1.1e-7 of 2^x, where std::exp2 is a scalar call the compiler cannot vectorise.
inline float exp2_nonpositive(float x) {
  // Below -126 and NaN clamped, so that the integer conversion stays defined.
  const float clamped = x >= -126.0f ? x : -126.0f;
  const float whole = std::floor(clamped);
  const float f = clamped - whole;
  float p = 2.161394423e-04f;
  p = p * f + 1.246734070e-03f;
  p = p * f + 9.675536063e-03f;
  p = p * f + 5.548521868e-02f;
  p = p * f + 2.402293254e-01f;
  p = p * f + 6.931470423e-01f;
  p = p * f + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<std::int32_t>(whole) + 127) << 23);
  return x >= -126.0f ? p * scale : (x != x ? x : 0.0f);
}

}  // namespace trisparse::cpu
