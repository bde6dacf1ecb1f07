#pragma once
#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"

namespace trisparse::cpu {
/// Block-sparse attention, fp32, OpenMP over (query block, head), for a mask already checked and
/// operands already checked against it (by a plan). Rows with no key left give zeros.
void block_sparse_attention_unchecked(const block_sparse_mask& mask, const tensor_view& q,
                                      const tensor_view& k, const tensor_view& v,
                                      const tensor_view& out, float scale);
}  // namespace trisparse::cpu
