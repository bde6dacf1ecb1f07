// GAT's fused attention (gat_plan): the CPU engines and the CUDA kernels behind one plan.
#include "trisparse/ops/layers.hpp"

#include <algorithm>
#include <span>
#include <type_traits>

#include "../../common/arguments.hpp"
#include "../../cpu/common/dropout_draws.hpp"
#include "../../cpu/layers/f32.hpp"
#include "../../cpu/layers/gat.hpp"
#include "../../cuda/layers/gat/plan.hpp"
#include "common.hpp"

namespace trisparse {

using detail::check_host;

namespace {

// The CPU engine's argument checks.
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

// The CPU engine in T (float or double) on copies of the arguments in T where they hold another
// dtype (dropout's draws as keep factors). The backward reads the forward's lse in fp32 and
// recomputes it in float64.
template <class T>
void cpu_forward(const csr_graph& g, const gat_args& a) {
  detail::check_keep_or_dropout(a.keep, a.dropout);  // (the state in host memory)
  host_tensor xs, ss, ds, ks, os, ls;
  if (a.dropout.p > 0) ks = cpu::drawn_edge_keep<T>(g.nnz(), a.x.heads, a.dropout, a.keep_index);
  const std::int64_t* keep_index = a.dropout.p > 0 ? nullptr : a.keep_index;
  const tensor_view x = cpu::typed_view<T>(a.x, xs), src = cpu::typed_view<T>(a.a_src, ss),
                    dst = cpu::typed_view<T>(a.a_dst, ds),
                    keep = a.dropout.p > 0 ? ks.view() : cpu::typed_view<T>(a.keep, ks),
                    out = cpu::typed_view<T>(a.out, os, false),
                    lse = cpu::typed_view<T>(a.lse, ls, false);
  check_gat_cpu(g, x, src, dst, keep, keep_index, a.negative_slope);
  check_view(a.out, "out", g.rows, a.x.heads, a.x.dim);
  if (a.lse.data != nullptr) check_view(a.lse, "lse", g.rows, a.x.heads, 1);
  cpu::gat_forward<T>(g, x, src, dst, {keep, keep_index}, static_cast<T>(a.negative_slope), out,
                      lse);
  cpu::store_view<T>(out, a.out);
  cpu::store_view<T>(lse, a.lse);
}

template <class T>
void cpu_backward(const csr_graph& g, const detail::transposed_pattern& t, const gat_grad_args& a) {
  check_view(a.dout, "dout", g.rows, a.x.heads, a.x.dim);
  check_view(a.dx, "dx", g.cols, a.x.heads, a.x.dim);
  check_view(a.da_src, "da_src", g.cols, a.x.heads, 1);
  check_view(a.da_dst, "da_dst", g.rows, a.x.heads, 1);
  const bool given_lse = a.lse.data != nullptr && std::is_same_v<T, float>;
  if (given_lse) {
    check_host(a.lse, "lse");
    check_view(a.lse, "lse", g.rows, a.x.heads, 1);
  }
  detail::check_keep_or_dropout(a.keep, a.dropout);  // (the state in host memory)
  host_tensor xs, ss, ds, ks, ls, gs, dxs, dss, dds;
  if (a.dropout.p > 0) ks = cpu::drawn_edge_keep<T>(g.nnz(), a.x.heads, a.dropout, a.keep_index);
  const std::int64_t* keep_index = a.dropout.p > 0 ? nullptr : a.keep_index;
  const tensor_view x = cpu::typed_view<T>(a.x, xs), src = cpu::typed_view<T>(a.a_src, ss),
                    dst = cpu::typed_view<T>(a.a_dst, ds),
                    keep = a.dropout.p > 0 ? ks.view() : cpu::typed_view<T>(a.keep, ks),
                    lse = given_lse ? cpu::typed_view<T>(a.lse, ls) : tensor_view{},
                    dout = cpu::typed_view<T>(a.dout, gs),
                    dx = cpu::typed_view<T>(a.dx, dxs, false),
                    da_src = cpu::typed_view<T>(a.da_src, dss, false),
                    da_dst = cpu::typed_view<T>(a.da_dst, dds, false);
  check_gat_cpu(g, x, src, dst, keep, keep_index, a.negative_slope);
  cpu::gat_backward<T>(g, t, x, src, dst, {keep, keep_index}, static_cast<T>(a.negative_slope), lse,
                       dout, dx, da_src, da_dst);
  cpu::store_view<T>(dx, a.dx);
  cpu::store_view<T>(da_src, a.da_src);
  cpu::store_view<T>(da_dst, a.da_dst);
}

}  // namespace

struct gat_plan::state {
  device_kind where = device_kind::cpu;
  std::int64_t rows = 0, cols = 0, nnz = 0;
  csr_graph pattern;                               // CPU
  detail::transposed_pattern transposed;           // CPU: the engine's backward
  std::shared_ptr<const cuda::gat_device> device;  // CUDA
};

gat_plan gat_plan::build(const csr_graph& pattern, device_kind where, stream_ref stream) {
  if (where == device_kind::cuda) detail::check_device_entries(pattern.nnz(), "gat_plan");
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
  // The engine in float64 for float64 inputs, else in fp32 (f16 and bf16 through fp32 copies).
  cpu::in_type_of(a.x.type, [&]<class T>() { cpu_forward<T>(s.pattern, a); });
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
  cpu::in_type_of(a.x.type, [&]<class T>() { cpu_backward<T>(s.pattern, s.transposed, a); });
}

}  // namespace trisparse
