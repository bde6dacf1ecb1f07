#pragma once
/// @file ME-BCRS, the FlashSparse paper's format: windows of `vector_rows` (8 or 16) rows; per
/// window the nonzero column vectors (columns with a nonzero in the window), sorted; values stored
/// per tensor-core block of `block_cols` vectors, row-major within the block, without padding the
/// last block (its width is the residue vectors % block_cols).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse {

struct me_bcrs_view {
  std::int64_t rows, cols, windows, vectors;
  int vector_rows, block_cols;
  const std::int64_t* row_ptr;  ///< [windows + 1], in vectors
  const std::int32_t* col_idx;  ///< [vectors]
  const float* values;          ///< [vectors * vector_rows]
};

/// A stored value of exactly 0 means "no entry"; a binary pattern stores 1 at every entry.
struct me_bcrs {
  std::int64_t rows = 0, cols = 0;
  int vector_rows = 8;  ///< 8 (the paper's 8x1 vectors) or 16 (the 16x1 ablation)
  int block_cols = 8;   ///< vectors per tensor-core block: 8 (FP16 k=8) or 4 (TF32 k=4)
  std::vector<std::int64_t> row_ptr{0};
  std::vector<std::int32_t> col_idx;
  std::vector<float> values;

  std::int64_t windows() const { return static_cast<std::int64_t>(row_ptr.size()) - 1; }
  std::int64_t vectors() const { return row_ptr.back(); }
  /// Index into values of row r (0..vector_rows) of vector v of window w (v counted from the
  /// window's first vector): block b = v / block_cols, width = block_cols or the residue.
  std::int64_t value_index(std::int64_t w, std::int64_t v, int r) const {
    const std::int64_t start = row_ptr[w];
    const std::int64_t n = row_ptr[w + 1] - start;
    const std::int64_t block_start = (v / block_cols) * block_cols;
    const std::int64_t width = std::min<std::int64_t>(block_cols, n - block_start);
    return (start + block_start) * vector_rows + r * width + (v - block_start);
  }
  /// Bytes of the arrays (32-bit values) and, for comparison, of the padded SR-BCRS layout.
  std::int64_t bytes() const;
  std::int64_t sr_bcrs_bytes() const;
  me_bcrs_view view() const;
  void check() const;
};

me_bcrs build_me_bcrs(const csr_graph& g, int vector_rows = 8, int block_cols = 8);
/// The pattern back (with values when the source had them; entries whose value is 0 are dropped).
csr_graph to_csr(const me_bcrs& format, bool with_values = true);

}  // namespace trisparse
