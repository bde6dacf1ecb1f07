// The GCN layer's CPU engine (gcn.hpp), in fp32 or float64.
#include "gcn.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "../common/simd.hpp"

namespace trisparse::cpu {

namespace {

// A [rows, 1, dim] view of T as a row-major matrix with its row stride.
template <class T>
struct mat {
  T* data = nullptr;
  std::int64_t ld = 0, cols = 0;
  T* row(std::int64_t r) const { return data + r * ld; }
};

template <class T>
mat<T> mat_of(const tensor_view& t) {
  return {static_cast<T*>(t.data), t.row_stride, t.dim};
}

// d = sum_e p_e src_{col e} over the entries [e0, e1) of one row (entry order).
template <class T>
[[gnu::always_inline]] inline void spmm_row_body(const csr_graph& p, std::int64_t e0,
                                                 std::int64_t e1, const mat<T>& src, T* d) {
  std::fill_n(d, src.cols, T{0});
  for (std::int64_t e = e0; e < e1; ++e) {
    const T v = p.values[static_cast<std::size_t>(e)];
    const T* s = src.row(p.col_idx[static_cast<std::size_t>(e)]);
    for (std::int64_t c = 0; c < src.cols; ++c) d[c] += v * s[c];
  }
}
// Cloned for AVX2 + FMA where the CPU has them (the fp32 engine's; float64 is the gradcheck's).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void spmm_row(const csr_graph& p,
                                                                  std::int64_t e0, std::int64_t e1,
                                                                  const mat<float>& src, float* d) {
  spmm_row_body(p, e0, e1, src, d);
}
void spmm_row(const csr_graph& p, std::int64_t e0, std::int64_t e1, const mat<double>& src,
              double* d) {
  spmm_row_body(p, e0, e1, src, d);
}

// dst_i = sum_e p_e src_{col e} over each row i of p (entry order).
template <class T>
void spmm(const csr_graph& p, const mat<T>& src, const mat<T>& dst) {
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t i = 0; i < p.rows; ++i)
    spmm_row(p, p.row_ptr[i], p.row_ptr[i + 1], src, dst.row(i));
}

constexpr std::int64_t kCols = 32;  // output columns a row accumulates in registers at once

// y = x B (B: [k, n]) for one row x, kCols output columns at a time in four vector accumulators
// that stay in registers; zero entries of x skipped (they add exactly 0 for finite B; bag-of-words
// features are mostly 0). Cloned for AVX2 + FMA where the CPU has them (the library is built for
// x86-64-v2).
// Columns [n0, n_dim) of y = x B one at a time.
template <class T>
void columns_of_row_times(const T* x, const mat<T>& b, T* y, std::int64_t k_dim, std::int64_t n0,
                          std::int64_t n_dim) {
  for (; n0 < n_dim; ++n0) {
    T acc = 0;
    for (std::int64_t k = 0; k < k_dim; ++k) acc += x[k] * b.row(k)[n0];
    y[n0] = acc;
  }
}
[[gnu::target_clones("arch=x86-64-v3", "default")]] void row_times(const float* x,
                                                                   const mat<float>& b, float* y,
                                                                   std::int64_t k_dim,
                                                                   std::int64_t n_dim) {
  std::int64_t n0 = 0;
  for (; n0 + kCols <= n_dim; n0 += kCols) {
    weighted_rows<kCols / 8, true>(
        k_dim, [&](std::int64_t k) { return x[k]; }, [&](std::int64_t k) { return b.row(k) + n0; },
        y + n0);
  }
  columns_of_row_times(x, b, y, k_dim, n0, n_dim);  // the last columns
}
void row_times(const double* x, const mat<double>& b, double* y, std::int64_t k_dim,
               std::int64_t n_dim) {
  columns_of_row_times(x, b, y, k_dim, 0, n_dim);
}

// c_i = a_i B row by row.
template <class T>
void rows_times(const mat<T>& a, const mat<T>& b, const mat<T>& c, std::int64_t rows) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) row_times(a.row(i), b, c.row(i), a.cols, c.cols);
}

// c_i = a_i B^T (B: [n, k]) row by row: dot products of a_i with B's rows.
template <class T>
void rows_times_transposed(const mat<T>& a, const mat<T>& b, const mat<T>& c, std::int64_t rows) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) {
    const T* x = a.row(i);
    T* y = c.row(i);
    for (std::int64_t n = 0; n < c.cols; ++n) {
      const T* bn = b.row(n);
      T s = 0;
      for (std::int64_t k = 0; k < a.cols; ++k) s += x[k] * bn[k];
      y[n] = s;
    }
  }
}

// c = a^T b over `rows` rows (c: [a.cols, b.cols]). The rows are cut into kRanges fixed ranges
// (whatever the thread count), each streamed in row order into its own partial c, zero entries of
// a skipped (they add exactly 0 for finite b); the partials are then added in range order.
template <class T>
void transposed_times(const mat<T>& a, const mat<T>& b, const mat<T>& c, std::int64_t rows) {
  constexpr std::int64_t kRanges = 16;
  const std::int64_t size = a.cols * c.cols;
  std::vector<T> part(static_cast<std::size_t>(kRanges * size), T{0});
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t r = 0; r < kRanges; ++r) {
    T* pr = part.data() + r * size;
    for (std::int64_t i = r * rows / kRanges; i < (r + 1) * rows / kRanges; ++i) {
      const T* x = a.row(i);
      const T* y = b.row(i);
      for (std::int64_t f = 0; f < a.cols; ++f) {
        const T xf = x[f];
        if (xf == T{0}) continue;
        T* cf = pr + f * c.cols;
        for (std::int64_t o = 0; o < c.cols; ++o) cf[o] += xf * y[o];
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t f = 0; f < a.cols; ++f) {
    T* cf = c.row(f);
    std::fill_n(cf, c.cols, T{0});
    for (std::int64_t r = 0; r < kRanges; ++r) {
      const T* pf = part.data() + r * size + f * c.cols;
      for (std::int64_t o = 0; o < c.cols; ++o) cf[o] += pf[o];
    }
  }
}

bool passes(std::span<const std::uint32_t> mask, std::int64_t words, std::int64_t i,
            std::int64_t f) {
  return mask.empty() || (mask[static_cast<std::size_t>(i * words + f / 32)] >> (f % 32) & 1u);
}

}  // namespace

template <class T>
void gcn_forward(const csr_graph& p, const tensor_view& x, const tensor_view& w,
                 const tensor_view& bias, bool relu, const tensor_view& out,
                 std::uint32_t* relu_mask, const tensor_view& ax) {
  const std::int64_t n = p.rows, f_in = x.dim, f_out = w.dim;
  const mat<T> xm = mat_of<T>(x), wm = mat_of<T>(w), om = mat_of<T>(out);
  if (ax.data != nullptr) spmm(p, xm, mat_of<T>(ax));
  // Every element is written below (no zero fill).
  const std::unique_ptr<T[]> tmp(new T[static_cast<std::size_t>(n * std::min(f_in, f_out))]);
  if (f_out < f_in) {  // P (x W)
    const mat<T> xw{tmp.get(), f_out, f_out};
    rows_times(xm, wm, xw, n);
    spmm(p, xw, om);
  } else {  // (P x) W
    const mat<T> pxm{tmp.get(), f_in, f_in};
    spmm(p, xm, pxm);
    rows_times(pxm, wm, om, n);
  }
  const std::int64_t words = (f_out + 31) / 32;
  const auto* b = static_cast<const T*>(bias.data);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    T* o = om.row(i);
    if (relu_mask != nullptr) std::fill_n(relu_mask + i * words, words, 0u);
    for (std::int64_t f = 0; f < f_out; ++f) {
      const T z = b != nullptr ? o[f] + b[f] : o[f];
      if (relu_mask != nullptr && z > T{0}) relu_mask[i * words + f / 32] |= 1u << (f % 32);
      o[f] = relu && !(z > T{0}) ? T{0} : z;
    }
  }
}

template <class T>
void gcn_backward(const csr_graph& p, const csr_graph& pt, const tensor_view& x,
                  const tensor_view& w, std::span<const std::uint32_t> relu_mask,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& dw,
                  const tensor_view& dbias) {
  const std::int64_t n = p.rows, f_in = x.dim, f_out = w.dim, words = (f_out + 31) / 32;
  const mat<T> xm = mat_of<T>(x), wm = mat_of<T>(w), gm = mat_of<T>(dout), dxm = mat_of<T>(dx),
               dwm = mat_of<T>(dw);
  std::vector<T> dz(static_cast<std::size_t>(n * f_out));
  const mat<T> dzm{dz.data(), f_out, f_out};
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t f = 0; f < f_out; ++f)
      dz[static_cast<std::size_t>(i * f_out + f)] =
          passes(relu_mask, words, i, f) ? gm.row(i)[f] : T{0};
  if (dbias.data != nullptr) {
    auto* db = static_cast<T*>(dbias.data);
    for (std::int64_t f = 0; f < f_out; ++f) db[f] = T{0};
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t f = 0; f < f_out; ++f) db[f] += dzm.row(i)[f];
  }
  if (f_out < f_in) {  // u = P^T dz; dw = x^T u; dx = u W^T
    std::vector<T> u(static_cast<std::size_t>(n * f_out));
    const mat<T> um{u.data(), f_out, f_out};
    spmm(pt, dzm, um);
    transposed_times(xm, um, dwm, n);
    if (dx.data != nullptr) rows_times_transposed(um, wm, dxm, n);
  } else {  // dw = (P x)^T dz; t = dz W^T; dx = P^T t
    std::vector<T> tmp(static_cast<std::size_t>(n * f_in));
    const mat<T> tm{tmp.data(), f_in, f_in};
    spmm(p, xm, tm);
    transposed_times(tm, dzm, dwm, n);
    if (dx.data == nullptr) return;
    rows_times_transposed(dzm, wm, tm, n);
    spmm(pt, tm, dxm);
  }
}

#define TRISPARSE_GCN_ENGINE(T)                                                              \
  template void gcn_forward<T>(const csr_graph&, const tensor_view&, const tensor_view&,     \
                               const tensor_view&, bool, const tensor_view&, std::uint32_t*, \
                               const tensor_view&);                                          \
  template void gcn_backward<T>(const csr_graph&, const csr_graph&, const tensor_view&,      \
                                const tensor_view&, std::span<const std::uint32_t>,          \
                                const tensor_view&, const tensor_view&, const tensor_view&,  \
                                const tensor_view&);
TRISPARSE_GCN_ENGINE(float)
TRISPARSE_GCN_ENGINE(double)
#undef TRISPARSE_GCN_ENGINE

}  // namespace trisparse::cpu
