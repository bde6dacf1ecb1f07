#pragma once
/// @file Attention within segments: the rows of a packed batch of short sequences (the graphs of a
/// PyG mini-batch, the documents of a packed batch) named by a sorted segment id per row. Row i
/// attends every row j of its own segment, O_i = softmax_j(scale q_i . k_j) v_j over
/// {j : segment[j] == segment[i]}: the block-diagonal pattern of the batch (GPS's global
/// attention), with no pattern built. The ids are read on the device at each call, so a new
/// mini-batch costs no host work and no round trip.
#include <cstddef>
#include <cstdint>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/ops/attention.hpp"
#include "trisparse/ops/segment_args.hpp"

namespace trisparse {

/// A plan over one segment vector (a view: the caller keeps the ids alive). CUDA: a thread block
/// per (64 query rows, head) walks the key rows from its first row's segment start to its last
/// row's segment end in tiles of 64 (the segments' bounds found from the ids by one small kernel
/// per call, into the workspace), masks pairs of different segments, and runs the block-sparse
/// kernels' mma.sync products and online softmax (several short segments share a tile; a long one
/// spans many). The backward is FlashAttention-2's with no atomics: dq over the query tiles, dk
/// and dv over the key tiles (the pattern is symmetric), each gradient row summed by one warp in
/// a fixed order: the same bits on every run. q, k, v f16 or bf16 with head dims 16, 32, 64 or
/// 128, every operand in 16-byte aligned rows. CUDA only: on the CPU, give the block-diagonal
/// pattern to attention_plan.
class segment_attention_plan {
 public:
  /// `edges`, where given (query_ptr set), makes options.bias a bias per edge (below).
  /// @throws invalid_input for negative or too many rows, ids missing, or edge lists missing.
  static segment_attention_plan build(const segment_view& segments,
                                      const segment_edges& edges = {});
  /// True if the kernels take heads of `head_dim` (16, 32, 64, 128 where built).
  static bool supports(std::int64_t head_dim);
  /// Bytes of workspace run() needs (the segments' bounds).
  std::size_t workspace_bytes() const;
  /// Bytes of workspace backward() needs with `heads` heads.
  std::size_t backward_workspace_bytes(std::int64_t heads) const;

  /// out = attention(q, k, v) within segments: q, k, v, out [rows, H, D] on the plan's device, out
  /// f32 or q's dtype; options.scale (default 1/sqrt(D)) and, where options.lse.data is set, the
  /// per-row log-sum-exp (f32 [rows, H, 1]) that backward() needs. options.bias, where set, is a
  /// score bias per pair: S_ij = scale q_i . k_j + bias[i, h, j - first(i)], first(i) the first
  /// row of i's segment (f32 [rows, H, M], or [rows, 1, M] shared by the heads; M at least the
  /// longest segment's rows, which the caller guarantees: the ids are read on the device only;
  /// Graphormer's spatial and edge encodings, GPS's local edges as a bias). On a plan built with
  /// edges, options.bias is instead one per edge, f32 [E, H or 1, 1]: S_ij gains the sum of the
  /// biases of the edges from key j to query i (nothing [rows, M] is made: GPS's bonds as a
  /// bias at the edges' own size). Block biases and block outputs are not taken. Asynchronous on
  /// `stream`: no synchronisation, allocation or lock.
  /// @throws invalid_input naming a wrong argument, not_supported for other dtypes or head dims.
  void run(const tensor_view& q, const tensor_view& k, const tensor_view& v, const tensor_view& out,
           const attention_options& options, workspace_view workspace,
           stream_ref stream = {}) const;

  /// dq, dk, dv (shaped as q, k, v, all f32 or all q's dtype; overwritten) of out = run(q, k, v)
  /// given dout (q's dtype); `out` and `lse` are what run() wrote, options as run() had them.
  /// Where options.dbias is set (f32 [rows, H, M], M the bias's), dL/dS of each pair is written
  /// at its place in it, once (no atomics: the same bits on every run); places of no pair are
  /// left as they were (zero them first). With edges, dbias is f32 [E, H, 1] and each edge takes
  /// its pair's dL/dS (edges between segments are left as they were). Asynchronous on `stream`.
  void backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                const tensor_view& out, const tensor_view& lse, const tensor_view& dout,
                const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                const attention_options& options, workspace_view workspace,
                stream_ref stream = {}) const;

  const segment_view& segments() const { return segments_; }
  const segment_edges& edges() const { return edges_; }

 private:
  segment_view segments_;
  segment_edges edges_;
};

}  // namespace trisparse
