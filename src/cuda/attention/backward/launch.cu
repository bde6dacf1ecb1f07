// The CUDA attention backward and row-wise forward (plan.hpp): the per-row terms (D and the
// log-sum-exp), a pass over the pattern's rows (dq) and one over the transposed pattern's rows
// (dk, dv), on the tensor cores (tensor_core.cuh) or a warp per work chunk and head group
// (cuda_core.cuh), fp32 accumulation. Rows longer than kChunkEntries are cut into chunks whose
// partial sums a reduction adds in chunk order: deterministic, and a hub spreads over many warps.
#include <cuda_runtime.h>
#include <thrust/binary_search.h>
#include <thrust/execution_policy.h>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <cmath>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../../common/workspace_layout.hpp"
#include "../../common/buffer.cuh"
#include "../../common/convert.cuh"
#include "../../common/current_device.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/gather_reuse.hpp"
#include "../../formats/bsb_build.cuh"
#include "../../formats/window_sort.cuh"
#include "cuda_core.cuh"
#include "device.cuh"
#include "plan.hpp"
#include "slots.cuh"
#include "tensor_core.cuh"
#include "trisparse/formats/bsb.hpp"
#include "tuning.hpp"

namespace trisparse::cuda {

namespace attention_backward {

// One pass's pattern (the pattern or its transpose) and its work chunks, on the device.
struct pass {
  device_buffer<std::int32_t> col_idx;
  device_buffer<chunk> chunks;
  device_buffer<split_row> splits;
  std::int64_t slots = 0;  // partial rows
};

// The window chunks of one pass at one chunk size, and their partial rows (16 per chunk of a cut
// window).
struct tc_work {
  device_buffer<tc_chunk> chunks;
  std::int64_t slots = 0;
};

// One pass's BSB (16x8 TCBs) and its window chunks for the tensor-core kernels, at two sizes:
// fine for runs of few heads (balance), coarse for many (fewer partial rows; tuning.hpp); the
// slots of its entries (slots.cuh). The windows take the rows in the order of `row_of` where it
// is set (RCM, where it cuts the pass's TCBs: ops/attention.cpp), else in the rows' own.
struct tc_pass {
  device_buffer<std::int64_t> tcb_offset;  // [windows + 1]
  device_buffer<std::int32_t> row_of;      // [rows]: the row at each window position, or empty
  device_buffer<std::int32_t> col_idx;
  device_buffer<std::uint64_t> bitmap;
  device_buffer<std::int32_t> first_slot;  // [tcbs]
  device_buffer<std::int32_t> target;      // [nnz]: the dk/dv pass's slots (the dq pass only)
  device_buffer<std::int32_t> entry;       // [nnz]: the entry at each slot (the dq pass only)
  tc_work fine, coarse;
  gather_reuse reuse;  // the windows' reuse distances (plans from host patterns): the task order
  std::int64_t tcbs() const { return static_cast<std::int64_t>(bitmap.size() / 2); }
  const tc_work& work(std::int64_t heads) const {
    return heads >= kCoarseFromHeads ? coarse : fine;
  }
};

}  // namespace attention_backward

struct attention_backward_device_plan {
  std::int64_t rows = 0, cols = 0, nnz = 0;
  head_order heads = head_order::automatic;  // the tensor-core passes' task order
  device_buffer<std::int64_t> row_ptr;       // A's offsets (the log-sum-exp recompute)
  device_buffer<std::int64_t> column_entry;  // A's entry of each of A^T's (a bias's reads)
  attention_backward::pass row, transposed;  // over A's rows (dq), over A^T's rows (dk, dv)
  attention_backward::tc_pass tc_row, tc_transposed;  // the same over A's and A^T's BSB windows
  bool symmetric = false;  // A == A^T (a mini-batch's blocks): the A^T passes are A's
  const attention_backward::pass& column() const { return symmetric ? row : transposed; }
  const attention_backward::tc_pass& tc_column() const {
    return symmetric ? tc_row : tc_transposed;
  }
};

namespace {

using namespace attention_backward;

struct workspace_segments {
  detail::workspace_layout layout;
  std::size_t lse = 0, delta = 0, dq = 0, dk = 0, dv = 0, dout = 0, pds = 0, arrivals = 0;
  std::size_t row_arrivals = 0;  // the dq pass's counters; the dk/dv pass's follow them
};

// pdim: floats per partial row (the larger head dim of q and v). An f32 backward never takes
// the tensor-core kernels: no room for their partial rows, rounded dout, P and dS.
workspace_segments segments(const attention_backward_device_plan& plan, std::int64_t heads,
                            std::int64_t pdim, dtype type) {
  const bool tensor_core = type == dtype::f16 || type == dtype::bf16;
  workspace_segments w;
  if (tensor_core) {
    // A counter per cut window and head for each tensor-core pass (16 partial rows per chunk of a
    // cut window), zero when the passes start (the layout's zeroed segment).
    w.row_arrivals =
        static_cast<std::size_t>(plan.tc_row.work(heads).slots / bsb::kRowWindow * heads);
    const auto column_arrivals =
        static_cast<std::size_t>(plan.tc_column().work(heads).slots / bsb::kRowWindow * heads);
    w.arrivals = w.layout.add_zeroed((w.row_arrivals + column_arrivals) * sizeof(std::uint32_t));
  }
  const auto n = static_cast<std::size_t>(plan.rows * heads) * sizeof(float);
  const auto row = static_cast<std::size_t>(heads * pdim) * sizeof(float);
  w.lse = w.layout.add(n);
  w.delta = w.layout.add(n);
  // One kernel family runs per call: room for the partial rows of either.
  const auto row_slots = static_cast<std::size_t>(
      std::max(plan.row.slots, tensor_core ? plan.tc_row.work(heads).slots : 0));
  const auto col_slots = static_cast<std::size_t>(
      std::max(plan.column().slots, tensor_core ? plan.tc_column().work(heads).slots : 0));
  w.dq = w.layout.add(row_slots * row);
  w.dk = w.layout.add(col_slots * row);
  w.dv = w.layout.add(col_slots * row);
  // The tensor-core kernels' 16-bit copy of an f32 dout.
  if (!tensor_core) return w;
  w.dout = w.layout.add(static_cast<std::size_t>(plan.rows * heads * pdim) * 2);
  // The tensor-core dq pass's P and dS for the dk/dv pass: a 32-bit word per entry and head.
  w.pds = w.layout.add(static_cast<std::size_t>(plan.nnz * heads) * sizeof(std::uint32_t));
  return w;
}

// The row-wise forward's: the cut rows' chunk accumulators (in segment dq) and their (max, sum)
// (in segment lse).
workspace_segments forward_segments(const attention_backward_device_plan& plan, std::int64_t heads,
                                    std::int64_t pdim) {
  workspace_segments w;
  const auto slots = static_cast<std::size_t>(plan.row.slots * heads);
  w.dq = w.layout.add(slots * static_cast<std::size_t>(pdim) * sizeof(float));
  w.lse = w.layout.add(slots * 2 * sizeof(float));
  return w;
}

unsigned grid_of(std::int64_t items) {
  return static_cast<unsigned>((items + kWarps - 1) / kWarps);
}

// The pattern's rows as work: one chunk per row of at most kChunkEntries entries (empty rows
// too: they write zeros), kChunkEntries-entry chunks of longer rows. `row_ptr` on the host,
// `col_idx` the pattern's columns on the device.
pass make_pass(std::span<const std::int64_t> row_ptr, device_buffer<std::int32_t> col_idx) {
  std::vector<chunk> chunks;
  std::vector<split_row> splits;
  std::int32_t slots = 0;
  const auto rows = static_cast<std::int64_t>(row_ptr.size()) - 1;
  chunks.reserve(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t begin = row_ptr[r], end = row_ptr[r + 1];
    const auto row = static_cast<std::int32_t>(r);
    if (end - begin <= kChunkEntries) {
      chunks.push_back({row, -1, begin, end});
      continue;
    }
    const auto n = static_cast<std::int32_t>((end - begin + kChunkEntries - 1) / kChunkEntries);
    splits.push_back({row, slots, n, 0});
    for (std::int32_t c = 0; c < n; ++c) {
      const std::int64_t b = begin + static_cast<std::int64_t>(c) * kChunkEntries;
      chunks.push_back({row, slots + c, b, std::min(end, b + kChunkEntries)});
    }
    slots += n;
  }
  pass p;
  p.col_idx = std::move(col_idx);
  p.chunks = device_buffer<chunk>(chunks);
  p.splits = device_buffer<split_row>(splits);
  p.slots = slots;
  return p;
}

// The BSB windows as work: one chunk per window of at most `size` TCBs (empty windows too: they
// write zeros), `size`-TCB chunks of larger windows with partial rows (row r of chunk c at
// first + r * n + c), which the last of them to finish adds up (tensor_core.cuh). `largest_first`:
// the chunks stably sorted by size, as the forward orders its items, so that the long chains do not
// start last and set the tail; else the cut windows' chunks first, the rest in window order (whose
// neighbours share columns in L2). Nothing depends on the order (a chunk's slots and counter are
// its own).
tc_work make_tc_work(std::span<const std::int64_t> tcb_offset, std::int64_t size,
                     bool largest_first) {
  std::vector<tc_chunk> chunks;
  std::int32_t slots = 0;
  const auto windows = static_cast<std::int64_t>(tcb_offset.size()) - 1;
  chunks.reserve(static_cast<std::size_t>(windows));
  for (std::int64_t w = 0; w < windows; ++w) {
    const std::int64_t begin = tcb_offset[w], end = tcb_offset[w + 1];
    const auto window = static_cast<std::int32_t>(w);
    if (end - begin <= size) {
      chunks.push_back({window, -1, 0, 0, begin, end});
      continue;
    }
    const auto n = static_cast<std::int32_t>((end - begin + size - 1) / size);
    for (std::int32_t c = 0; c < n; ++c) {
      const std::int64_t from = begin + static_cast<std::int64_t>(c) * size;
      chunks.push_back({window, slots + c, n, c, from, std::min(end, from + size)});
    }
    slots += bsb::kRowWindow * n;
  }
  if (largest_first)
    std::stable_sort(chunks.begin(), chunks.end(), [](const tc_chunk& a, const tc_chunk& b) {
      return a.end - a.begin > b.end - b.begin;
    });
  else
    std::stable_partition(chunks.begin(), chunks.end(),
                          [](const tc_chunk& c) { return c.slot >= 0; });
  tc_work work;
  work.chunks = device_buffer<tc_chunk>(chunks);
  work.slots = slots;
  return work;
}

// A pattern's BSB (`tcb_offset` on the host, columns and bitmap on the device) and its work at
// both chunk sizes: kChunkTcbs, or the TCBs over chunks_per_sm x `sms` chunks where more.
tc_pass make_tc_pass(std::span<const std::int64_t> tcb_offset,
                     device_buffer<std::int64_t> device_offset, device_buffer<std::int32_t> col_idx,
                     device_buffer<std::uint64_t> bitmap, std::int64_t sms) {
  const auto size = [&](std::int64_t per_sm) {
    const std::int64_t target = sms * per_sm;
    return std::max<std::int64_t>(kChunkTcbs, (tcb_offset.back() + target - 1) / target);
  };
  tc_pass p;
  p.tcb_offset = std::move(device_offset);
  p.col_idx = std::move(col_idx);
  p.bitmap = std::move(bitmap);
  p.fine = make_tc_work(tcb_offset, size(kFineChunksPerSm), true);
  p.coarse = make_tc_work(tcb_offset, size(kCoarseChunksPerSm), kCoarseLargestFirst);
  return p;
}

// `order` (empty: the rows' own): the row placed at each window position; `l2_bytes`: the
// device's L2 (the task order, gather_reuse.hpp).
tc_pass make_tc_pass(const csr_graph& g, std::int64_t sms, std::int64_t l2_bytes,
                     std::span<const std::int64_t> order) {
  const bsb b = build_bsb(order.empty() ? g : select_rows(g, order), 8);
  tc_pass p = make_tc_pass(b.tcb_offset, device_buffer<std::int64_t>(b.tcb_offset),
                           device_buffer<std::int32_t>(b.col_idx),
                           device_buffer<std::uint64_t>(b.bitmap), sms);
  if (!order.empty())
    p.row_of = device_buffer<std::int32_t>(std::vector<std::int32_t>(order.begin(), order.end()));
  p.reuse = gather_reuse_of(g, order);
  settle_head_orders(p.reuse, l2_bytes);
  return p;
}

// Whether the tensor-core kernels take these tensors: 16-bit q, k, v of one head dim in
// {32, 64, 128}, every row 16-byte aligned (fragments move in 16-byte runs).
bool tensor_core_eligible(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                          const tensor_view& out, const tensor_view& dout, const tensor_view& dq,
                          const tensor_view& dk, const tensor_view& dv) {
  if (q.type != dtype::f16 && q.type != dtype::bf16) return false;
  if (k.dim != q.dim || v.dim != q.dim || (q.dim != 32 && q.dim != 64 && q.dim != 128) ||
      !head_dim_built(static_cast<int>(q.dim)))
    return false;
  for (const tensor_view* t : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) {
    const auto bytes = static_cast<std::int64_t>(size_of(t->type));
    if (reinterpret_cast<std::uintptr_t>(t->data) % 16 != 0 || (t->row_stride * bytes) % 16 != 0 ||
        (t->head_stride * bytes) % 16 != 0)
      return false;
  }
  return true;
}

// dq, dk, dv (or their partial rows) on the tensor-core kernels: the per-row terms from `out`
// and `lse` in the dq pass where out.data is set, else already in `terms`.
template <class T, class G>
void run_tensor_core(const attention_backward_device_plan& plan, const tensor_view& q,
                     const tensor_view& k, const tensor_view& v, view<const T> dout,
                     view<const T> out, view<const float> lse, const tensor_view& dq,
                     const tensor_view& dk, const tensor_view& dv, row_terms terms,
                     std::uint32_t* pds, partials dq_part, partials dk_part, partials dv_part,
                     std::uint32_t* row_arrivals, std::uint32_t* column_arrivals, float scale,
                     tc_bias bias, cudaStream_t s) {
  const auto heads = static_cast<int>(q.heads);
  const float scale_log2 = scale * kLog2e;
  const auto args = [&](const tc_pass& pass, std::int64_t rows, std::uint32_t* arrivals) {
    const tc_work& work = pass.work(heads);
    return tc_args{pass.col_idx.data(),
                   pass.bitmap.data(),
                   work.chunks.data(),
                   static_cast<std::int64_t>(work.chunks.size()),
                   rows,
                   pass.row_of.data(),
                   heads,
                   scale,
                   scale_log2,
                   pass.first_slot.data(),
                   pass.target.data(),
                   pds,
                   plan.nnz,
                   arrivals,
                   heads_outer(plan.heads, pass.reuse, heads, q.dim)};
  };
  const tc_args row = args(plan.tc_row, plan.rows, row_arrivals),
                column = args(plan.tc_column(), plan.cols, column_arrivals);
  with_head_dim<32, 64, 128>(q.dim, "attention backward", [&]<int D>() {
    if (row.n_chunks * heads > 0) {
      const auto launch = [&]<bool kBias>() {
        tc_row_pass<T, G, D, kBias><<<grid_of(row.n_chunks * heads), kWarps * 32, 0, s>>>(
            row, view_of<const T>(q), view_of<const T>(k), view_of<const T>(v), dout, out, lse,
            terms, view_of<G>(dq), dq_part, bias);
        TRISPARSE_CUDA_CHECK_LAUNCH();
      };
      if (bias.bias != nullptr || bias.dbias != nullptr)
        launch.template operator()<true>();
      else
        launch.template operator()<false>();
    }
    if (column.n_chunks * heads > 0) {
      tc_column_pass<T, G, D><<<grid_of(column.n_chunks * heads), kWarps * 32, 0, s>>>(
          column, view_of<const T>(q), dout, view_of<G>(dk), view_of<G>(dv), dk_part, dv_part);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
  });
}

// The CUDA-core kernels' head layout: width max(q, v), vectors of up to 4 elements while a lane
// holds at most 4 floats of a head (heads up to 128 wide); wider heads take V = 1, 8 floats a lane.
struct core_layout {
  lanes l;
  int vec = 1;
};

core_layout core_layout_of(const tensor_view& q, const tensor_view& v,
                           std::initializer_list<const tensor_view*> ts) {
  const auto heads = static_cast<int>(q.heads), wq = static_cast<int>(q.dim),
             wv = static_cast<int>(v.dim);
  core_layout c;
  c.vec = head_lanes::vector_of(heads, {wq, wv}, 4, ts);
  c.l = head_lanes::layout_of(heads, std::max(wq, wv), c.vec);
  if (c.l.chunks * c.vec > 4) {
    c.vec = 1;
    c.l = head_lanes::layout_of(heads, std::max(wq, wv), 1);
  }
  return c;
}

// Calls f.template operator()<V, F>() for the layout's vector width and floats a lane.
template <class Fn>
void with_core_lanes(const core_layout& c, Fn&& f) {
  with_value<1, 2, 4>(c.vec, "the CUDA-core attention's vector width", [&]<int V>() {
    if constexpr (V == 1) {
      if (c.l.chunks > 4) {
        f.template operator()<1, 8>();
        return;
      }
    }
    f.template operator()<V, 4>();
  });
}

core_params core_base(const core_layout& c, const tensor_view& q, const tensor_view& k,
                      const tensor_view& v, double scale) {
  core_params p;
  p.l = c.l;
  p.wq = static_cast<int>(q.dim);
  p.wv = static_cast<int>(v.dim);
  p.q = head_lanes::in(q);
  p.k = head_lanes::in(k);
  p.v = head_lanes::in(v);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kCoreLog2e;
  return p;
}

// The cut lines' partial rows `part` (`width` wide) added in chunk order into `out`.
template <class G, int V, int F>
void launch_reduce(core_params p, const device_buffer<split_row>& splits, const float* part,
                   const tensor_view& out, float factor, cudaStream_t s) {
  p.splits = splits.data();
  p.n_splits = static_cast<std::int64_t>(splits.size());
  if (p.n_splits == 0) return;
  core_reduce<G, V, F><<<grid_of(p.n_splits * p.l.groups), kWarps * 32, 0, s>>>(
      p, part, head_lanes::out_of(out), static_cast<int>(out.dim), factor);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

void set_work(core_params& p, const pass& work) {
  p.chunks = work.chunks.data();
  p.n_chunks = static_cast<std::int64_t>(work.chunks.size());
  p.col = work.col_idx.data();
  p.splits = work.splits.data();
  p.n_splits = static_cast<std::int64_t>(work.splits.size());
}

// A bias (score_bias::bias) and its gradient for the CUDA-core kernels.
void set_bias(core_params& p, const tensor_view& bias, const tensor_view& dbias,
              const attention_backward_device_plan& plan) {
  if (bias.data != nullptr) {
    TRISPARSE_EXPECTS_INPUT(
        bias.type == dtype::f32 && bias.rows == plan.nnz,
        "the CUDA attention takes the bias as f32 [nnz, H or 1, 1], not " + bias.describe());
    p.bias = static_cast<const float*>(bias.data);
    p.bias_rs = bias.row_stride;
    p.bias_hs = bias.heads == 1 ? 0 : bias.head_stride;
    p.entry = plan.column_entry.data();
  }
  if (dbias.data != nullptr) {
    TRISPARSE_EXPECTS_INPUT(
        dbias.type == dtype::f32 && dbias.rows == plan.nnz,
        "the CUDA attention backward writes dbias as f32 [nnz, H, 1], not " + dbias.describe());
    p.dbias = static_cast<float*>(dbias.data);
    p.dbias_rs = dbias.row_stride;
    p.dbias_hs = dbias.head_stride;
  }
}

void check_dims(const tensor_view& q, const tensor_view& v, const char* what) {
  TRISPARSE_EXPECTS_INPUT(q.dim <= kMaxHeadDim && v.dim <= kMaxHeadDim,
                          std::string(what) + " takes head dims up to " +
                              std::to_string(kMaxHeadDim) + ", not " +
                              std::to_string(std::max(q.dim, v.dim)));
}

// The tensor-core passes' slot maps (slots.cuh), from the pattern's CSR on the device.
void link_slots(attention_backward_device_plan& p, cudaStream_t s) {
  tc_pass& row = p.tc_row;
  tc_pass& column = p.symmetric ? p.tc_row : p.tc_transposed;
  row.first_slot = first_slots(row.bitmap.data(), row.tcbs(), s);
  if (!p.symmetric) column.first_slot = first_slots(column.bitmap.data(), column.tcbs(), s);
  row.target = device_buffer<std::int32_t>(static_cast<std::size_t>(p.nnz));
  row.entry = device_buffer<std::int32_t>(static_cast<std::size_t>(p.nnz));
  if (p.nnz == 0) return;
  device_buffer<std::int32_t> slot_of(static_cast<std::size_t>(p.nnz), s);
  const auto windows = [](const tc_pass& t) {
    return static_cast<std::int64_t>(t.tcb_offset.size()) - 1;
  };
  pattern_slots<<<build_blocks(row.tcbs()), kBuildThreads, 0, s>>>(
      row.tcb_offset.data(), windows(row), row.col_idx.data(), row.bitmap.data(),
      row.first_slot.data(), row.tcbs(), row.row_of.data(), p.row_ptr.data(), p.row.col_idx.data(),
      slot_of.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  invert_slots<<<build_blocks(p.nnz), kBuildThreads, 0, s>>>(slot_of.data(), p.nnz,
                                                             row.entry.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
  transposed_targets<<<build_blocks(column.tcbs()), kBuildThreads, 0, s>>>(
      column.tcb_offset.data(), windows(column), column.col_idx.data(), column.bitmap.data(),
      column.first_slot.data(), column.tcbs(), column.row_of.data(), p.row_ptr.data(),
      p.row.col_idx.data(), slot_of.data(), row.target.data());
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::shared_ptr<attention_backward_device_plan> make_attention_backward_plan(
    const csr_graph& pattern, const csr_graph& transposed,
    std::span<const std::int64_t> transposed_entry, stream_ref stream,
    std::span<const std::int64_t> row_order, std::span<const std::int64_t> column_order,
    head_order heads) {
  TRISPARSE_EXPECTS_INPUT(transposed.rows == pattern.cols && transposed.cols == pattern.rows &&
                              transposed.nnz() == pattern.nnz() &&
                              transposed_entry.size() == static_cast<std::size_t>(pattern.nnz()),
                          "the transposed pattern does not match the pattern");
  TRISPARSE_EXPECTS_INPUT(
      (row_order.empty() || std::cmp_equal(row_order.size(), pattern.rows)) &&
          (column_order.empty() || std::cmp_equal(column_order.size(), pattern.cols)),
      "the backward's window orders must hold every row of the pattern and of its transpose");
  auto p = std::make_shared<attention_backward_device_plan>();
  p->rows = pattern.rows;
  p->cols = pattern.cols;
  p->nnz = pattern.nnz();
  // A symmetric pattern (a batch of graphs attending within each) is its own transpose: its
  // column passes are its row passes, built once.
  p->symmetric = transposed.row_ptr == pattern.row_ptr && transposed.col_idx == pattern.col_idx;
  p->row = make_pass(pattern.row_ptr, device_buffer<std::int32_t>(pattern.col_idx));
  if (!p->symmetric)
    p->transposed = make_pass(transposed.row_ptr, device_buffer<std::int32_t>(transposed.col_idx));
  p->heads = heads;
  const std::int64_t sms = std::max(current_device().sms, 1), l2_bytes = current_l2_bytes();
  p->tc_row = make_tc_pass(pattern, sms, l2_bytes, row_order);
  if (!p->symmetric) p->tc_transposed = make_tc_pass(transposed, sms, l2_bytes, column_order);
  p->row_ptr = device_buffer<std::int64_t>(pattern.row_ptr);
  p->column_entry = device_buffer<std::int64_t>(
      std::vector<std::int64_t>(transposed_entry.begin(), transposed_entry.end()));
  link_slots(*p, static_cast<cudaStream_t>(stream.handle));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  return p;
}

namespace {

// entry_row[e] = the row of entry e (a warp per row); flags |= 1 where a row's columns do not
// strictly increase.
__global__ void rows_of_entries(const std::int64_t* row_ptr, const std::int32_t* col,
                                std::int64_t rows, std::int32_t* entry_row, int* flags) {
  const std::int64_t r = (blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x) / 32;
  if (r >= rows) return;
  const std::int64_t begin = row_ptr[r], end = row_ptr[r + 1];
  bool bad = false;
  for (std::int64_t e = begin + threadIdx.x % 32; e < end; e += 32) {
    entry_row[e] = static_cast<std::int32_t>(r);
    bad |= e > begin && col[e] <= col[e - 1];
  }
  if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) atomicOr(flags, 1);
}

__global__ void iota64(std::int64_t* out, std::int64_t n) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n) out[i] = i;
}

// The transpose's offsets: offset[c] = the first sorted entry whose column is >= c.
__global__ void column_offsets(const std::uint32_t* sorted_cols, std::int64_t nnz,
                               std::int64_t cols, std::int64_t* offset) {
  const std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (c > cols) return;
  offset[c] = thrust::lower_bound(thrust::seq, sorted_cols, sorted_cols + nnz, c,
                                  [](std::uint32_t col, std::int64_t x) {
                                    return static_cast<std::int64_t>(col) < x;
                                  }) -
              sorted_cols;
}

__global__ void gather_rows(const std::int64_t* entry, const std::int32_t* entry_row,
                            std::int64_t nnz, std::int32_t* out) {
  const std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (t < nnz) out[t] = entry_row[entry[t]];
}

// A square pattern taken as its own transpose: entry t = (c, r) finds its mirror (r, c) by a
// binary search of row r's (increasing) columns; mirror[t] is its index, the transposed entry's
// entry of the pattern. flags |= 1 where some mirror is missing (the pattern is not symmetric).
__global__ void mirror_entries(const std::int64_t* row_ptr, const std::int32_t* col,
                               const std::int32_t* entry_row, std::int64_t nnz,
                               std::int64_t* mirror, int* flags) {
  const std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (t >= nnz) return;
  const std::int32_t c = entry_row[t], r = col[t];
  const std::int64_t lo = lower_entry(row_ptr, col, r, c);
  if (lo < row_ptr[r + 1] && col[lo] == c)
    mirror[t] = lo;
  else
    atomicOr(flags, 1);
}

template <class T>
device_buffer<T> device_copy(const T* from, std::int64_t n, cudaStream_t s) {
  device_buffer<T> out(static_cast<std::size_t>(n));
  if (n > 0)
    TRISPARSE_CUDA_TRY(cudaMemcpyAsync(out.data(), from, out.bytes(), cudaMemcpyDeviceToDevice, s));
  return out;
}

template <class T>
std::vector<T> host_copy(const T* from, std::int64_t n, cudaStream_t s) {
  std::vector<T> out(static_cast<std::size_t>(n));
  if (n > 0) {
    TRISPARSE_CUDA_TRY(
        cudaMemcpyAsync(out.data(), from, out.size() * sizeof(T), cudaMemcpyDeviceToHost, s));
  }
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return out;
}

int read_flag(const device_buffer<int>& flag, cudaStream_t s) {
  return host_copy(flag.data(), 1, s)[0];
}

// The tensor-core pass of a pattern in device memory: its BSB built there, the window offsets
// brought to the host to cut the work.
tc_pass device_tc_pass(const csr_view& g, std::int64_t sms, cudaStream_t s) {
  device_bsb b = build_bsb_device(g, s, true, false);
  const std::vector<std::int64_t> offsets = host_copy(b.tcb_offset.data(), b.windows + 1, s);
  return make_tc_pass(offsets, std::move(b.tcb_offset), std::move(b.col_idx), std::move(b.bitmap),
                      sms);
}

}  // namespace

std::shared_ptr<attention_backward_device_plan> make_attention_backward_plan(
    const csr_view& pattern, stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  check_csr_view(pattern, s);
  TRISPARSE_EXPECTS_INPUT(
      pattern.nnz < (std::int64_t{1} << 31) && pattern.cols < (std::int64_t{1} << 31),
      "a plan with gradients from a device pattern takes fewer than 2^31 "
      "entries and columns");
  const std::int64_t rows = pattern.rows, cols = pattern.cols, nnz = pattern.nnz;
  const auto n = static_cast<std::size_t>(nnz);
  // Temporaries are stream-ordered: freed without a device synchronisation.
  device_buffer<int> flag(1, s);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(flag.data(), 0, sizeof(int), s));
  device_buffer<std::int32_t> entry_row(n, s);
  if (rows > 0) {
    rows_of_entries<<<build_blocks(rows * 32), kBuildThreads, 0, s>>>(
        pattern.row_ptr, pattern.col_idx, rows, entry_row.data(), flag.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  if (read_flag(flag, s) != 0) {
    throw invalid_input(
        "CSR view: a plan with gradients needs each row's columns strictly increasing (sorted, "
        "no repeats)");
  }
  auto p = std::make_shared<attention_backward_device_plan>();
  p->rows = rows;
  p->cols = cols;
  p->nnz = nnz;
  p->column_entry = device_buffer<std::int64_t>(n);
  // A square pattern is tried as its own transpose first (a mini-batch's blocks are): each
  // entry's mirror found by a binary search, no sort.
  p->symmetric = rows == cols;
  if (p->symmetric && nnz > 0) {
    mirror_entries<<<build_blocks(nnz), kBuildThreads, 0, s>>>(pattern.row_ptr, pattern.col_idx,
                                                               entry_row.data(), nnz,
                                                               p->column_entry.data(), flag.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    p->symmetric = read_flag(flag, s) == 0;
  }
  const std::int64_t sms = std::max(current_device().sms, 1);
  p->row = make_pass(host_copy(pattern.row_ptr, rows + 1, s), device_copy(pattern.col_idx, nnz, s));
  p->tc_row = device_tc_pass(pattern, sms, s);
  p->row_ptr = device_copy(pattern.row_ptr, rows + 1, s);
  if (!p->symmetric) {
    // The transpose: the entries stably sorted by column (so each column's rows increase).
    device_buffer<std::uint32_t> sorted_cols(n, s);
    device_buffer<std::int64_t> ids(n, s);
    device_buffer<std::int32_t> t_col(n);
    device_buffer<std::int64_t> t_row_ptr(static_cast<std::size_t>(cols + 1), s);
    if (nnz > 0) {
      iota64<<<build_blocks(nnz), kBuildThreads, 0, s>>>(ids.data(), nnz);
      TRISPARSE_CUDA_CHECK_LAUNCH();
      const auto* keys = reinterpret_cast<const std::uint32_t*>(pattern.col_idx);
      const int bits =
          std::max(1, static_cast<int>(std::bit_width(static_cast<std::uint64_t>(cols))));
      std::size_t temp_bytes = 0;
      TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
          nullptr, temp_bytes, keys, sorted_cols.data(), ids.data(), p->column_entry.data(),
          static_cast<int>(nnz), 0, bits, s));
      device_buffer<std::byte> temp(temp_bytes, s);
      TRISPARSE_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
          temp.data(), temp_bytes, keys, sorted_cols.data(), ids.data(), p->column_entry.data(),
          static_cast<int>(nnz), 0, bits, s));
      gather_rows<<<build_blocks(nnz), kBuildThreads, 0, s>>>(p->column_entry.data(),
                                                              entry_row.data(), nnz, t_col.data());
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
    column_offsets<<<build_blocks(cols + 1), kBuildThreads, 0, s>>>(sorted_cols.data(), nnz, cols,
                                                                    t_row_ptr.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
    const csr_view t{.rows = cols,
                     .cols = rows,
                     .nnz = nnz,
                     .row_ptr = t_row_ptr.data(),
                     .col_idx = t_col.data(),
                     .where = device_kind::cuda};
    p->tc_transposed = device_tc_pass(t, sms, s);
    p->transposed = make_pass(host_copy(t_row_ptr.data(), cols + 1, s), std::move(t_col));
  }
  link_slots(*p, s);
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return p;
}

std::size_t attention_backward_workspace_bytes(const attention_backward_device_plan& plan,
                                               std::int64_t heads, std::int64_t head_dim,
                                               dtype type) {
  return segments(plan, heads, head_dim, type).layout.bytes();
}

void run_attention_backward(const attention_backward_device_plan& plan, const tensor_view& q,
                            const tensor_view& k, const tensor_view& v, const tensor_view& out,
                            const tensor_view& lse, const tensor_view& dout, const tensor_view& dq,
                            const tensor_view& dk, const tensor_view& dv, const score_bias& bias,
                            double scale, const workspace_view& workspace, stream_ref stream) {
  check_dims(q, v, "the CUDA attention backward");
  TRISPARSE_EXPECTS_INPUT(k.type == q.type && v.type == q.type, "q, k and v must have one dtype");
  TRISPARSE_EXPECTS_INPUT(dout.type == out.type, "dout must have out's dtype");
  TRISPARSE_EXPECTS_INPUT(dk.type == dq.type && dv.type == dq.type,
                          "dq, dk and dv must have one dtype");
  TRISPARSE_EXPECTS_INPUT(lse.data == nullptr || lse.type == dtype::f32,
                          "the CUDA backward takes the log-sum-exp as f32");
  const int pdim = static_cast<int>(std::max(q.dim, v.dim));
  const workspace_segments w = segments(plan, q.heads, pdim, q.type);
  w.layout.check(workspace, "attention backward");
  using layout = detail::workspace_layout;
  const row_terms terms{layout::at<float>(workspace, w.lse), layout::at<float>(workspace, w.delta)};
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const auto heads = static_cast<int>(q.heads);
  float* const dq_part = layout::at<float>(workspace, w.dq);
  float* const dk_part = layout::at<float>(workspace, w.dk);
  float* const dv_part = layout::at<float>(workspace, w.dv);
  const bool tensor_core = tensor_core_eligible(q, k, v, out, dout, dq, dk, dv);
  const core_layout cl = core_layout_of(q, v, {&q, &k, &v, &out, &dout, &dq, &dk, &dv});
  core_params base = core_base(cl, q, k, v, scale);
  base.out = head_lanes::in(out);
  base.dout = head_lanes::in(dout);
  base.lse_in = head_lanes::in(lse);
  base.terms = terms;
  set_bias(base, bias.bias, bias.dbias, plan);
  with_element_type(q.type, "attention backward (q, k, v)", [&]<class T>() {
    with_output_type<T>(out.type, "attention backward (out, dout)", [&]<class O>() {
      with_output_type<T>(dq.type, "attention backward (dq, dk, dv)", [&]<class G>() {
        with_core_lanes(cl, [&]<int V, int F>() {
          // The tensor-core kernels take dout in T: an f32 dout is rounded into the workspace.
          const bool round_dout = tensor_core && !std::is_same_v<T, O>;
          T* const rounded = round_dout ? layout::at<T>(workspace, w.dout) : nullptr;
          // Given the forward's lse and dout in T, the tensor-core dq pass takes the terms itself
          // (D from out's rows as it reads dout's): no terms pass.
          const bool dq_terms = tensor_core && !round_dout && lse.data != nullptr;
          core_params p = base;
          p.row_ptr = plan.row_ptr.data();
          p.col = plan.row.col_idx.data();
          p.rounded = {rounded, heads * dout.dim, dout.dim};
          if (!dq_terms && plan.rows * p.l.groups > 0) {
            core_terms<T, O, V, F>
                <<<grid_of(plan.rows * p.l.groups), kWarps * 32, 0, s>>>(p, plan.rows);
            TRISPARSE_CUDA_CHECK_LAUNCH();
          }
          if constexpr (!std::is_same_v<T, float>) {
            if (tensor_core) {
              std::uint32_t* const arrivals = layout::at<std::uint32_t>(workspace, w.arrivals);
              if (w.layout.zeroed_bytes() > 0)
                TRISPARSE_CUDA_TRY(cudaMemsetAsync(workspace.data, 0, w.layout.zeroed_bytes(), s));
              const view<const T> dout_t =
                  round_dout ? view<const T>{rounded, heads * dout.dim, dout.dim,
                                             static_cast<int>(dout.dim)}
                             : view<const T>{static_cast<const T*>(dout.data), dout.row_stride,
                                             dout.head_stride, static_cast<int>(dout.dim)};
              const view<const T> out_t =
                  dq_terms ? view_of<const T>(out) : view<const T>{nullptr, 0, 0, 0};
              run_tensor_core<T, G>(plan, q, k, v, dout_t, out_t, view_of<const float>(lse), dq, dk,
                                    dv, terms, layout::at<std::uint32_t>(workspace, w.pds),
                                    partials{dq_part, heads, pdim}, partials{dk_part, heads, pdim},
                                    partials{dv_part, heads, pdim}, arrivals,
                                    arrivals + w.row_arrivals, static_cast<float>(scale),
                                    tc_bias{plan.tc_row.entry.data(), base.bias, base.bias_rs,
                                            base.bias_hs, base.dbias, base.dbias_rs, base.dbias_hs},
                                    s);
              return;
            }
          }
          p = base;
          set_work(p, plan.row);
          p.o1 = head_lanes::out_of(dq);
          p.part1 = dq_part;
          if (p.n_chunks * p.l.groups > 0) {
            core_row_pass<T, O, G, V, F>
                <<<grid_of(p.n_chunks * p.l.groups), kWarps * 32, 0, s>>>(p);
            TRISPARSE_CUDA_CHECK_LAUNCH();
          }
          launch_reduce<G, V, F>(base, plan.row.splits, dq_part, dq, base.scale, s);
          p = base;
          set_work(p, plan.column());
          p.o1 = head_lanes::out_of(dk);
          p.o2 = head_lanes::out_of(dv);
          p.part1 = dk_part;
          p.part2 = dv_part;
          if (p.n_chunks * p.l.groups > 0) {
            core_column_pass<T, O, G, V, F>
                <<<grid_of(p.n_chunks * p.l.groups), kWarps * 32, 0, s>>>(p);
            TRISPARSE_CUDA_CHECK_LAUNCH();
          }
          launch_reduce<G, V, F>(base, plan.column().splits, dk_part, dk, base.scale, s);
          launch_reduce<G, V, F>(base, plan.column().splits, dv_part, dv, 1.0f, s);
        });
      });
    });
  });
}

std::size_t attention_rowwise_workspace_bytes(const attention_backward_device_plan& plan,
                                              std::int64_t heads, std::int64_t head_dim) {
  return forward_segments(plan, heads, head_dim).layout.bytes();
}

void run_attention_rowwise(const attention_backward_device_plan& plan, const tensor_view& q,
                           const tensor_view& k, const tensor_view& v, const tensor_view& out,
                           const tensor_view& lse, const tensor_view& bias, double scale,
                           const workspace_view& workspace, stream_ref stream) {
  check_dims(q, v, "the CUDA row-wise attention");
  TRISPARSE_EXPECTS_INPUT(k.type == q.type && v.type == q.type, "q, k and v must have one dtype");
  TRISPARSE_EXPECTS_INPUT(lse.data == nullptr || lse.type == dtype::f32,
                          "the CUDA row-wise attention writes the log-sum-exp as f32");
  const workspace_segments w = forward_segments(plan, q.heads, std::max(q.dim, v.dim));
  w.layout.check(workspace, "row-wise attention");
  const core_layout cl = core_layout_of(q, v, {&q, &k, &v, &out});
  core_params p = core_base(cl, q, k, v, scale);
  set_work(p, plan.row);
  set_bias(p, bias, {}, plan);
  p.o1 = head_lanes::out_of(out);
  p.lse_out = head_lanes::out_of(lse);
  p.part1 = detail::workspace_layout::at<float>(workspace, w.dq);
  p.part_ml = detail::workspace_layout::at<float>(workspace, w.lse);
  if (p.n_chunks * p.l.groups == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(q.type, "row-wise attention (q, k, v)", [&]<class T>() {
    with_output_type<T>(out.type, "row-wise attention (out)", [&]<class O>() {
      with_core_lanes(cl, [&]<int V, int F>() {
        core_forward<T, O, V, F><<<grid_of(p.n_chunks * p.l.groups), kWarps * 32, 0, s>>>(p);
        TRISPARSE_CUDA_CHECK_LAUNCH();
        if (p.n_splits > 0) {
          core_forward_merge<O, V, F><<<grid_of(p.n_splits * p.l.groups), kWarps * 32, 0, s>>>(p);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
      });
    });
  });
}

std::int64_t device_bytes(const attention_backward_device_plan& plan) {
  const auto pass_bytes = [](const pass& p) {
    return p.col_idx.bytes() + p.chunks.bytes() + p.splits.bytes();
  };
  const auto tc_bytes = [](const tc_pass& p) {
    std::size_t bytes = p.tcb_offset.bytes() + p.row_of.bytes() + p.col_idx.bytes() +
                        p.bitmap.bytes() + p.first_slot.bytes() + p.target.bytes();
    for (const tc_work* w : {&p.fine, &p.coarse}) bytes += w->chunks.bytes();
    return bytes;
  };
  return static_cast<std::int64_t>(plan.row_ptr.bytes() + plan.column_entry.bytes() +
                                   pass_bytes(plan.row) + pass_bytes(plan.transposed) +
                                   tc_bytes(plan.tc_row) + tc_bytes(plan.tc_transposed));
}

}  // namespace trisparse::cuda
