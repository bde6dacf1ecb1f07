// The CPU's block importance (attention_options::block_mass / block_grad): per (sequence, query
// block, head), each row's softmax over its kept keys and dS = P (dP - <dP, P>) in float64 (the
// dot products in float32 for inputs other than float64), summed per kept block. Each task writes
// its own block row: deterministic.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../common/online_softmax.hpp"
#include "engine.hpp"
#include "trisparse/core/numeric.hpp"

namespace trisparse::cpu {

namespace {

// Row dot products of two operands: float64 views read as they are, others through float32
// copies (made once per call; none for an empty view, whose rows are not read).
struct rows_of {
  const tensor_view& t;
  cpu::f32_operand f;
  explicit rows_of(const tensor_view& view)
      : t(view),
        f(view.type == dtype::f64 || view.data == nullptr ? cpu::f32_operand{}
                                                          : cpu::as_f32(view)) {}
};

double dot_rows(const rows_of& a, std::int64_t ra, const rows_of& b, std::int64_t rb,
                std::int64_t h) {
  if (a.f.data == nullptr) {
    double s = 0.0;
    for (std::int64_t d = 0; d < a.t.dim; ++d) {
      s += load_as_double(a.t.data, a.t.type, a.t.offset(ra, h, d)) *
           load_as_double(b.t.data, b.t.type, b.t.offset(rb, h, d));
    }
    return s;
  }
  const float* x = a.f.row(ra, h);
  const float* y = b.f.row(rb, h);
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (std::int64_t d = 0; d < a.t.dim; ++d) s += x[d] * y[d];
  return s;
}

}  // namespace

void block_importance_unchecked(const block_sparse_mask& mask, const tensor_view& q,
                                const tensor_view& k, const tensor_view& v, const tensor_view& dout,
                                double scale, const tensor_view& mass, const tensor_view& grad,
                                std::int64_t qb_max) {
  const std::int64_t heads = q.heads, g = mask.block;
  const bool with_grad = grad.data != nullptr;  // else v and dout may be empty: not read
  const tensor_view none{}, &v_read = with_grad ? v : none, &dout_read = with_grad ? dout : none;
  const rows_of qr(q), kr(k), vr(v_read), dr(dout_read);
  std::vector<std::pair<std::int64_t, std::int64_t>> block_rows;  // (sequence, query block)
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    for (std::int64_t r = 0; r * g < mask.len_q(b); ++r) block_rows.emplace_back(b, r);
  }
  const auto tasks = static_cast<std::int64_t>(block_rows.size()) * heads;

#pragma omp parallel
  {
    std::vector<double> score, dp, block_p, block_ds;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const auto [b, r] = block_rows[task / heads];
      const std::int64_t h = task % heads;
      const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
      const std::int64_t rows = std::min(g, mask.len_q(b) - r * g);
      const csr_graph& blocks = mask.at(b, h).blocks;
      const std::int64_t e0 = blocks.row_ptr[r], e1 = blocks.row_ptr[r + 1];
      block_p.assign(static_cast<std::size_t>(e1 - e0), 0.0);
      block_ds.assign(block_p.size(), 0.0);
      for (std::int64_t i = r * g; i < r * g + rows; ++i) {
        const std::int64_t last = mask.last_key(b, i);
        // The row's kept keys, block by block: scores, then the softmax and dS.
        score.clear();
        dp.clear();
        double top = -std::numeric_limits<double>::infinity();
        for (std::int64_t e = e0; e < e1; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          for (std::int64_t j = j0; j < std::min(j0 + g, last + 1); ++j) {
            score.push_back(scale * dot_rows(qr, q0 + i, kr, k0 + j, h));
            if (with_grad) dp.push_back(dot_rows(dr, q0 + i, vr, k0 + j, h));
            top = std::max(top, score.back());
          }
        }
        if (score.empty()) continue;  // no key: P = 0
        double sum = 0.0;
        for (double& s : score) sum += (s = std::exp(s - top));
        double dterm = 0.0;
        for (std::size_t x = 0; x < score.size(); ++x) {
          score[x] /= sum;
          if (with_grad) dterm += score[x] * dp[x];
        }
        std::size_t x = 0;
        for (std::int64_t e = e0; e < e1; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          for (std::int64_t j = j0; j < std::min(j0 + g, last + 1); ++j, ++x) {
            block_p[e - e0] += score[x];
            if (with_grad) block_ds[e - e0] += std::abs(score[x] * (dp[x] - dterm));
          }
        }
      }
      for (std::int64_t e = e0; e < e1; ++e) {
        const std::int64_t row = b * qb_max + r, c = blocks.col_idx[e];
        if (mass.data != nullptr) {
          store_from_double(mass.data, mass.type, mass.offset(row, h, c),
                            block_p[e - e0] / static_cast<double>(rows));
        }
        if (grad.data != nullptr)
          store_from_double(grad.data, grad.type, grad.offset(row, h, c), block_ds[e - e0]);
      }
    }
  }
}

}  // namespace trisparse::cpu
