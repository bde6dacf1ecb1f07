#include <numeric>

#include "support.hpp"

namespace trisparse {
namespace {

coo_graph small_coo() {
  coo_graph c;
  c.rows = c.cols = 4;
  c.src = {0, 0, 1, 3, 0, 2, 2};
  c.dst = {2, 1, 1, 0, 2, 3, 2};  // (0,2) twice, loops (1,1), (2,2)
  return c;
}

TEST(Csr, BuildSortsAndMergesDuplicates) {
  const csr_graph g = to_csr(small_coo());
  g.check();
  EXPECT_EQ(g.row_ptr, (std::vector<std::int64_t>{0, 2, 3, 5, 6}));
  EXPECT_EQ(g.col_idx, (std::vector<std::int32_t>{1, 2, 1, 2, 3, 0}));
}

TEST(Csr, SelfLoopsAddRemoveKeep) {
  const csr_graph removed = to_csr(small_coo(), {.loops = self_loops::remove});
  for (std::int64_t r = 0; r < removed.rows; ++r) {
    for (std::int64_t e = removed.row_ptr[r]; e < removed.row_ptr[r + 1]; ++e)
      EXPECT_NE(removed.col_idx[e], r);
  }
  const csr_graph added = to_csr(small_coo(), {.loops = self_loops::add});
  EXPECT_EQ(compute_degree_stats(added).self_loops, 4);
  EXPECT_EQ(added.nnz(), 6 + 2);  // loops at 0 and 3 are new; 1 and 2 existed
}

TEST(Csr, WeightedDuplicatesSumAndAddedLoopsDoNotDisturbStoredOnes) {
  coo_graph c;
  c.rows = c.cols = 2;
  c.src = {0, 0, 1};
  c.dst = {1, 1, 1};
  c.values = {1.5f, 2.0f, 7.0f};
  const csr_graph g = to_csr(c, {.loops = self_loops::add});
  EXPECT_EQ(g.col_idx, (std::vector<std::int32_t>{0, 1, 1}));
  EXPECT_EQ(g.values, (std::vector<float>{1.0f, 3.5f, 7.0f}));
}

TEST(Csr, SymmetrizeGivesTheTransposeUnion) {
  const csr_graph g = to_csr(small_coo(), {.symmetrize = true});
  EXPECT_TRUE(compute_degree_stats(g).symmetric);
  const csr_graph t = transpose(g);
  EXPECT_EQ(t.col_idx, g.col_idx);
  coo_graph rect = small_coo();
  rect.cols = 5;
  EXPECT_THROW(to_csr(rect, {.symmetrize = true}), invalid_input);
}

TEST(Csr, RectangularTransposeRoundTrips) {
  const csr_graph g = test::random_pattern(37, 91, 12, 3, true);
  const csr_graph tt = transpose(transpose(g));
  EXPECT_EQ(tt, g);
  EXPECT_EQ(transpose(g).rows, 91);
}

TEST(Csr, CheckCatchesEachBrokenInvariant) {
  const csr_graph good = test::random_pattern(20, 20, 5, 1, true);
  good.check();
  auto broken = [&](auto mutate) {
    csr_graph g = good;
    mutate(g);
    EXPECT_THROW(g.check(), invalid_input);
  };
  broken([](csr_graph& g) { g.row_ptr.pop_back(); });
  broken([](csr_graph& g) { g.row_ptr[0] = 1; });
  broken([](csr_graph& g) { g.row_ptr.back() += 1; });
  broken([](csr_graph& g) {
    std::swap(g.row_ptr[3], g.row_ptr[4]);
    if (g.row_ptr[3] == g.row_ptr[4]) g.row_ptr[3] += 1;
  });
  broken([](csr_graph& g) { g.col_idx[0] = 20; });
  broken([](csr_graph& g) { g.col_idx[0] = -1; });
  broken([](csr_graph& g) { g.values.pop_back(); });
  broken([](csr_graph& g) { g.values[0] = std::nanf(""); });
  broken([](csr_graph& g) {  // an unsorted row
    for (std::int64_t r = 0; r < g.rows; ++r) {
      if (g.degree(r) >= 2) {
        std::swap(g.col_idx[g.row_ptr[r]], g.col_idx[g.row_ptr[r] + 1]);
        return;
      }
    }
  });
}

TEST(Csr, CooCheckRejectsOutOfRange) {
  coo_graph c = small_coo();
  c.dst[0] = 4;
  EXPECT_THROW(to_csr(c), invalid_input);
}

TEST(Csr, SelectRowsKeepsEachRowAndItsValues) {
  const csr_graph g = test::random_pattern(50, 70, 9, 21, true);
  const std::vector<std::int64_t> rows{49, 3, 3, 0};
  const csr_graph s = select_rows(g, rows);
  s.check();
  ASSERT_EQ(s.rows, 4);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    ASSERT_EQ(s.degree(static_cast<std::int64_t>(i)), g.degree(rows[i]));
    for (std::int64_t k = 0; k < s.degree(static_cast<std::int64_t>(i)); ++k) {
      EXPECT_EQ(s.col_idx[s.row_ptr[i] + k], g.col_idx[g.row_ptr[rows[i]] + k]);
      EXPECT_EQ(s.values[s.row_ptr[i] + k], g.values[g.row_ptr[rows[i]] + k]);
    }
  }
  const std::vector<std::int64_t> bad{50};
  EXPECT_THROW(select_rows(g, bad), invalid_input);
}

TEST(Csr, DegreeStats) {
  const csr_graph g = to_csr(small_coo());
  const degree_stats s = compute_degree_stats(g);
  EXPECT_EQ(s.min, 1);
  EXPECT_EQ(s.max, 2);
  EXPECT_DOUBLE_EQ(s.mean, 1.5);
  EXPECT_EQ(s.self_loops, 2);
  EXPECT_FALSE(s.symmetric);
}

}  // namespace
}  // namespace trisparse

namespace trisparse {
namespace {

TEST(Reorder, RcmIsAPermutationThatRecoversABandedOrder) {
  // A path 0-1-2-...-n-1 with its node ids shuffled: RCM puts neighbours next to each other.
  const std::int64_t n = 500;
  std::vector<std::int64_t> label(n);
  std::iota(label.begin(), label.end(), 0);
  rng r(3);
  for (std::int64_t i = n - 1; i > 0; --i)
    std::swap(label[i],
              label[static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(i + 1)))]);
  coo_graph coo{.rows = n, .cols = n, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t i = 0; i + 1 < n; ++i) {
    coo.src.push_back(label[i]);
    coo.dst.push_back(label[i + 1]);
  }
  const csr_graph g = to_csr(coo, {.symmetrize = true});
  const auto order = reverse_cuthill_mckee(g);
  std::vector<std::int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i);
  std::vector<std::int64_t> position(n);
  for (std::int64_t i = 0; i < n; ++i) position[order[i]] = i;
  for (std::int64_t i = 0; i + 1 < n; ++i)
    EXPECT_EQ(std::abs(position[label[i]] - position[label[i + 1]]), 1);  // bandwidth 1
  // Fewer TCBs than the shuffled order, and count_tcbs agrees with the built format.
  const csr_graph permuted = select_rows(g, order);
  EXPECT_LT(count_tcbs(permuted), count_tcbs(g));
  EXPECT_EQ(count_tcbs(g), build_bsb(g).tcbs());
  EXPECT_EQ(count_tcbs(permuted, 16), build_bsb(permuted, 16).tcbs());
  EXPECT_THROW(reverse_cuthill_mckee(test::random_pattern(10, 12, 3, 1)), invalid_input);
  EXPECT_TRUE(reverse_cuthill_mckee(csr_graph{}).empty());
}

TEST(Reorder, ClusteredWindowsGroupRowsThatShareColumns) {
  // 8 groups of 8 rows; the rows of group k all hold columns {10k .. 10k + 9}, but the groups are
  // interleaved (row i is in group i % 8), so every window of 8 consecutive rows holds 8 groups:
  // 80 vectors per window. Grouped, a window holds one group: 10 vectors.
  const std::int64_t n = 64;
  coo_graph coo{.rows = n, .cols = 80, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t c = 0; c < 10; ++c) {
      coo.src.push_back(i);
      coo.dst.push_back(10 * (i % 8) + c);
    }
  }
  const csr_graph g = to_csr(coo);
  EXPECT_EQ(count_window_columns(g, 8), 8 * 80);
  const auto order = cluster_rows(g, 8);
  std::vector<std::int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(count_window_columns(g, 8, order), 8 * 10);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(order[i] % 8, order[i / 8 * 8] % 8) << i;
  // Seeds fix where windows start; the result is deterministic and still a permutation.
  std::vector<std::int64_t> seeds(n);
  std::iota(seeds.rbegin(), seeds.rend(), 0);
  const auto seeded = cluster_rows(g, 8, seeds);
  EXPECT_EQ(seeded.front(), n - 1);
  EXPECT_EQ(count_window_columns(g, 8, seeded), 8 * 10);
  EXPECT_EQ(cluster_rows(g, 8, seeds), seeded);
  // On a random pattern: a permutation with no more vectors than the original order's.
  const csr_graph r = test::random_pattern(700, 500, 12, 5, true);
  const auto ro = cluster_rows(r, 8, {}, 16);
  EXPECT_EQ(static_cast<std::int64_t>(ro.size()), r.rows);
  EXPECT_LE(count_window_columns(r, 8, ro), count_window_columns(r, 8));
  EXPECT_THROW(cluster_rows(g, 8, std::vector<std::int64_t>(n, 0)), invalid_input);
  EXPECT_THROW(cluster_rows(g, 0), invalid_input);
  EXPECT_THROW(count_window_columns(g, 8, std::vector<std::int64_t>(n, n)), invalid_input);
  EXPECT_EQ(parse_row_order("clustered"), row_order::clustered);
  EXPECT_THROW(parse_row_order("zigzag"), invalid_input);
}

}  // namespace
}  // namespace trisparse
