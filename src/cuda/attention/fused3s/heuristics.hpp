#pragma once
// The fused 3S backend's run-time choices (host code; measured on the H200,
// docs/notes/fused3s.md). The split limit and the team count come from a replay of the kernel's
// schedule (schedule.hpp).
#include <cstdint>

#include "tuning.hpp"

namespace trisparse::cuda::fused3s {

/// Patterns up to this many nonzeros try the reverse Cuthill-McKee row order (the ordering's
/// host time grows past what the kernel gains above it).
inline constexpr std::int64_t kRcmMaxNnz = std::int64_t{4} << 20;

/// RCM is kept where it leaves at most this percentage of the TCBs: it lengthens the densest
/// windows and adds a row-map load per item, so fewer TCBs paid only from about a third fewer.
inline constexpr std::int64_t kRcmKeepPercent = 65;

/// At D = 128, run 12 warps per SM (rows not loaded a TCB ahead, to fit 168 registers) where that
/// runs every task at once and 8 would not: tasks between the warp slots of two and of three
/// 4-warp blocks, all short. Batches of small graphs (tu_enzymes: two rounds of tasks become one)
/// measured 4.5% faster; with more tasks than three blocks' slots 1-3.5% slower, with longer items
/// 3-22% slower.
inline bool short_items_on_small_blocks(std::int32_t longest_item_tcbs, std::int64_t tasks,
                                        int sms) {
  const std::int64_t block_warps = std::int64_t{kWarps} * sms;
  return longest_item_tcbs <= kShortItem && tasks > kMinBlocks<128> * block_warps &&
         tasks <= 3 * block_warps;
}

}  // namespace trisparse::cuda::fused3s
