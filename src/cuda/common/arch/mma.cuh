#pragma once
// Warp-level tensor-core MMA wrappers (sm_80+), named by shape and types: D = A * B + C with A
// row-major and B column-major ("TN"), fp32 accumulators. Fragment layouts are the PTX ISA's
// (lane = 4 * group + thread_in_group).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace trisparse::cuda::arch {

/// m16n8k16, 16-bit A/B (f16 or bf16), f32 C/D. a: 4 regs, b: 2 regs, c: 4 floats.
template <class T>
__device__ __forceinline__ void mma_16x8x16_f32(float (&c)[4], const std::uint32_t (&a)[4],
                                                const std::uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16x8x16_f32<__half>(float (&c)[4], const std::uint32_t (&a)[4],
                                                        const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16x8x16_f32<__nv_bfloat16>(float (&c)[4],
                                                               const std::uint32_t (&a)[4],
                                                               const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// m16n8k8, 16-bit A/B, f32 C/D. a: 2 regs, b: 1 reg, c: 4 floats.
template <class T>
__device__ __forceinline__ void mma_16x8x8_f32(float (&c)[4], const std::uint32_t (&a)[2],
                                               std::uint32_t b);

template <>
__device__ __forceinline__ void mma_16x8x8_f32<__half>(float (&c)[4], const std::uint32_t (&a)[2],
                                                       std::uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

template <>
__device__ __forceinline__ void mma_16x8x8_f32<__nv_bfloat16>(float (&c)[4],
                                                              const std::uint32_t (&a)[2],
                                                              std::uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

/// m16n8k8, tf32 A/B (fp32 bit patterns rounded by to_tf32), f32 C/D. a: 4 regs, b: 2 regs.
__device__ __forceinline__ void mma_16x8x8_f32_tf32(float (&c)[4], const std::uint32_t (&a)[4],
                                                    const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// m16n8k32, s8 A/B (four values a register, in k order), s32 C/D: exact. a: 4 regs (rows g,
/// g + 8 at k 4t.., then at k 16 + 4t..), b: 2 regs (k 4t.., 16 + 4t.. of column g).
__device__ __forceinline__ void mma_16x8x32_s32_s8(int (&c)[4], const std::uint32_t (&a)[4],
                                                   const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// fp32 -> tf32 (round to nearest, ties away), as the register the tf32 MMA reads.
__device__ __forceinline__ std::uint32_t to_tf32(float x) {
  std::uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

/// x with the low 13 mantissa bits cleared: a tf32 value, and x - tf32_high(x) is exact (the MMA
/// then reads that remainder to tf32 precision: x to about 2^-21 relative).
__device__ __forceinline__ float tf32_high(float x) {
  return __uint_as_float(__float_as_uint(x) & 0xffffe000u);
}

/// Two floats -> one register of two 16-bit values (lo in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

/// One register of two 16-bit values -> two floats (x the low half): pack2's inverse.
template <class T>
__device__ __forceinline__ float2 unpack2(std::uint32_t r);
template <>
__device__ __forceinline__ float2 unpack2<__half>(std::uint32_t r) {
  return __half22float2(*reinterpret_cast<const __half2*>(&r));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(std::uint32_t r) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r));
}

/// The 16-bit halves of two registers: (lo of a, lo of b) and (hi of a, hi of b).
__device__ __forceinline__ std::uint32_t interleave_lo(std::uint32_t a, std::uint32_t b) {
  return __byte_perm(a, b, 0x5410);
}
__device__ __forceinline__ std::uint32_t interleave_hi(std::uint32_t a, std::uint32_t b) {
  return __byte_perm(a, b, 0x7632);
}

}  // namespace trisparse::cuda::arch
