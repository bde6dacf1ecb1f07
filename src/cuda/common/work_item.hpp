#pragma once
// Work items of the window-based kernels (plain data, no CUDA headers): a row window's blocks
// [begin, end), possibly one part of a window split across warps.
#include <cstdint>

namespace trisparse::cuda {

/// A warp's work: blocks [begin, end) (global block indices) of row window `window`; part >= 0
/// writes a partial result into slot `part` of split window `split`, part < 0 writes the output.
struct work_item {
  std::int32_t window, begin, end, part, split;
};

/// A window split into `parts` consecutive partial slots from `first_part`.
struct split_window {
  std::int32_t window, first_part, parts;
};

}  // namespace trisparse::cuda
