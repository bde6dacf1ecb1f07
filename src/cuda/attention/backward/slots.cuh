#pragma once
// The slots of the tensor-core backward's stored P and dS (included by launch.cu, at plan build).
//
// The dq pass writes P and dS of each pattern entry it recomputes (one 32-bit word a head: the two
// 16-bit values) at the entry's *slot* in the pattern's BSB (../../formats/bsb_slots.cuh) -- but
// it stores them at the slot of the same pair in the transpose's BSB (target[its slot]), so the
// dk/dv pass reads its own TCB's words in place. Both maps are built here on the device from the
// pattern's CSR (columns increasing in each row): each set bit's pair found by a binary search of
// its row. The dq pass also finds each slot's pattern entry (`slot_entries`: a bias's reads and
// dbias's writes).
#include <cstdint>

#include "../../formats/bsb_slots.cuh"

namespace trisparse::cuda::attention_backward {

// Thread blocks of the plan build's kernels (a thread per item).
constexpr int kBuildThreads = kSlotBuildThreads;

inline unsigned build_blocks(std::int64_t threads) { return slot_build_blocks(threads); }

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

// entry[slot_of[e]] = e: the pattern's entry at each slot of its BSB.
__global__ void invert_slots(const std::int32_t* slot_of, std::int64_t nnz, std::int32_t* entry) {
  const std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (e < nnz) entry[slot_of[e]] = static_cast<std::int32_t>(e);
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

}  // namespace trisparse::cuda::attention_backward
