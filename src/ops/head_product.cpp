// The per-head products (include/trisparse/ops/head_product.hpp): the argument checks, the CPU's
// float64 loops (the reference), and the CUDA kernels' entry (src/cuda/layers/head_product).
#include "trisparse/ops/head_product.hpp"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../cuda/layers/head_product/head_product.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse {

namespace {

// The bytes [first, last) a view's elements span.
std::pair<const char*, const char*> span_of(const tensor_view& t) {
  const auto* p = static_cast<const char*>(t.data);
  if (t.numel() == 0) return {p, p};
  const std::int64_t last = t.offset(t.rows - 1, t.heads - 1, t.dim - 1);
  return {p, p + (last + 1) * static_cast<std::int64_t>(sizeof(float))};
}

bool overlap(const tensor_view& a, const tensor_view& b) {
  const auto [a0, a1] = span_of(a);
  const auto [b0, b1] = span_of(b);
  return a0 < b1 && b0 < a1;
}

// Checks the operands of either op: x [N, H, a], y [N, H, b] or [H, a, b] (the weight), the
// output on their device; all float32.
void check_operands(const char* op, const tensor_view& x, const tensor_view& y, const char* y_name,
                    const tensor_view& out, const char* out_name) {
  for (const tensor_view* t : {&x, &y, &out})
    TRISPARSE_EXPECTS_INPUT(t->type == dtype::f32, std::string(op) + ": x, " + y_name + " and " +
                                                       out_name + " must be float32, got " +
                                                       t->describe());
  TRISPARSE_EXPECTS_INPUT(
      x.where == y.where && x.where == out.where && x.device_id == y.device_id &&
          x.device_id == out.device_id,
      std::string(op) + ": x, " + y_name + " and " + out_name + " must be on one device");
  TRISPARSE_EXPECTS_INPUT(!overlap(out, x) && !overlap(out, y),
                          std::string(op) + ": " + out_name + " overlaps an input");
}

// The CUDA kernels' widths (register arrays of kHeadProductMaxWidth floats).
void check_cuda_widths(const char* op, std::int64_t a, std::int64_t b) {
  if (a > kHeadProductMaxWidth || b > kHeadProductMaxWidth)
    throw not_supported(std::string(op) + ": CUDA takes widths up to " +
                        std::to_string(kHeadProductMaxWidth) + ", got " + std::to_string(a) +
                        " x " + std::to_string(b));
}

}  // namespace

void head_product(const tensor_view& x, const tensor_view& w, const tensor_view& out,
                  stream_ref stream) {
  check_view(x, "head_product: x", -1, -1, -1);
  check_view(w, "head_product: w (rows: heads, heads: x's width, dim: out's width)", x.heads, x.dim,
             -1);
  check_view(out, "head_product: out", x.rows, x.heads, w.dim);
  check_operands("head_product", x, w, "w", out, "out");
  const std::int64_t a = x.dim, b = w.dim;
  if (x.rows * x.heads * b == 0) return;
  if (x.where == device_kind::cuda) {
    check_cuda_widths("head_product", a, b);
    cuda::head_product(x, w, out, stream);
    return;
  }
  const auto* xd = static_cast<const float*>(x.data);
  const auto* wd = static_cast<const float*>(w.data);
  auto* od = static_cast<float*>(out.data);
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < x.rows; ++n) {
    std::vector<double> acc(static_cast<std::size_t>(b));
    for (std::int64_t h = 0; h < x.heads; ++h) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t i = 0; i < a; ++i) {
        const double xi = xd[x.offset(n, h, i)];
        for (std::int64_t j = 0; j < b; ++j) acc[j] += xi * wd[w.offset(h, i, j)];
      }
      for (std::int64_t j = 0; j < b; ++j) od[out.offset(n, h, j)] = static_cast<float>(acc[j]);
    }
  }
}

std::size_t head_outer_workspace_bytes(std::int64_t rows, std::int64_t heads, std::int64_t a,
                                       std::int64_t b) {
  TRISPARSE_EXPECTS_INPUT(rows >= 0 && heads >= 0 && a >= 0 && b >= 0,
                          "head_outer_workspace_bytes: the sizes must be >= 0");
  const std::int64_t chunks = (rows + kHeadOuterChunkRows - 1) / kHeadOuterChunkRows;
  return static_cast<std::size_t>(chunks * heads * a * b) * sizeof(float);
}

void head_outer(const tensor_view& x, const tensor_view& g, const tensor_view& dw, void* workspace,
                std::size_t workspace_bytes, stream_ref stream) {
  check_view(x, "head_outer: x", -1, -1, -1);
  check_view(g, "head_outer: g", x.rows, x.heads, -1);
  check_view(dw, "head_outer: dw (rows: heads, heads: x's width, dim: g's width)", x.heads, x.dim,
             g.dim);
  check_operands("head_outer", x, g, "g", dw, "dw");
  const std::int64_t a = x.dim, b = g.dim;
  if (x.heads * a * b == 0) return;
  if (x.where == device_kind::cuda) {
    check_cuda_widths("head_outer", a, b);
    const std::size_t need = head_outer_workspace_bytes(x.rows, x.heads, a, b);
    TRISPARSE_EXPECTS_INPUT(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                            "head_outer: the workspace holds " + std::to_string(workspace_bytes) +
                                " bytes, it needs " + std::to_string(need));
    cuda::head_outer(x, g, dw, static_cast<float*>(workspace), stream);
    return;
  }
  const auto* xd = static_cast<const float*>(x.data);
  const auto* gd = static_cast<const float*>(g.data);
  auto* out = static_cast<float*>(dw.data);
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t h = 0; h < x.heads; ++h) {
    for (std::int64_t i = 0; i < a; ++i) {
      std::vector<double> acc(static_cast<std::size_t>(b), 0.0);
      for (std::int64_t n = 0; n < x.rows; ++n) {
        const double xi = xd[x.offset(n, h, i)];
        for (std::int64_t j = 0; j < b; ++j) acc[j] += xi * gd[g.offset(n, h, j)];
      }
      for (std::int64_t j = 0; j < b; ++j) out[dw.offset(h, i, j)] = static_cast<float>(acc[j]);
    }
  }
}

}  // namespace trisparse
