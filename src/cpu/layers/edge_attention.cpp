// The attention over a multigraph: the CPU engine (edge_attention.hpp), in fp32 or float64. One
// softmax and its sums serve two score policies: TransformerConv's dot products and GAT's additive
// terms; a policy forms an edge's score and takes its score's gradient apart.
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

// TransformerConv: s = scale q_i . k_j + r_i . a_u; the values v, the features a (summed into
// out_edge). The score's gradient ds goes to dq, dr and da by target, to dk by source.
template <class T>
struct dot_scores {
  const edge_operands& x;
  T scale;
  const tensor_view *dq = nullptr, *dk = nullptr, *dr = nullptr, *da = nullptr;

  const tensor_view& values() const { return x.v; }
  const tensor_view& features() const { return x.a; }
  std::int64_t feature_count() const { return x.r.data != nullptr ? x.r.dim : 0; }
  T score(std::int64_t i, std::int64_t j, std::int64_t u, std::int64_t h) const {
    T z = scale * dot(typed_at<T>(x.q, i, h), typed_at<T>(x.k, j, h), x.q.dim);
    if (feature_count() > 0) z += dot(typed_at<T>(x.r, i, h), typed_at<T>(x.a, u, 0), x.r.dim);
    return z;
  }
  void start_target(std::int64_t i) const {
    zero_row<T>(*dq, i);
    if (feature_count() > 0) zero_row<T>(*dr, i);
  }
  void start_edge(std::int64_t u) const {
    if (feature_count() > 0) std::fill_n(typed_at<T>(*da, u, 0), x.r.dim, T{0});
  }
  // ds's target terms (w: the edge's weight, for out_edge's gradient); returns what the source
  // pass reads.
  T target_terms(std::int64_t i, std::int64_t j, std::int64_t u, std::int64_t h, T ds, T w,
                 const tensor_view& dout_edge) const {
    add_scaled(scale * ds, typed_at<T>(x.k, j, h), typed_at<T>(*dq, i, h), x.q.dim);
    if (feature_count() > 0) {
      const std::int64_t f = x.r.dim;
      T* const da_u = typed_at<T>(*da, u, 0);
      add_scaled(ds, typed_at<T>(x.a, u, 0), typed_at<T>(*dr, i, h), f);
      add_scaled(ds, typed_at<T>(x.r, i, h), da_u, f);
      add_scaled(w, typed_at<T>(dout_edge, i, h), da_u, f);
    }
    return ds;
  }
  void start_source(std::int64_t j) const { zero_row<T>(*dk, j); }
  void source_terms(std::int64_t j, std::int64_t i, std::int64_t h, T stored) const {
    add_scaled(scale * stored, typed_at<T>(x.q, i, h), typed_at<T>(*dk, j, h), x.q.dim);
  }
};

// GAT: s = LeakyReLU(a_dst_i + a_src_j + a_edge_u); the values x, no features. The
// pre-activation's gradient dz = ds · slope goes to da_dst and da_edge by target, to da_src by
// source.
template <class T>
struct additive_scores {
  const gat_operands& x;
  T slope;
  const tensor_view *da_src = nullptr, *da_dst = nullptr, *da_edge = nullptr;

  const tensor_view& values() const { return x.x; }
  const tensor_view& features() const { return x.a_edge; }  // not summed: feature_count() 0
  static std::int64_t feature_count() { return 0; }
  T pre(std::int64_t i, std::int64_t j, std::int64_t u, std::int64_t h) const {
    T z = *typed_at<T>(x.a_dst, i, h) + *typed_at<T>(x.a_src, j, h);
    if (x.a_edge.data != nullptr) z += *typed_at<T>(x.a_edge, u, h);
    return z;
  }
  T score(std::int64_t i, std::int64_t j, std::int64_t u, std::int64_t h) const {
    const T z = pre(i, j, u, h);
    return z > T{0} ? z : slope * z;
  }
  void start_target(std::int64_t i) const { zero_row<T>(*da_dst, i); }
  static void start_edge(std::int64_t) {}
  T target_terms(std::int64_t i, std::int64_t j, std::int64_t u, std::int64_t h, T ds, T,
                 const tensor_view&) const {
    const T dz = pre(i, j, u, h) > T{0} ? ds : slope * ds;
    *typed_at<T>(*da_dst, i, h) += dz;
    if (x.a_edge.data != nullptr) *typed_at<T>(*da_edge, u, h) = dz;
    return dz;
  }
  void start_source(std::int64_t j) const { zero_row<T>(*da_src, j); }
  void source_terms(std::int64_t j, std::int64_t, std::int64_t h, T stored) const {
    *typed_at<T>(*da_src, j, h) += stored;
  }
};

// Target i's scores, position-major [n, H].
template <class T, class Scores>
void scores(const multigraph_view& g, const Scores& sc, std::int64_t heads, std::int64_t i,
            std::vector<T>& s) {
  const std::int64_t p0 = g.row_ptr[i], n = g.row_ptr[i + 1] - p0;
  s.resize(static_cast<std::size_t>(n * heads));
  for (std::int64_t e = 0; e < n; ++e) {
    const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
    for (std::int64_t h = 0; h < heads; ++h)
      s[static_cast<std::size_t>(e * heads + h)] = sc.score(i, j, u, h);
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

// out_i = sum_p alpha_p keep_p values_j (and out_edge_i = sum_p alpha_p keep_p features_u).
template <class T, class Scores>
void forward(const multigraph_view& g, const Scores& sc, const tensor_view& keep,
             const tensor_view& out, const tensor_view& out_edge, const tensor_view& lse) {
  const tensor_view& values = sc.values();
  const std::int64_t heads = values.heads, dim = values.dim, features = sc.feature_count();
#pragma omp parallel
  {
    std::vector<T> s, l(static_cast<std::size_t>(heads));
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t p0 = g.row_ptr[i], n = g.row_ptr[i + 1] - p0;
      scores(g, sc, heads, i, s);
      log_sum_exp(s, n, heads, l.data());
      zero_row<T>(out, i);
      if (features > 0) zero_row<T>(out_edge, i);
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
        for (std::int64_t h = 0; h < heads; ++h) {
          const T w = std::exp(s[static_cast<std::size_t>(e * heads + h)] -
                               l[static_cast<std::size_t>(h)]) *
                      keep_of<T>(keep, u, h);
          add_scaled(w, typed_at<T>(values, j, h), typed_at<T>(out, i, h), dim);
          if (features > 0)
            add_scaled(w, typed_at<T>(sc.features(), u, 0), typed_at<T>(out_edge, i, h), features);
        }
      }
      if (lse.data != nullptr)
        for (std::int64_t h = 0; h < heads; ++h)
          *typed_at<T>(lse, i, h) = l[static_cast<std::size_t>(h)];
    }
  }
}

// The softmax's backward: by target, each edge's weight and what the policy's source terms read
// (its target terms added); then by source, dvalues and the policy's source terms. `scratch`: 2
// edges H values.
template <class T, class Scores>
void backward(const multigraph_view& g, const Scores& sc, const tensor_view& keep,
              const tensor_view& lse, const tensor_view& dout, const tensor_view& dout_edge,
              const tensor_view& dvalues, T* scratch) {
  const tensor_view& values = sc.values();
  const std::int64_t heads = values.heads, dim = values.dim, features = sc.feature_count();
  T* const stored = scratch;                    // [positions, H]: what the source terms read
  T* const weight = scratch + g.edges * heads;  // [positions, H]: alpha keep
#pragma omp parallel
  {
    std::vector<T> s, dalpha, l(static_cast<std::size_t>(heads)), mean(l.size());
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const std::int64_t p0 = g.row_ptr[i], n = g.row_ptr[i + 1] - p0;
      scores(g, sc, heads, i, s);
      if (lse.data != nullptr)
        for (std::int64_t h = 0; h < heads; ++h)
          l[static_cast<std::size_t>(h)] = *typed_at<T>(lse, i, h);
      else
        log_sum_exp(s, n, heads, l.data());
      dalpha.resize(s.size());
      std::fill(mean.begin(), mean.end(), T{0});
      // dL/dalpha_p = keep_p (dout_i . values_j + dout_edge_i . features_u); s becomes alpha.
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
        for (std::int64_t h = 0; h < heads; ++h) {
          const auto at = static_cast<std::size_t>(e * heads + h);
          s[at] = std::exp(s[at] - l[static_cast<std::size_t>(h)]);
          T d = dot(typed_at<T>(dout, i, h), typed_at<T>(values, j, h), dim);
          if (features > 0)
            d += dot(typed_at<T>(dout_edge, i, h), typed_at<T>(sc.features(), u, 0), features);
          dalpha[at] = keep_of<T>(keep, u, h) * d;
          mean[static_cast<std::size_t>(h)] += s[at] * dalpha[at];
        }
      }
      sc.start_target(i);
      for (std::int64_t e = 0; e < n; ++e) {
        const std::int64_t p = p0 + e, j = g.src[p], u = input_edge(g, p);
        sc.start_edge(u);
        for (std::int64_t h = 0; h < heads; ++h) {
          const auto at = static_cast<std::size_t>(e * heads + h);
          const T ds = s[at] * (dalpha[at] - mean[static_cast<std::size_t>(h)]),
                  w = s[at] * keep_of<T>(keep, u, h);
          weight[p * heads + h] = w;
          stored[p * heads + h] = sc.target_terms(i, j, u, h, ds, w, dout_edge);
        }
      }
    }
  }
#pragma omp parallel for schedule(dynamic, 64)
  for (std::int64_t j = 0; j < g.cols; ++j) {
    zero_row<T>(dvalues, j);
    sc.start_source(j);
    for (std::int64_t t = g.col_ptr[j]; t < g.col_ptr[j + 1]; ++t) {
      const std::int64_t p = g.by_source[t], i = g.dst[p];
      for (std::int64_t h = 0; h < heads; ++h) {
        add_scaled(weight[p * heads + h], typed_at<T>(dout, i, h), typed_at<T>(dvalues, j, h), dim);
        sc.source_terms(j, i, h, stored[p * heads + h]);
      }
    }
  }
}

}  // namespace

template <class T>
void edge_attention_forward(const multigraph_view& g, const edge_operands& x, T scale,
                            const tensor_view& out, const tensor_view& out_edge,
                            const tensor_view& lse) {
  forward<T>(g, dot_scores<T>{x, scale}, x.keep, out, out_edge, lse);
}

template <class T>
void edge_attention_backward(const multigraph_view& g, const edge_operands& x, T scale,
                             const tensor_view& lse, const tensor_view& dout,
                             const tensor_view& dout_edge, const tensor_view& dq,
                             const tensor_view& dk, const tensor_view& dv, const tensor_view& dr,
                             const tensor_view& da, T* scratch) {
  backward<T>(g, dot_scores<T>{x, scale, &dq, &dk, &dr, &da}, x.keep, lse, dout, dout_edge, dv,
              scratch);
}

template <class T>
void edge_gat_forward(const multigraph_view& g, const gat_operands& x, T negative_slope,
                      const tensor_view& out, const tensor_view& lse) {
  forward<T>(g, additive_scores<T>{x, negative_slope}, x.keep, out, {}, lse);
}

template <class T>
void edge_gat_backward(const multigraph_view& g, const gat_operands& x, T negative_slope,
                       const tensor_view& lse, const tensor_view& dout, const tensor_view& dx,
                       const tensor_view& da_src, const tensor_view& da_dst,
                       const tensor_view& da_edge, T* scratch) {
  backward<T>(g, additive_scores<T>{x, negative_slope, &da_src, &da_dst, &da_edge}, x.keep, lse,
              dout, {}, dx, scratch);
}

#define TRISPARSE_EDGE_ATTENTION(T)                                                            \
  template void edge_attention_forward<T>(const multigraph_view&, const edge_operands&, T,     \
                                          const tensor_view&, const tensor_view&,              \
                                          const tensor_view&);                                 \
  template void edge_attention_backward<T>(                                                    \
      const multigraph_view&, const edge_operands&, T, const tensor_view&, const tensor_view&, \
      const tensor_view&, const tensor_view&, const tensor_view&, const tensor_view&,          \
      const tensor_view&, const tensor_view&, T*);                                             \
  template void edge_gat_forward<T>(const multigraph_view&, const gat_operands&, T,            \
                                    const tensor_view&, const tensor_view&);                   \
  template void edge_gat_backward<T>(                                                          \
      const multigraph_view&, const gat_operands&, T, const tensor_view&, const tensor_view&,  \
      const tensor_view&, const tensor_view&, const tensor_view&, const tensor_view&, T*);
TRISPARSE_EDGE_ATTENTION(float)
TRISPARSE_EDGE_ATTENTION(double)
#undef TRISPARSE_EDGE_ATTENTION

}  // namespace trisparse::cpu
