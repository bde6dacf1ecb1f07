#include <algorithm>
#include <cstdlib>
#include <set>

#include "support.hpp"

namespace trisparse {
namespace {

TEST(Generate, RmatIsDeterministicSymmetricSkewedAndLoopFree) {
  const rmat_options o{.scale = 12, .edge_factor = 8, .seed = 5};
  const csr_graph a = generate_rmat(o), b = generate_rmat(o);
  EXPECT_EQ(a, b);
  rmat_options o2 = o;
  o2.seed = 6;
  EXPECT_NE(generate_rmat(o2), a);
  const degree_stats s = compute_degree_stats(a);
  EXPECT_TRUE(s.symmetric);
  EXPECT_EQ(s.self_loops, 0);
  EXPECT_GT(static_cast<double>(s.max), 10 * s.mean);  // power law: hubs far above the mean
  EXPECT_GT(a.nnz(), 4096 * 8);                        // most of 2 * 8 * 4096 survive dedup
}

TEST(Generate, ErdosRenyiHasTheRequestedEdgeCount) {
  const csr_graph g = generate_erdos_renyi({.rows = 1000, .cols = 700, .avg_degree = 5, .seed = 2});
  EXPECT_EQ(g.nnz(), 5000);
  EXPECT_EQ(g.cols, 700);
  const csr_graph dense = generate_erdos_renyi({.rows = 50, .avg_degree = 40, .seed = 2});
  EXPECT_NEAR(static_cast<double>(dense.nnz()), 2000, 200);
}

TEST(Generate, SparseMatricesHaveTheirRowLengthLawAndPlacement) {
  // FEM-like: constant lengths within a band of the diagonal (clipped at the matrix's edges).
  const sparse_matrix_options fem{
      .rows = 3000, .avg_row = 20, .lengths = row_length_law::constant, .band = 30, .seed = 3};
  const csr_graph a = generate_sparse_matrix(fem);
  ASSERT_NO_THROW(a.check());
  EXPECT_EQ(a, generate_sparse_matrix(fem));
  sparse_matrix_options other = fem;
  other.seed = 4;
  EXPECT_NE(a, generate_sparse_matrix(other));
  EXPECT_FALSE(a.has_values());
  for (std::int64_t i = 0; i < a.rows; ++i) {
    EXPECT_EQ(a.degree(i), 20);
    for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e)
      ASSERT_LE(std::abs(a.col_idx[e] - i), 30) << "row " << i;
  }
  // A band narrower than the length: the row takes the whole band.
  const csr_graph full = generate_sparse_matrix(
      {.rows = 100, .avg_row = 50, .lengths = row_length_law::constant, .band = 10});
  EXPECT_EQ(full.degree(50), 21);
  EXPECT_EQ(full.degree(0), 11);

  // Uniform lengths in [0, 2 avg] on a wide matrix, with dense rows of half the columns.
  const csr_graph lp = generate_sparse_matrix({.rows = 20000,
                                               .cols = 50000,
                                               .avg_row = 8,
                                               .lengths = row_length_law::uniform,
                                               .dense_rows = 4,
                                               .seed = 5});
  ASSERT_NO_THROW(lp.check());
  EXPECT_EQ(lp.cols, 50000);
  std::int64_t dense = 0, max_sparse = 0, sum_sparse = 0;
  for (std::int64_t i = 0; i < lp.rows; ++i) {
    if (lp.degree(i) == 25000) {
      ++dense;
    } else {
      max_sparse = std::max(max_sparse, lp.degree(i));
      sum_sparse += lp.degree(i);
    }
  }
  EXPECT_EQ(dense, 4);
  EXPECT_EQ(max_sparse, 16);
  EXPECT_NEAR(static_cast<double>(sum_sparse) / static_cast<double>(lp.rows - 4), 8.0, 0.2);

  // Power law: a median below the mean and a tail far above it.
  const csr_graph web = generate_sparse_matrix(
      {.rows = 50000, .avg_row = 10, .lengths = row_length_law::power_law, .exponent = 1.5});
  ASSERT_NO_THROW(web.check());
  std::vector<std::int64_t> lengths;
  for (std::int64_t i = 0; i < web.rows; ++i) lengths.push_back(web.degree(i));
  std::sort(lengths.begin(), lengths.end());
  const double mean = static_cast<double>(web.nnz()) / static_cast<double>(web.rows);
  EXPECT_GT(mean, 7.0);
  EXPECT_LT(static_cast<double>(lengths[lengths.size() / 2]), mean);
  EXPECT_GT(static_cast<double>(lengths.back()), 50 * mean);

  EXPECT_THROW(generate_sparse_matrix({.lengths = row_length_law::power_law, .exponent = 1.0}),
               invalid_input);
  EXPECT_THROW(generate_sparse_matrix({.rows = -1}), invalid_input);
}

TEST(Generate, BatchIsBlockDiagonalAndSymmetric) {
  const batched_graph b =
      generate_batch({.graphs = 100, .min_nodes = 5, .max_nodes = 30, .seed = 4});
  ASSERT_EQ(b.graph_ptr.size(), 101u);
  EXPECT_EQ(b.graph_ptr.back(), b.graph.rows);
  EXPECT_TRUE(compute_degree_stats(b.graph).symmetric);
  for (std::size_t g = 0; g + 1 < b.graph_ptr.size(); ++g) {
    EXPECT_GE(b.graph_ptr[g + 1] - b.graph_ptr[g], 5);
    EXPECT_LE(b.graph_ptr[g + 1] - b.graph_ptr[g], 30);
    for (std::int64_t r = b.graph_ptr[g]; r < b.graph_ptr[g + 1]; ++r) {
      EXPECT_GT(b.graph.degree(r), 0) << "the spanning path connects every node";
      for (std::int64_t e = b.graph.row_ptr[r]; e < b.graph.row_ptr[r + 1]; ++e) {
        ASSERT_GE(b.graph.col_idx[e], b.graph_ptr[g]);
        ASSERT_LT(b.graph.col_idx[e], b.graph_ptr[g + 1]);
      }
    }
  }
}

TEST(Generate, SequenceMasksHaveTheirDefiningProperty) {
  const std::int64_t n = 200;
  const csr_graph win = sliding_window_mask(n, 3);
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(win.degree(i),
              std::min<std::int64_t>(n - 1, i + 3) - std::max<std::int64_t>(0, i - 3) + 1);
  }
  const csr_graph dil = dilated_mask(n, 2, 5);
  for (std::int64_t e = dil.row_ptr[100]; e < dil.row_ptr[101]; ++e)
    EXPECT_EQ((dil.col_idx[e] - 100) % 5, 0);
  EXPECT_EQ(dil.degree(100), 5);
  const csr_graph causal = causal_mask(n);
  EXPECT_EQ(causal.nnz(), n * (n + 1) / 2);
  const csr_graph glob = global_mask(n, 2);
  EXPECT_EQ(glob.degree(0), n);
  EXPECT_EQ(glob.degree(150), 3);  // the two global tokens and itself (window 0)
  const csr_graph bb = bigbird_mask(n, 2, 1, 3, 9);
  for (std::int64_t i = 1; i < n; ++i) {
    std::set<std::int32_t> cols(bb.col_idx.begin() + bb.row_ptr[i],
                                bb.col_idx.begin() + bb.row_ptr[i + 1]);
    EXPECT_TRUE(cols.count(0));  // the global token
    for (std::int64_t j = std::max<std::int64_t>(0, i - 2);
         j <= std::min<std::int64_t>(n - 1, i + 2); ++j) {
      EXPECT_TRUE(cols.count(static_cast<std::int32_t>(j)));
    }
  }
  const csr_graph causal_bb = generate_sequence_mask(
      {.n = n, .window = 4, .global_tokens = 2, .random_per_row = 3, .causal = true});
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t e = causal_bb.row_ptr[i]; e < causal_bb.row_ptr[i + 1]; ++e)
      EXPECT_LE(causal_bb.col_idx[e], i);
  }
}

TEST(Generate, BlockRandomKeepsAboutOneMinusPAndTheDiagonal) {
  const block_mask m = generate_block_random({.n = 4096, .p = 0.9, .block = 32, .seed = 3});
  m.check();
  const double nb = 128.0;
  EXPECT_NEAR(static_cast<double>(m.blocks.nnz()) / (nb * nb), 0.1 + 0.9 / nb, 0.01);
  for (std::int64_t i = 0; i < m.blocks.rows; ++i) {
    EXPECT_TRUE(std::binary_search(m.blocks.col_idx.begin() + m.blocks.row_ptr[i],
                                   m.blocks.col_idx.begin() + m.blocks.row_ptr[i + 1],
                                   static_cast<std::int32_t>(i)));
  }
  const block_mask ragged = generate_block_random({.n = 100, .p = 0.5, .block = 32, .seed = 1});
  const csr_graph e = ragged.expand();
  e.check();
  EXPECT_EQ(e.rows, 100);
  const block_mask causal =
      generate_block_random({.n = 512, .p = 0.0, .block = 64, .causal = true});
  EXPECT_EQ(causal.blocks.nnz(), 8 * 9 / 2);
}

}  // namespace
}  // namespace trisparse
