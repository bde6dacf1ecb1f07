// The CUDA attention backward (plan.hpp): a row pass (dq, D and the log-sum-exp) and a column
// pass over the transposed pattern (dk, dv), one warp per (row, head), fp32 accumulation.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "../../../common/workspace_layout.hpp"
#include "../../common/buffer.cuh"
#include "../../common/convert.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "plan.hpp"

namespace trisparse::cuda {

struct attention_backward_device_plan {
  std::int64_t rows = 0, cols = 0, nnz = 0;
  device_buffer<std::int64_t> row_ptr, t_row_ptr;  // A's and A^T's offsets
  device_buffer<std::int32_t> col_idx, t_col_idx;  // A's columns, A^T's columns (rows of A)
};

namespace {

constexpr int kWarps = 4;      // warps per thread block, one (row, head) each
constexpr int kMaxChunks = 8;  // head dims up to 8 x 32 = 256 elements per lane group

// A [rows, heads, dim] view as the kernels read it: element (r, h, d) at r*rs + h*hs + d.
template <class T>
struct view {
  T* data;
  std::int64_t rs, hs;
  int dim;
  __device__ T* at(std::int64_t r, std::int64_t h) const { return data + r * rs + h * hs; }
};

template <class T>
view<T> view_of(const tensor_view& t) {
  return {static_cast<T*>(t.data), t.row_stride, t.head_stride, static_cast<int>(t.dim)};
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// This lane's elements lane, lane + 32, ... of a row, as floats (0 past dim).
template <class T>
__device__ __forceinline__ void load(const T* row, int dim, int lane, float (&x)[kMaxChunks]) {
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const int d = lane + 32 * c;
    x[c] = d < dim ? convert<float>(row[d]) : 0.0f;
  }
}

template <class T>
__device__ __forceinline__ void store(T* row, int dim, int lane, const float (&x)[kMaxChunks],
                                      float factor) {
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const int d = lane + 32 * c;
    if (d < dim) row[d] = convert<T>(x[c] * factor);
  }
}

// <x, row> over the warp: x holds this lane's elements of the other operand.
template <class T>
__device__ __forceinline__ float dot(const float (&x)[kMaxChunks], const T* row, int dim,
                                     int lane) {
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const int d = lane + 32 * c;
    if (d < dim) s += x[c] * convert<float>(row[d]);
  }
  return warp_sum(s);
}

struct row_terms {
  float* lse;    // [rows * heads]: the given or recomputed log-sum-exp
  float* delta;  // [rows * heads]: D = <dout, out>
};

// One warp per (row i, head h): D_i, the log-sum-exp if not given, and
// dq_i = scale sum_j P_ij (dout_i . v_j - D_i) k_j over row i's entries.
template <class T, class O, class G>
__global__ void __launch_bounds__(kWarps * 32)
    row_pass(const std::int64_t* __restrict__ row_ptr, const std::int32_t* __restrict__ col_idx,
             std::int64_t rows, int heads, view<const T> q, view<const T> k, view<const T> v,
             view<const O> out, view<const O> dout, const float* __restrict__ lse_in,
             std::int64_t lse_rs, std::int64_t lse_hs, row_terms terms, view<G> dq, float scale) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= rows * heads) return;
  const std::int64_t i = item / heads;
  const int h = static_cast<int>(item % heads);
  float qi[kMaxChunks], gi[kMaxChunks], acc[kMaxChunks];
  load(q.at(i, h), q.dim, lane, qi);
  load(dout.at(i, h), dout.dim, lane, gi);
  const float delta = dot(gi, out.at(i, h), out.dim, lane);
  const std::int64_t begin = row_ptr[i], end = row_ptr[i + 1];
  float lse;
  if (lse_in != nullptr) {
    lse = lse_in[i * lse_rs + h * lse_hs];
  } else {
    float m = -INFINITY, l = 0.0f;
    for (std::int64_t e = begin; e < end; ++e) {
      const float s = scale * dot(qi, k.at(col_idx[e], h), k.dim, lane);
      const float m2 = fmaxf(m, s);
      l = l * expf(m - m2) + expf(s - m2);
      m = m2;
    }
    lse = end > begin ? m + logf(l) : -INFINITY;
  }
  if (lane == 0) {
    terms.lse[item] = lse;
    terms.delta[item] = delta;
  }
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) acc[c] = 0.0f;
  for (std::int64_t e = begin; e < end; ++e) {
    const std::int64_t j = col_idx[e];
    const T* kj = k.at(j, h);
    const float p = expf(scale * dot(qi, kj, k.dim, lane) - lse);
    const float ds = p * (dot(gi, v.at(j, h), v.dim, lane) - delta);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int d = lane + 32 * c;
      if (d < k.dim) acc[c] += ds * convert<float>(kj[d]);
    }
  }
  store(dq.at(i, h), dq.dim, lane, acc, scale);
}

// One warp per (key j, head h), over row j of the transpose (the queries i that attend j):
// dk_j = scale sum_i dS_ij q_i and dv_j = sum_i P_ij dout_i.
template <class T, class O, class G>
__global__ void __launch_bounds__(kWarps * 32)
    column_pass(const std::int64_t* __restrict__ t_row_ptr,
                const std::int32_t* __restrict__ t_col_idx, std::int64_t cols, int heads,
                view<const T> q, view<const T> k, view<const T> v, view<const O> dout,
                row_terms terms, view<G> dk, view<G> dv, float scale) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= cols * heads) return;
  const std::int64_t j = item / heads;
  const int h = static_cast<int>(item % heads);
  float kj[kMaxChunks], vj[kMaxChunks], dk_acc[kMaxChunks], dv_acc[kMaxChunks];
  load(k.at(j, h), k.dim, lane, kj);
  load(v.at(j, h), v.dim, lane, vj);
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) dk_acc[c] = dv_acc[c] = 0.0f;
  for (std::int64_t e = t_row_ptr[j]; e < t_row_ptr[j + 1]; ++e) {
    const std::int64_t i = t_col_idx[e];
    const T* qi = q.at(i, h);
    const O* gi = dout.at(i, h);
    const std::int64_t r = i * heads + h;
    const float p = expf(scale * dot(kj, qi, q.dim, lane) - terms.lse[r]);
    const float ds = p * (dot(vj, gi, dout.dim, lane) - terms.delta[r]);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      const int d = lane + 32 * c;
      if (d < q.dim) dk_acc[c] += ds * convert<float>(qi[d]);
      if (d < dout.dim) dv_acc[c] += p * convert<float>(gi[d]);
    }
  }
  store(dk.at(j, h), dk.dim, lane, dk_acc, scale);
  store(dv.at(j, h), dv.dim, lane, dv_acc, 1.0f);
}

struct workspace_segments {
  detail::workspace_layout layout;
  std::size_t lse = 0, delta = 0;
};

workspace_segments segments(const attention_backward_device_plan& plan, std::int64_t heads) {
  workspace_segments w;
  const auto n = static_cast<std::size_t>(plan.rows * heads) * sizeof(float);
  w.lse = w.layout.add(n);
  w.delta = w.layout.add(n);
  return w;
}

unsigned grid_of(std::int64_t items) {
  return static_cast<unsigned>((items + kWarps - 1) / kWarps);
}

}  // namespace

std::shared_ptr<attention_backward_device_plan> make_attention_backward_plan(
    const csr_graph& pattern, const csr_graph& transposed, stream_ref stream) {
  TRISPARSE_EXPECTS_INPUT(transposed.rows == pattern.cols && transposed.cols == pattern.rows &&
                              transposed.nnz() == pattern.nnz(),
                          "the transposed pattern does not match the pattern");
  auto p = std::make_shared<attention_backward_device_plan>();
  p->rows = pattern.rows;
  p->cols = pattern.cols;
  p->nnz = pattern.nnz();
  p->row_ptr = device_buffer<std::int64_t>(pattern.row_ptr);
  p->col_idx = device_buffer<std::int32_t>(pattern.col_idx);
  p->t_row_ptr = device_buffer<std::int64_t>(transposed.row_ptr);
  p->t_col_idx = device_buffer<std::int32_t>(transposed.col_idx);
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  return p;
}

std::size_t attention_backward_workspace_bytes(const attention_backward_device_plan& plan,
                                               std::int64_t heads) {
  return segments(plan, heads).layout.bytes();
}

void run_attention_backward(const attention_backward_device_plan& plan, const tensor_view& q,
                            const tensor_view& k, const tensor_view& v, const tensor_view& out,
                            const tensor_view& lse, const tensor_view& dout, const tensor_view& dq,
                            const tensor_view& dk, const tensor_view& dv, double scale,
                            const workspace_view& workspace, stream_ref stream) {
  TRISPARSE_EXPECTS_INPUT(q.dim <= 32 * kMaxChunks && v.dim <= 32 * kMaxChunks,
                          "the CUDA attention backward takes head dims up to " +
                              std::to_string(32 * kMaxChunks) + ", not " +
                              std::to_string(std::max(q.dim, v.dim)));
  TRISPARSE_EXPECTS_INPUT(k.type == q.type && v.type == q.type, "q, k and v must have one dtype");
  TRISPARSE_EXPECTS_INPUT(dout.type == out.type, "dout must have out's dtype");
  TRISPARSE_EXPECTS_INPUT(dk.type == dq.type && dv.type == dq.type,
                          "dq, dk and dv must have one dtype");
  TRISPARSE_EXPECTS_INPUT(lse.data == nullptr || lse.type == dtype::f32,
                          "the CUDA backward takes the log-sum-exp as f32");
  const workspace_segments w = segments(plan, q.heads);
  w.layout.check(workspace, "attention backward");
  const row_terms terms{detail::workspace_layout::at<float>(workspace, w.lse),
                        detail::workspace_layout::at<float>(workspace, w.delta)};
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const auto heads = static_cast<int>(q.heads);
  const auto fscale = static_cast<float>(scale);
  with_element_type(q.type, "attention backward (q, k, v)", [&]<class T>() {
    with_output_type<T>(out.type, "attention backward (out, dout)", [&]<class O>() {
      with_output_type<T>(dq.type, "attention backward (dq, dk, dv)", [&]<class G>() {
        if (plan.rows * q.heads > 0) {
          row_pass<T, O, G><<<grid_of(plan.rows * q.heads), kWarps * 32, 0, s>>>(
              plan.row_ptr.data(), plan.col_idx.data(), plan.rows, heads, view_of<const T>(q),
              view_of<const T>(k), view_of<const T>(v), view_of<const O>(out),
              view_of<const O>(dout), static_cast<const float*>(lse.data), lse.row_stride,
              lse.head_stride, terms, view_of<G>(dq), fscale);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
        if (plan.cols * q.heads > 0) {
          column_pass<T, O, G><<<grid_of(plan.cols * q.heads), kWarps * 32, 0, s>>>(
              plan.t_row_ptr.data(), plan.t_col_idx.data(), plan.cols, heads, view_of<const T>(q),
              view_of<const T>(k), view_of<const T>(v), view_of<const O>(dout), terms,
              view_of<G>(dk), view_of<G>(dv), fscale);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
      });
    });
  });
}

std::int64_t device_bytes(const attention_backward_device_plan& plan) {
  return static_cast<std::int64_t>(plan.row_ptr.bytes() + plan.col_idx.bytes() +
                                   plan.t_row_ptr.bytes() + plan.t_col_idx.bytes());
}

}  // namespace trisparse::cuda
