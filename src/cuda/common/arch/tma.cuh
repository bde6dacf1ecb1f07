#pragma once
// Tensor-memory-accelerator copies and the shared-memory barriers that count their bytes (sm_90),
// as the PTX ISA defines cp.async.bulk.tensor and mbarrier; named barriers (bar.sync, bar.arrive).
#include <cstdint>

namespace trisparse::cuda::arch {

/// Initialises the barrier at shared address `bar` for `count` arrivals per phase, and makes the
/// initialisation visible to the asynchronous proxy.
__device__ __forceinline__ void mbarrier_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile(
      "mbarrier.init.shared::cta.b64 [%0], %1;\n"
      "fence.mbarrier_init.release.cluster;\n" ::"r"(bar),
      "r"(count)
      : "memory");
}

/// Arrives on the barrier and adds `bytes` to the transaction count its phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

/// Arrives on the barrier (one of the arrivals its phase counts).
__device__ __forceinline__ void mbarrier_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

/// Copies the box at coordinates (c0, c1, c2) of the 3-D tensor map `map` (the address of a
/// __grid_constant__ kernel parameter) to shared address `dst`; completion adds the box's bytes
/// to barrier `bar`'s transaction count. Elements past the tensor's extent arrive as zeros.
__device__ __forceinline__ void tma_load_3d(std::uint32_t dst, const void* map, std::uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

/// Named barrier `id` (1 .. 15; 0 is __syncthreads') for `threads` threads, a multiple of 32:
/// barrier_sync waits until that many have arrived (itself included), barrier_arrive counts
/// this warp without waiting.
__device__ __forceinline__ void barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace trisparse::cuda::arch
