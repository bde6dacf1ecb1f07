// Float64 attention over multigraphs (edge_attention_plan's oracle): TransformerConv's scores
// with edge features and GAT's additive ones share one softmax over each target's edges (each
// copy of a repeated pair its own term), its output sums and its backward; the two differ only
// in how a score is formed and where its gradient goes. Plain loops, checked against finite
// differences (tests/unit/backward_test.cpp).
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "access.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/ops/reference.hpp"

namespace trisparse::reference {

namespace {

using access::accumulator;
using access::at;
using access::dot;
using access::put;

// Each target's edges, in input order.
std::vector<std::vector<std::int64_t>> by_target(const coo_graph& g) {
  g.check();
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(g.rows));
  for (std::int64_t p = 0; p < g.nnz(); ++p) rows[static_cast<std::size_t>(g.src[p])].push_back(p);
  return rows;
}

// The softmax over target i's edges for one head: the pre-activation z_p of each edge (in the
// row's order), the weights alpha_p and the row's lse.
struct edge_row {
  std::vector<double> z, alpha;
  double lse = -std::numeric_limits<double>::infinity();
};

// What the two scores share: the pre-activation of edge p in head h, the slope of the activation
// below 0 (1: none), the values summed (v or x, by source) and, optionally, each edge's features
// summed alongside (a, [edges, 1, F]).
struct edge_softmax {
  const coo_graph& g;
  std::function<double(std::int64_t p, std::int64_t h)> score;
  double slope;
  const tensor_view& values;
  const tensor_view& features;
  const tensor_view& keep;
  std::vector<std::vector<std::int64_t>> rows = by_target(g);

  double keep_of(std::int64_t p, std::int64_t h) const {
    return keep.data != nullptr ? at(keep, p, h, 0) : 1.0;
  }

  edge_row row(std::int64_t i, std::int64_t h) const {
    const auto& edges = rows[static_cast<std::size_t>(i)];
    edge_row r;
    double m = -std::numeric_limits<double>::infinity();
    for (const std::int64_t p : edges) {
      const double z = score(p, h);
      r.z.push_back(z);
      r.alpha.push_back(z > 0 ? z : slope * z);
      m = std::max(m, r.alpha.back());
    }
    if (edges.empty()) return r;
    double sum = 0;
    for (double& a : r.alpha) sum += (a = std::exp(a - m));
    for (double& a : r.alpha) a /= sum;
    r.lse = m + std::log(sum);
    return r;
  }

  // out_i = sum_p alpha_p keep_p values_j, out_edge_i = sum_p alpha_p keep_p features_p.
  void forward(const tensor_view& out, const tensor_view& out_edge, const tensor_view& lse) const {
    const std::int64_t heads = values.heads;
    check_view(out, "out", g.rows, heads, values.dim);
    if (out_edge.data != nullptr) check_view(out_edge, "out_edge", g.rows, heads, features.dim);
    if (lse.data != nullptr) check_view(lse, "lse", g.rows, heads, 1);
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const auto& edges = rows[static_cast<std::size_t>(i)];
      for (std::int64_t h = 0; h < heads; ++h) {
        const edge_row r = row(i, h);
        std::vector<double> acc(static_cast<std::size_t>(values.dim), 0.0),
            acc_edge(static_cast<std::size_t>(out_edge.data != nullptr ? features.dim : 0), 0.0);
        for (std::size_t x = 0; x < edges.size(); ++x) {
          const std::int64_t p = edges[x], j = g.dst[p];
          const double w = r.alpha[x] * keep_of(p, h);
          for (std::int64_t c = 0; c < values.dim; ++c) acc[c] += w * at(values, j, h, c);
          for (std::size_t f = 0; f < acc_edge.size(); ++f)
            acc_edge[f] += w * at(features, p, 0, static_cast<std::int64_t>(f));
        }
        for (std::int64_t c = 0; c < values.dim; ++c) put(out, i, h, c, acc[c]);
        for (std::size_t f = 0; f < acc_edge.size(); ++f)
          put(out_edge, i, h, static_cast<std::int64_t>(f), acc_edge[f]);
        if (lse.data != nullptr) put(lse, i, h, 0, r.lse);
      }
    }
  }

  // The backward of forward's sums given dout (and dout_edge): the gradient of each edge's
  // pre-activation, dz [edges * heads] (p * heads + h), with the values' gradient (by source)
  // and the features' (by edge, summed over the heads) added to dvalues and dfeatures.
  std::vector<double> backward(const tensor_view& dout, const tensor_view& dout_edge,
                               accumulator& dvalues, accumulator* dfeatures) const {
    const std::int64_t heads = values.heads;
    check_view(dout, "dout", g.rows, heads, values.dim);
    if (dout_edge.data != nullptr) check_view(dout_edge, "dout_edge", g.rows, heads, features.dim);
    std::vector<double> dz(static_cast<std::size_t>(g.nnz() * heads), 0.0);
    for (std::int64_t i = 0; i < g.rows; ++i) {
      const auto& edges = rows[static_cast<std::size_t>(i)];
      for (std::int64_t h = 0; h < heads; ++h) {
        const edge_row r = row(i, h);
        // dL/dalpha_p = keep_p (<dout_i, values_j> + <dout_edge_i, features_p>); the softmax's
        // gradient alpha_p (dalpha_p - sum alpha dalpha), times the activation's slope.
        std::vector<double> dalpha(edges.size());
        double mean = 0;
        for (std::size_t x = 0; x < edges.size(); ++x) {
          const std::int64_t p = edges[x];
          double d = dot(dout, i, values, g.dst[p], h);
          if (dout_edge.data != nullptr)
            for (std::int64_t f = 0; f < features.dim; ++f)
              d += at(dout_edge, i, h, f) * at(features, p, 0, f);
          dalpha[x] = keep_of(p, h) * d;
          mean += r.alpha[x] * dalpha[x];
        }
        for (std::size_t x = 0; x < edges.size(); ++x) {
          const std::int64_t p = edges[x], j = g.dst[p];
          dz[static_cast<std::size_t>(p * heads + h)] =
              r.alpha[x] * (dalpha[x] - mean) * (r.z[x] > 0 ? 1.0 : slope);
          const double w = r.alpha[x] * keep_of(p, h);
          for (std::int64_t c = 0; c < values.dim; ++c) dvalues(j, h, c) += w * at(dout, i, h, c);
          if (dfeatures != nullptr && dout_edge.data != nullptr)
            for (std::int64_t f = 0; f < features.dim; ++f)
              (*dfeatures)(p, 0, f) += w * at(dout_edge, i, h, f);
        }
      }
    }
    return dz;
  }
};

void check_edge_attention(const coo_graph& g, const tensor_view& q, const tensor_view& k,
                          const tensor_view& v, const tensor_view& r, const tensor_view& a,
                          const tensor_view& keep) {
  check_view(q, "q", g.rows, -1, -1);
  check_view(k, "k", g.cols, q.heads, q.dim);
  check_view(v, "v", g.cols, q.heads, -1);
  TRISPARSE_EXPECTS_INPUT((r.data == nullptr) == (a.data == nullptr),
                          "edge features need both r and a (or neither)");
  if (r.data != nullptr) {
    check_view(r, "r", g.rows, q.heads, -1);
    check_view(a, "a", g.nnz(), 1, r.dim);
  }
  if (keep.data != nullptr) check_view(keep, "keep", g.nnz(), q.heads, 1);
}

void check_edge_gat(const coo_graph& g, const tensor_view& x, const tensor_view& a_src,
                    const tensor_view& a_dst, const tensor_view& a_edge, const tensor_view& keep,
                    double negative_slope) {
  check_view(x, "x", g.cols, -1, -1);
  check_view(a_src, "a_src", g.cols, x.heads, 1);
  check_view(a_dst, "a_dst", g.rows, x.heads, 1);
  if (a_edge.data != nullptr) check_view(a_edge, "a_edge", g.nnz(), x.heads, 1);
  if (keep.data != nullptr) check_view(keep, "keep", g.nnz(), x.heads, 1);
  TRISPARSE_EXPECTS_INPUT(std::isfinite(negative_slope), "negative_slope must be finite");
}

// TransformerConv's score of edge p: scale <q_i, k_j> + <r_i, a_p>.
std::function<double(std::int64_t, std::int64_t)> attention_score(
    const coo_graph& g, const tensor_view& q, const tensor_view& k, const tensor_view& r,
    const tensor_view& a, double scale) {
  return [&g, &q, &k, &r, &a, scale](std::int64_t p, std::int64_t h) {
    double s = scale * dot(q, g.src[p], k, g.dst[p], h);
    if (r.data != nullptr)
      for (std::int64_t f = 0; f < r.dim; ++f) s += at(r, g.src[p], h, f) * at(a, p, 0, f);
    return s;
  };
}

// GAT's: a_dst[i] + a_src[j] + a_edge[p].
std::function<double(std::int64_t, std::int64_t)> gat_score(const coo_graph& g,
                                                            const tensor_view& a_src,
                                                            const tensor_view& a_dst,
                                                            const tensor_view& a_edge) {
  return [&g, &a_src, &a_dst, &a_edge](std::int64_t p, std::int64_t h) {
    return at(a_dst, g.src[p], h, 0) + at(a_src, g.dst[p], h, 0) +
           (a_edge.data != nullptr ? at(a_edge, p, h, 0) : 0.0);
  };
}

}  // namespace

void edge_attention(const coo_graph& edges, const tensor_view& q, const tensor_view& k,
                    const tensor_view& v, const tensor_view& r, const tensor_view& a,
                    const tensor_view& keep, double scale, const tensor_view& out,
                    const tensor_view& out_edge, const tensor_view& lse) {
  check_edge_attention(edges, q, k, v, r, a, keep);
  const edge_softmax s{edges, attention_score(edges, q, k, r, a, scale), 1.0, v, a, keep};
  s.forward(out, r.data != nullptr ? out_edge : tensor_view{}, lse);
}

void edge_attention_backward(const coo_graph& edges, const tensor_view& q, const tensor_view& k,
                             const tensor_view& v, const tensor_view& r, const tensor_view& a,
                             const tensor_view& keep, double scale, const tensor_view& dout,
                             const tensor_view& dout_edge, const tensor_view& dq,
                             const tensor_view& dk, const tensor_view& dv, const tensor_view& dr,
                             const tensor_view& da) {
  check_edge_attention(edges, q, k, v, r, a, keep);
  const bool features = r.data != nullptr;
  const std::int64_t heads = q.heads;
  check_view(dq, "dq", edges.rows, heads, q.dim);
  check_view(dk, "dk", edges.cols, heads, q.dim);
  check_view(dv, "dv", edges.cols, heads, v.dim);
  if (features) {
    check_view(dr, "dr", edges.rows, heads, r.dim);
    check_view(da, "da", edges.nnz(), 1, r.dim);
  }
  const edge_softmax s{edges, attention_score(edges, q, k, r, a, scale), 1.0, v, a, keep};
  accumulator gq(edges.rows, heads, q.dim), gk(edges.cols, heads, q.dim),
      gv(edges.cols, heads, v.dim), gr(edges.rows, heads, features ? r.dim : 0),
      ga(edges.nnz(), 1, features ? r.dim : 0);
  const std::vector<double> dz =
      s.backward(dout, features ? dout_edge : tensor_view{}, gv, features ? &ga : nullptr);
  // dS_p flows to q_i and k_j through scale <q_i, k_j>, to r_i and a_p through <r_i, a_p>.
  for (std::int64_t p = 0; p < edges.nnz(); ++p) {
    const std::int64_t i = edges.src[p], j = edges.dst[p];
    for (std::int64_t h = 0; h < heads; ++h) {
      const double d = dz[static_cast<std::size_t>(p * heads + h)];
      for (std::int64_t c = 0; c < q.dim; ++c) {
        gq(i, h, c) += scale * d * at(k, j, h, c);
        gk(j, h, c) += scale * d * at(q, i, h, c);
      }
      if (!features) continue;
      for (std::int64_t f = 0; f < r.dim; ++f) {
        gr(i, h, f) += d * at(a, p, 0, f);
        ga(p, 0, f) += d * at(r, i, h, f);
      }
    }
  }
  gq.store(dq);
  gk.store(dk);
  gv.store(dv);
  if (features) {
    gr.store(dr);
    ga.store(da);
  }
}

void edge_gat(const coo_graph& edges, const tensor_view& x, const tensor_view& a_src,
              const tensor_view& a_dst, const tensor_view& a_edge, const tensor_view& keep,
              double negative_slope, const tensor_view& out, const tensor_view& lse) {
  check_edge_gat(edges, x, a_src, a_dst, a_edge, keep, negative_slope);
  const tensor_view none{};
  const edge_softmax s{edges, gat_score(edges, a_src, a_dst, a_edge), negative_slope, x, none,
                       keep};
  s.forward(out, none, lse);
}

void edge_gat_backward(const coo_graph& edges, const tensor_view& x, const tensor_view& a_src,
                       const tensor_view& a_dst, const tensor_view& a_edge, const tensor_view& keep,
                       double negative_slope, const tensor_view& dout, const tensor_view& dx,
                       const tensor_view& da_src, const tensor_view& da_dst,
                       const tensor_view& da_edge) {
  check_edge_gat(edges, x, a_src, a_dst, a_edge, keep, negative_slope);
  const std::int64_t heads = x.heads;
  check_view(dx, "dx", edges.cols, heads, x.dim);
  check_view(da_src, "da_src", edges.cols, heads, 1);
  check_view(da_dst, "da_dst", edges.rows, heads, 1);
  if (a_edge.data != nullptr) check_view(da_edge, "da_edge", edges.nnz(), heads, 1);
  const tensor_view none{};
  const edge_softmax s{edges, gat_score(edges, a_src, a_dst, a_edge), negative_slope, x, none,
                       keep};
  accumulator gx(edges.cols, heads, x.dim), gs(edges.cols, heads, 1), gd(edges.rows, heads, 1),
      ge(edges.nnz(), heads, 1);
  const std::vector<double> dz = s.backward(dout, none, gx, nullptr);
  for (std::int64_t p = 0; p < edges.nnz(); ++p) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const double d = dz[static_cast<std::size_t>(p * heads + h)];
      gs(edges.dst[p], h, 0) += d;
      gd(edges.src[p], h, 0) += d;
      ge(p, h, 0) = d;
    }
  }
  gx.store(dx);
  gs.store(da_src);
  gd.store(da_dst);
  if (a_edge.data != nullptr) ge.store(da_edge);
}

}  // namespace trisparse::reference
