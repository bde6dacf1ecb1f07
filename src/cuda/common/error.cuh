#pragma once
// TRISPARSE_CUDA_TRY: throws cuda_error naming the call, the CUDA error, the file and the line.
#include <cuda_runtime.h>

#include <string>

#include "trisparse/core/error.hpp"

#define TRISPARSE_CUDA_TRY(call)                                                          \
  do {                                                                                    \
    const cudaError_t trisparse_status_ = (call);                                         \
    if (trisparse_status_ != cudaSuccess) {                                               \
      ::trisparse::detail::fail_at<::trisparse::cuda_error>(                              \
          __FILE__, __LINE__,                                                             \
          std::string(#call) + " failed: " + cudaGetErrorName(trisparse_status_) + " (" + \
              cudaGetErrorString(trisparse_status_) + ")");                               \
    }                                                                                     \
  } while (0)

/// After a kernel launch: reports launch-configuration errors without synchronising.
#define TRISPARSE_CUDA_CHECK_LAUNCH() TRISPARSE_CUDA_TRY(cudaPeekAtLastError())
