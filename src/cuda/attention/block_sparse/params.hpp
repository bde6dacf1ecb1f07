#pragma once
// Host <-> kernel parameters of the fused block-sparse attention kernel (plain data).
#include <cstdint>

namespace trisparse::cuda::block_sparse {

/// The query rows [row0, row0 + tile rows) of sequence `seq` (row0 local to the sequence); a tile
/// never crosses a query block.
struct tile {
  std::int32_t seq, row0;
};

struct params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  std::int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head;  // element strides
  const std::int64_t* cu_q;                                                 // [batch + 1]
  const std::int64_t* cu_k;                                                 // [batch + 1]
  // Mask m = seq * mask_heads + head: its block row r lists the key blocks
  // col_idx[row_ptr[mask_row[m] + r] .. row_ptr[mask_row[m] + r + 1]), ascending.
  const std::int32_t* mask_row;
  const std::int32_t* row_ptr;
  const std::int32_t* col_idx;
  const tile* tiles;  // in launch order (most work first); block x = tile index * heads + head
  std::int32_t heads, mask_heads, block;
  bool causal;
  float scale_log2;  // scale * log2(e)
};

}  // namespace trisparse::cuda::block_sparse
