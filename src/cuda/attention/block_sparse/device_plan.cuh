#pragma once
// The device side of a block-sparse plan (launch.cu builds it, the top-k selection,
// src/cuda/attention/topk/, rewrites its blocks).
#include <cstdint>

#include "../../common/buffer.cuh"
#include "params.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"

namespace trisparse::cuda {

struct block_sparse_device_plan {
  int device = 0;
  std::int64_t block = 0, tile_rows = 0, mask_heads = 1, rows_q = 0;
  bool causal = false, wgmma = false, pingpong = false;
  std::int32_t num_tiles = 0;
  device_buffer<std::int64_t> cu_q, cu_k;
  device_buffer<std::int32_t> mask_row, row_ptr, col_idx;
  device_buffer<block_sparse::tile> tiles;
  // With gradients (backward.cu): the transposed masks (params: t_mask_col, t_ptr, t_idx), the
  // query tiles of the dq kernel and the key tiles of the dk/dv kernel, both of
  // backward_tile_rows rows and ordered by work.
  bool gradients = false;
  std::int64_t backward_tile_rows = 0;
  std::int32_t num_backward_tiles = 0, num_key_tiles = 0;
  device_buffer<std::int32_t> t_mask_col, t_ptr, t_idx;
  device_buffer<block_sparse::tile> backward_tiles, key_tiles;
};

/// Fills the gradients part of `plan` from its mask (launch.cu).
void prepare_backward(block_sparse_device_plan& plan, const block_sparse_mask& mask);

/// The kernel parameters of a run of `plan` (launch.cu): the operands, the mask, the forward's
/// query tiles, heads and scale; lse where lse.data is set (f32).
block_sparse::params run_params(const block_sparse_device_plan& plan, const tensor_view& q,
                                const tensor_view& k, const tensor_view& v, const tensor_view& out,
                                const tensor_view& lse, double scale);

}  // namespace trisparse::cuda
