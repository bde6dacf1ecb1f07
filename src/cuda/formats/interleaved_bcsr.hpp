#pragma once
// Kernel parameters of the blocked-sparse report's pipeline (SDDMM -> softmax -> SpMM over the
// row-interleaved BCSR of interleaved_layout.hpp): plain data, no CUDA headers.
#include <cstdint>

#include "../common/attention_io.hpp"
#include "interleaved_layout.hpp"

namespace trisparse::cuda::interleaved {

/// Items (tiles or parts) of mask head m: [first[m], first[m + 1]).
struct work {
  const void* items;
  const std::int32_t* first;
};

struct params : ragged_attention_io {
  const block_row* rows;
  const std::int32_t* col_idx;
  float* scores;           // [heads of this launch][slot]: scores, then probabilities, in place
  std::int64_t slot;       // floats per head
  std::int32_t h0, heads;  // this launch covers attention heads [h0, h0 + heads)
  std::int32_t mask_heads, block, dim;
  bool causal;
  float scale_log2;  // SDDMM stores scale * log2(e) * <q, k>: the softmax works in base 2
};

}  // namespace trisparse::cuda::interleaved
