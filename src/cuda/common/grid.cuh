#pragma once
// Grid sizes for one-dimensional launches (at least one block, so empty inputs still launch
// kernels that write their own bounds-checked outputs).
#include <algorithm>
#include <cstdint>

namespace trisparse::cuda {

/// Blocks of `per_block` threads covering `threads` threads.
inline unsigned blocks_for(std::int64_t threads, int per_block) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, (threads + per_block - 1) / per_block));
}

}  // namespace trisparse::cuda
