#pragma once
// Warpgroup-level tensor-core MMA (wgmma, sm_90a only) as the PTX ISA defines it: shared-memory
// matrix descriptors, the fence / commit / wait protocol and m64n64k16 with A from registers or
// from shared memory.
// A warpgroup is 4 consecutive warps; warp w of it owns rows 16w..16w+15 of the 64-row tile, and
// its A and accumulator fragments have the layouts of mma.sync m16n8k16 (accumulator element
// 4j + e is the m16n8 fragment element e of columns 8j..8j+7).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace trisparse::cuda::arch {

/// Descriptor of a 16-bit operand tile in shared memory in the 128-byte swizzle layout: rows of
/// 64 values (128 bytes) whose 16-byte chunk c of row r sits at chunk c ^ (r % 8), 8-row groups
/// 1024 bytes apart; the tile must start on a 1024-byte boundary (`start` may sit 32 bytes a k16
/// step into it). K-major: rows are the N (or M) index. N-major (transposed B): rows are the K
/// index; both byte offsets are then 1024 so that the 8-row stride is right whichever of them the
/// hardware takes for it (an N extent of 64 has one atom, so the other is never used).
__device__ __forceinline__ std::uint64_t sw128_descriptor(std::uint32_t start) {
  constexpr std::uint64_t kGroup = 1024 >> 4;
  return std::uint64_t{(start & 0x3FFFF) >> 4} | (kGroup << 16) | (kGroup << 32) |
         (std::uint64_t{1} << 62);
}

/// `descriptor` (sw128_descriptor) moved `bytes` further into its tile: the start field holds the
/// address / 16 in 14 bits and shared addresses stay below 2^18 bytes, so the sum cannot carry
/// into the next field. A loop over k16 steps builds its tiles' descriptors once this way.
__device__ __forceinline__ std::uint64_t sw128_advance(std::uint64_t descriptor,
                                                       std::uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

/// Orders this thread's earlier generic-proxy writes to shared memory (cp.async, st.shared) before
/// later async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/// The executing warpgroup's registers per thread lowered (DEC) or raised to N (sm_90a; every warp
/// of the warpgroup runs it): a producer warpgroup hands registers to the consumers this way.
template <bool DEC, int N>
__device__ __forceinline__ void set_max_registers() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256);
  if constexpr (DEC)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N) : "memory");
  else
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N) : "memory");
}

/// Before the first wgmma of a batch whose accumulator or A registers other code wrote.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/// Waits until at most N committed wgmma groups of this warp are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/// Ties accumulator registers to this point of the program: wgmma writes them asynchronously, so
/// code after wgmma_wait must not be moved above it (nor code before a wgmma below it).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 32 accumulator registers of an m64n64 wgmma: operands %0 .. %31, and their constraints.
#define TRISPARSE_WGMMA_ACCUMULATOR_REGS                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TRISPARSE_WGMMA_ACCUMULATORS(d)                                                           \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// Issues WGMMA(types) with the PTX type pair of T (f16 or bf16 for both operands).
#define TRISPARSE_WGMMA_BY_TYPE(WGMMA)               \
  if constexpr (std::is_same_v<T, __half>) {         \
    WGMMA("f16.f16");                                \
  } else {                                           \
    static_assert(std::is_same_v<T, __nv_bfloat16>); \
    WGMMA("bf16.bf16");                              \
  }

/// d (+)= A * B for a 64x64 tile and k = 16: A (64 x 16) in registers, B (16 x 64) from the
/// descriptor, K-major or (TransB) N-major; accumulate = false ignores d's old values.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], const std::uint32_t (&a)[4],
                                               std::uint64_t b, bool accumulate) {
#define TRISPARSE_WGMMA_64X64X16(TYPES)                                                        \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " " TRISPARSE_WGMMA_ACCUMULATOR_REGS \
      ", {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"                                        \
      : TRISPARSE_WGMMA_ACCUMULATORS(d)                                                        \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TransB),                       \
        "r"(static_cast<int>(accumulate)))
  TRISPARSE_WGMMA_BY_TYPE(TRISPARSE_WGMMA_64X64X16);
#undef TRISPARSE_WGMMA_64X64X16
}

/// d (+)= A * B for a 64x64 tile and k = 16 with both operands from shared memory: A (64 x 16)
/// K-major from descriptor a, B (16 x 64) K-major from descriptor b; accumulate = false ignores
/// d's old values.
template <class T>
__device__ __forceinline__ void wgmma_64x64x16_ss(float (&d)[32], std::uint64_t a, std::uint64_t b,
                                                  bool accumulate) {
#define TRISPARSE_WGMMA_64X64X16_SS(TYPES)                                                     \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " " TRISPARSE_WGMMA_ACCUMULATOR_REGS \
      ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                                        \
      : TRISPARSE_WGMMA_ACCUMULATORS(d)                                                        \
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
  TRISPARSE_WGMMA_BY_TYPE(TRISPARSE_WGMMA_64X64X16_SS);
#undef TRISPARSE_WGMMA_64X64X16_SS
}

#undef TRISPARSE_WGMMA_ACCUMULATORS
#undef TRISPARSE_WGMMA_BY_TYPE
#undef TRISPARSE_WGMMA_ACCUMULATOR_REGS

}  // namespace trisparse::cuda::arch
