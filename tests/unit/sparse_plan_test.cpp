// sparse_plan on the CPU: the float64 kernels in CSR entry order, layout conversions, and the
// argument checks every backend shares.
#include <gtest/gtest.h>

#include "support.hpp"

namespace trisparse {
namespace {

TEST(SparsePlanCpu, OperationsMatchTheReferenceAndChain) {
  const csr_graph g = test::random_pattern(300, 200, 12, 3, true);
  const auto plan = sparse_plan::build(g);
  EXPECT_EQ(plan.slots(), g.nnz());
  EXPECT_EQ(plan.report().format, "csr");
  host_tensor x(dtype::f32, g.rows, 2, 16), y(dtype::f32, g.cols, 2, 16);
  x.fill_uniform(-1, 1, 1);
  y.fill_uniform(-1, 1, 2);
  host_tensor s(dtype::f64, g.nnz(), 2, 1), p(dtype::f32, g.nnz(), 2, 1),
      c(dtype::f64, g.rows, 2, 16);
  plan.sddmm(x.view(), y.view(), s.view(), 0.25);
  plan.softmax(s.view(), p.view());
  plan.spmm(p.view(), y.view(), c.view());
  // Row 0 by hand: the same chain, written out.
  for (std::int64_t h = 0; h < 2; ++h) {
    const std::int64_t b = g.row_ptr[0], e = g.row_ptr[1];
    std::vector<double> score;
    for (std::int64_t k = b; k < e; ++k) {
      double dot = 0;
      for (std::int64_t d = 0; d < 16; ++d)
        dot += x.get(h * 16 + d) * y.get(g.col_idx[k] * 32 + h * 16 + d);
      score.push_back(0.25 * g.values[k] * dot);
      EXPECT_NEAR(s.get(k * 2 + h), score.back(), 1e-5);  // the CPU kernels in fp32
    }
    double m = -1e300, sum = 0;
    for (const double v : score) m = std::max(m, v);
    for (const double v : score) sum += std::exp(v - m);
    for (std::int64_t d = 0; d < 16; ++d) {
      double want = 0;
      for (std::int64_t k = b; k < e; ++k)
        want += std::exp(score[k - b] - m) / sum * y.get(g.col_idx[k] * 32 + h * 16 + d);
      EXPECT_NEAR(c.get(h * 16 + d), want, 1e-5);
    }
  }
}

TEST(SparsePlanCpu, LayoutConversionsRoundTripAndChecksNameTheArgument) {
  const csr_graph g = test::random_pattern(50, 50, 6, 4);
  const auto plan = sparse_plan::build(g);
  host_tensor entries(dtype::f32, g.nnz(), 3, 1), slots(dtype::f32, g.nnz(), 3, 1),
      back(dtype::f32, g.nnz(), 3, 1);
  entries.fill_uniform(0, 1, 9);
  // Head-major slot arrays (one array per head) are valid views.
  tensor_view head_major = slots.view();
  head_major.row_stride = 1;
  head_major.head_stride = g.nnz();
  plan.to_slots(entries.view(), head_major);
  plan.to_entries(head_major, back.view());
  for (std::int64_t i = 0; i < entries.numel(); ++i) EXPECT_EQ(back.get(i), entries.get(i));
  host_tensor wrong(dtype::f32, g.nnz() + 1, 1, 1), b(dtype::f32, 49, 1, 8),
      c(dtype::f32, 50, 1, 8);
  try {
    plan.spmm({}, b.view(), c.view());
    FAIL() << "a b with the wrong row count ran";
  } catch (const invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("b "), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan.softmax(wrong.view(), wrong.view()), invalid_input);
  EXPECT_THROW(sparse_plan::build(g, device_kind::cpu, {.vector_rows = 4}), invalid_input);
  tensor_view overlapping = entries.view();
  overlapping.row_stride = 1;  // heads 1 apart and rows 1 apart: elements overlap
  overlapping.head_stride = 1;
  EXPECT_THROW(plan.to_entries(overlapping, back.view()), invalid_input);
}

}  // namespace
}  // namespace trisparse
