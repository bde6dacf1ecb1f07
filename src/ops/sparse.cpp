#include "trisparse/ops/sparse.hpp"

#include <chrono>
#include <cmath>

#include "../common/arguments.hpp"
#include "../cpu/sparse/kernels.hpp"
#include "../cuda/me_bcrs/heuristics.hpp"
#include "../cuda/me_bcrs/plan.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/graph/reorder.hpp"

namespace trisparse {

struct sparse_plan::state {
  csr_graph pattern;  // CPU plans
  std::shared_ptr<cuda::me_device_plan> device;
  sparse_plan_report report;
  bool split_f32 = false;  // sparse_plan_options.sddmm_f32 == tf32x3
};

namespace {

void check_options(const sparse_plan_options& o) {
  TRISPARSE_EXPECTS_INPUT(
      o.vector_rows == 8 || o.vector_rows == 16,
      "sparse_plan_options.vector_rows must be 8 or 16, not " + std::to_string(o.vector_rows));
  TRISPARSE_EXPECTS_INPUT(o.split_blocks >= 0, "sparse_plan_options.split_blocks must be >= 0");
  TRISPARSE_EXPECTS_INPUT(o.sddmm_f32 == f32_math::tf32 || o.sddmm_f32 == f32_math::tf32x3,
                          "sparse_plan_options.sddmm_f32 must be f32_math::tf32 or tf32x3");
}

cuda::me_work_limits limits(const sparse_plan_options& o) {
  return {o.split_blocks, o.team_blocks, o.workspace_heads, o.workspace_dim};
}

void fill_device_report(sparse_plan_report& r, const cuda::me_device_plan& plan, int vector_rows) {
  const cuda::me_plan_info i = cuda::info(plan);
  r.where = device_kind::cuda;
  r.windows = i.windows;
  r.vectors = i.vectors;
  r.slots = i.slots;
  r.format_bytes = i.format_bytes;
  r.sr_bcrs_bytes = i.sr_bcrs_bytes;
  r.format = "me-bcrs" + std::to_string(vector_rows) + "x1";
}

// The rows' window order for a CUDA plan from a host pattern (empty: as given).
std::vector<std::int64_t> choose_order(const csr_graph& g, const sparse_plan_options& o,
                                       row_order& chosen) {
  chosen = row_order::original;
  const bool square = g.rows == g.cols;
  if (o.order == row_order::original || g.rows <= 1) return {};
  if (o.order == row_order::rcm) {
    TRISPARSE_EXPECTS_INPUT(square, "row_order::rcm needs a square pattern; this one is " +
                                        std::to_string(g.rows) + " x " + std::to_string(g.cols));
    chosen = row_order::rcm;
    return reverse_cuthill_mckee(g);
  }
  if (o.order == row_order::automatic && g.nnz() > cuda::me_bcrs::kReorderMaxNnz) return {};
  const std::vector<std::int64_t> seeds =
      square ? reverse_cuthill_mckee(g) : std::vector<std::int64_t>{};
  std::vector<std::int64_t> order = cluster_rows(g, o.vector_rows, seeds);
  if (o.order == row_order::automatic &&
      !cuda::me_bcrs::reorder_pays(count_window_columns(g, o.vector_rows, order),
                                   count_window_columns(g, o.vector_rows))) {
    return {};
  }
  chosen = row_order::clustered;
  return order;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// CPU slot layout = CSR entry order: a strided copy of [nnz, H, 1] views.
void copy_entries(const tensor_view& from, const tensor_view& to, std::int64_t nnz) {
  check_view(from, "from", nnz, -1, 1);
  check_view(to, "to", nnz, from.heads, 1);
  TRISPARSE_EXPECTS_INPUT(from.where == device_kind::cpu && to.where == device_kind::cpu,
                          "a CPU plan's per-edge values must be on the CPU");
  for (std::int64_t e = 0; e < nnz; ++e) {
    for (std::int64_t h = 0; h < from.heads; ++h) {
      store_from_double(to.data, to.type, to.offset(e, h, 0),
                        load_as_double(from.data, from.type, from.offset(e, h, 0)));
    }
  }
}

}  // namespace

sparse_plan sparse_plan::build(const csr_graph& pattern, device_kind where,
                               const sparse_plan_options& options, stream_ref stream) {
  check_options(options);
  if (where == device_kind::cuda) detail::check_device_entries(pattern.nnz(), "sparse_plan");
  pattern.check();
  const auto t0 = std::chrono::steady_clock::now();
  auto s = std::make_shared<state>();
  s->split_f32 = options.sddmm_f32 == f32_math::tf32x3;
  s->report.rows = pattern.rows;
  s->report.cols = pattern.cols;
  s->report.nnz = pattern.nnz();
  if (where == device_kind::cpu) {
    s->pattern = pattern;
    s->report.slots = pattern.nnz();
    s->report.format = "csr";
    s->report.format_bytes = static_cast<std::int64_t>(
        8 * pattern.row_ptr.size() + 4 * pattern.col_idx.size() + 4 * pattern.values.size());
  } else {
    row_order chosen = row_order::original;
    const std::vector<std::int64_t> order = choose_order(pattern, options, chosen);
    s->device = cuda::make_me_plan(pattern, options.vector_rows, limits(options), stream, order);
    fill_device_report(s->report, *s->device, options.vector_rows);
    s->report.order = chosen;
  }
  s->report.build_seconds = seconds_since(t0);
  sparse_plan p;
  p.state_ = std::move(s);
  return p;
}

sparse_plan sparse_plan::build(const csr_view& pattern, const float* values,
                               const sparse_plan_options& options, stream_ref stream) {
  check_options(options);
  TRISPARSE_EXPECTS_INPUT(pattern.where == device_kind::cuda,
                          "sparse_plan::build(csr_view) takes a pattern in GPU memory; build "
                          "CPU plans from a csr_graph");
  detail::check_device_entries(pattern.nnz, "sparse_plan");
  TRISPARSE_EXPECTS_INPUT(
      options.order == row_order::automatic || options.order == row_order::original,
      "a plan from a device pattern keeps its rows in the given order: build from a csr_graph for "
      "row_order::" +
          std::string(to_string(options.order)));
  const auto t0 = std::chrono::steady_clock::now();
  auto s = std::make_shared<state>();
  s->split_f32 = options.sddmm_f32 == f32_math::tf32x3;
  s->report.rows = pattern.rows;
  s->report.cols = pattern.cols;
  s->report.nnz = pattern.nnz;
  s->device = cuda::make_me_plan(pattern, values, options.vector_rows, limits(options), stream);
  fill_device_report(s->report, *s->device, options.vector_rows);
  s->report.build_seconds = seconds_since(t0);
  sparse_plan p;
  p.state_ = std::move(s);
  return p;
}

std::int64_t sparse_plan::slots() const { return state_->report.slots; }
const sparse_plan_report& sparse_plan::report() const { return state_->report; }

std::size_t sparse_plan::workspace_bytes(std::int64_t heads, std::int64_t dim) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && dim >= 0, "workspace_bytes: heads and dim must be >= 0");
  return state_->device ? cuda::me_workspace_bytes(*state_->device, heads, dim) : 0;
}

void sparse_plan::spmm(const tensor_view& values, const tensor_view& b, const tensor_view& c,
                       stream_ref stream, workspace_view workspace) const {
  if (state_->device)
    return cuda::run_spmm(*state_->device, values, b, c, workspace.empty() ? nullptr : &workspace,
                          stream);
  const csr_graph& g = state_->pattern;
  check_view(b, "b", g.cols, -1, -1);
  check_view(c, "c", g.rows, b.heads, b.dim);
  if (values.data != nullptr) check_view(values, "values", g.nnz(), b.heads, 1);
  cpu::spmm(g, values, b, c);
}

void sparse_plan::sddmm(const tensor_view& x, const tensor_view& y, const tensor_view& out,
                        double scale, stream_ref stream) const {
  if (state_->device)
    return cuda::run_sddmm(*state_->device, x, y, out, scale, state_->split_f32, stream);
  const csr_graph& g = state_->pattern;
  check_view(x, "x", g.rows, -1, -1);
  check_view(y, "y", g.cols, x.heads, x.dim);
  check_view(out, "out", g.nnz(), x.heads, 1);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "the SDDMM scale must be finite");
  cpu::sddmm(g, x, y, out, scale);
}

void sparse_plan::softmax(const tensor_view& scores, const tensor_view& out, stream_ref stream,
                          workspace_view workspace) const {
  if (state_->device)
    return cuda::run_softmax(*state_->device, scores, out, workspace.empty() ? nullptr : &workspace,
                             stream);
  const csr_graph& g = state_->pattern;
  check_view(scores, "scores", g.nnz(), -1, 1);
  check_view(out, "out", g.nnz(), scores.heads, 1);
  cpu::softmax(g, scores, out);
}

void sparse_plan::to_slots(const tensor_view& entries, const tensor_view& slots,
                           stream_ref stream) const {
  if (state_->device) return cuda::entries_to_slots(*state_->device, entries, slots, stream);
  copy_entries(entries, slots, state_->pattern.nnz());
}

void sparse_plan::to_entries(const tensor_view& slots, const tensor_view& entries,
                             stream_ref stream) const {
  if (state_->device) return cuda::slots_to_entries(*state_->device, slots, entries, stream);
  copy_entries(slots, entries, state_->pattern.nnz());
}

}  // namespace trisparse
