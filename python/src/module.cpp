// trisparse._C: the plans of include/trisparse/ for the Python package, and nothing else. Tensors
// cross as plain tuples (pointer, dtype, device, shape, strides) that trisparse/_tensors.py makes
// from torch tensors, so the module links no torch library and one build serves every torch
// release; streams and workspaces cross as integers (torch's current stream, and bytes from its
// caching allocator).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "trisparse/trisparse.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using namespace trisparse;

/// (data pointer, dtype code = the dtype enum's value, device index or -1 for the CPU, rows,
/// heads, dim, row stride, head stride), strides in elements.
using tensor_tuple = std::tuple<std::uintptr_t, int, int, std::int64_t, std::int64_t, std::int64_t,
                                std::int64_t, std::int64_t>;

tensor_view view_of(const tensor_tuple& t) {
  const auto& [data, code, device, rows, heads, dim, row_stride, head_stride] = t;
  if (code < 0 || code > static_cast<int>(dtype::f64))
    throw invalid_input("unknown dtype code " + std::to_string(code));
  return {reinterpret_cast<void*>(data),
          static_cast<dtype>(code),
          device < 0 ? device_kind::cpu : device_kind::cuda,
          device < 0 ? 0 : device,
          rows,
          heads,
          dim,
          row_stride,
          head_stride};
}

tensor_view view_of(const std::optional<tensor_tuple>& t) {
  return t ? view_of(*t) : tensor_view{};
}

stream_ref stream_of(std::uintptr_t s) { return {reinterpret_cast<void*>(s)}; }

prune_scope prune_scope_of(const std::string& scope) {
  TRISPARSE_EXPECTS_INPUT(scope == "row" || scope == "global",
                          "prune_block_importance: scope must be row or global, not " + scope);
  return scope == "row" ? prune_scope::row : prune_scope::global;
}

/// Attention dropout's argument from the package: p and the device address of {seed, offset}
/// (0 without dropout).
attention_dropout dropout_of(double p, std::uintptr_t state) {
  return {p, reinterpret_cast<const std::uint64_t*>(state)};
}

workspace_view workspace_of(std::uintptr_t data, std::size_t bytes) {
  return bytes == 0 ? workspace_view{} : workspace_view{reinterpret_cast<void*>(data), bytes};
}

attention_options options_of(std::optional<double> scale, const std::string& algo) {
  attention_options o;
  o.scale = scale;
  o.algo = parse_algorithm(algo);
  return o;
}

/// The package's plan options: every run passes its workspace from torch's caching allocator, so
/// the plan's own (sized at build, for runs given none) is kept to its smallest.
plan_options package_options(const std::string& algo, bool gradients, bool keep_order = false) {
  plan_options o;
  o.algo = parse_algorithm(algo);
  o.gradients = gradients;
  if (keep_order) o.order = row_order::original;
  o.workspace_heads = 1;
  o.workspace_dim = 32;
  return o;
}

/// An attention plan and the pattern's sizes (for the Python side's checks).
struct py_attention_plan {
  attention_plan plan;

  static py_attention_plan from_host(std::uintptr_t row_ptr, std::uintptr_t col_idx,
                                     std::int64_t rows, std::int64_t cols, std::int64_t nnz,
                                     const std::string& algo, bool gradients, int device,
                                     std::uintptr_t stream, bool keep_order) {
    csr_graph g;
    g.rows = rows;
    g.cols = cols;
    const auto* rp = reinterpret_cast<const std::int64_t*>(row_ptr);
    const auto* ci = reinterpret_cast<const std::int32_t*>(col_idx);
    g.row_ptr.assign(rp, rp + rows + 1);
    g.col_idx.assign(ci, ci + nnz);
    plan_options o = package_options(algo, gradients, keep_order);
    nb::gil_scoped_release release;
    return {attention_plan::build(g, device < 0 ? device_kind::cpu : device_kind::cuda, o,
                                  stream_of(stream))};
  }

  static py_attention_plan from_device(std::uintptr_t row_ptr, std::uintptr_t col_idx,
                                       std::int64_t rows, std::int64_t cols, std::int64_t nnz,
                                       const std::string& algo, bool gradients,
                                       std::uintptr_t stream) {
    const csr_view view{rows,
                        cols,
                        nnz,
                        reinterpret_cast<const std::int64_t*>(row_ptr),
                        reinterpret_cast<const std::int32_t*>(col_idx),
                        device_kind::cuda};
    plan_options o = package_options(algo, gradients);
    nb::gil_scoped_release release;
    return {attention_plan::build(view, o, stream_of(stream))};
  }

  void run(const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v,
           const tensor_tuple& out, const std::optional<tensor_tuple>& lse,
           const std::optional<tensor_tuple>& bias, std::optional<double> scale,
           const std::string& algo, std::uintptr_t stream, std::uintptr_t ws,
           std::size_t ws_bytes) const {
    attention_options o = options_of(scale, algo);
    o.lse = view_of(lse);
    o.bias = view_of(bias);
    nb::gil_scoped_release release;
    plan.run(view_of(q), view_of(k), view_of(v), view_of(out), o, stream_of(stream),
             workspace_of(ws, ws_bytes));
  }

  void backward(const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v,
                const tensor_tuple& out, const std::optional<tensor_tuple>& lse,
                const tensor_tuple& dout, const tensor_tuple& dq, const tensor_tuple& dk,
                const tensor_tuple& dv, const std::optional<tensor_tuple>& bias,
                const std::optional<tensor_tuple>& dbias, std::optional<double> scale,
                const std::string& algo, std::uintptr_t stream, std::uintptr_t ws,
                std::size_t ws_bytes) const {
    attention_options o = options_of(scale, algo);
    o.bias = view_of(bias);
    o.dbias = view_of(dbias);
    nb::gil_scoped_release release;
    plan.backward(view_of(q), view_of(k), view_of(v), view_of(out), view_of(lse), view_of(dout),
                  view_of(dq), view_of(dk), view_of(dv), o, stream_of(stream),
                  workspace_of(ws, ws_bytes));
  }
};

/// What the package's block-sparse ops call on a plan (block_sparse_attention_plan or
/// topk_block_sparse_plan): run with the lse, backward with the blocks' importance outputs.
template <class Plan>
struct py_block_plan_calls {
  static constexpr bool topk = std::is_same_v<Plan, topk_block_sparse_plan>;
  Plan plan;

  void run(const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v,
           const tensor_tuple& out, const std::optional<tensor_tuple>& lse,
           std::optional<double> scale, std::uintptr_t stream, std::uintptr_t ws,
           std::size_t ws_bytes, double dropout, std::uintptr_t dropout_state,
           const std::optional<tensor_tuple>& block_bias) const {
    attention_options o;
    o.scale = scale;
    o.lse = view_of(lse);
    o.dropout = dropout_of(dropout, dropout_state);
    o.block_bias = view_of(block_bias);
    nb::gil_scoped_release release;
    if constexpr (topk)  // (its forward needs no workspace)
      plan.run(view_of(q), view_of(k), view_of(v), view_of(out), o, stream_of(stream));
    else
      plan.run(view_of(q), view_of(k), view_of(v), view_of(out), o, stream_of(stream),
               workspace_of(ws, ws_bytes));
  }

  void backward(const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v,
                const std::optional<tensor_tuple>& out, const std::optional<tensor_tuple>& lse,
                const tensor_tuple& dout, const tensor_tuple& dq, const tensor_tuple& dk,
                const tensor_tuple& dv, std::optional<double> scale, std::uintptr_t stream,
                std::uintptr_t ws, std::size_t ws_bytes,
                const std::optional<tensor_tuple>& block_mass,
                const std::optional<tensor_tuple>& block_grad, double dropout,
                std::uintptr_t dropout_state, const std::optional<tensor_tuple>& block_bias,
                const std::optional<tensor_tuple>& dblock_bias) const {
    attention_options o;
    o.scale = scale;
    o.dropout = dropout_of(dropout, dropout_state);
    o.block_mass = view_of(block_mass);
    o.block_grad = view_of(block_grad);
    o.block_bias = view_of(block_bias);
    o.dblock_bias = view_of(dblock_bias);
    nb::gil_scoped_release release;
    const auto ws_view = workspace_of(ws, ws_bytes);
    if constexpr (topk)
      plan.backward(view_of(q), view_of(k), view_of(v), view_of(out), view_of(lse), view_of(dout),
                    view_of(dq), view_of(dk), view_of(dv), ws_view, o, stream_of(stream));
    else
      plan.backward(view_of(q), view_of(k), view_of(v), view_of(out), view_of(lse), view_of(dout),
                    view_of(dq), view_of(dk), view_of(dv), o, stream_of(stream), ws_view);
  }

  std::size_t backward_workspace_bytes(std::int64_t heads, bool importance) const {
    return plan.backward_workspace_bytes(heads, importance);
  }

  void block_mass(const tensor_tuple& q, const tensor_tuple& k,
                  const std::optional<tensor_tuple>& lse, const tensor_tuple& mass,
                  std::optional<double> scale, std::uintptr_t stream, std::uintptr_t ws,
                  std::size_t ws_bytes) const {
    attention_options o;
    o.scale = scale;
    o.block_mass = view_of(mass);
    nb::gil_scoped_release release;
    if constexpr (topk)
      plan.block_mass(view_of(q), view_of(k), view_of(lse), workspace_of(ws, ws_bytes), o,
                      stream_of(stream));
    else
      plan.block_mass(view_of(q), view_of(k), view_of(lse), o, stream_of(stream),
                      workspace_of(ws, ws_bytes));
  }
  std::size_t block_mass_workspace_bytes(std::int64_t heads) const {
    return plan.block_mass_workspace_bytes(heads);
  }
  std::string backend() const {
    const auto& r = plan.report();
    return trisparse::backend_name(r.algo, r.where, true);
  }
};

/// A bool block mask on CUDA device `device` at `kept` ([B or 1, H or 1, rows, cols], element
/// strides seq/head/row).
device_block_mask device_mask_of(std::uintptr_t kept, std::int64_t seq_stride,
                                 std::int64_t head_stride, std::int64_t row_stride,
                                 std::int64_t rows, std::int64_t cols, int device) {
  return {
      reinterpret_cast<const void*>(kept), device, seq_stride, head_stride, row_stride, rows, cols};
}

/// A block-sparse attention plan for one mask: (b, h) block patterns as CSR arrays in host
/// memory (row_ptr int64 [query blocks + 1], col_idx int32), sequence b's mask h at b * heads + h.
struct py_block_sparse_plan : py_block_plan_calls<block_sparse_attention_plan> {
  using block_csr = std::tuple<std::uintptr_t, std::uintptr_t, std::int64_t>;

  // The batch's lengths, heads, block and causality, with no masks yet.
  static block_sparse_mask layout_of(std::int64_t block, std::int64_t heads, bool causal,
                                     const std::vector<std::int64_t>& cu_seqlens_q,
                                     const std::vector<std::int64_t>& cu_seqlens_k) {
    block_sparse_mask m;
    m.block = block;
    m.heads = heads;
    m.causal = causal;
    m.cu_seqlens_q = cu_seqlens_q;
    m.cu_seqlens_k = cu_seqlens_k;
    return m;
  }

  static py_block_sparse_plan build(std::int64_t block, std::int64_t heads, bool causal,
                                    const std::vector<std::int64_t>& cu_seqlens_q,
                                    const std::vector<std::int64_t>& cu_seqlens_k,
                                    const std::vector<block_csr>& masks, const std::string& algo,
                                    int device, std::uintptr_t stream) {
    block_sparse_mask m = layout_of(block, heads, causal, cu_seqlens_q, cu_seqlens_k);
    TRISPARSE_EXPECTS_INPUT(static_cast<std::int64_t>(masks.size()) == m.batch() * heads,
                            "block masks: one per sequence and head expected");
    for (std::size_t i = 0; i < masks.size(); ++i) {
      const auto b = static_cast<std::int64_t>(i) / heads;
      const auto& [row_ptr, col_idx, nnz] = masks[i];
      block_mask bm;
      bm.rows = m.len_q(b);
      bm.cols = m.len_k(b);
      bm.block = block;
      bm.blocks.rows = (bm.rows + block - 1) / block;
      bm.blocks.cols = (bm.cols + block - 1) / block;
      const auto* rp = reinterpret_cast<const std::int64_t*>(row_ptr);
      const auto* ci = reinterpret_cast<const std::int32_t*>(col_idx);
      bm.blocks.row_ptr.assign(rp, rp + bm.blocks.rows + 1);
      bm.blocks.col_idx.assign(ci, ci + nnz);
      m.masks.push_back(std::move(bm));
    }
    const device_kind where = device < 0 ? device_kind::cpu : device_kind::cuda;
    nb::gil_scoped_release release;
    block_sparse_plan_options o;
    o.algo = parse_algorithm(algo);
    // CUDA plans prepare the backward; every backward passes its workspace (the package's
    // options), so the plan's own is kept to its smallest.
    o.gradients = where == device_kind::cuda;
    o.workspace_heads = 1;
    return {{block_sparse_attention_plan::build(std::move(m), where, o, stream_of(stream))}};
  }

  /// A plan whose lists kernels write from a bool mask on CUDA device `device` ([B or 1, H or 1,
  /// query blocks, key blocks] at `kept`, element strides seq/head/row): no host synchronisation.
  static py_block_sparse_plan build_on_device(std::int64_t block, std::int64_t heads, bool causal,
                                              const std::vector<std::int64_t>& cu_seqlens_q,
                                              const std::vector<std::int64_t>& cu_seqlens_k,
                                              std::uintptr_t kept, std::int64_t seq_stride,
                                              std::int64_t head_stride, std::int64_t row_stride,
                                              std::int64_t rows, std::int64_t cols, int device,
                                              std::uintptr_t stream, double mean_blocks) {
    block_sparse_mask layout = layout_of(block, heads, causal, cu_seqlens_q, cu_seqlens_k);
    const device_block_mask d =
        device_mask_of(kept, seq_stride, head_stride, row_stride, rows, cols, device);
    nb::gil_scoped_release release;
    block_sparse_plan_options o;
    o.gradients = true;
    o.workspace_heads = 0;  // every backward passes its workspace
    o.mean_blocks = mean_blocks;
    return {{block_sparse_attention_plan::build(std::move(layout), d, o, stream_of(stream))}};
  }

  /// build_on_device's plan, its lists rewritten from the mask at `kept` (the same strides and
  /// block counts as at build): kernels on `stream`, no allocation, capturable.
  void refill(std::uintptr_t kept, std::int64_t seq_stride, std::int64_t head_stride,
              std::int64_t row_stride, std::int64_t rows, std::int64_t cols, int device,
              std::uintptr_t stream, std::uintptr_t due) const {
    plan.refill(device_mask_of(kept, seq_stride, head_stride, row_stride, rows, cols, device),
                stream_of(stream), reinterpret_cast<const bool*>(due));
  }
};

csr_graph csr_of(std::uintptr_t row_ptr, std::uintptr_t col_idx, std::uintptr_t values,
                 std::int64_t rows, std::int64_t cols, std::int64_t nnz) {
  csr_graph g;
  g.rows = rows;
  g.cols = cols;
  const auto* rp = reinterpret_cast<const std::int64_t*>(row_ptr);
  const auto* ci = reinterpret_cast<const std::int32_t*>(col_idx);
  const auto* vs = reinterpret_cast<const float*>(values);
  g.row_ptr.assign(rp, rp + rows + 1);
  g.col_idx.assign(ci, ci + nnz);
  if (vs != nullptr) g.values.assign(vs, vs + nnz);
  return g;
}

gcn_order order_of(const std::string& order) {
  if (order == "auto") return gcn_order::automatic;
  if (order == "fused") return gcn_order::fused;
  if (order == "unfused") return gcn_order::unfused;
  throw invalid_input("order must be 'auto', 'fused' or 'unfused', not '" + order + "'");
}

/// The fused GCN layer of a weighted square matrix on one device.
struct py_gcn_fused_plan {
  gcn_fused_plan plan;

  static py_gcn_fused_plan from_host(std::uintptr_t row_ptr, std::uintptr_t col_idx,
                                     std::uintptr_t values, std::int64_t rows, std::int64_t nnz,
                                     int device, std::uintptr_t stream) {
    const csr_graph g = csr_of(row_ptr, col_idx, values, rows, rows, nnz);
    nb::gil_scoped_release release;
    return {gcn_fused_plan::build(g, device < 0 ? device_kind::cpu : device_kind::cuda,
                                  stream_of(stream))};
  }

  /// mask: a pointer to N * ceil(F_out / 32) words on out's device, or 0.
  void forward(const tensor_tuple& x, const tensor_tuple& w,
               const std::optional<tensor_tuple>& bias, const tensor_tuple& out, bool relu,
               std::uintptr_t mask, const std::optional<tensor_tuple>& ax, const std::string& order,
               std::uintptr_t stream, std::uintptr_t ws, std::size_t ws_bytes) const {
    gcn_fused_args a{.x = view_of(x),
                     .w = view_of(w),
                     .bias = view_of(bias),
                     .out = view_of(out),
                     .relu = relu,
                     .relu_mask = reinterpret_cast<std::uint32_t*>(mask),
                     .ax = view_of(ax),
                     .order = order_of(order)};
    nb::gil_scoped_release release;
    plan.forward(a, stream_of(stream), workspace_of(ws, ws_bytes));
  }

  /// mask: the forward's mask pointer, or 0 (no ReLU).
  void backward(const tensor_tuple& dout, std::uintptr_t mask, const tensor_tuple& x,
                const tensor_tuple& w, const std::optional<tensor_tuple>& ax,
                const std::optional<tensor_tuple>& dx, const tensor_tuple& dw,
                const std::optional<tensor_tuple>& dbias, const std::string& order,
                std::uintptr_t stream, std::uintptr_t ws, std::size_t ws_bytes) const {
    const gcn_fused_grad_args a{.dout = view_of(dout),
                                .relu_mask = reinterpret_cast<const std::uint32_t*>(mask),
                                .x = view_of(x),
                                .w = view_of(w),
                                .ax = view_of(ax),
                                .dx = view_of(dx),
                                .dw = view_of(dw),
                                .dbias = view_of(dbias),
                                .order = order_of(order)};
    nb::gil_scoped_release release;
    plan.backward(a, stream_of(stream), workspace_of(ws, ws_bytes));
  }
};

/// GAT's fused attention over a binary pattern on one device.
struct py_gat_plan {
  gat_plan plan;

  static py_gat_plan from_host(std::uintptr_t row_ptr, std::uintptr_t col_idx, std::int64_t rows,
                               std::int64_t cols, std::int64_t nnz, int device,
                               std::uintptr_t stream) {
    const csr_graph g = csr_of(row_ptr, col_idx, 0, rows, cols, nnz);
    nb::gil_scoped_release release;
    return {
        gat_plan::build(g, device < 0 ? device_kind::cpu : device_kind::cuda, stream_of(stream))};
  }

  /// keep_index: a pointer to [nnz] int64 rows of keep, or 0.
  /// dropout, dropout_state: attention dropout drawn in the kernels (the state's address, or 0).
  void forward(const tensor_tuple& x, const tensor_tuple& a_src, const tensor_tuple& a_dst,
               const std::optional<tensor_tuple>& keep, std::uintptr_t keep_index,
               const tensor_tuple& out, const tensor_tuple& lse, double negative_slope,
               std::uintptr_t stream, std::uintptr_t ws, std::size_t ws_bytes, double dropout,
               std::uintptr_t dropout_state) const {
    const gat_args a{.x = view_of(x),
                     .a_src = view_of(a_src),
                     .a_dst = view_of(a_dst),
                     .keep = view_of(keep),
                     .keep_index = reinterpret_cast<const std::int64_t*>(keep_index),
                     .out = view_of(out),
                     .lse = view_of(lse),
                     .dropout = dropout_of(dropout, dropout_state),
                     .negative_slope = negative_slope};
    nb::gil_scoped_release release;
    plan.forward(a, stream_of(stream), workspace_of(ws, ws_bytes));
  }

  void backward(const tensor_tuple& x, const tensor_tuple& a_src, const tensor_tuple& a_dst,
                const std::optional<tensor_tuple>& keep, std::uintptr_t keep_index,
                const tensor_tuple& out, const tensor_tuple& lse, const tensor_tuple& dout,
                const tensor_tuple& dx, const tensor_tuple& da_src, const tensor_tuple& da_dst,
                double negative_slope, std::uintptr_t stream, std::uintptr_t ws,
                std::size_t ws_bytes, double dropout, std::uintptr_t dropout_state) const {
    const gat_grad_args a{.x = view_of(x),
                          .a_src = view_of(a_src),
                          .a_dst = view_of(a_dst),
                          .keep = view_of(keep),
                          .keep_index = reinterpret_cast<const std::int64_t*>(keep_index),
                          .dropout = dropout_of(dropout, dropout_state),
                          .out = view_of(out),
                          .lse = view_of(lse),
                          .dout = view_of(dout),
                          .dx = view_of(dx),
                          .da_src = view_of(da_src),
                          .da_dst = view_of(da_dst),
                          .negative_slope = negative_slope};
    nb::gil_scoped_release release;
    plan.backward(a, stream_of(stream), workspace_of(ws, ws_bytes));
  }
};

/// Attention within segments: the plan is a view of the ids, made per call (no state to keep);
/// `edges` (0: none) the edges' lists packed as one int32 array, in segment_edges' order:
/// query_ptr [rows + 1], query_key, query_edge [E], key_ptr [rows + 1], key_query, key_edge [E].
segment_attention_plan segment_plan(std::int64_t rows, std::uintptr_t ids, bool ids_64, int device,
                                    std::uintptr_t edges = 0, std::int64_t num_edges = 0) {
  const segment_edges lists =
      edges == 0
          ? segment_edges{}
          : packed_segment_edges(reinterpret_cast<const std::int32_t*>(edges), rows, num_edges);
  return segment_attention_plan::build(
      {rows, reinterpret_cast<const void*>(ids), ids_64, device < 0 ? 0 : device}, lists);
}

/// TransformerConv's attention with edge features over a multigraph whose arrays torch keeps on
/// the device (the Python side holds them as long as the plan).
struct py_edge_attention_plan {
  edge_attention_plan plan;

  static py_edge_attention_plan build(std::int64_t rows, std::int64_t cols, std::int64_t edges,
                                      std::uintptr_t row_ptr, std::uintptr_t src,
                                      std::uintptr_t dst, std::uintptr_t edge,
                                      std::uintptr_t col_ptr, std::uintptr_t by_source,
                                      std::int64_t heavy, std::uintptr_t heavy_rows,
                                      std::int64_t heavy_row_count, std::uintptr_t heavy_cols,
                                      std::int64_t heavy_col_count, int device) {
    multigraph_view g{.rows = rows,
                      .cols = cols,
                      .edges = edges,
                      .row_ptr = reinterpret_cast<const std::int64_t*>(row_ptr),
                      .src = reinterpret_cast<const std::int32_t*>(src),
                      .dst = reinterpret_cast<const std::int32_t*>(dst),
                      .edge = reinterpret_cast<const std::int64_t*>(edge),
                      .col_ptr = reinterpret_cast<const std::int64_t*>(col_ptr),
                      .by_source = reinterpret_cast<const std::int64_t*>(by_source),
                      .heavy = heavy,
                      .heavy_row_count = heavy_row_count,
                      .heavy_col_count = heavy_col_count,
                      .heavy_rows = reinterpret_cast<const std::int32_t*>(heavy_rows),
                      .heavy_cols = reinterpret_cast<const std::int32_t*>(heavy_cols),
                      .where = device < 0 ? device_kind::cpu : device_kind::cuda,
                      .device_id = device < 0 ? 0 : device};
    return {edge_attention_plan::build(g)};
  }

  void forward(const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v,
               const std::optional<tensor_tuple>& r, const std::optional<tensor_tuple>& a,
               const tensor_tuple& out, const std::optional<tensor_tuple>& out_edge,
               const tensor_tuple& lse, const std::optional<tensor_tuple>& keep, double scale,
               std::uintptr_t stream, double dropout, std::uintptr_t dropout_state) const {
    const edge_attention_args args{.q = view_of(q),
                                   .k = view_of(k),
                                   .v = view_of(v),
                                   .r = view_of(r),
                                   .a = view_of(a),
                                   .out = view_of(out),
                                   .out_edge = view_of(out_edge),
                                   .lse = view_of(lse),
                                   .keep = view_of(keep),
                                   .dropout = dropout_of(dropout, dropout_state),
                                   .scale = scale};
    nb::gil_scoped_release release;
    plan.forward(args, stream_of(stream));
  }

  void backward(const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v,
                const std::optional<tensor_tuple>& r, const std::optional<tensor_tuple>& a,
                const tensor_tuple& out, const std::optional<tensor_tuple>& out_edge,
                const tensor_tuple& lse, const tensor_tuple& dout,
                const std::optional<tensor_tuple>& dout_edge, const tensor_tuple& dq,
                const tensor_tuple& dk, const tensor_tuple& dv,
                const std::optional<tensor_tuple>& dr, const std::optional<tensor_tuple>& da,
                const std::optional<tensor_tuple>& keep, double scale, std::uintptr_t stream,
                std::uintptr_t ws, std::size_t ws_bytes, double dropout,
                std::uintptr_t dropout_state) const {
    const edge_attention_grad_args args{.q = view_of(q),
                                        .k = view_of(k),
                                        .v = view_of(v),
                                        .r = view_of(r),
                                        .a = view_of(a),
                                        .out = view_of(out),
                                        .out_edge = view_of(out_edge),
                                        .lse = view_of(lse),
                                        .dout = view_of(dout),
                                        .dout_edge = view_of(dout_edge),
                                        .dq = view_of(dq),
                                        .dk = view_of(dk),
                                        .dv = view_of(dv),
                                        .dr = view_of(dr),
                                        .da = view_of(da),
                                        .keep = view_of(keep),
                                        .dropout = dropout_of(dropout, dropout_state),
                                        .scale = scale};
    nb::gil_scoped_release release;
    plan.backward(args, stream_of(stream), workspace_of(ws, ws_bytes));
  }

  void gat_forward(const tensor_tuple& x, const tensor_tuple& a_src, const tensor_tuple& a_dst,
                   const std::optional<tensor_tuple>& a_edge, const tensor_tuple& out,
                   const tensor_tuple& lse, const std::optional<tensor_tuple>& keep,
                   double negative_slope, std::uintptr_t stream, double dropout,
                   std::uintptr_t dropout_state) const {
    const edge_gat_args args{.x = view_of(x),
                             .a_src = view_of(a_src),
                             .a_dst = view_of(a_dst),
                             .a_edge = view_of(a_edge),
                             .out = view_of(out),
                             .lse = view_of(lse),
                             .keep = view_of(keep),
                             .dropout = dropout_of(dropout, dropout_state),
                             .negative_slope = negative_slope};
    nb::gil_scoped_release release;
    plan.gat_forward(args, stream_of(stream));
  }

  void gat_backward(const tensor_tuple& x, const tensor_tuple& a_src, const tensor_tuple& a_dst,
                    const std::optional<tensor_tuple>& a_edge, const tensor_tuple& out,
                    const tensor_tuple& lse, const tensor_tuple& dout, const tensor_tuple& dx,
                    const tensor_tuple& da_src, const tensor_tuple& da_dst,
                    const std::optional<tensor_tuple>& da_edge,
                    const std::optional<tensor_tuple>& keep, double negative_slope,
                    std::uintptr_t stream, std::uintptr_t ws, std::size_t ws_bytes, double dropout,
                    std::uintptr_t dropout_state) const {
    const edge_gat_grad_args args{.x = view_of(x),
                                  .a_src = view_of(a_src),
                                  .a_dst = view_of(a_dst),
                                  .a_edge = view_of(a_edge),
                                  .out = view_of(out),
                                  .lse = view_of(lse),
                                  .dout = view_of(dout),
                                  .dx = view_of(dx),
                                  .da_src = view_of(da_src),
                                  .da_dst = view_of(da_dst),
                                  .da_edge = view_of(da_edge),
                                  .keep = view_of(keep),
                                  .dropout = dropout_of(dropout, dropout_state),
                                  .negative_slope = negative_slope};
    nb::gil_scoped_release release;
    plan.gat_backward(args, stream_of(stream), workspace_of(ws, ws_bytes));
  }
};

/// A weighted sparse matrix prepared on one device (the SpMM of the GCN layer and its transpose).
struct py_sparse_plan {
  sparse_plan plan;

  static py_sparse_plan from_host(std::uintptr_t row_ptr, std::uintptr_t col_idx,
                                  std::uintptr_t values, std::int64_t rows, std::int64_t cols,
                                  std::int64_t nnz, int device, std::uintptr_t stream,
                                  bool keep_order) {
    const csr_graph g = csr_of(row_ptr, col_idx, values, rows, cols, nnz);
    // The package's SDDMM gives scores that a softmax follows (the layers' per-edge path): f32
    // inputs take the three-product SDDMM, as accurate as f32 arithmetic (tf32 alone: ~3e-4).
    sparse_plan_options o;
    o.sddmm_f32 = f32_math::tf32x3;
    if (keep_order) o.order = row_order::original;
    nb::gil_scoped_release release;
    return {sparse_plan::build(g, device < 0 ? device_kind::cpu : device_kind::cuda, o,
                               stream_of(stream))};
  }

  /// values: per-head weights [slots, H, 1] in the plan's slot layout, or None for its own.
  void spmm(const std::optional<tensor_tuple>& values, const tensor_tuple& b, const tensor_tuple& c,
            std::uintptr_t stream, std::uintptr_t ws, std::size_t ws_bytes) const {
    nb::gil_scoped_release release;
    plan.spmm(view_of(values), view_of(b), view_of(c), stream_of(stream),
              workspace_of(ws, ws_bytes));
  }

  void sddmm(const tensor_tuple& x, const tensor_tuple& y, const tensor_tuple& out, double scale,
             std::uintptr_t stream) const {
    nb::gil_scoped_release release;
    plan.sddmm(view_of(x), view_of(y), view_of(out), scale, stream_of(stream));
  }

  void to_slots(const tensor_tuple& entries, const tensor_tuple& slots,
                std::uintptr_t stream) const {
    nb::gil_scoped_release release;
    plan.to_slots(view_of(entries), view_of(slots), stream_of(stream));
  }

  void to_entries(const tensor_tuple& slots, const tensor_tuple& entries,
                  std::uintptr_t stream) const {
    nb::gil_scoped_release release;
    plan.to_entries(view_of(slots), view_of(entries), stream_of(stream));
  }
};

/// A mask of equal-length sequences as a dense table: `table` (uint8, [batch, H, query blocks, key
/// blocks], zeroed by the caller) gets 1 at every kept block.
void fill_table(const block_sparse_mask& m, std::uint8_t* table) {
  for (const block_mask& bm : m.masks) {
    for (std::int64_t r = 0; r < bm.blocks.rows; ++r)
      for (std::int64_t e = bm.blocks.row_ptr[r]; e < bm.blocks.row_ptr[r + 1]; ++e)
        table[r * bm.blocks.cols + bm.blocks.col_idx[e]] = 1;
    table += bm.blocks.rows * bm.blocks.cols;
  }
}

/// A top-k block-sparse plan (topk_block_sparse_plan): select() picks the mask on the GPU from q
/// and k, then run and backward as BlockSparsePlan's (the package's block-sparse ops take either).
struct py_topk_plan : py_block_plan_calls<topk_block_sparse_plan> {
  static py_topk_plan build(const std::vector<std::int64_t>& cu_seqlens_q,
                            const std::vector<std::int64_t>& cu_seqlens_k, std::int64_t heads,
                            std::int64_t head_dim, std::int64_t block, std::int64_t top_k,
                            bool causal, bool keep_diagonal, bool gradients,
                            std::uintptr_t stream) {
    block_sparse_plan_options o;
    o.gradients = gradients;
    o.workspace_heads = 0;  // every backward passes its workspace
    nb::gil_scoped_release release;
    return {{topk_block_sparse_plan::build(
        cu_seqlens_q, cu_seqlens_k, heads, head_dim,
        {.block = block, .top_k = top_k, .causal = causal, .keep_diagonal = keep_diagonal}, o,
        stream_of(stream))}};
  }

  void select(const tensor_tuple& q, const tensor_tuple& k, std::uintptr_t stream) {
    nb::gil_scoped_release release;
    plan.select(view_of(q), view_of(k), stream_of(stream));
  }

  /// The last selected mask as fill_table's table at `out` (synchronises with `stream`).
  void blocks(std::uintptr_t out, std::uintptr_t stream) const {
    block_sparse_mask m;
    {
      nb::gil_scoped_release release;
      m = plan.mask(stream_of(stream));
    }
    fill_table(m, reinterpret_cast<std::uint8_t*>(out));
  }
};

/// topk_block_mask over sequences of equal lengths (q, k packed [batch * n, H, D] on the CPU), as
/// fill_table's table at `out`.
void topk_blocks(const tensor_tuple& q, const tensor_tuple& k, std::int64_t batch,
                 std::int64_t block, std::int64_t top_k, bool causal, bool keep_diagonal,
                 std::uintptr_t out) {
  const tensor_view qv = view_of(q), kv = view_of(k);
  TRISPARSE_EXPECTS_INPUT(batch > 0 && qv.rows % batch == 0 && kv.rows % batch == 0,
                          "topk_blocks: the rows must split into the batch's sequences");
  std::vector<std::int64_t> cu_q, cu_k;
  for (std::int64_t b = 0; b <= batch; ++b) {
    cu_q.push_back(b * (qv.rows / batch));
    cu_k.push_back(b * (kv.rows / batch));
  }
  block_sparse_mask m;
  {
    nb::gil_scoped_release release;
    m = topk_block_mask(
        qv, kv, cu_q, cu_k,
        {.block = block, .top_k = top_k, .causal = causal, .keep_diagonal = keep_diagonal});
  }
  fill_table(m, reinterpret_cast<std::uint8_t*>(out));
}

}  // namespace

// A block_pattern held by Python (trisparse.BlockPattern): built from and copied into tensors'
// memory by address, heads' block rows concatenated (heads * (block rows + 1) offsets, each head's
// from 0), so that no element goes through a Python list.
struct py_block_pattern {
  block_pattern p;

  static py_block_pattern from_csr(std::int64_t block, std::int64_t rows, std::int64_t cols,
                                   std::int64_t heads, std::uintptr_t row_ptr,
                                   std::uintptr_t col_idx, std::uintptr_t order,
                                   std::int64_t order_len, const std::string& made_by) {
    py_block_pattern out;
    block_pattern& p = out.p;
    p.block = block;
    p.rows = rows;
    p.cols = cols;
    p.made_by = made_by;
    TRISPARSE_EXPECTS_INPUT(block >= 1 && rows >= 0 && cols >= 0 && heads >= 1,
                            "BlockPattern: block >= 1, sizes >= 0 and heads >= 1");
    const std::int64_t br = p.block_rows();
    const auto* ptr = reinterpret_cast<const std::int64_t*>(row_ptr);
    const auto* idx = reinterpret_cast<const std::int32_t*>(col_idx);
    std::int64_t base = 0;
    for (std::int64_t h = 0; h < heads; ++h) {
      csr_graph g;
      g.rows = br;
      g.cols = p.block_cols();
      g.row_ptr.assign(ptr + h * (br + 1), ptr + (h + 1) * (br + 1));
      TRISPARSE_EXPECTS_INPUT(
          g.row_ptr.front() == 0 && g.row_ptr.back() >= 0,
          "BlockPattern: broken block row offsets of head " + std::to_string(h));
      g.col_idx.assign(idx + base, idx + base + g.row_ptr.back());
      base += g.row_ptr.back();
      p.heads.push_back(std::move(g));
    }
    const auto* ord = reinterpret_cast<const std::int64_t*>(order);
    if (order_len > 0) p.order.assign(ord, ord + order_len);
    p.check();
    return out;
  }

  /// Copies head h's offsets (block rows + 1) and key blocks into the given memory.
  void copy_head(std::int64_t h, std::uintptr_t row_ptr, std::uintptr_t col_idx) const {
    TRISPARSE_EXPECTS_INPUT(h >= 0 && h < p.num_heads(),
                            "BlockPattern: no head " + std::to_string(h));
    const csr_graph& g = p.heads[static_cast<std::size_t>(h)];
    std::copy(g.row_ptr.begin(), g.row_ptr.end(), reinterpret_cast<std::int64_t*>(row_ptr));
    std::copy(g.col_idx.begin(), g.col_idx.end(), reinterpret_cast<std::int32_t*>(col_idx));
  }
};

/// run, backward, block_mass, their workspace sizes and backend of a block-sparse plan class.
template <class T>
void bind_block_plan_calls(nb::class_<T>& c) {
  c.def("run", &T::run, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "scale"_a.none(), "stream"_a,
        "workspace"_a, "workspace_bytes"_a, "dropout"_a = 0.0, "dropout_state"_a = 0,
        "block_bias"_a.none() = nb::none())
      .def("backward", &T::backward, "q"_a, "k"_a, "v"_a, "out"_a.none(), "lse"_a.none(), "dout"_a,
           "dq"_a, "dk"_a, "dv"_a, "scale"_a.none(), "stream"_a, "workspace"_a, "workspace_bytes"_a,
           "block_mass"_a.none() = nb::none(), "block_grad"_a.none() = nb::none(),
           "dropout"_a = 0.0, "dropout_state"_a = 0, "block_bias"_a.none() = nb::none(),
           "dblock_bias"_a.none() = nb::none())
      .def("backward_workspace_bytes", &T::backward_workspace_bytes, "heads"_a,
           "importance"_a = false)
      .def("block_mass", &T::block_mass, "q"_a, "k"_a, "lse"_a.none(), "mass"_a, "scale"_a.none(),
           "stream"_a, "workspace"_a, "workspace_bytes"_a)
      .def("block_mass_workspace_bytes", &T::block_mass_workspace_bytes, "heads"_a)
      .def_prop_ro("backend", &T::backend);
}

NB_MODULE(_C, m) {
  m.doc() = "trisparse's plans (the C++ library); use the trisparse package, not this module";

  // Typed errors as the Python exceptions a user expects: a wrong argument is a ValueError, a
  // missing capability NotImplementedError, a device failure RuntimeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const trisparse::invalid_input& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const trisparse::not_supported& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    } catch (const trisparse::cuda_error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("topk_blocks", &topk_blocks, "q"_a, "k"_a, "batch"_a, "block"_a, "top_k"_a, "causal"_a,
        "keep_diagonal"_a, "out"_a);
  // The codes of trisparse::dtype, as views carry them (python/trisparse/_tensors.py).
  m.attr("dtype_codes") = nb::make_tuple(nb::make_tuple("float16", static_cast<int>(dtype::f16)),
                                         nb::make_tuple("bfloat16", static_cast<int>(dtype::bf16)),
                                         nb::make_tuple("float32", static_cast<int>(dtype::f32)),
                                         nb::make_tuple("float64", static_cast<int>(dtype::f64)));
  m.def("cuda_available", &trisparse::cuda_available,
        "Whether this build has the CUDA backend and a device is visible.");
  m.def("has_cuda_backend", [] {
#ifdef TRISPARSE_HAVE_CUDA
    return true;
#else
    return false;
#endif
  });

  nb::class_<py_attention_plan>(m, "AttentionPlan")
      .def_static("from_host", &py_attention_plan::from_host, "row_ptr"_a, "col_idx"_a, "rows"_a,
                  "cols"_a, "nnz"_a, "algo"_a, "gradients"_a, "device"_a, "stream"_a,
                  "keep_order"_a = false)
      .def_static("from_device", &py_attention_plan::from_device, "row_ptr"_a, "col_idx"_a,
                  "rows"_a, "cols"_a, "nnz"_a, "algo"_a, "gradients"_a, "stream"_a)
      .def("run", &py_attention_plan::run, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(),
           "bias"_a.none(), "scale"_a.none(), "algo"_a, "stream"_a, "workspace"_a,
           "workspace_bytes"_a)
      .def("backward", &py_attention_plan::backward, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(),
           "dout"_a, "dq"_a, "dk"_a, "dv"_a, "bias"_a.none(), "dbias"_a.none(), "scale"_a.none(),
           "algo"_a, "stream"_a, "workspace"_a, "workspace_bytes"_a)
      .def("workspace_bytes", [](const py_attention_plan& p, std::int64_t heads,
                                 std::int64_t dim) { return p.plan.workspace_bytes(heads, dim); })
      .def(
          "backward_workspace_bytes",
          [](const py_attention_plan& p, std::int64_t heads, std::int64_t dim, int type) {
            return p.plan.backward_workspace_bytes(heads, dim, static_cast<dtype>(type));
          },
          "heads"_a, "dim"_a, "dtype"_a)
      .def("resolve",
           [](const py_attention_plan& p, const std::string& algo) {
             return std::string(
                 trisparse::to_string(p.plan.resolve(trisparse::parse_algorithm(algo))));
           })
      .def_prop_ro("backend", [](const py_attention_plan& p) {
        const auto& r = p.plan.report();
        return trisparse::backend_name(r.algo, r.where);
      });

  nb::class_<py_sparse_plan>(m, "SparsePlan")
      .def_static("from_host", &py_sparse_plan::from_host, "row_ptr"_a, "col_idx"_a, "values"_a,
                  "rows"_a, "cols"_a, "nnz"_a, "device"_a, "stream"_a, "keep_order"_a = false)
      .def("spmm", &py_sparse_plan::spmm, "values"_a.none(), "b"_a, "c"_a, "stream"_a,
           "workspace"_a, "workspace_bytes"_a)
      .def("sddmm", &py_sparse_plan::sddmm, "x"_a, "y"_a, "out"_a, "scale"_a, "stream"_a)
      .def("to_slots", &py_sparse_plan::to_slots, "entries"_a, "slots"_a, "stream"_a)
      .def("to_entries", &py_sparse_plan::to_entries, "slots"_a, "entries"_a, "stream"_a)
      .def("slots", [](const py_sparse_plan& p) { return p.plan.slots(); })
      .def("workspace_bytes", [](const py_sparse_plan& p, std::int64_t heads, std::int64_t dim) {
        return p.plan.workspace_bytes(heads, dim);
      });

  nb::class_<py_gcn_fused_plan>(m, "GcnFusedPlan")
      .def_static("from_host", &py_gcn_fused_plan::from_host, "row_ptr"_a, "col_idx"_a, "values"_a,
                  "rows"_a, "nnz"_a, "device"_a, "stream"_a)
      .def("forward", &py_gcn_fused_plan::forward, "x"_a, "w"_a, "bias"_a.none(), "out"_a, "relu"_a,
           "mask"_a, "ax"_a.none(), "order"_a, "stream"_a, "workspace"_a, "workspace_bytes"_a)
      .def("backward", &py_gcn_fused_plan::backward, "dout"_a, "mask"_a, "x"_a, "w"_a,
           "ax"_a.none(), "dx"_a.none(), "dw"_a, "dbias"_a.none(), "order"_a, "stream"_a,
           "workspace"_a, "workspace_bytes"_a)
      .def(
          "backward_workspace_bytes",
          [](const py_gcn_fused_plan& p, std::int64_t in_dim, std::int64_t out_dim, int type,
             const std::string& order) {
            return p.plan.backward_workspace_bytes(in_dim, out_dim, static_cast<dtype>(type),
                                                   order_of(order));
          },
          "in_dim"_a, "out_dim"_a, "dtype"_a, "order"_a)
      .def(
          "fused",
          [](const py_gcn_fused_plan& p, std::int64_t in_dim, std::int64_t out_dim, int type,
             const std::string& order) {
            return p.plan.fused(in_dim, out_dim, static_cast<dtype>(type), order_of(order));
          },
          "in_dim"_a, "out_dim"_a, "dtype"_a, "order"_a)
      .def(
          "workspace_bytes",
          [](const py_gcn_fused_plan& p, std::int64_t in_dim, std::int64_t out_dim, int type,
             const std::string& order) {
            return p.plan.workspace_bytes(in_dim, out_dim, static_cast<dtype>(type),
                                          order_of(order));
          },
          "in_dim"_a, "out_dim"_a, "dtype"_a, "order"_a);
  nb::class_<py_gat_plan>(m, "GatPlan")
      .def_ro_static("max_head_width", &gat_plan::max_head_width)
      .def_static("from_host", &py_gat_plan::from_host, "row_ptr"_a, "col_idx"_a, "rows"_a,
                  "cols"_a, "nnz"_a, "device"_a, "stream"_a)
      .def("forward", &py_gat_plan::forward, "x"_a, "a_src"_a, "a_dst"_a, "keep"_a.none(),
           "keep_index"_a, "out"_a, "lse"_a, "negative_slope"_a, "stream"_a, "workspace"_a,
           "workspace_bytes"_a, "dropout"_a, "dropout_state"_a)
      .def("backward", &py_gat_plan::backward, "x"_a, "a_src"_a, "a_dst"_a, "keep"_a.none(),
           "keep_index"_a, "out"_a, "lse"_a, "dout"_a, "dx"_a, "da_src"_a, "da_dst"_a,
           "negative_slope"_a, "stream"_a, "workspace"_a, "workspace_bytes"_a, "dropout"_a,
           "dropout_state"_a)
      .def(
          "workspace_bytes",
          [](const py_gat_plan& p, std::int64_t heads, std::int64_t width, bool backward) {
            return backward ? p.plan.backward_workspace_bytes(heads, width)
                            : p.plan.forward_workspace_bytes(heads, width);
          },
          "heads"_a, "width"_a, "backward"_a);
  nb::class_<py_edge_attention_plan>(m, "EdgeAttentionPlan")
      .def_static("build", &py_edge_attention_plan::build, "rows"_a, "cols"_a, "edges"_a,
                  "row_ptr"_a, "src"_a, "dst"_a, "edge"_a, "col_ptr"_a, "by_source"_a, "heavy"_a,
                  "heavy_rows"_a, "heavy_row_count"_a, "heavy_cols"_a, "heavy_col_count"_a,
                  "device"_a)
      .def_ro_static("heavy_degree", &edge_attention_plan::heavy_degree)
      .def_static("supports", &edge_attention_plan::supports, "head_dim"_a)
      .def_static("feature_width", &edge_attention_plan::feature_width, "head_dim"_a, "features"_a)
      .def("forward", &py_edge_attention_plan::forward, "q"_a, "k"_a, "v"_a, "r"_a.none(),
           "a"_a.none(), "out"_a, "out_edge"_a.none(), "lse"_a, "keep"_a.none(), "scale"_a,
           "stream"_a, "dropout"_a = 0.0, "dropout_state"_a = 0)
      .def("backward", &py_edge_attention_plan::backward, "q"_a, "k"_a, "v"_a, "r"_a.none(),
           "a"_a.none(), "out"_a, "out_edge"_a.none(), "lse"_a, "dout"_a, "dout_edge"_a.none(),
           "dq"_a, "dk"_a, "dv"_a, "dr"_a.none(), "da"_a.none(), "keep"_a.none(), "scale"_a,
           "stream"_a, "workspace"_a, "workspace_bytes"_a, "dropout"_a = 0.0, "dropout_state"_a = 0)
      .def("gat_forward", &py_edge_attention_plan::gat_forward, "x"_a, "a_src"_a, "a_dst"_a,
           "a_edge"_a.none(), "out"_a, "lse"_a, "keep"_a.none(), "negative_slope"_a, "stream"_a,
           "dropout"_a = 0.0, "dropout_state"_a = 0)
      .def("gat_backward", &py_edge_attention_plan::gat_backward, "x"_a, "a_src"_a, "a_dst"_a,
           "a_edge"_a.none(), "out"_a, "lse"_a, "dout"_a, "dx"_a, "da_src"_a, "da_dst"_a,
           "da_edge"_a.none(), "keep"_a.none(), "negative_slope"_a, "stream"_a, "workspace"_a,
           "workspace_bytes"_a, "dropout"_a = 0.0, "dropout_state"_a = 0)
      .def(
          "neighbor_sum",
          [](const py_edge_attention_plan& p, const tensor_tuple& x, const tensor_tuple& out,
             bool transposed, std::uintptr_t stream) {
            const tensor_view xv = view_of(x), ov = view_of(out);
            nb::gil_scoped_release release;
            p.plan.neighbor_sum(xv, ov, transposed, stream_of(stream));
          },
          "x"_a, "out"_a, "transposed"_a, "stream"_a)
      .def(
          "workspace_bytes",
          [](const py_edge_attention_plan& p, std::int64_t heads, int grads) {
            return p.plan.backward_workspace_bytes(heads, static_cast<dtype>(grads));
          },
          "heads"_a, "grads"_a = static_cast<int>(dtype::f32));
  m.def("cuda_head_dims", &cuda_head_dims);
  m.def("segment_attention_supports", &segment_attention_plan::supports, "head_dim"_a);
  m.def(
      "segment_attention_workspace",
      [](std::uintptr_t ids, std::int64_t rows, std::int64_t heads, bool backward) {
        const auto plan = segment_plan(rows, ids, true, 0);
        return backward ? plan.backward_workspace_bytes(heads) : plan.workspace_bytes();
      },
      "ids"_a, "rows"_a, "heads"_a, "backward"_a);
  m.def(
      "segment_attention_forward",
      [](std::uintptr_t ids, bool ids_64, const tensor_tuple& q, const tensor_tuple& k,
         const tensor_tuple& v, const tensor_tuple& out, const tensor_tuple& lse, double scale,
         double dropout, std::uintptr_t dropout_state, const std::optional<tensor_tuple>& bias,
         std::uintptr_t edges, std::int64_t num_edges, std::uintptr_t stream, std::uintptr_t ws,
         std::size_t ws_bytes) {
        const tensor_view qv = view_of(q);
        const auto plan = segment_plan(qv.rows, ids, ids_64, qv.device_id, edges, num_edges);
        nb::gil_scoped_release release;
        plan.run(qv, view_of(k), view_of(v), view_of(out),
                 {.scale = scale,
                  .lse = view_of(lse),
                  .bias = view_of(bias),
                  .dropout = dropout_of(dropout, dropout_state)},
                 workspace_of(ws, ws_bytes), stream_of(stream));
      },
      "ids"_a, "ids_64"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "scale"_a, "dropout"_a,
      "dropout_state"_a, "bias"_a.none(), "edges"_a, "num_edges"_a, "stream"_a, "workspace"_a,
      "workspace_bytes"_a);
  m.def(
      "segment_attention_backward",
      [](std::uintptr_t ids, bool ids_64, const tensor_tuple& q, const tensor_tuple& k,
         const tensor_tuple& v, const tensor_tuple& out, const tensor_tuple& lse,
         const tensor_tuple& dout, const tensor_tuple& dq, const tensor_tuple& dk,
         const tensor_tuple& dv, double scale, double dropout, std::uintptr_t dropout_state,
         const std::optional<tensor_tuple>& bias, const std::optional<tensor_tuple>& dbias,
         std::uintptr_t edges, std::int64_t num_edges, std::uintptr_t stream, std::uintptr_t ws,
         std::size_t ws_bytes) {
        const tensor_view qv = view_of(q);
        const auto plan = segment_plan(qv.rows, ids, ids_64, qv.device_id, edges, num_edges);
        nb::gil_scoped_release release;
        plan.backward(qv, view_of(k), view_of(v), view_of(out), view_of(lse), view_of(dout),
                      view_of(dq), view_of(dk), view_of(dv),
                      {.scale = scale,
                       .bias = view_of(bias),
                       .dbias = view_of(dbias),
                       .dropout = dropout_of(dropout, dropout_state)},
                      workspace_of(ws, ws_bytes), stream_of(stream));
      },
      "ids"_a, "ids_64"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a,
      "scale"_a, "dropout"_a, "dropout_state"_a, "bias"_a.none(), "dbias"_a.none(), "edges"_a,
      "num_edges"_a, "stream"_a, "workspace"_a, "workspace_bytes"_a);
  m.def(
      "block_attention_mass",
      [](const tensor_tuple& q, const tensor_tuple& k, std::int64_t block, bool causal,
         double scale, std::uintptr_t out) {
        const tensor_view qv = view_of(q), kv = view_of(k);
        nb::gil_scoped_release release;
        const std::vector<double> mass = block_attention_mass(qv, kv, block, causal, scale);
        std::copy(mass.begin(), mass.end(), reinterpret_cast<double*>(out));
      },
      "q"_a, "k"_a, "block"_a, "causal"_a, "scale"_a, "out"_a,
      "Each block's attention mass into the float64 [H, qb, kb] buffer at `out`.");
  m.def(
      "block_value_mass",
      [](const tensor_tuple& q, const tensor_tuple& k, const tensor_tuple& v, std::int64_t block,
         bool causal, double scale, std::uintptr_t mass, std::uintptr_t value) {
        const tensor_view qv = view_of(q), kv = view_of(k), vv = view_of(v);
        nb::gil_scoped_release release;
        const block_value_statistics st = block_value_mass(qv, kv, vv, block, causal, scale);
        std::copy(st.mass.begin(), st.mass.end(), reinterpret_cast<double*>(mass));
        std::copy(st.value.begin(), st.value.end(), reinterpret_cast<double*>(value));
      },
      "q"_a, "k"_a, "v"_a, "block"_a, "causal"_a, "scale"_a, "mass"_a, "value"_a,
      "Each block's attention mass and value sums into the float64 [H, qb, kb] and "
      "[H, qb, kb, Dv] buffers at `mass` and `value`.");
  m.def("pooled_block_mass_workspace_bytes", &pooled_block_mass_workspace_bytes, "heads"_a, "n_q"_a,
        "n_k"_a, "dim"_a, "block"_a);
  m.def(
      "pooled_block_mass",
      [](const tensor_tuple& q, const tensor_tuple& k, std::int64_t block, bool causal,
         double scale, std::uintptr_t out, std::uintptr_t ws, std::size_t ws_bytes,
         std::uintptr_t stream, std::uintptr_t due) {
        pooled_block_mass(view_of(q), view_of(k), block, causal, scale,
                          reinterpret_cast<double*>(out), reinterpret_cast<void*>(ws), ws_bytes,
                          stream_of(stream), reinterpret_cast<const bool*>(due));
      },
      "q"_a, "k"_a, "block"_a, "causal"_a, "scale"_a, "out"_a, "workspace"_a, "workspace_bytes"_a,
      "stream"_a, "due"_a = 0,
      "The pooled block mass into the float64 [H, qb, kb] buffer at `out` (q's device), where "
      "the bool at `due` (0: none) is true.");
  m.attr("head_product_max_width") = kHeadProductMaxWidth;
  m.def(
      "head_product",
      [](const tensor_tuple& x, const tensor_tuple& w, const tensor_tuple& out,
         std::uintptr_t stream) {
        const tensor_view xv = view_of(x), wv = view_of(w), ov = view_of(out);
        nb::gil_scoped_release release;
        head_product(xv, wv, ov, stream_of(stream));
      },
      "x"_a, "w"_a, "out"_a, "stream"_a,
      "out[n, h] = x[n, h] w[h] (float32 [N, H, a] x [H, a, b] -> [N, H, b]).");
  m.def("head_outer_workspace_bytes", &head_outer_workspace_bytes, "rows"_a, "heads"_a, "a"_a,
        "b"_a);
  m.def(
      "head_outer",
      [](const tensor_tuple& x, const tensor_tuple& g, const tensor_tuple& dw, std::uintptr_t ws,
         std::size_t ws_bytes, std::uintptr_t stream) {
        const tensor_view xv = view_of(x), gv = view_of(g), dv = view_of(dw);
        nb::gil_scoped_release release;
        head_outer(xv, gv, dv, reinterpret_cast<void*>(ws), ws_bytes, stream_of(stream));
      },
      "x"_a, "g"_a, "dw"_a, "workspace"_a, "workspace_bytes"_a, "stream"_a,
      "dw[h] = sum over n of x[n, h]^T g[n, h] (float32, a fixed order of sums).");
  m.def(
      "fold_block_importance",
      [](std::uintptr_t state, std::uintptr_t mass, const std::vector<std::int64_t>& strides,
         std::int64_t batch, std::uintptr_t keep, std::uintptr_t pooled, std::uintptr_t seen,
         std::int64_t heads, std::int64_t qb, std::int64_t kb, double decay, int device,
         std::uintptr_t stream, std::uintptr_t due) {
        TRISPARSE_EXPECTS_INPUT(strides.size() == 4, "fold_block_importance: 4 mass strides");
        importance_fold_args a;
        a.state = reinterpret_cast<double*>(state);
        a.mass = reinterpret_cast<const float*>(mass);
        std::copy(strides.begin(), strides.end(), a.mass_strides);
        a.batch = batch;
        a.keep = reinterpret_cast<const bool*>(keep);
        a.pooled = reinterpret_cast<const double*>(pooled);
        a.seen = reinterpret_cast<const bool*>(seen);
        a.heads = heads;
        a.qb = qb;
        a.kb = kb;
        a.decay = decay;
        a.due = reinterpret_cast<const bool*>(due);
        a.where = device < 0 ? device_kind::cpu : device_kind::cuda;
        a.device_id = device < 0 ? 0 : device;
        fold_block_importance(a, stream_of(stream));
      },
      "state"_a, "mass"_a, "mass_strides"_a, "batch"_a, "keep"_a, "pooled"_a, "seen"_a, "heads"_a,
      "qb"_a, "kb"_a, "decay"_a, "device"_a, "stream"_a, "due"_a = 0,
      "A kernel-measured block mass folded into the float64 importance average at `state`, "
      "where the bool at `due` (0: none) is true.");
  m.def(
      "advance_learner_schedule",
      [](std::uintptr_t steps, std::uintptr_t flags, std::int64_t warmup, std::int64_t every,
         std::int64_t track_every, std::int64_t freeze_after, int device, std::uintptr_t stream) {
        learner_schedule_args a;
        a.steps = reinterpret_cast<std::int64_t*>(steps);
        a.flags = reinterpret_cast<bool*>(flags);
        a.warmup = warmup;
        a.every = every;
        a.track_every = track_every;
        a.freeze_after = freeze_after;
        a.where = device < 0 ? device_kind::cpu : device_kind::cuda;
        a.device_id = device < 0 ? 0 : device;
        advance_learner_schedule(a, stream_of(stream));
      },
      "steps"_a, "flags"_a, "warmup"_a, "every"_a, "track_every"_a, "freeze_after"_a, "device"_a,
      "stream"_a,
      "A learner's step count (int64 at `steps`) advanced, its prune, fold and track flags for "
      "the step into the 3 bools at `flags` (freeze_after < 0: never).");
  m.def(
      "prune_block_importance",
      [](std::uintptr_t importance, std::uintptr_t forced, std::uintptr_t keep, std::uintptr_t due,
         std::int64_t heads, std::int64_t qb, std::int64_t kb, std::int64_t budget,
         const std::string& scope, int device, std::uintptr_t stream, std::uintptr_t workspace,
         std::size_t workspace_bytes) {
        block_prune_args a;
        a.importance = reinterpret_cast<const double*>(importance);
        a.forced = reinterpret_cast<const bool*>(forced);
        a.keep = reinterpret_cast<bool*>(keep);
        a.due = reinterpret_cast<const bool*>(due);
        a.heads = heads;
        a.qb = qb;
        a.kb = kb;
        a.budget = budget;
        a.scope = prune_scope_of(scope);
        a.where = device < 0 ? device_kind::cpu : device_kind::cuda;
        a.device_id = device < 0 ? 0 : device;
        a.workspace = reinterpret_cast<void*>(workspace);
        a.workspace_bytes = workspace_bytes;
        prune_block_importance(a, stream_of(stream));
      },
      "importance"_a, "forced"_a, "keep"_a, "due"_a, "heads"_a, "qb"_a, "kb"_a, "budget"_a,
      "scope"_a, "device"_a, "stream"_a, "workspace"_a = 0, "workspace_bytes"_a = 0,
      "keep = forced | each row's (or head's) `budget` most important blocks (float64 "
      "importance [H, qb, kb], bool forced [qb, kb] or 0, bool keep), where the bool at `due` "
      "(0: always) is true; on CUDA with prune_block_importance_workspace_bytes of workspace.");
  m.def(
      "prune_block_importance_workspace_bytes",
      [](std::int64_t heads, std::int64_t qb, std::int64_t kb, const std::string& scope) {
        return prune_block_importance_workspace_bytes(heads, qb, kb, prune_scope_of(scope));
      },
      "heads"_a, "qb"_a, "kb"_a, "scope"_a,
      "Bytes of prune_block_importance's workspace on CUDA for these sizes and scope.");
  m.def(
      "prune_blocks_by_output",
      [](std::uintptr_t mass, std::uintptr_t value, std::int64_t heads, std::int64_t qb,
         std::int64_t kb, std::int64_t dv, double sparsity, bool keep_diagonal, std::int64_t window,
         std::int64_t global_blocks, bool causal, std::uintptr_t keep) {
        const std::span<const double> m(reinterpret_cast<const double*>(mass),
                                        static_cast<std::size_t>(heads * qb * kb));
        const std::span<const double> u(reinterpret_cast<const double*>(value),
                                        static_cast<std::size_t>(heads * qb * kb * dv));
        prune_options o;
        o.method = "output";
        o.sparsity = sparsity;
        o.keep_diagonal = keep_diagonal;
        o.window = window;
        o.global_blocks = global_blocks;
        nb::gil_scoped_release release;
        const std::vector<std::uint8_t> kept =
            prune_blocks_by_output(m, u, heads, qb, kb, dv, o, causal);
        std::copy(kept.begin(), kept.end(), reinterpret_cast<std::uint8_t*>(keep));
      },
      "mass"_a, "value"_a, "heads"_a, "qb"_a, "kb"_a, "dv"_a, "sparsity"_a, "keep_diagonal"_a,
      "window"_a, "global_blocks"_a, "causal"_a, "keep"_a,
      "The blocks kept for the output (uint8 [H, qb, kb] at `keep`) from the float64 block "
      "statistics at `mass` and `value`.");
  nb::class_<py_block_pattern>(m, "BlockPattern")
      .def_static("from_csr", &py_block_pattern::from_csr, "block"_a, "rows"_a, "cols"_a, "heads"_a,
                  "row_ptr"_a, "col_idx"_a, "order"_a, "order_len"_a, "made_by"_a)
      .def_static(
          "layout",
          [](const std::string& kind, std::int64_t n, std::int64_t block, std::int64_t heads,
             double p, std::int64_t window, std::int64_t stride, std::int64_t global,
             std::int64_t random, std::uint64_t seed) {
            static const std::map<std::string, block_layout> kinds = {
                {"dense", block_layout::dense},   {"random", block_layout::random},
                {"window", block_layout::window}, {"strided", block_layout::strided},
                {"global", block_layout::global}, {"bigbird", block_layout::bigbird}};
            const auto it = kinds.find(kind);
            TRISPARSE_EXPECTS_INPUT(it != kinds.end(),
                                    "kind must be dense, random, window, strided, global or "
                                    "bigbird, not '" +
                                        kind + "'");
            block_layout_options o;
            o.layout = it->second;
            o.block = block;
            o.p = p;
            o.window = window;
            o.stride = stride;
            o.global = global;
            o.random = random;
            o.seed = seed;
            return py_block_pattern{layout_block_pattern(o, n, heads)};
          },
          "kind"_a, "n"_a, "block"_a, "heads"_a, "p"_a, "window"_a, "stride"_a, "global_"_a,
          "random"_a, "seed"_a)
      .def_static(
          "community",
          [](std::uintptr_t rows, std::uintptr_t cols, std::int64_t edges, std::int64_t n,
             std::int64_t block, std::int64_t heads, std::uint64_t seed) {
            coo_graph c;
            c.rows = c.cols = n;
            const auto* r = reinterpret_cast<const std::int64_t*>(rows);
            const auto* k = reinterpret_cast<const std::int64_t*>(cols);
            c.src.assign(r, r + edges);
            c.dst.assign(k, k + edges);
            const csr_graph g = to_csr(c);
            nb::gil_scoped_release release;
            return py_block_pattern{community_block_pattern(g, block, heads, seed)};
          },
          "rows"_a, "cols"_a, "edges"_a, "n"_a, "block"_a, "heads"_a, "seed"_a)
      .def_static(
          "load",
          [](const std::string& path) { return py_block_pattern{load_block_pattern(path)}; })
      .def_static(
          "learn",
          [](const tensor_tuple& q, const tensor_tuple& k, std::int64_t block,
             const std::string& method, double sparsity, double top_p, bool keep_diagonal,
             std::int64_t window, std::int64_t global_blocks, bool causal,
             const std::optional<tensor_tuple>& v) {
            const prune_options o{method, sparsity, top_p, keep_diagonal, window, global_blocks};
            const tensor_view qv = view_of(q), kv = view_of(k);
            std::optional<tensor_view> vv;
            if (v) vv = view_of(*v);
            nb::gil_scoped_release release;
            return py_block_pattern{learn_block_pattern(qv, kv, block, o, causal, vv)};
          },
          "q"_a, "k"_a, "block"_a, "method"_a, "sparsity"_a, "top_p"_a, "keep_diagonal"_a,
          "window"_a, "global_blocks"_a, "causal"_a, "v"_a = nb::none())
      .def_static("union",
                  [](const std::vector<const py_block_pattern*>& parts) {
                    std::vector<block_pattern> ps;
                    for (const auto* x : parts) ps.push_back(x->p);
                    return py_block_pattern{union_of(ps)};
                  })
      .def("save", [](const py_block_pattern& x,
                      const std::string& path) { save_block_pattern(x.p, path); })
      .def(
          "render",
          [](const py_block_pattern& x, std::int64_t max_side, std::int64_t columns) {
            gray_image img = render(x.p, max_side, columns);
            return std::make_tuple(
                img.width, img.height,
                nb::bytes(reinterpret_cast<const char*>(img.pixels.data()), img.pixels.size()));
          },
          "max_side"_a, "columns"_a)
      .def("copy_head", &py_block_pattern::copy_head, "head"_a, "row_ptr"_a, "col_idx"_a)
      .def("head_nnz",
           [](const py_block_pattern& x, std::int64_t h) {
             TRISPARSE_EXPECTS_INPUT(h >= 0 && h < x.p.num_heads(), "no head " + std::to_string(h));
             return x.p.heads[static_cast<std::size_t>(h)].nnz();
           })
      .def("copy_order",
           [](const py_block_pattern& x, std::uintptr_t out) {
             std::copy(x.p.order.begin(), x.p.order.end(), reinterpret_cast<std::int64_t*>(out));
           })
      .def("stats",
           [](const py_block_pattern& x) {
             const block_pattern_stats s = stats(x.p);
             nb::dict d;
             d["density"] = s.density;
             d["row_min_density"] = s.row_min_density;
             d["row_max_density"] = s.row_max_density;
             d["mean_distance"] = s.mean_distance;
             d["head_overlap"] = s.head_overlap;
             return d;
           })
      .def_prop_ro("block", [](const py_block_pattern& x) { return x.p.block; })
      .def_prop_ro("rows", [](const py_block_pattern& x) { return x.p.rows; })
      .def_prop_ro("cols", [](const py_block_pattern& x) { return x.p.cols; })
      .def_prop_ro("heads", [](const py_block_pattern& x) { return x.p.num_heads(); })
      .def_prop_ro(
          "order_len",
          [](const py_block_pattern& x) { return static_cast<std::int64_t>(x.p.order.size()); })
      .def_prop_ro("made_by", [](const py_block_pattern& x) { return x.p.made_by; });
  auto block_plan =
      nb::class_<py_block_sparse_plan>(m, "BlockSparsePlan")
          .def_static("build", &py_block_sparse_plan::build, "block"_a, "heads"_a, "causal"_a,
                      "cu_seqlens_q"_a, "cu_seqlens_k"_a, "masks"_a, "algo"_a, "device"_a,
                      "stream"_a)
          .def_static("build_on_device", &py_block_sparse_plan::build_on_device, "block"_a,
                      "heads"_a, "causal"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "kept"_a,
                      "seq_stride"_a, "head_stride"_a, "row_stride"_a, "rows"_a, "cols"_a,
                      "device"_a, "stream"_a, "mean_blocks"_a = -1.0)
          .def("refill", &py_block_sparse_plan::refill, "kept"_a, "seq_stride"_a, "head_stride"_a,
               "row_stride"_a, "rows"_a, "cols"_a, "device"_a, "stream"_a, "due"_a = 0)
          .def("workspace_bytes",
               [](const py_block_sparse_plan& p, std::int64_t heads, std::int64_t dim) {
                 return p.plan.workspace_bytes(heads, dim);
               });
  bind_block_plan_calls(block_plan);
  auto topk_plan = nb::class_<py_topk_plan>(m, "TopkBlockSparsePlan")
                       .def_static("build", &py_topk_plan::build, "cu_seqlens_q"_a,
                                   "cu_seqlens_k"_a, "heads"_a, "head_dim"_a, "block"_a, "top_k"_a,
                                   "causal"_a, "keep_diagonal"_a, "gradients"_a, "stream"_a)
                       .def("select", &py_topk_plan::select, "q"_a, "k"_a, "stream"_a)
                       .def("blocks", &py_topk_plan::blocks, "out"_a, "stream"_a)
                       .def("workspace_bytes",
                            [](const py_topk_plan&, std::int64_t, std::int64_t) { return 0; });
  bind_block_plan_calls(topk_plan);
}
