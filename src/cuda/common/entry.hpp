#pragma once
// How the CUDA backends' host interfaces declare their entry points (internal). With the backend
// built, TRISPARSE_CUDA_ENTRY(declaration) is the declaration, defined in the backend's .cu files;
// without it, the same declaration becomes an inline definition that throws not_supported. So each
// interface is written once, and a build without nvcc needs no hand-kept mirror of it.
#include "trisparse/core/error.hpp"

namespace trisparse::cuda {

[[noreturn]] inline void no_cuda_backend() {
  throw not_supported(
      "this build has no CUDA backend (configure with TRISPARSE_CUDA=ON where nvcc exists)");
}

}  // namespace trisparse::cuda

#if TRISPARSE_HAVE_CUDA
#define TRISPARSE_CUDA_ENTRY(...) __VA_ARGS__;
#else
#define TRISPARSE_CUDA_ENTRY(...)                                                         \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wunused-parameter\"") \
      [[noreturn]] inline __VA_ARGS__ {                                                   \
    ::trisparse::cuda::no_cuda_backend();                                                 \
  }                                                                                       \
  _Pragma("GCC diagnostic pop")
#endif
