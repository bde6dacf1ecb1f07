// The GCN layer (gcn_layer): Â x W as GEMM and SpMM in the order the tuning file picks;
// gcn_normalized.
#include "trisparse/ops/layers.hpp"

#include <cmath>
#include <vector>

#include "../../cpu/layers/f32.hpp"
#include "../../cpu/layers/gcn.hpp"
#include "../../cuda/layers/dense.hpp"
#include "common.hpp"

namespace trisparse {

using detail::check_device_arg;
using detail::check_host;
using detail::layer_core;
using detail::with_self_loops;

csr_graph gcn_normalized(const csr_graph& graph, bool add_self_loops) {
  csr_graph a = with_self_loops(graph, add_self_loops);
  std::vector<double> inv_sqrt(static_cast<std::size_t>(a.rows), 0.0);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    if (a.degree(r) > 0) inv_sqrt[r] = 1.0 / std::sqrt(static_cast<double>(a.degree(r)));
  }
  a.values.resize(a.col_idx.size());
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e)
      a.values[e] = static_cast<float>(inv_sqrt[r] * inv_sqrt[a.col_idx[e]]);
  }
  return a;
}

namespace {

// cuBLAS's workspace, the intermediate (x w or Â x, at most 4-byte elements), the SpMM's.
struct gcn_workspace {
  detail::workspace_layout layout;
  std::size_t blas = 0, between = 0, sparse = 0;
};

gcn_workspace gcn_workspace_of(const sparse_plan& p, std::int64_t rows, std::int64_t in_dim,
                               std::int64_t out_dim) {
  const std::int64_t narrow = std::min(in_dim, out_dim);
  gcn_workspace w;
  w.blas = w.layout.add(cuda::kGemmWorkspaceBytes);
  w.between = w.layout.add(static_cast<std::size_t>(rows * narrow) * 4);
  w.sparse = w.layout.add(p.workspace_bytes(1, narrow));
  return w;
}

}  // namespace

struct gcn_layer::state : layer_core {
  using layer_core::layer_core;
};

gcn_layer gcn_layer::build(const csr_graph& graph, device_kind where, const layer_options& options,
                           stream_ref stream) {
  gcn_layer layer;
  layer.state_ =
      std::make_shared<state>(gcn_normalized(graph, options.add_self_loops), where, options, stream,
                              [](const sparse_plan& p, std::int64_t rows, std::int64_t dim) {
                                return gcn_workspace_of(p, rows, dim, dim).layout.bytes();
                              });
  return layer;
}

device_kind gcn_layer::where() const { return state_->where; }
std::int64_t gcn_layer::nnz() const { return state_->nnz; }

std::size_t gcn_layer::workspace_bytes(std::int64_t in_dim, std::int64_t out_dim) const {
  TRISPARSE_EXPECTS_INPUT(in_dim >= 0 && out_dim >= 0, "workspace_bytes: dims must be >= 0");
  const state& s = *state_;
  return s.plan ? gcn_workspace_of(*s.plan, s.rows, in_dim, out_dim).layout.bytes() : 0;
}

void gcn_layer::forward(const tensor_view& x, const tensor_view& w, const tensor_view& out,
                        stream_ref stream, workspace_view workspace) const {
  const state& s = *state_;
  check_view(x, "x", s.rows, 1, -1);
  check_view(w, "w", x.dim, 1, -1);
  check_view(out, "out", s.rows, 1, w.dim);
  if (s.where == device_kind::cpu) {
    for (const auto& [t, what] : {std::pair{&x, "x"}, std::pair{&w, "w"}, std::pair{&out, "out"}})
      check_host(*t, what);
    // The CPU engine (cpu/layers/gcn.hpp) in float64 for float64 inputs, else in fp32 (other
    // dtypes through fp32 copies).
    const auto run = [&]<class T>() {
      host_tensor xs, ws, os;
      const tensor_view o = cpu::typed_view<T>(out, os, false);
      cpu::gcn_forward<T>(s.pattern, cpu::typed_view<T>(x, xs), cpu::typed_view<T>(w, ws), {},
                          false, o, nullptr, {});
      cpu::store_view<T>(o, out);
    };
    cpu::in_type_of(x.type, run);
    return;
  }
  for (const auto& [t, what] : {std::pair{&x, "x"}, std::pair{&w, "w"}, std::pair{&out, "out"}})
    check_device_arg(*t, what);
  TRISPARSE_EXPECTS_INPUT(x.type == w.type,
                          "x " + x.describe() + " and w " + w.describe() + " need one dtype");
  TRISPARSE_EXPECTS_INPUT(out.type == dtype::f32 || out.type == x.type,
                          "out " + out.describe() + " must be f32 or x's dtype");
  const gcn_workspace g = gcn_workspace_of(*s.plan, s.rows, x.dim, w.dim);
  const workspace_view ws = s.use(g.layout, workspace, "GCN layer");
  const workspace_view blas{detail::workspace_layout::at<void>(ws, g.blas),
                            cuda::kGemmWorkspaceBytes};
  const workspace_view sparse{detail::workspace_layout::at<void>(ws, g.sparse),
                              g.layout.bytes() - g.sparse};
  // The narrower intermediate: x w, then Â (x w); or (Â x) w.
  const tensor_view between =
      detail::segment_view(ws, g.between, x.type, s.rows, 1, std::min(x.dim, w.dim), x.device_id);
  if (w.dim <= x.dim) {
    cuda::gemm(x, w, between, blas, stream);
    s.plan->spmm({}, between, out, stream, sparse);
  } else {
    s.plan->spmm({}, x, between, stream, sparse);
    cuda::gemm(between, w, out, blas, stream);
  }
}

}  // namespace trisparse
