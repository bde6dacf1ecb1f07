// cuBLAS products and the row normalisation of the GNN layers (dense.hpp).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <unordered_map>

#include "../common/dispatch.cuh"
#include "../common/error.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "dense.hpp"

namespace trisparse::cuda {

namespace {

void blas_try(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw cuda_error(std::string("cuBLAS ") + what + " failed with status " +
                     std::to_string(static_cast<int>(status)));
  }
}

cudaDataType_t blas_type(dtype t) {
  switch (t) {
    case dtype::f16:
      return CUDA_R_16F;
    case dtype::bf16:
      return CUDA_R_16BF;
    case dtype::f32:
      return CUDA_R_32F;
    case dtype::f64:
      throw not_supported(
          "the dense products take f16, bf16 or f32, not f64 (float64 runs on "
          "the CPU)");
    default:
      throw invalid_input("the dense products take f16, bf16 or f32, not " +
                          std::string(to_string(t)));
  }
}

constexpr int kWarps = 8;

template <class T>
__global__ void normalize_kernel(const T* x, std::int64_t x_row, T* out, std::int64_t out_row,
                                 std::int64_t rows, std::int64_t dim) {
  const std::int64_t r = blockIdx.x * std::int64_t{kWarps} + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (r >= rows) return;
  const T* xr = x + r * x_row;
  float sum = 0.0f;
  for (std::int64_t f = lane; f < dim; f += 32) {
    const float v = frags::to_float(xr[f]);
    sum += v * v;
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
  const float inv = sum > 0.0f ? rsqrtf(sum) : 0.0f;
  for (std::int64_t f = lane; f < dim; f += 32)
    out[r * out_row + f] = frags::from_float<T>(frags::to_float(xr[f]) * inv);
}

}  // namespace

namespace {

// The calling thread's cuBLAS handles, one per device, created on first use and kept for the
// thread's life (cuBLAS handles must not be shared by threads without a lock). Not destroyed:
// at exit the CUDA context may already be gone.
cublasHandle_t thread_handle() {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  int device = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  cublasHandle_t& h = handles[device];
  if (h == nullptr) blas_try(cublasCreate(&h), "create");
  return h;
}

}  // namespace

void gemm(const tensor_view& a, const tensor_view& b, const tensor_view& c,
          const workspace_view& workspace, stream_ref stream, bool trans_a, bool trans_b) {
  const std::int64_t m = trans_a ? a.dim : a.rows, k = trans_a ? a.rows : a.dim;
  const std::int64_t n = trans_b ? b.rows : b.dim;
  check_device_matrix(a, "a", a.rows, a.dim);
  check_device_matrix(b, "b", trans_b ? n : k, trans_b ? k : n);
  check_device_matrix(c, "c", m, n);
  TRISPARSE_EXPECTS_INPUT(a.type == b.type,
                          "a " + a.describe() + " and b " + b.describe() + " need one dtype");
  TRISPARSE_EXPECTS_INPUT(c.type == dtype::f32 || c.type == a.type,
                          "c " + c.describe() + " must be f32 or a's dtype");
  TRISPARSE_EXPECTS_INPUT(
      m < (std::int64_t{1} << 31) && n < (std::int64_t{1} << 31) && k < (std::int64_t{1} << 31),
      "the dense product's sizes must be below 2^31");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // cuBLAS would leave c alone: an empty sum is 0
    TRISPARSE_CUDA_TRY(cudaMemset2DAsync(
        c.data, static_cast<std::size_t>(std::max<std::int64_t>(c.row_stride, n)) * size_of(c.type),
        0, static_cast<std::size_t>(n) * size_of(c.type), static_cast<std::size_t>(m),
        static_cast<cudaStream_t>(stream.handle)));
    return;
  }
  const cudaDataType_t in = blas_type(a.type), out = blas_type(c.type);
  const cublasComputeType_t compute =
      a.type == dtype::f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const float alpha = 1.0f, beta = 0.0f;
  TRISPARSE_EXPECTS_INPUT(workspace.bytes >= kGemmWorkspaceBytes && workspace.data != nullptr,
                          "the dense product needs " + std::to_string(kGemmWorkspaceBytes) +
                              " bytes of cuBLAS workspace");
  const cublasHandle_t h = thread_handle();
  // SetStream resets the workspace to cuBLAS's own: ours is set after it.
  blas_try(cublasSetStream(h, static_cast<cudaStream_t>(stream.handle)), "set stream");
  blas_try(cublasSetWorkspace(h, workspace.data, kGemmWorkspaceBytes), "set workspace");
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix read
  // column-major is its transpose: so b comes first, transposed by cuBLAS where trans_b.
  blas_try(
      cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b.data,
                   in, static_cast<int>(std::max<std::int64_t>(b.row_stride, b.dim)), a.data, in,
                   static_cast<int>(std::max<std::int64_t>(a.row_stride, a.dim)), &beta, c.data,
                   out, static_cast<int>(std::max<std::int64_t>(c.row_stride, n)), compute,
                   CUBLAS_GEMM_DEFAULT),
      "GemmEx");
}

void check_device_matrix(const tensor_view& t, const char* what, std::int64_t rows,
                         std::int64_t cols) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cuda,
                          std::string(what) + " " + t.describe() + " must be on the GPU");
  check_view(t, what, rows, 1, cols);
  TRISPARSE_EXPECTS_INPUT(
      t.rows <= 1 || t.row_stride >= t.dim,
      std::string(what) + " " + t.describe() + " needs rows at least dim elements apart");
}

void normalize_rows(const tensor_view& x, const tensor_view& out, stream_ref stream) {
  check_device_matrix(x, "x", x.rows, x.dim);
  check_device_matrix(out, "out", x.rows, x.dim);
  TRISPARSE_EXPECTS_INPUT(out.type == x.type, "out " + out.describe() + " needs x's dtype");
  if (x.rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(x.type, "x", [&]<class T>() {
    normalize_kernel<T><<<blocks_for(x.rows, kWarps), kWarps * 32, 0, s>>>(
        static_cast<const T*>(x.data), x.row_stride, static_cast<T*>(out.data), out.row_stride,
        x.rows, x.dim);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace trisparse::cuda
