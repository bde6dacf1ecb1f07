#pragma once
/// @file TRISPARSE_HOST_DEVICE: a small function compiled for the host and, under nvcc, for the
/// device too, so that the CPU loops and the kernels share its arithmetic.

#if defined(__CUDACC__)
#define TRISPARSE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TRISPARSE_HOST_DEVICE inline
#endif
