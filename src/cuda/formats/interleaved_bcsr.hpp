#pragma once
// The row-interleaved BCSR layout of the blocked-sparse report's pipeline (SDDMM -> softmax ->
// SpMM over a block mask at granularity G), as the kernels read it: plain data, no CUDA headers.
//
// A block row is one query block (of one mask head and sequence) and its kept key blocks. Its
// scores are stored row-interleaved: query row t of the block row holds the scores of all its
// key blocks one after the other (count * G values, "positions"), so a scalar row is contiguous
// and every kernel walks it with coalesced accesses.
#include <cstdint>

#include "../common/attention_io.hpp"

namespace trisparse::cuda::interleaved {

/// Query rows [row0, row0 + rows) (local to sequence `seq`) attending the `count` key blocks
/// col_idx[first, first + count); position x of a row is key (col_idx[first + x / G] * G + x % G).
/// Query row t's scores start at value0 + t * count * G within its head's score slot.
struct block_row {
  std::int64_t first, value0;
  std::int32_t seq, row0, rows, count, mask_head;
};

/// SDDMM: one warp's rows [t0, t0 + R) x positions [p0, p0 + 1024 / R) of block row `row`.
/// SpMM: one thread block's rows [t0, t0 + its tile rows) x every position.
struct tile {
  std::int32_t row, t0, p0;
};

/// Softmax: a warp's query rows, from row t of block row `row` up to the next part's start.
struct part {
  std::int32_t row, t;
};

/// Items (tiles or parts) of mask head m: [first[m], first[m + 1]).
struct work {
  const void* items;
  const std::int32_t* first;
};

struct params : attention_io {
  const std::int64_t* cu_q;  // [batch + 1]
  const std::int64_t* cu_k;  // [batch + 1]
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
