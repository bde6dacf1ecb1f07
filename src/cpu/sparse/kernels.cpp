// The CPU's SpMM, SDDMM and sparse softmax (kernels.hpp): float64 inputs in float64, the rest in
// float32.
#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <vector>

#include "../common/compute_type.hpp"
#include "../common/exp2.hpp"
#include "../common/simd.hpp"
#include "trisparse/core/numeric.hpp"

namespace trisparse::cpu {

namespace {

constexpr int kRowsPerTask = 64;  // rows a dynamic OpenMP chunk takes (rows vary in length)

/// A view's values as T: the view itself where it holds T, else a packed copy.
template <class T>
struct operand {
  const T* data = nullptr;
  std::int64_t row_stride = 0, head_stride = 0;
  std::vector<T> owned;

  explicit operand(const tensor_view& t) {
    if (t.data == nullptr) return;
    if (t.type == dtype_of<T>) {
      data = static_cast<const T*>(t.data);
      row_stride = t.row_stride;
      head_stride = t.head_stride;
      return;
    }
    owned.resize(static_cast<std::size_t>(t.numel()));
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < t.rows; ++r)
      for (std::int64_t h = 0; h < t.heads; ++h)
        for (std::int64_t d = 0; d < t.dim; ++d)
          owned[static_cast<std::size_t>((r * t.heads + h) * t.dim + d)] =
              static_cast<T>(load_as_double(t.data, t.type, t.offset(r, h, d)));
    data = owned.data();
    row_stride = t.heads * t.dim;
    head_stride = t.dim;
  }
  const T* row(std::int64_t r, std::int64_t h) const {
    return data + r * row_stride + h * head_stride;
  }
};

// Writes n values as row r, head h of t (its dtype), from column 0.
template <class T>
void store(const tensor_view& t, std::int64_t r, std::int64_t h, const T* x, std::int64_t n) {
  if (t.type == dtype_of<T>) {
    std::copy_n(x, n, static_cast<T*>(t.data) + t.offset(r, h, 0));
    return;
  }
  for (std::int64_t d = 0; d < n; ++d) store_from_double(t.data, t.type, t.offset(r, h, d), x[d]);
}

// One row's SpMM in float32 for head h: acc = sum_e x_e b[col_e], x_e = w[e * w_row] where w is
// set (already at head h), else values[e] where set, else 1. Cloned for AVX2 + FMA where the CPU
// has them (the library is built for x86-64-v2).
[[gnu::target_clones("arch=x86-64-v3", "default")]] void spmm_row_f32(
    const csr_graph& a, std::int64_t r, const float* b, std::int64_t b_row, std::int64_t dim,
    const float* w, std::int64_t w_row, const float* values, float* acc) {
  const std::int64_t e0 = a.row_ptr[r], e1 = a.row_ptr[r + 1];
  const auto weight = [&](std::int64_t e) {
    return w != nullptr ? w[e * w_row] : values != nullptr ? values[e] : 1.f;
  };
  const auto row_of = [&](std::int64_t e) {
    return b + std::int64_t{a.col_idx[static_cast<std::size_t>(e)]} * b_row;
  };
  // 32 columns at a time in four vector accumulators that stay in registers, then 8, then one.
  std::int64_t d0 = 0;
  const auto term = [&](std::int64_t t) { return weight(e0 + t); };
  for (; d0 + 32 <= dim; d0 += 32)
    weighted_rows<4, false>(
        e1 - e0, term, [&](std::int64_t t) { return row_of(e0 + t) + d0; }, acc + d0);
  for (; d0 + 8 <= dim; d0 += 8)
    weighted_rows<1, false>(
        e1 - e0, term, [&](std::int64_t t) { return row_of(e0 + t) + d0; }, acc + d0);
  for (; d0 < dim; ++d0) {
    float s0 = 0.f;
    for (std::int64_t e = e0; e < e1; ++e) s0 += weight(e) * row_of(e)[d0];
    acc[d0] = s0;
  }
}

}  // namespace

void spmm(const csr_graph& a, const tensor_view& w, const tensor_view& b, const tensor_view& c) {
  in_type_of(b.type, [&]<class T>() {
    const operand<T> bt(b), wt(w);
    const std::int64_t heads = b.heads, dim = b.dim;
#pragma omp parallel
    {
      std::vector<T> acc(static_cast<std::size_t>(dim));
#pragma omp for schedule(dynamic, kRowsPerTask)
      for (std::int64_t r = 0; r < a.rows; ++r) {
        for (std::int64_t h = 0; h < heads; ++h) {
          if constexpr (std::is_same_v<T, float>) {
            spmm_row_f32(a, r, bt.row(0, h), bt.row_stride, dim,
                         w.data != nullptr ? wt.row(0, h) : nullptr, wt.row_stride,
                         a.has_values() ? a.values.data() : nullptr, acc.data());
          } else {
            std::fill(acc.begin(), acc.end(), T{0});
            for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
              const T x = w.data != nullptr ? *wt.row(e, h)
                          : a.has_values()  ? static_cast<T>(a.values[static_cast<std::size_t>(e)])
                                            : T{1};
              const T* br = bt.row(a.col_idx[static_cast<std::size_t>(e)], h);
#pragma omp simd
              for (std::int64_t d = 0; d < dim; ++d) acc[static_cast<std::size_t>(d)] += x * br[d];
            }
          }
          store(c, r, h, acc.data(), dim);
        }
      }
    }
  });
}

void sddmm(const csr_graph& a, const tensor_view& x, const tensor_view& y, const tensor_view& out,
           double scale) {
  in_type_of(x.type, [&]<class T>() {
    const operand<T> xt(x), yt(y);
    const std::int64_t heads = x.heads, dim = x.dim;
    const auto s = static_cast<T>(scale);
#pragma omp parallel for schedule(dynamic, kRowsPerTask)
    for (std::int64_t r = 0; r < a.rows; ++r) {
      for (std::int64_t e = a.row_ptr[r]; e < a.row_ptr[r + 1]; ++e) {
        const T v = a.has_values() ? static_cast<T>(a.values[static_cast<std::size_t>(e)]) : T{1};
        for (std::int64_t h = 0; h < heads; ++h) {
          const T* xr = xt.row(r, h);
          const T* yr = yt.row(a.col_idx[static_cast<std::size_t>(e)], h);
          T dot = 0;
#pragma omp simd reduction(+ : dot)
          for (std::int64_t d = 0; d < dim; ++d) dot += xr[d] * yr[d];
          const T got = s * v * dot;
          store(out, e, h, &got, 1);
        }
      }
    }
  });
}

void softmax(const csr_graph& a, const tensor_view& scores, const tensor_view& out) {
  in_type_of(scores.type, [&]<class T>() {
    const operand<T> st(scores);
    const std::int64_t heads = scores.heads;
    T* const direct = out.type == (std::is_same_v<T, double> ? dtype::f64 : dtype::f32)
                          ? static_cast<T*>(out.data)
                          : nullptr;
    if constexpr (std::is_same_v<T, float>) {
      // One head, entries packed in and out (scores, out may be one array): the output holds the
      // exponentials until the row's sum scales them, so short rows cost a few passes, no copy.
      if (direct != nullptr && heads == 1 && st.row_stride == 1 && out.row_stride == 1) {
        const float* in0 = st.row(0, 0);
        float* out0 = direct + out.offset(0, 0, 0);
#pragma omp parallel for schedule(dynamic, 1024)
        for (std::int64_t r = 0; r < a.rows; ++r) {
          const std::int64_t e0 = a.row_ptr[r], n = a.row_ptr[r + 1] - e0;
          const float* in = in0 + e0;
          float* o = out0 + e0;
          float top = -std::numeric_limits<float>::infinity();
          for (std::int64_t x = 0; x < n; ++x) top = std::max(top, in[x]);
          float sum = 0;
#pragma omp simd reduction(+ : sum)
          for (std::int64_t x = 0; x < n; ++x) {
            const float e = exp2_nonpositive((in[x] - top) * std::numbers::log2e_v<float>);
            o[x] = e;
            sum += e;
          }
          const float inv = 1.0f / sum;
          for (std::int64_t x = 0; x < n; ++x) o[x] *= inv;
        }
        return;
      }
    }
#pragma omp parallel
    {
      std::vector<T> p;
#pragma omp for schedule(dynamic, kRowsPerTask)
      for (std::int64_t r = 0; r < a.rows; ++r) {
        const std::int64_t e0 = a.row_ptr[r], n = a.row_ptr[r + 1] - e0;
        p.resize(static_cast<std::size_t>(n));
        for (std::int64_t h = 0; h < heads; ++h) {
          const T* in = st.row(e0, h);  // entry e0 + x at in[x * row_stride]
          T top = -std::numeric_limits<T>::infinity();
          for (std::int64_t x = 0; x < n; ++x) top = std::max(top, in[x * st.row_stride]);
          T sum = 0;
          if constexpr (std::is_same_v<T, float>) {  // exp(s - top) = 2^((s - top) log2 e)
            const std::int64_t stride = st.row_stride;
#pragma omp simd reduction(+ : sum)
            for (std::int64_t x = 0; x < n; ++x) {
              const float e =
                  exp2_nonpositive((in[x * stride] - top) * std::numbers::log2e_v<float>);
              p[static_cast<std::size_t>(x)] = e;
              sum += e;
            }
          } else {
            for (std::int64_t x = 0; x < n; ++x) {
              p[static_cast<std::size_t>(x)] = std::exp(in[x * st.row_stride] - top);
              sum += p[static_cast<std::size_t>(x)];
            }
          }
          const T inv = T{1} / sum;
          if (direct != nullptr) {
            T* o = direct + out.offset(e0, h, 0);
            for (std::int64_t x = 0; x < n; ++x)
              o[x * out.row_stride] = p[static_cast<std::size_t>(x)] * inv;
          } else {
            for (std::int64_t x = 0; x < n; ++x)
              store_from_double(out.data, out.type, out.offset(e0 + x, h, 0),
                                p[static_cast<std::size_t>(x)] * inv);
          }
        }
      }
    }
  });
}

}  // namespace trisparse::cpu
