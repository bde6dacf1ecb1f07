#include "trisparse/ops/layers.hpp"

#include <cmath>
#include <mutex>
#include <optional>
#include <string>

#include "../cuda/layers/dense.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/reference.hpp"
#include "trisparse/ops/sparse.hpp"
#include "workspace.hpp"

namespace trisparse {

namespace {

// The binary pattern of a square graph with (i, i) in every row when `add_self_loops`.
csr_graph with_self_loops(const csr_graph& g, bool add_self_loops) {
  g.check();
  TRISPARSE_EXPECTS_INPUT(g.rows == g.cols, "a GNN layer needs a square graph; this one is " +
                                                std::to_string(g.rows) + " x " +
                                                std::to_string(g.cols));
  csr_graph a;
  a.rows = a.cols = g.rows;
  a.row_ptr.assign(1, 0);
  a.row_ptr.reserve(g.row_ptr.size());
  a.col_idx.reserve(g.col_idx.size() + (add_self_loops ? g.col_idx.size() : 0));
  for (std::int64_t r = 0; r < g.rows; ++r) {
    bool placed = !add_self_loops;
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) {
      const std::int32_t c = g.col_idx[e];
      if (!placed && c >= r) {  // columns are sorted: the loop goes before the first c >= r
        if (c != r) a.col_idx.push_back(static_cast<std::int32_t>(r));
        placed = true;
      }
      a.col_idx.push_back(c);
    }
    if (!placed) a.col_idx.push_back(static_cast<std::int32_t>(r));
    a.row_ptr.push_back(a.nnz());
  }
  return a;
}

void check_host(const tensor_view& t, const char* what) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cpu,
                          std::string(what) + " " + t.describe() + " must be on the CPU");
}

void check_device_arg(const tensor_view& t, const char* what) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cuda,
                          std::string(what) + " " + t.describe() + " must be on the GPU");
}

// c = a b in float64 on the CPU: a [m, 1, k], b [k, 1, n], c [m, 1, n].
void host_gemm(const tensor_view& a, const tensor_view& b, const tensor_view& c) {
  const std::int64_t m = a.rows, k = a.dim, n = b.dim;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (std::int64_t l = 0; l < k; ++l)
        sum += load_as_double(a.data, a.type, a.offset(i, 0, l)) *
               load_as_double(b.data, b.type, b.offset(l, 0, j));
      store_from_double(c.data, c.type, c.offset(i, 0, j), sum);
    }
  }
}

}  // namespace

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

// --- GCN ------------------------------------------------------------------------------------

struct gcn_layer::state {
  device_kind where = device_kind::cpu;
  csr_graph propagation;            // Â (CPU layers)
  std::optional<sparse_plan> plan;  // Â (CUDA layers)
  std::shared_ptr<cuda::blas_handle> blas;
  std::int64_t rows = 0, nnz = 0;
  mutable std::mutex mutex;
  mutable device_tensor between;  // x w or Â x
};

gcn_layer gcn_layer::build(const csr_graph& graph, device_kind where, const layer_options& options,
                           stream_ref stream) {
  auto s = std::make_shared<state>();
  s->where = where;
  csr_graph a = gcn_normalized(graph, options.add_self_loops);
  s->rows = a.rows;
  s->nnz = a.nnz();
  if (where == device_kind::cuda) {
    s->plan = sparse_plan::build(a, where, {.order = options.order}, stream);
    s->blas = cuda::make_blas();
  } else {
    s->propagation = std::move(a);
  }
  gcn_layer layer;
  layer.state_ = std::move(s);
  return layer;
}

device_kind gcn_layer::where() const { return state_->where; }
std::int64_t gcn_layer::nnz() const { return state_->nnz; }

void gcn_layer::forward(const tensor_view& x, const tensor_view& w, const tensor_view& out,
                        stream_ref stream) const {
  const state& s = *state_;
  check_view(x, "x", s.rows, 1, -1);
  check_view(w, "w", x.dim, 1, -1);
  check_view(out, "out", s.rows, 1, w.dim);
  if (s.where == device_kind::cpu) {
    for (const auto& [t, what] : {std::pair{&x, "x"}, std::pair{&w, "w"}, std::pair{&out, "out"}})
      check_host(*t, what);
    host_tensor xw(dtype::f64, s.rows, 1, w.dim);
    host_gemm(x, w, xw.view());
    reference::spmm(s.propagation, {}, xw.view(), out);
    return;
  }
  for (const auto& [t, what] : {std::pair{&x, "x"}, std::pair{&w, "w"}, std::pair{&out, "out"}})
    check_device_arg(*t, what);
  TRISPARSE_EXPECTS_INPUT(x.type == w.type,
                          "x " + x.describe() + " and w " + w.describe() + " need one dtype");
  TRISPARSE_EXPECTS_INPUT(out.type == dtype::f32 || out.type == x.type,
                          "out " + out.describe() + " must be f32 or x's dtype");
  std::lock_guard<std::mutex> lock(s.mutex);
  if (w.dim <= x.dim) {  // the narrower intermediate: x w, then Â (x w)
    const tensor_view xw = detail::workspace(s.between, x.type, s.rows, 1, w.dim);
    cuda::gemm(*s.blas, x, w, xw, stream);
    s.plan->spmm({}, xw, out, stream);
  } else {  // (Â x) w
    const tensor_view ax = detail::workspace(s.between, x.type, s.rows, 1, x.dim);
    s.plan->spmm({}, x, ax, stream);
    cuda::gemm(*s.blas, ax, w, out, stream);
  }
}

// --- AGNN -----------------------------------------------------------------------------------

struct agnn_layer::state {
  device_kind where = device_kind::cpu;
  csr_graph pattern;                // CPU layers
  std::optional<sparse_plan> plan;  // CUDA layers
  std::int64_t rows = 0, nnz = 0;
  mutable std::mutex mutex;
  mutable device_tensor unit, scores, probs;  // h / |h|, β cos, softmax
};

agnn_layer agnn_layer::build(const csr_graph& graph, device_kind where,
                             const layer_options& options, stream_ref stream) {
  auto s = std::make_shared<state>();
  s->where = where;
  csr_graph a = with_self_loops(graph, options.add_self_loops);
  s->rows = a.rows;
  s->nnz = a.nnz();
  if (where == device_kind::cuda) {
    s->plan = sparse_plan::build(a, where, {.order = options.order}, stream);
  } else {
    s->pattern = std::move(a);
  }
  agnn_layer layer;
  layer.state_ = std::move(s);
  return layer;
}

device_kind agnn_layer::where() const { return state_->where; }
std::int64_t agnn_layer::nnz() const { return state_->nnz; }

void agnn_layer::forward(const tensor_view& h, double beta, const tensor_view& out,
                         stream_ref stream) const {
  const state& s = *state_;
  check_view(h, "h", s.rows, 1, -1);
  check_view(out, "out", s.rows, 1, h.dim);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(beta), "AGNN's beta must be finite");
  if (s.where == device_kind::cpu) {
    check_host(h, "h");
    check_host(out, "out");
    host_tensor unit(dtype::f64, s.rows, 1, h.dim);
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
    host_tensor scores(dtype::f64, s.pattern.nnz(), 1, 1), probs(dtype::f64, s.pattern.nnz(), 1, 1);
    reference::sddmm(s.pattern, unit.view(), unit.view(), scores.view(), beta);
    reference::softmax(s.pattern, scores.view(), probs.view());
    reference::spmm(s.pattern, probs.view(), h, out);
    return;
  }
  check_device_arg(h, "h");
  check_device_arg(out, "out");
  TRISPARSE_EXPECTS_INPUT(out.type == dtype::f32 || out.type == h.type,
                          "out " + out.describe() + " must be f32 or h's dtype");
  const sparse_plan& p = *s.plan;
  std::lock_guard<std::mutex> lock(s.mutex);
  const tensor_view unit = detail::workspace(s.unit, h.type, s.rows, 1, h.dim);
  const tensor_view scores = detail::slot_workspace(s.scores, dtype::f32, p.slots(), 1);
  const tensor_view probs =
      h.type == dtype::f32 ? scores : detail::slot_workspace(s.probs, h.type, p.slots(), 1);
  cuda::normalize_rows(h, unit, stream);
  p.sddmm(unit, unit, scores, beta, stream);
  p.softmax(scores, probs, stream);
  p.spmm(probs, h, out, stream);
}

}  // namespace trisparse
