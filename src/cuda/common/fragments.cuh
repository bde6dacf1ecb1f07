#pragma once
// Register fragments of dense rows (the ME-BCRS kernels, the GCN layer's, the BCSR kernels'):
// kElems consecutive elements of one row, loaded with 16-byte (or 8/4-byte) vector accesses when
// the row allows, element by element with zero fill otherwise; and the matching stores of fp32
// results.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "convert.cuh"

namespace trisparse::cuda::frags {

template <class T, int kElems>
struct frag {
  static constexpr int kBytes = kElems * static_cast<int>(sizeof(T));
  static_assert(kBytes % 4 == 0, "fragments are whole registers");
  static constexpr int kRegs = kBytes / 4;
  std::uint32_t r[kRegs];
};

template <class T>
__device__ __forceinline__ std::uint32_t raw_bits(const T* p) {
  if constexpr (sizeof(T) == 2)
    return *reinterpret_cast<const unsigned short*>(p);
  else
    return *reinterpret_cast<const std::uint32_t*>(p);
}

/// Elements [0, valid) of src (valid <= 0: src is not read); the rest are zero. `aligned`: src is
/// aligned to the fragment's size (up to 16 bytes).
template <class T, int kElems>
__device__ __forceinline__ void load_frag(const T* src, int valid, bool aligned,
                                          frag<T, kElems>& out) {
  using F = frag<T, kElems>;
  if (valid >= kElems && aligned) {
    if constexpr (F::kBytes >= 16) {
#pragma unroll
      for (int i = 0; i < F::kRegs / 4; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + i);
        out.r[4 * i] = v.x;
        out.r[4 * i + 1] = v.y;
        out.r[4 * i + 2] = v.z;
        out.r[4 * i + 3] = v.w;
      }
    } else if constexpr (F::kBytes == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
      out.r[0] = v.x;
      out.r[1] = v.y;
    } else {
      out.r[0] = __ldg(reinterpret_cast<const unsigned int*>(src));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < F::kRegs; ++i) out.r[i] = 0;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    if (e < valid) {
      if constexpr (sizeof(T) == 2)
        out.r[e / 2] |= raw_bits(src + e) << (16 * (e % 2));
      else
        out.r[e] = raw_bits(src + e);
    }
  }
}

template <class O>
__device__ __forceinline__ O from_float(float x) {
  return convert<O>(x);
}

template <class T>
__device__ __forceinline__ float to_float(T x) {
  return convert<float>(x);
}

/// dst[0, valid) = v[0, valid) converted to O; vector stores when the whole fragment is written
/// and `aligned`.
template <class O, int kElems>
__device__ __forceinline__ void store_floats(O* dst, const float (&v)[kElems], int valid,
                                             bool aligned) {
  constexpr int kBytes = kElems * static_cast<int>(sizeof(O));
  if (valid >= kElems && aligned && kBytes % 4 == 0) {
    if constexpr (sizeof(O) == 4) {
      if constexpr (kElems % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kElems / 4; ++i)
          reinterpret_cast<float4*>(dst)[i] =
              make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        return;
      } else if constexpr (kElems % 2 == 0) {
#pragma unroll
        for (int i = 0; i < kElems / 2; ++i)
          reinterpret_cast<float2*>(dst)[i] = make_float2(v[2 * i], v[2 * i + 1]);
        return;
      }
    } else if constexpr (kElems % 2 == 0) {
      std::uint32_t packed[kElems / 2];
#pragma unroll
      for (int i = 0; i < kElems / 2; ++i) {
        const O lo = from_float<O>(v[2 * i]), hi = from_float<O>(v[2 * i + 1]);
        packed[i] = std::uint32_t{*reinterpret_cast<const unsigned short*>(&lo)} |
                    (std::uint32_t{*reinterpret_cast<const unsigned short*>(&hi)} << 16);
      }
      if constexpr (kElems % 8 == 0) {
#pragma unroll
        for (int i = 0; i < kElems / 8; ++i)
          reinterpret_cast<uint4*>(dst)[i] =
              make_uint4(packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]);
      } else {
#pragma unroll
        for (int i = 0; i < kElems / 2; ++i) reinterpret_cast<std::uint32_t*>(dst)[i] = packed[i];
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    if (e < valid) dst[e] = from_float<O>(v[e]);
  }
}

}  // namespace trisparse::cuda::frags
