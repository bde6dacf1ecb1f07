#pragma once
/// @file The sparse pattern as the user has it: CSR and COO, and the builders between them.
#include <cstdint>
#include <span>
#include <vector>

#include "trisparse/core/tensor.hpp"

namespace trisparse {

/// A rows x cols sparse matrix in CSR: 64-bit row offsets, 32-bit column indices, optional values.
/// Rectangular patterns are allowed (rows = queries, cols = keys).
/// Invariants (check()): row_ptr has rows + 1 entries, starts at 0, is non-decreasing and ends at
/// nnz; every column is in [0, cols); columns are strictly increasing within a row (sorted, no
/// duplicates); values are empty or have nnz entries, all finite.
struct csr_graph {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<std::int64_t> row_ptr{0};
  std::vector<std::int32_t> col_idx;
  std::vector<float> values;

  std::int64_t nnz() const { return static_cast<std::int64_t>(col_idx.size()); }
  bool has_values() const { return !values.empty(); }
  std::int64_t degree(std::int64_t r) const { return row_ptr[r + 1] - row_ptr[r]; }
  /// @throws invalid_input naming the first broken invariant.
  void check() const;
  bool operator==(const csr_graph&) const = default;
};

/// A CSR pattern in memory the caller owns, for example on a GPU: row_ptr[rows + 1] offsets,
/// col_idx[nnz] columns. Plans built from it accept columns that are unsorted or repeated within
/// a row (repeats are merged: patterns are binary). The pointers must stay valid during the build.
struct csr_view {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t nnz = 0;
  const std::int64_t* row_ptr = nullptr;
  const std::int32_t* col_idx = nullptr;
  device_kind where = device_kind::cuda;
};

/// A rows x cols sparse matrix as an edge list (src = row, dst = column), in any order, with
/// duplicates allowed. Invariants (check()): src and dst have the same length, ids in range,
/// values empty or one per edge.
struct coo_graph {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<std::int64_t> src;
  std::vector<std::int64_t> dst;
  std::vector<float> values;

  std::int64_t nnz() const { return static_cast<std::int64_t>(src.size()); }
  /// @throws invalid_input naming the first broken invariant.
  void check() const;
};

/// What to do with self loops (i, i) when building a CSR.
enum class self_loops : std::uint8_t { keep, add, remove };

/// Preprocessing applied by to_csr.
struct build_options {
  bool symmetrize = false;              ///< add (j, i) for every (i, j); needs rows == cols
  self_loops loops = self_loops::keep;  ///< add: every i < min(rows, cols) gets (i, i)
  bool sum_duplicates = true;           ///< merged duplicates sum their values (else keep first)
};

/// Builds a CSR with sorted, duplicate-free rows from a COO (O(nnz) bucketing + per-row sort).
/// @throws invalid_input if the COO is broken, or symmetrize is asked of a rectangular matrix.
csr_graph to_csr(const coo_graph& coo, const build_options& options = {});

/// Re-applies preprocessing to a CSR (same rules as to_csr).
csr_graph preprocess(const csr_graph& g, const build_options& options);

/// The COO of a CSR, in row-major order.
coo_graph to_coo(const csr_graph& g);

/// The cols x rows transpose (values follow their entries).
csr_graph transpose(const csr_graph& g);

/// The given rows of g, in the given order, as a pattern of rows.size() rows and g.cols columns
/// (values follow). For checking a sample of rows against a reference.
/// @throws invalid_input if a row is out of range.
csr_graph select_rows(const csr_graph& g, std::span<const std::int64_t> rows);

/// Degree statistics of the rows.
struct degree_stats {
  std::int64_t min = 0, max = 0;
  double mean = 0, stddev = 0;
  std::int64_t empty_rows = 0;
  std::int64_t self_loops = 0;
  bool symmetric = false;  ///< pattern equals its transpose (square only)
};
degree_stats compute_degree_stats(const csr_graph& g);

}  // namespace trisparse
