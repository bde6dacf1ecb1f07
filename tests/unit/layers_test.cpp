// GCN and AGNN layers on the CPU against the layers' definitions written out with dense matrices.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "support.hpp"

namespace trisparse {
namespace {

// Dense A + I of a square pattern (binary).
std::vector<std::vector<double>> dense_with_loops(const csr_graph& g) {
  std::vector<std::vector<double>> a(g.rows, std::vector<double>(g.rows, 0.0));
  for (std::int64_t r = 0; r < g.rows; ++r) {
    a[r][r] = 1;
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) a[r][g.col_idx[e]] = 1;
  }
  return a;
}

TEST(Layers, GcnNormalisationByHand) {
  // The path 0 - 1 - 2 (both directions): with loops the degrees are 2, 3, 2.
  coo_graph coo{.rows = 3, .cols = 3, .src = {0, 1}, .dst = {1, 2}, .values = {5.0f, 7.0f}};
  const csr_graph g = to_csr(coo, {.symmetrize = true});
  const csr_graph a = gcn_normalized(g);
  ASSERT_EQ(a.row_ptr, (std::vector<std::int64_t>{0, 2, 5, 7}));
  ASSERT_EQ(a.col_idx, (std::vector<std::int32_t>{0, 1, 0, 1, 2, 1, 2}));
  const std::vector<double> want{0.5,     1 / std::sqrt(6.0), 1 / std::sqrt(6.0),
                                 1 / 3.0, 1 / std::sqrt(6.0), 1 / std::sqrt(6.0),
                                 0.5};
  for (std::size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(a.values[e], want[e], 1e-7) << e;
  // Without self loops an isolated node keeps an empty row (and a zero output).
  const csr_graph b = gcn_normalized(g, false);
  EXPECT_EQ(b.nnz(), 4);
  EXPECT_NEAR(b.values[0], 1 / std::sqrt(2.0), 1e-7);  // (0, 1): degrees 1 and 2
  EXPECT_THROW(gcn_normalized(test::random_pattern(4, 5, 2, 1)), invalid_input);
}

TEST(Layers, GcnForwardIsNormalisedAdjacencyTimesXTimesW) {
  const csr_graph g = test::random_pattern(40, 40, 5, 3);  // directed, some rows with loops
  const std::int64_t fi = 7, fo = 5;
  host_tensor x(dtype::f32, g.rows, 1, fi), w(dtype::f32, fi, 1, fo),
      out(dtype::f64, g.rows, 1, fo);
  x.fill_uniform(-1, 1, 1);
  w.fill_uniform(-1, 1, 2);
  const gcn_layer layer = gcn_layer::build(g);
  layer.forward(x.view(), w.view(), out.view());
  const auto a = dense_with_loops(g);
  std::vector<double> deg(g.rows, 0);
  for (std::int64_t i = 0; i < g.rows; ++i)
    for (std::int64_t j = 0; j < g.rows; ++j) deg[i] += a[i][j];
  EXPECT_EQ(layer.nnz(), static_cast<std::int64_t>(std::accumulate(deg.begin(), deg.end(), 0.0)));
  for (std::int64_t i = 0; i < g.rows; ++i) {
    for (std::int64_t o = 0; o < fo; ++o) {
      double want = 0;
      for (std::int64_t j = 0; j < g.rows; ++j) {
        if (a[i][j] == 0) continue;
        double xw = 0;
        for (std::int64_t k = 0; k < fi; ++k) xw += x.get(j * fi + k) * w.get(k * fo + o);
        want += xw / std::sqrt(deg[i] * deg[j]);
      }
      EXPECT_NEAR(out.get(i * fo + o), want, 1e-6) << i << " " << o;  // Â's values are f32
    }
  }
}

TEST(Layers, AgnnForwardIsCosineAttention) {
  const csr_graph g = test::random_pattern(30, 30, 6, 5);
  const std::int64_t f = 9;
  host_tensor h(dtype::f32, g.rows, 1, f), out(dtype::f64, g.rows, 1, f);
  h.fill_uniform(-1, 1, 3);
  for (std::int64_t k = 0; k < f; ++k) h.set(4 * f + k, 0.0);  // a zero row: cosine 0
  const double beta = 1.7;
  const agnn_layer layer = agnn_layer::build(g);
  layer.forward(h.view(), beta, out.view());
  const auto a = dense_with_loops(g);
  const auto norm = [&](std::int64_t i) {
    double s = 0;
    for (std::int64_t k = 0; k < f; ++k) s += h.get(i * f + k) * h.get(i * f + k);
    return std::sqrt(s);
  };
  for (std::int64_t i = 0; i < g.rows; ++i) {
    std::vector<double> weight(g.rows, 0.0);
    double sum = 0;
    for (std::int64_t j = 0; j < g.rows; ++j) {
      if (a[i][j] == 0) continue;
      double dot = 0;
      for (std::int64_t k = 0; k < f; ++k) dot += h.get(i * f + k) * h.get(j * f + k);
      const double n = norm(i) * norm(j);
      weight[j] = std::exp(beta * (n > 0 ? dot / n : 0.0));  // |beta cos| <= 1.7: no overflow
      sum += weight[j];
    }
    for (std::int64_t k = 0; k < f; ++k) {
      double want = 0;
      for (std::int64_t j = 0; j < g.rows; ++j) want += weight[j] / sum * h.get(j * f + k);
      EXPECT_NEAR(out.get(i * f + k), want, 1e-12) << i << " " << k;
    }
  }
}

TEST(Layers, RejectWrongShapesAndDevices) {
  const csr_graph g = test::random_pattern(20, 20, 3, 7);
  const gcn_layer gcn = gcn_layer::build(g);
  const agnn_layer agnn = agnn_layer::build(g);
  host_tensor x(dtype::f32, 20, 1, 4), w(dtype::f32, 4, 1, 3), out(dtype::f32, 20, 1, 3),
      wrong_w(dtype::f32, 5, 1, 3), two_heads(dtype::f32, 20, 2, 4);
  EXPECT_NO_THROW(gcn.forward(x.view(), w.view(), out.view()));
  EXPECT_THROW(gcn.forward(x.view(), wrong_w.view(), out.view()), invalid_input);
  EXPECT_THROW(gcn.forward(two_heads.view(), w.view(), out.view()), invalid_input);
  EXPECT_THROW(agnn.forward(x.view(), 1.0, out.view()), invalid_input);  // out dim 3 != 4
  EXPECT_THROW(agnn.forward(x.view(), NAN, x.view()), invalid_input);
  tensor_view on_gpu = x.view();
  on_gpu.where = device_kind::cuda;
  EXPECT_THROW(agnn.forward(on_gpu, 1.0, x.view()), invalid_input);
  EXPECT_THROW(gcn_layer::build(test::random_pattern(3, 4, 2, 1)), invalid_input);
  EXPECT_THROW(agnn_layer::build(test::random_pattern(3, 4, 2, 1)), invalid_input);
}

}  // namespace
}  // namespace trisparse
