#include "trisparse/ops/block_sparse.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#include "../cpu/block_sparse/engine.hpp"
#include "arguments.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse {

struct block_sparse_attention_plan::state {
  block_sparse_mask mask;
  plan_report report;
};

namespace {

// Attended (query, key) pairs of one mask: per kept block, its rows' keys up to the causal limit.
std::int64_t attended_pairs(const block_sparse_mask& m) {
  std::int64_t n = 0;
  const std::int64_t g = m.block;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    const std::int64_t lq = m.len_q(b), lk = m.len_k(b);
    for (std::int64_t h = 0; h < m.heads; ++h) {
      const csr_graph& blocks = m.masks[b * m.heads + h].blocks;
      for (std::int64_t r = 0; r < blocks.rows; ++r) {
        for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          for (std::int64_t i = r * g; i < std::min(lq, (r + 1) * g); ++i) {
            const std::int64_t last = m.causal ? std::min(lk - 1, i + (lk - lq)) : lk - 1;
            n += std::max<std::int64_t>(0, std::min(j0 + g, last + 1) - j0);
          }
        }
      }
    }
  }
  return n;
}

}  // namespace

block_sparse_attention_plan block_sparse_attention_plan::build(
    block_sparse_mask mask, device_kind where, const block_sparse_plan_options& options,
    stream_ref /*stream*/) {
  const auto t0 = std::chrono::steady_clock::now();
  mask.check();
  if (where != device_kind::cpu)
    throw not_supported("block-sparse attention has no CUDA kernel in this build yet");
  const algorithm algo = options.algo == algorithm::automatic ? algorithm::cpu_fused : options.algo;
  TRISPARSE_EXPECTS_INPUT(algo == algorithm::cpu_reference || algo == algorithm::cpu_fused,
                          "block-sparse attention runs cpu_reference or cpu_fused, not " +
                              std::string(to_string(algo)));
  auto s = std::make_shared<state>();
  s->report.algo = algo;
  s->report.where = where;
  s->report.rows = mask.cu_seqlens_q.back();
  s->report.cols = mask.cu_seqlens_k.back();
  s->report.nnz = attended_pairs(mask);
  s->report.format = "block mask G=" + std::to_string(mask.block) + ", " +
                     std::to_string(mask.active_blocks()) + " blocks";
  std::int64_t bytes = 0;
  for (const block_mask& m : mask.masks)
    bytes += static_cast<std::int64_t>(8 * m.blocks.row_ptr.size() + 4 * m.blocks.col_idx.size());
  s->report.format_bytes = bytes;
  s->mask = std::move(mask);
  s->report.build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  block_sparse_attention_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

void block_sparse_attention_plan::run(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const attention_options& options, stream_ref) const {
  const block_sparse_mask& m = state_->mask;
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, v, out,
                               state_->report.where);
  TRISPARSE_EXPECTS_INPUT(m.heads == 1 || m.heads == q.heads,
                          "the mask has " + std::to_string(m.heads) + " heads, q " +
                              std::to_string(q.heads) + " (a mask is per head or shared)");
  const double scale = detail::resolve_scale(options.scale, q.dim);
  const algorithm algo = options.algo == algorithm::automatic ? state_->report.algo : options.algo;
  switch (algo) {
    case algorithm::cpu_reference:
      reference::block_sparse_attention(m, q, k, v, out, scale);
      return;
    case algorithm::cpu_fused:
      cpu::block_sparse_attention_unchecked(m, q, k, v, out, static_cast<float>(scale));
      return;
    default:
      throw invalid_input("block-sparse attention runs cpu_reference or cpu_fused, not " +
                          std::string(to_string(algo)));
  }
}

const plan_report& block_sparse_attention_plan::report() const { return state_->report; }
const block_sparse_mask& block_sparse_attention_plan::mask() const { return state_->mask; }

}  // namespace trisparse
