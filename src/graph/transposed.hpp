#pragma once
// The transpose of a pattern that remembers where each entry came from (the GAT layer's backward
// walks columns but reads and writes per-entry values in the pattern's own order).
#include <cstdint>
#include <utility>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse::detail {

struct transposed_pattern {
  std::vector<std::int64_t> col_ptr;  // [cols + 1]
  std::vector<std::int32_t> row_idx;  // [nnz]: each column's rows, in row order
  std::vector<std::int64_t> entry;    // [nnz]: the entry of g each one is
};

// A counting sort over the columns: each column's rows come in row order.
inline transposed_pattern transposed_of(const csr_graph& g) {
  transposed_pattern t;
  t.col_ptr.assign(static_cast<std::size_t>(g.cols) + 1, 0);
  for (const std::int32_t c : g.col_idx) ++t.col_ptr[static_cast<std::size_t>(c) + 1];
  for (std::int64_t c = 0; c < g.cols; ++c) t.col_ptr[c + 1] += t.col_ptr[c];
  t.row_idx.resize(static_cast<std::size_t>(g.nnz()));
  t.entry.resize(static_cast<std::size_t>(g.nnz()));
  std::vector<std::int64_t> next(t.col_ptr.begin(), t.col_ptr.end() - 1);
  for (std::int64_t r = 0; r < g.rows; ++r) {
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      const std::int64_t at = next[g.col_idx[e]]++;
      t.row_idx[at] = static_cast<std::int32_t>(r);
      t.entry[at] = e;
    }
  }
  return t;
}

// The transpose of a binary pattern as a CSR graph, and the entry of g that each of its entries is.
inline std::pair<csr_graph, std::vector<std::int64_t>> transpose_with_entries(const csr_graph& g) {
  transposed_pattern t = transposed_of(g);
  csr_graph b;
  b.rows = g.cols;
  b.cols = g.rows;
  b.row_ptr = std::move(t.col_ptr);
  b.col_idx = std::move(t.row_idx);
  return {std::move(b), std::move(t.entry)};
}

}  // namespace trisparse::detail
