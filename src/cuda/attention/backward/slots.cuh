#pragma once
// The slots of the tensor-core backward's stored P and dS (included by launch.cu, at plan build).
//
// The dq pass writes P and dS of each pattern entry it recomputes (one 32-bit word a head: the two
// 16-bit values) at the entry's *slot*: its rank among the set bits of the pattern's BSB, in TCB
// order and, within a TCB, bit order (rows 0-7 of mask0, then rows 8-15 of mask1), so a TCB's
// entries are the slots first_slot[tcb] + [0, popcount) -- but it stores them at the slot of the
// same pair in the transpose's BSB (target[its slot]), so the dk/dv pass reads its own TCB's words
// in place. Both maps are built here on the device from the pattern's CSR (columns increasing in
// each row): each set bit's pair found by a binary search of its row.
#include <thrust/binary_search.h>
#include <thrust/execution_policy.h>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "../../common/buffer.cuh"
#include "../../common/error.cuh"

namespace trisparse::cuda::attention_backward {

// Thread blocks of the plan build's kernels (a thread per item).
constexpr int kBuildThreads = 256;

inline unsigned build_blocks(std::int64_t threads) {
  return static_cast<unsigned>((threads + kBuildThreads - 1) / kBuildThreads);
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

__global__ void tcb_entry_counts(const std::uint64_t* bitmap, std::int64_t tcbs,
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
__device__ __forceinline__ std::int64_t position_row(const std::int32_t* row_of, std::int64_t at) {
  return row_of != nullptr ? std::int64_t{row_of[at]} : at;
}

// slot_of[e] = the slot of the pattern's entry e, over the pattern's own BSB (its windows' rows in
// row_of's order).
__global__ void pattern_slots(const std::int64_t* tcb_offset, std::int64_t windows,
                              const std::int32_t* tcb_col, const std::uint64_t* bitmap,
                              const std::int32_t* first_slot, std::int64_t tcbs,
                              const std::int32_t* row_of, const std::int64_t* row_ptr,
                              const std::int32_t* col, std::int32_t* slot_of) {
  const std::int64_t tcb = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (tcb >= tcbs) return;
  const std::int64_t base = window_of(tcb_offset, windows, tcb) * 16;
  for_each_bit(bitmap, tcb, first_slot[tcb], [&](int r, int c, std::int32_t slot) {
    slot_of[lower_entry(row_ptr, col, position_row(row_of, base + r), tcb_col[tcb * 8 + c])] = slot;
  });
}

// target[slot_of[e]] = the transpose's slot s of the pattern's entry e (key at window row r, in
// row_of's order; query column c: the pattern's entry (query, key)).
__global__ void transposed_targets(const std::int64_t* tcb_offset, std::int64_t windows,
                                   const std::int32_t* tcb_col, const std::uint64_t* bitmap,
                                   const std::int32_t* first_slot, std::int64_t tcbs,
                                   const std::int32_t* row_of, const std::int64_t* row_ptr,
                                   const std::int32_t* col, const std::int32_t* slot_of,
                                   std::int32_t* target) {
  const std::int64_t tcb = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (tcb >= tcbs) return;
  const std::int64_t base = window_of(tcb_offset, windows, tcb) * 16;
  for_each_bit(bitmap, tcb, first_slot[tcb], [&](int r, int c, std::int32_t slot) {
    const auto key = static_cast<std::int32_t>(position_row(row_of, base + r));
    target[slot_of[lower_entry(row_ptr, col, tcb_col[tcb * 8 + c], key)]] = slot;
  });
}

// first_slot of a BSB: the exclusive prefix sum of its TCBs' entry counts.
inline device_buffer<std::int32_t> first_slots(const std::uint64_t* bitmap, std::int64_t tcbs,
                                               cudaStream_t s) {
  device_buffer<std::int32_t> first(static_cast<std::size_t>(tcbs));
  if (tcbs == 0) return first;
  device_buffer<std::int32_t> count(static_cast<std::size_t>(tcbs), s);
  tcb_entry_counts<<<build_blocks(tcbs), kBuildThreads, 0, s>>>(bitmap, tcbs, count.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  std::size_t bytes = 0;
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, bytes, count.data(), first.data(),
                                                   static_cast<int>(tcbs), s));
  device_buffer<std::byte> temp(std::max<std::size_t>(bytes, 1), s);  // non-null: not a size query
  TRISPARSE_CUDA_TRY(cub::DeviceScan::ExclusiveSum(temp.data(), bytes, count.data(), first.data(),
                                                   static_cast<int>(tcbs), s));
  return first;
}

}  // namespace trisparse::cuda::attention_backward
