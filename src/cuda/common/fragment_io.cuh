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

/// Where a lane's operands of one 16x8 TCB are: the column of its B row for the k16 products
/// (col[g]), the columns of its two slices for the k8 products (col[2t], col[2t+1]), and the
/// TCB's bitmap. Loaded two TCBs ahead, so the row loads that depend on them need not wait.
struct tcb_meta {
  std::int32_t cb = -1, c0 = -1, c1 = -1;
  std::uint64_t mask0 = 0, mask1 = 0;  // rows 0-7, rows 8-15
};

__device__ __forceinline__ tcb_meta load_tcb_meta(const std::int32_t* col_idx,
                                                  const std::uint64_t* bitmap, std::int64_t tcb,
                                                  int g, int t) {
  const std::int32_t* cols = col_idx + tcb * 8;
  return {__ldg(cols + g), __ldg(cols + 2 * t), __ldg(cols + 2 * t + 1), __ldg(bitmap + 2 * tcb),
          __ldg(bitmap + 2 * tcb + 1)};
}

// Sector-aligned fragment layouts of the m16n8k16 / m16n8k8 products over gathered rows (16-bit
// elements; D the row length): the warp's 16-byte loads each cover whole 32-byte sectors.

// A lane's share of a row: N elements in runs of min(8, N), run i at columns
// i·P·run + lane·run + [0, run), P lanes sharing the row, so that the warp's 16-byte loads cover
// whole 32-byte sectors. Zeros for row == nullptr.
template <int N, int P>
__device__ __forceinline__ void load_runs(const void* row, int lane, std::uint32_t (&dst)[N / 2]) {
  constexpr int kR = N < 8 ? N : 8;
  if (row == nullptr) {
    zero(dst);
    return;
  }
#pragma unroll
  for (int i = 0; i < N / kR; ++i) {
    load_halves<kR>(static_cast<const std::uint16_t*>(row) + i * P * kR + lane * kR,
                    *reinterpret_cast<std::uint32_t(*)[kR / 2]>(&dst[i * kR / 2]));
  }
}

// A lane's share of a row's contraction for the m16n8k16 products: D/4 elements, run i at columns
// i·32 + t·8 + [0, 8) (4-element runs at D = 32). The same permutation in A and B rows (it
// depends on t only) leaves the products exact.
template <int D>
__device__ __forceinline__ void load_quarter(const void* row, int t, std::uint32_t (&dst)[D / 8]) {
  load_runs<D / 4, 4>(row, t, dst);
}

// Stores a lane's D/4 floats of one row (converted to G) in the quarter layout above: element
// i·8 + e at column i·32 + t·8 + e.
template <class G, int D>
__device__ __forceinline__ void store_quarter(G* row, int t, const float (&x)[D / 4]) {
  static_assert(D % 32 == 0, "the quarter layout stores 8-element runs");
#pragma unroll
  for (int i = 0; i < D / 32; ++i)
    store_run<G, 8>(row + i * 32 + t * 8, *reinterpret_cast<const float(*)[8]>(&x[i * 8]));
}

// A lane's slice of a row for the m16n8k8 products: D/8 elements in runs of kRun<D> = min(8, D/8),
// run i at columns i·8·kRun + g·kRun + [0, kRun). Slice element j = i·kRun + e is output column j
// of the lane's blocks.
template <int D>
inline constexpr int kRun = D / 8 < 8 ? D / 8 : 8;

template <int D>
__device__ __forceinline__ void load_slice(const void* row, int g, std::uint32_t (&dst)[D / 16]) {
  load_runs<D / 8, 8>(row, g, dst);
}

// Stores a lane's D/8 accumulator columns of one row, those of C column `n` (2t or 2t + 1): run i
// at columns i·8·kRun + n·kRun + [0, kRun) (the slice order above).
template <class G, int D>
__device__ __forceinline__ void store_slice(G* row, int n, const float (&x)[D / 8]) {
  constexpr int kR = kRun<D>;
#pragma unroll
  for (int i = 0; i < D / 8 / kR; ++i)
    store_run<G, kR>(row + i * 8 * kR + n * kR, *reinterpret_cast<const float(*)[kR]>(&x[i * kR]));
}

}  // namespace trisparse::cuda
