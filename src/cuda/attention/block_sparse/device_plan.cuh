#pragma once
// The device side of a block-sparse plan (launch.cu builds it, the top-k selection,
// src/cuda/attention/topk/, rewrites its blocks).
#include <cstdint>

#include "../../common/buffer.cuh"
#include "params.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"

namespace trisparse::cuda {

/// Where one mask (sequence b, mask head h: m = b * mask_heads + h) lives in the flattened arrays,
/// for the kernels that write its blocks on the device (device_mask.cu).
struct mask_extent {
  std::int32_t row0;        // its block rows' offsets: row_ptr[row0 .. row0 + rows]
  std::int32_t col0;        // its key blocks' offsets: t_ptr[col0 .. col0 + cols]
  std::int32_t rows, cols;  // its sequence's query and key blocks
  std::int32_t base;        // its first slot in col_idx and in t_idx (as many slots in each)
  std::int64_t kept;        // a mask on the device: the offset of its kept[0][0] (elements)
};

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
  // Masks whose blocks the device writes (a mask on the device, a top-k selection): where each
  // lives; the transposed masks are rebuilt from row_ptr and col_idx by transpose_on_device.
  device_buffer<mask_extent> extents;
  std::int32_t num_masks = 0, most_rows = 0, most_cols = 0;
  // A plan made from a mask on the device: that mask's layout (refill_block_sparse_plan takes
  // only another mask of the same).
  bool from_kept = false;
  device_block_mask kept_layout{};
};

/// A mask's blocks as bytes on the device (nonzero: kept): mask (b, h) at kept + offset of
/// extent m, block row r at + r * row_stride, key block c at + c.
struct device_kept {
  const std::uint8_t* data;
  std::int64_t row_stride;
};

/// The backward part of a top-k plan (launch.cu): its masks' extents (`slots` a block row), tiles
/// in the layout's order and room for the transposed masks, which select_topk rebuilds.
void prepare_topk_backward(block_sparse_device_plan& plan, const block_sparse_mask& skeleton,
                           std::int64_t slots, stream_ref stream);

/// Writes the plan's row_ptr and col_idx from `kept` (three launches on `stream`: counts, their
/// prefix sums, the ascending lists), and with gradients the transposed masks; where `due` (a
/// flag on the device) is given and false, the kernels return at once.
void fill_from_kept(block_sparse_device_plan& plan, const device_kept& kept, cudaStream_t stream,
                    const bool* due = nullptr);

/// Rebuilds the plan's transposed masks (t_ptr, t_idx) from its row_ptr and col_idx on `stream`:
/// per mask, key block c lists the query blocks whose rows hold c, ascending (entries past the
/// sequence's key blocks, a top-k row's unused slots, are left out). No atomics.
void transpose_on_device(block_sparse_device_plan& plan, cudaStream_t stream,
                         const bool* due = nullptr);

/// Fills the gradients part of `plan` from its mask (launch.cu).
void prepare_backward(block_sparse_device_plan& plan, const block_sparse_mask& mask);

/// The kernel parameters of a run of `plan` (launch.cu): the operands, the mask, the forward's
/// query tiles, heads and scale; lse where lse.data is set (f32).
block_sparse::params run_params(const block_sparse_device_plan& plan, const tensor_view& q,
                                const tensor_view& k, const tensor_view& v, const tensor_view& out,
                                const tensor_view& lse, double scale);

}  // namespace trisparse::cuda
