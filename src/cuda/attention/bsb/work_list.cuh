#pragma once
// The fused 3S kernel's work list, built on the device from the BSB's per-window TCB counts.
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/buffer.cuh"
#include "../../formats/bsb_build.cuh"
#include "params.hpp"

namespace trisparse::cuda::fused3s {

struct device_work_list {
  device_buffer<work_item> items;      // largest first
  device_buffer<split_window> splits;  // windows cut into several items
  std::int32_t num_items = 0, num_splits = 0, num_parts = 0;
};

/// Windows of more than `limit` TCBs become ceil(TCBs / limit) items of equal share (each writing
/// a partial state), the others (also empty windows, whose rows get zeros) one item; items sorted
/// by decreasing TCB count, stable (ties in window order). Synchronous on `stream`.
device_work_list build_work_list(const device_bsb& format, std::int64_t limit, cudaStream_t stream);

}  // namespace trisparse::cuda::fused3s
