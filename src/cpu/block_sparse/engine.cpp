// The CPU engine's block-sparse attention: one task per (sequence, query block, head); each of its
// rows walks the active key blocks (contiguous key ranges) in chunks with an online softmax.
#include "engine.hpp"

#include <algorithm>
#include <numbers>
#include <utility>
#include <vector>

#include "../common/dropout_draws.hpp"
#include "../common/online_softmax.hpp"

namespace trisparse::cpu {

namespace {

// The engine in T: fp32, or float64 for float64 inputs.
template <class T>
void attend_blocks(const block_sparse_mask& mask, const tensor_view& q, const tensor_view& k,
                   const tensor_view& v, const tensor_view& out, double scale,
                   const attention_dropout& dropout, const tensor_view& lse) {
  const bool drops = dropout.p > 0;
  const operand<T> qf = as_operand<T>(q), kf = as_operand<T>(k), vf = as_operand<T>(v);
  const std::int64_t heads = q.heads, dk = q.dim, dv = v.dim, g = mask.block;
  const T scale2 = static_cast<T>(scale) * std::numbers::log2e_v<T>;
  std::vector<std::pair<std::int64_t, std::int64_t>> block_rows;  // (sequence, query block)
  for (std::int64_t b = 0; b < mask.batch(); ++b) {
    for (std::int64_t r = 0; r * g < mask.len_q(b); ++r) block_rows.emplace_back(b, r);
  }
  const auto tasks = static_cast<std::int64_t>(block_rows.size()) * heads;

#pragma omp parallel
  {
    std::vector<T> qrow(dk);
    row_state<T> st(dv);
    dropout_draws draws(dropout);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const auto [b, r] = block_rows[task / heads];
      const std::int64_t h = task % heads;
      const std::int64_t lq = mask.len_q(b);
      const std::int64_t q0 = mask.cu_seqlens_q[b], k0 = mask.cu_seqlens_k[b];
      const csr_graph& blocks = mask.at(b, h).blocks;
      const auto draw_head = static_cast<std::int32_t>(b * heads + h);  // dropout's head
      for (std::int64_t i = r * g; i < std::min(lq, (r + 1) * g); ++i) {
        const T* qp = qf.row(q0 + i, h);
        for (std::int64_t d = 0; d < dk; ++d) qrow[d] = qp[d] * scale2;
        st.reset();
        // Keys up to `last` (causal: aligned at the bottom right).
        const std::int64_t last = mask.last_key(b, i);
        for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          const std::int64_t j1 = std::min(j0 + g, last + 1);
          for (std::int64_t c0 = j0; c0 < j1; c0 += kChunk) {
            const std::int64_t n = std::min(kChunk, j1 - c0);
            const auto key_row = [&](std::int64_t j) { return k0 + c0 + j; };
            if (drops) {
              attend_chunk(qrow.data(), n, key_row, kf, vf, h, dk, dv, st, no_bias{},
                           [&](std::int64_t j) { return draws.factor(i, c0 + j, draw_head); });
            } else {
              attend_chunk(qrow.data(), n, key_row, kf, vf, h, dk, dv, st);
            }
          }
        }
        store_row(st, out, q0 + i, h);
        if (lse.data != nullptr) store_value(lse, q0 + i, h, 0, static_cast<double>(row_lse(st)));
      }
    }
  }
}

}  // namespace

void block_sparse_attention_unchecked(const block_sparse_mask& mask, const tensor_view& q,
                                      const tensor_view& k, const tensor_view& v,
                                      const tensor_view& out, double scale,
                                      const attention_dropout& dropout, const tensor_view& lse) {
  if (blocked_engine_takes(q))
    return block_sparse_forward_blocked(mask, q, k, v, out, scale, dropout, lse);
  in_type_of(q.type, [&]<class T>() { attend_blocks<T>(mask, q, k, v, out, scale, dropout, lse); });
}

}  // namespace trisparse::cpu
