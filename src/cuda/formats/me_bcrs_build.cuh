#pragma once
// ME-BCRS (FlashSparse's format) built on the GPU from a CSR pattern (internal). Windows of
// `vector_rows` rows; per window its nonzero column vectors, sorted; per vector the window rows
// that hold an entry (mask) and, in the value layout the kernels read, the entries' values: per
// block of 8 vectors row-major, the window's last block only as wide as its residue (no padding).
// Slot of (row r of the window, vector v counted from the window's first):
//   (row_ptr[w] + v / 8 * 8) * vector_rows + r * width + v % 8,  width = min(8, n - v / 8 * 8).
#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "../common/buffer.cuh"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cuda {

inline constexpr int kMeBlockCols = 8;  // vectors per tensor-core block

struct device_me_bcrs {
  std::int64_t rows = 0, cols = 0, nnz = 0, windows = 0, vectors = 0;
  int vector_rows = 8;
  bool binary = false;                        // built without values: every entry's value is 1
  device_buffer<std::int64_t> row_ptr;        // [windows + 1], in vectors
  device_buffer<std::int32_t> col_idx;        // [vectors]
  device_buffer<std::uint32_t> mask;          // [vectors]: bit r = row r of the window has an entry
  device_buffer<float> values;                // [vectors * vector_rows]; 0 where no entry
  device_buffer<std::int64_t> entry_slot;     // [nnz]: the slot of each CSR entry
  device_buffer<std::int32_t> window_blocks;  // [windows + 1]: ceil(vectors / 8), last 0
  device_buffer<std::int64_t> block_offset;   // [windows + 1]: exclusive scan of window_blocks
  device_buffer<std::int64_t> row_map;        // [rows]: window row i is pattern row row_map[i]
                                              // (empty: the identity)

  std::int64_t slots() const { return vectors * vector_rows; }
};

/// Builds the ME-BCRS of a CSR pattern on the current device. `values` (device, [nnz]) or nullptr
/// for a binary pattern (every entry 1). Columns may be unsorted or repeated within a row;
/// repeated entries share a slot and their values add up (binary: the slot holds 1). `checked`: the
/// caller has validated the pattern (otherwise the device checks it and this throws invalid_input).
/// Synchronous.
device_me_bcrs build_me_bcrs_device(const csr_view& pattern, const float* values, int vector_rows,
                                    cudaStream_t stream, bool checked);

/// Uploads a host pattern (checked) and its values, and builds the ME-BCRS with its rows in
/// `order` (order[i] = the pattern row placed at window row i; empty = as given). entry_slot stays
/// indexed by the pattern's own entries.
device_me_bcrs build_me_bcrs_device(const csr_graph& pattern, int vector_rows, cudaStream_t stream,
                                    std::span<const std::int64_t> order = {});

}  // namespace trisparse::cuda
