#pragma once
/// @file Block CSR at block size G. Values (optional) are in the blocked-sparse report's
/// row-interleaved layout: within a block row, the G-wide slices of all its blocks for one scalar
/// row are contiguous, so row t of block row B starts at G*G*row_ptr[B] + t*nb*G (nb = blocks in
/// the row) and block j's slice at + j*G.
#include <cstdint>
#include <vector>

#include "trisparse/graph/csr.hpp"
#include "trisparse/graph/generate.hpp"

namespace trisparse {

struct bcsr_view {
  std::int64_t rows, cols, block, block_rows, block_cols, blocks;
  const std::int64_t* row_ptr;
  const std::int32_t* col_idx;
  const float* values;  ///< null for a pure block mask
};

/// A stored value of exactly 0 means "no entry"; a binary pattern stores 1 at every entry.
struct bcsr {
  std::int64_t rows = 0, cols = 0, block = 1;
  std::vector<std::int64_t> row_ptr{0};
  std::vector<std::int32_t> col_idx;
  std::vector<float> values;  ///< empty (pure block mask) or blocks * block * block

  std::int64_t block_rows() const { return static_cast<std::int64_t>(row_ptr.size()) - 1; }
  std::int64_t block_cols() const { return (cols + block - 1) / block; }
  std::int64_t blocks() const { return static_cast<std::int64_t>(col_idx.size()); }
  std::int64_t value_index(std::int64_t block_row, std::int64_t j, std::int64_t t,
                           std::int64_t c) const {
    const std::int64_t nb = row_ptr[block_row + 1] - row_ptr[block_row];
    return block * block * row_ptr[block_row] + t * nb * block + j * block + c;
  }
  std::int64_t bytes() const;
  bcsr_view view() const;
  void check() const;
};

/// The blocks of size G that hold at least one entry (with a non-zero value) of g.
block_mask blocks_of(const csr_graph& g, std::int64_t block);

/// Element pattern -> BCSR with values (1 for a binary pattern, zero fill elsewhere).
bcsr build_bcsr(const csr_graph& g, std::int64_t block);
/// Block mask -> BCSR without values (every element of a kept block is active).
bcsr build_bcsr(const block_mask& mask);
/// The element pattern back: entries with a non-zero value, or (no values) every element of
/// every block, clipped at rows/cols.
csr_graph to_csr(const bcsr& format, bool with_values = true);

}  // namespace trisparse
