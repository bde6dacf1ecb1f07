// The fused GCN layer on CUDA: the format on the device, the argument checks and the launches
// of kernel.cuh (the design is there).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../../common/arch/mma.cuh"
#include "../../common/buffer.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/grid.cuh"
#include "../dense.hpp"
#include "kernel.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

struct gcn_fused_device {
  std::int64_t rows = 0, windows = 0, chunks = 0;
  device_buffer<std::int64_t> tcb_offset, value_offset;
  device_buffer<std::int32_t> col_idx, order, split_first, split_count;
  device_buffer<std::uint64_t> bitmap;
  device_buffer<float> values;
  device_buffer<gcn_chunk> chunk_list;
};

namespace {

using namespace gcn_fused_kernels;
using namespace gcn_fused_tuning;

bool aligned(const void* p, std::int64_t row, std::size_t elem, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0 && (row * elem) % bytes == 0;
}

void check_bias(const tensor_view& bias, const tensor_view& x, std::int64_t f_out) {
  if (bias.data == nullptr) return;
  check_device_matrix(bias, "bias", 1, f_out);
  TRISPARSE_EXPECTS_INPUT(bias.type == dtype::f32 || bias.type == x.type,
                          "bias " + bias.describe() + " must be f32 or x's dtype");
}

}  // namespace

std::shared_ptr<const gcn_fused_device> upload_gcn_fused(const gcn_fused_host& h,
                                                         stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  auto d = std::make_shared<gcn_fused_device>();
  d->rows = h.format.rows;
  d->windows = h.format.windows();
  d->chunks = static_cast<std::int64_t>(h.chunks.size());
  d->tcb_offset = device_buffer<std::int64_t>(h.format.tcb_offset, s);
  d->col_idx = device_buffer<std::int32_t>(h.format.col_idx, s);
  d->bitmap = device_buffer<std::uint64_t>(h.format.bitmap, s);
  d->order = device_buffer<std::int32_t>(h.format.window_order, s);
  d->value_offset = device_buffer<std::int64_t>(h.value_offset, s);
  d->values = device_buffer<float>(h.values, s);
  d->split_first = device_buffer<std::int32_t>(h.split_first, s);
  d->split_count = device_buffer<std::int32_t>(h.split_count, s);
  d->chunk_list = device_buffer<gcn_chunk>(h.chunks, s);
  return d;
}

bool gcn_fused_fits(std::int64_t in_dim, dtype type) {
  if (in_dim < 0 || in_dim > (std::int64_t{1} << 20)) return false;
  return (type == dtype::f32 ? stage_bytes<float>(in_dim) : stage_bytes<__half>(in_dim)) +
             group_bytes(in_dim) <=
         static_cast<std::size_t>(kMaxSmem);
}

std::size_t gcn_fused_workspace_bytes(const gcn_fused_device& d, std::int64_t in_dim) {
  return static_cast<std::size_t>(d.chunks) * 16 * static_cast<std::size_t>(in_dim) * 4;
}

void gcn_fused_forward(const gcn_fused_device& d, const tensor_view& x, const tensor_view& w,
                       const tensor_view& bias, bool relu, const tensor_view& out,
                       std::uint32_t* relu_mask, const tensor_view& ax,
                       const workspace_view& workspace, stream_ref stream) {
  const std::int64_t f_in = x.dim, f_out = w.dim;
  check_device_matrix(x, "x", d.rows, f_in);
  check_device_matrix(w, "w", f_in, f_out);
  check_device_matrix(out, "out", d.rows, f_out);
  check_bias(bias, x, f_out);
  if (ax.data != nullptr) {
    check_device_matrix(ax, "ax", d.rows, f_in);
    TRISPARSE_EXPECTS_INPUT(ax.type == x.type, "ax " + ax.describe() + " needs x's dtype");
  }
  TRISPARSE_EXPECTS_INPUT(x.type == w.type,
                          "x " + x.describe() + " and w " + w.describe() + " need one dtype");
  TRISPARSE_EXPECTS_INPUT(gcn_fused_fits(f_in, x.type),
                          "the fused GCN kernel holds 16 rows of (Â x) in shared memory: " +
                              std::to_string(f_in) + " features do not fit");
  TRISPARSE_EXPECTS_INPUT(f_out < (std::int64_t{1} << 30), "F_out must be below 2^30");
  const std::size_t need = gcn_fused_workspace_bytes(d, f_in);
  TRISPARSE_EXPECTS_INPUT(workspace.bytes >= need && (need == 0 || workspace.data != nullptr),
                          "the fused GCN layer needs " + std::to_string(need) +
                              " bytes of workspace, got " + std::to_string(workspace.bytes));
  if (d.rows == 0 || f_out == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(x.type, "x", [&]<class T>() {
    const format_args f{d.tcb_offset.data(),   d.col_idx.data(), d.bitmap.data(),
                        d.value_offset.data(), d.values.data(),  d.rows};
    const std::size_t frag_bytes = kTiles * sizeof(T);
    const dense_args in{x.data, x.row_stride, static_cast<int>(f_in),
                        aligned(x.data, x.row_stride, sizeof(T), frag_bytes)};
    float* partial = static_cast<float*>(workspace.data);
    if (d.chunks > 0 && f_in > 0) {
      partial_kernel<T><<<static_cast<unsigned>(d.chunks), kWarps * 32, group_bytes(f_in), s>>>(
          partial_args{f, in, d.chunk_list.data(), partial});
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
    with_output_type<T>(out.type, "out", [&]<class O>() {
      fused_args a{};
      a.f = f;
      a.in = in;
      a.order = d.order.data();
      a.split_first = d.chunks > 0 ? d.split_first.data() : nullptr;
      a.split_count = d.split_count.data();
      a.partial = partial;
      a.w = w.data;
      a.w_row = w.row_stride;
      a.f_out = static_cast<int>(f_out);
      a.w_vec = aligned(w.data, w.row_stride, sizeof(T), frag_bytes);
      a.bias = bias.data;
      a.bias_f32 = bias.type == dtype::f32;
      a.relu = relu;
      a.out = out.data;
      a.out_row = out.row_stride;
      a.out_vec = aligned(out.data, out.row_stride, sizeof(O), 16);
      a.mask = relu_mask;
      a.mask_words = static_cast<int>((f_out + 31) / 32);
      a.ax = ax.data;
      a.ax_row = ax.row_stride;
      a.stride = stage_stride<T>(f_in);
      a.stage_bytes = static_cast<int>(stage_bytes<T>(f_in));
      const std::size_t smem = stage_bytes<T>(f_in) + group_bytes(f_in);
      auto kernel = fused_kernel<T, O>;
      if (smem > 48 * 1024) {
        TRISPARSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)));
      }
      kernel<<<static_cast<unsigned>(d.windows), kWarps * 32, smem, s>>>(a);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    });
  });
}

void relu_grad(const tensor_view& dout, const std::uint32_t* relu_mask, const tensor_view& dz,
               const tensor_view& dbias, const workspace_view& workspace, stream_ref stream) {
  check_device_matrix(dout, "dout", dout.rows, dout.dim);
  check_device_matrix(dz, "dz", dout.rows, dout.dim);
  TRISPARSE_EXPECTS_INPUT(dout.type == dtype::f32 || dout.type == dz.type,
                          "dout " + dout.describe() + " must be f32 or the layer's dtype");
  if (dbias.data != nullptr) {
    check_device_matrix(dbias, "dbias", 1, dout.dim);
    TRISPARSE_EXPECTS_INPUT(dbias.type == dtype::f32 || dbias.type == dz.type,
                            "dbias " + dbias.describe() + " must be f32 or the layer's dtype");
    TRISPARSE_EXPECTS_INPUT(workspace.bytes >= relu_grad_workspace_bytes(dout.rows, dout.dim),
                            "relu_grad: workspace too small");
  }
  if (dout.dim == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t blocks = (dout.rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock;
  float* sums = dbias.data != nullptr ? static_cast<float*>(workspace.data) : nullptr;
  with_element_type(dz.type, "dz", [&]<class T>() {
    const int words = static_cast<int>((dout.dim + 31) / 32);
    if (dout.rows > 0) {
      const dim3 grid(static_cast<unsigned>(words), static_cast<unsigned>(blocks));
      const auto launch = [&]<class I>() {
        relu_grad_kernel<I, T><<<grid, 256, 0, s>>>(
            static_cast<const I*>(dout.data), dout.row_stride, relu_mask, words,
            static_cast<T*>(dz.data), dz.row_stride, sums, dout.rows, static_cast<int>(dout.dim));
      };
      if (dout.type == dtype::f32)
        launch.template operator()<float>();
      else
        launch.template operator()<T>();
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
    if (dbias.data == nullptr) return;
    with_output_type<T>(dbias.type, "dbias", [&]<class B>() {
      add_sums_kernel<B><<<blocks_for(dout.dim, 128), 128, 0, s>>>(
          sums, blocks, static_cast<int>(dout.dim), static_cast<B*>(dbias.data));
      TRISPARSE_CUDA_CHECK_LAUNCH();
    });
  });
}

void bias_relu_mask(const tensor_view& z, const tensor_view& bias, bool relu,
                    const tensor_view& out, std::uint32_t* relu_mask, stream_ref stream) {
  check_device_matrix(z, "z", z.rows, z.dim);
  check_device_matrix(out, "out", z.rows, z.dim);
  TRISPARSE_EXPECTS_INPUT(z.type == dtype::f32, "z " + z.describe() + " must be f32");
  if (z.rows == 0 || z.dim == 0) return;
  const int words = static_cast<int>((z.dim + 31) / 32);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(out.type, "out", [&]<class O>() {
    if (bias.data != nullptr) {
      check_device_matrix(bias, "bias", 1, z.dim);
      TRISPARSE_EXPECTS_INPUT(bias.type != dtype::f64,
                              "bias " + bias.describe() + " must be f32, f16 or bf16");
    }
    bias_relu_kernel<O><<<blocks_for(z.rows * words * 32, 256), 256, 0, s>>>(
        static_cast<const float*>(z.data), z.row_stride, bias.data, bias.type, relu,
        static_cast<O*>(out.data), out.row_stride, relu_mask, words, z.rows,
        static_cast<int>(z.dim));
    TRISPARSE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace trisparse::cuda
