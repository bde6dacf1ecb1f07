// The per-head products on the device (head_product.hpp): the kernels of kernel.cuh on the
// caller's stream.
#include <string>

#include "../../common/current_device.cuh"
#include "../../common/error.cuh"
#include "head_product.hpp"
#include "kernel.cuh"

namespace trisparse::cuda {

namespace {

using namespace head_product_kernels;

operand operand_of(const tensor_view& t) {
  return {static_cast<const float*>(t.data), t.row_stride, t.head_stride};
}
result result_of(const tensor_view& t) {
  return {static_cast<float*>(t.data), t.row_stride, t.head_stride};
}

// Whether t's rows of `width` floats move in 16-byte pieces.
bool vector_rows(const tensor_view& t, std::int64_t width) {
  return width % 4 == 0 && t.row_stride % 4 == 0 && t.head_stride % 4 == 0 &&
         reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
}

void check_grid(std::int64_t y, const char* op) {
  if (y > 65535)
    throw not_supported(std::string(op) + ": too many heads for one launch (" + std::to_string(y) +
                        " head groups, CUDA takes 65535)");
}

}  // namespace

void head_product(const tensor_view& x, const tensor_view& w, const tensor_view& out,
                  stream_ref stream) {
  expect_current_device(x.device_id, "head_product: x");
  const std::int64_t groups = (x.heads + kProductWarps - 1) / kProductWarps;
  check_grid(groups, "head_product");
  const auto a = static_cast<int>(x.dim), b = static_cast<int>(w.dim),
             heads = static_cast<int>(x.heads);
  const dim3 grid(static_cast<unsigned>((x.rows + 31) / 32), static_cast<unsigned>(groups));
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const bool vec = vector_rows(x, a) && vector_rows(out, b);
  const auto launch = [&]<int M>() {
    if (vec)
      product<M, true><<<grid, kProductWarps * 32, 0, s>>>(operand_of(x), operand_of(w),
                                                           result_of(out), x.rows, heads, a, b);
    else
      product<M, false><<<grid, kProductWarps * 32, 0, s>>>(operand_of(x), operand_of(w),
                                                            result_of(out), x.rows, heads, a, b);
  };
  const int widest = a > b ? a : b;
  // Heads side by side in x and out: whole rows through shared memory (product_staged).
  const bool staged = vec && widest <= 16 && x.head_stride == a && out.head_stride == b;
  if (staged && widest <= 8)
    product_staged<8><<<grid, kProductWarps * 32, 0, s>>>(operand_of(x), operand_of(w),
                                                          result_of(out), x.rows, heads, a, b);
  else if (staged)
    product_staged<16><<<grid, kProductWarps * 32, 0, s>>>(operand_of(x), operand_of(w),
                                                           result_of(out), x.rows, heads, a, b);
  else if (widest <= 8)
    launch.template operator()<8>();
  else if (widest <= 16)
    launch.template operator()<16>();
  else
    launch.template operator()<32>();
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

void head_outer(const tensor_view& x, const tensor_view& g, const tensor_view& dw, float* partials,
                stream_ref stream) {
  expect_current_device(x.device_id, "head_outer: x");
  const auto a = static_cast<int>(x.dim), b = static_cast<int>(g.dim),
             heads = static_cast<int>(x.heads);
  const int group = outer_group(heads, a, b);
  const std::int64_t groups = (heads + group - 1) / group;
  check_grid(groups, "head_outer");
  const std::int64_t chunks = (x.rows + kHeadOuterChunkRows - 1) / kHeadOuterChunkRows;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (chunks > 0) {
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(groups));
    const auto launch = [&]<int JB>() {
      outer<JB><<<grid, kOuterThreads, 0, s>>>(operand_of(x), operand_of(g), x.rows, heads, a, b,
                                               group, partials);
    };
    const int jb = outer_block(b);
    if (jb == 8)
      launch.template operator()<8>();
    else if (jb == 4)
      launch.template operator()<4>();
    else
      launch.template operator()<1>();
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  const std::int64_t outputs = static_cast<std::int64_t>(heads) * a * b;
  sum_chunks<<<static_cast<unsigned>((outputs + 31) / 32), kSumWarps * 32, 0, s>>>(
      partials, chunks, heads, a, b, result_of(dw));
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

}  // namespace trisparse::cuda
