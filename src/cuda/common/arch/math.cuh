#pragma once
// Arithmetic as the PTX ISA defines it, where CUDA C++ has no exact equivalent: the MUFU
// exponential and a subtract that counts borrows.
#include <cstdint>

namespace trisparse::cuda::arch {

/// 2^x for x <= 0 or -inf (MUFU.EX2, flushing subnormal results to zero).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// n -= (k < x) as one borrow chain (sub.cc, subc): two instructions, no compare or select.
__device__ __forceinline__ void count_borrow(unsigned& n, unsigned k, unsigned x) {
  asm("{\n .reg .u32 d;\n sub.cc.u32 d, %1, %2;\n subc.u32 %0, %0, 0;\n}"
      : "+r"(n)
      : "r"(k), "r"(x));
}

}  // namespace trisparse::cuda::arch
