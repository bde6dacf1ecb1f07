// The GCN layer's fp32 CPU engine (gcn.hpp).
#include "gcn.hpp"

#include <algorithm>
#include <vector>

namespace trisparse::cpu {

namespace {

// A [rows, 1, dim] f32 view as a row-major matrix with its row stride.
struct mat {
  float* data = nullptr;
  std::int64_t ld = 0, cols = 0;
  float* row(std::int64_t r) const { return data + r * ld; }
};

mat mat_of(const tensor_view& t) { return {static_cast<float*>(t.data), t.row_stride, t.dim}; }

// dst_i = sum_e p_e src_{col e} over each row i of p (entry order).
void spmm(const csr_graph& p, const mat& src, const mat& dst) {
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t i = 0; i < p.rows; ++i) {
    float* d = dst.row(i);
    std::fill_n(d, src.cols, 0.0f);
    for (std::int64_t e = p.row_ptr[i]; e < p.row_ptr[i + 1]; ++e) {
      const float v = p.values[static_cast<std::size_t>(e)];
      const float* s = src.row(p.col_idx[static_cast<std::size_t>(e)]);
      for (std::int64_t c = 0; c < src.cols; ++c) d[c] += v * s[c];
    }
  }
}

constexpr std::int64_t kCols = 16;  // output columns a row accumulates in registers at once

// c_i = a_i B (B: [k, n]) row by row, kCols output columns at a time in local accumulators; zero
// entries of a skipped (they add exactly 0 for finite B; bag-of-words features are mostly 0).
void rows_times(const mat& a, const mat& b, const mat& c, std::int64_t rows) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* x = a.row(i);
    float* y = c.row(i);
    for (std::int64_t n0 = 0; n0 < c.cols; n0 += kCols) {
      const std::int64_t nn = std::min(kCols, c.cols - n0);
      float acc[kCols] = {};
      for (std::int64_t k = 0; k < a.cols; ++k) {
        const float xk = x[k];
        if (xk == 0.0f) continue;
        const float* bk = b.row(k) + n0;
        if (nn == kCols) {
          for (std::int64_t n = 0; n < kCols; ++n) acc[n] += xk * bk[n];
        } else {
          for (std::int64_t n = 0; n < nn; ++n) acc[n] += xk * bk[n];
        }
      }
      std::copy_n(acc, nn, y + n0);
    }
  }
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
  std::vector<float> tmp(static_cast<std::size_t>(n * std::min(f_in, f_out)));
  if (f_out < f_in) {  // P (x W)
    const mat xw{tmp.data(), f_out, f_out};
    rows_times(xm, wm, xw, n);
    spmm(p, xw, om);
  } else {  // (P x) W
    const mat pxm{tmp.data(), f_in, f_in};
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
