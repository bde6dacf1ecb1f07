// The fused GAT attention (gat.hpp).
//
// Lanes and heads: head groups (../common/head_lanes.cuh), F = 4 or 16 floats a lane (C <= 512).
//
// Forward: a warp per (target row, head group). Per entry, the lane's head's score, an online
// softmax (running max and sum, the accumulators rescaled) and keep * x[j] into the
// accumulators: each source row is read once and the [E, H] scores are never stored. The loads of
// 2-4 entries are issued before their updates. The row's log-sum-exp is kept for the backward.
//
// Backward, with dp_ij = keep_ij <dout_i, x_j> and D_i = sum_j p_ij dp_ij = <dout_i, out_i>:
//   1. D per (row, head), packed with a_dst and the lse into one 16-byte record per (row, head)
//      that the column pass reads for each entry: row_dot_kernel.
//   2. A warp per (source column, head group) over the transposed pattern: p_ij from the lse,
//      dx_j = sum_i p_ij keep_ij dout_i, de_ij = p_ij (dp_ij - D_i) LeakyReLU'(s_ij),
//      da_src_j = sum_i de_ij in the column's row order, de_ij stored per entry: column_kernel.
//   3. da_dst_i = sum_j de_ij in entry order: row_sum_kernel, a warp a row.
//
// Rows (forward) and columns (backward) of more than kChunk entries are cut into chunks of kChunk,
// each a warp's; their partial results (max, sum and accumulators; dx and da_src) go to the
// workspace and a merge kernel adds them in chunk order. Every sum has a fixed order: the same
// bits on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "../../common/workspace_layout.hpp"
#include "../../graph/transposed.hpp"
#include "../common/buffer.cuh"
#include "../common/convert.cuh"
#include "../common/current_device.cuh"
#include "../common/dispatch.cuh"
#include "../common/error.cuh"
#include "../common/grid.cuh"
#include "../common/head_lanes.cuh"
#include "gat.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse::cuda {

// Lines (rows, or columns of the transpose) longer than kChunk entries, cut into chunks of kChunk.
struct chunk_lists {
  std::int64_t lines = 0, count = 0;
  device_buffer<std::int32_t> line;         // [lines]: the cut lines
  device_buffer<std::int64_t> first;        // [lines + 1]: their first chunk
  device_buffer<std::int32_t> chunk_line;   // [count]: each chunk's line
  device_buffer<std::int64_t> chunk_begin;  // [count]: its first entry
};

struct gat_device {
  int device = 0;
  std::int64_t rows = 0, cols = 0, nnz = 0;
  device_buffer<std::int64_t> row_ptr, col_ptr;
  device_buffer<std::int32_t> col_idx;
  device_buffer<std::int32_t> row_idx;   // [nnz]: the rows of each column, in row order
  device_buffer<std::int64_t> entry_of;  // [nnz]: their entries in CSR order
  chunk_lists row_chunks, col_chunks;
};

namespace {

using namespace head_lanes;

constexpr int kWarps = 8;
// The fewest blocks an SM must hold of the forward and column kernels whose lanes keep one vector
// of a head (F == V): 4, 32 warps, so at most 64 registers a thread. Their per-entry gathers are
// bound by latency, and 32 resident warps hide more of it than the 16-24 that 72-106 registers
// allowed: on the H100 the forward 1.3-1.4 × and the column pass 1.3-1.8 × faster (8 x 8 and
// 1 x 16 heads in f32), though the column pass then spills a few words to L1.
template <int V, int F>
inline constexpr int kMinBlocks = F == V ? 32 / kWarps : 1;
constexpr std::string_view kVectorWidth = "the GAT kernels' vector width";
constexpr std::int64_t kChunk = gat_plan::chunk_entries;
constexpr float kLog2e = 1.4426950408889634f;

// What the kernels read of a chunk list.
struct chunks {
  std::int64_t lines = 0, count = 0;
  const std::int32_t* line = nullptr;
  const std::int64_t* first = nullptr;
  const std::int32_t* chunk_line = nullptr;
  const std::int64_t* chunk_begin = nullptr;
};

chunks view_of(const chunk_lists& c) {
  return {
      c.lines, c.count, c.line.data(), c.first.data(), c.chunk_line.data(), c.chunk_begin.data()};
}

// The warp's share of a pass over lines (rows or columns): a whole line of at most kChunk
// entries (warps [0, lines * groups)), or one chunk of a longer line (the warps after them).
struct share {
  std::int64_t line, begin, end, chunk;  // chunk -1: the whole line
  int group;
  bool valid;
};

__device__ __forceinline__ share share_of(const std::int64_t* ptr, std::int64_t lines,
                                          const chunks& c, int groups) {
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  share w{};
  if (warp < lines * groups) {
    w.line = warp / groups;
    w.group = static_cast<int>(warp % groups);
    w.begin = ptr[w.line];
    w.end = ptr[w.line + 1];
    w.chunk = -1;
    w.valid = w.end - w.begin <= kChunk;
    return w;
  }
  const std::int64_t k = warp - lines * groups;
  w.chunk = k / groups;
  w.group = static_cast<int>(k % groups);
  w.valid = w.chunk < c.count;
  if (!w.valid) return w;
  w.line = c.chunk_line[w.chunk];
  w.begin = c.chunk_begin[w.chunk];
  w.end = min(w.begin + kChunk, ptr[w.line + 1]);
  return w;
}

// Floats a lane holds of a head (F), and edges whose loads are issued together (U).
template <int F>
inline constexpr int kUnroll = F <= 4 ? 4 : 2;

struct forward_params {
  const std::int64_t* row_ptr;
  const std::int32_t* col;
  std::int64_t rows;
  chunks cut;
  lanes l;
  operand x, a_src, a_dst, keep;
  const std::int64_t* keep_index;
  out_operand out, lse;
  float* part_acc;  // [chunks, H, C]
  float* part_ml;   // [chunks, H, 2]: running max (log2 units) and sum
  float slope;
};

// The online softmax over entries [begin, end) of row i for the lane's head: m (log2 units), l
// and the unnormalised accumulators. U edges' loads are issued before their updates.
template <class T, int V, int K, int U>
__device__ __forceinline__ void attend(const forward_params& p, const place& q, std::int64_t i,
                                       std::int64_t begin, std::int64_t end, float& m, float& l,
                                       float (&acc)[K][V]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const float ad = *p.a_dst.at<float>(i, q.load_head);
  for (std::int64_t base = begin; base < end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, end - base));
    const int mine = lane < n ? p.col[base + lane] : 0;
    // Each lane looks up one entry's keep row up front: per edge, one load less in the chain.
    const std::int64_t mine_keep =
        lane < n && p.keep_index != nullptr ? p.keep_index[base + lane] : base + lane;
    for (int u = 0; u < n; u += U) {
      float t[U], kp[U], v[U][K][V];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const int e = min(u + b, n - 1);  // past the end: the last edge again, not applied
        const std::int64_t j = __shfl_sync(0xffffffffu, mine, e);
        const float s = ad + *p.a_src.at<float>(j, q.load_head);
        t[b] = (s > 0.0f ? s : s * p.slope) * kLog2e;
        const std::int64_t kr = __shfl_sync(0xffffffffu, mine_keep, e);
        kp[b] = p.keep.data == nullptr ? 1.0f : *p.keep.at<float>(kr, q.load_head);
        load_row<T, V, K>(p.x.at<T>(j, q.load_head), p.l, q.sub, v[b]);
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        if (u + b >= n) break;
        const float mn = fmaxf(m, t[b]);
        const float rescale = exp2f(m - mn), e = exp2f(t[b] - mn);
        l = l * rescale + e;
        const float w = e * kp[b];
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int x = 0; x < V; ++x) acc[k][x] = fmaf(acc[k][x], rescale, w * v[b][k][x]);
        m = mn;
      }
    }
  }
}

template <class O, int V, int K>
__device__ __forceinline__ void finish_row(const forward_params& p, const place& q, std::int64_t i,
                                           float m, float l, float (&acc)[K][V]) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int x = 0; x < V; ++x) acc[k][x] *= inv;
  store_row<O, V, K>(p.out.at<O>(i, q.head), p.l, q.sub, acc);
  if (p.lse.data != nullptr && q.sub == 0)
    *p.lse.at<float>(i, q.head) = l > 0.0f ? (m + log2f(l)) / kLog2e : -INFINITY;
}

template <class T, class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks<V, F>)
    forward_kernel(const forward_params p) {
  constexpr int K = F / V;
  const share w = share_of(p.row_ptr, p.rows, p.cut, p.l.groups);
  if (!w.valid) return;
  const place q = place_of(p.l, w.group);
  float m = -INFINITY, l = 0.0f, acc[K][V] = {};
  attend<T, V, K, kUnroll<F>>(p, q, w.line, w.begin, w.end, m, l, acc);
  if (!q.active) return;
  if (w.chunk < 0) {
    finish_row<O, V, K>(p, q, w.line, m, l, acc);
    return;
  }
  const std::int64_t slot = w.chunk * p.l.heads + q.head;
  store_row<float, V, K>(p.part_acc + slot * p.l.width, p.l, q.sub, acc);
  if (q.sub == 0) {
    p.part_ml[2 * slot] = m;
    p.part_ml[2 * slot + 1] = l;
  }
}

// A cut row from its chunks' partial results, in chunk order.
template <class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) forward_merge_kernel(const forward_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.cut.lines * p.l.groups) return;
  const std::int64_t r = warp / p.l.groups;
  const place q = place_of(p.l, static_cast<int>(warp % p.l.groups));
  const std::int64_t first = p.cut.first[r], last = p.cut.first[r + 1];
  float m = -INFINITY;
  for (std::int64_t c = first; c < last; ++c)
    m = fmaxf(m, p.part_ml[2 * (c * p.l.heads + q.load_head)]);
  float l = 0.0f, acc[K][V] = {};
  for (std::int64_t c = first; c < last; ++c) {
    const std::int64_t slot = c * p.l.heads + q.load_head;
    const float f = exp2f(p.part_ml[2 * slot] - m);
    l = fmaf(p.part_ml[2 * slot + 1], f, l);
    float v[K][V];
    load_row<float, V, K>(p.part_acc + slot * p.l.width, p.l, q.sub, v);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int x = 0; x < V; ++x) acc[k][x] = fmaf(f, v[k][x], acc[k][x]);
  }
  if (q.active) finish_row<O, V, K>(p, q, p.cut.line[r], m, l, acc);
}

struct row_dot_params {
  std::int64_t rows;
  lanes l;
  operand dout, out, a_dst, lse;
  float4* rec;  // [rows, H]: (a_dst, lse, D, 0), what the column pass reads of a target row
};

template <class O, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) row_dot_kernel(const row_dot_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.rows * p.l.groups) return;
  const std::int64_t i = warp / p.l.groups;
  const place q = place_of(p.l, static_cast<int>(warp % p.l.groups));
  float g[K][V], o[K][V];
  load_row<O, V, K>(p.dout.at<O>(i, q.load_head), p.l, q.sub, g);
  load_row<O, V, K>(p.out.at<O>(i, q.load_head), p.l, q.sub, o);
  const float d = head_sum(lane_dot<V, K>(g, o), p.l);
  if (q.active && q.sub == 0)
    p.rec[i * p.l.heads + q.head] =
        make_float4(*p.a_dst.at<float>(i, q.head), *p.lse.at<float>(i, q.head), d, 0.0f);
}

struct column_params {
  const std::int64_t* col_ptr;
  const std::int32_t* row_idx;
  const std::int64_t* entry_of;
  std::int64_t cols;
  chunks cut;
  lanes l;
  operand x, a_src, keep, dout;
  const std::int64_t* keep_index;
  const float4* rec;  // [rows, H]: (a_dst, lse, D, 0)
  out_operand dx, da_src;
  float* de;        // [nnz, H]
  float* part_dx;   // [chunks, H, C]
  float* part_das;  // [chunks, H]
  float slope;
};

template <class T, class G, int V, int F>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks<V, F>)
    column_kernel(const column_params p) {
  constexpr int K = F / V, U = kUnroll<F>;
  const share w = share_of(p.col_ptr, p.cols, p.cut, p.l.groups);
  if (!w.valid) return;
  const place q = place_of(p.l, w.group);
  const int lane = static_cast<int>(threadIdx.x & 31);
  float xj[K][V], dx[K][V] = {};
  load_row<T, V, K>(p.x.at<T>(w.line, q.load_head), p.l, q.sub, xj);
  const float as = *p.a_src.at<float>(w.line, q.load_head);
  float das = 0.0f;
  for (std::int64_t base = w.begin; base < w.end; base += 32) {
    const int n = static_cast<int>(min(std::int64_t{32}, w.end - base));
    const int mine_row = lane < n ? p.row_idx[base + lane] : 0;
    const std::int64_t mine_entry = lane < n ? p.entry_of[base + lane] : 0;
    const std::int64_t mine_keep =
        lane < n && p.keep_index != nullptr ? p.keep_index[mine_entry] : mine_entry;
    for (int u = 0; u < n; u += U) {
      float g[U][K][V], kp[U];
      float4 r[U];
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const int e = min(u + b, n - 1);  // past the end: the last edge again, not applied
        const std::int64_t i = __shfl_sync(0xffffffffu, mine_row, e);
        load_row<G, V, K>(p.dout.at<G>(i, q.load_head), p.l, q.sub, g[b]);
        r[b] = p.rec[i * p.l.heads + q.load_head];
        const std::int64_t kr = __shfl_sync(0xffffffffu, mine_keep, e);
        kp[b] = p.keep.data == nullptr ? 1.0f : *p.keep.at<float>(kr, q.load_head);
      }
#pragma unroll
      for (int b = 0; b < U; ++b) {
        const float dot = head_sum(lane_dot<V, K>(g[b], xj), p.l);  // every lane: shuffles
        if (u + b >= n) continue;
        const float s = as + r[b].x;
        const float t = s > 0.0f ? s : s * p.slope;
        const float pe = exp2f((t - r[b].y) * kLog2e);
        const float wgt = pe * kp[b];
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int x = 0; x < V; ++x) dx[k][x] = fmaf(wgt, g[b][k][x], dx[k][x]);
        const float de = pe * (kp[b] * dot - r[b].z) * (s > 0.0f ? 1.0f : p.slope);
        das += de;
        const std::int64_t entry = __shfl_sync(0xffffffffu, mine_entry, u + b);
        if (q.active && q.sub == 0) p.de[entry * p.l.heads + q.head] = de;
      }
    }
  }
  if (!q.active) return;
  if (w.chunk < 0) {
    store_row<G, V, K>(p.dx.at<G>(w.line, q.head), p.l, q.sub, dx);
    if (q.sub == 0) *p.da_src.at<float>(w.line, q.head) = das;
    return;
  }
  const std::int64_t slot = w.chunk * p.l.heads + q.head;
  store_row<float, V, K>(p.part_dx + slot * p.l.width, p.l, q.sub, dx);
  if (q.sub == 0) p.part_das[slot] = das;
}

// A cut column's dx and da_src: its chunks' partial sums added in chunk order.
template <class G, int V, int F>
__global__ void __launch_bounds__(kWarps * 32) column_merge_kernel(const column_params p) {
  constexpr int K = F / V;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (warp >= p.cut.lines * p.l.groups) return;
  const std::int64_t r = warp / p.l.groups;
  const place q = place_of(p.l, static_cast<int>(warp % p.l.groups));
  float dx[K][V] = {}, das = 0.0f;
  for (std::int64_t c = p.cut.first[r]; c < p.cut.first[r + 1]; ++c) {
    const std::int64_t slot = c * p.l.heads + q.load_head;
    float v[K][V];
    load_row<float, V, K>(p.part_dx + slot * p.l.width, p.l, q.sub, v);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int x = 0; x < V; ++x) dx[k][x] += v[k][x];
    das += p.part_das[slot];
  }
  if (!q.active) return;
  const std::int64_t j = p.cut.line[r];
  store_row<G, V, K>(p.dx.at<G>(j, q.head), p.l, q.sub, dx);
  if (q.sub == 0) *p.da_src.at<float>(j, q.head) = das;
}

// da_dst[i, h] = sum of row i's de[e, h] in entry order: a warp a row. Where H divides 32 each
// lane keeps one head's share of the row's contiguous [entries, H] values and the lanes of a
// head are added by a butterfly; else a lane a head walks the row.
__global__ void __launch_bounds__(kWarps * 32)
    row_sum_kernel(const std::int64_t* row_ptr, const float* de, std::int64_t rows, int heads,
                   out_operand da_dst) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= rows) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const std::int64_t begin = row_ptr[i] * heads, end = row_ptr[i + 1] * heads;
  if (32 % heads == 0) {
    float s = 0.0f;
    for (std::int64_t t = begin + lane; t < end; t += 32) s += de[t];
    for (int o = 16; o >= heads; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane < heads) *da_dst.at<float>(i, lane) = s;
    return;
  }
  for (int h = lane; h < heads; h += 32) {
    float s = 0.0f;
    for (std::int64_t t = begin + h; t < end; t += heads) s += de[t];
    *da_dst.at<float>(i, h) = s;
  }
}

void check_gpu(const tensor_view& t, const char* what, std::int64_t rows, std::int64_t heads,
               std::int64_t dim) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cuda,
                          std::string(what) + " " + t.describe() + " must be on the GPU");
  check_view(t, what, rows, heads, dim);
}

void check_f32(const tensor_view& t, const char* what, std::int64_t rows, std::int64_t heads) {
  check_gpu(t, what, rows, heads, 1);
  TRISPARSE_EXPECTS_INPUT(t.type == dtype::f32,
                          std::string(what) + " " + t.describe() + " must be f32");
}

// The checks forward and backward share.
void check_inputs(const gat_device& d, const tensor_view& x, const tensor_view& a_src,
                  const tensor_view& a_dst, const tensor_view& keep, double slope) {
  expect_current_device(d.device);
  check_gpu(x, "x", d.cols, -1, -1);
  TRISPARSE_EXPECTS_INPUT(x.heads >= 1, "x needs at least one head, got " + x.describe());
  TRISPARSE_EXPECTS_INPUT(x.dim <= gat_plan::max_head_width,
                          "x " + x.describe() + ": the GAT kernels take heads up to " +
                              std::to_string(gat_plan::max_head_width) + " channels wide");
  check_f32(a_src, "a_src", d.cols, x.heads);
  check_f32(a_dst, "a_dst", d.rows, x.heads);
  if (keep.data != nullptr) check_f32(keep, "keep", d.nnz, x.heads);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(slope), "negative_slope must be finite");
}

unsigned warps_blocks(std::int64_t warps) { return blocks_for(warps * 32, kWarps * 32); }

chunk_lists make_chunks(const std::vector<std::int64_t>& ptr, cudaStream_t s) {
  std::vector<std::int32_t> line, chunk_line;
  std::vector<std::int64_t> first{0}, chunk_begin;
  for (std::size_t r = 0; r + 1 < ptr.size(); ++r) {
    if (ptr[r + 1] - ptr[r] <= kChunk) continue;
    line.push_back(static_cast<std::int32_t>(r));
    for (std::int64_t b = ptr[r]; b < ptr[r + 1]; b += kChunk) {
      chunk_line.push_back(static_cast<std::int32_t>(r));
      chunk_begin.push_back(b);
    }
    first.push_back(static_cast<std::int64_t>(chunk_line.size()));
  }
  chunk_lists c;
  c.lines = static_cast<std::int64_t>(line.size());
  c.count = static_cast<std::int64_t>(chunk_line.size());
  c.line = device_buffer<std::int32_t>(line, s);
  c.first = device_buffer<std::int64_t>(first, s);
  c.chunk_line = device_buffer<std::int32_t>(chunk_line, s);
  c.chunk_begin = device_buffer<std::int64_t>(chunk_begin, s);
  return c;
}

struct workspace_parts {
  detail::workspace_layout layout;
  std::size_t part_a = 0, part_b = 0, d = 0, de = 0;
};

// Forward: the cut rows' chunk accumulators and (max, sum); backward: the (a_dst, lse, D) records
// per row and head, de per entry and head, the cut columns' chunk dx and da_src.
workspace_parts workspace_of(const gat_device& d, std::int64_t heads, std::int64_t width,
                             bool backward) {
  workspace_parts w;
  const auto floats = [](std::int64_t n) { return static_cast<std::size_t>(n) * 4; };
  if (!backward) {
    w.part_a = w.layout.add(floats(d.row_chunks.count * heads * width));
    w.part_b = w.layout.add(floats(d.row_chunks.count * heads * 2));
    return w;
  }
  w.d = w.layout.add(floats(d.rows * heads * 4));
  w.de = w.layout.add(floats(d.nnz * heads));
  w.part_a = w.layout.add(floats(d.col_chunks.count * heads * width));
  w.part_b = w.layout.add(floats(d.col_chunks.count * heads));
  return w;
}

}  // namespace

std::shared_ptr<const gat_device> upload_gat(const csr_graph& g, stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  auto d = std::make_shared<gat_device>();
  d->device = current_device().device;
  d->rows = g.rows;
  d->cols = g.cols;
  d->nnz = g.nnz();
  const detail::transposed_pattern t = detail::transposed_of(g);
  d->row_ptr = device_buffer<std::int64_t>(g.row_ptr, s);
  d->col_idx = device_buffer<std::int32_t>(g.col_idx, s);
  d->col_ptr = device_buffer<std::int64_t>(t.col_ptr, s);
  d->row_idx = device_buffer<std::int32_t>(t.row_idx, s);
  d->entry_of = device_buffer<std::int64_t>(t.entry, s);
  d->row_chunks = make_chunks(g.row_ptr, s);
  d->col_chunks = make_chunks(t.col_ptr, s);
  return d;
}

std::size_t gat_workspace_bytes(const gat_device& d, std::int64_t heads, std::int64_t width,
                                bool backward) {
  return workspace_of(d, heads, width, backward).layout.bytes();
}

void gat_forward(const gat_device& d, const gat_args& a, const workspace_view& workspace,
                 stream_ref stream) {
  check_inputs(d, a.x, a.a_src, a.a_dst, a.keep, a.negative_slope);
  check_gpu(a.out, "out", d.rows, a.x.heads, a.x.dim);
  if (a.lse.data != nullptr) check_f32(a.lse, "lse", d.rows, a.x.heads);
  const workspace_parts ws = workspace_of(d, a.x.heads, a.x.dim, false);
  ws.layout.check(workspace, "GAT forward");
  const int heads = static_cast<int>(a.x.heads), width = static_cast<int>(a.x.dim);
  const int vec =
      vector_of(heads, {width}, 16 / static_cast<int>(size_of(a.x.type)), {&a.x, &a.out});
  const forward_params p{d.row_ptr.data(),
                         d.col_idx.data(),
                         d.rows,
                         view_of(d.row_chunks),
                         layout_of(heads, width, vec),
                         in(a.x),
                         in(a.a_src),
                         in(a.a_dst),
                         in(a.keep),
                         a.keep_index,
                         out_of(a.out),
                         out_of(a.lse),
                         detail::workspace_layout::at<float>(workspace, ws.part_a),
                         detail::workspace_layout::at<float>(workspace, ws.part_b),
                         static_cast<float>(a.negative_slope)};
  const std::int64_t groups = p.l.groups;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(a.x.type, "x", [&]<class T>() {
    with_output_type<T>(a.out.type, "out", [&]<class O>() {
      with_lanes<16>(vec, p.l, kVectorWidth, [&]<int V, int F>() {
        forward_kernel<T, O, V, F>
            <<<warps_blocks((d.rows + d.row_chunks.count) * groups), kWarps * 32, 0, s>>>(p);
        TRISPARSE_CUDA_CHECK_LAUNCH();
        if (d.row_chunks.lines > 0) {
          forward_merge_kernel<O, V, F>
              <<<warps_blocks(d.row_chunks.lines * groups), kWarps * 32, 0, s>>>(p);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
      });
    });
  });
}

void gat_backward(const gat_device& d, const gat_grad_args& a, const workspace_view& workspace,
                  stream_ref stream) {
  check_inputs(d, a.x, a.a_src, a.a_dst, a.keep, a.negative_slope);
  const std::int64_t heads = a.x.heads;
  check_gpu(a.out, "out", d.rows, heads, a.x.dim);
  check_f32(a.lse, "lse", d.rows, heads);
  check_gpu(a.dout, "dout", d.rows, heads, a.x.dim);
  TRISPARSE_EXPECTS_INPUT(a.dout.type == a.out.type, "dout " + a.dout.describe() +
                                                         " needs out's dtype (" +
                                                         std::string(to_string(a.out.type)) + ")");
  check_gpu(a.dx, "dx", d.cols, heads, a.x.dim);
  TRISPARSE_EXPECTS_INPUT(a.dx.type == a.dout.type,
                          "dx " + a.dx.describe() + " needs dout's dtype");
  check_f32(a.da_src, "da_src", d.cols, heads);
  check_f32(a.da_dst, "da_dst", d.rows, heads);
  const workspace_parts ws = workspace_of(d, heads, a.x.dim, true);
  ws.layout.check(workspace, "GAT backward");
  auto* rec = detail::workspace_layout::at<float4>(workspace, ws.d);
  float* de = detail::workspace_layout::at<float>(workspace, ws.de);
  const int h = static_cast<int>(heads), width = static_cast<int>(a.x.dim);
  const int vec = vector_of(h, {width}, 16 / static_cast<int>(size_of(a.x.type)),
                            {&a.x, &a.out, &a.dout, &a.dx});
  const lanes l = layout_of(h, width, vec);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const row_dot_params rd{d.rows, l, in(a.dout), in(a.out), in(a.a_dst), in(a.lse), rec};
  const column_params cp{d.col_ptr.data(),
                         d.row_idx.data(),
                         d.entry_of.data(),
                         d.cols,
                         view_of(d.col_chunks),
                         l,
                         in(a.x),
                         in(a.a_src),
                         in(a.keep),
                         in(a.dout),
                         a.keep_index,
                         rec,
                         out_of(a.dx),
                         out_of(a.da_src),
                         de,
                         detail::workspace_layout::at<float>(workspace, ws.part_a),
                         detail::workspace_layout::at<float>(workspace, ws.part_b),
                         static_cast<float>(a.negative_slope)};
  with_element_type(a.x.type, "x", [&]<class T>() {
    with_output_type<T>(a.dout.type, "dout", [&]<class G>() {
      with_lanes<16>(vec, l, kVectorWidth, [&]<int V, int F>() {
        row_dot_kernel<G, V, F><<<warps_blocks(d.rows * l.groups), kWarps * 32, 0, s>>>(rd);
        TRISPARSE_CUDA_CHECK_LAUNCH();
        column_kernel<T, G, V, F>
            <<<warps_blocks((d.cols + d.col_chunks.count) * l.groups), kWarps * 32, 0, s>>>(cp);
        TRISPARSE_CUDA_CHECK_LAUNCH();
        if (d.col_chunks.lines > 0) {
          column_merge_kernel<G, V, F>
              <<<warps_blocks(d.col_chunks.lines * l.groups), kWarps * 32, 0, s>>>(cp);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
      });
    });
  });
  row_sum_kernel<<<warps_blocks(d.rows), kWarps * 32, 0, s>>>(d.row_ptr.data(), de, d.rows, h,
                                                              out_of(a.da_dst));
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

}  // namespace trisparse::cuda
