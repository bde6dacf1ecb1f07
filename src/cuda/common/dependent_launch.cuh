#pragma once
// Programmatic dependent launch (sm_90, PTX griddepcontrol). A kernel launched as a dependent of
// the kernel before it in its stream may be placed on the SMs while that one still runs, as soon
// as each of that one's blocks has called launch_dependents() or exited. The dependent must call
// wait_for_primary() before it reads anything the kernel before wrote, or writes anything that
// one reads: the wait returns once that grid has completed and its writes are visible. Where no
// kernel before it triggers early, a dependent launch starts as a stream-ordered one would.
#include <cuda_runtime.h>

#include <cstddef>

#include "error.cuh"

namespace trisparse::cuda::arch {

/// Lets the dependent launch of the next kernel be placed once every block of this grid has
/// called it (no-op before sm_90).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Waits until the grids this one depends on have completed and their writes are visible (no-op
/// before sm_90, where launches are never dependent).
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Whether `kernel`, as loaded for the current device, was compiled from PTX for sm_90 or later,
/// so that its wait_for_primary() is a real wait and it may be launched as a dependent. (Checked
/// on the function, not the device: PTX for an older target, compiled by the driver for an sm_90
/// device, has no wait.)
template <class... P>
bool waits_for_primary(void (*kernel)(P...)) {
  cudaFuncAttributes a{};
  TRISPARSE_CUDA_TRY(cudaFuncGetAttributes(&a, kernel));
  return a.ptxVersion >= 90;
}

/// kernel<<<grid, block, shared_bytes, s>>>(args...), as a programmatic dependent of the kernel
/// before it in s where `dependent` (which needs waits_for_primary(kernel)).
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t s,
            bool dependent, const A&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = s;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  TRISPARSE_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, args...));
}

}  // namespace trisparse::cuda::arch
