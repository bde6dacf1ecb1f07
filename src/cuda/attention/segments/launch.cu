// Attention within segments on CUDA: the segments' bounds from the ids, then the block-sparse
// kernels (block_sparse/kernel.cuh, backward.cuh) over segment walks (walk.cuh), all on one
// stream. Tiles of 64 rows (four warps), streamed tiles of 64 (32 for dk/dv at D = 128, whose two
// accumulators leave no room for more).
#include <thrust/binary_search.h>
#include <thrust/execution_policy.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "../../common/current_device.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../block_sparse/backward.cuh"
#include "../block_sparse/dispatch.cuh"
#include "../block_sparse/kernel.cuh"
#include "plan.hpp"
#include "walk.cuh"

namespace trisparse::cuda {

namespace {

constexpr int kTile = 64;  // stationary rows a thread block
constexpr int kBoundThreads = 256;

/// bounds[2 i] = the first row of row i's segment, bounds[2 i + 1] = one past its last (ids
/// sorted: two binary searches, the first in [0, i], the second in (i, rows]).
template <class I>
__global__ void segment_bounds_kernel(const I* ids, std::int32_t rows, std::int32_t* bounds) {
  const std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const I id = ids[i];
  bounds[2 * i] =
      static_cast<std::int32_t>(thrust::lower_bound(thrust::seq, ids, ids + i, id) - ids);
  bounds[2 * i + 1] = static_cast<std::int32_t>(
      thrust::upper_bound(thrust::seq, ids + i + 1, ids + rows, id) - ids);
}

std::int32_t* write_bounds(const segment_view& seg, workspace_view workspace, cudaStream_t s) {
  auto* bounds = static_cast<std::int32_t*>(workspace.data);
  const auto rows = static_cast<std::int32_t>(seg.rows);
  if (rows > 0) {
    const auto blocks =
        static_cast<unsigned>((std::int64_t{rows} + kBoundThreads - 1) / kBoundThreads);
    if (seg.ids_64)
      segment_bounds_kernel<<<blocks, kBoundThreads, 0, s>>>(
          static_cast<const std::int64_t*>(seg.ids), rows, bounds);
    else
      segment_bounds_kernel<<<blocks, kBoundThreads, 0, s>>>(
          static_cast<const std::int32_t*>(seg.ids), rows, bounds);
    TRISPARSE_CUDA_TRY(cudaGetLastError());
  }
  return bounds;
}

block_sparse::params segment_params(const segment_view& seg, const tensor_view& q,
                                    const tensor_view& k, const tensor_view& v,
                                    const tensor_view& out, const tensor_view& lse, double scale,
                                    const attention_dropout& dropout, const std::int32_t* bounds) {
  block_sparse::params p{};
  static_cast<attention_io&>(p) = attention_io_of(q, k, v, out);
  p.num_tiles = static_cast<std::int32_t>((seg.rows + kTile - 1) / kTile);
  p.heads = static_cast<std::int32_t>(q.heads);
  p.negate_scores = scale < 0;
  p.scale_log2 = scale_log2(std::abs(scale));
  if (lse.data != nullptr) {
    p.lse = static_cast<float*>(lse.data);
    p.lse_row = lse.row_stride;
    p.lse_head = lse.head_stride;
  }
  p.segments = bounds;
  p.segment_rows = static_cast<std::int32_t>(seg.rows);
  block_sparse::set_dropout(p, dropout);
  return p;
}

/// p's pair bias and its gradient (f32 [rows, H or 1, M], or per edge [E, H or 1, 1] with the
/// edges' lists; checked by the caller; data == nullptr: none).
void set_pair_bias(block_sparse::params& p, const segment_edges& edges, const tensor_view& bias,
                   const tensor_view& dbias) {
  if (bias.data == nullptr) return;
  p.pair_bias = static_cast<const float*>(bias.data);
  p.pair_row = bias.row_stride;
  p.pair_head = bias.heads == 1 ? 0 : bias.head_stride;
  p.dpair_bias = static_cast<float*>(dbias.data);
  p.dpair_row = dbias.row_stride;
  p.dpair_head = dbias.head_stride;
  p.query_ptr = edges.query_ptr;
  p.query_key = edges.query_key;
  p.query_edge = edges.query_edge;
  p.key_ptr = edges.key_ptr;
  p.key_query = edges.key_query;
  p.key_edge = edges.key_edge;
}

/// f.template operator()<BIAS>() with the kind of pair bias given.
template <class F>
void with_pair_bias(const segment_edges& edges, const tensor_view& bias, F&& f) {
  using segments::pair_bias;
  if (bias.data == nullptr)
    f.template operator()<pair_bias::none>();
  else if (edges.query_ptr != nullptr)
    f.template operator()<pair_bias::edges>();
  else
    f.template operator()<pair_bias::dense>();
}

/// f.template operator()<D>() for the head dims the kernels take (16 always, the others where
/// this build has them).
template <class F>
void with_segment_dim(std::int64_t dim, F&& f) {
  with_value<16, 32, 64, 128>(dim, "attention within segments' head_dim", [&]<int D>() {
    if constexpr (D == 16 || head_dim_built(D))
      f.template operator()<D>();
    else
      throw not_supported("attention within segments: head_dim " + std::to_string(D) +
                          " is not in this build (configure with TRISPARSE_HEAD_DIMS)");
  });
}

}  // namespace

bool segment_attention_takes(std::int64_t head_dim) {
  return head_dim == 16 || ((head_dim == 32 || head_dim == 64 || head_dim == 128) &&
                            head_dim_built(static_cast<int>(head_dim)));
}

void segment_attention_forward(const segment_view& seg, const segment_edges& edges,
                               const tensor_view& q, const tensor_view& k, const tensor_view& v,
                               const tensor_view& out, const tensor_view& lse, double scale,
                               const attention_dropout& dropout, const tensor_view& bias,
                               workspace_view workspace, stream_ref stream) {
  expect_current_device(seg.device_id);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int32_t* bounds = write_bounds(seg, workspace, s);
  block_sparse::params p = segment_params(seg, q, k, v, out, lse, scale, dropout, bounds);
  set_pair_bias(p, edges, bias, {});
  with_half_type(q.type, "attention within segments' q", [&]<class T>() {
    with_segment_dim(q.dim, [&]<int D>() {
      with_output_type<T>(out.type, "attention within segments' out", [&]<class O>() {
        block_sparse::with_dropout(dropout, [&]<bool DROPOUT>() {
          with_pair_bias(edges, bias, [&]<segments::pair_bias PAIR>() {
            using walk = segments::segment_walk<kTile, kTile, false, PAIR>;
            block_sparse::launch_kernel<
                block_sparse::block_sparse_kernel<T, D, O, kTile, kTile, walk, DROPOUT>>(
                block_sparse::threads<kTile>(), block_sparse::shared_bytes<D, kTile, kTile>(), p,
                p.num_tiles, s);
          });
        });
      });
    });
  });
}

void segment_attention_backward(const segment_view& seg, const segment_edges& edges,
                                const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                const tensor_view& out, const tensor_view& lse,
                                const tensor_view& dout, const tensor_view& dq,
                                const tensor_view& dk, const tensor_view& dv, double scale,
                                const attention_dropout& dropout, const tensor_view& bias,
                                const tensor_view& dbias, workspace_view workspace,
                                stream_ref stream) {
  expect_current_device(seg.device_id);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int32_t* bounds = write_bounds(seg, workspace, s);
  block_sparse::backward_params p{};
  static_cast<block_sparse::params&>(p) =
      segment_params(seg, q, k, v, out, lse, scale, dropout, bounds);
  set_pair_bias(p, edges, bias, dbias);
  block_sparse::set_gradient_io(p, dout, dq, dk, dv, scale);
  auto* terms =
      reinterpret_cast<float*>(static_cast<char*>(workspace.data) + segment_bounds_bytes(seg.rows));
  p.lse2 = terms;
  p.dterm = terms + q.heads * seg.rows;
  p.rows_q = seg.rows;
  with_half_type(q.type, "attention within segments' q", [&]<class T>() {
    block_sparse::launch_backward_terms<T>(p, out.type, static_cast<int>(v.dim), terms, s);
    with_segment_dim(q.dim, [&]<int D>() {
      block_sparse::with_dropout(dropout, [&]<bool DROPOUT>() {
        with_pair_bias(edges, bias, [&]<segments::pair_bias PAIR>() {
          constexpr int kThreads = kTile / 16 * 32;
          constexpr int kKeyStream = D == 128 ? 32 : kTile;
          using query_walk = segments::segment_walk<kTile, kTile, false, PAIR>;
          using key_walk = segments::segment_walk<kTile, kKeyStream, true, PAIR>;
          block_sparse::launch_kernel<
              block_sparse::backward_kernel<T, D, kTile, kTile, false, query_walk, DROPOUT>>(
              kThreads, block_sparse::backward_shared_bytes<D, kTile, kTile, false>(), p,
              p.num_tiles, s);
          block_sparse::launch_kernel<
              block_sparse::backward_kernel<T, D, kTile, kKeyStream, true, key_walk, DROPOUT>>(
              kThreads, block_sparse::backward_shared_bytes<D, kTile, kKeyStream, true>(), p,
              p.num_tiles, s);
        });
      });
    });
  });
}

}  // namespace trisparse::cuda
