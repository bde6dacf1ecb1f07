#pragma once
// Dense helpers of the GNN layers on CUDA (host interface, no CUDA headers: ops/ includes it).
#include <memory>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cuda {

/// A cuBLAS handle on the current device (used under its own lock).
struct blas_handle;
std::shared_ptr<blas_handle> make_blas();

/// c = a b for row-major [m, 1, k] x [k, 1, n] -> [m, 1, n] views on the GPU: a and b one dtype
/// (f16, bf16, or f32 computed in tf32), fp32 accumulation, c f32 or a's dtype. Asynchronous.
/// @throws invalid_input for other shapes, dtypes or layouts.
void gemm(const blas_handle& blas, const tensor_view& a, const tensor_view& b, const tensor_view& c,
          stream_ref stream);

/// out[i] = x[i] / ||x[i]||_2 (0 for a zero row), [N, 1, F] in x's dtype, computed in fp32.
void normalize_rows(const tensor_view& x, const tensor_view& out, stream_ref stream);

}  // namespace trisparse::cuda
