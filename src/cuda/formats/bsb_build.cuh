#pragma once
// BSB (16x8 TCBs) built on the GPU from a CSR pattern (internal): the same arrays as build_bsb.
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/buffer.cuh"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cuda {

struct device_bsb {
  std::int64_t rows = 0, cols = 0, windows = 0, tcbs = 0;
  device_buffer<std::int64_t> tcb_offset;    // [windows + 1]
  device_buffer<std::int32_t> col_idx;       // [tcbs * 8], -1 = padding
  device_buffer<std::uint64_t> bitmap;       // [tcbs * 2]
  device_buffer<std::int32_t> window_order;  // [windows], by decreasing TCB count, stable
};

/// Uploads the pattern and builds its BSB on the current device (synchronous).
device_bsb build_bsb_device(const csr_graph& pattern, cudaStream_t stream = nullptr);

}  // namespace trisparse::cuda
