// The GPU BSB builder equals the host builder, array for array (label gpu).
#include "../../src/cuda/formats/bsb_host.hpp"
#include "support.hpp"

namespace trisparse {
namespace {

void expect_same(const csr_graph& g) {
  SCOPED_TRACE("n " + std::to_string(g.rows) + " x " + std::to_string(g.cols) + " nnz " +
               std::to_string(g.nnz()));
  const bsb host = build_bsb(g, 8), device = build_bsb_cuda(g);
  EXPECT_NO_THROW(device.check());
  EXPECT_EQ(device.tcb_offset, host.tcb_offset);
  EXPECT_EQ(device.col_idx, host.col_idx);
  EXPECT_EQ(device.bitmap, host.bitmap);
  EXPECT_EQ(device.window_order, host.window_order);
}

TEST(GpuBsbBuild, EqualsTheHostBuilder) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible: skipping";
  expect_same(csr_graph{});
  expect_same(csr_graph{.rows = 40,
                        .cols = 40,
                        .row_ptr = std::vector<std::int64_t>(41, 0),
                        .col_idx = {},
                        .values = {}});
  for (const std::int64_t n : {1, 17, 1000, 65537})
    expect_same(test::random_pattern(n, n, 30, static_cast<std::uint64_t>(n)));
  expect_same(test::random_pattern(300, 100000, 500, 3));  // rectangular, wide windows
  expect_same(generate_rmat({.scale = 16, .edge_factor = 16, .seed = 4}));
  coo_graph heavy{.rows = 100, .cols = 200000, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t j = 0; j < 150000; ++j) {
    heavy.src.push_back(37);
    heavy.dst.push_back(j);
  }
  expect_same(to_csr(heavy));
}

TEST(GpuBsbBuild, EqualsTheHostBuilderOnEverySharedDataset) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible: skipping";
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  for (const auto& path : test::dataset_graphs()) {
    SCOPED_TRACE(path.filename().string());
    expect_same(read_graph(path));
  }
}

}  // namespace
}  // namespace trisparse
