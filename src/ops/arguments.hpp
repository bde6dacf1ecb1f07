#pragma once
// Argument checks shared by every attention backend (internal).
#include <optional>

#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

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

/// The scale to use: the given one, or 1/sqrt(head_dim). @throws invalid_input if not finite.
double resolve_scale(const std::optional<double>& scale, std::int64_t head_dim);

}  // namespace trisparse::detail
