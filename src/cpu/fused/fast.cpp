// The CPU engine's fused attention: fp32 (float64 for float64 inputs), OpenMP over rows, online
// softmax per chunk of neighbours.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <vector>

#include "../../common/arguments.hpp"
#include "../common/dropout_draws.hpp"
#include "../common/online_softmax.hpp"
#include "fast.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/cpu.hpp"

namespace trisparse::cpu {

namespace {

// The engine in T: fp32, or float64 for float64 inputs (the gradcheck path).
template <class T>
void attend_rows(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                 const tensor_view& v, const tensor_view& out, double scale, const tensor_view& lse,
                 const tensor_view& bias, const attention_dropout& dropout,
                 std::int64_t dropout_head0) {
  const bool biased = bias.data != nullptr, drops = dropout.p > 0;
  const operand<T> qf = as_operand<T>(q), kf = as_operand<T>(k), vf = as_operand<T>(v);
  const operand<T> bf = biased ? as_operand<T>(bias) : operand<T>{};
  const std::int64_t heads = q.heads, dk = q.dim, dv = v.dim;
  // exp(x) = exp2(x * log2 e): fold log2 e into the scale once.
  const T scale2 = static_cast<T>(scale) * std::numbers::log2e_v<T>;

#pragma omp parallel
  {
    std::vector<T> qrow(dk);
    row_state<T> st(dv);
    dropout_draws draws(dropout);
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t i = 0; i < a.rows; ++i) {
      const std::int64_t e0 = a.row_ptr[i], e1 = a.row_ptr[i + 1];
      for (std::int64_t h = 0; h < heads; ++h) {
        const T* qp = qf.row(i, h);
        for (std::int64_t d = 0; d < dk; ++d) qrow[d] = qp[d] * scale2;
        st.reset();
        for (std::int64_t c0 = e0; c0 < e1; c0 += kChunk) {
          const auto key_row = [&](std::int64_t j) { return std::int64_t{a.col_idx[c0 + j]}; };
          const std::int64_t n = std::min(kChunk, e1 - c0);
          const auto bias_of = [&, bh = biased ? detail::bias_head(bias, h) : 0](std::int64_t j) {
            return *bf.row(c0 + j, bh) * std::numbers::log2e_v<T>;
          };
          const auto keep_of = [&, head = static_cast<std::int32_t>(dropout_head0 + h)](
                                   std::int64_t j) { return draws.factor(i, key_row(j), head); };
          if (biased && drops) {
            attend_chunk(qrow.data(), n, key_row, kf, vf, h, dk, dv, st, bias_of, keep_of);
          } else if (biased) {
            attend_chunk(qrow.data(), n, key_row, kf, vf, h, dk, dv, st, bias_of);
          } else if (drops) {
            attend_chunk(qrow.data(), n, key_row, kf, vf, h, dk, dv, st, no_bias{}, keep_of);
          } else {
            attend_chunk(qrow.data(), n, key_row, kf, vf, h, dk, dv, st);
          }
        }
        store_row(st, out, i, h);
        if (lse.data != nullptr) store_value(lse, i, h, 0, row_lse(st));
      }
    }
  }
}

}  // namespace

void fused_attention_unchecked(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                               const tensor_view& v, const tensor_view& out, double scale,
                               const tensor_view& lse, const tensor_view& bias,
                               const attention_dropout& dropout, std::int64_t dropout_head0) {
  detail::check_attention_args(a.rows, a.cols, q, k, v, out, device_kind::cpu);
  if (lse.data != nullptr) check_view(lse, "lse", a.rows, q.heads, 1);
  if (bias.data != nullptr) detail::check_bias(bias, "bias", a.nnz(), q.heads, device_kind::cpu);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "scale must be finite");
  in_type_of(q.type, [&]<class T>() {
    attend_rows<T>(a, q, k, v, out, scale, lse, bias, dropout, dropout_head0);
  });
}

void fused_attention(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                     const tensor_view& v, const tensor_view& out, float scale) {
  a.check();
  fused_attention_unchecked(a, q, k, v, out, scale);
}

}  // namespace trisparse::cpu
