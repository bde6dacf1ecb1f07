#pragma once
// Pieces of the online softmax (running max in log2 units, rescaled accumulators) that the fused
// attention kernels share; fragments in the m16n8 accumulator layout (rows g and g + 8).
#include "arch/math.cuh"

namespace trisparse::cuda {

constexpr float kNegInf = -__builtin_huge_valf();

/// The maximum to subtract from a row's scores: an empty row (-inf) uses 0, so that its weights
/// stay exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
__device__ __forceinline__ float safe_max(float m) { return m == kNegInf ? 0.0f : m; }

/// The natural log-sum-exp of a row from its base-2 softmax state (m = the running maximum of
/// the scores times scale * log2 e, l = the sum of 2^(s - m)): ln 2 (m + log2 l); -inf when empty.
__device__ __forceinline__ float natural_lse(float m, float l) {
  return l > 0.0f ? (m + __log2f(l)) * 0.693147180559945309f : kNegInf;
}

/// O rows g (columns 0, 1 of each fragment) times c0, rows g + 8 (2, 3) times c1.
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N][4], float c0, float c1) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    o[j][0] *= c0;
    o[j][1] *= c0;
    o[j][2] *= c1;
    o[j][3] *= c1;
  }
}

using arch::exp2_approx;

}  // namespace trisparse::cuda
