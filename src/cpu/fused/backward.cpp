// The CPU engine's attention backward: FlashAttention-2's algorithm on the pattern, in two passes
// that each own their outputs (no atomics, no scatter): dq over the rows of A, dk and dv over the
// rows of A's transpose. P is recomputed from the forward's log-sum-exp, never stored.
#include <cmath>
#include <vector>

#include "../../common/arguments.hpp"
#include "../common/dropout_draws.hpp"
#include "../common/online_softmax.hpp"
#include "fast.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse::cpu {

namespace {

template <class T>
T dot(const T* x, const T* y, std::int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (std::int64_t d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

// The two passes in T: fp32, or float64 for float64 inputs (the gradcheck path).
template <class T>
void backward_passes(const csr_graph& a, const csr_graph& at, const tensor_view& q,
                     const tensor_view& k, const tensor_view& v, const tensor_view& out,
                     const tensor_view& lse, const tensor_view& dout, const tensor_view& dq,
                     const tensor_view& dk, const tensor_view& dv, double scale_in,
                     const backward_bias& bias) {
  const bool biased = bias.bias.data != nullptr;
  const operand<T> bf = biased ? as_operand<T>(bias.bias) : operand<T>{};
  // The bias of entry e (of the pattern), head h.
  const auto bias_of = [&](std::int64_t e, std::int64_t h) {
    return biased ? *bf.row(e, detail::bias_head(bias.bias, h)) : T{0};
  };
  const operand<T> qf = as_operand<T>(q), kf = as_operand<T>(k), vf = as_operand<T>(v),
                   of = as_operand<T>(out), gf = as_operand<T>(dout), lf = as_operand<T>(lse);
  const T scale = static_cast<T>(scale_in);
  const std::int64_t heads = q.heads, d_k = q.dim, d_v = v.dim;
  // Attention dropout's factor m of pair (i, j), head h (1 without dropout), from a thread's draws.
  const auto keep = [&](dropout_draws& draws, std::int64_t i, std::int64_t j, std::int64_t h) {
    return static_cast<T>(draws.factor(i, j, static_cast<std::int32_t>(bias.dropout_head0 + h)));
  };
  // D[i, h] = <dout_i, out_i> = sum_j P_ij dP_ij: the softmax's backward term of row i.
  std::vector<T> rowdot(static_cast<std::size_t>(a.rows * heads));

  // Pass 1, rows of A: dS_ij = P_ij (m_ij dout_i . v_j - D_i), dq_i = scale sum_j dS_ij k_j
  // (m = 1 without dropout; D_i = dout_i . out_i = sum_j P_ij m_ij dout_i . v_j, out dropped).
#pragma omp parallel
  {
    std::vector<T> acc(static_cast<std::size_t>(d_k));
    dropout_draws draws(bias.dropout);
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const T* qi = qf.row(i, h);
        const T* gi = gf.row(i, h);
        const T l = *lf.row(i, h);
        const T di = dot(gi, of.row(i, h), d_v);  // out: the dropped output with dropout
        rowdot[static_cast<std::size_t>(i * heads + h)] = di;
        std::fill(acc.begin(), acc.end(), T{0});
        for (std::int64_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e) {
          const std::int64_t j = a.col_idx[e];
          const T* kj = kf.row(j, h);
          const T p = std::exp(scale * dot(qi, kj, d_k) + bias_of(e, h) - l);
          const T ds = p * (keep(draws, i, j, h) * dot(gi, vf.row(j, h), d_v) - di);
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
    std::vector<T> acc_k(static_cast<std::size_t>(d_k)), acc_v(static_cast<std::size_t>(d_v));
    dropout_draws draws(bias.dropout);
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t j = 0; j < at.rows; ++j) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const T* kj = kf.row(j, h);
        const T* vj = vf.row(j, h);
        std::fill(acc_k.begin(), acc_k.end(), T{0});
        std::fill(acc_v.begin(), acc_v.end(), T{0});
        for (std::int64_t e = at.row_ptr[j]; e < at.row_ptr[j + 1]; ++e) {
          const std::int64_t i = at.col_idx[e];
          const T* qi = qf.row(i, h);
          const T* gi = gf.row(i, h);
          const T b =
              biased ? bias_of(bias.transposed_entry[static_cast<std::size_t>(e)], h) : T{0};
          const T p = std::exp(scale * dot(qi, kj, d_k) + b - *lf.row(i, h));
          const T m = keep(draws, i, j, h), pm = p * m;
          const T ds = p * (m * dot(gi, vj, d_v) - rowdot[static_cast<std::size_t>(i * heads + h)]);
#pragma omp simd
          for (std::int64_t d = 0; d < d_k; ++d) acc_k[d] += ds * qi[d];
#pragma omp simd
          for (std::int64_t d = 0; d < d_v; ++d) acc_v[d] += pm * gi[d];
        }
        for (std::int64_t d = 0; d < d_k; ++d) store_value(dk, j, h, d, scale * acc_k[d]);
        for (std::int64_t d = 0; d < d_v; ++d) store_value(dv, j, h, d, acc_v[d]);
      }
    }
  }
}

}  // namespace

void fused_attention_backward_unchecked(const csr_graph& a, const csr_graph& at,
                                        const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, const tensor_view& out,
                                        const tensor_view& lse, const tensor_view& dout,
                                        const tensor_view& dq, const tensor_view& dk,
                                        const tensor_view& dv, double scale,
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
  detail::check_dropout(bias.dropout);
  in_type_of(q.type, [&]<class T>() {
    backward_passes<T>(a, at, q, k, v, out, lse, dout, dq, dk, dv, scale, bias);
  });
}

}  // namespace trisparse::cpu
