#pragma once
// Argument checks shared by every attention backend (internal).
#include <optional>

#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"
#include "trisparse/ops/attention.hpp"

namespace trisparse::detail {

/// Checks q: [rows, H, D], k: [cols, H, D], v: [cols, H, Dv], out: [rows, H, Dv], all on `where`.
/// @throws invalid_input naming the offending argument.
void check_attention_args(std::int64_t rows, std::int64_t cols, const tensor_view& q,
                          const tensor_view& k, const tensor_view& v, const tensor_view& out,
                          device_kind where);

/// Checks the gradients dq, dk, dv against q, k, v (shapes, and on `where`).
/// @throws invalid_input naming the offending argument.
void check_gradient_args(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                         const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                         device_kind where);

/// Checks a CUDA backward's saved forward: out [rows, H, Dv] and lse [rows, H, 1], on the GPU.
/// @throws invalid_input naming the offending argument.
void check_saved_forward(std::int64_t rows, const tensor_view& q, const tensor_view& v,
                         const tensor_view& out, const tensor_view& lse);

/// Checks a per-entry score bias: [nnz, heads, 1] or [nnz, 1, 1] (one bias shared by the heads),
/// on `where`; `what` names it ("bias", "dbias"). With `per_head`, only [nnz, heads, 1].
/// @throws invalid_input naming the argument.
void check_bias(const tensor_view& bias, const char* what, std::int64_t nnz, std::int64_t heads,
                device_kind where, bool per_head = false);

/// The head of a checked bias that head h reads (0 when the bias is shared by the heads).
inline std::int64_t bias_head(const tensor_view& bias, std::int64_t h) {
  return bias.heads == 1 ? 0 : h;
}

/// Checks a block-sparse backward's importance outputs (options.block_mass, block_grad, those
/// set): [batch * qb, heads, kb], f32 (or f64 on the CPU), on `where`.
/// @throws invalid_input naming the argument.
void check_block_importance(const attention_options& options, std::int64_t batch, std::int64_t qb,
                            std::int64_t heads, std::int64_t kb, device_kind where);

/// Checks a block-sparse call's block bias (options.block_bias: [batch * qb, heads or 1, kb]) and,
/// with `backward`, its gradient (dblock_bias: [batch * qb, heads, kb]): f32 (or f64 on the CPU),
/// on `where`; none of them set outside a backward (`backward` false: dblock_bias must be empty).
/// @throws invalid_input naming the argument.
void check_block_bias(const attention_options& options, std::int64_t batch, std::int64_t qb,
                      std::int64_t heads, std::int64_t kb, device_kind where, bool backward);

/// @throws not_supported if options asks for a block bias: `what` does not take one (block-sparse
/// plans do).
void check_no_block_bias(const attention_options& options, const char* what);

/// The largest entry count a CUDA plan over a graph pattern takes: the fused 3S, ME-BCRS and
/// backward formats index entries and blocks in 32 bits (GAT's hold 64-bit offsets, but no run
/// has gone past 2^31 entries, so it takes the same limit).
inline constexpr std::int64_t kMaxDeviceEntries = (std::int64_t{1} << 31) - 1;

/// Checks, before anything is built, that a pattern of `nnz` entries fits a CUDA plan (`what`:
/// the plan). @throws invalid_input naming the limit and the count.
void check_device_entries(std::int64_t nnz, const char* what);

/// @throws not_supported if options.dropout asks for dropout: `what` does not draw it (attention
/// within segments and the CUDA block kernels do).
void check_no_dropout(const attention_options& options, const char* what);

/// @throws invalid_input unless options.dropout is none or p in [0, 1) with a state.
void check_dropout(const attention_dropout& dropout);

/// check_dropout, and @throws invalid_input if both keep factors (keep.data) and draws are given.
void check_keep_or_dropout(const tensor_view& keep, const attention_dropout& dropout);

/// The scale to use: the given one, or 1/sqrt(head_dim). @throws invalid_input if not finite.
double resolve_scale(const std::optional<double>& scale, std::int64_t head_dim);

}  // namespace trisparse::detail
