#pragma once
// The fused 3S kernel's compile-time shapes (plain constexpr, host and device; H200-tuned,
// docs/notes/fused3s.md).
#include <cstdint>

namespace trisparse::cuda::fused3s {

/// Warps per thread block: a team of warps shares one item (teams, schedule.hpp).
inline constexpr int kWarps = 4;

/// Resident blocks of kWarps per SM the register budget is held to (65536 / (blocks * 128)
/// registers): at D = 128 three blocks (168 registers) spill and measured 1.2-1.6x slower than
/// two; D <= 64 fits four without spilling.
template <int D>
inline constexpr int kMinBlocks = D <= 64    ? 4
                                  : D == 128 ? 2
                                             : 1;

/// Items of at most this many TCBs are short: at D = 128 they may run 12 warps per SM
/// (heuristics.hpp, short_items_on_small_blocks).
inline constexpr std::int32_t kShortItem = 8;

/// The short-item launch at D = 128: blocks per SM and warps per block (six blocks of two
/// measured 4% faster on tu_enzymes than three of four: 8-10 warps per SM instead of 8-12).
inline constexpr int kShortBlocks = 6, kShortBlockWarps = 2;

}  // namespace trisparse::cuda::fused3s
