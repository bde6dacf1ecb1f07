#pragma once
// The arguments of the layers' runs (trisparse/ops/layers.hpp): plain views and numbers, no plan,
// so that the backends' private headers take these types without the plans' declarations.
#include <cstdint>

#include "trisparse/core/dropout.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse {

/// gat_plan (CUDA): rows (forward) and columns (backward) with more entries than this are cut
/// into chunks of this many, taken by separate warps and merged in chunk order.
inline constexpr std::int64_t gat_chunk_entries = 256;
/// gat_plan (CUDA): the widest heads (C) the kernels take.
inline constexpr std::int64_t gat_max_head_width = 512;

/// How the fused GCN layer computes P x w.
enum class gcn_order : std::uint8_t {
  automatic,  ///< the measured rule (gcn_fused_plan::fused)
  fused,      ///< (P x) w and the epilogue in one kernel (GraphCUDA's A·X·W)
  unfused,    ///< x w (cuBLAS), P (x w) (SpMM), then the epilogue
};

/// One run of the fused GCN layer: out = P x w + bias, ReLU'd with `relu`.
struct gcn_fused_args {
  tensor_view x;     ///< [N, 1, F_in]
  tensor_view w;     ///< [F_in, 1, F_out], row-major weights, x's dtype
  tensor_view bias;  ///< [1, 1, F_out], f32 or x's dtype; data == nullptr: none
  tensor_view out;   ///< [N, 1, F_out], f32 or x's dtype (CPU: any dtype, computed in float64)
  bool relu = true;
  /// The ReLU mask, N * ceil(F_out / 32) words on out's device, bit f % 32 of word
  /// i * ceil(F_out / 32) + f / 32 set where out's row i, column f is > 0 before the ReLU (what
  /// the backward reads); nullptr: not written.
  std::uint32_t* relu_mask = nullptr;
  /// [N, 1, F_in] in x's dtype: P x as the W product used it (the backward's dW = (P x)^T dZ);
  /// written by the fused order only (data == nullptr: not written).
  tensor_view ax;
  gcn_order order = gcn_order::automatic;
};

/// The gradients of one gcn_fused_plan::forward given dout (deterministic).
struct gcn_fused_grad_args {
  tensor_view dout;  ///< [N, 1, F_out], f32 or x's dtype
  /// The forward's ReLU mask (nullptr: the forward had no ReLU).
  const std::uint32_t* relu_mask = nullptr;
  tensor_view x;      ///< the forward's x (read by the CPU and the unfused order)
  tensor_view w;      ///< the forward's w
  tensor_view ax;     ///< the forward's P x (read by the fused order on CUDA)
  tensor_view dx;     ///< [N, 1, F_in], f32 or x's dtype; data == nullptr: not computed
  tensor_view dw;     ///< [F_in, 1, F_out], f32 or x's dtype
  tensor_view dbias;  ///< [1, 1, F_out], f32 or x's dtype; data == nullptr: not computed
  gcn_order order = gcn_order::automatic;  ///< the forward's
};

/// One run of the fused GAT attention over a pattern whose row i lists the sources j of target
/// i's incoming edges: per head h, e_ij = LeakyReLU(a_dst[i, h] + a_src[j, h]), softmax over row
/// i's entries, and out[i, h] = sum_j softmax_ij keep_ij x[j, h] -- no [E, H, C] tensor.
struct gat_args {
  tensor_view x;      ///< [cols, H, C], f16, bf16 or f32: the sources' features (W x_j)
  tensor_view a_src;  ///< [cols, H, 1] f32: a_src . W x_j
  tensor_view a_dst;  ///< [rows, H, 1] f32: a_dst . W x_i
  /// [nnz, H, 1] f32: a factor on each weight after the softmax (attention dropout: 0 or
  /// 1 / (1 - p)); data == nullptr: 1. Row e holds entry e's (CSR entry order), or row
  /// keep_index[e] where keep_index is given.
  tensor_view keep;
  /// [nnz] on keep's device: the row of keep holding each entry's factors, so that a mask drawn
  /// in another edge order (PyG's) serves without a gather; nullptr: row e. With `dropout`: the
  /// input edge each entry's draws are keyed by.
  const std::int64_t* keep_index = nullptr;
  tensor_view out;  ///< [rows, H, C], f32 or x's dtype (CPU: any float dtype)
  /// [rows, H, 1] f32: log sum_j exp(e_ij) over row i (-inf for an empty row), what the backward
  /// reads; data == nullptr: not written.
  tensor_view lse;
  /// Attention dropout drawn in the kernels, in place of `keep` (trisparse/core/dropout.hpp): the
  /// factor of entry e in head h is input edge u's draw in head h (philox::edge_word), where u =
  /// keep_index[e] (or e without keep_index): the draws of edge_attention_plan's GAT kernels for
  /// the same input edges. `state` in host memory for the CPU, device memory for CUDA; give the
  /// backward the forward's.
  attention_dropout dropout{};
  double negative_slope = 0.2;
};

/// The gradients of one gat_plan::forward given dout (deterministic).
struct gat_grad_args {
  tensor_view x, a_src, a_dst, keep;  ///< the forward's inputs
  /// The rows of keep, or the input edges the dropout draws are keyed by (as gat_args's).
  const std::int64_t* keep_index = nullptr;
  attention_dropout dropout{};  ///< the forward's dropout draws (or none)
  tensor_view out, lse;         ///< the forward's outputs (lse is required)
  tensor_view dout;             ///< [rows, H, C] in out's dtype
  tensor_view dx;               ///< [cols, H, C] in dout's dtype
  tensor_view da_src;           ///< [cols, H, 1] f32
  tensor_view da_dst;           ///< [rows, H, 1] f32
  double negative_slope = 0.2;
};

/// A multigraph's edges on one device, in memory the caller owns, grouped twice (each edge once,
/// repeated (target, source) pairs as separate edges): by target, row_ptr[rows + 1] over the
/// edges with src[p] the source and edge[p] the row of the per-edge tensors (the input's edge id)
/// of the edge at position p, and dst[p] its target; by source, col_ptr[cols + 1] over
/// by_source[], the positions (in target order) of each source's edges. Node ids are 32-bit;
/// positions, offsets and the edge count 64-bit (past 2^31 edges). `edge` may be null: the
/// positions are the input's edge ids (a CSR given in target order). col_ptr, dst and by_source
/// may be left null together: a forward-only multigraph (its plan's backward refuses).
struct multigraph_view {
  std::int64_t rows = 0, cols = 0, edges = 0;
  const std::int64_t* row_ptr = nullptr;
  const std::int32_t* src = nullptr;
  const std::int32_t* dst = nullptr;
  const std::int64_t* edge = nullptr;
  const std::int64_t* col_ptr = nullptr;
  const std::int64_t* by_source = nullptr;
  /// Lines (targets, sources) with more than `heavy` edges, listed (int32 ids) for kernels that
  /// give each of their heads a warp of its own; heavy = 0: no lists (every line a warp).
  std::int64_t heavy = 0, heavy_row_count = 0, heavy_col_count = 0;
  const std::int32_t* heavy_rows = nullptr;
  const std::int32_t* heavy_cols = nullptr;
  device_kind where = device_kind::cuda;
  int device_id = 0;
};

/// TransformerConv's attention with edge features (PyG's edge_dim), fused: per head h, the score
/// of edge p = (i <- j) with features a_p is s_p = scale q_i . k_j + r_i . a_p (r_i = W_e^T q_i,
/// formed by the caller), the softmax runs over each target's edges (each copy of a repeated
/// pair its own term), and out_i = sum_p alpha_p v_j, out_edge_i = sum_p alpha_p a_p, so that the
/// layer's message sum is out + W_e out_edge -- no [E, H, C] tensor, no [E, H] score.
struct edge_attention_args {
  tensor_view q;         ///< [rows, H, C], f16, bf16 or f32
  tensor_view k, v;      ///< [cols, H, C], q's dtype
  tensor_view r;         ///< [rows, H, F], q's dtype; F = 0 (data == nullptr): no edge features
  tensor_view a;         ///< [edges, 1, F], q's dtype: row e holds the features of edge e
  tensor_view out;       ///< [rows, H, C], q's dtype
  tensor_view out_edge;  ///< [rows, H, F] f32 or q's dtype (with edge features)
  tensor_view lse;       ///< [rows, H, 1] f32: the log-sum-exp of each row's scores (-inf: none)
  /// [edges, H, 1] f32: a factor per (edge, head) on the edge's weight in the output's sums,
  /// row e for edge e (attention dropout: 0 or 1 / (1 - p)); data == nullptr: none. The softmax's
  /// normaliser is not affected (PyG drops the normalised weights).
  tensor_view keep;
  /// Attention dropout drawn in the kernels, in place of `keep` (trisparse/core/dropout.hpp): the
  /// factor of input edge u (each copy its own) in head h is philox::edge_word(u, h)'s. Give
  /// the backward the forward's.
  attention_dropout dropout{};
  double scale = 1.0;
};

/// The gradients of one edge_attention_plan::forward given dout and dout_edge (deterministic).
struct edge_attention_grad_args {
  tensor_view q, k, v, r, a;       ///< the forward's inputs
  tensor_view out, out_edge, lse;  ///< its outputs
  tensor_view dout;                ///< [rows, H, C], q's dtype
  tensor_view dout_edge;           ///< [rows, H, F] out_edge's dtype (with edge features)
  tensor_view dq;                  ///< [rows, H, C] f32 or q's dtype (dk, dv, dr, da alike)
  tensor_view dk, dv;              ///< [cols, H, C] f32 or q's dtype
  tensor_view dr;                  ///< [rows, H, F] dq's dtype (with edge features)
  tensor_view da;                  ///< [edges, 1, F] dq's dtype (with features): row e, edge e
  tensor_view keep;                ///< the forward's keep factors (or none)
  attention_dropout dropout{};     ///< the forward's dropout draws (or none)
  double scale = 1.0;
};

/// GAT's attention over a multigraph (PyG's GATConv with repeated edges and edge features): per
/// head, z_p = a_dst[i] + a_src[j] + a_edge[p] for edge p = (i <- j), the softmax of
/// LeakyReLU(z) over each target's edges (each copy its own term), out_i = sum alpha_p x_j.
struct edge_gat_args {
  tensor_view x;       ///< [cols, H, C], f16, bf16 or f32: the sources' features (W x_j)
  tensor_view a_src;   ///< [cols, H, 1] f32
  tensor_view a_dst;   ///< [rows, H, 1] f32
  tensor_view a_edge;  ///< [edges, H, 1] f32: row e holds edge e's term; data == nullptr: none
  tensor_view out;     ///< [rows, H, C], x's dtype
  tensor_view lse;     ///< [rows, H, 1] f32
  tensor_view keep;    ///< as edge_attention_args::keep
  attention_dropout dropout{};  ///< as edge_attention_args::dropout
  double negative_slope = 0.2;
};

/// The gradients of one edge_attention_plan::gat_forward given dout (deterministic).
struct edge_gat_grad_args {
  tensor_view x, a_src, a_dst, a_edge;  ///< the forward's inputs
  tensor_view out, lse;                 ///< its outputs
  tensor_view dout;                     ///< [rows, H, C], x's dtype
  tensor_view dx;                       ///< [cols, H, C] f32 or x's dtype
  tensor_view da_src;                   ///< [cols, H, 1] f32
  tensor_view da_dst;                   ///< [rows, H, 1] f32
  tensor_view da_edge;                  ///< [edges, H, 1] f32 (with a_edge): row e, edge e's
  tensor_view keep;                     ///< the forward's keep factors (or none)
  attention_dropout dropout{};          ///< the forward's dropout draws (or none)
  double negative_slope = 0.2;
};

}  // namespace trisparse
