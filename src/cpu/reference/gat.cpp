// Float64 GAT attention and its gradients: plain loops over the CSR entries, the softmax and the
// chain rule written out. The oracle of gat_plan's kernels; itself checked against finite
// differences (tests/unit/gat_test.cpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "access.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse::reference {

namespace {

using access::at;
using access::dot;
using access::put;

void check_gat(const csr_graph& a, const tensor_view& x, const tensor_view& a_src,
               const tensor_view& a_dst, const tensor_view& keep, double negative_slope) {
  a.check();
  check_view(x, "x", a.cols, -1, -1);
  check_view(a_src, "a_src", a.cols, x.heads, 1);
  check_view(a_dst, "a_dst", a.rows, x.heads, 1);
  if (keep.data != nullptr) check_view(keep, "keep", a.nnz(), x.heads, 1);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(negative_slope), "negative_slope must be finite");
}

// Row i's scores e_ij for head h (LeakyReLU'd), their pre-activation s_ij, and the softmax.
struct gat_row {
  std::vector<double> s, p;
  double lse = -std::numeric_limits<double>::infinity();

  gat_row(const csr_graph& a, const tensor_view& a_src, const tensor_view& a_dst, double slope,
          std::int64_t i, std::int64_t h) {
    const std::int64_t e0 = a.row_ptr[i], n = a.row_ptr[i + 1] - e0;
    s.resize(static_cast<std::size_t>(n));
    p.resize(static_cast<std::size_t>(n));
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t x = 0; x < n; ++x) {
      s[x] = at(a_dst, i, h, 0) + at(a_src, a.col_idx[e0 + x], h, 0);
      p[x] = s[x] > 0 ? s[x] : slope * s[x];
      m = std::max(m, p[x]);
    }
    if (n == 0) return;
    double sum = 0;
    for (double& v : p) sum += (v = std::exp(v - m));
    for (double& v : p) v /= sum;
    lse = m + std::log(sum);
  }
};

double keep_of(const tensor_view& keep, std::int64_t e, std::int64_t h) {
  return keep.data != nullptr ? at(keep, e, h, 0) : 1.0;
}

}  // namespace

void gat(const csr_graph& a, const tensor_view& x, const tensor_view& a_src,
         const tensor_view& a_dst, const tensor_view& keep, double negative_slope,
         const tensor_view& out, const tensor_view& lse) {
  check_gat(a, x, a_src, a_dst, keep, negative_slope);
  check_view(out, "out", a.rows, x.heads, x.dim);
  if (lse.data != nullptr) check_view(lse, "lse", a.rows, x.heads, 1);
  std::vector<double> acc(static_cast<std::size_t>(x.dim));
  for (std::int64_t i = 0; i < a.rows; ++i) {
    for (std::int64_t h = 0; h < x.heads; ++h) {
      const gat_row row(a, a_src, a_dst, negative_slope, i, h);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e) {
        const double w = row.p[e - a.row_ptr[i]] * keep_of(keep, e, h);
        for (std::int64_t c = 0; c < x.dim; ++c) acc[c] += w * at(x, a.col_idx[e], h, c);
      }
      for (std::int64_t c = 0; c < x.dim; ++c) put(out, i, h, c, acc[c]);
      if (lse.data != nullptr) put(lse, i, h, 0, row.lse);
    }
  }
}

void gat_backward(const csr_graph& a, const tensor_view& x, const tensor_view& a_src,
                  const tensor_view& a_dst, const tensor_view& keep, double negative_slope,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& da_src,
                  const tensor_view& da_dst) {
  check_gat(a, x, a_src, a_dst, keep, negative_slope);
  check_view(dout, "dout", a.rows, x.heads, x.dim);
  check_view(dx, "dx", a.cols, x.heads, x.dim);
  check_view(da_src, "da_src", a.cols, x.heads, 1);
  check_view(da_dst, "da_dst", a.rows, x.heads, 1);
  const std::int64_t heads = x.heads, width = x.dim;
  std::vector<double> gx(static_cast<std::size_t>(a.cols * heads * width), 0.0);
  std::vector<double> gsrc(static_cast<std::size_t>(a.cols * heads), 0.0);
  std::vector<double> dp;
  for (std::int64_t i = 0; i < a.rows; ++i) {
    const std::int64_t e0 = a.row_ptr[i], n = a.row_ptr[i + 1] - e0;
    for (std::int64_t h = 0; h < heads; ++h) {
      const gat_row row(a, a_src, a_dst, negative_slope, i, h);
      // out_i = sum_j p_j keep_j x_j: dL/dp_j = keep_j <dout_i, x_j>; the softmax's gradient
      // ds_j = p_j (dp_j - sum_k p_k dp_k); LeakyReLU's slope below 0.
      dp.assign(static_cast<std::size_t>(n), 0.0);
      double mean = 0;
      for (std::int64_t k = 0; k < n; ++k) {
        dp[k] = keep_of(keep, e0 + k, h) * dot(dout, i, x, a.col_idx[e0 + k], h);
        mean += row.p[k] * dp[k];
      }
      double gdst = 0;
      for (std::int64_t k = 0; k < n; ++k) {
        const std::int64_t j = a.col_idx[e0 + k];
        const double de = row.p[k] * (dp[k] - mean) * (row.s[k] > 0 ? 1.0 : negative_slope);
        gdst += de;
        gsrc[j * heads + h] += de;
        const double w = row.p[k] * keep_of(keep, e0 + k, h);
        for (std::int64_t c = 0; c < width; ++c)
          gx[(j * heads + h) * width + c] += w * at(dout, i, h, c);
      }
      put(da_dst, i, h, 0, gdst);
    }
  }
  for (std::int64_t j = 0; j < a.cols; ++j) {
    for (std::int64_t h = 0; h < heads; ++h) {
      put(da_src, j, h, 0, gsrc[j * heads + h]);
      for (std::int64_t c = 0; c < width; ++c) put(dx, j, h, c, gx[(j * heads + h) * width + c]);
    }
  }
}

}  // namespace trisparse::reference
