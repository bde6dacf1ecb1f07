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
  /// in another edge order (PyG's) serves without a gather; nullptr: row e.
  const std::int64_t* keep_index = nullptr;
  tensor_view out;  ///< [rows, H, C], f32 or x's dtype (CPU: any float dtype)
  /// [rows, H, 1] f32: log sum_j exp(e_ij) over row i (-inf for an empty row), what the backward
  /// reads; data == nullptr: not written.
  tensor_view lse;
  double negative_slope = 0.2;
};

/// The gradients of one gat_plan::forward given dout (deterministic).
struct gat_grad_args {
  tensor_view x, a_src, a_dst, keep;  ///< the forward's inputs
  const std::int64_t* keep_index = nullptr;
  tensor_view out, lse;  ///< the forward's outputs (lse is required)
  tensor_view dout;      ///< [rows, H, C] in out's dtype
  tensor_view dx;        ///< [cols, H, C] in dout's dtype
  tensor_view da_src;    ///< [cols, H, 1] f32
  tensor_view da_dst;    ///< [rows, H, 1] f32
  double negative_slope = 0.2;
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
  static constexpr std::int64_t chunk_entries = 256;
  /// The widest heads (C) the CUDA kernels take.
  static constexpr std::int64_t max_head_width = 512;
  device_kind where() const;
  std::int64_t rows() const;
  std::int64_t cols() const;
  std::int64_t nnz() const;

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

/// A multigraph's edges on one device, in memory the caller owns, grouped twice (each edge once,
/// repeated (target, source) pairs as separate edges): by target, row_ptr[rows + 1] over the
/// edges with src[p] the source and edge[p] the row of the per-edge tensors (the input's edge id)
/// of the edge at position p, and dst[p] its target; by source, col_ptr[cols + 1] over
/// by_source[], the positions (in target order) of each source's edges. Node ids are 32-bit;
/// positions and offsets 64-bit.
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
  tensor_view out_edge;  ///< [rows, H, F] f32 (with edge features)
  tensor_view lse;       ///< [rows, H, 1] f32: the log-sum-exp of each row's scores (-inf: none)
  /// [edges, H, 1] f32: a factor per (edge, head) on the edge's weight in the output's sums,
  /// row e for edge e (attention dropout: 0 or 1 / (1 - p)); data == nullptr: none. The softmax's
  /// normaliser is not affected (PyG drops the normalised weights).
  tensor_view keep;
  double scale = 1.0;
};

/// The gradients of one edge_attention_plan::forward given dout and dout_edge (deterministic).
struct edge_attention_grad_args {
  tensor_view q, k, v, r, a;       ///< the forward's inputs
  tensor_view out, out_edge, lse;  ///< its outputs
  tensor_view dout;                ///< [rows, H, C], q's dtype
  tensor_view dout_edge;           ///< [rows, H, F] f32 (with edge features)
  tensor_view dq;                  ///< [rows, H, C] f32
  tensor_view dk, dv;              ///< [cols, H, C] f32
  tensor_view dr;                  ///< [rows, H, F] f32 (with edge features)
  tensor_view da;                  ///< [edges, 1, F] f32 (with edge features): row e, edge e's
  tensor_view keep;                ///< the forward's keep factors (or none)
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
  double negative_slope = 0.2;
};

/// The gradients of one edge_attention_plan::gat_forward given dout (deterministic).
struct edge_gat_grad_args {
  tensor_view x, a_src, a_dst, a_edge;  ///< the forward's inputs
  tensor_view out, lse;                 ///< its outputs
  tensor_view dout;                     ///< [rows, H, C], x's dtype
  tensor_view dx;                       ///< [cols, H, C] f32
  tensor_view da_src;                   ///< [cols, H, 1] f32
  tensor_view da_dst;                   ///< [rows, H, 1] f32
  tensor_view da_edge;                  ///< [edges, H, 1] f32 (with a_edge): row e, edge e's
  tensor_view keep;                     ///< the forward's keep factors (or none)
  double negative_slope = 0.2;
};

/// The plan of edge_attention over one multigraph (a view: the caller keeps its arrays alive).
/// CUDA: a warp per target, its lanes in groups that each take one head (and, with fewer heads
/// than groups, one of a few edges at a time): a group's lanes split the C channels and the F
/// features; an online softmax, the groups' states merged in a fixed butterfly. Targets with more
/// than `heavy_degree` edges (the view's heavy lists) get a warp per head, its groups taking
/// edges side by side. The backward recomputes each edge's weight from the lse (a warp per
/// target: dq, dr and each edge's weight and score gradient into the workspace), then a warp per
/// source over by_source (dk, dv), heavy sources a warp per head, and a thread per (edge,
/// feature) (da). Every sum has a fixed order: the same bits on every run. C must be
/// 4 * 2^k <= 128 or 256; F a multiple of the group width (feature_width() pads it). CUDA only.
class edge_attention_plan {
 public:
  /// @throws invalid_input if the view's sizes are inconsistent or it is not on CUDA.
  static edge_attention_plan build(const multigraph_view& graph);
  /// The degree above which the view should list a line as heavy.
  static constexpr std::int64_t heavy_degree = 128;
  /// True if the kernels take heads of C channels.
  static bool supports(std::int64_t head_dim);
  /// The feature width the kernels take for F features beside heads of C channels (F rounded up
  /// to a multiple of the lanes that split a head): pad a and r with zero columns to it.
  static std::int64_t feature_width(std::int64_t head_dim, std::int64_t features);
  /// Bytes of workspace a backward with `heads` heads needs (each edge's weight and score
  /// gradient).
  std::size_t backward_workspace_bytes(std::int64_t heads) const;
  /// Asynchronous on `stream`; never synchronises the host, allocates or locks.
  void forward(const edge_attention_args& args, stream_ref stream = {}) const;
  void backward(const edge_attention_grad_args& args, stream_ref stream = {},
                workspace_view workspace = {}) const;
  /// GAT's attention over the multigraph (edge_gat_args), as forward: the same kernels with
  /// GAT's additive scores; the backward's workspace is backward_workspace_bytes(heads).
  void gat_forward(const edge_gat_args& args, stream_ref stream = {}) const;
  void gat_backward(const edge_gat_grad_args& args, stream_ref stream = {},
                    workspace_view workspace = {}) const;
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
