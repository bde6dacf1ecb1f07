#pragma once
/// @file Seeded, deterministic pattern generators (identical output on every platform).
#include <cstdint>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse {

/// R-MAT / Kronecker power-law graph: 2^scale nodes, about edge_factor * 2^scale distinct edges
/// before symmetrization. Quadrant probabilities a, b, c, d = 1 - a - b - c.
struct rmat_options {
  int scale = 16;
  double edge_factor = 16;
  double a = 0.57, b = 0.19, c = 0.19;
  bool symmetrize = true;
  bool remove_self_loops = true;
  std::uint64_t seed = 1;
};
csr_graph generate_rmat(const rmat_options& options);

/// Erdős–Rényi G(n, m) with m = round(avg_degree * n) distinct directed edges (rows x cols).
struct erdos_renyi_options {
  std::int64_t rows = 1024;
  std::int64_t cols = -1;  ///< -1: square
  double avg_degree = 8;
  std::uint64_t seed = 1;
};
csr_graph generate_erdos_renyi(const erdos_renyi_options& options);

/// How generate_sparse_matrix draws row lengths (mean `avg_row` before clipping at the columns a
/// row may use): all equal; uniform integers in [0, 2 avg_row]; Pareto with tail exponent
/// `exponent` (P(length >= k) = (k_min / k)^exponent, rounded up).
enum class row_length_law { constant, uniform, power_law };

/// A sparse matrix with a chosen row-length distribution and column placement, a stand-in for the
/// classes of the SuiteSparse collection: constant lengths in a band (FEM, structural), power-law
/// lengths at random columns (circuit, web), uniform lengths on a wide matrix with a few dense
/// rows (linear programs). Binary (no values); columns distinct and sorted within a row.
struct sparse_matrix_options {
  std::int64_t rows = 10000;
  std::int64_t cols = -1;  ///< -1: square
  double avg_row = 16;
  row_length_law lengths = row_length_law::uniform;
  double exponent = 1.5;  ///< power_law only; > 1
  /// > 0: row i's columns lie within `band` of its diagonal column i * cols / rows; 0: anywhere.
  std::int64_t band = 0;
  /// Rows (spread evenly) that hold half of all columns, whatever the law and the band.
  std::int64_t dense_rows = 0;
  std::uint64_t seed = 1;
};
/// @throws invalid_input on negative sizes, avg_row < 0 or exponent <= 1 with power_law.
csr_graph generate_sparse_matrix(const sparse_matrix_options& options);

/// Many small graphs in one block-diagonal pattern with a graph pointer.
struct batch_options {
  std::int64_t graphs = 1024;
  std::int64_t min_nodes = 10;
  std::int64_t max_nodes = 40;
  double avg_degree = 3;  ///< undirected degree; every graph is symmetric
  std::uint64_t seed = 1;
};
struct batched_graph {
  csr_graph graph;
  std::vector<std::int64_t>
      graph_ptr;  ///< graphs + 1 node offsets; graph g owns [ptr[g], ptr[g+1])
};
batched_graph generate_batch(const batch_options& options);

/// Sequence attention masks over n tokens; the parts combine (BigBird = window + global + random).
struct sequence_mask_options {
  std::int64_t n = 1024;
  std::int64_t window = 0;  ///< attend to j with |i - j| <= window * dilation, j ≡ i (mod dilation)
  std::int64_t dilation = 1;        ///< 1 = sliding window; > 1 = dilated / strided
  std::int64_t global_tokens = 0;   ///< the first g tokens attend to all and are attended by all
  std::int64_t random_per_row = 0;  ///< extra uniformly random keys per query
  bool causal = false;              ///< keep only j <= i
  std::uint64_t seed = 1;
};
csr_graph generate_sequence_mask(const sequence_mask_options& options);

/// Convenience forms of generate_sequence_mask.
csr_graph sliding_window_mask(std::int64_t n, std::int64_t window, bool causal = false);
csr_graph dilated_mask(std::int64_t n, std::int64_t window, std::int64_t dilation);
csr_graph global_mask(std::int64_t n, std::int64_t global_tokens);
csr_graph bigbird_mask(std::int64_t n, std::int64_t window, std::int64_t global_tokens,
                       std::int64_t random_per_row, std::uint64_t seed);
csr_graph causal_mask(std::int64_t n);

/// A mask at block granularity: blocks is a ceil(rows/block) x ceil(cols/block) pattern.
struct block_mask {
  std::int64_t rows = 0, cols = 0;
  std::int64_t block = 1;
  csr_graph blocks;
  /// @throws invalid_input on broken invariants.
  void check() const;
  /// The element pattern (every element of every kept block, clipped at rows/cols).
  csr_graph expand() const;
};

/// The blocked-sparse report's random mask: each G x G block of an N x N matrix kept with
/// probability 1 - p; keep_diagonal also keeps every diagonal block so no block row is empty.
struct block_random_options {
  std::int64_t n = 4096;
  double p = 0.9;  ///< fraction of blocks dropped
  std::int64_t block = 64;
  bool keep_diagonal = true;
  bool causal = false;  ///< only blocks on or below the diagonal
  std::uint64_t seed = 1;
};
block_mask generate_block_random(const block_random_options& options);

}  // namespace trisparse
