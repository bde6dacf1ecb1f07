// TransformerConv's attention over a multigraph: the CPU engine (edge_attention.hpp), in fp32 or
// float64.
#include "edge_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "f32.hpp"

namespace trisparse::cpu {

namespace {

template <class T>
T dot(const T* x, const T* y, std::int64_t n) {
  T s{0};
  for (std::int64_t c = 0; c < n; ++c) s += x[c] * y[c];
  return s;
}

// y += w x over n elements.
template <class T>
void add_scaled(T w, const T* x, T* y, std::int64_t n) {
  for (std::int64_t c = 0; c < n; ++c) y[c] += w * x[c];
}

// Zeroes row r of t (every head), where t is given.
template <class T>
void zero_row(const tensor_view& t, std::int64_t r) {
  if (t.data == nullptr) return;
  for (std::int64_t h = 0; h < t.heads; ++h) std::fill_n(typed_at<T>(t, r, h), t.dim, T{0});
}

std::int64_t input_edge(const multigraph_view& g, std::int64_t p) {
  return g.edge != nullptr ? g.edge[p] : p;
}

template <class T>
T keep_of(const tensor_view& keep, std::int64_t u, std::int64_t h) {
  return keep.data != nullptr ? *typed_at<T>(keep, u, h) : T{1};
}

// Target i's scores, position-major [n, H]: scale q_i . k_j + r_i . a_u.
template <class T>
void scores(const multigraph_view& g, const edge_operands& x, T scale, std::int64_t i,
            std::vector<T>& s) {
  const std::int64_t p0 = g.row_ptr[i], n = g.row_ptr[i + 1] - p0, heads = x.q.heads,
                     features = x.r.data != nullptr ? x.r.dim : 0;
  s.resize(static_cast<std::size_t>(n * heads));
  for (std::int64_t e = 0; e < n; ++e) {
    const std::int64_t p = p0 + e, j = g.src[p];
    const T* a = features > 0 ? typed_at<T>(x.a, input_edge(g, p), 0) : nullptr;
    for (std::int64_t h = 0; h < heads; ++h) {
      T z = scale * dot(typed_at<T>(x.q, i, h), typed_at<T>(x.k, j, h), x.q.dim);
      if (a != nullptr) z += dot(typed_at<T>(x.r, i, h), a, features);
      s[static_cast<std::size_t>(e * heads + h)] = z;
    }
  }
}

// Each head's log-sum-exp of n scores (-inf where n = 0).
template <class T>
void log_sum_exp(const std::vector<T>& s, std::int64_t n, std::int64_t heads, T* lse) {
  for (std::int64_t h = 0; h < heads; ++h) {
    T m = -std::numeric_limits<T>::infinity(), l{0};
    for (std::int64_t e = 0; e < n; ++e)
      m = std::max(m, s[static_cast<std::size_t>(e * heads + h)]);
    for (std::int64_t e = 0; e < n; ++e)
      l += std::exp(s[static_cast<std::size_t>(e * heads + h)] - m);
    lse[h] = n > 0 ? m + std::log(l) : m;
  }
}

}  // namespace

template <class T>
void edge_attention_forward(const multigraph_view& g, const edge_operands& x, T scale,
                            const tensor_view& out, const tensor_view& out_edge,
                            const tensor_view& lse) {
  const std::int64_t heads = x.q.heads, dim = x.q.dim, features = x.r.data != nullptr ? x.r.dim : 0;
#pragma omp parallel
  {
    std::vector<T> s, l(static_cast<std::size_t>(heads));
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t p0 = g.row_ptr[i], n = g.row_ptr[i + 1] - p0;
      scores(g, x, scale, i, s);
      log_sum_exp(s, n, heads, l.data());
      zero_row<T>(out, i);
      if (features > 0) zero_row<T>(out_edge, i);
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
        for (std::int64_t h = 0; h < heads; ++h) {
          const T w = std::exp(s[static_cast<std::size_t>(e * heads + h)] -
                               l[static_cast<std::size_t>(h)]) *
                      keep_of<T>(x.keep, u, h);
          add_scaled(w, typed_at<T>(x.v, j, h), typed_at<T>(out, i, h), dim);
          if (features > 0)
            add_scaled(w, typed_at<T>(x.a, u, 0), typed_at<T>(out_edge, i, h), features);
        }
      }
      if (lse.data != nullptr)
        for (std::int64_t h = 0; h < heads; ++h)
          *typed_at<T>(lse, i, h) = l[static_cast<std::size_t>(h)];
    }
  }
}

template <class T>
void edge_attention_backward(const multigraph_view& g, const edge_operands& x, T scale,
                             const tensor_view& lse, const tensor_view& dout,
                             const tensor_view& dout_edge, const tensor_view& dq,
                             const tensor_view& dk, const tensor_view& dv, const tensor_view& dr,
                             const tensor_view& da, T* scratch) {
  const std::int64_t heads = x.q.heads, dim = x.q.dim, features = x.r.data != nullptr ? x.r.dim : 0;
  T* const dscore = scratch;                    // [positions, H]: the score's gradient
  T* const weight = scratch + g.edges * heads;  // [positions, H]: alpha keep
  // By target: each edge's weight and score gradient, dq, dr and (each input edge once) da.
#pragma omp parallel
  {
    std::vector<T> s, dalpha, l(static_cast<std::size_t>(heads)), mean(l.size());
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t p0 = g.row_ptr[i], n = g.row_ptr[i + 1] - p0;
      scores(g, x, scale, i, s);
      if (lse.data != nullptr)
        for (std::int64_t h = 0; h < heads; ++h)
          l[static_cast<std::size_t>(h)] = *typed_at<T>(lse, i, h);
      else
        log_sum_exp(s, n, heads, l.data());
      dalpha.resize(s.size());
      std::fill(mean.begin(), mean.end(), T{0});
      // dL/dalpha_p = keep_p (dout_i . v_j + dout_edge_i . a_u); s becomes alpha.
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
        for (std::int64_t h = 0; h < heads; ++h) {
          const auto at = static_cast<std::size_t>(e * heads + h);
          s[at] = std::exp(s[at] - l[static_cast<std::size_t>(h)]);
          T d = dot(typed_at<T>(dout, i, h), typed_at<T>(x.v, j, h), dim);
          if (features > 0)
            d += dot(typed_at<T>(dout_edge, i, h), typed_at<T>(x.a, u, 0), features);
          dalpha[at] = keep_of<T>(x.keep, u, h) * d;
          mean[static_cast<std::size_t>(h)] += s[at] * dalpha[at];
        }
      }
      zero_row<T>(dq, i);
      if (features > 0) zero_row<T>(dr, i);
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
        T* const da_u = features > 0 ? typed_at<T>(da, u, 0) : nullptr;
        if (da_u != nullptr) std::fill_n(da_u, features, T{0});
        for (std::int64_t h = 0; h < heads; ++h) {
          const auto at = static_cast<std::size_t>(e * heads + h);
          const T ds = s[at] * (dalpha[at] - mean[static_cast<std::size_t>(h)]),
                  w = s[at] * keep_of<T>(x.keep, u, h);
          dscore[p * heads + h] = ds;
          weight[p * heads + h] = w;
          add_scaled(scale * ds, typed_at<T>(x.k, j, h), typed_at<T>(dq, i, h), dim);
          if (da_u == nullptr) continue;
          add_scaled(ds, typed_at<T>(x.a, u, 0), typed_at<T>(dr, i, h), features);
          add_scaled(ds, typed_at<T>(x.r, i, h), da_u, features);
          add_scaled(w, typed_at<T>(dout_edge, i, h), da_u, features);
        }
      }
    }
  }
  // By source, its edges in target order: dk and dv.
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t j = 0; j < g.cols; ++j) {
    zero_row<T>(dk, j);
    zero_row<T>(dv, j);
    for (std::int64_t t = g.col_ptr[j]; t < g.col_ptr[j + 1]; ++t) {
      const std::int64_t p = g.by_source[t], i = g.dst[p];
      for (std::int64_t h = 0; h < heads; ++h) {
        add_scaled(scale * dscore[p * heads + h], typed_at<T>(x.q, i, h), typed_at<T>(dk, j, h),
                   dim);
        add_scaled(weight[p * heads + h], typed_at<T>(dout, i, h), typed_at<T>(dv, j, h), dim);
      }
    }
  }
}

#define TRISPARSE_EDGE_ATTENTION(T)                                                            \
  template void edge_attention_forward<T>(const multigraph_view&, const edge_operands&, T,     \
                                          const tensor_view&, const tensor_view&,              \
                                          const tensor_view&);                                 \
  template void edge_attention_backward<T>(                                                    \
      const multigraph_view&, const edge_operands&, T, const tensor_view&, const tensor_view&, \
      const tensor_view&, const tensor_view&, const tensor_view&, const tensor_view&,          \
      const tensor_view&, const tensor_view&, T*);
TRISPARSE_EDGE_ATTENTION(float)
TRISPARSE_EDGE_ATTENTION(double)
#undef TRISPARSE_EDGE_ATTENTION

}  // namespace trisparse::cpu
