#pragma once
#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {
/// fused_attention for a pattern already checked (by a plan's build).
void fused_attention_unchecked(const csr_graph& a, const tensor_view& q, const tensor_view& k,
                               const tensor_view& v, const tensor_view& out, float scale);
}  // namespace trisparse::cpu
