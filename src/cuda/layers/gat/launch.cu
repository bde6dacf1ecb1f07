// The fused GAT attention on CUDA: the pattern and its chunk lists on the device, the argument
// checks and the launches of kernel.cuh (the design is there).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "../../../common/arguments.hpp"
#include "../../../common/workspace_layout.hpp"
#include "../../../graph/transposed.hpp"
#include "../../common/buffer.cuh"
#include "../../common/convert.cuh"
#include "../../common/current_device.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/grid.cuh"
#include "../../common/head_lanes.cuh"
#include "kernel.cuh"
#include "plan.hpp"
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

using namespace gat;

constexpr std::string_view kVectorWidth = "the GAT kernels' vector width";

chunks view_of(const chunk_lists& c) {
  return {
      c.lines, c.count, c.line.data(), c.first.data(), c.chunk_line.data(), c.chunk_begin.data()};
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

// Attention dropout's draws made in the kernels, where asked (gat_args::dropout).
draws draws_of(const attention_dropout& d) {
  if (d.p <= 0) return {};
  return {d.state, philox::drop_below(d.p), static_cast<float>(1.0 / (1.0 - d.p))};
}

// The checks forward and backward share.
void check_inputs(const gat_device& d, const tensor_view& x, const tensor_view& a_src,
                  const tensor_view& a_dst, const tensor_view& keep,
                  const attention_dropout& dropout, double slope) {
  expect_current_device(d.device);
  check_gpu(x, "x", d.cols, -1, -1);
  TRISPARSE_EXPECTS_INPUT(x.heads >= 1, "x needs at least one head, got " + x.describe());
  TRISPARSE_EXPECTS_INPUT(x.dim <= gat_max_head_width,
                          "x " + x.describe() + ": the GAT kernels take heads up to " +
                              std::to_string(gat_max_head_width) + " channels wide");
  check_f32(a_src, "a_src", d.cols, x.heads);
  check_f32(a_dst, "a_dst", d.rows, x.heads);
  if (keep.data != nullptr) check_f32(keep, "keep", d.nnz, x.heads);
  detail::check_keep_or_dropout(keep, dropout);
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
  check_inputs(d, a.x, a.a_src, a.a_dst, a.keep, a.dropout, a.negative_slope);
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
                         static_cast<float>(a.negative_slope),
                         draws_of(a.dropout)};
  const std::int64_t groups = p.l.groups;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(a.x.type, "x", [&]<class T>() {
    with_output_type<T>(a.out.type, "out", [&]<class O>() {
      with_lanes<16>(vec, p.l, kVectorWidth, [&]<int V, int F>() {
        const unsigned blocks = warps_blocks((d.rows + d.row_chunks.count) * groups);
        if (p.drop.state != nullptr)
          forward_kernel<T, O, V, F, true><<<blocks, kWarps * 32, 0, s>>>(p);
        else
          forward_kernel<T, O, V, F, false><<<blocks, kWarps * 32, 0, s>>>(p);
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
  check_inputs(d, a.x, a.a_src, a.a_dst, a.keep, a.dropout, a.negative_slope);
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
                         static_cast<float>(a.negative_slope),
                         draws_of(a.dropout)};
  with_element_type(a.x.type, "x", [&]<class T>() {
    with_output_type<T>(a.dout.type, "dout", [&]<class G>() {
      with_lanes<16>(vec, l, kVectorWidth, [&]<int V, int F>() {
        row_dot_kernel<G, V, F><<<warps_blocks(d.rows * l.groups), kWarps * 32, 0, s>>>(rd);
        TRISPARSE_CUDA_CHECK_LAUNCH();
        const unsigned blocks = warps_blocks((d.cols + d.col_chunks.count) * l.groups);
        if (cp.drop.state != nullptr)
          column_kernel<T, G, V, F, true><<<blocks, kWarps * 32, 0, s>>>(cp);
        else
          column_kernel<T, G, V, F, false><<<blocks, kWarps * 32, 0, s>>>(cp);
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
