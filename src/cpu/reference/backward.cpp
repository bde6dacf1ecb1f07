// Float64 gradients of the operations: plain loops over the CSR entries, the chain rule written
// out. The oracle every backward kernel is tested against; itself tested against finite
// differences (tests/unit/backward_test.cpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../../common/arguments.hpp"
#include "../../graph/transposed.hpp"
#include "access.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse::reference {

namespace {

using access::at;
using access::dot;
using access::put;

using grad = access::accumulator;

// The scaled score of entry e = (i, j), head h, with its bias.
double score(const tensor_view& q, const tensor_view& k, const tensor_view& bias, std::int64_t i,
             std::int64_t j, std::int64_t e, std::int64_t h, double scale) {
  const double b = bias.data != nullptr ? at(bias, e, detail::bias_head(bias, h), 0) : 0.0;
  return scale * dot(q, i, k, j, h) + b;
}

// Per row i and head h: the log-sum-exp of the scores over the row's entries.
double row_lse(const csr_graph& a, const tensor_view& q, const tensor_view& k,
               const tensor_view& bias, std::int64_t i, std::int64_t h, double scale) {
  double m = -std::numeric_limits<double>::infinity(), sum = 0;
  for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e)
    m = std::max(m, score(q, k, bias, i, a.col_idx[e], e, h, scale));
  if (m == -std::numeric_limits<double>::infinity()) return m;
  for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e)
    sum += std::exp(score(q, k, bias, i, a.col_idx[e], e, h, scale) - m);
  return m + std::log(sum);
}

}  // namespace

void attention_backward(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                        const tensor_view& v, const tensor_view& dout, const tensor_view& dq,
                        const tensor_view& dk, const tensor_view& dv, double scale,
                        const tensor_view& ds, const tensor_view& bias) {
  a.check();
  check_view(q, "q", a.rows, -1, -1);
  check_view(k, "k", a.cols, q.heads, q.dim);
  check_view(v, "v", a.cols, q.heads, -1);
  check_view(dout, "dout", a.rows, q.heads, v.dim);
  check_view(dq, "dq", a.rows, q.heads, q.dim);
  check_view(dk, "dk", a.cols, q.heads, q.dim);
  check_view(dv, "dv", a.cols, q.heads, v.dim);
  if (ds.data != nullptr) check_view(ds, "ds", a.nnz(), q.heads, 1);
  if (bias.data != nullptr) detail::check_bias(bias, "bias", a.nnz(), q.heads, device_kind::cpu);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "scale must be finite");
  const std::int64_t heads = q.heads;
  grad gq(a.rows, heads, q.dim), gk(a.cols, heads, q.dim), gv(a.cols, heads, v.dim);
  // q, k, v and dout read as doubles once (access::as_f64).
  const host_tensor q64 = access::as_f64(q), k64 = access::as_f64(k), v64 = access::as_f64(v),
                    dout64 = access::as_f64(dout);
  const tensor_view qd = q64.view(), kd = k64.view(), vd = v64.view(), doutd = dout64.view();
  // Two passes on OpenMP threads, each output summed in the order of one thread's row-by-row
  // loop, so the result does not depend on the threads. Rows: each entry's P and dS, and dq.
  const std::int64_t nnz = a.nnz();
  std::vector<double> p_of(static_cast<std::size_t>(nnz * heads)), ds_of(p_of.size());
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t i = 0; i < a.rows; ++i) {
    const std::int64_t e0 = a.row_ptr[i], n = a.row_ptr[i + 1] - e0;
    for (std::int64_t h = 0; h < heads; ++h) {
      const double lse = row_lse(a, qd, kd, bias, i, h, scale);
      double dp_mean = 0;  // sum_j p_j dp_j = <dout_i, out_i>
      for (std::int64_t e = e0; e < e0 + n; ++e) {
        const std::size_t eh = static_cast<std::size_t>(e * heads + h);
        p_of[eh] = std::exp(score(qd, kd, bias, i, a.col_idx[e], e, h, scale) - lse);
        ds_of[eh] = dot(doutd, i, vd, a.col_idx[e], h);  // dp, made dS below
        dp_mean += p_of[eh] * ds_of[eh];
      }
      for (std::int64_t e = e0; e < e0 + n; ++e) {
        const std::size_t eh = static_cast<std::size_t>(e * heads + h);
        const double d_s = p_of[eh] * (ds_of[eh] - dp_mean);  // dL/dS_ij
        ds_of[eh] = d_s;
        if (ds.data != nullptr) put(ds, e, h, 0, d_s);
        for (std::int64_t d = 0; d < q.dim; ++d)
          gq(i, h, d) += scale * d_s * at(kd, a.col_idx[e], h, d);
      }
    }
  }
  // Columns: dk and dv over each column's entries in row order (the transpose keeps it).
  const detail::transposed_pattern t = detail::transposed_of(a);
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t j = 0; j < a.cols; ++j) {
    for (std::int64_t x = t.col_ptr[j]; x < t.col_ptr[j + 1]; ++x) {
      const std::int64_t e = t.entry[x], i = t.row_idx[x];
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::size_t eh = static_cast<std::size_t>(e * heads + h);
        for (std::int64_t d = 0; d < q.dim; ++d) gk(j, h, d) += scale * ds_of[eh] * at(qd, i, h, d);
        for (std::int64_t d = 0; d < v.dim; ++d) gv(j, h, d) += p_of[eh] * at(doutd, i, h, d);
      }
    }
  }
  gq.store(dq);
  gk.store(dk);
  gv.store(dv);
}

void sddmm_backward(const csr_graph& a, const tensor_view& x, const tensor_view& y,
                    const tensor_view& dout, const tensor_view& dx, const tensor_view& dy,
                    double scale) {
  a.check();
  check_view(x, "x", a.rows, -1, -1);
  check_view(y, "y", a.cols, x.heads, x.dim);
  check_view(dout, "dout", a.nnz(), x.heads, 1);
  check_view(dx, "dx", a.rows, x.heads, x.dim);
  check_view(dy, "dy", a.cols, x.heads, x.dim);
  grad gx(a.rows, x.heads, x.dim), gy(a.cols, x.heads, x.dim);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
      const double w = a.has_values() ? a.values[e] : 1.0;
      const std::int64_t c = a.col_idx[e];
      for (std::int64_t h = 0; h < x.heads; ++h) {
        const double g = w * scale * at(dout, e, h, 0);
        for (std::int64_t d = 0; d < x.dim; ++d) {
          gx(r, h, d) += g * at(y, c, h, d);
          gy(c, h, d) += g * at(x, r, h, d);
        }
      }
    }
  }
  gx.store(dx);
  gy.store(dy);
}

void softmax_backward(const csr_graph& a, const tensor_view& out, const tensor_view& dout,
                      const tensor_view& dscores) {
  a.check();
  check_view(out, "out", a.nnz(), -1, 1);
  check_view(dout, "dout", a.nnz(), out.heads, 1);
  check_view(dscores, "dscores", a.nnz(), out.heads, 1);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t h = 0; h < out.heads; ++h) {
      double mean = 0;  // sum_e p_e dp_e
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e)
        mean += at(out, e, h, 0) * at(dout, e, h, 0);
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e)
        put(dscores, e, h, 0, at(out, e, h, 0) * (at(dout, e, h, 0) - mean));
    }
  }
}

void spmm_backward(const csr_graph& a, const tensor_view& w, const tensor_view& b,
                   const tensor_view& dc, const tensor_view& dw, const tensor_view& db) {
  a.check();
  check_view(b, "b", a.cols, -1, -1);
  check_view(dc, "dc", a.rows, b.heads, b.dim);
  check_view(db, "db", a.cols, b.heads, b.dim);
  if (w.data != nullptr) check_view(w, "w", a.nnz(), b.heads, 1);
  if (dw.data != nullptr) check_view(dw, "dw", a.nnz(), b.heads, 1);
  grad gb(a.cols, b.heads, b.dim);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
      const std::int64_t c = a.col_idx[e];
      for (std::int64_t h = 0; h < b.heads; ++h) {
        const double x = w.data != nullptr ? at(w, e, h, 0) : a.has_values() ? a.values[e] : 1.0;
        if (dw.data != nullptr) put(dw, e, h, 0, dot(dc, r, b, c, h));
        for (std::int64_t d = 0; d < b.dim; ++d) gb(c, h, d) += x * at(dc, r, h, d);
      }
    }
  }
  gb.store(db);
}

double agnn_backward(const csr_graph& a, const tensor_view& h, double beta, const tensor_view& dout,
                     const tensor_view& dh) {
  a.check();
  TRISPARSE_EXPECTS_INPUT(a.rows == a.cols, "AGNN's propagation pattern must be square");
  check_view(h, "h", a.rows, 1, -1);
  check_view(dout, "dout", a.rows, 1, h.dim);
  check_view(dh, "dh", a.rows, 1, h.dim);
  const std::int64_t n = a.rows, f = h.dim;
  // Unit rows u_i = h_i / |h_i| (0 for a zero row), the scores' softmax p per row.
  grad u(n, 1, f);
  std::vector<double> norm(static_cast<std::size_t>(n), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::int64_t c = 0; c < f; ++c) s += at(h, i, 0, c) * at(h, i, 0, c);
    norm[static_cast<std::size_t>(i)] = std::sqrt(s);
    for (std::int64_t c = 0; c < f; ++c) u(i, 0, c) = s > 0 ? at(h, i, 0, c) / std::sqrt(s) : 0.0;
  }
  const auto cosine = [&](std::int64_t i, std::int64_t j) {
    double s = 0;
    for (std::int64_t c = 0; c < f; ++c) s += u(i, 0, c) * u(j, 0, c);
    return s;
  };
  std::vector<double> p(static_cast<std::size_t>(a.nnz())), dp(p.size());
  grad g(n, 1, f), du(n, 1, f);
  double dbeta = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t e0 = a.row_ptr[i], e1 = a.row_ptr[i + 1];
    double top = -std::numeric_limits<double>::infinity(), sum = 0, mean = 0;
    for (std::int64_t e = e0; e < e1; ++e) top = std::max(top, beta * cosine(i, a.col_idx[e]));
    for (std::int64_t e = e0; e < e1; ++e) {
      p[static_cast<std::size_t>(e)] = std::exp(beta * cosine(i, a.col_idx[e]) - top);
      sum += p[static_cast<std::size_t>(e)];
    }
    for (std::int64_t e = e0; e < e1; ++e) {
      const std::int64_t j = a.col_idx[e];
      double& pe = p[static_cast<std::size_t>(e)];
      pe /= sum;
      double dpe = 0;  // dL/dp_ij = <dout_i, h_j>; and h_j's share of out_i: p_ij dout_i
      for (std::int64_t c = 0; c < f; ++c) {
        dpe += at(dout, i, 0, c) * at(h, j, 0, c);
        g(j, 0, c) += pe * at(dout, i, 0, c);
      }
      dp[static_cast<std::size_t>(e)] = dpe;
      mean += pe * dpe;
    }
    for (std::int64_t e = e0; e < e1; ++e) {
      // ds = p (dp - sum_k p_ik dp_ik); s = beta <u_i, u_j>.
      const std::int64_t j = a.col_idx[e];
      const double ds = p[static_cast<std::size_t>(e)] * (dp[static_cast<std::size_t>(e)] - mean);
      dbeta += ds * cosine(i, j);
      for (std::int64_t c = 0; c < f; ++c) {
        du(i, 0, c) += beta * ds * u(j, 0, c);
        du(j, 0, c) += beta * ds * u(i, 0, c);
      }
    }
  }
  // Through the normalisation: dh_i += (du_i - u_i <u_i, du_i>) / |h_i|.
  for (std::int64_t i = 0; i < n; ++i) {
    const double r = norm[static_cast<std::size_t>(i)];
    if (r == 0) continue;
    double along = 0;
    for (std::int64_t c = 0; c < f; ++c) along += u(i, 0, c) * du(i, 0, c);
    for (std::int64_t c = 0; c < f; ++c) g(i, 0, c) += (du(i, 0, c) - u(i, 0, c) * along) / r;
  }
  g.store(dh);
  return dbeta;
}

void gcn_backward(const csr_graph& a, const tensor_view& x, const tensor_view& w,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& dw) {
  a.check();
  check_view(x, "x", a.rows, 1, -1);
  check_view(w, "w", x.dim, 1, -1);
  check_view(dout, "dout", a.rows, 1, w.dim);
  check_view(dx, "dx", a.rows, 1, x.dim);
  check_view(dw, "dw", x.dim, 1, w.dim);
  // g = Â^T dout: the gradient of x w.
  grad g(a.cols, 1, w.dim);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
      const double av = a.has_values() ? a.values[e] : 1.0;
      for (std::int64_t f = 0; f < w.dim; ++f) g(a.col_idx[e], 0, f) += av * at(dout, r, 0, f);
    }
  }
  // dx = g w^T, dw = x^T g.
  for (std::int64_t i = 0; i < a.rows; ++i) {
    for (std::int64_t c = 0; c < x.dim; ++c) {
      double s = 0;
      for (std::int64_t f = 0; f < w.dim; ++f) s += g(i, 0, f) * at(w, c, 0, f);
      put(dx, i, 0, c, s);
    }
  }
  for (std::int64_t c = 0; c < x.dim; ++c) {
    for (std::int64_t f = 0; f < w.dim; ++f) {
      double s = 0;
      for (std::int64_t i = 0; i < a.rows; ++i) s += at(x, i, 0, c) * g(i, 0, f);
      put(dw, c, 0, f, s);
    }
  }
}

namespace {

// z = Â x w (+ bias) in float64: [N, F_out].
grad gcn_preactivation(const csr_graph& a, const tensor_view& x, const tensor_view& w,
                       const tensor_view& bias) {
  grad ax(a.rows, 1, x.dim), z(a.rows, 1, w.dim);
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
      const double av = a.has_values() ? a.values[e] : 1.0;
      for (std::int64_t c = 0; c < x.dim; ++c) ax(r, 0, c) += av * at(x, a.col_idx[e], 0, c);
    }
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t f = 0; f < w.dim; ++f) {
      double s = bias.data != nullptr ? at(bias, 0, 0, f) : 0.0;
      for (std::int64_t c = 0; c < x.dim; ++c) s += ax(r, 0, c) * at(w, c, 0, f);
      z(r, 0, f) = s;
    }
  return z;
}

void check_gcn_fused_args(const csr_graph& a, const tensor_view& x, const tensor_view& w,
                          const tensor_view& bias) {
  a.check();
  TRISPARSE_EXPECTS_INPUT(a.rows == a.cols, "gcn_fused: the propagation matrix must be square");
  check_view(x, "x", a.rows, 1, -1);
  check_view(w, "w", x.dim, 1, -1);
  if (bias.data != nullptr) check_view(bias, "bias", 1, 1, w.dim);
}

}  // namespace

std::vector<std::uint32_t> gcn_fused(const csr_graph& a, const tensor_view& x, const tensor_view& w,
                                     const tensor_view& bias, bool relu, const tensor_view& out) {
  check_gcn_fused_args(a, x, w, bias);
  check_view(out, "out", a.rows, 1, w.dim);
  grad z = gcn_preactivation(a, x, w, bias);
  const std::int64_t words = (w.dim + 31) / 32;
  std::vector<std::uint32_t> mask(relu ? static_cast<std::size_t>(a.rows * words) : 0, 0u);
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t f = 0; f < w.dim; ++f) {
      double v = z(r, 0, f);
      if (relu) {
        if (v > 0)
          mask[static_cast<std::size_t>(r * words + f / 32)] |= std::uint32_t{1} << (f % 32);
        else
          v = 0;
      }
      put(out, r, 0, f, v);
    }
  return mask;
}

void gcn_fused_backward(const csr_graph& a, const tensor_view& x, const tensor_view& w,
                        std::span<const std::uint32_t> relu_mask, const tensor_view& dout,
                        const tensor_view& dx, const tensor_view& dw, const tensor_view& dbias) {
  check_gcn_fused_args(a, x, w, {});
  check_view(dout, "dout", a.rows, 1, w.dim);
  const std::int64_t words = (w.dim + 31) / 32;
  TRISPARSE_EXPECTS_INPUT(
      relu_mask.empty() || static_cast<std::int64_t>(relu_mask.size()) == a.rows * words,
      "gcn_fused_backward: relu_mask holds " + std::to_string(relu_mask.size()) +
          " words, not rows x " + std::to_string(words));
  if (dbias.data != nullptr) check_view(dbias, "dbias", 1, 1, w.dim);
  // dz = dout where the ReLU passed; the rest is gcn_backward's, and dbias sums dz over rows.
  host_tensor dz(dtype::f64, a.rows, 1, w.dim);
  grad db(1, 1, w.dim);
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t f = 0; f < w.dim; ++f) {
      const bool pass =
          relu_mask.empty() ||
          (relu_mask[static_cast<std::size_t>(r * words + f / 32)] >> (f % 32) & 1u) != 0;
      const double g = pass ? at(dout, r, 0, f) : 0.0;
      dz.set(r * w.dim + f, g);
      db(0, 0, f) += g;
    }
  gcn_backward(a, x, w, dz.view(), dx, dw);
  if (dbias.data != nullptr) db.store(dbias);
}

}  // namespace trisparse::reference
