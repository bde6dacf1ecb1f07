#pragma once
// Element conversions of the kernels (internal): f32, f16 and bf16, rounding to nearest even, and
// vector registers spread into arrays.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace trisparse::cuda {

/// x as To: the identity, a 16-bit type widened to float, or float rounded to a 16-bit type.
template <class To, class From>
__device__ __forceinline__ To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<To, float>) {
    if constexpr (std::is_same_v<From, __half>)
      return __half2float(x);
    else
      return __bfloat162float(x);
  } else {
    static_assert(std::is_same_v<From, float>, "16-bit types convert through float");
    if constexpr (std::is_same_v<To, __half>)
      return __float2half_rn(x);
    else
      return __float2bfloat16_rn(x);
  }
}

/// dst[0, 4) (or [0, 2)) = the words of a vector register.
template <class V, class T>
__device__ __forceinline__ void spread(const V& v, T* dst) {
  dst[0] = v.x;
  dst[1] = v.y;
  if constexpr (sizeof(V) == 4 * sizeof(T)) {
    dst[2] = v.z;
    dst[3] = v.w;
  }
}

}  // namespace trisparse::cuda
