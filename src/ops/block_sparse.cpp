#include "trisparse/ops/block_sparse.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../common/arguments.hpp"
#include "../cpu/block_sparse/engine.hpp"
#include "../cpu/fused/fast.hpp"
#include "../cuda/attention/block_sparse/plan.hpp"
#include "../cuda/attention/block_sparse/unfused/plan.hpp"
#include "../formats/block_sparse_internal.hpp"
#include "../graph/transposed.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"

namespace trisparse {

using detail::attended_pairs;
using detail::batch_pattern;

struct block_sparse_attention_plan::state {
  block_sparse_mask mask;
  plan_report report;
  std::shared_ptr<cuda::block_sparse_device_plan> device;  // block
  std::shared_ptr<cuda::unfused_device_plan> unfused;      // unfused
  // fused on CUDA: the element pattern of the whole packed batch (block diagonal over the
  // sequences), one plan per mask head.
  std::vector<attention_plan> element;
  // block with gradients: the backward's own workspace, for up to grad_heads heads.
  device_tensor grad_own;
  std::int64_t grad_heads = 0;
};

namespace {

// Attention dropout runs in the CUDA block kernels and the CPU engine.
void check_dropout_runs(const attention_options& options, algorithm algo, device_kind where) {
  detail::check_dropout(options.dropout);
  const bool draws =
      where == device_kind::cuda ? algo == algorithm::block : algo == algorithm::fused;
  if (options.dropout.p > 0 && !draws)
    detail::check_no_dropout(options, ("block-sparse attention with " +
                                       std::string(to_string(algo)) + " on " + to_string(where))
                                          .c_str());
}

// One head of a [rows, heads, dim] view.
tensor_view head_of(const tensor_view& t, std::int64_t h) {
  tensor_view one = t;
  one.data = static_cast<std::byte*>(t.data) +
             h * t.head_stride * static_cast<std::int64_t>(size_of(t.type));
  one.heads = 1;
  return one;
}

// Rows [row0, row0 + rows) of a [rows, heads, dim] view (every head).
tensor_view rows_of(const tensor_view& t, std::int64_t row0, std::int64_t rows) {
  tensor_view s = t;
  s.data = static_cast<std::byte*>(t.data) +
           row0 * t.row_stride * static_cast<std::int64_t>(size_of(t.type));
  s.rows = rows;
  return s;
}

// A block bias on the CPU (attention_options::block_bias, dblock_bias): the element pattern's
// per-entry bias and its gradient's sums per block.
struct cpu_block_bias {
  tensor_view bias, dbias;
  std::int64_t qb = 0;  // query blocks a sequence in the bias's rows

  bool wanted() const { return bias.data != nullptr; }

  // The global head of head h of a run over `heads` heads of mask group g.
  static std::int64_t head_of_run(std::int64_t heads, std::int64_t g, std::int64_t h) {
    return heads == 1 ? g : h;
  }

  // Entry (i, j) of sequence b's element pattern `a` (mask group g; `heads` heads in the run)
  // takes B[b * qb + i / G, head, j / G].
  host_tensor entries(const block_sparse_mask& m, const csr_graph& a, std::int64_t b,
                      std::int64_t g, std::int64_t heads, dtype t) const {
    host_tensor e(t, a.nnz(), heads, 1);
    const tensor_view ev = e.view();
    for (std::int64_t i = 0; i < a.rows; ++i) {
      const std::int64_t row = b * qb + i / m.block;
      for (std::int64_t x = a.row_ptr[i]; x < a.row_ptr[i + 1]; ++x) {
        const std::int64_t c = a.col_idx[x] / m.block;
        for (std::int64_t h = 0; h < heads; ++h) {
          const std::int64_t head = bias.heads == 1 ? 0 : head_of_run(heads, g, h);
          store_from_double(ev.data, t, ev.offset(x, h, 0),
                            load_as_double(bias.data, bias.type, bias.offset(row, head, c)));
        }
      }
    }
    return e;
  }

  // dB of sequence b's kept blocks (mask group g) from the per-entry gradient `d` of `a`: each
  // block's entries summed in float64 in entry order, zeros for kept blocks without pairs.
  void store_sums(const block_sparse_mask& m, const csr_graph& a, const tensor_view& d,
                  std::int64_t b, std::int64_t g, std::int64_t heads) const {
    const std::int64_t kb = dbias.dim;
    std::vector<double> sums(static_cast<std::size_t>(qb * heads * kb), 0.0);
    const auto at = [&](std::int64_t r, std::int64_t h, std::int64_t c) {
      return static_cast<std::size_t>((r * heads + h) * kb + c);
    };
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t x = a.row_ptr[i]; x < a.row_ptr[i + 1]; ++x) {
        for (std::int64_t h = 0; h < heads; ++h)
          sums[at(i / m.block, h, a.col_idx[x] / m.block)] +=
              load_as_double(d.data, d.type, d.offset(x, h, 0));
      }
    }
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t head = head_of_run(heads, g, h);
      const csr_graph& blocks = m.at(b, head).blocks;
      for (std::int64_t r = 0; r < blocks.rows; ++r) {
        for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
          const std::int64_t c = blocks.col_idx[e];
          store_from_double(dbias.data, dbias.type, dbias.offset(b * qb + r, head, c),
                            sums[at(r, h, c)]);
        }
      }
    }
  }
};

// One sequence b and mask group g of the element-pattern paths: its rows, its expanded pattern,
// the heads run together (all where the mask is shared, else head g alone) and the group's views
// of a tensor's rows of the sequence's queries (part_q) or keys (part_k).
struct sequence_group {
  std::int64_t b, g, heads, q0, k0, lq, lk;
  bool per_head;
  csr_graph a;

  tensor_view part(const tensor_view& t, std::int64_t row0, std::int64_t rows) const {
    if (t.data == nullptr) return t;
    const tensor_view r = rows_of(t, row0, rows);
    return per_head ? head_of(r, g) : r;
  }
  tensor_view part_q(const tensor_view& t) const { return part(t, q0, lq); }
  tensor_view part_k(const tensor_view& t) const { return part(t, k0, lk); }
};

// Calls f(group) for each sequence and mask group (one group where the mask is shared by the
// heads, else one per head).
template <class F>
void for_each_sequence_group(const block_sparse_mask& m, std::int64_t heads, F&& f) {
  const bool per_head = m.heads != 1;  // else the heads run together
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    for (std::int64_t g = 0; g < (per_head ? heads : 1); ++g) {
      f(sequence_group{b, g, per_head ? 1 : heads, m.cu_seqlens_q[b], m.cu_seqlens_k[b], m.len_q(b),
                       m.len_k(b), per_head, m.expand(b, g)});
    }
  }
}

// The CPU forward with a block bias: per sequence (and mask head) the element pattern with the
// bias per entry, through the fused engine (fp32, float64 for float64 inputs; dropout drawn as
// the engine draws it).
void cpu_biased_forward(const block_sparse_mask& m, const tensor_view& q, const tensor_view& k,
                        const tensor_view& v, const tensor_view& out, double scale,
                        const attention_dropout& dropout, const tensor_view& lse,
                        const cpu_block_bias& bias) {
  const dtype t = q.type == dtype::f64 ? dtype::f64 : dtype::f32;
  for_each_sequence_group(m, q.heads, [&](const sequence_group& s) {
    const host_tensor e = bias.entries(m, s.a, s.b, s.g, s.heads, t);
    cpu::fused_attention_unchecked(s.a, s.part_q(q), s.part_k(k), s.part_k(v), s.part_q(out), scale,
                                   s.part_q(lse), e.view(), dropout,
                                   s.b * q.heads + s.g);  // (g = 0 where the mask is shared)
  });
}

// The CPU engine's backward over a block mask: fp32 work without a block bias in tiles over the
// blocks (cpu/block_sparse/blocked.cpp); float64 and block biases per sequence
// (and mask head), the expanded pattern and its transpose, the forward's out and lse (given, as
// run() wrote them, or recomputed in the engine's type where null), then the fused backward,
// which writes every row of dq, dk and dv (zeros where no pair reaches).
void cpu_block_sparse_backward(const block_sparse_mask& m, const tensor_view& q,
                               const tensor_view& k, const tensor_view& v,
                               const tensor_view* saved_out, const tensor_view* saved_lse,
                               const tensor_view& dout, const tensor_view& dq,
                               const tensor_view& dk, const tensor_view& dv, double scale,
                               const attention_dropout& dropout, const cpu_block_bias& bias) {
  if (cpu::blocked_engine_takes(q) && !bias.wanted()) {  // fp32 tiles, no expansion
    const bool saved = saved_out != nullptr && saved_lse != nullptr;
    host_tensor out(dtype::f32, saved ? 0 : q.rows, q.heads, v.dim),
        lse(dtype::f32, saved ? 0 : q.rows, q.heads, 1);
    if (!saved)
      cpu::block_sparse_forward_blocked(m, q, k, v, out.view(), scale, dropout, lse.view());
    cpu::block_sparse_backward_blocked(m, q, k, v, saved ? *saved_out : out.view(),
                                       saved ? *saved_lse : lse.view(), dout, dq, dk, dv, scale,
                                       dropout);
    return;
  }
  const dtype t = q.type == dtype::f64 ? dtype::f64 : dtype::f32;
  for_each_sequence_group(m, q.heads, [&](const sequence_group& s) {
    const auto [at, transposed_entry] = detail::transpose_with_entries(s.a);
    // Dropout's draws: rows within the sequence, head b * H + h (the kernels').
    const std::int64_t head0 = s.b * q.heads + s.g;
    const host_tensor e =
        bias.wanted() ? bias.entries(m, s.a, s.b, s.g, s.heads, t) : host_tensor{};
    host_tensor de(t, bias.dbias.data != nullptr ? s.a.nnz() : 0, s.heads, 1);
    // The forward recomputed in the engine's type (float64 for float64 inputs), out with the
    // dropout.
    host_tensor out(t, saved_out ? 0 : s.lq, s.heads, v.dim),
        lse(t, saved_lse ? 0 : s.lq, s.heads, 1);
    if (saved_out == nullptr) {
      cpu::fused_attention_unchecked(s.a, s.part_q(q), s.part_k(k), s.part_k(v), out.view(), scale,
                                     lse.view(), bias.wanted() ? e.view() : tensor_view{}, dropout,
                                     head0);
    }
    cpu::fused_attention_backward_unchecked(s.a, at, s.part_q(q), s.part_k(k), s.part_k(v),
                                            saved_out ? s.part_q(*saved_out) : out.view(),
                                            saved_lse ? s.part_q(*saved_lse) : lse.view(),
                                            s.part_q(dout), s.part_q(dq), s.part_k(dk),
                                            s.part_k(dv), scale,
                                            {.bias = bias.wanted() ? e.view() : tensor_view{},
                                             .dbias = de.rows() > 0 ? de.view() : tensor_view{},
                                             .transposed_entry = transposed_entry,
                                             .dropout = dropout,
                                             .dropout_head0 = head0});
    if (de.rows() > 0) bias.store_sums(m, s.a, de.view(), s.b, s.g, s.heads);
  });
}

// run()'s operands against the mask: shapes, devices, and the heads a mask serves.
void check_run_args(const block_sparse_mask& m, const tensor_view& q, const tensor_view& k,
                    const tensor_view& v, const tensor_view& out, device_kind where) {
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, v, out, where);
  TRISPARSE_EXPECTS_INPUT(m.heads == 1 || m.heads == q.heads,
                          "the mask has " + std::to_string(m.heads) + " heads, q " +
                              std::to_string(q.heads) + " (a mask is per head or shared)");
}

// The block kernel's own backward workspace, for up to `heads` heads.
device_tensor own_backward_workspace(const cuda::block_sparse_device_plan& plan,
                                     std::int64_t heads) {
  const std::size_t own = cuda::block_sparse_backward_workspace_bytes(plan, heads, false);
  return {dtype::f32, std::max<std::int64_t>(static_cast<std::int64_t>(own / 4), 1), 1, 1};
}

// The algorithms a block mask runs with: fused on the CPU; block, fused (the
// element patterns) and unfused on CUDA.
bool runs_block_masks(algorithm a, device_kind where) {
  return runs_on(a, where) && a != algorithm::blocked_reference && a != algorithm::automatic;
}

// The CUDA backward passes (and the block mass) exist for algorithm::block only: `what` names
// the call in the error.
void expect_block_kernel(algorithm plan_algo, const char* what) {
  if (plan_algo != algorithm::block) {
    throw not_supported(std::string(what) +
                        " on CUDA runs algorithm::block (blocks a multiple of 16); this plan "
                        "runs " +
                        std::string(to_string(plan_algo)));
  }
}

}  // namespace

block_sparse_attention_plan block_sparse_attention_plan::build(
    block_sparse_mask mask, device_kind where, const block_sparse_plan_options& options,
    stream_ref stream) {
  const auto t0 = std::chrono::steady_clock::now();
  mask.check();
  // On the GPU: the tensor-core block kernel where the block is a multiple of 16; finer blocks
  // (G = 1, 2, 8, ...) are element patterns for the fused BSB kernel, whose 16x8 tensor-core
  // blocks with bitmaps lose nothing to a fine mask (a 16 x 16 tile of the block kernel would
  // compute and discard every masked element).
  const algorithm algo = options.algo != algorithm::automatic      ? options.algo
                         : where == device_kind::cpu               ? algorithm::fused
                         : cuda::block_sparse_supports(mask.block) ? algorithm::block
                                                                   : algorithm::fused;
  TRISPARSE_EXPECTS_INPUT(runs_block_masks(algo, where),
                          std::string("block-sparse attention on ") + to_string(where) + " runs " +
                              (where == device_kind::cpu ? "fused" : "block, fused or unfused") +
                              ", not " + std::string(to_string(algo)));
  auto s = std::make_shared<state>();
  s->report.algo = algo;
  s->report.where = where;
  s->report.rows = mask.cu_seqlens_q.back();
  s->report.cols = mask.cu_seqlens_k.back();
  s->report.nnz = attended_pairs(mask);
  s->report.format = "block mask G=" + std::to_string(mask.block) + ", " +
                     std::to_string(mask.active_blocks()) + " blocks";
  std::int64_t bytes = 0;
  for (const block_mask& m : mask.masks)
    bytes += static_cast<std::int64_t>(8 * m.blocks.row_ptr.size() + 4 * m.blocks.col_idx.size());
  if (algo == algorithm::block) {
    s->device = cuda::make_block_sparse_plan(mask, options.kernel, options.gradients, stream);
    bytes = cuda::device_bytes(*s->device);
    if (options.gradients) {
      s->grad_heads = std::max<std::int64_t>(options.workspace_heads, 1);
      s->grad_own = own_backward_workspace(*s->device, s->grad_heads);
    }
    s->report.format += " (device, " + std::string(cuda::kernel_name(*s->device)) + ")";
  } else if (algo == algorithm::unfused) {
    s->unfused = cuda::make_unfused_plan(mask, options.workspace_heads, stream);
    bytes = cuda::device_bytes(*s->unfused);
    s->report.format += " as row-interleaved BCSR (SDDMM, softmax, SpMM; " +
                        std::to_string(cuda::score_bytes_per_head(*s->unfused)) +
                        " score bytes a head)";
  } else if (algo == algorithm::fused && where == device_kind::cuda) {
    bytes = 0;
    plan_options o;
    o.algo = algorithm::fused;
    o.workspace_heads = mask.heads == 1 ? options.workspace_heads : 1;
    o.workspace_dim = options.workspace_dim;
    for (std::int64_t h = 0; h < mask.heads; ++h) {
      s->element.push_back(attention_plan::build(batch_pattern(mask, h), where, o, stream));
      bytes += s->element.back().report().format_bytes;
    }
    s->report.format += " as elements, " + s->element.front().report().format;
  }
  s->report.format_bytes = bytes;
  s->mask = std::move(mask);
  s->report.build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  block_sparse_attention_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

block_sparse_attention_plan block_sparse_attention_plan::build(
    block_sparse_mask layout, const device_block_mask& kept,
    const block_sparse_plan_options& options, stream_ref stream) {
  const auto t0 = std::chrono::steady_clock::now();
  TRISPARSE_EXPECTS_INPUT(layout.masks.empty(),
                          "a plan for a mask on the device takes a layout without masks");
  detail::topk_rows(layout, 0, false).check();  // the offsets, heads and block
  TRISPARSE_EXPECTS_INPUT(
      options.algo == algorithm::automatic || options.algo == algorithm::block,
      "a mask on the device runs algorithm::block, not " + std::string(to_string(options.algo)));
  const std::int64_t g = layout.block;
  std::int64_t rows = 0, cols = 0;
  for (std::int64_t b = 0; b < layout.batch(); ++b) {
    rows = std::max(rows, (layout.len_q(b) + g - 1) / g);
    cols = std::max(cols, (layout.len_k(b) + g - 1) / g);
  }
  TRISPARSE_EXPECTS_INPUT(kept.rows >= rows && kept.cols >= cols,
                          "kept: " + std::to_string(kept.rows) + " x " + std::to_string(kept.cols) +
                              " blocks do not cover the longest sequences' " +
                              std::to_string(rows) + " x " + std::to_string(cols));
  TRISPARSE_EXPECTS_INPUT((kept.data != nullptr || rows * cols == 0) && kept.seq_stride >= 0 &&
                              kept.head_stride >= 0 && kept.row_stride >= cols,
                          "kept: null data, or strides that overlap its blocks");
  if (!cuda::block_sparse_supports(g)) {
    throw not_supported("a mask on the device takes blocks that are multiples of 16, not " +
                        std::to_string(g));
  }
  auto s = std::make_shared<state>();
  s->report.algo = algorithm::block;
  s->report.where = device_kind::cuda;
  s->report.rows = layout.cu_seqlens_q.back();
  s->report.cols = layout.cu_seqlens_k.back();
  s->report.nnz = -1;
  s->device = cuda::make_block_sparse_plan_on_device(
      layout, kept, options.kernel, options.gradients, options.mean_blocks, stream);
  // workspace_heads = 0: every backward passes its own.
  if (options.gradients && options.workspace_heads > 0) {
    s->grad_heads = options.workspace_heads;
    s->grad_own = own_backward_workspace(*s->device, s->grad_heads);
  }
  s->report.format = "block mask G=" + std::to_string(g) + " on the device (" +
                     cuda::kernel_name(*s->device) + ")";
  s->report.format_bytes = cuda::device_bytes(*s->device);
  s->mask = std::move(layout);
  s->report.build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  block_sparse_attention_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

std::size_t block_sparse_attention_plan::workspace_bytes(std::int64_t heads,
                                                         std::int64_t head_dim) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && head_dim >= 0,
                          "workspace_bytes: heads and head_dim must be >= 0");
  if (state_->unfused) return cuda::unfused_workspace_bytes(*state_->unfused, heads);
  std::size_t bytes = 0;  // fused: the element plans run one after another
  for (const attention_plan& e : state_->element)
    bytes = std::max(bytes, e.workspace_bytes(state_->mask.heads == 1 ? heads : 1, head_dim));
  return bytes;
}

void block_sparse_attention_plan::run(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const attention_options& options, stream_ref stream,
                                      workspace_view given) const {
  const workspace_view* workspace = given.empty() ? nullptr : &given;
  const block_sparse_mask& m = state_->mask;
  check_run_args(m, q, k, v, out, state_->report.where);
  const double scale = detail::resolve_scale(options.scale, q.dim);
  const algorithm algo = options.algo == algorithm::automatic ? state_->report.algo : options.algo;
  check_dropout_runs(options, algo, state_->report.where);
  const device_kind where = state_->report.where;
  const auto [qb, kb] = detail::most_blocks(m);
  detail::check_block_bias(options, m.batch(), qb, q.heads, kb, where, false);
  const cpu_block_bias bias{options.block_bias, {}, qb};
  if (bias.wanted() && algo != (where == device_kind::cpu ? algorithm::fused : algorithm::block)) {
    throw not_supported(
        "a block bias runs with algorithm::block on CUDA and algorithm::fused on "
        "the CPU, not " +
        std::string(to_string(algo)));
  }
  if (options.lse.data != nullptr) {
    const bool cpu = where == device_kind::cpu;
    TRISPARSE_EXPECTS_INPUT(algo == (cpu ? algorithm::fused : algorithm::block),
                            "block-sparse plans write the log-sum-exp with algorithm::block on "
                            "CUDA and algorithm::fused on the CPU, not " +
                                std::string(to_string(algo)) + " on " + to_string(where));
    check_view(options.lse, "lse", m.cu_seqlens_q.back(), q.heads, 1);
    TRISPARSE_EXPECTS_INPUT(
        options.lse.where == where,
        std::string("lse must be on the plan's device (") + to_string(where) + ")");
    TRISPARSE_EXPECTS_INPUT(
        options.lse.type == dtype::f32 || (cpu && options.lse.type == dtype::f64),
        "lse must be f32 (or f64 on the CPU), not " + std::string(to_string(options.lse.type)));
  }
  // The CPU runs either algorithm from the mask; a CUDA plan runs the one it was built for.
  TRISPARSE_EXPECTS_INPUT(
      runs_block_masks(algo, where) && (where == device_kind::cpu || algo == state_->report.algo),
      "this plan was built for " + std::string(to_string(state_->report.algo)) + " on " +
          to_string(where) + ", not " + std::string(to_string(algo)));
  switch (algo) {
    case algorithm::block:
      cuda::run_block_sparse(*state_->device, q, k, v, out, options.lse, scale, options.dropout,
                             {bias.bias, {}, qb}, stream);
      return;
    case algorithm::unfused:
      cuda::run_unfused(*state_->unfused, q, k, v, out, scale, workspace, stream);
      return;
    case algorithm::fused: {
      if (where == device_kind::cpu) {
        if (bias.wanted()) {
          cpu_biased_forward(m, q, k, v, out, scale, options.dropout, options.lse, bias);
          return;
        }
        cpu::block_sparse_attention_unchecked(m, q, k, v, out, scale, options.dropout, options.lse);
        return;
      }
      // The element plans hold no device CSR for the row-wise kernels (they are forward-only).
      if (q.type != dtype::f16 && q.type != dtype::bf16) {
        throw not_supported(
            "block-sparse attention with algorithm::fused on CUDA takes f16 or "
            "bf16, not " +
            std::string(to_string(q.type)));
      }
      attention_options o = options;
      o.algo = algorithm::automatic;
      o.scale = scale;
      if (m.heads == 1) {
        state_->element.front().run(q, k, v, out, o, stream, given);
        return;
      }
      for (std::int64_t h = 0; h < m.heads; ++h) {
        state_->element[static_cast<std::size_t>(h)].run(
            head_of(q, h), head_of(k, h), head_of(v, h), head_of(out, h), o, stream, given);
      }
      return;
    }
    default:
      throw invalid_input("block-sparse attention cannot run " + std::string(to_string(algo)));
  }
}

std::size_t block_sparse_attention_plan::backward_workspace_bytes(std::int64_t heads,
                                                                  bool importance) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0, "backward_workspace_bytes: heads must be >= 0");
  return state_->device
             ? cuda::block_sparse_backward_workspace_bytes(*state_->device, heads, importance)
             : 0;
}

std::size_t block_sparse_attention_plan::block_mass_workspace_bytes(std::int64_t heads) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0, "block_mass_workspace_bytes: heads must be >= 0");
  return state_->device ? cuda::block_sparse_mass_workspace_bytes(*state_->device, heads) : 0;
}

void block_sparse_attention_plan::block_mass(const tensor_view& q, const tensor_view& k,
                                             const tensor_view& lse,
                                             const attention_options& options, stream_ref stream,
                                             workspace_view workspace) const {
  const block_sparse_mask& m = state_->mask;
  const device_kind where = state_->report.where;
  check_run_args(m, q, k, k, q, where);  // (no v or out: q and k stand in)
  const double scale = detail::resolve_scale(options.scale, q.dim);
  const auto [qb, kb] = detail::most_blocks(m);
  detail::check_block_importance(options, m.batch(), qb, q.heads, kb, where);
  detail::check_no_block_bias(options, "block_mass (the light pass)");
  TRISPARSE_EXPECTS_INPUT(options.block_mass.data != nullptr && options.block_grad.data == nullptr,
                          "block_mass writes options.block_mass (set it) and no block_grad (the "
                          "|dS| sums need a backward)");
  if (where == device_kind::cpu) {
    cpu::block_importance_unchecked(m, q, k, {}, {}, scale, options.block_mass, {}, qb);
    return;
  }
  expect_block_kernel(state_->report.algo, "block mass");
  check_view(lse, "lse", m.cu_seqlens_q.back(), q.heads, 1);
  TRISPARSE_EXPECTS_INPUT(lse.where == device_kind::cuda, "lse must be on the GPU");
  cuda::run_block_sparse_mass(*state_->device, q, k, lse, scale, {options.block_mass, {}, qb},
                              workspace, stream);
}

void block_sparse_attention_plan::backward(const tensor_view& q, const tensor_view& k,
                                           const tensor_view& v, const tensor_view& out,
                                           const tensor_view& lse, const tensor_view& dout,
                                           const tensor_view& dq, const tensor_view& dk,
                                           const tensor_view& dv, const attention_options& options,
                                           stream_ref stream, workspace_view given) const {
  const block_sparse_mask& m = state_->mask;
  const device_kind where = state_->report.where;
  check_run_args(m, q, k, v, dout, where);
  detail::check_gradient_args(q, k, v, dq, dk, dv, where);
  const double scale = detail::resolve_scale(options.scale, q.dim);
  check_dropout_runs(
      options, options.algo == algorithm::automatic ? state_->report.algo : options.algo, where);
  const auto [qb, kb] = detail::most_blocks(m);
  detail::check_block_importance(options, m.batch(), qb, q.heads, kb, where);
  detail::check_block_bias(options, m.batch(), qb, q.heads, kb, where, true);
  const cuda::block_importance_views importance{options.block_mass, options.block_grad, qb};
  const cpu_block_bias bias{options.block_bias, options.dblock_bias, qb};
  if (bias.wanted() && importance.wanted())
    throw not_supported("block importance together with a block bias");
  if (where == device_kind::cpu) {
    const algorithm algo =
        options.algo == algorithm::automatic ? state_->report.algo : options.algo;
    TRISPARSE_EXPECTS_INPUT(
        runs_block_masks(algo, where),
        "block-sparse backward on the CPU runs fused, not " + std::string(to_string(algo)));
    const bool saved = out.data != nullptr && lse.data != nullptr;
    if (saved) {
      check_view(out, "out", m.cu_seqlens_q.back(), q.heads, v.dim);
      check_view(lse, "lse", m.cu_seqlens_q.back(), q.heads, 1);
      TRISPARSE_EXPECTS_INPUT(out.where == device_kind::cpu && lse.where == device_kind::cpu,
                              "out and lse must be on the CPU, as the plan");
    }
    cpu_block_sparse_backward(m, q, k, v, saved ? &out : nullptr, saved ? &lse : nullptr, dout, dq,
                              dk, dv, scale, options.dropout, bias);
    if (importance.wanted()) {
      cpu::block_importance_unchecked(m, q, k, v, dout, scale, importance.mass, importance.grad,
                                      qb);
    }
    return;
  }
  expect_block_kernel(state_->report.algo, "block-sparse backward");
  detail::check_saved_forward(m.cu_seqlens_q.back(), q, v, out, lse);
  workspace_view ws = given;
  TRISPARSE_EXPECTS_INPUT(ws.data != nullptr || !(importance.wanted() || bias.dbias.data),
                          "block-sparse backward with block importance or dblock_bias: pass a "
                          "workspace of backward_workspace_bytes(heads, true) bytes");
  if (ws.empty()) {
    TRISPARSE_EXPECTS_INPUT(
        state_->grad_own.view().data != nullptr && q.heads <= state_->grad_heads,
        "block-sparse backward: this plan's own workspace serves up to " +
            std::to_string(state_->grad_heads) + " heads, not " + std::to_string(q.heads) +
            ": build it with gradients and larger workspace_heads, or pass a "
            "workspace");
    ws = {state_->grad_own.view().data, static_cast<std::size_t>(state_->grad_own.view().rows) * 4};
  }
  cuda::run_block_sparse_backward(*state_->device, q, k, v, out, lse, dout, dq, dk, dv, scale,
                                  importance, options.dropout, {bias.bias, bias.dbias, qb}, ws,
                                  stream);
}

std::array<double, 3> block_sparse_attention_plan::run_timing_stages(
    const tensor_view& q, const tensor_view& k, const tensor_view& v, const tensor_view& out,
    const attention_options& options, stream_ref stream) const {
  TRISPARSE_EXPECTS_INPUT(state_->report.algo == algorithm::unfused,
                          "run_timing_stages times the unfused pipeline; this plan runs " +
                              std::string(to_string(state_->report.algo)));
  const block_sparse_mask& m = state_->mask;
  check_run_args(m, q, k, v, out, state_->report.where);
  std::array<double, 3> ms{};
  cuda::run_unfused(*state_->unfused, q, k, v, out, detail::resolve_scale(options.scale, q.dim),
                    nullptr, stream, &ms);
  return ms;
}

void block_sparse_attention_plan::refill(const device_block_mask& kept, stream_ref stream,
                                         const bool* due) const {
  TRISPARSE_EXPECTS_INPUT(state_->device != nullptr && state_->report.nnz < 0,
                          "refill: the plan was not built from a mask on the device");
  cuda::refill_block_sparse_plan(*state_->device, kept, stream, due);
}

const plan_report& block_sparse_attention_plan::report() const { return state_->report; }
const block_sparse_mask& block_sparse_attention_plan::mask() const { return state_->mask; }

}  // namespace trisparse
