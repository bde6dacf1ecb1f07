#pragma once
// The ME-BCRS kernels' run-time choices (host code; measured on the H200,
// docs/notes/me_bcrs.md): how work lists cut windows, which SpMM items run on teams, and when
// reordering rows pays.
#include <algorithm>
#include <cstdint>

namespace trisparse::cuda::me_bcrs {

/// Warp slots per SM that the mean work per slot is counted over.
inline constexpr std::int64_t kWarpSlotsPerSm = 16;

/// Blocks of 8 vectors per warp slot, rounded up.
inline std::int64_t mean_blocks_per_slot(std::int64_t blocks, int sms) {
  const std::int64_t slots = std::int64_t{sms} * kWarpSlotsPerSm;
  return (blocks + slots - 1) / slots;
}

/// SpMM teams: items longer than the mean work per slot, at least 8 blocks (2 per warp). A shorter
/// item's chain does not outlast the kernel, and a team costs each warp the item's set-up and a
/// share of the reduction (teams for every item of uniform patterns were 1.4x slower).
inline std::int64_t spmm_team_blocks(std::int64_t mean) { return std::max<std::int64_t>(8, mean); }

/// SpMM split limit: a split writes a partial tile of C and a share of its merge, so windows are
/// cut only where far longer than the mean (with teams, the team absorbs long items).
inline std::int64_t spmm_split_blocks(std::int64_t mean, bool teams) {
  return teams ? std::max<std::int64_t>(64, 4 * mean) : std::max<std::int64_t>(32, 2 * mean);
}

/// SDDMM: no merge, so windows are cut short and the longest item no longer sets the time.
inline std::int64_t sddmm_split_blocks(std::int64_t mean) { return mean <= 16 ? 4 : 8; }

/// Softmax: a split merges two numbers per row.
inline std::int64_t softmax_split_blocks(std::int64_t mean) { return mean <= 16 ? 8 : 16; }

/// Patterns up to this many nonzeros try the clustered row order (its host time grows past
/// what the kernels gain above it).
inline constexpr std::int64_t kReorderMaxNnz = std::int64_t{4} << 20;

/// A row map costs a load per output row and scatters C's rows: reordering pays from about a
/// tenth fewer vectors.
inline bool reorder_pays(std::int64_t vectors_reordered, std::int64_t vectors) {
  return 10 * vectors_reordered <= 9 * vectors;
}

}  // namespace trisparse::cuda::me_bcrs
