// The CUDA attention backward (plan.hpp): the per-row terms (D and the log-sum-exp), a pass over
// the pattern's rows (dq) and one over the transposed pattern's rows (dk, dv), one warp per work
// chunk and head, fp32 accumulation. Rows longer than kChunkEntries are cut into chunks whose
// partial sums a reduction adds in chunk order: deterministic, and a hub spreads over many warps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "../../../common/workspace_layout.hpp"
#include "../../common/buffer.cuh"
#include "../../common/convert.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "device.cuh"
#include "plan.hpp"
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

// The window chunks of one pass at one chunk size, and their partial rows.
struct tc_work {
  device_buffer<tc_chunk> chunks;
  device_buffer<split_row> splits;
  std::int64_t slots = 0;
};

// One pass's BSB (16x8 TCBs) and its window chunks for the tensor-core kernels, at two sizes:
// fine for runs of few heads (balance), coarse for many (fewer partial rows; tuning.hpp).
struct tc_pass {
  device_buffer<std::int32_t> col_idx;
  device_buffer<std::uint64_t> bitmap;
  tc_work fine, coarse;
  const tc_work& work(std::int64_t heads) const {
    return heads >= kCoarseFromHeads ? coarse : fine;
  }
};

}  // namespace attention_backward

struct attention_backward_device_plan {
  std::int64_t rows = 0, cols = 0, nnz = 0;
  device_buffer<std::int64_t> row_ptr;            // A's offsets (the log-sum-exp recompute)
  attention_backward::pass row, column;           // over A's rows (dq), over A^T's rows (dk, dv)
  attention_backward::tc_pass tc_row, tc_column;  // the same over A's and A^T's BSB windows
};

namespace {

using namespace attention_backward;

// One warp per (row i, head h): D_i and the log-sum-exp (given, or recomputed over row i).
template <class T, class O>
__global__ void __launch_bounds__(kWarps * 32)
    terms_pass(const std::int64_t* __restrict__ row_ptr, const std::int32_t* __restrict__ col_idx,
               std::int64_t rows, int heads, view<const T> q, view<const T> k, view<const O> out,
               view<const O> dout, const float* __restrict__ lse_in, std::int64_t lse_rs,
               std::int64_t lse_hs, row_terms terms, float scale, view<T> dout_rounded) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= rows * heads) return;
  const std::int64_t i = item / heads;
  const int h = static_cast<int>(item % heads);
  float a[kMaxChunks], b[kMaxChunks];
  load(dout.at(i, h), dout.dim, lane, a);
  if (dout_rounded.data != nullptr) {
    // dout in the inputs' type for the tensor-core kernels' products, and D from the same rounded
    // values, so that dP - D cancels as it does in exact arithmetic.
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) a[c] = convert<float>(convert<T>(a[c]));
    store(dout_rounded.at(i, h), dout.dim, lane, a, 1.0f);
  }
  load(out.at(i, h), out.dim, lane, b);
  const float delta = warp_sum(lane_dot(a, b));
  float lse;
  if (lse_in != nullptr) {
    lse = lse_in[i * lse_rs + h * lse_hs];
  } else {
    load(q.at(i, h), q.dim, lane, a);
    float m = -INFINITY, l = 0.0f;
    const std::int64_t begin = row_ptr[i], end = row_ptr[i + 1];
    for (std::int64_t e = begin; e < end; ++e) {
      load(k.at(col_idx[e], h), k.dim, lane, b);
      const float s = scale * warp_sum(lane_dot(a, b));
      const float m2 = fmaxf(m, s);
      l = l * expf(m - m2) + expf(s - m2);
      m = m2;
    }
    lse = end > begin ? m + logf(l) : -INFINITY;
  }
  if (lane == 0) {
    terms.lse[item] = lse;
    terms.delta[item] = delta;
  }
}

// One warp per (chunk of row i, head h): dq_i = scale sum_j P_ij (dout_i . v_j - D_i) k_j over
// the chunk's entries, kUnroll entries at a time.
template <class T, class O, class G>
__global__ void __launch_bounds__(kWarps * 32)
    row_pass(const chunk* __restrict__ chunks, std::int64_t n_chunks,
             const std::int32_t* __restrict__ col_idx, int heads, view<const T> q, view<const T> k,
             view<const T> v, view<const O> dout, row_terms terms, view<G> dq, partials part,
             float scale) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= n_chunks * heads) return;
  const chunk w = chunks[item / heads];
  const int h = static_cast<int>(item % heads);
  const std::int64_t r = static_cast<std::int64_t>(w.row) * heads + h;
  float qi[kMaxChunks], gi[kMaxChunks], acc[kMaxChunks];
  load(q.at(w.row, h), q.dim, lane, qi);
  load(dout.at(w.row, h), dout.dim, lane, gi);
  const float lse = terms.lse[r], delta = terms.delta[r];
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) acc[c] = 0.0f;
  for (std::int64_t e = w.begin; e < w.end; e += kUnroll) {
    float kx[kUnroll][kMaxChunks], s[kUnroll], dp[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t j = col_idx[e + u < w.end ? e + u : w.begin];
      float vx[kMaxChunks];
      load(k.at(j, h), k.dim, lane, kx[u]);
      load(v.at(j, h), v.dim, lane, vx);
      s[u] = lane_dot(qi, kx[u]);
      dp[u] = lane_dot(gi, vx);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      s[u] = warp_sum(s[u]);
      dp[u] = warp_sum(dp[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float p = e + u < w.end ? expf(scale * s[u] - lse) : 0.0f;
      const float ds = p * (dp[u] - delta);
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) acc[c] += ds * kx[u][c];
    }
  }
  finish(w, h, lane, acc, scale, dq, part);
}

// One warp per (chunk of key j, head h), over row j of the transpose (the queries i that attend
// j): dk_j = scale sum_i dS_ij q_i and dv_j = sum_i P_ij dout_i, kUnroll entries at a time.
template <class T, class O, class G>
__global__ void __launch_bounds__(kWarps * 32)
    column_pass(const chunk* __restrict__ chunks, std::int64_t n_chunks,
                const std::int32_t* __restrict__ t_col_idx, int heads, view<const T> q,
                view<const T> k, view<const T> v, view<const O> dout, row_terms terms, view<G> dk,
                view<G> dv, partials dk_part, partials dv_part, float scale) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= n_chunks * heads) return;
  const chunk w = chunks[item / heads];
  const int h = static_cast<int>(item % heads);
  float kj[kMaxChunks], vj[kMaxChunks], dk_acc[kMaxChunks], dv_acc[kMaxChunks];
  load(k.at(w.row, h), k.dim, lane, kj);
  load(v.at(w.row, h), v.dim, lane, vj);
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) dk_acc[c] = dv_acc[c] = 0.0f;
  for (std::int64_t e = w.begin; e < w.end; e += kUnroll) {
    float qx[kUnroll][kMaxChunks], gx[kUnroll][kMaxChunks], s[kUnroll], dp[kUnroll], lse[kUnroll],
        delta[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t i = t_col_idx[e + u < w.end ? e + u : w.begin];
      const std::int64_t r = i * heads + h;
      load(q.at(i, h), q.dim, lane, qx[u]);
      load(dout.at(i, h), dout.dim, lane, gx[u]);
      lse[u] = terms.lse[r];
      delta[u] = terms.delta[r];
      s[u] = lane_dot(kj, qx[u]);
      dp[u] = lane_dot(vj, gx[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      s[u] = warp_sum(s[u]);
      dp[u] = warp_sum(dp[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float p = e + u < w.end ? expf(scale * s[u] - lse[u]) : 0.0f;
      const float ds = p * (dp[u] - delta[u]);
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        dk_acc[c] += ds * qx[u][c];
        dv_acc[c] += p * gx[u][c];
      }
    }
  }
  finish(w, h, lane, dk_acc, scale, dk, dk_part);
  finish(w, h, lane, dv_acc, 1.0f, dv, dv_part);
}

// One warp per (cut row, head): the row's partial rows added in chunk order, times `factor`.
template <class G>
__global__ void __launch_bounds__(kWarps * 32)
    reduce_pass(const split_row* __restrict__ splits, std::int64_t n_splits, int heads,
                partials part, view<G> out, float factor) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= n_splits * heads) return;
  const split_row sr = splits[item / heads];
  const int h = static_cast<int>(item % heads);
  float acc[kMaxChunks], x[kMaxChunks];
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) acc[c] = 0.0f;
  for (int t = 0; t < sr.count; ++t) {
    load(part.at(sr.first + t, h), out.dim, lane, x);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) acc[c] += x[c];
  }
  store(out.at(sr.row, h), out.dim, lane, acc, factor);
}

// One warp per (row i, head h): out_i = sum_j softmax_j(scale q_i . k_j) v_j by online softmax,
// kUnroll entries at a time, and the log-sum-exp where asked. The f32 forward (the fused 3S
// kernel's tensor cores take f16 and bf16).
template <class T, class O>
__global__ void __launch_bounds__(kWarps * 32)
    rowwise_forward(const std::int64_t* __restrict__ row_ptr,
                    const std::int32_t* __restrict__ col_idx, std::int64_t rows, int heads,
                    view<const T> q, view<const T> k, view<const T> v, view<O> out,
                    float* __restrict__ lse_out, std::int64_t lse_rs, std::int64_t lse_hs,
                    float scale) {
  const int lane = threadIdx.x & 31;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= rows * heads) return;
  const std::int64_t i = item / heads;
  const int h = static_cast<int>(item % heads);
  float qi[kMaxChunks], acc[kMaxChunks];
  load(q.at(i, h), q.dim, lane, qi);
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) acc[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const std::int64_t begin = row_ptr[i], end = row_ptr[i + 1];
  for (std::int64_t e = begin; e < end; e += kUnroll) {
    float vx[kUnroll][kMaxChunks], s[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t j = col_idx[e + u < end ? e + u : begin];
      float kx[kMaxChunks];
      load(k.at(j, h), k.dim, lane, kx);
      load(v.at(j, h), v.dim, lane, vx[u]);
      s[u] = lane_dot(qi, kx);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) s[u] = e + u < end ? scale * warp_sum(s[u]) : -INFINITY;
    float m2 = m;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) m2 = fmaxf(m2, s[u]);
    const float rescale = expf(m - m2);  // m2 is finite: entry e is in the row
    l *= rescale;
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) acc[c] *= rescale;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float p = expf(s[u] - m2);  // 0 for the padding entries
      l += p;
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) acc[c] += p * vx[u][c];
    }
    m = m2;
  }
  store(out.at(i, h), out.dim, lane, acc, end > begin ? 1.0f / l : 0.0f);
  if (lse_out != nullptr && lane == 0)
    lse_out[i * lse_rs + h * lse_hs] = end > begin ? m + logf(l) : -INFINITY;
}

struct workspace_segments {
  detail::workspace_layout layout;
  std::size_t lse = 0, delta = 0, dq = 0, dk = 0, dv = 0, dout = 0;
};

// pdim: floats per partial row (the larger head dim of q and v).
workspace_segments segments(const attention_backward_device_plan& plan, std::int64_t heads,
                            std::int64_t pdim) {
  workspace_segments w;
  const auto n = static_cast<std::size_t>(plan.rows * heads) * sizeof(float);
  const auto row = static_cast<std::size_t>(heads * pdim) * sizeof(float);
  w.lse = w.layout.add(n);
  w.delta = w.layout.add(n);
  // One kernel family runs per call: room for the partial rows of either.
  const auto row_slots =
      static_cast<std::size_t>(std::max(plan.row.slots, plan.tc_row.work(heads).slots));
  const auto col_slots =
      static_cast<std::size_t>(std::max(plan.column.slots, plan.tc_column.work(heads).slots));
  w.dq = w.layout.add(row_slots * row);
  w.dk = w.layout.add(col_slots * row);
  w.dv = w.layout.add(col_slots * row);
  // The tensor-core kernels' 16-bit copy of an f32 dout.
  w.dout = w.layout.add(static_cast<std::size_t>(plan.rows * heads * pdim) * 2);
  return w;
}

unsigned grid_of(std::int64_t items) {
  return static_cast<unsigned>((items + kWarps - 1) / kWarps);
}

// The pattern's rows as work: one chunk per row of at most kChunkEntries entries (empty rows
// too: they write zeros), kChunkEntries-entry chunks of longer rows.
pass make_pass(const csr_graph& g) {
  std::vector<chunk> chunks;
  std::vector<split_row> splits;
  std::int32_t slots = 0;
  chunks.reserve(static_cast<std::size_t>(g.rows));
  for (std::int64_t r = 0; r < g.rows; ++r) {
    const std::int64_t begin = g.row_ptr[r], end = g.row_ptr[r + 1];
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
  p.col_idx = device_buffer<std::int32_t>(g.col_idx);
  p.chunks = device_buffer<chunk>(chunks);
  p.splits = device_buffer<split_row>(splits);
  p.slots = slots;
  return p;
}

// The BSB windows as work: one chunk per window of at most `size` TCBs (empty windows too: they
// write zeros), `size`-TCB chunks of larger windows, whose 16 rows each become a split row over
// the chunks' partial rows (row r of chunk c at first + r * n + c).
tc_work make_tc_work(const bsb& b, std::int64_t rows, std::int64_t size) {
  std::vector<tc_chunk> chunks;
  std::vector<split_row> splits;
  std::int32_t slots = 0;
  chunks.reserve(static_cast<std::size_t>(b.windows()));
  for (std::int64_t w = 0; w < b.windows(); ++w) {
    const std::int64_t begin = b.tcb_offset[w], end = b.tcb_offset[w + 1];
    const auto window = static_cast<std::int32_t>(w);
    if (end - begin <= size) {
      chunks.push_back({window, -1, 0, 0, begin, end});
      continue;
    }
    const auto n = static_cast<std::int32_t>((end - begin + size - 1) / size);
    for (std::int32_t c = 0; c < n; ++c) {
      const std::int64_t from = begin + static_cast<std::int64_t>(c) * size;
      chunks.push_back({window, slots + c, n, 0, from, std::min(end, from + size)});
    }
    for (std::int32_t r = 0; r < bsb::kRowWindow; ++r) {
      const std::int64_t row = w * bsb::kRowWindow + r;
      if (row < rows) splits.push_back({static_cast<std::int32_t>(row), slots + r * n, n, 0});
    }
    slots += bsb::kRowWindow * n;
  }
  tc_work work;
  work.chunks = device_buffer<tc_chunk>(chunks);
  work.splits = device_buffer<split_row>(splits);
  work.slots = slots;
  return work;
}

// The pattern's BSB and its work at both chunk sizes: kChunkTcbs, or the TCBs over
// chunks_per_sm x `sms` chunks where more.
tc_pass make_tc_pass(const csr_graph& g, std::int64_t sms) {
  const bsb b = build_bsb(g, 8);
  const auto size = [&](std::int64_t per_sm) {
    const std::int64_t target = sms * per_sm;
    return std::max<std::int64_t>(kChunkTcbs, (b.tcb_offset.back() + target - 1) / target);
  };
  tc_pass p;
  p.col_idx = device_buffer<std::int32_t>(b.col_idx);
  p.bitmap = device_buffer<std::uint64_t>(b.bitmap);
  p.fine = make_tc_work(b, g.rows, size(kFineChunksPerSm));
  p.coarse = make_tc_work(b, g.rows, size(kCoarseChunksPerSm));
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

// dq, dk, dv on the tensor-core kernels (the terms already in `terms`).
template <class T, class G>
void run_tensor_core(const attention_backward_device_plan& plan, const tensor_view& q,
                     const tensor_view& k, const tensor_view& v, view<const T> dout,
                     const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                     row_terms terms, partials dq_part, partials dk_part, partials dv_part,
                     float scale, cudaStream_t s) {
  const auto heads = static_cast<int>(q.heads);
  const float scale_log2 = scale * kLog2e;
  const auto args = [&](const tc_pass& pass, std::int64_t rows) {
    const tc_work& work = pass.work(heads);
    return tc_args{pass.col_idx.data(),
                   pass.bitmap.data(),
                   work.chunks.data(),
                   static_cast<std::int64_t>(work.chunks.size()),
                   rows,
                   heads,
                   scale,
                   scale_log2};
  };
  const tc_args row = args(plan.tc_row, plan.rows), column = args(plan.tc_column, plan.cols);
  with_head_dim<32, 64, 128>(q.dim, "attention backward", [&]<int D>() {
    if (row.n_chunks * heads > 0) {
      tc_row_pass<T, G, D><<<grid_of(row.n_chunks * heads), kWarps * 32, 0, s>>>(
          row, view_of<const T>(q), view_of<const T>(k), view_of<const T>(v), dout, terms,
          view_of<G>(dq), dq_part);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
    if (column.n_chunks * heads > 0) {
      tc_column_pass<T, G, D><<<grid_of(column.n_chunks * heads), kWarps * 32, 0, s>>>(
          column, view_of<const T>(q), view_of<const T>(k), view_of<const T>(v), dout, terms,
          view_of<G>(dk), view_of<G>(dv), dk_part, dv_part);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
  });
  const auto reduce = [&](const tc_pass& pass, partials part, const tensor_view& out, float f) {
    const tc_work& work = pass.work(heads);
    const auto n = static_cast<std::int64_t>(work.splits.size());
    if (n * heads == 0) return;
    reduce_pass<G><<<grid_of(n * heads), kWarps * 32, 0, s>>>(work.splits.data(), n, heads, part,
                                                              view_of<G>(out), f);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  };
  reduce(plan.tc_row, dq_part, dq, scale);
  reduce(plan.tc_column, dk_part, dk, scale);
  reduce(plan.tc_column, dv_part, dv, 1.0f);
}

}  // namespace

std::shared_ptr<attention_backward_device_plan> make_attention_backward_plan(
    const csr_graph& pattern, const csr_graph& transposed, stream_ref stream) {
  TRISPARSE_EXPECTS_INPUT(transposed.rows == pattern.cols && transposed.cols == pattern.rows &&
                              transposed.nnz() == pattern.nnz(),
                          "the transposed pattern does not match the pattern");
  auto p = std::make_shared<attention_backward_device_plan>();
  p->rows = pattern.rows;
  p->cols = pattern.cols;
  p->nnz = pattern.nnz();
  p->row = make_pass(pattern);
  p->column = make_pass(transposed);
  int device = 0, sms = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  p->tc_row = make_tc_pass(pattern, std::max(sms, 1));
  p->tc_column = make_tc_pass(transposed, std::max(sms, 1));
  p->row_ptr = device_buffer<std::int64_t>(pattern.row_ptr);
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
  return p;
}

std::size_t attention_backward_workspace_bytes(const attention_backward_device_plan& plan,
                                               std::int64_t heads, std::int64_t head_dim) {
  return segments(plan, heads, head_dim).layout.bytes();
}

void run_attention_backward(const attention_backward_device_plan& plan, const tensor_view& q,
                            const tensor_view& k, const tensor_view& v, const tensor_view& out,
                            const tensor_view& lse, const tensor_view& dout, const tensor_view& dq,
                            const tensor_view& dk, const tensor_view& dv, double scale,
                            const workspace_view& workspace, stream_ref stream) {
  TRISPARSE_EXPECTS_INPUT(q.dim <= 32 * kMaxChunks && v.dim <= 32 * kMaxChunks,
                          "the CUDA attention backward takes head dims up to " +
                              std::to_string(32 * kMaxChunks) + ", not " +
                              std::to_string(std::max(q.dim, v.dim)));
  TRISPARSE_EXPECTS_INPUT(k.type == q.type && v.type == q.type, "q, k and v must have one dtype");
  TRISPARSE_EXPECTS_INPUT(dout.type == out.type, "dout must have out's dtype");
  TRISPARSE_EXPECTS_INPUT(dk.type == dq.type && dv.type == dq.type,
                          "dq, dk and dv must have one dtype");
  TRISPARSE_EXPECTS_INPUT(lse.data == nullptr || lse.type == dtype::f32,
                          "the CUDA backward takes the log-sum-exp as f32");
  const int pdim = static_cast<int>(std::max(q.dim, v.dim));
  const workspace_segments w = segments(plan, q.heads, pdim);
  w.layout.check(workspace, "attention backward");
  using layout = detail::workspace_layout;
  const row_terms terms{layout::at<float>(workspace, w.lse), layout::at<float>(workspace, w.delta)};
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const auto heads = static_cast<int>(q.heads);
  const partials dq_part{layout::at<float>(workspace, w.dq), heads, pdim},
      dk_part{layout::at<float>(workspace, w.dk), heads, pdim},
      dv_part{layout::at<float>(workspace, w.dv), heads, pdim};
  const auto fscale = static_cast<float>(scale);
  const auto n_row = static_cast<std::int64_t>(plan.row.chunks.size());
  const auto n_col = static_cast<std::int64_t>(plan.column.chunks.size());
  const auto s_row = static_cast<std::int64_t>(plan.row.splits.size());
  const auto s_col = static_cast<std::int64_t>(plan.column.splits.size());
  const bool tensor_core = tensor_core_eligible(q, k, v, out, dout, dq, dk, dv);
  with_element_type(q.type, "attention backward (q, k, v)", [&]<class T>() {
    with_output_type<T>(out.type, "attention backward (out, dout)", [&]<class O>() {
      with_output_type<T>(dq.type, "attention backward (dq, dk, dv)", [&]<class G>() {
        // The tensor-core kernels take dout in T: an f32 dout is rounded into the workspace.
        const bool round_dout = tensor_core && !std::is_same_v<T, O>;
        const view<T> dout_rounded{round_dout ? layout::at<T>(workspace, w.dout) : nullptr,
                                   heads * dout.dim, dout.dim, static_cast<int>(dout.dim)};
        if (plan.rows * q.heads > 0) {
          terms_pass<T, O><<<grid_of(plan.rows * q.heads), kWarps * 32, 0, s>>>(
              plan.row_ptr.data(), plan.row.col_idx.data(), plan.rows, heads, view_of<const T>(q),
              view_of<const T>(k), view_of<const O>(out), view_of<const O>(dout),
              static_cast<const float*>(lse.data), lse.row_stride, lse.head_stride, terms, fscale,
              dout_rounded);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
        if constexpr (!std::is_same_v<T, float>) {
          if (tensor_core) {
            const view<const T> dout_t =
                round_dout ? view<const T>{dout_rounded.data, dout_rounded.rs, dout_rounded.hs,
                                           dout_rounded.dim}
                           : view<const T>{static_cast<const T*>(dout.data), dout.row_stride,
                                           dout.head_stride, static_cast<int>(dout.dim)};
            run_tensor_core<T, G>(plan, q, k, v, dout_t, dq, dk, dv, terms, dq_part, dk_part,
                                  dv_part, fscale, s);
            return;
          }
        }
        if (plan.rows * q.heads > 0) {
          row_pass<T, O, G><<<grid_of(n_row * q.heads), kWarps * 32, 0, s>>>(
              plan.row.chunks.data(), n_row, plan.row.col_idx.data(), heads, view_of<const T>(q),
              view_of<const T>(k), view_of<const T>(v), view_of<const O>(dout), terms,
              view_of<G>(dq), dq_part, fscale);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
        if (s_row * q.heads > 0) {
          reduce_pass<G><<<grid_of(s_row * q.heads), kWarps * 32, 0, s>>>(
              plan.row.splits.data(), s_row, heads, dq_part, view_of<G>(dq), fscale);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
        if (plan.cols * q.heads > 0) {
          column_pass<T, O, G><<<grid_of(n_col * q.heads), kWarps * 32, 0, s>>>(
              plan.column.chunks.data(), n_col, plan.column.col_idx.data(), heads,
              view_of<const T>(q), view_of<const T>(k), view_of<const T>(v), view_of<const O>(dout),
              terms, view_of<G>(dk), view_of<G>(dv), dk_part, dv_part, fscale);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
        if (s_col * q.heads > 0) {
          reduce_pass<G><<<grid_of(s_col * q.heads), kWarps * 32, 0, s>>>(
              plan.column.splits.data(), s_col, heads, dk_part, view_of<G>(dk), fscale);
          TRISPARSE_CUDA_CHECK_LAUNCH();
          reduce_pass<G><<<grid_of(s_col * q.heads), kWarps * 32, 0, s>>>(
              plan.column.splits.data(), s_col, heads, dv_part, view_of<G>(dv), 1.0f);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
      });
    });
  });
}

void run_attention_rowwise(const attention_backward_device_plan& plan, const tensor_view& q,
                           const tensor_view& k, const tensor_view& v, const tensor_view& out,
                           const tensor_view& lse, double scale, stream_ref stream) {
  TRISPARSE_EXPECTS_INPUT(q.dim <= 32 * kMaxChunks && v.dim <= 32 * kMaxChunks,
                          "the CUDA row-wise attention takes head dims up to " +
                              std::to_string(32 * kMaxChunks) + ", not " +
                              std::to_string(std::max(q.dim, v.dim)));
  TRISPARSE_EXPECTS_INPUT(k.type == q.type && v.type == q.type, "q, k and v must have one dtype");
  TRISPARSE_EXPECTS_INPUT(lse.data == nullptr || lse.type == dtype::f32,
                          "the CUDA row-wise attention writes the log-sum-exp as f32");
  if (plan.rows * q.heads == 0) return;
  with_element_type(q.type, "row-wise attention (q, k, v)", [&]<class T>() {
    with_output_type<T>(out.type, "row-wise attention (out)", [&]<class O>() {
      rowwise_forward<T, O><<<grid_of(plan.rows * q.heads), kWarps * 32, 0,
                              static_cast<cudaStream_t>(stream.handle)>>>(
          plan.row_ptr.data(), plan.row.col_idx.data(), plan.rows, static_cast<int>(q.heads),
          view_of<const T>(q), view_of<const T>(k), view_of<const T>(v), view_of<O>(out),
          static_cast<float*>(lse.data), lse.row_stride, lse.head_stride,
          static_cast<float>(scale));
      TRISPARSE_CUDA_CHECK_LAUNCH();
    });
  });
}

std::int64_t device_bytes(const attention_backward_device_plan& plan) {
  const auto pass_bytes = [](const pass& p) {
    return p.col_idx.bytes() + p.chunks.bytes() + p.splits.bytes();
  };
  const auto tc_bytes = [](const tc_pass& p) {
    std::size_t bytes = p.col_idx.bytes() + p.bitmap.bytes();
    for (const tc_work* w : {&p.fine, &p.coarse}) bytes += w->chunks.bytes() + w->splits.bytes();
    return bytes;
  };
  return static_cast<std::int64_t>(plan.row_ptr.bytes() + pass_bytes(plan.row) +
                                   pass_bytes(plan.column) + tc_bytes(plan.tc_row) +
                                   tc_bytes(plan.tc_column));
}

}  // namespace trisparse::cuda
