// The AGNN layer (agnn_layer): cosine scores, their softmax and the aggregation over A + I.
#include "trisparse/ops/layers.hpp"

#include "../../cpu/sparse/kernels.hpp"
#include "../../cuda/layers/dense.hpp"

#include "common.hpp"

namespace trisparse {

using detail::check_device_arg;
using detail::check_host;
using detail::layer_core;
using detail::with_self_loops;

namespace {

// plan's segments.
struct agnn_workspace {
  detail::workspace_layout layout;
  std::size_t unit = 0, scores = 0, probs = 0, sparse = 0;
};

agnn_workspace agnn_workspace_of(const sparse_plan& p, std::int64_t rows, std::int64_t dim) {
  agnn_workspace w;
  const auto slots = static_cast<std::size_t>(std::max<std::int64_t>(p.slots(), 1));
  w.unit = w.layout.add(static_cast<std::size_t>(rows * dim) * 4);
  w.scores = w.layout.add(slots * 4);
  w.probs = w.layout.add(slots * 2);
  w.sparse = w.layout.add(p.workspace_bytes(1, dim));
  return w;
}

}  // namespace

struct agnn_layer::state : layer_core {
  using layer_core::layer_core;
};

agnn_layer agnn_layer::build(const csr_graph& graph, device_kind where,
                             const layer_options& options, stream_ref stream) {
  agnn_layer layer;
  layer.state_ = std::make_shared<state>(
      with_self_loops(graph, options.add_self_loops), where, options, stream,
      [](const sparse_plan& p, std::int64_t rows, std::int64_t dim) {
        return agnn_workspace_of(p, rows, dim).layout.bytes();
      });
  return layer;
}

device_kind agnn_layer::where() const { return state_->where; }
std::int64_t agnn_layer::nnz() const { return state_->nnz; }

std::size_t agnn_layer::workspace_bytes(std::int64_t dim) const {
  TRISPARSE_EXPECTS_INPUT(dim >= 0, "workspace_bytes: dim must be >= 0");
  const state& s = *state_;
  return s.plan ? agnn_workspace_of(*s.plan, s.rows, dim).layout.bytes() : 0;
}

void agnn_layer::forward(const tensor_view& h, double beta, const tensor_view& out,
                         stream_ref stream, workspace_view workspace) const {
  const state& s = *state_;
  check_view(h, "h", s.rows, 1, -1);
  check_view(out, "out", s.rows, 1, h.dim);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(beta), "AGNN's beta must be finite");
  if (s.where == device_kind::cpu) {
    check_host(h, "h");
    check_host(out, "out");
    // The CPU kernels (cpu/sparse/kernels.hpp; float64 for float64 h, else float32): unit rows,
    // their cosines, the softmax, the SpMM.
    const dtype t = h.type == dtype::f64 ? dtype::f64 : dtype::f32;
    host_tensor unit(t, s.rows, 1, h.dim);
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < s.rows; ++i) {
      double sum = 0;
      for (std::int64_t f = 0; f < h.dim; ++f) {
        const double v = load_as_double(h.data, h.type, h.offset(i, 0, f));
        sum += v * v;
      }
      const double inv = sum > 0 ? 1.0 / std::sqrt(sum) : 0.0;
      for (std::int64_t f = 0; f < h.dim; ++f)
        unit.set(i * h.dim + f, load_as_double(h.data, h.type, h.offset(i, 0, f)) * inv);
    }
    host_tensor scores(t, s.pattern.nnz(), 1, 1), probs(t, s.pattern.nnz(), 1, 1);
    cpu::sddmm(s.pattern, unit.view(), unit.view(), scores.view(), beta);
    cpu::softmax(s.pattern, scores.view(), probs.view());
    cpu::spmm(s.pattern, probs.view(), h, out);
    return;
  }
  check_device_arg(h, "h");
  check_device_arg(out, "out");
  TRISPARSE_EXPECTS_INPUT(out.type == dtype::f32 || out.type == h.type,
                          "out " + out.describe() + " must be f32 or h's dtype");
  const sparse_plan& p = *s.plan;
  const agnn_workspace a = agnn_workspace_of(p, s.rows, h.dim);
  const workspace_view ws = s.use(a.layout, workspace, "AGNN layer");
  const workspace_view sparse{detail::workspace_layout::at<void>(ws, a.sparse),
                              a.layout.bytes() - a.sparse};
  const tensor_view unit = detail::segment_view(ws, a.unit, h.type, s.rows, 1, h.dim, h.device_id);
  const tensor_view scores = detail::slot_view(ws, a.scores, dtype::f32, p.slots(), 1, h.device_id);
  const tensor_view probs = h.type == dtype::f32
                                ? scores
                                : detail::slot_view(ws, a.probs, h.type, p.slots(), 1, h.device_id);
  cuda::normalize_rows(h, unit, stream);
  p.sddmm(unit, unit, scores, beta, stream);
  p.softmax(scores, probs, stream, sparse);
  p.spmm(probs, h, out, stream, sparse);
}

}  // namespace trisparse
