#pragma once
// The CUDA kernels of the per-head products (internal; the public interface and its checks:
// include/trisparse/ops/head_product.hpp, src/ops/head_product.cpp).
#include "../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse::cuda {

/// head_product on the device (checked f32 views, widths at most kHeadProductMaxWidth, N H > 0).
TRISPARSE_CUDA_ENTRY(void head_product(const tensor_view& x, const tensor_view& w,
                                       const tensor_view& out, stream_ref stream))

/// head_outer on the device (checked views; `partials`: head_outer_workspace_bytes).
TRISPARSE_CUDA_ENTRY(void head_outer(const tensor_view& x, const tensor_view& g,
                                     const tensor_view& dw, float* partials, stream_ref stream))

}  // namespace trisparse::cuda
