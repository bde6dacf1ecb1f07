#pragma once
/// @file The fast CPU engine (fp32 accumulation, float64 for float64 inputs; OpenMP), usable
/// directly or through a plan.
#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {

/// Fused sparse attention on the CPU: OpenMP over rows, per row an online max-stabilised softmax
/// over chunks of neighbours, vectorised dot products and accumulation in fp32 (float64 when q is
/// float64). Inputs of any dtype (converted on load); out of any dtype. Shapes as
/// attention_plan::run. Synchronous.
void fused_attention(const csr_graph& pattern, const tensor_view& q, const tensor_view& k,
                     const tensor_view& v, const tensor_view& out, float scale);

}  // namespace trisparse::cpu
