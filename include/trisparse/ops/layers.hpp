#pragma once
/// @file GNN layers built from the sparse kernels: GCN, out = Â (X W) with
/// Â = D^-1/2 (A + I) D^-1/2, and AGNN, out = softmax(β cos(H_i, H_j) over A + I) H. A layer is
/// built once per graph and device (the normalised pattern as a sparse_plan) and runs many times.
/// On CUDA the dense products use cuBLAS and the sparse ones the ME-BCRS kernels; on the CPU
/// everything runs in float64 (the reference the CUDA layers are tested against).
///
/// Row i of the graph lists the nodes whose features flow into node i (PyG's edge (j -> i));
/// degrees are row lengths, counted with the self loop (as PyG's gcn_norm does).
#include <cstdint>
#include <memory>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/graph/csr.hpp"
#include "trisparse/graph/reorder.hpp"
#include "trisparse/ops/layer_args.hpp"

namespace trisparse {

struct layer_options {
  /// Adds (i, i) to every row that lacks it (PyG's default for GCNConv and AGNNConv).
  bool add_self_loops = true;
  /// CUDA: how rows are grouped into ME-BCRS windows (see sparse_plan_options::order).
  row_order order = row_order::automatic;
  /// CUDA: the widest features that the layer's own workspace, sized at build, serves (GCN: the
  /// narrower of F_in and F_out); wider runs pass their own (workspace_bytes()).
  std::int64_t workspace_dim = 256;
};

/// The GCN propagation matrix Â = D^-1/2 (A + I) D^-1/2 as a CSR with values (self loops added
/// per `add_self_loops`; the pattern's own values are ignored). @throws invalid_input unless
/// square.
csr_graph gcn_normalized(const csr_graph& graph, bool add_self_loops = true);

/// out = Â (x w): x [N, 1, F_in], w [F_in, 1, F_out] (row-major weights), out [N, 1, F_out].
/// CUDA: x and w one dtype (f16, bf16, or f32 computed in tf32), out f32 or x's dtype; the
/// product is taken in the cheaper order ((Â x) w when F_in < F_out).
class gcn_layer {
 public:
  /// @throws invalid_input unless the graph is square; not_supported without the CUDA backend.
  static gcn_layer build(const csr_graph& graph, device_kind where = device_kind::cpu,
                         const layer_options& options = {}, stream_ref stream = {});
  /// CUDA: asynchronous on `stream`; never synchronises the host, allocates or locks.
  /// `workspace`: workspace_bytes(x.dim, w.dim) bytes, 256-byte aligned (runs with different
  /// workspaces may overlap on different streams), or empty for the layer's own (its runs must
  /// not overlap).
  void forward(const tensor_view& x, const tensor_view& w, const tensor_view& out,
               stream_ref stream = {}, workspace_view workspace = {}) const;
  /// Bytes of workspace a forward with F_in = in_dim and F_out = out_dim needs (0 on the CPU).
  std::size_t workspace_bytes(std::int64_t in_dim, std::int64_t out_dim) const;
  device_kind where() const;
  std::int64_t nnz() const;  ///< of Â (with the self loops)

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

/// The fused GCN layer of a weighted propagation matrix P (gcn_normalized(graph), or any weights:
/// PyG's gcn_norm), built once per graph and device. CUDA: the fused kernel over BSB with P's
/// values (16-row windows, 16x8 tensor-core blocks; windows of many blocks cut into chunks added
/// in a fixed order), or the unfused order where the rule finds it faster; deterministic. The
/// CPU computes f32 tensors in fp32 (OpenMP over rows, fixed-order sums: the same bits at any
/// thread count) and other dtypes in float64 (reference::gcn_fused).
class gcn_fused_plan {
 public:
  /// @throws invalid_input unless `propagation` is square and has values; not_supported for
  /// CUDA without the CUDA backend.
  static gcn_fused_plan build(const csr_graph& propagation, device_kind where = device_kind::cpu,
                              stream_ref stream = {});
  /// Whether a run of these widths and dtype takes the fused kernel (CUDA) under `order`:
  /// gcn_order::fused where its shared memory holds the features, automatic by the rule.
  bool fused(std::int64_t in_dim, std::int64_t out_dim, dtype type,
             gcn_order order = gcn_order::automatic) const;
  /// Bytes of workspace such a run needs (0 on the CPU).
  std::size_t workspace_bytes(std::int64_t in_dim, std::int64_t out_dim, dtype type,
                              gcn_order order = gcn_order::automatic) const;
  /// CUDA: asynchronous on `stream`; never synchronises the host, allocates or locks.
  /// `workspace`: workspace_bytes(...) bytes, 256-byte aligned.
  void forward(const gcn_fused_args& args, stream_ref stream = {},
               workspace_view workspace = {}) const;
  /// Bytes of workspace a backward of these widths needs (0 on the CPU).
  std::size_t backward_workspace_bytes(std::int64_t in_dim, std::int64_t out_dim, dtype type,
                                       gcn_order order = gcn_order::automatic) const;
  /// dZ = dout ∘ mask, dbias = Σ dZ; the fused order dW = (P x)ᵀ dZ, dX = Pᵀ (dZ Wᵀ); the unfused
  /// one dU = Pᵀ dZ, dW = xᵀ dU, dX = dU Wᵀ: cuBLAS, the SpMM over Pᵀ (built with the plan) and
  /// fixed-order sums, so the same bits on every run. dZ is rounded to x's dtype. Without dx
  /// (data == nullptr: x needs no gradient) the products that only feed it are skipped. CUDA: as
  /// forward. The CPU: fp32 for f32 tensors, else float64 (reference::gcn_fused_backward).
  void backward(const gcn_fused_grad_args& args, stream_ref stream = {},
                workspace_view workspace = {}) const;
  device_kind where() const;
  std::int64_t rows() const;
  std::int64_t nnz() const;

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

/// GAT's attention (PyG's GATConv between the linear map and the head concat or mean) fused into
/// one pass over the pattern, built once per pattern and device. CUDA: one warp a target and
/// group of heads, an online softmax, each source row read once (head widths up to 512); the
/// backward is one pass over the transposed pattern (dx, da_src and each edge's score gradient)
/// and a fixed-order row sum (da_dst). Long rows and columns are cut into chunks whose partial
/// results are merged in order, so the same bits on every run. The CPU computes in float64
/// (reference::gat).
class gat_plan {
 public:
  /// @throws invalid_input if the pattern is broken; not_supported for CUDA without the backend.
  static gat_plan build(const csr_graph& pattern, device_kind where = device_kind::cpu,
                        stream_ref stream = {});
  /// Bytes of workspace a forward / backward with `heads` heads `width` channels wide needs (0 on
  /// the CPU; the forward's is 0 unless some row is cut into chunks).
  std::size_t forward_workspace_bytes(std::int64_t heads, std::int64_t width) const;
  std::size_t backward_workspace_bytes(std::int64_t heads, std::int64_t width) const;
  /// CUDA: asynchronous on `stream`; never synchronises the host, allocates or locks.
  /// `workspace`: forward_workspace_bytes(...) bytes, 256-byte aligned.
  void forward(const gat_args& args, stream_ref stream = {}, workspace_view workspace = {}) const;
  /// CUDA: as forward; `workspace`: backward_workspace_bytes(...) bytes.
  void backward(const gat_grad_args& args, stream_ref stream = {},
                workspace_view workspace = {}) const;
  /// CUDA: rows (forward) and columns (backward) with more entries than this are cut into chunks
  /// of this many, taken by separate warps and merged in chunk order.
  static constexpr std::int64_t chunk_entries = gat_chunk_entries;
  /// The widest heads (C) the CUDA kernels take.
  static constexpr std::int64_t max_head_width = gat_max_head_width;
  device_kind where() const;
  std::int64_t rows() const;
  std::int64_t cols() const;
  std::int64_t nnz() const;

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

/// The plan of edge_attention over one multigraph (a view: the caller keeps its arrays alive).
/// CUDA: a warp per target, its lanes in groups that each take one head (and, with fewer heads
/// than groups, one of a few edges at a time): a group's lanes split the C channels and the F
/// features; an online softmax, the groups' states merged in a fixed butterfly. Targets with more
/// than `heavy_degree` edges (the view's heavy lists) get a thread block per head, the groups of
/// its warps taking edges side by side and the warps merged in order. The backward recomputes
/// each edge's weight from the lse (a warp per target: dq, dr and each edge's weight and score
/// gradient into the workspace), then a warp per source over by_source (dk, dv), heavy sources a
/// thread block per head, and a thread per (edge,
/// feature) (da). Every sum has a fixed order: the same bits on every run. C must be
/// 4 * 2^k <= 128 or 256; F a multiple of the group width (feature_width() pads it).
/// CPU (a multigraph in host memory; forward, backward and GAT's, not the neighbour sums): any C
/// and F, fp32 (f16 and bf16 widened) or float64 for float64 operands, OpenMP over targets and
/// over sources (by_source), each sum in a fixed order; dropout's draws are the kernels'.
class edge_attention_plan {
 public:
  /// @throws invalid_input if the view's sizes are inconsistent.
  static edge_attention_plan build(const multigraph_view& graph);
  /// The degree above which the view should list a line as heavy.
  static constexpr std::int64_t heavy_degree = 128;
  /// True if the kernels take heads of C channels.
  static bool supports(std::int64_t head_dim);
  /// The feature width the kernels take for F features beside heads of C channels (F rounded up
  /// to a multiple of the lanes that split a head): pad a and r with zero columns to it.
  static std::int64_t feature_width(std::int64_t head_dim, std::int64_t features);
  /// Bytes of workspace a backward with `heads` heads needs (each edge's weight and score
  /// gradient): f32 (8 bytes an edge and head), or bf16 (4) where `grads`, the dtype of
  /// backward()'s dq, is f16 or bf16 (the gradients are rounded to 16 bits anyway); on the CPU 16
  /// bytes an edge and head (float64 for float64 operands). GAT's backward keeps f32:
  /// gat_backward's need is backward_workspace_bytes(heads).
  std::size_t backward_workspace_bytes(std::int64_t heads, dtype grads = dtype::f32) const;
  /// Asynchronous on `stream`; never synchronises the host, allocates or locks.
  void forward(const edge_attention_args& args, stream_ref stream = {}) const;
  void backward(const edge_attention_grad_args& args, stream_ref stream = {},
                workspace_view workspace = {}) const;
  /// GAT's attention over the multigraph (edge_gat_args), as forward: the same kernels with
  /// GAT's additive scores; the backward's workspace is backward_workspace_bytes(heads).
  void gat_forward(const edge_gat_args& args, stream_ref stream = {}) const;
  void gat_backward(const edge_gat_grad_args& args, stream_ref stream = {},
                    workspace_view workspace = {}) const;
  /// The neighbour sum over the multigraph's edges (each copy of a repeated pair its own term):
  /// out_i = sum over the edges (i <- j) of x_j, x [cols, H, C], out [rows, H, C]; `transposed`:
  /// out_j = sum over the edges (i <- j) of x_i, x [rows, H, C], out [cols, H, C] (needs the
  /// backward's side). x f16, bf16 or f32 with C as the attention's; out f32 or x's dtype (f32
  /// sums rounded once). Each sum in a fixed order: bitwise repeatable. A GCN layer's
  /// aggregation, with the normalisation on the nodes (D^-1/2 A D^-1/2 x = d^-1/2 sum d^-1/2 x).
  void neighbor_sum(const tensor_view& x, const tensor_view& out, bool transposed,
                    stream_ref stream = {}) const;
  const multigraph_view& graph() const { return graph_; }

 private:
  multigraph_view graph_;
};

/// out_i = sum_j softmax_j(β cos(h_i, h_j)) h_j over row i of A (+ I): h [N, 1, F], out [N, 1, F].
/// CUDA: h f16, bf16 or f32 (tf32), out f32 or h's dtype. Zero rows of h have cosine 0.
class agnn_layer {
 public:
  /// @throws invalid_input unless the graph is square; not_supported without the CUDA backend.
  static agnn_layer build(const csr_graph& graph, device_kind where = device_kind::cpu,
                          const layer_options& options = {}, stream_ref stream = {});
  /// CUDA: as gcn_layer::forward; `workspace`: workspace_bytes(h.dim) bytes, or empty for the
  /// layer's own.
  void forward(const tensor_view& h, double beta, const tensor_view& out, stream_ref stream = {},
               workspace_view workspace = {}) const;
  /// Bytes of workspace a forward with F = dim needs (0 on the CPU).
  std::size_t workspace_bytes(std::int64_t dim) const;
  device_kind where() const;
  std::int64_t nnz() const;  ///< of the pattern (with the self loops)

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

}  // namespace trisparse
