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
  device_buffer<std::int32_t> window_tcbs;   // [windows]
};

/// Builds the BSB of a CSR pattern already on the current device (synchronous on `stream`).
/// Columns may be unsorted or repeated within a row. `checked`: the caller has validated the
/// pattern (otherwise a kernel checks the offsets and column range first and this throws
/// invalid_input). `with_order`: also sort windows by decreasing TCB count.
device_bsb build_bsb_device(const csr_view& pattern, cudaStream_t stream, bool checked,
                            bool with_order);

/// Uploads a host pattern (checked) and builds its BSB.
device_bsb build_bsb_device(const csr_graph& pattern, cudaStream_t stream, bool with_order);

}  // namespace trisparse::cuda
