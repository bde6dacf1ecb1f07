// The GCN layer's fp32 CPU engine (gcn.hpp).
#include "gcn.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "../common/simd.hpp"

namespace trisparse::cpu {

namespace {

// A [rows, 1, dim] f32 view as a row-major matrix with its row stride.
struct mat {
  float* data = nullptr;
  std::int64_t ld = 0, cols = 0;
  float* row(std::int64_t r) const { return data + r * ld; }
};

mat mat_of(const tensor_view& t) { return {static_cast<float*>(t.data), t.row_stride, t.dim}; }

// d = sum_e p_e src_{col e} over the entries [e0, e1) of one row (entry order); cloned for AVX2 +
// FMA where the CPU has them.
[[gnu::target_clones("arch=x86-64-v3", "default")]] void spmm_row(const csr_graph& p,
                                                                  std::int64_t e0, std::int64_t e1,
                                                                  const mat& src, float* d) {
  std::fill_n(d, src.cols, 0.0f);
  for (std::int64_t e = e0; e < e1; ++e) {
    const float v = p.values[static_cast<std::size_t>(e)];
    const float* s = src.row(p.col_idx[static_cast<std::size_t>(e)]);
    for (std::int64_t c = 0; c < src.cols; ++c) d[c] += v * s[c];
  }
}

// dst_i = sum_e p_e src_{col e} over each row i of p (entry order).
void spmm(const csr_graph& p, const mat& src, const mat& dst) {
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t i = 0; i < p.rows; ++i)
    spmm_row(p, p.row_ptr[i], p.row_ptr[i + 1], src, dst.row(i));
}

constexpr std::int64_t kCols = 32;  // output columns a row accumulates in registers at once

// y = x B (B: [k, n]) for one row x, kCols output columns at a time in four vector accumulators
// that stay in registers; zero entries of x skipped (they add exactly 0 for finite B; bag-of-words
// features are mostly 0). Cloned for AVX2 + FMA where the CPU has them (the library is built for
// x86-64-v2).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void row_times(const float* x, const mat& b,
                                                                   float* y, std::int64_t k_dim,
                                                                   std::int64_t n_dim) {
  std::int64_t n0 = 0;
  for (; n0 + kCols <= n_dim; n0 += kCols) {
    weighted_rows<kCols / 8, true>(
        k_dim, [&](std::int64_t k) { return x[k]; }, [&](std::int64_t k) { return b.row(k) + n0; },
        y + n0);
  }
  for (; n0 < n_dim; ++n0) {  // the last columns, one at a time
    float acc = 0.0f;
    for (std::int64_t k = 0; k < k_dim; ++k) acc += x[k] * b.row(k)[n0];
    y[n0] = acc;
  }
}

// c_i = a_i B row by row.
void rows_times(const mat& a, const mat& b, const mat& c, std::int64_t rows) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) row_times(a.row(i), b, c.row(i), a.cols, c.cols);
}

// c_i = a_i B^T (B: [n, k]) row by row: dot products of a_i with B's rows.
void rows_times_transposed(const mat& a, const mat& b, const mat& c, std::int64_t rows) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* x = a.row(i);
    float* y = c.row(i);
    for (std::int64_t n = 0; n < c.cols; ++n) {
      const float* bn = b.row(n);
      float s = 0.0f;
      for (std::int64_t k = 0; k < a.cols; ++k) s += x[k] * bn[k];
      y[n] = s;
    }
  }
}

// c = a^T b over `rows` rows (c: [a.cols, b.cols]). The rows are cut into kRanges fixed ranges
// (whatever the thread count), each streamed in row order into its own partial c, zero entries of
// a skipped (they add exactly 0 for finite b); the partials are then added in range order.
void transposed_times(const mat& a, const mat& b, const mat& c, std::int64_t rows) {
  constexpr std::int64_t kRanges = 16;
  const std::int64_t size = a.cols * c.cols;
  std::vector<float> part(static_cast<std::size_t>(kRanges * size), 0.0f);
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t r = 0; r < kRanges; ++r) {
    float* pr = part.data() + r * size;
    for (std::int64_t i = r * rows / kRanges; i < (r + 1) * rows / kRanges; ++i) {
      const float* x = a.row(i);
      const float* y = b.row(i);
      for (std::int64_t f = 0; f < a.cols; ++f) {
        const float xf = x[f];
        if (xf == 0.0f) continue;
        float* cf = pr + f * c.cols;
        for (std::int64_t o = 0; o < c.cols; ++o) cf[o] += xf * y[o];
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t f = 0; f < a.cols; ++f) {
    float* cf = c.row(f);
    std::fill_n(cf, c.cols, 0.0f);
    for (std::int64_t r = 0; r < kRanges; ++r) {
      const float* pf = part.data() + r * size + f * c.cols;
      for (std::int64_t o = 0; o < c.cols; ++o) cf[o] += pf[o];
    }
  }
}

bool passes(std::span<const std::uint32_t> mask, std::int64_t words, std::int64_t i,
            std::int64_t f) {
  return mask.empty() || (mask[static_cast<std::size_t>(i * words + f / 32)] >> (f % 32) & 1u);
}

}  // namespace

void gcn_forward(const csr_graph& p, const tensor_view& x, const tensor_view& w,
                 const tensor_view& bias, bool relu, const tensor_view& out,
                 std::uint32_t* relu_mask, const tensor_view& ax) {
  const std::int64_t n = p.rows, f_in = x.dim, f_out = w.dim;
  const mat xm = mat_of(x), wm = mat_of(w), om = mat_of(out);
  if (ax.data != nullptr) spmm(p, xm, mat_of(ax));
  // Every element is written below (no zero fill).
  const std::unique_ptr<float[]> tmp(
      new float[static_cast<std::size_t>(n * std::min(f_in, f_out))]);
  if (f_out < f_in) {  // P (x W)
    const mat xw{tmp.get(), f_out, f_out};
    rows_times(xm, wm, xw, n);
    spmm(p, xw, om);
  } else {  // (P x) W
    const mat pxm{tmp.get(), f_in, f_in};
    spmm(p, xm, pxm);
    rows_times(pxm, wm, om, n);
  }
  const std::int64_t words = (f_out + 31) / 32;
  const auto* b = static_cast<const float*>(bias.data);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    float* o = om.row(i);
    if (relu_mask != nullptr) std::fill_n(relu_mask + i * words, words, 0u);
    for (std::int64_t f = 0; f < f_out; ++f) {
      const float z = b != nullptr ? o[f] + b[f] : o[f];
      if (relu_mask != nullptr && z > 0.0f) relu_mask[i * words + f / 32] |= 1u << (f % 32);
      o[f] = relu && !(z > 0.0f) ? 0.0f : z;
    }
  }
}

void gcn_backward(const csr_graph& p, const csr_graph& pt, const tensor_view& x,
                  const tensor_view& w, std::span<const std::uint32_t> relu_mask,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& dw,
                  const tensor_view& dbias) {
  const std::int64_t n = p.rows, f_in = x.dim, f_out = w.dim, words = (f_out + 31) / 32;
  const mat xm = mat_of(x), wm = mat_of(w), gm = mat_of(dout), dxm = mat_of(dx), dwm = mat_of(dw);
  std::vector<float> dz(static_cast<std::size_t>(n * f_out));
  const mat dzm{dz.data(), f_out, f_out};
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t f = 0; f < f_out; ++f)
      dz[static_cast<std::size_t>(i * f_out + f)] =
          passes(relu_mask, words, i, f) ? gm.row(i)[f] : 0.0f;
  if (dbias.data != nullptr) {
    auto* db = static_cast<float*>(dbias.data);
    for (std::int64_t f = 0; f < f_out; ++f) db[f] = 0.0f;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t f = 0; f < f_out; ++f) db[f] += dzm.row(i)[f];
  }
  if (f_out < f_in) {  // u = P^T dz; dw = x^T u; dx = u W^T
    std::vector<float> u(static_cast<std::size_t>(n * f_out));
    const mat um{u.data(), f_out, f_out};
    spmm(pt, dzm, um);
    transposed_times(xm, um, dwm, n);
    if (dx.data != nullptr) rows_times_transposed(um, wm, dxm, n);
  } else {  // dw = (P x)^T dz; t = dz W^T; dx = P^T t
    std::vector<float> tmp(static_cast<std::size_t>(n * f_in));
    const mat tm{tmp.data(), f_in, f_in};
    spmm(p, xm, tm);
    transposed_times(tm, dzm, dwm, n);
    if (dx.data == nullptr) return;
    rows_times_transposed(dzm, wm, tm, n);
    spmm(pt, tm, dxm);
  }
}

}  // namespace trisparse::cpu
