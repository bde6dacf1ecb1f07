#pragma once
// Asynchronous global -> shared copies and shared -> register matrix loads (sm_80+), as the PTX
// ISA defines cp.async and ldmatrix, and an in-place XOR of shared memory.
#include <cstdint>

namespace trisparse::cuda::arch {

/// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16 bytes of global memory read once, through the non-coherent path and not kept in L1.
__device__ __forceinline__ uint4 load_streaming(const void* at) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(at));
  return v;
}

/// Copies 16 bytes from global `src` to shared `dst` asynchronously; with valid = false writes
/// 16 zero bytes and reads nothing (src may then be any address).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

/// Copies 4 bytes from global `src` to shared `dst` asynchronously (through L1); with valid =
/// false writes 4 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_4(std::uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/// Four 8x8 16-bit matrices; lane l gives the address of row l % 8 of matrix l / 8, and receives
/// in r[i] row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// The same, transposed: r[i] holds rows 2 (l % 4) and 2 (l % 4) + 1, column l / 4 of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// XORs each 32-bit word of the 16 bytes at shared address `address` with `mask`, in place.
__device__ __forceinline__ void xor_shared_16(std::uint32_t address, std::uint32_t mask) {
  std::uint32_t w[4];
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(address)
               : "memory");
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(address), "r"(w[0] ^ mask),
               "r"(w[1] ^ mask), "r"(w[2] ^ mask), "r"(w[3] ^ mask)
               : "memory");
}

}  // namespace trisparse::cuda::arch
