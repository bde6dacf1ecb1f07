#pragma once
// Host <-> kernel parameters of the fused block-sparse attention kernels, forward and backward
// (plain data).
#include <bit>
#include <cstdint>

#include "../../common/attention_io.hpp"
#include "trisparse/core/dropout.hpp"

namespace trisparse::cuda::block_sparse {

/// The query rows [row0, row0 + tile rows) of sequence `seq` (row0 local to the sequence); a tile
/// never crosses a query block.
struct tile {
  std::int32_t seq, row0;
};

struct params : ragged_attention_io {
  // Mask m = seq * mask_heads + head: its block row r lists the key blocks
  // col_idx[row_ptr[mask_row[m] + r] .. row_ptr[mask_row[m] + r + 1]), ascending.
  const std::int32_t* mask_row;
  const std::int32_t* row_ptr;
  const std::int32_t* col_idx;
  // In launch order (most work first), head-major: block x = head * num_tiles + tile index, so
  // that the resident blocks share one head's K and V in L2.
  const tile* tiles;
  std::int32_t num_tiles;
  std::int32_t heads, mask_heads, block;
  // Blocks x with (x / down_wave) odd walk their keys in descending order (0: none): a wave of
  // resident blocks then starts on the keys the previous wave read last, still in L2 (H200, heads
  // 8, D = 64, N = 128K: 1-4% faster; docs/notes/block_sparse.md). The order changes the
  // rounding, not the set of keys; the result of a plan is still the same bits on every run.
  std::int32_t down_wave;
  bool causal;
  bool negate_scores;  // the scale is negative: the kernels negate Q and use |scale|
  float scale_log2;    // |scale| * log2(e)
  // Where not null, also each row's natural log-sum-exp of the scaled scores (-inf: no key).
  float* lse;
  std::int64_t lse_row, lse_head;  // element strides
  // Attention within segments (segments/walk.cuh; the mask fields above unused): row i of the
  // packed rows [0, segment_rows) attends the keys [segments[2 i], segments[2 i + 1]); tile t of
  // num_tiles holds rows [64 t, 64 t + 64).
  const std::int32_t* segments;
  std::int32_t segment_rows;
  // Its per-pair score bias (walks instantiated with PAIR), f32 natural-log units: pair (i, j) of
  // head h at pair_bias[i * pair_row + h * pair_head + j - segments[2 i]] (pair_head 0: shared);
  // where dpair_bias is set the dq kernel writes dL/dS of each pair at the same place of it.
  const float* pair_bias;
  std::int64_t pair_row, pair_head;
  float* dpair_bias;
  std::int64_t dpair_row, dpair_head;
  // Or (walks instantiated with EDGES) a score bias per edge (trisparse::segment_edges): pair (i,
  // j) takes the sum of pair_bias[e * pair_row + h * pair_head] over the edges e from key j to
  // query i, found through the edges' lists by query (query_ptr, query_key, query_edge: each
  // query's edges, keys ascending) or by key (key_ptr, key_query, key_edge); dpair_bias[e *
  // dpair_row + h * dpair_head] takes each edge's dL/dS.
  const std::int32_t *query_ptr, *query_key, *query_edge;
  const std::int32_t *key_ptr, *key_query, *key_edge;
  // Attention dropout (kernels instantiated with DROPOUT; trisparse/core/dropout.hpp): {seed,
  // offset} on the device; pair (i, j) of head h, in packed rows, keeps P times dropout_scale
  // where its 16-bit draw is at least drop_below (philox::drop_below16), else 0.
  const std::uint64_t* dropout_state;
  std::uint32_t drop_below;
  float dropout_scale;
  // A per-block score bias (attention_options::block_bias) where set, f32 natural-log units: head
  // h's bias at sequence seq's kept block (query block r, key block c) is
  // block_bias[(seq * bias_qb + r) * bias_row + h * bias_head + c] (bias_head 0: shared).
  const float* block_bias;
  std::int64_t bias_row, bias_head;
  std::int32_t bias_qb;
  std::int32_t bias_block_log2;  // log2(block) where block is a power of two, else -1 (divide)
};

/// The backward kernels (backward.cuh). The forward's fields give q, k, v, the mask and, in
/// `tiles`, the query tiles of the dq kernel (mma.sync tile rows, launch order); `out` is unused.
struct backward_params : params {
  const void* dout;
  std::int64_t do_row, do_head;
  void* dq;
  void* dk;
  void* dv;
  std::int64_t dq_row, dq_head, dk_row, dk_head, dv_row, dv_head;
  bool grads_f32;  // dq, dk, dv are f32 (else q's type)
  float scale;     // signed
  // Per head h and query row r (packed): lse2[h * rows_q + r] = the log-sum-exp in log2 units,
  // dterm[...] = <dout_r, out_r> (the first kernel writes both).
  const float* lse2;
  const float* dterm;
  std::int64_t rows_q;
  // The transposed masks: mask m's key block c lists the query blocks
  // t_idx[t_ptr[t_mask_col[m] + c] .. t_ptr[t_mask_col[m] + c + 1]), ascending.
  const std::int32_t* t_mask_col;
  const std::int32_t* t_ptr;
  const std::int32_t* t_idx;
  // The key tiles of the dk/dv kernel (row0 = the tile's first key), most work first.
  const tile* key_tiles;
  std::int32_t num_key_tiles;
  // Block importance (importance.cuh), where imp_partial is set: the dk/dv kernel's warp w writes
  // per transposed entry e (of head h's slots with a shared mask) and key tile x of its key block
  // imp_partial[2 s] = sum P, imp_partial[2 s + 1] = sum |dS| of the pairs it saw, at
  // s = (((mask_heads == 1 ? h : 0) * imp_slots + e) * imp_sub + x) * imp_warps + w (imp_sub key
  // tiles a block, imp_warps warps a key tile).
  float* imp_partial;
  std::int64_t imp_slots;
  std::int32_t imp_sub, imp_warps;
  bool imp_grad;    // the |dS| sums too (the wgmma kernels skip them where no one reads them)
  bool imp_signed;  // the grad sums add dS, not |dS| (a block bias's gradient, dblock_bias)
};

/// Sets p's dropout fields from `dropout` (p = 0: none; the kernels' DROPOUT instantiations read
/// them).
inline void set_dropout(params& p, const attention_dropout& dropout) {
  if (dropout.p <= 0) return;
  p.dropout_state = dropout.state;
  p.drop_below = philox::drop_below16(dropout.p);
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout.p));
}

/// Sets p's block bias (f32 [batch * qb_max, H or 1, KB], checked by the caller; data == nullptr:
/// none).
inline void set_block_bias(params& p, const tensor_view& bias, std::int64_t qb_max) {
  if (bias.data == nullptr) return;
  p.block_bias = static_cast<const float*>(bias.data);
  p.bias_row = bias.row_stride;
  p.bias_head = bias.heads == 1 ? 0 : bias.head_stride;
  p.bias_qb = static_cast<std::int32_t>(qb_max);
  // (p.block set by the caller before: a shift per tile where it is a power of two.)
  const auto block = static_cast<std::uint32_t>(p.block);
  p.bias_block_log2 = std::has_single_bit(block) ? std::countr_zero(block) : -1;
}

/// Sets p's gradient operands: dout, dq, dk, dv with their strides, grads_f32 (dq's dtype f32)
/// and the signed scale.
inline void set_gradient_io(backward_params& p, const tensor_view& dout, const tensor_view& dq,
                            const tensor_view& dk, const tensor_view& dv, double scale) {
  p.dout = dout.data;
  p.do_row = dout.row_stride;
  p.do_head = dout.head_stride;
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  p.dq_row = dq.row_stride;
  p.dq_head = dq.head_stride;
  p.dk_row = dk.row_stride;
  p.dk_head = dk.head_stride;
  p.dv_row = dv.row_stride;
  p.dv_head = dv.head_stride;
  p.grads_f32 = dq.type == dtype::f32;
  p.scale = static_cast<float>(scale);
}

}  // namespace trisparse::cuda::block_sparse
