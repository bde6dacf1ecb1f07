#include "trisparse/ops/block_sparse.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/block_sparse/engine.hpp"
#include "../cuda/attention/block_sparse/plan.hpp"
#include "../cuda/attention/block_sparse/unfused.hpp"
#include "arguments.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/numeric.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse {

struct block_sparse_attention_plan::state {
  block_sparse_mask mask;
  plan_report report;
  std::shared_ptr<cuda::block_sparse_device_plan> device;  // cuda_fused_block
  std::shared_ptr<cuda::unfused_device_plan> unfused;      // cuda_unfused
  // cuda_fused_bsb: the element pattern of the whole packed batch (block diagonal over the
  // sequences), one plan per mask head.
  std::vector<attention_plan> element;
};

namespace {

// Attended (query, key) pairs of one mask: per kept block, its rows' keys up to the causal limit.
std::int64_t attended_pairs(const block_sparse_mask& m) {
  std::int64_t n = 0;
  const std::int64_t g = m.block;
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    const std::int64_t lq = m.len_q(b);
    for (std::int64_t h = 0; h < m.heads; ++h) {
      const csr_graph& blocks = m.masks[b * m.heads + h].blocks;
      for (std::int64_t r = 0; r < blocks.rows; ++r) {
        for (std::int64_t e = blocks.row_ptr[r]; e < blocks.row_ptr[r + 1]; ++e) {
          const std::int64_t j0 = std::int64_t{blocks.col_idx[e]} * g;
          for (std::int64_t i = r * g; i < std::min(lq, (r + 1) * g); ++i) {
            n += std::max<std::int64_t>(0, std::min(j0 + g, m.last_key(b, i) + 1) - j0);
          }
        }
      }
    }
  }
  return n;
}

// The element pattern of mask head h over the whole batch: rows are the packed query rows, columns
// the packed key rows, sequence b's expansion placed at (cu_seqlens_q[b], cu_seqlens_k[b]).
csr_graph batch_pattern(const block_sparse_mask& m, std::int64_t h) {
  csr_graph g;
  g.rows = m.cu_seqlens_q.back();
  g.cols = m.cu_seqlens_k.back();
  for (std::int64_t b = 0; b < m.batch(); ++b) {
    const csr_graph e = m.expand(b, h);
    const auto col0 = static_cast<std::int32_t>(m.cu_seqlens_k[b]);
    for (std::int64_t r = 0; r < e.rows; ++r) {
      for (std::int64_t x = e.row_ptr[r]; x < e.row_ptr[r + 1]; ++x)
        g.col_idx.push_back(col0 + e.col_idx[x]);
      g.row_ptr.push_back(g.nnz());
    }
  }
  return g;
}

// One head of a [rows, heads, dim] view.
tensor_view head_of(const tensor_view& t, std::int64_t h) {
  tensor_view one = t;
  one.data = static_cast<std::byte*>(t.data) +
             h * t.head_stride * static_cast<std::int64_t>(size_of(t.type));
  one.heads = 1;
  return one;
}

// A block mask of lq x lk at block g with no blocks yet (row_ptr holds its first 0).
block_mask empty_block_mask(std::int64_t lq, std::int64_t lk, std::int64_t g) {
  block_mask m;
  m.rows = lq;
  m.cols = lk;
  m.block = g;
  m.blocks.rows = (lq + g - 1) / g;
  m.blocks.cols = (lk + g - 1) / g;
  m.blocks.row_ptr.assign(1, 0);
  return m;
}

// run()'s operands against the mask: shapes, devices, and the heads a mask serves.
void check_run_args(const block_sparse_mask& m, const tensor_view& q, const tensor_view& k,
                    const tensor_view& v, const tensor_view& out, device_kind where) {
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, v, out, where);
  TRISPARSE_EXPECTS_INPUT(m.heads == 1 || m.heads == q.heads,
                          "the mask has " + std::to_string(m.heads) + " heads, q " +
                              std::to_string(q.heads) + " (a mask is per head or shared)");
}

bool runs_on_cuda(algorithm a) {
  return a == algorithm::cuda_fused_block || a == algorithm::cuda_fused_bsb ||
         a == algorithm::cuda_unfused;
}

}  // namespace

block_sparse_mask topk_block_mask(const tensor_view& q, const tensor_view& k,
                                  std::span<const std::int64_t> cu_seqlens_q,
                                  std::span<const std::int64_t> cu_seqlens_k,
                                  const topk_mask_options& o) {
  TRISPARSE_EXPECTS_INPUT(o.block >= 1 && o.top_k >= 0,
                          "top-k block mask: block must be >= 1 and top_k >= 0");
  block_sparse_mask mask;
  mask.block = o.block;
  mask.heads = q.heads;
  mask.causal = o.causal;
  mask.cu_seqlens_q.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());
  mask.cu_seqlens_k.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  TRISPARSE_EXPECTS_INPUT(
      !mask.cu_seqlens_q.empty() && mask.cu_seqlens_q.size() == mask.cu_seqlens_k.size(),
      "top-k block mask: cu_seqlens_q and cu_seqlens_k need the same number "
      "(>= 1) of offsets");
  check_view(q, "q", mask.cu_seqlens_q.back(), -1, -1);
  check_view(k, "k", mask.cu_seqlens_k.back(), q.heads, q.dim);
  TRISPARSE_EXPECTS_INPUT(q.where == device_kind::cpu && k.where == device_kind::cpu,
                          "top-k block mask: q and k must be on the CPU");
  const std::int64_t g = o.block, heads = q.heads, d = q.dim;
  // Block means of one sequence and head: [blocks, d].
  const auto pooled = [&](const tensor_view& t, std::int64_t row0, std::int64_t len,
                          std::int64_t h) {
    const std::int64_t nb = (len + g - 1) / g;
    std::vector<double> m(static_cast<std::size_t>(nb * d), 0.0);
    for (std::int64_t i = 0; i < len; ++i) {
      for (std::int64_t c = 0; c < d; ++c)
        m[(i / g) * d + c] += load_as_double(t.data, t.type, t.offset(row0 + i, h, c));
    }
    for (std::int64_t blk = 0; blk < nb; ++blk) {
      const auto rows = static_cast<double>(std::min(g, len - blk * g));
      for (std::int64_t c = 0; c < d; ++c) m[blk * d + c] /= rows;
    }
    return m;
  };
  for (std::int64_t b = 0; b + 1 < static_cast<std::int64_t>(mask.cu_seqlens_q.size()); ++b) {
    const std::int64_t lq = mask.cu_seqlens_q[b + 1] - mask.cu_seqlens_q[b];
    const std::int64_t lk = mask.cu_seqlens_k[b + 1] - mask.cu_seqlens_k[b];
    TRISPARSE_EXPECTS_INPUT(
        lq >= 0 && lk >= 0,
        "top-k block mask: cu_seqlens decrease at sequence " + std::to_string(b));
    const std::int64_t nbq = (lq + g - 1) / g;
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::vector<double> qm = pooled(q, mask.cu_seqlens_q[b], lq, h),
                                km = pooled(k, mask.cu_seqlens_k[b], lk, h);
      block_mask m = empty_block_mask(lq, lk, g);
      m.blocks.row_ptr.assign(nbq + 1, 0);
      std::vector<std::pair<double, std::int32_t>> scored;
      for (std::int64_t r = 0; r < nbq; ++r) {
        // The key aligned with the block's last row (bottom right); with causal, the key blocks
        // up to it are those with a key some row of the block may see.
        const std::int64_t row = std::min(lq, (r + 1) * g) - 1, aligned = row + (lk - lq);
        const std::int64_t last = mask.last_key(b, row);
        const std::int64_t allowed = last < 0 ? 0 : last / g + 1;
        scored.clear();
        for (std::int64_t c = 0; c < allowed; ++c) {
          double s = 0;
          for (std::int64_t x = 0; x < d; ++x) s += qm[r * d + x] * km[c * d + x];
          scored.emplace_back(-s, static_cast<std::int32_t>(c));  // ascending = best first
        }
        const auto keep = static_cast<std::size_t>(std::min<std::int64_t>(o.top_k, allowed));
        std::partial_sort(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(keep),
                          scored.end());
        std::vector<std::int32_t> cols;
        for (std::size_t i = 0; i < keep; ++i) cols.push_back(scored[i].second);
        if (o.keep_diagonal && aligned >= 0 && lk > 0)  // the block holding the aligned key
          cols.push_back(static_cast<std::int32_t>(std::min(aligned, lk - 1) / g));
        std::sort(cols.begin(), cols.end());
        cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
        m.blocks.col_idx.insert(m.blocks.col_idx.end(), cols.begin(), cols.end());
        m.blocks.row_ptr[r + 1] = static_cast<std::int64_t>(m.blocks.col_idx.size());
      }
      mask.masks.push_back(std::move(m));
    }
  }
  mask.check();
  return mask;
}

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
                         : where == device_kind::cpu               ? algorithm::cpu_fused
                         : cuda::block_sparse_supports(mask.block) ? algorithm::cuda_fused_block
                                                                   : algorithm::cuda_fused_bsb;
  if (where == device_kind::cpu) {
    TRISPARSE_EXPECTS_INPUT(algo == algorithm::cpu_reference || algo == algorithm::cpu_fused,
                            "block-sparse attention on the CPU runs cpu_reference or cpu_fused, "
                            "not " +
                                std::string(to_string(algo)));
  } else {
    TRISPARSE_EXPECTS_INPUT(runs_on_cuda(algo),
                            "block-sparse attention on CUDA runs cuda_fused_block, "
                            "cuda_fused_bsb or cuda_unfused, not " +
                                std::string(to_string(algo)));
  }
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
  if (algo == algorithm::cuda_fused_block) {
    s->device = cuda::make_block_sparse_plan(mask, options.kernel, stream);
    bytes = cuda::device_bytes(*s->device);
    s->report.format += " (device, " + std::string(cuda::kernel_name(*s->device)) + ")";
  } else if (algo == algorithm::cuda_unfused) {
    s->unfused = cuda::make_unfused_plan(mask, options.workspace_heads, stream);
    bytes = cuda::device_bytes(*s->unfused);
    s->report.format += " as row-interleaved BCSR (SDDMM, softmax, SpMM; " +
                        std::to_string(cuda::score_bytes_per_head(*s->unfused)) +
                        " score bytes a head)";
  } else if (algo == algorithm::cuda_fused_bsb) {
    bytes = 0;
    plan_options o;
    o.algo = algorithm::cuda_fused_bsb;
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

std::size_t block_sparse_attention_plan::workspace_bytes(std::int64_t heads,
                                                         std::int64_t head_dim) const {
  TRISPARSE_EXPECTS_INPUT(heads >= 0 && head_dim >= 0,
                          "workspace_bytes: heads and head_dim must be >= 0");
  if (state_->unfused) return cuda::unfused_workspace_bytes(*state_->unfused, heads);
  std::size_t bytes = 0;  // cuda_fused_bsb: the element plans run one after another
  for (const attention_plan& e : state_->element)
    bytes = std::max(bytes, e.workspace_bytes(state_->mask.heads == 1 ? heads : 1, head_dim));
  return bytes;
}

void block_sparse_attention_plan::run(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const attention_options& options, stream_ref stream) const {
  run(q, k, v, out, nullptr, options, stream);
}

void block_sparse_attention_plan::run(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const workspace_view& workspace,
                                      const attention_options& options, stream_ref stream) const {
  run(q, k, v, out, &workspace, options, stream);
}

void block_sparse_attention_plan::run(const tensor_view& q, const tensor_view& k,
                                      const tensor_view& v, const tensor_view& out,
                                      const workspace_view* workspace,
                                      const attention_options& options, stream_ref stream) const {
  const block_sparse_mask& m = state_->mask;
  check_run_args(m, q, k, v, out, state_->report.where);
  const double scale = detail::resolve_scale(options.scale, q.dim);
  const algorithm algo = options.algo == algorithm::automatic ? state_->report.algo : options.algo;
  TRISPARSE_EXPECTS_INPUT(runs_on_cuda(algo) == runs_on_cuda(state_->report.algo) &&
                              (!runs_on_cuda(algo) || algo == state_->report.algo),
                          "this plan was built for " + std::string(to_string(state_->report.algo)) +
                              ", not " + std::string(to_string(algo)));
  switch (algo) {
    case algorithm::cpu_reference:
      reference::block_sparse_attention(m, q, k, v, out, scale);
      return;
    case algorithm::cpu_fused:
      cpu::block_sparse_attention_unchecked(m, q, k, v, out, static_cast<float>(scale));
      return;
    case algorithm::cuda_fused_block:
      cuda::run_block_sparse(*state_->device, q, k, v, out, scale, stream);
      return;
    case algorithm::cuda_unfused:
      cuda::run_unfused(*state_->unfused, q, k, v, out, scale, workspace, stream);
      return;
    case algorithm::cuda_fused_bsb: {
      attention_options o = options;
      o.algo = algorithm::automatic;
      o.scale = scale;
      const auto run_one = [&](const attention_plan& e, const tensor_view& eq,
                               const tensor_view& ek, const tensor_view& ev,
                               const tensor_view& eo) {
        if (workspace != nullptr)
          e.run(eq, ek, ev, eo, *workspace, o, stream);
        else
          e.run(eq, ek, ev, eo, o, stream);
      };
      if (m.heads == 1) {
        run_one(state_->element.front(), q, k, v, out);
        return;
      }
      for (std::int64_t h = 0; h < m.heads; ++h) {
        run_one(state_->element[static_cast<std::size_t>(h)], head_of(q, h), head_of(k, h),
                head_of(v, h), head_of(out, h));
      }
      return;
    }
    default:
      throw invalid_input("block-sparse attention cannot run " + std::string(to_string(algo)));
  }
}

std::array<double, 3> block_sparse_attention_plan::run_timing_stages(
    const tensor_view& q, const tensor_view& k, const tensor_view& v, const tensor_view& out,
    const attention_options& options, stream_ref stream) const {
  TRISPARSE_EXPECTS_INPUT(state_->report.algo == algorithm::cuda_unfused,
                          "run_timing_stages times the cuda_unfused pipeline; this plan runs " +
                              std::string(to_string(state_->report.algo)));
  const block_sparse_mask& m = state_->mask;
  check_run_args(m, q, k, v, out, state_->report.where);
  std::array<double, 3> ms{};
  cuda::run_unfused(*state_->unfused, q, k, v, out, detail::resolve_scale(options.scale, q.dim),
                    nullptr, stream, &ms);
  return ms;
}

const plan_report& block_sparse_attention_plan::report() const { return state_->report; }
const block_sparse_mask& block_sparse_attention_plan::mask() const { return state_->mask; }

// --- top-k masks selected on the device ------------------------------------------------------

struct topk_block_sparse_plan::state {
  std::shared_ptr<cuda::topk_device_plan> device;
  block_sparse_mask shape;  // lengths, heads, block, causality; no blocks
  std::int64_t slots = 0;
  bool selected = false;
  plan_report report;
};

namespace {

// The top-k plan's mask before any selection: every block row holds `slots` ascending values,
// its first allowed blocks and then, past them (fill_past = true), the sequence's key-block count;
// with fill_past = false only the allowed ones (a mask check() accepts).
block_sparse_mask topk_rows(const block_sparse_mask& shape, std::int64_t slots, bool fill_past) {
  block_sparse_mask m = shape;
  m.masks.clear();
  const std::int64_t g = shape.block;
  for (std::int64_t b = 0; b < shape.batch(); ++b) {
    const std::int64_t lq = shape.len_q(b), lk = shape.len_k(b);
    const std::int64_t nbq = (lq + g - 1) / g, nbk = (lk + g - 1) / g;
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      block_mask bm = empty_block_mask(lq, lk, g);
      for (std::int64_t r = 0; r < nbq; ++r) {
        const std::int64_t last = shape.last_key(b, std::min(lq, (r + 1) * g) - 1);
        const std::int64_t allowed = last < 0 ? 0 : last / g + 1;
        for (std::int64_t i = 0; i < slots; ++i) {
          if (i < allowed)
            bm.blocks.col_idx.push_back(static_cast<std::int32_t>(i));
          else if (fill_past)
            bm.blocks.col_idx.push_back(static_cast<std::int32_t>(nbk));
        }
        bm.blocks.row_ptr.push_back(bm.blocks.nnz());
      }
      m.masks.push_back(std::move(bm));
    }
  }
  return m;
}

}  // namespace

topk_block_sparse_plan topk_block_sparse_plan::build(std::span<const std::int64_t> cu_seqlens_q,
                                                     std::span<const std::int64_t> cu_seqlens_k,
                                                     std::int64_t heads, std::int64_t head_dim,
                                                     const topk_mask_options& options,
                                                     const block_sparse_plan_options& plan_options,
                                                     stream_ref stream) {
  const auto t0 = std::chrono::steady_clock::now();
  TRISPARSE_EXPECTS_INPUT(options.block >= 1 && options.top_k >= 0 && heads >= 1 && head_dim >= 1,
                          "top-k plan: block, heads and head_dim must be >= 1 and top_k >= 0");
  TRISPARSE_EXPECTS_INPUT(
      plan_options.algo == algorithm::automatic || plan_options.algo == algorithm::cuda_fused_block,
      "top-k plans run cuda_fused_block, not " + std::string(to_string(plan_options.algo)));
  if (!cuda::block_sparse_supports(options.block)) {
    throw not_supported("top-k plans take blocks that are multiples of 16, not " +
                        std::to_string(options.block));
  }
  auto s = std::make_shared<state>();
  s->shape.block = options.block;
  s->shape.heads = heads;
  s->shape.causal = options.causal;
  s->shape.cu_seqlens_q.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());
  s->shape.cu_seqlens_k.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  s->slots = options.top_k + (options.keep_diagonal ? 1 : 0);
  topk_rows(s->shape, s->slots, false).check();  // the offsets, through the mask's own checks
  s->device = cuda::make_topk_plan(topk_rows(s->shape, s->slots, true), options.top_k,
                                   options.keep_diagonal, head_dim, plan_options.kernel, stream);
  s->report.algo = algorithm::cuda_fused_block;
  s->report.where = device_kind::cuda;
  s->report.rows = s->shape.cu_seqlens_q.back();
  s->report.cols = s->shape.cu_seqlens_k.back();
  s->report.format =
      "top-" + std::to_string(options.top_k) + " block mask G=" + std::to_string(options.block) +
      " selected on the device (" + cuda::kernel_name(cuda::attention_of(*s->device)) + ")";
  s->report.format_bytes = cuda::device_bytes(cuda::attention_of(*s->device));
  s->report.build_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  topk_block_sparse_plan plan;
  plan.state_ = std::move(s);
  return plan;
}

void topk_block_sparse_plan::select(const tensor_view& q, const tensor_view& k, stream_ref stream) {
  cuda::select_topk(*state_->device, q, k, stream);
  state_->selected = true;
}

void topk_block_sparse_plan::run(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                                 const tensor_view& out, const attention_options& options,
                                 stream_ref stream) const {
  const block_sparse_mask& m = state_->shape;
  detail::check_attention_args(m.cu_seqlens_q.back(), m.cu_seqlens_k.back(), q, k, v, out,
                               device_kind::cuda);
  TRISPARSE_EXPECTS_INPUT(state_->selected, "top-k plan: select() the mask before run()");
  TRISPARSE_EXPECTS_INPUT(q.heads == m.heads, "the plan has " + std::to_string(m.heads) +
                                                  " heads, q " + std::to_string(q.heads));
  TRISPARSE_EXPECTS_INPUT(
      options.algo == algorithm::automatic || options.algo == algorithm::cuda_fused_block,
      "top-k plans run cuda_fused_block, not " + std::string(to_string(options.algo)));
  cuda::run_block_sparse(cuda::attention_of(*state_->device), q, k, v, out,
                         detail::resolve_scale(options.scale, q.dim), stream);
}

block_sparse_mask topk_block_sparse_plan::mask(stream_ref stream) const {
  TRISPARSE_EXPECTS_INPUT(state_->selected, "top-k plan: select() the mask before mask()");
  const std::vector<std::int32_t> slots = cuda::download_blocks(*state_->device, stream);
  block_sparse_mask m = topk_rows(state_->shape, 0, false);
  std::size_t at = 0;
  for (block_mask& bm : m.masks) {
    bm.blocks.row_ptr.assign(1, 0);
    for (std::int64_t r = 0; r < bm.blocks.rows; ++r) {
      for (std::int64_t i = 0; i < state_->slots; ++i, ++at)
        if (slots[at] < bm.blocks.cols) bm.blocks.col_idx.push_back(slots[at]);
      bm.blocks.row_ptr.push_back(bm.blocks.nnz());
    }
  }
  m.check();
  return m;
}

const plan_report& topk_block_sparse_plan::report() const { return state_->report; }

}  // namespace trisparse
