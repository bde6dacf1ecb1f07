// The fused GCN layer (gcn_fused_plan): GraphCUDA's A·X·W with its epilogue, and its backward.
#include "trisparse/ops/layers.hpp"

#include <algorithm>
#include <bit>

#include "../../common/arguments.hpp"
#include "../../cpu/layers/f32.hpp"
#include "../../cpu/layers/gcn.hpp"
#include "../../cuda/layers/dense.hpp"
#include "../../cuda/layers/gcn_fused/heuristics.hpp"
#include "../../cuda/layers/gcn_fused/plan.hpp"
#include "common.hpp"

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

using detail::check_device_arg;
using detail::check_host;

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
  if (where == device_kind::cuda) detail::check_device_entries(propagation.nnz(), "gcn_fused_plan");
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
  return fits && cuda::gcn_fused_heuristics::prefer_fused(state_->rows, in_dim, out_dim);
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
    // The CPU engine in float64 for float64 inputs (the gradcheck path), else in fp32 (other
    // dtypes through fp32 copies); the outputs stored back.
    const auto run = [&]<class T>() {
      host_tensor xs, ws, bs, os, axs;
      const tensor_view out = cpu::typed_view<T>(a.out, os, false),
                        ax = cpu::typed_view<T>(a.ax, axs, false);
      cpu::gcn_forward<T>(s.propagation, cpu::typed_view<T>(a.x, xs), cpu::typed_view<T>(a.w, ws),
                          cpu::typed_view<T>(a.bias, bs), a.relu, out, a.relu_mask, ax);
      cpu::store_view<T>(out, a.out);
      cpu::store_view<T>(ax, a.ax);
    };
    cpu::in_type_of(a.x.type, run);
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
    const auto run = [&]<class T>() {
      host_tensor xs, ws, gs, dxs, dws, dbs;
      const tensor_view dx = cpu::typed_view<T>(a.dx, dxs, false),
                        dw = cpu::typed_view<T>(a.dw, dws, false),
                        dbias = cpu::typed_view<T>(a.dbias, dbs, false);
      cpu::gcn_backward<T>(s.propagation, s.propagation_t, cpu::typed_view<T>(a.x, xs),
                           cpu::typed_view<T>(a.w, ws), mask, cpu::typed_view<T>(a.dout, gs), dx,
                           dw, dbias);
      cpu::store_view<T>(dx, a.dx);
      cpu::store_view<T>(dw, a.dw);
      cpu::store_view<T>(dbias, a.dbias);
    };
    cpu::in_type_of(a.x.type, run);
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

}  // namespace trisparse
