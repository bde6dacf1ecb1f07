#pragma once
// The slots of a BSB's entries (16-row windows, 16x8 TCBs with bitmaps): an entry's slot is its
// rank among the set bits of the BSB, in TCB order and, within a TCB, bit order (rows 0-7 of
// mask0, then rows 8-15 of mask1), so a TCB's entries are the slots first_slot[tcb] + [0,
// popcount). Kernels that read or write a value per pattern entry (a score bias, its gradient,
// stored P and dS) find it through the slots: `slot_entries` maps each slot to the entry of the
// pattern's CSR (columns increasing in each row) that it is, by a binary search of its row.
#include <thrust/binary_search.h>
#include <thrust/execution_policy.h>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "../common/buffer.cuh"
#include "../common/error.cuh"
#include "../common/fragment_io.cuh"

namespace trisparse::cuda {

// Thread blocks of the slot maps' build kernels (a thread per item).
constexpr int kSlotBuildThreads = 256;

inline unsigned slot_build_blocks(std::int64_t threads) {
  return static_cast<unsigned>((threads + kSlotBuildThreads - 1) / kSlotBuildThreads);
}

// The window of TCB `tcb`: the last w with tcb_offset[w] <= tcb (tcb_offset: windows + 1 offsets).
__device__ __forceinline__ std::int64_t window_of(const std::int64_t* tcb_offset,
                                                  std::int64_t windows, std::int64_t tcb) {
  return thrust::upper_bound(thrust::seq, tcb_offset, tcb_offset + windows + 1, tcb) - tcb_offset -
         1;
}

// The first entry of `row` whose column is >= c, in a CSR with increasing columns in each row:
// the entry (row, c) where it is present.
__device__ __forceinline__ std::int64_t lower_entry(const std::int64_t* row_ptr,
                                                    const std::int32_t* col, std::int64_t row,
                                                    std::int32_t c) {
  return thrust::lower_bound(thrust::seq, col + row_ptr[row], col + row_ptr[row + 1], c) - col;
}

__global__ inline void tcb_entry_counts(const std::uint64_t* bitmap, std::int64_t tcbs,
                                        std::int32_t* count) {
  const std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (t < tcbs) count[t] = __popcll(bitmap[2 * t]) + __popcll(bitmap[2 * t + 1]);
}

// Calls f(r, c, slot) for each set bit of TCB `tcb` (window row r, column slot c) in slot order.
template <class F>
__device__ __forceinline__ void for_each_bit(const std::uint64_t* bitmap, std::int64_t tcb,
                                             std::int32_t first, F&& f) {
  std::int32_t slot = first;
  for (int half = 0; half < 2; ++half) {
    for (std::uint64_t m = bitmap[2 * tcb + half]; m != 0; m &= m - 1) {
      const int bit = __ffsll(static_cast<long long>(m)) - 1;
      f(half * 8 + bit / 8, bit % 8, slot++);
    }
  }
}

// The row at window position `at` of a BSB whose windows take the rows in `row_of`'s order (null:
// the rows' own order).
template <class I>
__device__ __forceinline__ std::int64_t position_row(const I* row_of, std::int64_t at) {
  return row_of != nullptr ? std::int64_t{row_of[at]} : at;
}

// The slots of a lane's four bits of a TCB of mma.sync's 16x8 accumulator layout (bit and
// bit + 1 of both masks: rows g and g + 8, columns 2t and 2t + 1; bit = 8g + 2t), -1 where the
// bit is clear.
__device__ __forceinline__ void lane_slots(const tcb_meta& m, int bit, std::int32_t first,
                                           std::int32_t (&slot)[4]) {
  const std::uint64_t below = (std::uint64_t{1} << bit) - 1;
  const std::int32_t r0 = first + __popcll(m.mask0 & below),
                     r1 = first + __popcll(m.mask0) + __popcll(m.mask1 & below);
  const bool b0 = (m.mask0 >> bit) & 1, b1 = (m.mask0 >> (bit + 1)) & 1, b2 = (m.mask1 >> bit) & 1,
             b3 = (m.mask1 >> (bit + 1)) & 1;
  slot[0] = b0 ? r0 : -1;
  slot[1] = b1 ? r0 + b0 : -1;
  slot[2] = b2 ? r1 : -1;
  slot[3] = b3 ? r1 + b2 : -1;
}

// entry[slot] = the CSR entry (row_ptr, col) each slot of a BSB is (its windows' rows in row_of's
// order).
template <class I>
__global__ void slot_entries(const std::int64_t* tcb_offset, std::int64_t windows,
                             const std::int32_t* tcb_col, const std::uint64_t* bitmap,
                             const std::int32_t* first_slot, std::int64_t tcbs, const I* row_of,
                             const std::int64_t* row_ptr, const std::int32_t* col,
                             std::int32_t* entry) {
  const std::int64_t tcb = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (tcb >= tcbs) return;
  const std::int64_t base = window_of(tcb_offset, windows, tcb) * 16;
  for_each_bit(bitmap, tcb, first_slot[tcb], [&](int r, int c, std::int32_t slot) {
    entry[slot] = static_cast<std::int32_t>(
        lower_entry(row_ptr, col, position_row(row_of, base + r), tcb_col[tcb * 8 + c]));
  });
}

// first_slot of a BSB: the exclusive prefix sum of its TCBs' entry counts.
inline device_buffer<std::int32_t> first_slots(const std::uint64_t* bitmap, std::int64_t tcbs,
                                               cudaStream_t s) {
  device_buffer<std::int32_t> first(static_cast<std::size_t>(tcbs));
  if (tcbs == 0) return first;
  device_buffer<std::int32_t> count(static_cast<std::size_t>(tcbs), s);
  tcb_entry_counts<<<slot_build_blocks(tcbs), kSlotBuildThreads, 0, s>>>(bitmap, tcbs,
                                                                         count.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  std::size_t bytes = 0;
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, bytes, count.data(), first.data(),
                                                   static_cast<int>(tcbs), s));
  device_buffer<std::byte> temp(std::max<std::size_t>(bytes, 1), s);  // non-null: not a size query
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp.data(), bytes, count.data(), first.data(),
                                                   static_cast<int>(tcbs), s));
  return first;
}

}  // namespace trisparse::cuda
