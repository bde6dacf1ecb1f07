#pragma once
#include "trisparse/core/dropout.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"

namespace trisparse::cpu {
/// Block-sparse attention, fp32 (float64 for float64 q), OpenMP over (query block, head), for a
/// mask already checked and operands already checked against it (by a plan). Rows with no key
/// left give zeros. With `dropout` (its state in host memory), the kernels' draws
/// (trisparse/core/dropout.hpp: rows within the sequence, head b * H + h). With `lse` (any float
/// type, [rows, H, 1]) also each row's log-sum-exp of the scaled scores (-inf for a row with no
/// key; dropout does not enter it), what the backward reads.
void block_sparse_attention_unchecked(const block_sparse_mask& mask, const tensor_view& q,
                                      const tensor_view& k, const tensor_view& v,
                                      const tensor_view& out, double scale,
                                      const attention_dropout& dropout = {},
                                      const tensor_view& lse = {});

/// Whether the tiled engine (blocked.cpp) runs a call: fp32 work (any input type but float64);
/// the row engine above runs the rest.
bool blocked_engine_takes(const tensor_view& q);

/// The forward in tiles (block_sparse_attention_unchecked's contract; lse always written when
/// given).
void block_sparse_forward_blocked(const block_sparse_mask& mask, const tensor_view& q,
                                  const tensor_view& k, const tensor_view& v,
                                  const tensor_view& out, double scale,
                                  const attention_dropout& dropout, const tensor_view& lse);

/// The backward in tiles, from the forward's out and lse (as the forward wrote them, with the
/// same dropout): dq, dk and dv (any float type; every row written, zeros where no pair reaches),
/// fp32 inside; operands already checked.
void block_sparse_backward_blocked(const block_sparse_mask& mask, const tensor_view& q,
                                   const tensor_view& k, const tensor_view& v,
                                   const tensor_view& out, const tensor_view& lse,
                                   const tensor_view& dout, const tensor_view& dq,
                                   const tensor_view& dk, const tensor_view& dv, double scale,
                                   const attention_dropout& dropout);

/// Block importance (attention_options::block_mass, block_grad; either view may be empty, and v
/// and dout too where block_grad is), float64
/// sums over the rows' recomputed softmax, OpenMP over (query block, head); operands and views
/// already checked; row b * qb_max + r for sequence b's block row r. Blocks the mask drops are not
/// written.
void block_importance_unchecked(const block_sparse_mask& mask, const tensor_view& q,
                                const tensor_view& k, const tensor_view& v, const tensor_view& dout,
                                double scale, const tensor_view& mass, const tensor_view& grad,
                                std::int64_t qb_max);
}  // namespace trisparse::cpu
