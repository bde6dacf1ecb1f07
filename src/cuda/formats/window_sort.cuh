#pragma once
// The first steps of every windowed format builder on the GPU (BSB, ME-BCRS), from a CSR pattern
// in device memory. Entries of one row window (`height` rows) are contiguous in CSR, so
// everything is per window: the entries' keys col * height + row % height are sorted within each
// window (columns ascending, one column's rows together), and one warp per window then walks its
// sorted keys in chunks of 32 to rank the distinct columns (walk_window).
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/buffer.cuh"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cuda {

/// Checks the offsets and the column range on the device.
/// @throws invalid_input naming the broken invariant.
void check_csr_view(const csr_view& pattern, cudaStream_t stream);

/// The entries of each window sorted by key; ids (when asked for) are the entries' CSR indices
/// in the same order.
template <class Key>
struct window_sorted {
  std::int64_t windows = 0;
  device_buffer<std::int64_t> window_begin;  // [windows + 1]: first entry of each window
  device_buffer<Key> keys;                   // [nnz]
  device_buffer<std::uint32_t> ids;          // [nnz] or empty
};

/// Asynchronous on `stream` (the temporaries are released after a stream synchronisation).
template <class Key>
window_sorted<Key> sort_windows(const csr_view& pattern, int height, bool with_ids,
                                cudaStream_t stream);

/// 32-bit keys when cols * height fits, else 64-bit.
inline bool small_keys(const csr_view& pattern, int height) {
  return pattern.cols * height <= (std::int64_t{1} << 31);
}

__device__ __forceinline__ std::int64_t global_warp() {
  return (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) / 32;
}

/// One warp walks the sorted keys [begin, end) of a window in chunks of 32 and calls
/// visit(i, column, row_in_window, rank, first) for each entry i (rank: the 0-based rank of its
/// column among the window's distinct columns; first: the entry is its column's first). Returns
/// the number of distinct columns (on every lane).
template <class Key, int kHeight, class Visit>
__device__ __forceinline__ std::int64_t walk_window(const Key* sorted, std::int64_t begin,
                                                    std::int64_t end, Visit&& visit) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t distinct = 0;  // columns before this chunk
  Key prev_last = ~Key{0};    // the previous chunk's last column (none: all ones)
  for (std::int64_t c = begin; c < end; c += 32) {
    const std::int64_t i = c + lane;
    const bool valid = i < end;
    const Key key = valid ? sorted[i] : ~Key{0};
    const Key col = valid ? key / kHeight : ~Key{0};
    Key before = __shfl_up_sync(0xFFFFFFFFu, col, 1);
    if (lane == 0) before = prev_last;
    const bool fresh = valid && col != before;
    const unsigned fresh_mask = __ballot_sync(0xFFFFFFFFu, fresh);
    if (valid) {
      const std::int64_t rank = distinct + __popc(fresh_mask & ((2u << lane) - 1)) - 1;
      visit(i, col, static_cast<int>(key % kHeight), rank, fresh);
    }
    distinct += __popc(fresh_mask);
    prev_last = __shfl_sync(0xFFFFFFFFu, col, 31);
  }
  return distinct;
}

}  // namespace trisparse::cuda
