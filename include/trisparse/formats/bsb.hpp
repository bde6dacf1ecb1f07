#pragma once
/// @file Binary Sparse Block (BSB), the Fused3S paper's format: row windows of 16 rows; per window
/// the columns that hold a nonzero, compacted and sorted; the compacted window cut into
/// tensor-core blocks (TCBs) of 16 x tcb_cols whose pattern is a 128- or 256-bit bitmap.
#include <cstdint>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse {

/// Non-owning view of a BSB, as kernels take it (trivially copyable).
struct bsb_view {
  std::int64_t rows, cols, windows, tcbs;
  int tcb_cols, words_per_tcb;
  const std::int64_t* tcb_offset;    ///< [windows + 1]
  const std::int32_t* col_idx;       ///< [tcbs * tcb_cols]
  const std::uint64_t* bitmap;       ///< [tcbs * words_per_tcb]
  const std::int32_t* window_order;  ///< [windows]
};

struct bsb {
  static constexpr int kRowWindow = 16;
  /// Column slot that pads the last TCB of a window (its bitmap column is empty).
  static constexpr std::int32_t kPadColumn = -1;

  std::int64_t rows = 0, cols = 0;
  int tcb_cols = 8;                         ///< 8 (16x8 TCBs, 128-bit bitmaps) or 16 (256-bit)
  std::vector<std::int64_t> tcb_offset{0};  ///< TCB range of each window (the paper's tro)
  std::vector<std::int32_t> col_idx;        ///< original column of each compacted slot (sptd)
  std::vector<std::uint64_t> bitmap;        ///< bit (r * tcb_cols + c) of a TCB: row r, slot c
  std::vector<std::int32_t> window_order;   ///< windows by decreasing TCB count (stable)

  std::int64_t windows() const { return static_cast<std::int64_t>(tcb_offset.size()) - 1; }
  std::int64_t tcbs() const { return tcb_offset.back(); }
  int words_per_tcb() const { return kRowWindow * tcb_cols / 64; }
  std::int64_t window_tcbs(std::int64_t w) const { return tcb_offset[w + 1] - tcb_offset[w]; }
  bool test(std::int64_t tcb, int r, int c) const {
    const int bit = r * tcb_cols + c;
    return (bitmap[tcb * words_per_tcb() + bit / 64] >> (bit % 64)) & 1u;
  }
  /// Bytes held by the format's arrays.
  std::int64_t bytes() const;
  bsb_view view() const;
  /// @throws invalid_input naming the first broken invariant (offsets, slot order, padding,
  /// bitmap bits outside the matrix or on padding slots, every TCB non-empty, order a permutation).
  void check() const;
};

/// Builds the BSB of a CSR pattern (values are ignored: BSB is binary). tcb_cols is 8 or 16.
bsb build_bsb(const csr_graph& pattern, int tcb_cols = 8);

/// The number of TCBs build_bsb would make, without building the format (O(nnz), parallel).
std::int64_t count_tcbs(const csr_graph& pattern, int tcb_cols = 8);

/// The exact pattern back (no values).
csr_graph to_csr(const bsb& format);

}  // namespace trisparse
