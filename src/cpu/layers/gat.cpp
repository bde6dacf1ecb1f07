// GAT's attention: the CPU engine (gat.hpp), in fp32 or float64.
#include "gat.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "f32.hpp"

namespace trisparse::cpu {

namespace {

template <class T>
T keep_of(const gat_keep& k, std::int64_t e, std::int64_t h) {
  if (k.keep.data == nullptr) return T{1};
  return *typed_at<T>(k.keep, k.index != nullptr ? k.index[e] : e, h);
}

template <class T>
T leaky(T s, T slope) {
  return s > T{0} ? s : s * slope;
}

// Row i's pre-activation scores a_dst[i, h] + a_src[j, h], entry-major ([n, H]).
template <class T>
void scores(const csr_graph& g, const tensor_view& a_src, const tensor_view& a_dst, std::int64_t i,
            std::vector<T>& s) {
  const std::int64_t e0 = g.row_ptr[i], n = g.row_ptr[i + 1] - e0, heads = a_dst.heads;
  s.resize(static_cast<std::size_t>(n * heads));
  for (std::int64_t k = 0; k < n; ++k)
    for (std::int64_t h = 0; h < heads; ++h)
      s[k * heads + h] = *typed_at<T>(a_dst, i, h) + *typed_at<T>(a_src, g.col_idx[e0 + k], h);
}

// Row i's log-sum-exp for head h from its pre-activation scores s (n entries).
template <class T>
T log_sum_exp(const std::vector<T>& s, std::int64_t n, std::int64_t h, std::int64_t heads,
              T negative_slope) {
  if (n == 0) return -std::numeric_limits<T>::infinity();
  T m = -std::numeric_limits<T>::infinity(), l = 0;
  for (std::int64_t k = 0; k < n; ++k) m = std::max(m, leaky(s[k * heads + h], negative_slope));
  for (std::int64_t k = 0; k < n; ++k) l += std::exp(leaky(s[k * heads + h], negative_slope) - m);
  return m + std::log(l);
}

}  // namespace

template <class T>
void gat_forward(const csr_graph& g, const tensor_view& x, const tensor_view& a_src,
                 const tensor_view& a_dst, const gat_keep& keep, T negative_slope,
                 const tensor_view& out, const tensor_view& lse) {
  const std::int64_t heads = x.heads, width = x.dim;
#pragma omp parallel
  {
    std::vector<T> w, m(static_cast<std::size_t>(heads)), l(m.size());
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t e0 = g.row_ptr[i], n = g.row_ptr[i + 1] - e0;
      scores(g, a_src, a_dst, i, w);
      std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
      std::fill(l.begin(), l.end(), T{0});
      for (std::int64_t k = 0; k < n; ++k)
        for (std::int64_t h = 0; h < heads; ++h)
          m[h] = std::max(m[h], w[k * heads + h] = leaky(w[k * heads + h], negative_slope));
      for (std::int64_t k = 0; k < n; ++k)
        for (std::int64_t h = 0; h < heads; ++h)
          l[h] += w[k * heads + h] = std::exp(w[k * heads + h] - m[h]);
      for (std::int64_t h = 0; h < heads; ++h) {
        std::fill_n(typed_at<T>(out, i, h), width, T{0});
        if (lse.data != nullptr)
          *typed_at<T>(lse, i, h) =
              n > 0 ? m[h] + std::log(l[h]) : -std::numeric_limits<T>::infinity();
      }
      for (std::int64_t k = 0; k < n; ++k) {
        const std::int64_t j = g.col_idx[e0 + k];
        for (std::int64_t h = 0; h < heads; ++h) {
          const T wk = w[k * heads + h] / l[h] * keep_of<T>(keep, e0 + k, h);
          const T* xj = typed_at<T>(x, j, h);
          T* o = typed_at<T>(out, i, h);
          for (std::int64_t c = 0; c < width; ++c) o[c] += wk * xj[c];
        }
      }
    }
  }
}

template <class T>
void gat_backward(const csr_graph& g, const detail::transposed_pattern& t, const tensor_view& x,
                  const tensor_view& a_src, const tensor_view& a_dst, const gat_keep& keep,
                  T negative_slope, const tensor_view& lse, const tensor_view& dout,
                  const tensor_view& dx, const tensor_view& da_src, const tensor_view& da_dst) {
  const std::int64_t heads = x.heads, width = x.dim;
  // Per entry and head: the weight p keep that dx takes, and de = dL/d(a_dst + a_src).
  std::vector<T> weight(static_cast<std::size_t>(g.nnz() * heads)), de(weight.size());
#pragma omp parallel
  {
    std::vector<T> s, dp;
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t e0 = g.row_ptr[i], n = g.row_ptr[i + 1] - e0;
      scores(g, a_src, a_dst, i, s);
      dp.resize(s.size());
      for (std::int64_t h = 0; h < heads; ++h) {
        // out_i = sum_k p_k keep_k x_k: dL/dp_k = keep_k <dout_i, x_k>; the softmax's gradient
        // p_k (dp_k - sum_q p_q dp_q); LeakyReLU's slope below 0.
        const T li = lse.data != nullptr ? *typed_at<T>(lse, i, h)
                                         : log_sum_exp(s, n, h, heads, negative_slope);
        const T* gi = typed_at<T>(dout, i, h);
        T mean = 0;
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int64_t e = e0 + k;
          const T* xj = typed_at<T>(x, g.col_idx[e], h);
          T d = 0;
          for (std::int64_t c = 0; c < width; ++c) d += gi[c] * xj[c];
          const T p = std::exp(leaky(s[k * heads + h], negative_slope) - li),
                  kp = keep_of<T>(keep, e, h);
          dp[k * heads + h] = kp * d;
          weight[e * heads + h] = p * kp;
          de[e * heads + h] = p;
          mean += p * kp * d;
        }
        T sum = 0;
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int64_t e = e0 + k;
          const T v = de[e * heads + h] * (dp[k * heads + h] - mean) *
                      (s[k * heads + h] > T{0} ? T{1} : negative_slope);
          de[e * heads + h] = v;
          sum += v;
        }
        *typed_at<T>(da_dst, i, h) = sum;
      }
    }
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t j = 0; j < g.cols; ++j) {
      for (std::int64_t h = 0; h < heads; ++h) {
        std::fill_n(typed_at<T>(dx, j, h), width, T{0});
        *typed_at<T>(da_src, j, h) = T{0};
      }
      for (std::int64_t q = t.col_ptr[j]; q < t.col_ptr[j + 1]; ++q) {
        const std::int64_t e = t.entry[q], i = t.row_idx[q];
        for (std::int64_t h = 0; h < heads; ++h) {
          const T wk = weight[e * heads + h];
          const T* gi = typed_at<T>(dout, i, h);
          T* d = typed_at<T>(dx, j, h);
          for (std::int64_t c = 0; c < width; ++c) d[c] += wk * gi[c];
          *typed_at<T>(da_src, j, h) += de[e * heads + h];
        }
      }
    }
  }
}

#define TRISPARSE_GAT_ENGINE(T)                                                             \
  template void gat_forward<T>(const csr_graph&, const tensor_view&, const tensor_view&,    \
                               const tensor_view&, const gat_keep&, T, const tensor_view&,  \
                               const tensor_view&);                                         \
  template void gat_backward<T>(const csr_graph&, const detail::transposed_pattern&,        \
                                const tensor_view&, const tensor_view&, const tensor_view&, \
                                const gat_keep&, T, const tensor_view&, const tensor_view&, \
                                const tensor_view&, const tensor_view&, const tensor_view&);
TRISPARSE_GAT_ENGINE(float)
TRISPARSE_GAT_ENGINE(double)
#undef TRISPARSE_GAT_ENGINE

}  // namespace trisparse::cpu
