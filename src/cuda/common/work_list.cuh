#pragma once
// Work lists of the window-based kernels, built on the device from per-window block counts.
#include <cuda_runtime.h>

#include <cstdint>

#include "buffer.cuh"
#include "work_item.hpp"

namespace trisparse::cuda {

struct device_work_list {
  device_buffer<work_item> items;      // largest first
  device_buffer<split_window> splits;  // windows cut into several items
  device_buffer<std::int32_t> sizes;   // the items' block counts (decreasing)
  std::int32_t num_items = 0, num_splits = 0, num_parts = 0;
  std::int32_t num_large = 0;  // the leading items of at least `large` blocks
};

/// window_blocks: [windows] block counts; block_offset: [windows + 1] their exclusive scan.
/// Windows of more than `limit` blocks become ceil(blocks / limit) items of equal share (each
/// writing a partial result), the others (also empty windows, whose rows get zeros) one item;
/// items sorted by decreasing block count, stable (ties in window order); num_large counts the
/// items of at least `large` blocks (0 when large <= 0). Synchronous on `stream`.
device_work_list build_work_list(const std::int32_t* window_blocks,
                                 const std::int64_t* block_offset, std::int64_t windows,
                                 std::int64_t limit, cudaStream_t stream, std::int64_t large = 0);

}  // namespace trisparse::cuda
