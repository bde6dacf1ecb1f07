// GAT's fused attention (gat_plan): the CPU engines and the CUDA kernels behind one plan.
#include "trisparse/ops/layers.hpp"

#include <span>

#include "../../cpu/layers/f32.hpp"
#include "../../cpu/layers/gat.hpp"
#include "../../cuda/layers/gat/plan.hpp"
#include "common.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse {

using detail::check_host;

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
  if (a.x.type != dtype::f64) {  // the fp32 engine; f16 and bf16 through fp32 copies
    host_tensor xs, ss, ds, ks, os, ls;
    const tensor_view x = cpu::f32_view(a.x, xs), src = cpu::f32_view(a.a_src, ss),
                      dst = cpu::f32_view(a.a_dst, ds), keep = cpu::f32_view(a.keep, ks),
                      out = cpu::f32_view(a.out, os, false), lse = cpu::f32_view(a.lse, ls, false);
    check_gat_cpu(s.pattern, x, src, dst, keep, a.keep_index, a.negative_slope);
    check_view(a.out, "out", s.rows, a.x.heads, a.x.dim);
    if (a.lse.data != nullptr) check_view(a.lse, "lse", s.rows, a.x.heads, 1);
    cpu::gat_forward(s.pattern, x, src, dst, {keep, a.keep_index},
                     static_cast<float>(a.negative_slope), out, lse);
    cpu::store_view(out, a.out);
    cpu::store_view(lse, a.lse);
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
  if (a.lse.data != nullptr && a.x.type != dtype::f64) {  // fp32; f16 and bf16 through copies
    check_host(a.lse, "lse");
    check_view(a.lse, "lse", s.rows, a.x.heads, 1);
    check_view(a.dout, "dout", s.rows, a.x.heads, a.x.dim);
    check_view(a.dx, "dx", s.cols, a.x.heads, a.x.dim);
    check_view(a.da_src, "da_src", s.cols, a.x.heads, 1);
    check_view(a.da_dst, "da_dst", s.rows, a.x.heads, 1);
    host_tensor xs, ss, ds, ks, ls, gs, dxs, dss, dds;
    const tensor_view x = cpu::f32_view(a.x, xs), src = cpu::f32_view(a.a_src, ss),
                      dst = cpu::f32_view(a.a_dst, ds), keep = cpu::f32_view(a.keep, ks),
                      lse = cpu::f32_view(a.lse, ls), dout = cpu::f32_view(a.dout, gs),
                      dx = cpu::f32_view(a.dx, dxs, false),
                      da_src = cpu::f32_view(a.da_src, dss, false),
                      da_dst = cpu::f32_view(a.da_dst, dds, false);
    check_gat_cpu(s.pattern, x, src, dst, keep, a.keep_index, a.negative_slope);
    cpu::gat_backward(s.pattern, s.transposed, x, src, dst, {keep, a.keep_index},
                      static_cast<float>(a.negative_slope), lse, dout, dx, da_src, da_dst);
    cpu::store_view(dx, a.dx);
    cpu::store_view(da_src, a.da_src);
    cpu::store_view(da_dst, a.da_dst);
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

}  // namespace trisparse
