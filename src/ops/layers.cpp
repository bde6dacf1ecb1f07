#include "trisparse/ops/layers.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <optional>
#include <span>
#include <string>

#include "../common/workspace_layout.hpp"
#include "../cpu/layers/f32.hpp"
#include "../cpu/layers/gat.hpp"
#include "../cpu/layers/gcn.hpp"
#include "../cuda/layers/dense.hpp"
#include "../cuda/layers/gat.hpp"
#include "../cuda/layers/gcn_fused.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/reference.hpp"
#include "trisparse/ops/sparse.hpp"

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

namespace {

// What both layers hold: the pattern (CPU) or its sparse plan (CUDA), and on CUDA the workspace
// of runs not given one, sized at build for `own_dim` wide features.
struct layer_core {
  device_kind where = device_kind::cpu;
  csr_graph pattern;                // CPU layers: Â (GCN) or A + I (AGNN)
  std::optional<sparse_plan> plan;  // CUDA layers
  std::int64_t rows = 0, nnz = 0;
  device_tensor own;
  std::int64_t own_dim = 0;

  // `own_bytes(plan, rows, dim)`: the layer's workspace for features `dim` wide.
  template <class Bytes>
  layer_core(csr_graph a, device_kind w, const layer_options& options, stream_ref stream,
             Bytes&& own_bytes)
      : where(w), rows(a.rows), nnz(a.nnz()) {
    if (where == device_kind::cpu) {
      pattern = std::move(a);
      return;
    }
    plan = sparse_plan::build(
        a, where,
        {.order = options.order, .workspace_heads = 1, .workspace_dim = options.workspace_dim},
        stream);
    own_dim = std::max<std::int64_t>(options.workspace_dim, 1);
    own = device_tensor(dtype::f32,
                        static_cast<std::int64_t>((own_bytes(*plan, rows, own_dim) + 3) / 4), 1, 1);
  }

  // The workspace a run uses: the caller's, checked, or the layer's own, which must hold the
  // run's layout.
  workspace_view use(const detail::workspace_layout& layout, const workspace_view& given,
                     const char* what) const {
    if (!given.empty()) {
      layout.check(given, what);
      return given;
    }
    const tensor_view o = own.view();
    const workspace_view ws{o.data, static_cast<std::size_t>(o.rows) * 4};
    TRISPARSE_EXPECTS_INPUT(layout.bytes() <= ws.bytes,
                            std::string(what) +
                                ": the layer's own workspace serves features up to " +
                                std::to_string(own_dim) +
                                " wide: build it with a larger layer_options.workspace_dim, or "
                                "pass a workspace to forward()");
    return ws;
  }
};

// --- GCN ------------------------------------------------------------------------------------

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

// h / |h|, the scores (f32), the probabilities (16-bit; f32 runs reuse the scores), the sparse
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
    host_tensor xw(dtype::f64, s.rows, 1, w.dim);
    host_gemm(x, w, xw.view());
    reference::spmm(s.pattern, {}, xw.view(), out);
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

// --- fused GCN -------------------------------------------------------------------------------

}  // namespace trisparse

namespace trisparse::cuda {

gcn_fused_host make_gcn_fused_host(const csr_graph& p) {
  gcn_fused_host h;
  h.format = build_bsb(p, 8);
  const bsb& b = h.format;
  const std::int64_t windows = b.windows(), tcbs = b.tcbs();
  h.value_offset.resize(static_cast<std::size_t>(tcbs));
  std::int64_t offset = 0;
  for (std::int64_t t = 0; t < tcbs; ++t) {
    h.value_offset[t] = offset;
    offset += std::popcount(b.bitmap[2 * t]) + std::popcount(b.bitmap[2 * t + 1]);
  }
  h.values.assign(static_cast<std::size_t>(offset), 0.0f);
  // Each entry's place: its column's slot in the window's sorted columns gives the TCB and the
  // bit; the bits below it in the TCB give the index (repeated entries are summed).
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t w = 0; w < windows; ++w) {
    const std::int32_t* cols = b.col_idx.data() + b.tcb_offset[w] * 8;
    const std::int32_t* end = b.col_idx.data() + b.tcb_offset[w + 1] * 8;
    while (end > cols && end[-1] == bsb::kPadColumn) --end;
    for (int r = 0; r < bsb::kRowWindow && w * bsb::kRowWindow + r < p.rows; ++r) {
      const std::int64_t row = w * bsb::kRowWindow + r;
      for (std::int64_t e = p.row_ptr[row]; e < p.row_ptr[row + 1]; ++e) {
        const std::int64_t slot = std::lower_bound(cols, end, p.col_idx[e]) - cols;
        const std::int64_t t = b.tcb_offset[w] + slot / 8;
        const int bit = r * 8 + static_cast<int>(slot % 8);
        const std::uint64_t w0 = b.bitmap[2 * t], w1 = b.bitmap[2 * t + 1];
        const std::int64_t below =
            bit < 64
                ? std::popcount(w0 & ((std::uint64_t{1} << bit) - 1))
                : std::popcount(w0) + std::popcount(w1 & ((std::uint64_t{1} << (bit - 64)) - 1));
        h.values[h.value_offset[t] + below] += p.values[e];
      }
    }
  }
  h.split_first.assign(static_cast<std::size_t>(windows), -1);
  h.split_count.assign(static_cast<std::size_t>(windows), 0);
  for (std::int64_t w = 0; w < windows; ++w) {
    const std::int64_t n = b.window_tcbs(w);
    if (n <= 2 * kGcnChunkTcbs) continue;
    h.split_first[w] = static_cast<std::int32_t>(h.chunks.size());
    for (std::int64_t c = b.tcb_offset[w]; c < b.tcb_offset[w + 1]; c += kGcnChunkTcbs) {
      h.chunks.push_back({static_cast<std::int32_t>(w), static_cast<std::int32_t>(h.chunks.size()),
                          c, std::min(c + kGcnChunkTcbs, b.tcb_offset[w + 1])});
    }
    h.split_count[w] = static_cast<std::int32_t>(h.chunks.size()) - h.split_first[w];
  }
  return h;
}

}  // namespace trisparse::cuda

namespace trisparse {

namespace {

// The unfused order's workspace: cuBLAS's, x w (x's dtype), P (x w) in f32, the SpMM's.
struct gcn_unfused_workspace {
  detail::workspace_layout layout;
  std::size_t blas = 0, xw = 0, z = 0, sparse = 0;
};

gcn_unfused_workspace gcn_unfused_workspace_of(const sparse_plan& p, std::int64_t rows,
                                               std::int64_t out_dim, dtype type) {
  gcn_unfused_workspace w;
  w.blas = w.layout.add(cuda::kGemmWorkspaceBytes);
  w.xw = w.layout.add(static_cast<std::size_t>(rows * out_dim) * size_of(type));
  w.z = w.layout.add(static_cast<std::size_t>(rows * out_dim) * 4);
  w.sparse = w.layout.add(p.workspace_bytes(1, out_dim));
  return w;
}

// The backward's: cuBLAS's, dZ (x's dtype), the product through Pᵀ's operand or result (dZ Wᵀ
// or Pᵀ dZ, x's dtype), dbias's block sums, the SpMM's.
struct gcn_backward_workspace {
  detail::workspace_layout layout;
  std::size_t blas = 0, dz = 0, between = 0, sums = 0, sparse = 0;
};

gcn_backward_workspace gcn_backward_workspace_of(const sparse_plan& transposed, std::int64_t rows,
                                                 std::int64_t in_dim, std::int64_t out_dim,
                                                 dtype type, bool fused) {
  const std::int64_t width = fused ? in_dim : out_dim;
  gcn_backward_workspace w;
  w.blas = w.layout.add(cuda::kGemmWorkspaceBytes);
  w.dz = w.layout.add(static_cast<std::size_t>(rows * out_dim) * size_of(type));
  w.between = w.layout.add(static_cast<std::size_t>(rows * width) * size_of(type));
  w.sums = w.layout.add(cuda::relu_grad_workspace_bytes(rows, out_dim));
  w.sparse = w.layout.add(transposed.workspace_bytes(1, width));
  return w;
}

}  // namespace

struct gcn_fused_plan::state {
  device_kind where = device_kind::cpu;
  std::int64_t rows = 0, nnz = 0;
  csr_graph propagation, propagation_t;                 // CPU: P and its transpose
  std::shared_ptr<const cuda::gcn_fused_device> fused;  // CUDA
  std::optional<sparse_plan> plan;                      // CUDA, the unfused order
  std::optional<sparse_plan> transposed;                // CUDA, the backward's Pᵀ
};

gcn_fused_plan gcn_fused_plan::build(const csr_graph& propagation, device_kind where,
                                     stream_ref stream) {
  propagation.check();
  TRISPARSE_EXPECTS_INPUT(propagation.rows == propagation.cols,
                          "the fused GCN layer needs a square propagation matrix; this one is " +
                              std::to_string(propagation.rows) + " x " +
                              std::to_string(propagation.cols));
  TRISPARSE_EXPECTS_INPUT(propagation.has_values() || propagation.nnz() == 0,
                          "the fused GCN layer needs the propagation matrix's values (e.g. "
                          "gcn_normalized(graph))");
  auto s = std::make_shared<state>();
  s->where = where;
  s->rows = propagation.rows;
  s->nnz = propagation.nnz();
  if (where == device_kind::cpu) {
    s->propagation = propagation;
    s->propagation_t = transpose(propagation);
  } else {
    s->fused = cuda::upload_gcn_fused(cuda::make_gcn_fused_host(propagation), stream);
    s->plan =
        sparse_plan::build(propagation, where, {.workspace_heads = 1, .workspace_dim = 1}, stream);
    s->transposed = sparse_plan::build(transpose(propagation), where,
                                       {.workspace_heads = 1, .workspace_dim = 1}, stream);
  }
  gcn_fused_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

device_kind gcn_fused_plan::where() const { return state_->where; }
std::int64_t gcn_fused_plan::rows() const { return state_->rows; }
std::int64_t gcn_fused_plan::nnz() const { return state_->nnz; }

bool gcn_fused_plan::fused(std::int64_t in_dim, std::int64_t out_dim, dtype type,
                           gcn_order order) const {
  TRISPARSE_EXPECTS_INPUT(in_dim >= 0 && out_dim >= 0, "the GCN layer's dims must be >= 0");
  if (order == gcn_order::unfused) return false;
  const bool fits = state_->where == device_kind::cpu || cuda::gcn_fused_fits(in_dim, type);
  if (order == gcn_order::fused) return fits;
  // Measured (H100, docs/notes/fused_gcn.md): on small graphs the one kernel beats the three of
  // the unfused order (launch-bound) unless P x is much the wider product; on large ones the
  // fused kernel's (P x) pass gathers F_in-wide rows less efficiently than the SpMM does F_out-wide
  // ones, and wins where F_out is at least 8 F_in.
  const bool small = state_->rows <= 8192 && in_dim <= 4 * out_dim;
  return fits && (small || out_dim >= 8 * in_dim);
}

std::size_t gcn_fused_plan::workspace_bytes(std::int64_t in_dim, std::int64_t out_dim, dtype type,
                                            gcn_order order) const {
  const state& s = *state_;
  if (s.where == device_kind::cpu) return 0;
  if (fused(in_dim, out_dim, type, order)) return cuda::gcn_fused_workspace_bytes(*s.fused, in_dim);
  return gcn_unfused_workspace_of(*s.plan, s.rows, out_dim, type).layout.bytes();
}

void gcn_fused_plan::forward(const gcn_fused_args& a, stream_ref stream,
                             workspace_view workspace) const {
  const state& s = *state_;
  check_view(a.x, "x", s.rows, 1, -1);
  check_view(a.w, "w", a.x.dim, 1, -1);
  check_view(a.out, "out", s.rows, 1, a.w.dim);
  const bool fused_order = fused(a.x.dim, a.w.dim, a.x.type, a.order);
  TRISPARSE_EXPECTS_INPUT(a.order != gcn_order::fused || fused_order,
                          "gcn_order::fused: " + std::to_string(a.x.dim) +
                              " features do not fit the fused kernel's shared memory");
  TRISPARSE_EXPECTS_INPUT(a.ax.data == nullptr || fused_order,
                          "ax is written by the fused order only (check fused() first)");
  if (s.where == device_kind::cpu) {
    for (const tensor_view* t : {&a.x, &a.w, &a.out, &a.bias, &a.ax})
      if (t->data != nullptr) check_host(*t, "the fused GCN layer's argument");
    if (a.bias.data != nullptr) check_view(a.bias, "bias", 1, 1, a.w.dim);
    if (a.ax.data != nullptr) check_view(a.ax, "ax", s.rows, 1, a.x.dim);
    if (cpu::all_f32({&a.x, &a.w, &a.bias, &a.out, &a.ax})) {
      cpu::gcn_forward(s.propagation, a.x, a.w, a.bias, a.relu, a.out, a.relu_mask, a.ax);
      return;
    }
    const std::vector<std::uint32_t> mask =
        reference::gcn_fused(s.propagation, a.x, a.w, a.bias, a.relu, a.out);
    if (a.relu_mask != nullptr) {
      if (a.relu) {
        std::copy(mask.begin(), mask.end(), a.relu_mask);
      } else {  // without ReLU the reference returns none: the sign bits of out
        const std::int64_t words = (a.w.dim + 31) / 32;
        std::fill_n(a.relu_mask, s.rows * words, 0u);
        for (std::int64_t i = 0; i < s.rows; ++i) {
          for (std::int64_t f = 0; f < a.w.dim; ++f) {
            if (load_as_double(a.out.data, a.out.type, a.out.offset(i, 0, f)) > 0)
              a.relu_mask[i * words + f / 32] |= 1u << (f % 32);
          }
        }
      }
    }
    if (a.ax.data != nullptr) reference::spmm(s.propagation, {}, a.x, a.ax);
    return;
  }
  const std::size_t need = workspace_bytes(a.x.dim, a.w.dim, a.x.type, a.order);
  TRISPARSE_EXPECTS_INPUT(workspace.bytes >= need && (need == 0 || workspace.data != nullptr),
                          "the fused GCN layer needs " + std::to_string(need) +
                              " bytes of workspace (workspace_bytes()), got " +
                              std::to_string(workspace.bytes));
  if (fused_order) {
    cuda::gcn_fused_forward(*s.fused, a.x, a.w, a.bias, a.relu, a.out, a.relu_mask, a.ax, workspace,
                            stream);
    return;
  }
  for (const auto& [t, what] :
       {std::pair{&a.x, "x"}, std::pair{&a.w, "w"}, std::pair{&a.out, "out"}})
    check_device_arg(*t, what);
  TRISPARSE_EXPECTS_INPUT(a.x.type == a.w.type,
                          "x " + a.x.describe() + " and w " + a.w.describe() + " need one dtype");
  TRISPARSE_EXPECTS_INPUT(a.out.type == dtype::f32 || a.out.type == a.x.type,
                          "out " + a.out.describe() + " must be f32 or x's dtype");
  const gcn_unfused_workspace g = gcn_unfused_workspace_of(*s.plan, s.rows, a.w.dim, a.x.type);
  g.layout.check(workspace, "fused GCN layer");
  const workspace_view blas{detail::workspace_layout::at<void>(workspace, g.blas),
                            cuda::kGemmWorkspaceBytes};
  const workspace_view sparse{detail::workspace_layout::at<void>(workspace, g.sparse),
                              g.layout.bytes() - g.sparse};
  const tensor_view xw =
      detail::segment_view(workspace, g.xw, a.x.type, s.rows, 1, a.w.dim, a.x.device_id);
  const tensor_view z =
      detail::segment_view(workspace, g.z, dtype::f32, s.rows, 1, a.w.dim, a.x.device_id);
  cuda::gemm(a.x, a.w, xw, blas, stream);
  s.plan->spmm({}, xw, z, stream, sparse);
  cuda::bias_relu_mask(z, a.bias, a.relu, a.out, a.relu_mask, stream);
}

std::size_t gcn_fused_plan::backward_workspace_bytes(std::int64_t in_dim, std::int64_t out_dim,
                                                     dtype type, gcn_order order) const {
  const state& s = *state_;
  if (s.where == device_kind::cpu) return 0;
  return gcn_backward_workspace_of(*s.transposed, s.rows, in_dim, out_dim, type,
                                   fused(in_dim, out_dim, type, order))
      .layout.bytes();
}

void gcn_fused_plan::backward(const gcn_fused_grad_args& a, stream_ref stream,
                              workspace_view workspace) const {
  const state& s = *state_;
  const std::int64_t f_in = a.w.rows, f_out = a.w.dim;
  check_view(a.w, "w", f_in, 1, f_out);
  check_view(a.dout, "dout", s.rows, 1, f_out);
  if (a.dx.data != nullptr) check_view(a.dx, "dx", s.rows, 1, f_in);
  check_view(a.dw, "dw", f_in, 1, f_out);
  if (a.dbias.data != nullptr) check_view(a.dbias, "dbias", 1, 1, f_out);
  const auto words = static_cast<std::size_t>(s.rows * ((f_out + 31) / 32));
  if (s.where == device_kind::cpu) {
    check_view(a.x, "x", s.rows, 1, f_in);
    for (const tensor_view* t : {&a.x, &a.w, &a.dout, &a.dx, &a.dw, &a.dbias})
      if (t->data != nullptr) check_host(*t, "the fused GCN layer's backward argument");
    const std::span<const std::uint32_t> mask =
        a.relu_mask != nullptr ? std::span<const std::uint32_t>(a.relu_mask, words)
                               : std::span<const std::uint32_t>();
    if (cpu::all_f32({&a.x, &a.w, &a.dout, &a.dx, &a.dw, &a.dbias})) {
      cpu::gcn_backward(s.propagation, s.propagation_t, a.x, a.w, mask, a.dout, a.dx, a.dw,
                        a.dbias);
      return;
    }
    if (a.dx.data != nullptr) {
      reference::gcn_fused_backward(s.propagation, a.x, a.w, mask, a.dout, a.dx, a.dw, a.dbias);
    } else {  // the reference writes dx: into a scratch copy
      host_tensor dx(dtype::f64, s.rows, 1, f_in);
      reference::gcn_fused_backward(s.propagation, a.x, a.w, mask, a.dout, dx.view(), a.dw,
                                    a.dbias);
    }
    return;
  }
  const dtype type = a.w.type;
  const bool fused_order = fused(f_in, f_out, type, a.order);
  const tensor_view& saved = fused_order ? a.ax : a.x;
  check_view(saved, fused_order ? "ax" : "x", s.rows, 1, f_in);
  TRISPARSE_EXPECTS_INPUT(saved.type == type, std::string(fused_order ? "ax " : "x ") +
                                                  saved.describe() + " needs w's dtype");
  const gcn_backward_workspace g =
      gcn_backward_workspace_of(*s.transposed, s.rows, f_in, f_out, type, fused_order);
  g.layout.check(workspace, "fused GCN layer's backward");
  const int device = a.dout.device_id;
  const workspace_view blas{detail::workspace_layout::at<void>(workspace, g.blas),
                            cuda::kGemmWorkspaceBytes};
  const workspace_view sums{detail::workspace_layout::at<void>(workspace, g.sums),
                            cuda::relu_grad_workspace_bytes(s.rows, f_out)};
  const workspace_view sparse{detail::workspace_layout::at<void>(workspace, g.sparse),
                              g.layout.bytes() - g.sparse};
  const tensor_view dz = detail::segment_view(workspace, g.dz, type, s.rows, 1, f_out, device);
  cuda::relu_grad(a.dout, a.relu_mask, dz, a.dbias, sums, stream);
  if (fused_order) {
    const tensor_view t = detail::segment_view(workspace, g.between, type, s.rows, 1, f_in, device);
    cuda::gemm(a.ax, dz, a.dw, blas, stream, /*trans_a=*/true);
    if (a.dx.data == nullptr) return;
    cuda::gemm(dz, a.w, t, blas, stream, false, /*trans_b=*/true);
    s.transposed->spmm({}, t, a.dx, stream, sparse);
  } else {
    const tensor_view du =
        detail::segment_view(workspace, g.between, type, s.rows, 1, f_out, device);
    s.transposed->spmm({}, dz, du, stream, sparse);
    cuda::gemm(a.x, du, a.dw, blas, stream, /*trans_a=*/true);
    if (a.dx.data != nullptr) cuda::gemm(du, a.w, a.dx, blas, stream, false, /*trans_b=*/true);
  }
}

// --- GAT ------------------------------------------------------------------------------------

namespace {

// keep in CSR entry order (the reference's), from keep rows keep_index[e] (CPU).
host_tensor keep_in_entry_order(const tensor_view& keep, const std::int64_t* keep_index) {
  host_tensor k(dtype::f64, keep.rows, keep.heads, 1);
  for (std::int64_t e = 0; e < keep.rows; ++e) {
    TRISPARSE_EXPECTS_INPUT(keep_index[e] >= 0 && keep_index[e] < keep.rows,
                            "keep_index[" + std::to_string(e) +
                                "] = " + std::to_string(keep_index[e]) + " is not a row of keep");
    for (std::int64_t h = 0; h < keep.heads; ++h)
      k.set(e * keep.heads + h,
            load_as_double(keep.data, keep.type, keep.offset(keep_index[e], h, 0)));
  }
  return k;
}

// The CPU engine's argument checks (the reference makes its own).
void check_gat_cpu(const csr_graph& g, const tensor_view& x, const tensor_view& a_src,
                   const tensor_view& a_dst, const tensor_view& keep,
                   const std::int64_t* keep_index, double negative_slope) {
  check_view(x, "x", g.cols, -1, -1);
  check_view(a_src, "a_src", g.cols, x.heads, 1);
  check_view(a_dst, "a_dst", g.rows, x.heads, 1);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(negative_slope), "negative_slope must be finite");
  if (keep.data == nullptr) return;
  check_view(keep, "keep", g.nnz(), x.heads, 1);
  for (std::int64_t e = 0; keep_index != nullptr && e < g.nnz(); ++e)
    TRISPARSE_EXPECTS_INPUT(keep_index[e] >= 0 && keep_index[e] < keep.rows,
                            "keep_index[" + std::to_string(e) +
                                "] = " + std::to_string(keep_index[e]) + " is not a row of keep");
}

}  // namespace

struct gat_plan::state {
  device_kind where = device_kind::cpu;
  std::int64_t rows = 0, cols = 0, nnz = 0;
  csr_graph pattern;                               // CPU
  detail::transposed_pattern transposed;           // CPU: the fp32 engine's backward
  std::shared_ptr<const cuda::gat_device> device;  // CUDA
};

gat_plan gat_plan::build(const csr_graph& pattern, device_kind where, stream_ref stream) {
  pattern.check();
  auto s = std::make_shared<state>();
  s->where = where;
  s->rows = pattern.rows;
  s->cols = pattern.cols;
  s->nnz = pattern.nnz();
  if (where == device_kind::cpu) {
    s->pattern = pattern;
    s->transposed = detail::transposed_of(pattern);
  } else {
    s->device = cuda::upload_gat(pattern, stream);
  }
  gat_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

device_kind gat_plan::where() const { return state_->where; }
std::int64_t gat_plan::rows() const { return state_->rows; }
std::int64_t gat_plan::cols() const { return state_->cols; }
std::int64_t gat_plan::nnz() const { return state_->nnz; }

void gat_plan::forward(const gat_args& a, stream_ref stream, workspace_view workspace) const {
  const state& s = *state_;
  if (s.where == device_kind::cuda) {
    cuda::gat_forward(*s.device, a, workspace, stream);
    return;
  }
  for (const tensor_view* t : {&a.x, &a.a_src, &a.a_dst, &a.out}) check_host(*t, "GAT operand");
  for (const tensor_view* t : {&a.keep, &a.lse})
    if (t->data != nullptr) check_host(*t, "GAT operand");
  if (cpu::all_f32({&a.x, &a.a_src, &a.a_dst, &a.keep, &a.out, &a.lse})) {
    check_gat_cpu(s.pattern, a.x, a.a_src, a.a_dst, a.keep, a.keep_index, a.negative_slope);
    check_view(a.out, "out", s.rows, a.x.heads, a.x.dim);
    if (a.lse.data != nullptr) check_view(a.lse, "lse", s.rows, a.x.heads, 1);
    cpu::gat_forward(s.pattern, a.x, a.a_src, a.a_dst, {a.keep, a.keep_index},
                     static_cast<float>(a.negative_slope), a.out, a.lse);
    return;
  }
  host_tensor keep;
  if (a.keep.data != nullptr && a.keep_index != nullptr) {
    check_view(a.keep, "keep", s.nnz, a.x.heads, 1);
    keep = keep_in_entry_order(a.keep, a.keep_index);
  }
  reference::gat(s.pattern, a.x, a.a_src, a.a_dst, keep.numel() > 0 ? keep.view() : a.keep,
                 a.negative_slope, a.out, a.lse);
}

std::size_t gat_plan::forward_workspace_bytes(std::int64_t heads, std::int64_t width) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 1 && width >= 0, "the GAT layer needs heads >= 1, width >= 0");
  return state_->where == device_kind::cpu
             ? 0
             : cuda::gat_workspace_bytes(*state_->device, heads, width, false);
}

std::size_t gat_plan::backward_workspace_bytes(std::int64_t heads, std::int64_t width) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 1 && width >= 0, "the GAT layer needs heads >= 1, width >= 0");
  return state_->where == device_kind::cpu
             ? 0
             : cuda::gat_workspace_bytes(*state_->device, heads, width, true);
}

void gat_plan::backward(const gat_grad_args& a, stream_ref stream, workspace_view workspace) const {
  const state& s = *state_;
  if (s.where == device_kind::cuda) {
    cuda::gat_backward(*s.device, a, workspace, stream);
    return;
  }
  for (const tensor_view* t : {&a.x, &a.a_src, &a.a_dst, &a.dout, &a.dx, &a.da_src, &a.da_dst})
    check_host(*t, "GAT operand");
  if (a.keep.data != nullptr) check_host(a.keep, "keep");
  if (a.lse.data != nullptr && cpu::all_f32({&a.x, &a.a_src, &a.a_dst, &a.keep, &a.lse, &a.dout,
                                             &a.dx, &a.da_src, &a.da_dst})) {
    check_gat_cpu(s.pattern, a.x, a.a_src, a.a_dst, a.keep, a.keep_index, a.negative_slope);
    check_host(a.lse, "lse");
    check_view(a.lse, "lse", s.rows, a.x.heads, 1);
    check_view(a.dout, "dout", s.rows, a.x.heads, a.x.dim);
    check_view(a.dx, "dx", s.cols, a.x.heads, a.x.dim);
    check_view(a.da_src, "da_src", s.cols, a.x.heads, 1);
    check_view(a.da_dst, "da_dst", s.rows, a.x.heads, 1);
    cpu::gat_backward(s.pattern, s.transposed, a.x, a.a_src, a.a_dst, {a.keep, a.keep_index},
                      static_cast<float>(a.negative_slope), a.lse, a.dout, a.dx, a.da_src,
                      a.da_dst);
    return;
  }
  host_tensor keep;
  if (a.keep.data != nullptr && a.keep_index != nullptr) {
    check_view(a.keep, "keep", s.nnz, a.x.heads, 1);
    keep = keep_in_entry_order(a.keep, a.keep_index);
  }
  reference::gat_backward(s.pattern, a.x, a.a_src, a.a_dst, keep.numel() > 0 ? keep.view() : a.keep,
                          a.negative_slope, a.dout, a.dx, a.da_src, a.da_dst);
}

// --- AGNN -----------------------------------------------------------------------------------

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
