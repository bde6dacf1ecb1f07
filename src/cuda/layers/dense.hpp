#pragma once
// Dense helpers of the GNN layers on CUDA (host interface, no CUDA headers: ops/ includes it).
#include <cstddef>

#include "../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"

namespace trisparse::cuda {

/// Bytes of workspace that gemm() hands cuBLAS (so that it allocates nothing itself).
inline constexpr std::size_t kGemmWorkspaceBytes = std::size_t{4} << 20;

/// c = op(a) op(b) for row-major views on the GPU, op(t) = t or (with trans_*) its transpose:
/// op(a) [m, k], op(b) [k, n], c [m, 1, n] (so a is [m, 1, k], or [k, 1, m] with trans_a). a and b
/// one dtype (f16, bf16, or f32 computed in tf32), fp32 accumulation, c f32 or a's dtype.
/// Asynchronous, on the calling thread's cuBLAS handle for the current device (one per thread: no
/// lock), with `workspace` (kGemmWorkspaceBytes) as cuBLAS's. @throws invalid_input for other
/// shapes, dtypes or layouts.
TRISPARSE_CUDA_ENTRY(void gemm(const tensor_view& a, const tensor_view& b, const tensor_view& c,
                               const workspace_view& workspace, stream_ref stream,
                               bool trans_a = false, bool trans_b = false))

/// Checks that t is a [rows, 1, cols] view on the GPU whose rows do not overlap.
/// @throws invalid_input naming `what`.
TRISPARSE_CUDA_ENTRY(void check_device_matrix(const tensor_view& t, const char* what,
                                              std::int64_t rows, std::int64_t cols))

/// out[i] = x[i] / ||x[i]||_2 (0 for a zero row), [N, 1, F] in x's dtype, computed in fp32.
TRISPARSE_CUDA_ENTRY(void normalize_rows(const tensor_view& x, const tensor_view& out,
                                         stream_ref stream))

}  // namespace trisparse::cuda
