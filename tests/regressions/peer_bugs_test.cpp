// Regression tests named after the wrong results the peers give (../shared/anchors/README.md).
// On the CPU they pin the format builders and the reference semantics that the GPU kernels will
// be tested against.
#include <limits>

#include "support.hpp"

namespace trisparse {
namespace {

double max_rel_error_fused_vs_reference(const csr_graph& g, const test::qkv& x, double scale) {
  host_tensor ref(dtype::f64, g.rows, x.q.heads(), x.v.dim()),
      out(dtype::f32, g.rows, x.q.heads(), x.v.dim());
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), ref.view(), scale);
  cpu::fused_attention(g, x.q.view(), x.k.view(), x.v.view(), out.view(),
                       static_cast<float>(scale));
  const auto e = test::compare(out, ref);
  return e.finite ? e.relative() : std::numeric_limits<double>::infinity();
}

// Fused3S's GPU preprocessing misplaces edges of rows with more than 32 neighbours when N > 1024.
TEST(PeerBugs, Fused3sPreprocessingRowsOver32NeighboursWithNOver1024) {
  const csr_graph g = test::random_pattern(3000, 3000, 200, 11);
  ASSERT_GT(compute_degree_stats(g).max, 32);
  for (const int c : {8, 16}) {
    const bsb f = build_bsb(g, c);
    f.check();
    EXPECT_EQ(to_csr(f), g);
  }
  const auto x = test::random_qkv(g, 1, 32, dtype::f16, 2);
  host_tensor a(dtype::f64, g.rows, 1, 32), b(dtype::f64, g.rows, 1, 32);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), a.view(), 0.2);
  reference::blocked_attention(build_bsb(g), x.q.view(), x.k.view(), x.v.view(), b.view(), 0.2);
  EXPECT_LE(test::compare(b, a).relative(), 1e-13);
}

// Fused3S treats a score of exactly 0 as "no edge": with q = 0 every score is 0 and the output
// must be the plain mean of the neighbours' values, not zero.
TEST(PeerBugs, ScoreExactlyZeroIsStillAnEdge) {
  const csr_graph g = test::random_pattern(100, 100, 10, 3);
  auto x = test::random_qkv(g, 1, 8, dtype::f32, 4);
  x.q.fill(0.0);
  host_tensor out(dtype::f32, 100, 1, 8);
  cpu::fused_attention(g, x.q.view(), x.k.view(), x.v.view(), out.view(), 1.0f);
  for (std::int64_t r = 0; r < g.rows; ++r) {
    for (std::int64_t d = 0; d < 8; ++d) {
      double mean = 0;
      for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e)
        mean += x.v.get(g.col_idx[e] * 8 + d);
      mean = g.degree(r) > 0 ? mean / static_cast<double>(g.degree(r)) : 0.0;
      EXPECT_NEAR(out.get(r * 8 + d), mean, 1e-6);
    }
  }
}

// Fused3S starts the running max at 0: wrong when every score of a row is negative.
TEST(PeerBugs, RunningMaxStartsAtMinusInfinityAllNegativeScores) {
  const csr_graph g = test::random_pattern(300, 300, 40, 5);
  auto x = test::random_qkv(g, 1, 16, dtype::f32, 6, 0.5, 1.0);
  for (std::int64_t i = 0; i < x.q.numel(); ++i) x.q.set(i, -x.q.get(i) * 20);  // every score << 0
  EXPECT_LE(max_rel_error_fused_vs_reference(g, x, 1.0), 1e-5);
}

// Fused3S reads whole 16-row blocks of Q without a bound check. Under ASan these sizes fail on any
// read past the end; here they also must match the reference.
TEST(PeerBugs, UnpaddedRowCounts) {
  for (const std::int64_t n : {1, 17, 65537}) {
    const csr_graph g = test::random_pattern(n, n, 6, static_cast<std::uint64_t>(n));
    const auto x = test::random_qkv(g, 1, 16, dtype::f16, 7);
    EXPECT_LE(max_rel_error_fused_vs_reference(g, x, 0.25), 1e-5) << n;
    const bsb f = build_bsb(g);
    host_tensor a(dtype::f64, n, 1, 16);
    if (n <= 17)
      reference::blocked_attention(f, x.q.view(), x.k.view(), x.v.view(), a.view(), 0.25);
  }
}

// FlashSparse's naive softmax (exp without max-subtraction) overflows fp16 to NaN at d = 64, 128.
TEST(PeerBugs, NaiveSoftmaxOverflowLargeScores) {
  const csr_graph g = test::random_pattern(200, 200, 20, 8);
  for (const std::int64_t d : {64, 128}) {
    const auto x = test::random_qkv(g, 1, d, dtype::f16, 9, 0.0, 1.0);  // scores ~ d/4, no scale
    EXPECT_LE(max_rel_error_fused_vs_reference(g, x, 1.0), 1e-5) << d;
  }
}

// A row with 10^5 nonzeros (DF-GNN's hyper variant cannot hold ~1,500 in shared memory).
TEST(PeerBugs, RowWithHundredThousandNonzeros) {
  coo_graph c;
  c.rows = 40;
  c.cols = 120000;
  for (std::int64_t j = 0; j < 100000; ++j) {
    c.src.push_back(3);
    c.dst.push_back(j);
  }
  c.src.push_back(0);
  c.dst.push_back(5);
  const csr_graph g = to_csr(c);
  const auto x = test::random_qkv(g, 1, 32, dtype::f32, 10);
  EXPECT_LE(max_rel_error_fused_vs_reference(g, x, 0.2), 1e-5);
  const bsb f = build_bsb(g);
  EXPECT_EQ(to_csr(f), g);
}

}  // namespace
}  // namespace trisparse
