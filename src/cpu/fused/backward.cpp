// The CPU engine's attention backward: FlashAttention-2's algorithm on the pattern, in two passes
// that each own their outputs (no atomics, no scatter): dq over the rows of A, dk and dv over the
// rows of A's transpose. P is recomputed from the forward's log-sum-exp, never stored.
#include <cmath>
#include <vector>

#include "../../common/arguments.hpp"
#include "../common/online_softmax.hpp"
#include "fast.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse::cpu {

namespace {

float dot(const float* x, const float* y, std::int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (std::int64_t d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

}  // namespace

void fused_attention_backward_unchecked(const csr_graph& a, const csr_graph& at,
                                        const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, const tensor_view& out,
                                        const tensor_view& lse, const tensor_view& dout,
                                        const tensor_view& dq, const tensor_view& dk,
                                        const tensor_view& dv, float scale,
                                        const backward_bias& bias) {
  detail::check_attention_args(a.rows, a.cols, q, k, v, out, device_kind::cpu);
  check_view(lse, "lse", a.rows, q.heads, 1);
  check_view(dout, "dout", a.rows, q.heads, v.dim);
  check_view(dq, "dq", a.rows, q.heads, q.dim);
  check_view(dk, "dk", a.cols, q.heads, q.dim);
  check_view(dv, "dv", a.cols, q.heads, v.dim);
  TRISPARSE_EXPECTS_INPUT(at.rows == a.cols && at.cols == a.rows && at.nnz() == a.nnz(),
                          "the transposed pattern does not match the pattern");
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "scale must be finite");
  const bool biased = bias.bias.data != nullptr;
  if (biased) {
    detail::check_bias(bias.bias, "bias", a.nnz(), q.heads, device_kind::cpu);
    TRISPARSE_EXPECTS_INPUT(
        bias.transposed_entry.size() == static_cast<std::size_t>(a.nnz()),
        "a biased backward needs the entry of the pattern of each entry of its transpose");
  }
  if (bias.dbias.data != nullptr)
    detail::check_bias(bias.dbias, "dbias", a.nnz(), q.heads, device_kind::cpu, true);
  const f32_operand bf = biased ? as_f32(bias.bias) : f32_operand{};
  // The bias of entry e (of the pattern), head h.
  const auto bias_of = [&](std::int64_t e, std::int64_t h) {
    return biased ? *bf.row(e, detail::bias_head(bias.bias, h)) : 0.0f;
  };
  const f32_operand qf = as_f32(q), kf = as_f32(k), vf = as_f32(v), of = as_f32(out),
                    gf = as_f32(dout), lf = as_f32(lse);
  const std::int64_t heads = q.heads, d_k = q.dim, d_v = v.dim;
  // D[i, h] = <dout_i, out_i> = sum_j P_ij dP_ij: the softmax's backward term of row i.
  std::vector<float> rowdot(static_cast<std::size_t>(a.rows * heads));

  // Pass 1, rows of A: dS_ij = P_ij (dout_i . v_j - D_i), dq_i = scale sum_j dS_ij k_j.
#pragma omp parallel
  {
    std::vector<float> acc(static_cast<std::size_t>(d_k));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* qi = qf.row(i, h);
        const float* gi = gf.row(i, h);
        const float l = *lf.row(i, h);
        const float di = dot(gi, of.row(i, h), d_v);
        rowdot[static_cast<std::size_t>(i * heads + h)] = di;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e) {
          const std::int64_t j = a.col_idx[e];
          const float* kj = kf.row(j, h);
          const float p = std::exp(scale * dot(qi, kj, d_k) + bias_of(e, h) - l);
          const float ds = p * (dot(gi, vf.row(j, h), d_v) - di);
          if (bias.dbias.data != nullptr) store_value(bias.dbias, e, h, 0, ds);
#pragma omp simd
          for (std::int64_t d = 0; d < d_k; ++d) acc[d] += ds * kj[d];
        }
        for (std::int64_t d = 0; d < d_k; ++d) store_value(dq, i, h, d, scale * acc[d]);
      }
    }
  }

  // Pass 2, rows of A^T: dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dout_i.
#pragma omp parallel
  {
    std::vector<float> acc_k(static_cast<std::size_t>(d_k)), acc_v(static_cast<std::size_t>(d_v));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t j = 0; j < at.rows; ++j) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* kj = kf.row(j, h);
        const float* vj = vf.row(j, h);
        std::fill(acc_k.begin(), acc_k.end(), 0.0f);
        std::fill(acc_v.begin(), acc_v.end(), 0.0f);
        for (std::int64_t e = at.row_ptr[j]; e < at.row_ptr[j + 1]; ++e) {
          const std::int64_t i = at.col_idx[e];
          const float* qi = qf.row(i, h);
          const float* gi = gf.row(i, h);
          const float b =
              biased ? bias_of(bias.transposed_entry[static_cast<std::size_t>(e)], h) : 0.0f;
          const float p = std::exp(scale * dot(qi, kj, d_k) + b - *lf.row(i, h));
          const float ds = p * (dot(gi, vj, d_v) - rowdot[static_cast<std::size_t>(i * heads + h)]);
#pragma omp simd
          for (std::int64_t d = 0; d < d_k; ++d) acc_k[d] += ds * qi[d];
#pragma omp simd
          for (std::int64_t d = 0; d < d_v; ++d) acc_v[d] += p * gi[d];
        }
        for (std::int64_t d = 0; d < d_k; ++d) store_value(dk, j, h, d, scale * acc_k[d]);
        for (std::int64_t d = 0; d < d_v; ++d) store_value(dv, j, h, d, acc_v[d]);
      }
    }
  }
}

}  // namespace trisparse::cpu
