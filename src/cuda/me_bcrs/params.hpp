#pragma once
// Host <-> kernel parameters of the ME-BCRS kernels (SpMM, SDDMM, softmax): plain data.
#include <cstdint>

#include "../common/work_item.hpp"

namespace trisparse::cuda::me_bcrs {

/// The device ME-BCRS and its work list as the kernels read them. Per-edge value arrays are in
/// the format's slot layout, one array per head (slot stride 1, `*_head` elements apart).
struct format_ref {
  const std::int64_t* row_ptr;       // [windows + 1], in vectors
  const std::int32_t* col_idx;       // [vectors]
  const std::uint32_t* mask;         // [vectors]: bit r = window row r has an entry
  const float* values;               // [slots]: the pattern's values
  const std::int64_t* block_offset;  // [windows + 1], in blocks of 8 vectors
  std::int64_t rows;
  const std::int64_t* row_map;  // [rows]: window row i is pattern row row_map[i]; null = identity
  const work_item* items;       // blocks are 8-vector blocks, largest items first
  std::int64_t num_items;
  const split_window* splits;
  std::int64_t team_items;  // the leading items that one thread block's warps share (SpMM)
  bool binary;              // every entry's value is 1 (`values` holds 1 or 0)
};

/// A dense [rows, heads, dim] operand as the kernels read it (dim stride 1), or a per-edge one in
/// slot layout (row stride 1).
template <class P>
struct strided {
  P data;
  std::int64_t row, head;
};
using in_ref = strided<const void*>;
using out_ref = strided<void*>;

/// c[:, h, f_begin + chunk * 16 kTiles ...] = A_h b_h, A_h's values from `a` (slot layout).
struct spmm_params {
  format_ref f;
  in_ref a, b;
  out_ref c;
  std::int64_t n;        // features (b's and c's dim)
  std::int64_t f_begin;  // first feature of this launch
  std::int32_t chunks, heads;
  bool aligned;               // b and c rows allow 16-byte vector access
  float* part;                // split windows' partial c: [parts, heads, vector_rows, n]
  std::int32_t* split_count;  // [splits, heads, chunks]: parts done; the merger resets it
};

/// out = scale * A ⊙ (x y^T) in slot layout; slots without an entry get 0.
struct sddmm_params {
  format_ref f;
  in_ref x, y;
  out_ref out;
  std::int64_t d;
  std::int32_t heads;
  float scale;
  bool aligned;    // x and y rows allow 16-byte vector access
  bool split_f32;  // f32 x, y: three tf32 products per step (about float32 accuracy)
};

/// Row softmax over the entries, slot layout in and out; slots without an entry get 0.
struct softmax_params {
  format_ref f;
  in_ref in;
  out_ref out;
  std::int32_t heads;
  float* part_stats;  // split windows' per-part (max, sum): [parts, heads, vector_rows, 2]
};

}  // namespace trisparse::cuda::me_bcrs
