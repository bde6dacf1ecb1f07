#pragma once
// The CPU engine's fused attention and its backward, for patterns already checked (by a plan).
#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {

/// fused_attention for a checked pattern; with lse.data != nullptr also writes the per-row
/// log-sum-exp ([rows, H, 1], natural log, -inf for empty rows).
void fused_attention_unchecked(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                               const tensor_view& v, const tensor_view& out, float scale,
                               const tensor_view& lse = {});

/// Gradients of out = fused_attention(a, q, k, v) given dout, from the forward's out and lse
/// (FlashAttention-2's backward on the pattern, fp32): dq by rows of a, dk and dv by rows of
/// `at` = transpose(a), every element written once in a fixed order, so the result is bitwise
/// the same across runs and thread counts. dq [rows, H, D], dk [cols, H, D], dv [cols, H, Dv].
void fused_attention_backward_unchecked(const csr_graph& a, const csr_graph& at,
                                        const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, const tensor_view& out,
                                        const tensor_view& lse, const tensor_view& dout,
                                        const tensor_view& dq, const tensor_view& dk,
                                        const tensor_view& dv, float scale);

}  // namespace trisparse::cpu
