#pragma once
// The device side of a block-sparse plan (launch.cu builds it, the top-k selection, src/cuda/attention/topk/, rewrites its blocks).
#include <cstdint>

#include "../../common/buffer.cuh"
#include "params.hpp"

namespace trisparse::cuda {

struct block_sparse_device_plan {
  int device = 0;
  std::int64_t block = 0, tile_rows = 0, mask_heads = 1;
  bool causal = false, wgmma = false, pingpong = false;
  std::int32_t num_tiles = 0;
  device_buffer<std::int64_t> cu_q, cu_k;
  device_buffer<std::int32_t> mask_row, row_ptr, col_idx;
  device_buffer<block_sparse::tile> tiles;
};

}  // namespace trisparse::cuda
