// The top-k block-sparse plan: masks selected on the GPU from Q and K at every step.
#include "trisparse/ops/block_sparse.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "../common/arguments.hpp"
#include "../cuda/attention/block_sparse/plan.hpp"
#include "../formats/block_sparse_internal.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse {

using detail::topk_rows;

struct topk_block_sparse_plan::state {
  std::shared_ptr<cuda::topk_device_plan> device;
  block_sparse_mask shape;  // lengths, heads, block, causality; no blocks
  std::int64_t slots = 0;
  bool selected = false;
  plan_report report;
};

topk_block_sparse_plan topk_block_sparse_plan::build(std::span<const std::int64_t> cu_seqlens_q,
                                                     std::span<const std::int64_t> cu_seqlens_k,
                                                     std::int64_t heads, std::int64_t head_dim,
                                                     const topk_mask_options& options,
                                                     const block_sparse_plan_options& plan_options,
                                                     stream_ref stream) {
  const auto t0 = std::chrono::steady_clock::now();
  TRISPARSE_EXPECTS_INPUT(options.block >= 1 && options.top_k >= 0 && heads >= 1 && head_dim >= 1,
                          "top-k plan: block, heads and head_dim must be >= 1 and top_k >= 0");
  TRISPARSE_EXPECTS_INPUT(
      plan_options.algo == algorithm::automatic || plan_options.algo == algorithm::block,
      "top-k plans run block, not " + std::string(to_string(plan_options.algo)));
  if (!cuda::block_sparse_supports(options.block)) {
    throw not_supported("top-k plans take blocks that are multiples of 16, not " +
                        std::to_string(options.block));
  }
  auto s = std::make_shared<state>();
  s->shape.block = options.block;
  s->shape.heads = heads;
  s->shape.causal = options.causal;
  s->shape.cu_seqlens_q.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());
  s->shape.cu_seqlens_k.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  s->slots = options.top_k + (options.keep_diagonal ? 1 : 0);
  topk_rows(s->shape, s->slots, false).check();  // the offsets, through the mask's own checks
  s->device = cuda::make_topk_plan(topk_rows(s->shape, s->slots, true), options.top_k,
                                   options.keep_diagonal, head_dim, plan_options.kernel,
                                   plan_options.gradients, stream);
  s->report.algo = algorithm::block;
  s->report.where = device_kind::cuda;
  s->report.rows = s->shape.cu_seqlens_q.back();
  s->report.cols = s->shape.cu_seqlens_k.back();
  s->report.format =
      "top-" + std::to_string(options.top_k) + " block mask G=" + std::to_string(options.block) +
      " selected on the device (" + cuda::kernel_name(cuda::attention_of(*s->device)) + ")";
  s->report.format_bytes = cuda::device_bytes(cuda::attention_of(*s->device));
  s->report.build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  topk_block_sparse_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

void topk_block_sparse_plan::select(const tensor_view& q, const tensor_view& k, stream_ref stream) {
  cuda::select_topk(*state_->device, q, k, stream);
  state_->selected = true;
}

void topk_block_sparse_plan::run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                 const tensor_view& out, const attention_options& options,
                                 stream_ref stream) const {
  const block_sparse_mask& m = state_->shape;
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, v, out,
                               device_kind::cuda);
  TRISPARSE_EXPECTS_INPUT(state_->selected, "top-k plan: select() the mask before run()");
  detail::check_dropout(options.dropout);
  detail::check_no_block_bias(options, "topk_block_sparse_plan");
  TRISPARSE_EXPECTS_INPUT(q.heads == m.heads, "the plan has " + std::to_string(m.heads) +
                                                  " heads, q " + std::to_string(q.heads));
  TRISPARSE_EXPECTS_INPUT(options.algo == algorithm::automatic || options.algo == algorithm::block,
                          "top-k plans run block, not " + std::string(to_string(options.algo)));
  if (options.lse.data != nullptr) {
    check_view(options.lse, "lse", m.cu_seqlens_q.back(), q.heads, 1);
    TRISPARSE_EXPECTS_INPUT(options.lse.where == device_kind::cuda, "lse must be on the GPU");
  }
  cuda::run_block_sparse(cuda::attention_of(*state_->device), q, k, v, out, options.lse,
                         detail::resolve_scale(options.scale, q.dim), options.dropout, {}, stream);
}

void topk_block_sparse_plan::backward(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const tensor_view& lse, const tensor_view& dout,
                                      const tensor_view& dq, const tensor_view& dk,
                                      const tensor_view& dv, workspace_view workspace,
                                      const attention_options& options, stream_ref stream) const {
  const block_sparse_mask& m = state_->shape;
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, v, dout,
                               device_kind::cuda);
  detail::check_gradient_args(q, k, v, dq, dk, dv, device_kind::cuda);
  detail::check_saved_forward(m.cu_seqlens_q.back(), q, v, out, lse);
  TRISPARSE_EXPECTS_INPUT(state_->selected, "top-k plan: select() the mask before backward()");
  TRISPARSE_EXPECTS_INPUT(q.heads == m.heads, "the plan has " + std::to_string(m.heads) +
                                                  " heads, q " + std::to_string(q.heads));
  const auto [qb, kb] = detail::most_blocks(m);
  detail::check_block_importance(options, m.batch(), qb, q.heads, kb, device_kind::cuda);
  detail::check_dropout(options.dropout);
  detail::check_no_block_bias(options, "topk_block_sparse_plan");
  cuda::run_block_sparse_backward(cuda::attention_of(*state_->device), q, k, v, out, lse, dout, dq,
                                  dk, dv, detail::resolve_scale(options.scale, q.dim),
                                  {options.block_mass, options.block_grad, qb}, options.dropout, {},
                                  workspace, stream);
}

std::size_t topk_block_sparse_plan::backward_workspace_bytes(std::int64_t heads,
                                                             bool importance) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0, "backward_workspace_bytes: heads must be >= 0");
  return cuda::block_sparse_backward_workspace_bytes(cuda::attention_of(*state_->device), heads,
                                                     importance);
}

void topk_block_sparse_plan::block_mass(const tensor_view& q, const tensor_view& k,
                                        const tensor_view& lse, workspace_view workspace,
                                        const attention_options& options, stream_ref stream) const {
  const block_sparse_mask& m = state_->shape;
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, k, q,
                               device_kind::cuda);  // (no v or out: q and k stand in)
  TRISPARSE_EXPECTS_INPUT(state_->selected, "top-k plan: select() the mask before block_mass()");
  TRISPARSE_EXPECTS_INPUT(q.heads == m.heads, "the plan has " + std::to_string(m.heads) +
                                                  " heads, q " + std::to_string(q.heads));
  const auto [qb, kb] = detail::most_blocks(m);
  detail::check_block_importance(options, m.batch(), qb, q.heads, kb, device_kind::cuda);
  TRISPARSE_EXPECTS_INPUT(options.block_mass.data != nullptr && options.block_grad.data == nullptr,
                          "block_mass writes options.block_mass (set it) and no block_grad (the "
                          "|dS| sums need a backward)");
  check_view(lse, "lse", m.cu_seqlens_q.back(), q.heads, 1);
  TRISPARSE_EXPECTS_INPUT(lse.where == device_kind::cuda, "lse must be on the GPU");
  cuda::run_block_sparse_mass(cuda::attention_of(*state_->device), q, k, lse,
                              detail::resolve_scale(options.scale, q.dim),
                              {options.block_mass, {}, qb}, workspace, stream);
}

std::size_t topk_block_sparse_plan::block_mass_workspace_bytes(std::int64_t heads) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0, "block_mass_workspace_bytes: heads must be >= 0");
  return cuda::block_sparse_mass_workspace_bytes(cuda::attention_of(*state_->device), heads);
}

block_sparse_mask topk_block_sparse_plan::mask(stream_ref stream) const {
  TRISPARSE_EXPECTS_INPUT(state_->selected, "top-k plan: select() the mask before mask()");
  const std::vector<std::int32_t> slots = cuda::download_blocks(*state_->device, stream);
  block_sparse_mask m = topk_rows(state_->shape, 0, false);
  std::size_t at = 0;
  for (block_mask& bm : m.masks) {
    bm.blocks.row_ptr.assign(1, 0);
    for (std::int64_t r = 0; r < bm.blocks.rows; ++r) {
      for (std::int64_t i = 0; i < state_->slots; ++i, ++at)
        if (slots[at] < bm.blocks.cols) bm.blocks.col_idx.push_back(slots[at]);
      bm.blocks.row_ptr.push_back(bm.blocks.nnz());
    }
  }
  m.check();
  return m;
}

const plan_report& topk_block_sparse_plan::report() const { return state_->report; }

}  // namespace trisparse
