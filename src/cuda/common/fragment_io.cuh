#pragma once
// Register <-> memory moves of the tensor-core kernels' fragments: 16-bit runs loaded into packed
// registers, float runs stored (converted) with 16-byte stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "convert.cuh"

namespace trisparse::cuda {

/// Loads N consecutive 16-bit values (N a multiple of 4) into N/2 registers with 8/16-byte loads.
template <int N>
__device__ __forceinline__ void load_halves(const void* src, std::uint32_t (&dst)[N / 2]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      spread(__ldg(static_cast<const uint4*>(src) + i), &dst[4 * i]);
    }
  } else {
    static_assert(N % 4 == 0);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      spread(__ldg(static_cast<const uint2*>(src) + i), &dst[2 * i]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(std::uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = 0;
}

template <class O>
__device__ __forceinline__ O from_float(float x) {
  return convert<O>(x);
}

/// Stores N floats (converted to O) to consecutive addresses with 16-byte stores where possible.
template <class O, int N>
__device__ __forceinline__ void store_run(O* dst, const float (&x)[N]) {
  if constexpr (sizeof(O) == 4 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      reinterpret_cast<float4*>(dst)[i] =
          make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
    }
  } else if constexpr (sizeof(O) == 2 && N % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      uint4 v;
      std::uint32_t* w = reinterpret_cast<std::uint32_t*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const O lo = from_float<O>(x[8 * i + 2 * k]), hi = from_float<O>(x[8 * i + 2 * k + 1]);
        w[k] = static_cast<std::uint32_t>(*reinterpret_cast<const std::uint16_t*>(&lo)) |
               (static_cast<std::uint32_t>(*reinterpret_cast<const std::uint16_t*>(&hi)) << 16);
      }
      reinterpret_cast<uint4*>(dst)[i] = v;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = from_float<O>(x[i]);
  }
}

}  // namespace trisparse::cuda
