#pragma once
// The CPU engine's fused attention and its backward, for patterns already checked (by a plan).
#include <cstdint>
#include <span>

#include "trisparse/core/dropout.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {

/// fused_attention for a checked pattern, in fp32 (float64 for float64 q); with lse.data != nullptr
/// also writes the per-row log-sum-exp ([rows, H, 1], natural log, -inf for empty rows). bias: a
/// per-entry score bias
/// ([nnz, H, 1] or [nnz, 1, 1], any float dtype; data == nullptr: none).
/// With dropout, out sums the kept weights (the draws of pair (i, j) of head dropout_head0 + h:
/// trisparse/core/dropout.hpp), lse the undropped normaliser; not with a bias.
void fused_attention_unchecked(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                               const tensor_view& v, const tensor_view& out, double scale,
                               const tensor_view& lse = {}, const tensor_view& bias = {},
                               const attention_dropout& dropout = {},
                               std::int64_t dropout_head0 = 0);

/// The score bias of a backward and its gradient: bias as the forward's, dbias [nnz, H, 1]
/// (dL/dS per entry; data == nullptr: not written), and for a bias the entry of the pattern that
/// each entry of the transpose is (its CSR order).
struct backward_bias {
  tensor_view bias{}, dbias{};
  std::span<const std::int64_t> transposed_entry{};
  /// Attention dropout (its state in host memory): the draws of pair (i, j) of head
  /// dropout_head0 + h (trisparse/core/dropout.hpp; rows as the pattern's). out must then be the
  /// dropped output (fused_attention_unchecked with the same dropout).
  attention_dropout dropout{};
  std::int64_t dropout_head0 = 0;
};

/// Gradients of out = fused_attention(a, q, k, v) given dout, from the forward's out and lse
/// (FlashAttention-2's backward on the pattern, fp32; float64 for float64 q): dq by rows of a, dk
/// and dv by rows of `at` = transpose(a), every element written once in a fixed order, so the
/// result is bitwise the same across runs and thread counts. dq [rows, H, D], dk [cols, H, D], dv
/// [cols, H, Dv].
void fused_attention_backward_unchecked(const csr_graph& a, const csr_graph& at,
                                        const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, const tensor_view& out,
                                        const tensor_view& lse, const tensor_view& dout,
                                        const tensor_view& dq, const tensor_view& dk,
                                        const tensor_view& dv, double scale,
                                        const backward_bias& bias = {});

}  // namespace trisparse::cpu
