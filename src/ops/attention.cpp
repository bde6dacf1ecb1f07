#include "trisparse/ops/attention.hpp"

#include <chrono>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../common/arguments.hpp"
#include "../common/workspace_layout.hpp"
#include "../cpu/fused/fast.hpp"
#include "../cuda/attention/backward/plan.hpp"
#include "../cuda/attention/backward/tuning.hpp"
#include "../cuda/attention/fused3s/heuristics.hpp"
#include "../cuda/attention/fused3s/plan.hpp"
#include "../cuda/common/device.hpp"
#include "../graph/transposed.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/formats/bsb.hpp"
#include "trisparse/graph/reorder.hpp"
#include "trisparse/ops/reference.hpp"
#include "trisparse/ops/sparse.hpp"

namespace trisparse {

std::string_view to_string(algorithm a) {
  switch (a) {
    case algorithm::automatic:
      return "automatic";
    case algorithm::blocked_reference:
      return "blocked_reference";
    case algorithm::fused:
      return "fused";
    case algorithm::unfused:
      return "unfused";
    case algorithm::block:
      return "block";
  }
  return "?";
}

algorithm parse_algorithm(std::string_view name) {
  for (const auto a : {algorithm::automatic, algorithm::blocked_reference, algorithm::fused,
                       algorithm::unfused, algorithm::block}) {
    if (to_string(a) == name) return a;
  }
  if (name == "auto") return algorithm::automatic;
  if (name == "reference") {
    throw invalid_input(
        "the float64 reference is not an algorithm: call trisparse::reference (the command "
        "checks rows against it with --check-rows)");
  }
  throw invalid_input("unknown algorithm '" + std::string(name) +
                      "' (automatic, blocked_reference, fused, unfused, block)");
}

std::string_view to_string(head_order o) {
  switch (o) {
    case head_order::automatic:
      return "automatic";
    case head_order::by_window:
      return "by_window";
    case head_order::by_head:
      return "by_head";
  }
  return "?";
}

head_order parse_head_order(std::string_view name) {
  for (const auto o : {head_order::automatic, head_order::by_window, head_order::by_head}) {
    if (to_string(o) == name) return o;
  }
  if (name == "auto") return head_order::automatic;
  throw invalid_input("unknown head order '" + std::string(name) +
                      "' (automatic, by_window, by_head)");
}

bool runs_on(algorithm a, device_kind where) {
  switch (a) {
    case algorithm::automatic:
    case algorithm::fused:
      return true;
    case algorithm::blocked_reference:
      return where == device_kind::cpu;
    case algorithm::unfused:
    case algorithm::block:
      return where == device_kind::cuda;
  }
  return false;
}

std::string backend_name(algorithm a, device_kind where, bool block_mask) {
  const bool cuda = where == device_kind::cuda;
  switch (a) {
    case algorithm::fused:
      return cuda ? "cuda_fused3s" : block_mask ? "cpu_block" : "cpu_fused";
    case algorithm::unfused:
      return block_mask ? "cuda_block_unfused" : "cuda_me_bcrs";
    case algorithm::block:
      return "cuda_block";
    default:
      return std::string(to_string(where)) + "_" + std::string(to_string(a));
  }
}

std::vector<std::int64_t> cuda_head_dims() {
#ifndef TRISPARSE_HEAD_DIM_MASK  // a build without the CUDA backend: CMake's default, all four
#define TRISPARSE_HEAD_DIM_MASK 15
#endif
  std::vector<std::int64_t> dims;
  for (int i = 0; i < 4; ++i)
    if (((TRISPARSE_HEAD_DIM_MASK >> i) & 1) != 0) dims.push_back(std::int64_t{32} << i);
  return dims;
}

double effective_scale(const attention_options& options, std::int64_t head_dim) {
  return detail::resolve_scale(options.scale, head_dim);
}

bool cuda_available() { return cuda::device_count() > 0; }

struct attention_plan::state {
  csr_graph pattern;     // binary: values dropped
  csr_graph transposed;  // plan_options::gradients on the CPU: backward()'s dk and dv
  std::vector<std::int64_t> transposed_entry;  // the entry of `pattern` each of `transposed`'s is
  bool gradients = false;
  std::optional<bsb> blocks;
  std::shared_ptr<cuda::fused3s_device_plan> device_blocks;
  std::optional<sparse_plan> unfused;  // unfused: the ME-BCRS and its kernels
  plan_report report;
  // unfused: the plan's own workspace for its per-edge scores and probabilities, sized at
  // build for plan_options.workspace_heads (the SpMM's and softmax's own is the sparse plan's).
  device_tensor own;
  std::int64_t own_heads = 0;
  // plan_options::gradients on CUDA: the pattern and its transpose on the device, and the
  // backward's own workspace for up to grad_heads heads of up to grad_dim elements.
  std::shared_ptr<cuda::attention_backward_device_plan> device_grad;
  device_tensor grad_own;
  std::int64_t grad_heads = 0, grad_dim = 0;
};

namespace {

algorithm choose(algorithm requested, device_kind where) {
  const algorithm algo = requested != algorithm::automatic ? requested : algorithm::fused;
  if (!runs_on(algo, where)) {
    throw invalid_input("algorithm " + std::string(to_string(algo)) + " does not run on " +
                        to_string(where));
  }
  TRISPARSE_EXPECTS_INPUT(
      algo != algorithm::block,
      "the block algorithm runs block masks: build a block_sparse_attention_plan");
  return algo;
}

// The pattern without its values.
csr_graph binary_copy(const csr_graph& g) {
  csr_graph b;
  b.rows = g.rows;
  b.cols = g.cols;
  b.row_ptr = g.row_ptr;
  b.col_idx = g.col_idx;
  return b;
}

using detail::transpose_with_entries;

cuda::fused3s_limits fused3s_limits(const plan_options& o) {
  return {o.split_tcbs, o.team_tcbs, o.workspace_heads, o.workspace_dim, o.heads};
}

sparse_plan_options unfused_options(const plan_options& o) {
  // Scores go through a softmax, which turns tf32's absolute error at large scores into large
  // factors: f32 inputs take the three-product SDDMM.
  return {.vector_rows = 8,
          .split_blocks = o.split_tcbs,
          .order = o.order,
          .sddmm_f32 = f32_math::tf32x3,
          .workspace_heads = o.workspace_heads,
          .workspace_dim = o.workspace_dim};
}

// unfused's workspace: per-edge scores (f32) and probabilities (16-bit; f32 runs reuse the
// scores) in the slot layout, then the sparse plan's own segments (SpMM and softmax).
struct unfused_workspace {
  detail::workspace_layout layout;
  std::size_t scores = 0, probs = 0, sparse = 0;
};

unfused_workspace unfused_workspace_of(const sparse_plan& p, std::int64_t heads, std::int64_t dim) {
  unfused_workspace w;
  const auto n = static_cast<std::size_t>(std::max<std::int64_t>(p.slots(), 1) * heads);
  w.scores = w.layout.add(n * 4);
  w.probs = w.layout.add(n * 2);
  w.sparse = w.layout.add(p.workspace_bytes(heads, dim));
  return w;
}

void describe_unfused(plan_report& r, const sparse_plan& p) {
  r.format = p.report().format + " (device)";
  if (p.report().order != row_order::original)
    r.format += ", rows in " + std::string(to_string(p.report().order)) + " order";
}

void finish_report(plan_report& r, algorithm algo, device_kind where, std::int64_t rows,
                   std::int64_t cols, std::int64_t nnz, std::int64_t bytes,
                   std::chrono::steady_clock::time_point t0) {
  r.algo = algo;
  r.where = where;
  r.rows = rows;
  r.cols = cols;
  r.nnz = nnz;
  r.format_bytes = bytes;
  r.build_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Reverse Cuthill-McKee tried on a square pattern's windows: the order (of the symmetrised graph,
// so its transpose's too) and, under `automatic`, the TCBs in the pattern's own order and in it.
// No order where RCM is neither asked nor tried (automatic: square patterns of at most
// kRcmMaxNnz entries).
struct rcm_trial {
  std::vector<std::int64_t> order;
  std::int64_t tcbs = 0, tcbs_rcm = 0;
};

rcm_trial try_rcm(const csr_graph& g, row_order asked) {
  const bool square = g.rows == g.cols && g.rows > 1;
  if (!square || !(asked == row_order::rcm ||
                   (asked == row_order::automatic && g.nnz() <= cuda::fused3s::kRcmMaxNnz)))
    return {};
  rcm_trial t{.order = reverse_cuthill_mckee(g)};
  if (asked == row_order::automatic) {
    t.tcbs = count_tcbs(g);
    t.tcbs_rcm = count_tcbs(select_rows(g, t.order));
  }
  return t;
}

// The same order tried on another pattern of the same rows (the transpose): its TCB counts.
rcm_trial recounted(const rcm_trial& t, const csr_graph& g) {
  if (t.order.empty() || t.tcbs == 0) return t;
  return {.order = t.order, .tcbs = count_tcbs(g), .tcbs_rcm = count_tcbs(select_rows(g, t.order))};
}

// The order in which a CUDA plan's tensor-core windows take the rows (empty: their own): the
// trial's where asked, or where it leaves at most `keep_percent` % of the TCBs (the forward's
// and the backward's rules differ).
std::vector<std::int64_t> window_order(const rcm_trial& t, std::int64_t keep_percent) {
  if (t.order.empty() || 100 * t.tcbs_rcm > keep_percent * t.tcbs) return {};
  return t.order;
}

}  // namespace

void attention_plan::own_backward(state& s, const plan_options& options) {
  s.grad_heads = std::max<std::int64_t>(options.workspace_heads, 1);
  s.grad_dim = std::max<std::int64_t>(options.workspace_dim, 1);
  // Serves the backward and the row-wise forward (f32), which run in turn on the stream.
  const std::size_t bytes =
      std::max(cuda::attention_backward_workspace_bytes(*s.device_grad, s.grad_heads, s.grad_dim,
                                                        dtype::f16),
               cuda::attention_rowwise_workspace_bytes(*s.device_grad, s.grad_heads, s.grad_dim));
  s.grad_own = device_tensor(dtype::f32, static_cast<std::int64_t>(bytes / 4), 1, 1);
  s.gradients = true;
}

void attention_plan::own_unfused_workspace(state& s, const plan_options& options) {
  s.own_heads = std::max<std::int64_t>(options.workspace_heads, 1);
  const unfused_workspace w = unfused_workspace_of(*s.unfused, s.own_heads, 1);
  s.own = device_tensor(dtype::f32, static_cast<std::int64_t>(w.sparse) / 4, 1, 1);
}

attention_plan attention_plan::build(const csr_graph& pattern, device_kind where,
                                     const plan_options& options, stream_ref stream) {
  const auto t0 = std::chrono::steady_clock::now();
  if (where == device_kind::cuda) detail::check_device_entries(pattern.nnz(), "attention_plan");
  pattern.check();
  const algorithm algo = choose(options.algo, where);
  auto s = std::make_shared<state>();
  std::int64_t bytes = 0;
  // The tensor-core windows' row order, tried once for the forward and the backward.
  const bool cuda_windows =
      where == device_kind::cuda && (algo == algorithm::fused || options.gradients);
  const rcm_trial rcm = cuda_windows ? try_rcm(pattern, options.order) : rcm_trial{};
  if (algo == algorithm::unfused) {
    // Attention's pattern is binary: a plan from the values would scale the scores by them.
    s->unfused = sparse_plan::build(binary_copy(pattern), where, unfused_options(options), stream);
    describe_unfused(s->report, *s->unfused);
    own_unfused_workspace(*s, options);
    bytes = s->unfused->report().format_bytes;
  } else if (algo == algorithm::fused && where == device_kind::cuda) {
    // The BSB (16x8) is built on the GPU from the checked pattern; the plan keeps only that.
    // Rows grouped into windows in RCM order where that cuts the TCB count (item 3(d)); the
    // kernel maps window rows back to query rows.
    const std::vector<std::int64_t> order = window_order(rcm, cuda::fused3s::kRcmKeepPercent);
    s->device_blocks = cuda::make_fused3s_plan(pattern, fused3s_limits(options), stream, order);
    s->report.format = order.empty() ? "bsb16x8 (device)" : "bsb16x8 (device), rows in RCM order";
    bytes = cuda::device_bytes(*s->device_blocks);
  } else {
    s->pattern = binary_copy(pattern);
    s->report.format = "csr";
    bytes =
        static_cast<std::int64_t>(8 * s->pattern.row_ptr.size() + 4 * s->pattern.col_idx.size());
    if (options.gradients)
      std::tie(s->transposed, s->transposed_entry) = transpose_with_entries(s->pattern);
    s->gradients = options.gradients;
    if (algo == algorithm::blocked_reference) {
      s->blocks = build_bsb(s->pattern, options.tcb_cols);
      s->report.format += "+bsb16x" + std::to_string(options.tcb_cols);
      bytes += s->blocks->bytes();
    }
  }
  if (options.gradients && where == device_kind::cuda) {
    // The backward's tensor-core passes group the rows of the pattern (queries) and of its
    // transpose (keys) into windows by their own rule (attention_backward::kRcmKeepPercent).
    // A symmetric pattern's transpose is itself: its counts are the pattern's.
    const csr_graph b = binary_copy(pattern);
    const auto [transposed, entries] = transpose_with_entries(b);
    const bool symmetric = transposed.row_ptr == b.row_ptr && transposed.col_idx == b.col_idx;
    constexpr std::int64_t keep = cuda::attention_backward::kRcmKeepPercent;
    s->device_grad = cuda::make_attention_backward_plan(
        b, transposed, entries, stream, window_order(rcm, keep),
        window_order(symmetric ? rcm : recounted(rcm, transposed), keep), options.heads);
    own_backward(*s, options);
  }
  finish_report(s->report, algo, where, pattern.rows, pattern.cols, pattern.nnz(), bytes, t0);
  attention_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

attention_plan attention_plan::build(const csr_view& pattern, const plan_options& options,
                                     stream_ref stream) {
  if (pattern.where == device_kind::cpu) {
    // Host memory: merge repeats and sort rows into a checked csr_graph, then the usual build.
    TRISPARSE_EXPECTS_INPUT(pattern.rows >= 0 && pattern.nnz >= 0 && pattern.row_ptr != nullptr &&
                                (pattern.nnz == 0 || pattern.col_idx != nullptr),
                            "a CSR view needs rows, nnz >= 0, row_ptr and (with entries) col_idx");
    coo_graph coo{.rows = pattern.rows, .cols = pattern.cols, .src = {}, .dst = {}, .values = {}};
    TRISPARSE_EXPECTS_INPUT(pattern.row_ptr[0] == 0 && pattern.row_ptr[pattern.rows] == pattern.nnz,
                            "CSR view: row_ptr must start at 0 and end at nnz");
    for (std::int64_t r = 0; r < pattern.rows; ++r) {
      TRISPARSE_EXPECTS_INPUT(pattern.row_ptr[r] <= pattern.row_ptr[r + 1],
                              "CSR view: row_ptr decreases at row " + std::to_string(r));
      for (std::int64_t e = pattern.row_ptr[r]; e < pattern.row_ptr[r + 1]; ++e) {
        coo.src.push_back(r);
        coo.dst.push_back(pattern.col_idx[e]);
      }
    }
    return build(to_csr(coo), device_kind::cpu, options, stream);
  }
  detail::check_device_entries(pattern.nnz, "attention_plan");
  const auto t0 = std::chrono::steady_clock::now();
  const algorithm algo = choose(options.algo, pattern.where);
  auto s = std::make_shared<state>();
  if (options.gradients) {
    // Checks the pattern (columns strictly increasing within rows) and transposes it there.
    s->device_grad = cuda::make_attention_backward_plan(pattern, stream);
    own_backward(*s, options);
  }
  std::int64_t bytes = 0;
  // Rows stay in the given order (no reordering on the device).
  if (algo == algorithm::unfused) {
    sparse_plan_options o = unfused_options(options);
    o.order = row_order::original;
    s->unfused = sparse_plan::build(pattern, nullptr, o, stream);
    describe_unfused(s->report, *s->unfused);
    own_unfused_workspace(*s, options);
    bytes = s->unfused->report().format_bytes;
  } else {
    s->device_blocks = cuda::make_fused3s_plan(pattern, fused3s_limits(options), stream);
    s->report.format = "bsb16x8 (device)";
    bytes = cuda::device_bytes(*s->device_blocks);
  }
  finish_report(s->report, algo, pattern.where, pattern.rows, pattern.cols, pattern.nnz, bytes, t0);
  attention_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

const plan_report& attention_plan::report() const {
  TRISPARSE_EXPECTS(state_ != nullptr, "attention_plan used before build()");
  return state_->report;
}

algorithm attention_plan::resolve(algorithm requested) const {
  return requested == algorithm::automatic ? report().algo : requested;
}

std::size_t attention_plan::workspace_bytes(std::int64_t heads, std::int64_t head_dim) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && head_dim >= 0,
                          "workspace_bytes: heads and head_dim must be >= 0");
  std::size_t bytes = 0;
  if (state_->device_grad)  // the f32 forward runs row-wise
    bytes = cuda::attention_rowwise_workspace_bytes(*state_->device_grad, heads, head_dim);
  if (state_->device_blocks)
    return std::max(bytes, cuda::fused3s_workspace_bytes(*state_->device_blocks, heads, head_dim));
  if (bytes > 0) return bytes;
  if (state_->unfused)
    return unfused_workspace_of(*state_->unfused, heads, head_dim).layout.bytes();
  return 0;
}

void attention_plan::run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                         const tensor_view& out, const attention_options& options,
                         stream_ref stream, workspace_view given) const {
  const workspace_view* workspace = given.empty() ? nullptr : &given;
  const plan_report& r = report();
  detail::check_attention_args(r.rows, r.cols, q, k, v, out, r.where);
  const double scale = detail::resolve_scale(options.scale, q.dim);
  detail::check_no_dropout(options, "attention_plan");
  detail::check_no_block_bias(options, "attention_plan");
  const algorithm algo = resolve(options.algo);
  if (!runs_on(algo, r.where)) {
    throw invalid_input("algorithm " + std::string(to_string(algo)) + " does not run on " +
                        to_string(r.where));
  }
  const tensor_view& lse = options.lse;
  if (lse.data != nullptr) {
    TRISPARSE_EXPECTS_INPUT(algo == algorithm::fused,
                            "the log-sum-exp is written by the fused algorithm");
    check_view(lse, "lse", r.rows, q.heads, 1);
    TRISPARSE_EXPECTS_INPUT(lse.where == r.where,
                            std::string("lse must be on ") + to_string(r.where) + ", as the plan");
  }
  const tensor_view& bias = options.bias;
  if (bias.data != nullptr) {
    TRISPARSE_EXPECTS_INPUT(
        algo == algorithm::fused,
        "a score bias is taken by the fused algorithm, not " + std::string(to_string(algo)));
    detail::check_bias(bias, "bias", r.nnz, q.heads, r.where);
  }
  switch (algo) {
    case algorithm::blocked_reference:
      if (!state_->blocks) {
        throw invalid_input(
            "this plan holds no BSB format: build it with plan_options.algo = "
            "blocked_reference");
      }
      reference::blocked_attention(*state_->blocks, q, k, v, out, scale);
      return;
    case algorithm::fused:
      if (r.where == device_kind::cpu) {
        cpu::fused_attention_unchecked(state_->pattern, q, k, v, out, scale, lse, bias);
        return;
      }
      if (q.type == dtype::f32 ||
          (bias.data != nullptr &&
           (!state_->device_blocks ||
            !cuda::fused3s_takes_bias(*state_->device_blocks, q, k, v, out)))) {
        // The tensor-core kernel takes f16 and bf16 (with a bias where fused3s_takes_bias); f32
        // runs and the other biased ones go row-wise on the CSR that a plan with gradients holds.
        TRISPARSE_EXPECTS_INPUT(state_->device_grad != nullptr,
                                "f32 or biased attention on CUDA runs row-wise on the plan's "
                                "device CSR: build the plan with plan_options.gradients = true");
        cuda::run_attention_rowwise(*state_->device_grad, q, k, v, out, lse, bias, scale,
                                    workspace != nullptr ? *workspace : own_grad_workspace(q, v),
                                    stream);
        return;
      }
      if (!state_->device_blocks) {
        throw invalid_input(
            "this plan holds no device BSB: build it with plan_options.algo = fused");
      }
      cuda::run_fused3s(*state_->device_blocks, q, k, v, out, lse, bias, scale, workspace, stream);
      return;
    case algorithm::unfused: {
      if (!state_->unfused) {
        throw invalid_input(
            "this plan holds no device ME-BCRS: build it with plan_options.algo = unfused");
      }
      // scores = scale Q K^T on the pattern (f32) -> row softmax in v's dtype -> out = P V.
      TRISPARSE_EXPECTS_INPUT(out.type == dtype::f32 || out.type == v.type,
                              "the unfused pipeline writes out as f32 or in v's dtype; out is " +
                                  out.describe() + ", v " + v.describe());
      const sparse_plan& p = *state_->unfused;
      const unfused_workspace w = unfused_workspace_of(p, q.heads, v.dim);
      workspace_view ws;
      if (workspace != nullptr) {
        ws = *workspace;
        w.layout.check(ws, "unfused attention");
      } else {
        // The plan's own: scores and probabilities for up to own_heads heads; the sparse plan
        // keeps its own segments.
        TRISPARSE_EXPECTS_INPUT(
            q.heads <= state_->own_heads,
            "unfused attention: this plan's own workspace serves up to " +
                std::to_string(state_->own_heads) + " heads, not " + std::to_string(q.heads) +
                ": build it with a larger plan_options.workspace_heads, or pass a workspace");
        ws = {state_->own.view().data, static_cast<std::size_t>(state_->own.view().rows) * 4};
      }
      const tensor_view scores =
          detail::slot_view(ws, w.scores, dtype::f32, p.slots(), q.heads, q.device_id);
      const tensor_view probs =
          v.type == dtype::f32
              ? scores
              : detail::slot_view(ws, w.probs, v.type, p.slots(), q.heads, q.device_id);
      p.sddmm(q, k, scores, scale, stream);
      if (workspace != nullptr) {
        const workspace_view sparse{detail::workspace_layout::at<void>(ws, w.sparse),
                                    ws.bytes - w.sparse};
        p.softmax(scores, probs, stream, sparse);
        p.spmm(probs, v, out, stream, sparse);
      } else {
        p.softmax(scores, probs, stream);
        p.spmm(probs, v, out, stream);
      }
      return;
    }
    default:
      throw not_supported("algorithm " + std::string(to_string(algo)) + " is not in this build");
  }
}

workspace_view attention_plan::own_grad_workspace(const tensor_view& q,
                                                  const tensor_view& v) const {
  TRISPARSE_EXPECTS_INPUT(
      q.heads <= state_->grad_heads && std::max(q.dim, v.dim) <= state_->grad_dim,
      "attention on CUDA (backward, f32 forward): this plan's own workspace serves up to " +
          std::to_string(state_->grad_heads) + " heads of dim " + std::to_string(state_->grad_dim) +
          ", not " + std::to_string(q.heads) + " of " + std::to_string(std::max(q.dim, v.dim)) +
          ": build it with larger plan_options.workspace_heads/workspace_dim, or pass a "
          "workspace");
  return {state_->grad_own.view().data, static_cast<std::size_t>(state_->grad_own.view().rows) * 4};
}

std::size_t attention_plan::backward_workspace_bytes(std::int64_t heads, std::int64_t head_dim,
                                                     dtype type) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && head_dim >= 0,
                          "backward_workspace_bytes: heads and head_dim must be >= 0");
  return state_->device_grad
             ? cuda::attention_backward_workspace_bytes(*state_->device_grad, heads, head_dim, type)
             : 0;
}

void attention_plan::backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                              const tensor_view& out, const tensor_view& lse,
                              const tensor_view& dout, const tensor_view& dq, const tensor_view& dk,
                              const tensor_view& dv, const attention_options& options,
                              stream_ref stream, workspace_view given) const {
  const plan_report& r = report();
  detail::check_attention_args(r.rows, r.cols, q, k, v, out, r.where);
  detail::check_no_block_bias(options, "attention_plan");
  check_view(dout, "dout", r.rows, q.heads, v.dim);
  check_view(dq, "dq", r.rows, q.heads, q.dim);
  check_view(dk, "dk", r.cols, q.heads, q.dim);
  check_view(dv, "dv", r.cols, q.heads, v.dim);
  for (const auto& [t, what] : {std::pair{&dout, "dout"}, std::pair{&dq, "dq"},
                                std::pair{&dk, "dk"}, std::pair{&dv, "dv"}}) {
    TRISPARSE_EXPECTS_INPUT(t->where == r.where, std::string(what) + " is on " +
                                                     to_string(t->where) +
                                                     " but the plan runs on " + to_string(r.where));
  }
  if (lse.data != nullptr) {
    check_view(lse, "lse", r.rows, q.heads, 1);
    TRISPARSE_EXPECTS_INPUT(lse.where == r.where, "lse must be on the plan's device");
  }
  const algorithm algo = resolve(options.algo);
  const double scale = detail::resolve_scale(options.scale, q.dim);
  detail::check_no_dropout(options, "attention_plan");
  const tensor_view &bias = options.bias, &dbias = options.dbias;
  if (bias.data != nullptr) detail::check_bias(bias, "bias", r.nnz, q.heads, r.where);
  if (dbias.data != nullptr) detail::check_bias(dbias, "dbias", r.nnz, q.heads, r.where, true);
  if (r.where == device_kind::cuda) {
    TRISPARSE_EXPECTS_INPUT(state_->device_grad != nullptr,
                            "this plan was built without plan_options.gradients = true");
    const workspace_view ws = given.empty() ? own_grad_workspace(q, v) : given;
    // lse may be empty (the caller did not keep the forward's): the row pass recomputes it.
    cuda::run_attention_backward(*state_->device_grad, q, k, v, out, lse, dout, dq, dk, dv,
                                 {bias, dbias}, scale, ws, stream);
    return;
  }
  switch (algo) {
    case algorithm::fused:
      TRISPARSE_EXPECTS_INPUT(state_->gradients,
                              "this plan was built without plan_options.gradients = true");
      TRISPARSE_EXPECTS_INPUT(
          lse.data != nullptr,
          "the fused backward needs the forward's lse (attention_options::lse)");
      cpu::fused_attention_backward_unchecked(state_->pattern, state_->transposed, q, k, v, out,
                                              lse, dout, dq, dk, dv, scale,
                                              {bias, dbias, state_->transposed_entry});
      return;
    default:
      throw invalid_input("the backward runs the fused algorithm, not " +
                          std::string(to_string(algo)));
  }
}

}  // namespace trisparse
