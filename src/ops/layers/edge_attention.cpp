// TransformerConv's attention with edge features (edge_attention_plan): argument checks, then the
// CPU engine or the CUDA kernels.
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../../common/arguments.hpp"
#include "../../cpu/common/dropout_draws.hpp"
#include "../../cpu/layers/edge_attention.hpp"
#include "../../cpu/layers/f32.hpp"
#include "../../cuda/layers/edge_attention/plan.hpp"
#include "common.hpp"
#include "trisparse/ops/layers.hpp"

namespace trisparse {

namespace {

// Vector loads: a lane's slice of a head (4 or 8 elements) and of the features must be aligned.
void check_aligned(const tensor_view& t, const char* what, std::int64_t per_lane) {
  if (t.data == nullptr || per_lane <= 0) return;
  const std::int64_t bytes = per_lane * static_cast<std::int64_t>(size_of(t.type));
  const std::int64_t align = bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 1;
  const std::int64_t elems = align / static_cast<std::int64_t>(size_of(t.type));
  const bool ok = reinterpret_cast<std::uintptr_t>(t.data) % align == 0 &&
                  (elems <= 1 || (t.row_stride % elems == 0 && t.head_stride % elems == 0));
  TRISPARSE_EXPECTS_INPUT(ok, std::string(what) + " " + t.describe() + " must be " +
                                  std::to_string(align) +
                                  "-byte aligned with strides to match (make it contiguous)");
}

// A per-node operand [rows, H, C] of the line kernels: its shape, device, a head width they take
// and the vector loads' alignment; returns the lanes of a group. `op` names the call.
int check_node_operand(const tensor_view& x, const char* what, std::int64_t rows, const char* op) {
  check_view(x, what, rows, -1, -1);
  const int lanes = cuda::edge_attention_group(x.dim);
  TRISPARSE_EXPECTS_INPUT(lanes > 0, std::string(op) +
                                         " takes heads of 4 * 2^k <= 128 or 256 channels, not " +
                                         std::to_string(x.dim));
  detail::check_device_arg(x, what);
  check_aligned(x, what, x.dim / lanes);
  return lanes;
}

struct shapes {
  std::int64_t heads, dim, features;
};

shapes check_inputs(const multigraph_view& g, const tensor_view& q, const tensor_view& k,
                    const tensor_view& v, const tensor_view& r, const tensor_view& a) {
  check_view(q, "q", g.rows, -1, -1);
  const shapes s{q.heads, q.dim, r.data != nullptr ? r.dim : 0};
  const int lanes = cuda::edge_attention_group(s.dim);
  TRISPARSE_EXPECTS_INPUT(lanes > 0,
                          "edge_attention takes heads of 4 * 2^k <= 128 or 256 "
                          "channels, not " +
                              std::to_string(s.dim));
  check_view(k, "k", g.cols, s.heads, s.dim);
  check_view(v, "v", g.cols, s.heads, s.dim);
  for (const tensor_view* t : {&q, &k, &v}) {
    detail::check_device_arg(*t, "edge_attention operand");
    TRISPARSE_EXPECTS_INPUT(t->type == q.type, "q, k, v (and r, a) must share one dtype; got " +
                                                   t->describe() + " beside " + q.describe());
    check_aligned(*t, "edge_attention operand", s.dim / lanes);
  }
  if (s.features > 0) {
    TRISPARSE_EXPECTS_INPUT(s.features % lanes == 0, "r and a: " + std::to_string(s.features) +
                                                         " features are not a multiple of " +
                                                         std::to_string(lanes) +
                                                         " (edge_attention_plan::feature_width)");
    check_view(r, "r", g.rows, s.heads, s.features);
    check_view(a, "a", g.edges, 1, s.features);
    for (const tensor_view* t : {&r, &a}) {
      detail::check_device_arg(*t, "edge_attention operand");
      TRISPARSE_EXPECTS_INPUT(t->type == q.type, "r and a must have q's dtype; got " +
                                                     t->describe() + " beside " + q.describe());
      check_aligned(*t, "edge_attention operand", s.features / lanes);
    }
  }
  return s;
}

void check_f32(const tensor_view& t, const char* what, std::int64_t rows, std::int64_t heads,
               std::int64_t dim) {
  check_view(t, what, rows, heads, dim);
  detail::check_device_arg(t, what);
  TRISPARSE_EXPECTS_INPUT(t.type == dtype::f32,
                          std::string(what) + " " + t.describe() + " must be f32");
}

// A gradient or out_edge: f32, or the operands' dtype (rounded once from the kernels' f32 sums).
void check_f32_or_operand(const tensor_view& t, const char* what, std::int64_t rows,
                          std::int64_t heads, std::int64_t dim, dtype operand) {
  check_view(t, what, rows, heads, dim);
  detail::check_device_arg(t, what);
  TRISPARSE_EXPECTS_INPUT(
      t.type == dtype::f32 || t.type == operand,
      std::string(what) + " " + t.describe() + " must be f32 or the operands' dtype");
}

// The backward's side of the multigraph (by target and by source), which a forward-only
// multigraph leaves out.
void check_backward_side(const multigraph_view& g) {
  TRISPARSE_EXPECTS_INPUT(g.col_ptr != nullptr,
                          "edge_attention_plan: this multigraph was built for the forward only "
                          "(no dst, col_ptr and by_source); build it with them for the backward");
}

// Attention dropout's factors, where given: [edges, H, 1] f32 keep factors, or draws made in the
// kernels, not both.
void check_keep(const multigraph_view& g, const tensor_view& keep, const attention_dropout& dropout,
                std::int64_t heads) {
  if (keep.data != nullptr) check_f32(keep, "keep", g.edges, heads, 1);
  detail::check_keep_or_dropout(keep, dropout);
}

// The CPU engine's operands: shapes, host memory and one dtype; returns the feature count.
std::int64_t check_cpu_inputs(const multigraph_view& g, const tensor_view& q, const tensor_view& k,
                              const tensor_view& v, const tensor_view& r, const tensor_view& a) {
  check_view(q, "q", g.rows, -1, -1);
  check_view(k, "k", g.cols, q.heads, q.dim);
  check_view(v, "v", g.cols, q.heads, q.dim);
  // Given: data, or a shape (an empty tensor's data may be null).
  const auto given = [](const tensor_view& t) { return t.data != nullptr || t.dim > 0; };
  TRISPARSE_EXPECTS_INPUT(given(r) == given(a),
                          "r and a come together (the edge features' score term) or not at all");
  if (given(r)) {
    check_view(r, "r", g.rows, q.heads, -1);
    check_view(a, "a", g.edges, 1, r.dim);
  }
  for (const tensor_view* t : {&q, &k, &v, &r, &a}) {
    if (t->data == nullptr) continue;
    detail::check_host(*t, "edge_attention operand");
    TRISPARSE_EXPECTS_INPUT(t->type == q.type, "q, k, v (and r, a) must share one dtype; got " +
                                                   t->describe() + " beside " + q.describe());
  }
  return given(r) ? r.dim : 0;
}

// A host view of the given shape (an output or gradient, any float dtype), where given.
void check_cpu_view(const tensor_view& t, const char* what, std::int64_t rows, std::int64_t heads,
                    std::int64_t dim) {
  check_view(t, what, rows, heads, dim);
  detail::check_host(t, what);
}

// keep [edges, H, 1] on the host, or draws, not both.
void check_cpu_keep(const multigraph_view& g, const tensor_view& keep,
                    const attention_dropout& dropout, std::int64_t heads) {
  if (keep.data != nullptr) check_cpu_view(keep, "keep", g.edges, heads, 1);
  detail::check_keep_or_dropout(keep, dropout);  // (the state in host memory)
}

// The CPU backward's scratch: 2 edges H values of T.
template <class T>
T* cpu_scratch(const multigraph_view& g, std::int64_t heads, workspace_view workspace,
               const char* op) {
  const std::size_t need = static_cast<std::size_t>(2 * g.edges * heads) * sizeof(T);
  TRISPARSE_EXPECTS_INPUT(workspace.bytes >= need && (workspace.data != nullptr || need == 0),
                          std::string(op) + "'s backward needs backward_workspace_bytes(" +
                              std::to_string(heads) + ") = " + std::to_string(need) +
                              " bytes of workspace");
  return static_cast<T*>(workspace.data);
}

// The operands q, k, v, r, a and keep of a forward's or backward's arguments as views of T:
// themselves, or copies where they hold another dtype; dropout's draws as keep factors.
template <class T>
struct typed_operands {
  host_tensor q, k, v, r, a, keep;
  cpu::edge_operands views;

  template <class Args>
  typed_operands(const multigraph_view& g, const Args& args) {
    if (args.dropout.p > 0)
      keep = cpu::drawn_edge_keep<T>(g.edges, args.q.heads, args.dropout, nullptr);
    views = {cpu::typed_view<T>(args.q, q),
             cpu::typed_view<T>(args.k, k),
             cpu::typed_view<T>(args.v, v),
             cpu::typed_view<T>(args.r, r),
             cpu::typed_view<T>(args.a, a),
             args.dropout.p > 0 ? keep.view() : cpu::typed_view<T>(args.keep, keep)};
  }
  typed_operands(const typed_operands&) = delete;  // the views point into the copies
  typed_operands& operator=(const typed_operands&) = delete;
};

// The CPU engine in T (float, or double for float64 operands).
template <class T>
void cpu_forward(const multigraph_view& g, const edge_attention_args& a) {
  const std::int64_t features = check_cpu_inputs(g, a.q, a.k, a.v, a.r, a.a), heads = a.q.heads;
  check_cpu_view(a.out, "out", g.rows, heads, a.q.dim);
  check_cpu_view(a.lse, "lse", g.rows, heads, 1);
  if (features > 0) check_cpu_view(a.out_edge, "out_edge", g.rows, heads, features);
  check_cpu_keep(g, a.keep, a.dropout, heads);
  const typed_operands<T> x(g, a);
  host_tensor os, es, ls;
  const tensor_view out = cpu::typed_view<T>(a.out, os, false),
                    out_edge =
                        features > 0 ? cpu::typed_view<T>(a.out_edge, es, false) : tensor_view{},
                    lse = cpu::typed_view<T>(a.lse, ls, false);
  cpu::edge_attention_forward<T>(g, x.views, static_cast<T>(a.scale), out, out_edge, lse);
  cpu::store_view<T>(out, a.out);
  if (features > 0) cpu::store_view<T>(out_edge, a.out_edge);
  cpu::store_view<T>(lse, a.lse);
}

// The backward reads the forward's lse in fp32 and recomputes it in float64.
template <class T>
void cpu_backward(const multigraph_view& g, const edge_attention_grad_args& a,
                  workspace_view workspace) {
  const std::int64_t features = check_cpu_inputs(g, a.q, a.k, a.v, a.r, a.a), heads = a.q.heads,
                     dim = a.q.dim;
  check_backward_side(g);
  check_cpu_view(a.lse, "lse", g.rows, heads, 1);
  check_cpu_view(a.dout, "dout", g.rows, heads, dim);
  check_cpu_view(a.dq, "dq", g.rows, heads, dim);
  check_cpu_view(a.dk, "dk", g.cols, heads, dim);
  check_cpu_view(a.dv, "dv", g.cols, heads, dim);
  if (features > 0) {
    check_cpu_view(a.dout_edge, "dout_edge", g.rows, heads, features);
    check_cpu_view(a.dr, "dr", g.rows, heads, features);
    check_cpu_view(a.da, "da", g.edges, 1, features);
  }
  check_cpu_keep(g, a.keep, a.dropout, heads);
  T* const scratch = cpu_scratch<T>(g, heads, workspace, "edge_attention");
  const typed_operands<T> x(g, a);
  host_tensor ls, gs, ges, dqs, dks, dvs, drs, das;
  const bool given_lse = std::is_same_v<T, float>;
  const tensor_view lse = given_lse ? cpu::typed_view<T>(a.lse, ls) : tensor_view{},
                    dout = cpu::typed_view<T>(a.dout, gs),
                    dout_edge = features > 0 ? cpu::typed_view<T>(a.dout_edge, ges) : tensor_view{},
                    dq = cpu::typed_view<T>(a.dq, dqs, false),
                    dk = cpu::typed_view<T>(a.dk, dks, false),
                    dv = cpu::typed_view<T>(a.dv, dvs, false),
                    dr = features > 0 ? cpu::typed_view<T>(a.dr, drs, false) : tensor_view{},
                    da = features > 0 ? cpu::typed_view<T>(a.da, das, false) : tensor_view{};
  cpu::edge_attention_backward<T>(g, x.views, static_cast<T>(a.scale), lse, dout, dout_edge, dq, dk,
                                  dv, dr, da, scratch);
  for (const auto& [from, to] :
       {std::pair{dq, a.dq}, {dk, a.dk}, {dv, a.dv}, {dr, a.dr}, {da, a.da}})
    if (from.data != nullptr) cpu::store_view<T>(from, to);
}

// GAT's operands as views of T, as typed_operands.
template <class T>
struct typed_gat_operands {
  host_tensor x, a_src, a_dst, a_edge, keep;
  cpu::gat_operands views;

  template <class Args>
  typed_gat_operands(const multigraph_view& g, const Args& args) {
    if (args.dropout.p > 0)
      keep = cpu::drawn_edge_keep<T>(g.edges, args.x.heads, args.dropout, nullptr);
    views = {cpu::typed_view<T>(args.x, x), cpu::typed_view<T>(args.a_src, a_src),
             cpu::typed_view<T>(args.a_dst, a_dst), cpu::typed_view<T>(args.a_edge, a_edge),
             args.dropout.p > 0 ? keep.view() : cpu::typed_view<T>(args.keep, keep)};
  }
  typed_gat_operands(const typed_gat_operands&) = delete;  // the views point into the copies
  typed_gat_operands& operator=(const typed_gat_operands&) = delete;
};

// GAT's operands on the host: x, its terms and the keep factors.
void check_cpu_gat(const multigraph_view& g, const tensor_view& x, const tensor_view& a_src,
                   const tensor_view& a_dst, const tensor_view& a_edge, const tensor_view& keep,
                   const attention_dropout& dropout, double negative_slope) {
  check_cpu_view(x, "x", g.cols, -1, -1);
  check_cpu_view(a_src, "a_src", g.cols, x.heads, 1);
  check_cpu_view(a_dst, "a_dst", g.rows, x.heads, 1);
  if (a_edge.data != nullptr) check_cpu_view(a_edge, "a_edge", g.edges, x.heads, 1);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(negative_slope), "negative_slope must be finite");
  check_cpu_keep(g, keep, dropout, x.heads);
}

template <class T>
void cpu_gat_forward(const multigraph_view& g, const edge_gat_args& a) {
  check_cpu_gat(g, a.x, a.a_src, a.a_dst, a.a_edge, a.keep, a.dropout, a.negative_slope);
  check_cpu_view(a.out, "out", g.rows, a.x.heads, a.x.dim);
  check_cpu_view(a.lse, "lse", g.rows, a.x.heads, 1);
  const typed_gat_operands<T> x(g, a);
  host_tensor os, ls;
  const tensor_view out = cpu::typed_view<T>(a.out, os, false),
                    lse = cpu::typed_view<T>(a.lse, ls, false);
  cpu::edge_gat_forward<T>(g, x.views, static_cast<T>(a.negative_slope), out, lse);
  cpu::store_view<T>(out, a.out);
  cpu::store_view<T>(lse, a.lse);
}

template <class T>
void cpu_gat_backward(const multigraph_view& g, const edge_gat_grad_args& a,
                      workspace_view workspace) {
  check_cpu_gat(g, a.x, a.a_src, a.a_dst, a.a_edge, a.keep, a.dropout, a.negative_slope);
  check_backward_side(g);
  const std::int64_t heads = a.x.heads;
  check_cpu_view(a.lse, "lse", g.rows, heads, 1);
  check_cpu_view(a.dout, "dout", g.rows, heads, a.x.dim);
  check_cpu_view(a.dx, "dx", g.cols, heads, a.x.dim);
  check_cpu_view(a.da_src, "da_src", g.cols, heads, 1);
  check_cpu_view(a.da_dst, "da_dst", g.rows, heads, 1);
  const bool edge_term = a.a_edge.data != nullptr;
  if (edge_term) check_cpu_view(a.da_edge, "da_edge", g.edges, heads, 1);
  T* const scratch = cpu_scratch<T>(g, heads, workspace, "GAT");
  const typed_gat_operands<T> x(g, a);
  host_tensor ls, gs, dxs, dss, dds, des;
  const tensor_view lse = std::is_same_v<T, float> ? cpu::typed_view<T>(a.lse, ls) : tensor_view{},
                    dout = cpu::typed_view<T>(a.dout, gs),
                    dx = cpu::typed_view<T>(a.dx, dxs, false),
                    da_src = cpu::typed_view<T>(a.da_src, dss, false),
                    da_dst = cpu::typed_view<T>(a.da_dst, dds, false),
                    da_edge = edge_term ? cpu::typed_view<T>(a.da_edge, des, false) : tensor_view{};
  cpu::edge_gat_backward<T>(g, x.views, static_cast<T>(a.negative_slope), lse, dout, dx, da_src,
                            da_dst, da_edge, scratch);
  for (const auto& [from, to] :
       {std::pair{dx, a.dx}, {da_src, a.da_src}, {da_dst, a.da_dst}, {da_edge, a.da_edge}})
    if (from.data != nullptr) cpu::store_view<T>(from, to);
}
}  // namespace

edge_attention_plan edge_attention_plan::build(const multigraph_view& g) {
  TRISPARSE_EXPECTS_INPUT(g.rows >= 0 && g.cols >= 0 && g.edges >= 0,
                          "the multigraph's sizes must be non-negative");
  TRISPARSE_EXPECTS_INPUT(g.rows < (std::int64_t{1} << 31) && g.cols < (std::int64_t{1} << 31),
                          "node ids are 32-bit: rows and cols must be below 2^31");
  TRISPARSE_EXPECTS_INPUT(g.row_ptr != nullptr && (g.edges == 0 || g.src != nullptr),
                          "the multigraph needs row_ptr and src");
  TRISPARSE_EXPECTS_INPUT(
      g.col_ptr != nullptr ? g.edges == 0 || (g.dst != nullptr && g.by_source != nullptr)
                           : g.dst == nullptr && g.by_source == nullptr && g.heavy_col_count == 0,
      "the multigraph's col_ptr, dst and by_source come together (all, or none for a "
      "forward-only plan)");
  TRISPARSE_EXPECTS_INPUT(
      g.heavy >= 0 && g.heavy_row_count >= 0 && g.heavy_col_count >= 0 &&
          (g.heavy_row_count == 0 || g.heavy_rows != nullptr) &&
          (g.heavy_col_count == 0 || g.heavy_cols != nullptr) &&
          (g.heavy > 0 || (g.heavy_row_count == 0 && g.heavy_col_count == 0)),
      "the multigraph's heavy lists need their arrays, and a degree above which lines are listed");
  edge_attention_plan plan;
  plan.graph_ = g;
  return plan;
}

bool edge_attention_plan::supports(std::int64_t head_dim) {
  return cuda::edge_attention_group(head_dim) > 0;
}

std::int64_t edge_attention_plan::feature_width(std::int64_t head_dim, std::int64_t features) {
  const std::int64_t lanes = cuda::edge_attention_group(head_dim);
  TRISPARSE_EXPECTS_INPUT(lanes > 0,
                          "edge_attention takes heads of 4 * 2^k <= 128 or 256 "
                          "channels, not " +
                              std::to_string(head_dim));
  TRISPARSE_EXPECTS_INPUT(features >= 0, "features must be non-negative");
  if (features == 0) return 0;
  std::int64_t per_lane = 1;  // 1, 2, 4 or 8 features a lane
  while (per_lane * lanes < features) per_lane *= 2;
  TRISPARSE_EXPECTS_INPUT(per_lane <= 8, "edge_attention takes at most " +
                                             std::to_string(8 * lanes) +
                                             " edge features beside heads of " +
                                             std::to_string(head_dim) + " channels");
  return per_lane * lanes;
}

std::size_t edge_attention_plan::backward_workspace_bytes(std::int64_t heads, dtype grads) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 1, "edge_attention needs heads >= 1");
  // The CPU engine keeps fp32 or (float64 operands) float64 values; the kernels round to 16-bit
  // gradients.
  const std::size_t bytes = graph_.where == device_kind::cpu              ? sizeof(double)
                            : grads == dtype::f16 || grads == dtype::bf16 ? 2
                                                                          : sizeof(float);
  return static_cast<std::size_t>(graph_.edges * heads * 2) * bytes;
}

void edge_attention_plan::forward(const edge_attention_args& a, stream_ref stream) const {
  const multigraph_view& g = graph_;
  if (g.where == device_kind::cpu) {
    cpu::in_type_of(a.q.type, [&]<class T>() { cpu_forward<T>(g, a); });
    return;
  }
  const shapes s = check_inputs(g, a.q, a.k, a.v, a.r, a.a);
  check_view(a.out, "out", g.rows, s.heads, s.dim);
  detail::check_device_arg(a.out, "out");
  TRISPARSE_EXPECTS_INPUT(a.out.type == a.q.type, "out must have q's dtype");
  check_f32(a.lse, "lse", g.rows, s.heads, 1);
  if (s.features > 0)
    check_f32_or_operand(a.out_edge, "out_edge", g.rows, s.heads, s.features, a.q.type);
  check_keep(g, a.keep, a.dropout, s.heads);
  cuda::edge_attention_forward(g, a, stream);
}

void edge_attention_plan::backward(const edge_attention_grad_args& a, stream_ref stream,
                                   workspace_view workspace) const {
  const multigraph_view& g = graph_;
  if (g.where == device_kind::cpu) {
    cpu::in_type_of(a.q.type, [&]<class T>() { cpu_backward<T>(g, a, workspace); });
    return;
  }
  const shapes s = check_inputs(g, a.q, a.k, a.v, a.r, a.a);
  for (const tensor_view* t : {&a.out, &a.dout}) {
    check_view(*t, "out and dout", g.rows, s.heads, s.dim);
    detail::check_device_arg(*t, "out and dout");
    TRISPARSE_EXPECTS_INPUT(t->type == a.q.type, "out and dout must have q's dtype");
    check_aligned(*t, "out and dout", s.dim / cuda::edge_attention_group(s.dim));
  }
  check_f32(a.lse, "lse", g.rows, s.heads, 1);
  check_backward_side(g);
  check_f32_or_operand(a.dq, "dq", g.rows, s.heads, s.dim, a.q.type);
  check_f32_or_operand(a.dk, "dk", g.cols, s.heads, s.dim, a.q.type);
  check_f32_or_operand(a.dv, "dv", g.cols, s.heads, s.dim, a.q.type);
  TRISPARSE_EXPECTS_INPUT(a.dk.type == a.dq.type && a.dv.type == a.dq.type,
                          "dq, dk and dv must have one dtype");
  check_keep(g, a.keep, a.dropout, s.heads);
  if (s.features > 0) {
    check_f32_or_operand(a.out_edge, "out_edge", g.rows, s.heads, s.features, a.q.type);
    check_f32_or_operand(a.dout_edge, "dout_edge", g.rows, s.heads, s.features, a.q.type);
    TRISPARSE_EXPECTS_INPUT(a.dout_edge.type == a.out_edge.type,
                            "dout_edge must have out_edge's dtype; got " + a.dout_edge.describe() +
                                " beside " + a.out_edge.describe());
    check_f32_or_operand(a.dr, "dr", g.rows, s.heads, s.features, a.q.type);
    check_f32_or_operand(a.da, "da", g.edges, 1, s.features, a.q.type);
    TRISPARSE_EXPECTS_INPUT(a.dr.type == a.dq.type && a.da.type == a.dq.type,
                            "dr and da must have dq's dtype");
    const std::int64_t lanes = cuda::edge_attention_group(s.dim);
    check_aligned(a.out_edge, "out_edge", s.features / lanes);
    check_aligned(a.dout_edge, "dout_edge", s.features / lanes);
  }
  const std::size_t need = backward_workspace_bytes(s.heads, a.dq.type);
  TRISPARSE_EXPECTS_INPUT(workspace.bytes >= need && (workspace.data != nullptr || g.edges == 0),
                          "edge_attention's backward needs backward_workspace_bytes(" +
                              std::to_string(s.heads) + ", dq's dtype) = " + std::to_string(need) +
                              " bytes of workspace");
  cuda::edge_attention_backward(g, a, workspace, stream);
}

void edge_attention_plan::neighbor_sum(const tensor_view& x, const tensor_view& out,
                                       bool transposed, stream_ref stream) const {
  const multigraph_view& g = graph_;
  const std::int64_t in_rows = transposed ? g.rows : g.cols,
                     out_rows = transposed ? g.cols : g.rows;
  check_node_operand(x, "x", in_rows, "neighbor_sum");
  check_f32_or_operand(out, "out", out_rows, x.heads, x.dim, x.type);
  if (transposed) check_backward_side(g);
  cuda::edge_neighbor_sum(g, x, out, transposed, stream);
}

namespace {

// x and the per-node and per-edge score terms of GAT's attention.
void check_gat(const multigraph_view& g, const tensor_view& x, const tensor_view& a_src,
               const tensor_view& a_dst, const tensor_view& a_edge) {
  check_node_operand(x, "x", g.cols, "edge_attention");
  check_f32(a_src, "a_src", g.cols, x.heads, 1);
  check_f32(a_dst, "a_dst", g.rows, x.heads, 1);
  if (a_edge.data != nullptr) check_f32(a_edge, "a_edge", g.edges, x.heads, 1);
}

}  // namespace

void edge_attention_plan::gat_forward(const edge_gat_args& a, stream_ref stream) const {
  const multigraph_view& g = graph_;
  if (g.where == device_kind::cpu) {
    cpu::in_type_of(a.x.type, [&]<class T>() { cpu_gat_forward<T>(g, a); });
    return;
  }
  check_gat(g, a.x, a.a_src, a.a_dst, a.a_edge);
  check_view(a.out, "out", g.rows, a.x.heads, a.x.dim);
  detail::check_device_arg(a.out, "out");
  TRISPARSE_EXPECTS_INPUT(a.out.type == a.x.type, "out must have x's dtype");
  check_f32(a.lse, "lse", g.rows, a.x.heads, 1);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(a.negative_slope), "negative_slope must be finite");
  check_keep(g, a.keep, a.dropout, a.x.heads);
  cuda::edge_gat_forward(g, a, stream);
}

void edge_attention_plan::gat_backward(const edge_gat_grad_args& a, stream_ref stream,
                                       workspace_view workspace) const {
  const multigraph_view& g = graph_;
  if (g.where == device_kind::cpu) {
    cpu::in_type_of(a.x.type, [&]<class T>() { cpu_gat_backward<T>(g, a, workspace); });
    return;
  }
  check_gat(g, a.x, a.a_src, a.a_dst, a.a_edge);
  const std::int64_t lanes = cuda::edge_attention_group(a.x.dim);
  for (const tensor_view* t : {&a.out, &a.dout}) {
    check_view(*t, "out and dout", g.rows, a.x.heads, a.x.dim);
    detail::check_device_arg(*t, "out and dout");
    TRISPARSE_EXPECTS_INPUT(t->type == a.x.type, "out and dout must have x's dtype");
    check_aligned(*t, "out and dout", a.x.dim / lanes);
  }
  check_f32(a.lse, "lse", g.rows, a.x.heads, 1);
  check_backward_side(g);
  check_f32_or_operand(a.dx, "dx", g.cols, a.x.heads, a.x.dim, a.x.type);
  check_f32(a.da_src, "da_src", g.cols, a.x.heads, 1);
  check_f32(a.da_dst, "da_dst", g.rows, a.x.heads, 1);
  if (a.a_edge.data != nullptr) check_f32(a.da_edge, "da_edge", g.edges, a.x.heads, 1);
  check_keep(g, a.keep, a.dropout, a.x.heads);
  TRISPARSE_EXPECTS_INPUT(workspace.bytes >= backward_workspace_bytes(a.x.heads) &&
                              (workspace.data != nullptr || g.edges == 0),
                          "GAT's backward needs backward_workspace_bytes(" +
                              std::to_string(a.x.heads) + ") bytes of workspace");
  cuda::edge_gat_backward(g, a, workspace, stream);
}

}  // namespace trisparse
