// The real graphs in ../shared/datasets (skipped with a message when absent).
#include "support.hpp"

namespace trisparse {
namespace {

class Dataset : public ::testing::TestWithParam<std::filesystem::path> {};

std::string name_of(const ::testing::TestParamInfo<std::filesystem::path>& info) {
  std::string n = info.param.filename().string();
  n = n.substr(0, n.find('.'));
  for (auto& c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return n;
}

// The CPU engine against the float64 reference on every shared graph, two heads, signed inputs.
TEST_P(Dataset, FusedCpuMatchesFloat64Reference) {
  const csr_graph g = read_graph(GetParam());
  const auto x = test::random_qkv(g, 2, 32, dtype::f32, 17);
  host_tensor ref(dtype::f64, g.rows, 2, 32), out(dtype::f32, g.rows, 2, 32);
  out.fill(std::nan(""));
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), ref.view(), 0.3);
  cpu::fused_attention(g, x.q.view(), x.k.view(), x.v.view(), out.view(), 0.3f);
  const auto e = test::compare(out, ref);
  EXPECT_TRUE(e.finite);
  EXPECT_LE(e.relative(), 1e-5) << "max abs error " << e.max_abs;
}

// Formats round-trip on every real graph.
TEST_P(Dataset, FormatsRoundTrip) {
  const csr_graph g = read_graph(GetParam());
  const bsb f = build_bsb(g);
  f.check();
  EXPECT_EQ(to_csr(f), g);
  const me_bcrs m = build_me_bcrs(g);
  m.check();
  EXPECT_EQ(to_csr(m, false), g);
  const bcsr b = build_bcsr(blocks_of(g, 16));
  b.check();
  EXPECT_EQ(b.blocks(), blocks_of(g, 16).blocks.nnz());
}

INSTANTIATE_TEST_SUITE_P(Shared, Dataset, ::testing::ValuesIn(test::dataset_graphs()), name_of);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Dataset);

TEST(DatasetPresence, SharedGraphsAreFound) {
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  EXPECT_EQ(test::dataset_graphs().size(), 61u);
}

// Table 6 of the Fused3S paper (TCB 16x8, graphs as stored: symmetric, no self loops added).
TEST(DatasetPaper, Table6StatisticsAgreeWithinRounding) {
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  struct row {
    const char* name;
    double tcb_rw, tcb_rw_cv, nnz_tcb, nnz_tcb_cv;
  };
  for (const row r : {row{"cora", 7.5, 0.38, 8.3, 0.29}, row{"pubmed", 9.3, 0.45, 7.7, 0.18}}) {
    SCOPED_TRACE(r.name);
    const csr_graph g = read_graph(test::datasets_dir() / (std::string(r.name) + ".el.xz"));
    const bsb_stats s = compute_stats(build_bsb(g), g.nnz());
    EXPECT_NEAR(s.tcb_per_window_mean, r.tcb_rw, 0.05);
    EXPECT_NEAR(s.tcb_per_window_cv, r.tcb_rw_cv, 0.005);
    EXPECT_NEAR(s.nnz_per_tcb_mean, r.nnz_tcb, 0.05);
    EXPECT_NEAR(s.nnz_per_tcb_cv, r.nnz_tcb_cv, 0.005);
  }
  // Table 7's deciles for Pubmed.
  const csr_graph pubmed = read_graph(test::datasets_dir() / "pubmed.el.xz");
  const bsb_stats s = compute_stats(build_bsb(pubmed), pubmed.nnz());
  const std::vector<std::pair<std::int64_t, std::int64_t>> table7{
      {1, 5}, {5, 6}, {6, 7}, {7, 8}, {8, 9}, {9, 10}, {10, 11}, {11, 12}, {12, 14}, {14, 43}};
  EXPECT_EQ(s.deciles, table7);
}

TEST(DatasetPaper, BatchedGraphsMatchTheirGraphPointers) {
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  for (const auto& e : std::filesystem::directory_iterator(test::datasets_dir())) {
    const std::string p = e.path().string();
    if (!p.ends_with(".graph_ptr.xz")) continue;
    const std::string graph =
        p.substr(0, p.size() - std::string(".graph_ptr.xz").size()) + ".el.xz";
    const csr_graph g = read_graph(graph);
    const auto ptr = read_graph_ptr(p, g.rows);
    for (std::size_t b = 0; b + 1 < ptr.size(); ++b) {
      for (std::int64_t r = ptr[b]; r < ptr[b + 1]; ++r) {
        for (std::int64_t k = g.row_ptr[r]; k < g.row_ptr[r + 1]; ++k) {
          ASSERT_GE(g.col_idx[k], ptr[b]) << p;
          ASSERT_LT(g.col_idx[k], ptr[b + 1]) << p;
        }
      }
    }
  }
}

}  // namespace
}  // namespace trisparse
