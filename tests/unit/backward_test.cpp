// Gradients on the CPU (issue 42): the float64 references against central finite differences, and
// the fused CPU backward against the references on random and shared graphs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "support.hpp"

namespace trisparse {
namespace {

// A rectangular pattern with an empty row, an empty column and a row that has every column.
csr_graph small_pattern() {
  coo_graph coo{.rows = 7, .cols = 6, .src = {}, .dst = {}, .values = {}};
  const std::vector<std::pair<int, int>> e{
      {0, 0}, {0, 3}, {1, 1}, {1, 2}, {1, 3}, {3, 0}, {3, 5},
      {4, 1}, {5, 0}, {5, 1}, {5, 2}, {5, 3}, {5, 5}, {6, 2}};  // row 2 and column 4 empty
  for (const auto& [r, c] : e) {
    coo.src.push_back(r);
    coo.dst.push_back(c);
  }
  return to_csr(coo);
}

host_tensor random_f64(std::int64_t rows, std::int64_t heads, std::int64_t dim,
                       std::uint64_t seed) {
  host_tensor t(dtype::f64, rows, heads, dim);
  t.fill_uniform(-1.0, 1.0, seed);
  return t;
}

// <w, f(x)>: the scalar whose gradient the backward computes, for a given upstream gradient w.
double inner(const host_tensor& w, const host_tensor& y) {
  double s = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) s += w.get(i) * y.get(i);
  return s;
}

// Central differences of loss() with respect to every element of x (but those `skip` names),
// against `analytic`.
void expect_matches_finite_differences(
    host_tensor& x, const std::function<double()>& loss, const host_tensor& analytic,
    const char* what,
    const std::function<bool(std::int64_t)>& skip = [](std::int64_t) { return false; }) {
  SCOPED_TRACE(what);
  const double h = 1e-6;
  double max_err = 0, max_ref = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    if (skip(i)) continue;
    const double x0 = x.get(i);
    x.set(i, x0 + h);
    const double up = loss();
    x.set(i, x0 - h);
    const double down = loss();
    x.set(i, x0);
    const double fd = (up - down) / (2 * h);
    max_err = std::max(max_err, std::abs(fd - analytic.get(i)));
    max_ref = std::max(max_ref, std::abs(fd));
  }
  EXPECT_GT(max_ref, 0.0) << "the loss does not depend on it";
  EXPECT_LE(max_err, 1e-6 * std::max(max_ref, 1.0));
}

TEST(ReferenceGradients, AttentionMatchesFiniteDifferences) {
  const csr_graph g = small_pattern();
  const std::int64_t heads = 2, d = 3, dv = 4;
  host_tensor q = random_f64(g.rows, heads, d, 1), k = random_f64(g.cols, heads, d, 2),
              v = random_f64(g.cols, heads, dv, 3), w = random_f64(g.rows, heads, dv, 4);
  const double scale = 0.7;
  host_tensor out(dtype::f64, g.rows, heads, dv);
  const auto loss = [&] {
    reference::attention(g, q.view(), k.view(), v.view(), out.view(), scale);
    return inner(w, out);
  };
  host_tensor dq(dtype::f64, g.rows, heads, d), dk(dtype::f64, g.cols, heads, d),
      dvg(dtype::f64, g.cols, heads, dv), ds(dtype::f64, g.nnz(), heads, 1);
  reference::attention_backward(g, q.view(), k.view(), v.view(), w.view(), dq.view(), dk.view(),
                                dvg.view(), scale, ds.view());
  expect_matches_finite_differences(q, loss, dq, "dq");
  expect_matches_finite_differences(k, loss, dk, "dk");
  expect_matches_finite_differences(v, loss, dvg, "dv");
  // The empty row's dq and the empty column's dk and dv are exact zeros.
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t x = 0; x < d; ++x) {
      EXPECT_EQ(dq.get((2 * heads + h) * d + x), 0.0);
      EXPECT_EQ(dk.get((4 * heads + h) * d + x), 0.0);
    }
    for (std::int64_t x = 0; x < dv; ++x) EXPECT_EQ(dvg.get((4 * heads + h) * dv + x), 0.0);
  }
  // dS is the score gradient: dq_i = scale sum_j dS_ij k_j.
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t i = 0; i < g.rows; ++i) {
      for (std::int64_t x = 0; x < d; ++x) {
        double sum = 0;
        for (std::int64_t e = g.row_ptr[i]; e < g.row_ptr[i + 1]; ++e)
          sum += scale * ds.get(e * heads + h) * k.get((g.col_idx[e] * heads + h) * d + x);
        EXPECT_NEAR(sum, dq.get((i * heads + h) * d + x), 1e-12);
      }
    }
  }
}

TEST(ReferenceGradients, LogSumExpIsTheRowsNormaliser) {
  const csr_graph g = small_pattern();
  host_tensor q = random_f64(g.rows, 2, 3, 5), k = random_f64(g.cols, 2, 3, 6),
              v = random_f64(g.cols, 2, 3, 7);
  host_tensor out(dtype::f64, g.rows, 2, 3), lse(dtype::f64, g.rows, 2, 1);
  reference::attention(g, q.view(), k.view(), v.view(), out.view(), 0.5, lse.view());
  for (std::int64_t i = 0; i < g.rows; ++i) {
    for (std::int64_t h = 0; h < 2; ++h) {
      double sum = 0;
      for (std::int64_t e = g.row_ptr[i]; e < g.row_ptr[i + 1]; ++e) {
        double s = 0;
        for (std::int64_t x = 0; x < 3; ++x)
          s += q.get((i * 2 + h) * 3 + x) * k.get((g.col_idx[e] * 2 + h) * 3 + x);
        sum += std::exp(0.5 * s);
      }
      if (g.degree(i) == 0)
        EXPECT_EQ(lse.get(i * 2 + h), -std::numeric_limits<double>::infinity());
      else
        EXPECT_NEAR(lse.get(i * 2 + h), std::log(sum), 1e-12);
    }
  }
}

TEST(ReferenceGradients, AgnnMatchesFiniteDifferences) {
  // A square pattern with every self loop (the layer's A + I), and a zero row of h.
  coo_graph coo = to_coo(test::random_pattern(9, 9, 4, 31));
  for (std::int64_t i = 0; i < 9; ++i) {
    coo.src.push_back(i);
    coo.dst.push_back(i);
  }
  const csr_graph g = to_csr(coo);
  const std::int64_t f = 4;
  host_tensor h = random_f64(9, 1, f, 32), w = random_f64(9, 1, f, 33), out(dtype::f64, 9, 1, f);
  for (std::int64_t c = 0; c < f; ++c) h.set(3 * f + c, 0.0);
  double beta = 1.3;
  const agnn_layer layer = agnn_layer::build(g);
  const auto loss = [&] {
    layer.forward(h.view(), beta, out.view());
    return inner(w, out);
  };
  host_tensor dh(dtype::f64, 9, 1, f);
  const double dbeta = reference::agnn_backward(g, h.view(), beta, w.view(), dh.view());
  // Row 3 stays zero (its gradient through the cosine is not defined there): perturb the others.
  expect_matches_finite_differences(h, loss, dh, "agnn dh",
                                    [&](std::int64_t i) { return i / f == 3; });
  const double eps = 1e-6;
  beta += eps;
  const double up = loss();
  beta -= 2 * eps;
  const double down = loss();
  beta += eps;
  EXPECT_NEAR((up - down) / (2 * eps), dbeta, 1e-6);
  EXPECT_NE(dbeta, 0.0);
}

TEST(ReferenceGradients, SddmmSoftmaxSpmmMatchFiniteDifferences) {
  csr_graph g = small_pattern();
  g.values.assign(g.col_idx.size(), 0.0f);
  for (std::size_t e = 0; e < g.values.size(); ++e) g.values[e] = 0.5f + 0.1f * float(e % 5);
  const std::int64_t heads = 2, d = 3;
  host_tensor x = random_f64(g.rows, heads, d, 11), y = random_f64(g.cols, heads, d, 12);
  // SDDMM: out [nnz] = a_e scale <x_r, y_c>.
  host_tensor w = random_f64(g.nnz(), heads, 1, 13), s(dtype::f64, g.nnz(), heads, 1);
  const auto sddmm_loss = [&] {
    reference::sddmm(g, x.view(), y.view(), s.view(), 0.9);
    return inner(w, s);
  };
  host_tensor dx(dtype::f64, g.rows, heads, d), dy(dtype::f64, g.cols, heads, d);
  reference::sddmm_backward(g, x.view(), y.view(), w.view(), dx.view(), dy.view(), 0.9);
  expect_matches_finite_differences(x, sddmm_loss, dx, "sddmm dx");
  expect_matches_finite_differences(y, sddmm_loss, dy, "sddmm dy");
  // Softmax over each row's entries.
  host_tensor scores = random_f64(g.nnz(), heads, 1, 14), p(dtype::f64, g.nnz(), heads, 1);
  const auto softmax_loss = [&] {
    reference::softmax(g, scores.view(), p.view());
    return inner(w, p);
  };
  softmax_loss();
  host_tensor dscores(dtype::f64, g.nnz(), heads, 1);
  reference::softmax_backward(g, p.view(), w.view(), dscores.view());
  expect_matches_finite_differences(scores, softmax_loss, dscores, "softmax");
  // SpMM with per-head weights: c = A_w b.
  host_tensor weights = random_f64(g.nnz(), heads, 1, 15), b = random_f64(g.cols, heads, d, 16),
              wc = random_f64(g.rows, heads, d, 17), c(dtype::f64, g.rows, heads, d);
  const auto spmm_loss = [&] {
    reference::spmm(g, weights.view(), b.view(), c.view());
    return inner(wc, c);
  };
  host_tensor dw(dtype::f64, g.nnz(), heads, 1), db(dtype::f64, g.cols, heads, d);
  reference::spmm_backward(g, weights.view(), b.view(), wc.view(), dw.view(), db.view());
  expect_matches_finite_differences(weights, spmm_loss, dw, "spmm dw");
  expect_matches_finite_differences(b, spmm_loss, db, "spmm db");
}

TEST(ReferenceGradients, BlockSparseMatchesFiniteDifferences) {
  // Two sequences (5 and 11 tokens), blocks of 4, causal, a mask per head.
  const block_sparse_mask mask = make_block_sparse_mask(
      {.layout = block_layout::random, .block = 4, .p = 0.4, .causal = true, .heads = 2},
      std::vector<std::int64_t>{5, 11});
  const std::int64_t heads = 2, d = 3, rows = 16;
  host_tensor q = random_f64(rows, heads, d, 61), k = random_f64(rows, heads, d, 62),
              v = random_f64(rows, heads, d, 63), w = random_f64(rows, heads, d, 64);
  host_tensor out(dtype::f64, rows, heads, d);
  const auto loss = [&] {
    reference::block_sparse_attention(mask, q.view(), k.view(), v.view(), out.view(), 0.8);
    return inner(w, out);
  };
  host_tensor dq(dtype::f64, rows, heads, d), dk(dtype::f64, rows, heads, d),
      dv(dtype::f64, rows, heads, d);
  reference::block_sparse_attention_backward(mask, q.view(), k.view(), v.view(), w.view(),
                                             dq.view(), dk.view(), dv.view(), 0.8);
  expect_matches_finite_differences(q, loss, dq, "dq");
  expect_matches_finite_differences(k, loss, dk, "dk");
  expect_matches_finite_differences(v, loss, dv, "dv");
}

// Block importance in float64: what the CPU engine writes for float64 inputs (its dot products
// are then float64 too), a dense mask's block rows summing to 1, blocks the mask drops untouched.
TEST(ReferenceGradients, BlockImportanceIsTheBlocksSoftmaxAndScoreGradientMass) {
  const std::vector<std::int64_t> lens{5, 11};
  const std::int64_t heads = 2, d = 3, rows = 16, qb = 3, kb = 3;
  host_tensor q = random_f64(rows, heads, d, 71), k = random_f64(rows, heads, d, 72),
              v = random_f64(rows, heads, d, 73), w = random_f64(rows, heads, d, 74);
  for (const block_layout layout : {block_layout::random, block_layout::dense}) {
    const block_sparse_mask mask = make_block_sparse_mask(
        {.layout = layout, .block = 4, .p = 0.4, .causal = true, .heads = 2}, lens);
    host_tensor mass(dtype::f64, 2 * qb, heads, kb), grad(dtype::f64, 2 * qb, heads, kb),
        engine_mass(dtype::f64, 2 * qb, heads, kb), engine_grad(dtype::f64, 2 * qb, heads, kb);
    for (host_tensor* t : {&mass, &grad, &engine_mass, &engine_grad})
      t->fill(std::numeric_limits<double>::quiet_NaN());
    reference::block_importance(mask, q.view(), k.view(), v.view(), w.view(), 0.8, mass.view(),
                                grad.view());
    host_tensor dq(dtype::f64, rows, heads, d), dk(dtype::f64, rows, heads, d),
        dv(dtype::f64, rows, heads, d);
    block_sparse_attention_plan::build(mask).backward(
        q.view(), k.view(), v.view(), {}, {}, w.view(), dq.view(), dk.view(), dv.view(),
        {.scale = 0.8, .block_mass = engine_mass.view(), .block_grad = engine_grad.view()});
    for (std::int64_t i = 0; i < mass.numel(); ++i) {
      EXPECT_EQ(std::isnan(mass.get(i)), std::isnan(engine_mass.get(i))) << i;
      if (std::isnan(mass.get(i))) continue;
      EXPECT_NEAR(mass.get(i), engine_mass.get(i), 1e-12) << i;
      EXPECT_NEAR(grad.get(i), engine_grad.get(i), 1e-12) << i;
    }
    if (layout != block_layout::dense) continue;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t r = 0; r * 4 < lens[static_cast<std::size_t>(b)]; ++r) {
        for (std::int64_t h = 0; h < heads; ++h) {
          double sum = 0;
          for (std::int64_t c = 0; c <= r; ++c)
            sum += mass.get(((b * qb + r) * heads + h) * kb + c);
          EXPECT_NEAR(sum, 1.0, 1e-12) << "sequence " << b << " block row " << r;
        }
      }
    }
  }
}

// A multigraph over small_pattern's pairs, given out of order, with (5, 3) three times and (0, 0)
// twice; row 2 has no edge.
coo_graph small_multigraph() {
  const csr_graph g = small_pattern();
  coo_graph coo{.rows = g.rows, .cols = g.cols, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t x = 0; x < g.nnz(); ++x) {
    const std::int64_t e = (x * 5) % g.nnz();  // nnz = 14: 5 is coprime to it
    coo.src.push_back(std::upper_bound(g.row_ptr.begin(), g.row_ptr.end(), e) - g.row_ptr.begin() -
                      1);
    coo.dst.push_back(g.col_idx[e]);
  }
  for (const auto& [r, c] : std::vector<std::pair<int, int>>{{5, 3}, {0, 0}, {5, 3}}) {
    coo.src.push_back(r);
    coo.dst.push_back(c);
  }
  return coo;
}

// TransformerConv's multigraph attention with edge features and keep factors: every gradient
// against central differences of <dout, out> + <dout_edge, out_edge>; without features it is
// attention() over the merged pattern with log(multiplicity) as bias.
TEST(ReferenceGradients, EdgeAttentionMatchesFiniteDifferences) {
  const coo_graph g = small_multigraph();
  const std::int64_t heads = 2, c = 3, f = 2, e = g.nnz();
  host_tensor q = random_f64(g.rows, heads, c, 91), k = random_f64(g.cols, heads, c, 92),
              v = random_f64(g.cols, heads, c, 93), r = random_f64(g.rows, heads, f, 94),
              a = random_f64(e, 1, f, 95), up = random_f64(g.rows, heads, c, 96),
              up_edge = random_f64(g.rows, heads, f, 97), keep(dtype::f64, e, heads, 1),
              out(dtype::f64, g.rows, heads, c), out_edge(dtype::f64, g.rows, heads, f);
  for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, i % 4 == 1 ? 0.0 : 1.25);
  const double scale = 0.6;
  const auto loss = [&] {
    reference::edge_attention(g, q.view(), k.view(), v.view(), r.view(), a.view(), keep.view(),
                              scale, out.view(), out_edge.view(), {});
    return inner(up, out) + inner(up_edge, out_edge);
  };
  host_tensor dq(dtype::f64, g.rows, heads, c), dk(dtype::f64, g.cols, heads, c),
      dv(dtype::f64, g.cols, heads, c), dr(dtype::f64, g.rows, heads, f), da(dtype::f64, e, 1, f);
  reference::edge_attention_backward(g, q.view(), k.view(), v.view(), r.view(), a.view(),
                                     keep.view(), scale, up.view(), up_edge.view(), dq.view(),
                                     dk.view(), dv.view(), dr.view(), da.view());
  expect_matches_finite_differences(q, loss, dq, "dq");
  expect_matches_finite_differences(k, loss, dk, "dk");
  expect_matches_finite_differences(v, loss, dv, "dv");
  expect_matches_finite_differences(r, loss, dr, "dr");
  expect_matches_finite_differences(a, loss, da, "da");

  // Without features or keep: the merged pattern with log(copies) as a per-entry bias.
  const csr_graph merged = small_pattern();
  host_tensor bias(dtype::f64, merged.nnz(), 1, 1), want(dtype::f64, g.rows, heads, c),
      want_lse(dtype::f64, g.rows, heads, 1), lse(dtype::f64, g.rows, heads, 1);
  for (std::int64_t x = 0; x < e; ++x) {
    const auto* row = merged.col_idx.data() + merged.row_ptr[g.src[x]];
    const std::int64_t entry =
        merged.row_ptr[g.src[x]] +
        (std::lower_bound(row, row + merged.degree(g.src[x]), static_cast<std::int32_t>(g.dst[x])) -
         row);
    bias.set(entry, bias.get(entry) + 1);
  }
  for (std::int64_t x = 0; x < merged.nnz(); ++x) bias.set(x, std::log(bias.get(x)));
  reference::edge_attention(g, q.view(), k.view(), v.view(), {}, {}, {}, scale, out.view(), {},
                            lse.view());
  reference::attention(merged, q.view(), k.view(), v.view(), want.view(), scale, want_lse.view(),
                       bias.view());
  EXPECT_LE(test::compare(out, want).max_abs, 1e-12);
  for (std::int64_t i = 0; i < lse.numel(); ++i) {
    if (std::isinf(want_lse.get(i))) {
      EXPECT_EQ(lse.get(i), want_lse.get(i));
    } else {
      EXPECT_NEAR(lse.get(i), want_lse.get(i), 1e-12);
    }
  }
}

// GAT's multigraph attention with an edge term and keep factors against central differences;
// over a graph without repeats and without the edge term it is gat().
TEST(ReferenceGradients, EdgeGatMatchesFiniteDifferences) {
  const coo_graph g = small_multigraph();
  const std::int64_t heads = 2, c = 4, e = g.nnz();
  host_tensor x = random_f64(g.cols, heads, c, 101), src = random_f64(g.cols, heads, 1, 102),
              dst = random_f64(g.rows, heads, 1, 103), edge = random_f64(e, heads, 1, 104),
              up = random_f64(g.rows, heads, c, 105), keep(dtype::f64, e, heads, 1),
              out(dtype::f64, g.rows, heads, c);
  for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, i % 3 == 2 ? 0.0 : 1.5);
  const auto loss = [&] {
    reference::edge_gat(g, x.view(), src.view(), dst.view(), edge.view(), keep.view(), 0.2,
                        out.view(), {});
    return inner(up, out);
  };
  host_tensor dx(dtype::f64, g.cols, heads, c), dsrc(dtype::f64, g.cols, heads, 1),
      ddst(dtype::f64, g.rows, heads, 1), dedge(dtype::f64, e, heads, 1);
  reference::edge_gat_backward(g, x.view(), src.view(), dst.view(), edge.view(), keep.view(), 0.2,
                               up.view(), dx.view(), dsrc.view(), ddst.view(), dedge.view());
  expect_matches_finite_differences(x, loss, dx, "dx");
  expect_matches_finite_differences(src, loss, dsrc, "da_src");
  expect_matches_finite_differences(dst, loss, ddst, "da_dst");
  expect_matches_finite_differences(edge, loss, dedge, "da_edge");

  const csr_graph simple = small_pattern();
  const coo_graph pairs = to_coo(simple);
  host_tensor want(dtype::f64, g.rows, heads, c), got(dtype::f64, g.rows, heads, c);
  reference::edge_gat(pairs, x.view(), src.view(), dst.view(), {}, {}, 0.2, got.view(), {});
  reference::gat(simple, x.view(), src.view(), dst.view(), {}, 0.2, want.view(), {});
  EXPECT_LE(test::compare(got, want).max_abs, 1e-12);
}

TEST(BlockSparsePlanBackward, GivesTheReferenceGradientsAndNamesBadArguments) {
  const block_sparse_mask mask = make_block_sparse_mask(
      {.layout = block_layout::random, .block = 8, .p = 0.5, .causal = true, .heads = 2},
      std::vector<std::int64_t>{13, 30});
  const std::int64_t heads = 2, d = 5, rows = 43;
  const host_tensor q = random_f64(rows, heads, d, 71), k = random_f64(rows, heads, d, 72),
                    v = random_f64(rows, heads, d, 73), w = random_f64(rows, heads, d, 74);
  host_tensor dq(dtype::f32, rows, heads, d), dk(dtype::f32, rows, heads, d),
      dv(dtype::f32, rows, heads, d);
  const auto plan = block_sparse_attention_plan::build(mask);
  plan.backward(q.view(), k.view(), v.view(), {}, {}, w.view(), dq.view(), dk.view(), dv.view(),
                {.scale = 0.7});
  host_tensor rq(dtype::f32, rows, heads, d), rk(dtype::f32, rows, heads, d),
      rv(dtype::f32, rows, heads, d);
  reference::block_sparse_attention_backward(mask, q.view(), k.view(), v.view(), w.view(),
                                             rq.view(), rk.view(), rv.view(), 0.7);
  double max_abs = 0;
  for (const auto& [got, want] : {std::pair{&dq, &rq}, std::pair{&dk, &rk}, std::pair{&dv, &rv}}) {
    // float64 in float64, both rounded to f32 at the end: within a few f32 roundings.
    EXPECT_LE(test::compare(*got, *want).relative(), 1e-6);
    for (std::int64_t i = 0; i < got->numel(); ++i)
      max_abs = std::max(max_abs, std::abs(got->get(i)));
  }
  EXPECT_GT(max_abs, 0.0);
  host_tensor short_dk(dtype::f32, rows - 1, heads, d);
  EXPECT_THROW(
      {
        try {
          plan.backward(q.view(), k.view(), v.view(), {}, {}, w.view(), dq.view(), short_dk.view(),
                        dv.view());
        } catch (const invalid_input& e) {
          EXPECT_NE(std::string(e.what()).find("dk"), std::string::npos) << e.what();
          throw;
        }
      },
      invalid_input);
}

// The CPU engine's backward (fused, the default) against the float64 reference: a ragged batch
// with an empty sequence and rectangular sequences, per-head and shared causal masks; f32 and
// f16 inputs; bitwise repeatable. Given the out and lse that run() wrote (the lse checked against
// a float64 sum over each row's keys), the same gradients without recomputing the forward.
// Blocks of 8 (the tiles pad rows, keys and channels), 64 and 128 (two 64-key chunks a block in
// the tiled engine's dk, dv pass), partial last blocks, empty and one-row sequences.
TEST(BlockSparseBackward, TheCpuEngineMatchesTheReference) {
  struct config {
    std::int64_t block, d;
    std::vector<std::int64_t> lens;
    bool causal;
  };
  for (const config& c : {config{8, 6, {13, 0, 30}, true}, config{64, 24, {130, 1, 77}, true},
                          config{128, 16, {200, 0, 60}, false}})
    for (const std::int64_t mask_heads : {1, 2}) {
      block_sparse_mask mask = make_block_sparse_mask({.layout = block_layout::random,
                                                       .block = c.block,
                                                       .p = 0.4,
                                                       .causal = c.causal,
                                                       .heads = mask_heads},
                                                      c.lens);
      for (const dtype t : {dtype::f32, dtype::f16}) {
        SCOPED_TRACE("block " + std::to_string(c.block) + ", " + std::to_string(mask_heads) +
                     " mask heads, " + std::string(to_string(t)));
        const std::int64_t heads = 2, d = c.d, rows = mask.cu_seqlens_q.back();
        host_tensor q(t, rows, heads, d), k(t, rows, heads, d), v(t, rows, heads, d),
            w(t, rows, heads, d);
        q.fill_uniform(-1, 1, 81);
        k.fill_uniform(-1, 1, 82);
        v.fill_uniform(-1, 1, 83);
        w.fill_uniform(-1, 1, 84);
        const auto plan = block_sparse_attention_plan::build(mask);
        host_tensor out(dtype::f32, rows, heads, d), lse(dtype::f32, rows, heads, 1);
        plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = 0.6, .lse = lse.view()});
        for (std::int64_t b = 0; b < mask.batch(); ++b) {
          for (std::int64_t h = 0; h < heads; ++h) {
            const csr_graph pattern = mask.expand(b, mask_heads == 1 ? 0 : h);
            for (std::int64_t i = 0; i < pattern.rows; ++i) {
              const std::int64_t row = mask.cu_seqlens_q[b] + i;
              double sum = 0;
              for (std::int64_t e = pattern.row_ptr[i]; e < pattern.row_ptr[i + 1]; ++e) {
                const std::int64_t col = mask.cu_seqlens_k[b] + pattern.col_idx[e];
                double dot = 0;
                for (std::int64_t x = 0; x < d; ++x)
                  dot += q.get((row * heads + h) * d + x) * k.get((col * heads + h) * d + x);
                sum += std::exp(0.6 * dot);
              }
              const double got_lse = lse.get(row * heads + h);
              if (pattern.degree(i) == 0)
                EXPECT_EQ(got_lse, -std::numeric_limits<double>::infinity());
              else
                EXPECT_NEAR(got_lse, std::log(sum), 1e-5) << "row " << row << ", head " << h;
            }
          }
        }
        host_tensor got[3][3];
        for (int round = 0; round < 3; ++round) {
          for (auto& g : got[round]) {
            g = host_tensor(dtype::f32, rows, heads, d);
            g.fill(std::nan(""));
          }
          const bool saved = round == 2;
          plan.backward(q.view(), k.view(), v.view(), saved ? out.view() : tensor_view{},
                        saved ? lse.view() : tensor_view{}, w.view(), got[round][0].view(),
                        got[round][1].view(), got[round][2].view(), {.scale = 0.6});
        }
        host_tensor want[3] = {host_tensor(dtype::f64, rows, heads, d),
                               host_tensor(dtype::f64, rows, heads, d),
                               host_tensor(dtype::f64, rows, heads, d)};
        reference::block_sparse_attention_backward(mask, q.view(), k.view(), v.view(), w.view(),
                                                   want[0].view(), want[1].view(), want[2].view(),
                                                   0.6);
        for (int i = 0; i < 3; ++i) {
          double err = 0, ref = 0;
          for (std::int64_t x = 0; x < want[i].numel(); ++x) {
            ASSERT_TRUE(std::isfinite(got[0][i].get(x))) << "unwritten gradient " << i;
            err = std::max(err, std::abs(got[0][i].get(x) - want[i].get(x)));
            ref = std::max(ref, std::abs(want[i].get(x)));
          }
          EXPECT_GT(ref, 0.0);
          EXPECT_LE(err, 1e-5 * ref) << "gradient " << i;
          EXPECT_EQ(std::memcmp(got[0][i].data(), got[1][i].data(), got[0][i].size_bytes()), 0);
          double saved_err = 0;  // from run()'s out and lse
          for (std::int64_t x = 0; x < want[i].numel(); ++x)
            saved_err = std::max(saved_err, std::abs(got[2][i].get(x) - want[i].get(x)));
          EXPECT_LE(saved_err, 1e-5 * ref) << "gradient " << i << " from the saved out and lse";
        }
      }
    }
}

TEST(ReferenceGradients, GcnLayerMatchesFiniteDifferences) {
  const csr_graph g = test::random_pattern(9, 9, 4, 71);
  const csr_graph a = gcn_normalized(g);
  const std::int64_t f_in = 3, f_out = 2;
  host_tensor x = random_f64(g.rows, 1, f_in, 72), w = random_f64(f_in, 1, f_out, 73),
              up = random_f64(g.rows, 1, f_out, 74), out(dtype::f64, g.rows, 1, f_out);
  const gcn_layer layer = gcn_layer::build(g);
  const auto loss = [&] {
    layer.forward(x.view(), w.view(), out.view());
    return inner(up, out);
  };
  host_tensor dx(dtype::f64, g.rows, 1, f_in), dw(dtype::f64, f_in, 1, f_out);
  reference::gcn_backward(a, x.view(), w.view(), up.view(), dx.view(), dw.view());
  expect_matches_finite_differences(x, loss, dx, "dx");
  expect_matches_finite_differences(w, loss, dw, "dw");
}

// The fused GCN layer's reference (relu(Â x w + bias), GraphCUDA's A·X·W with its epilogue):
// without ReLU it is the GCN layer plus the bias; its ReLU mask marks exactly the positive
// outputs (F_out = 40: two mask words a row); its gradients match finite differences.
TEST(ReferenceGradients, FusedGcnLayerMatchesFiniteDifferences) {
  const csr_graph g = test::random_pattern(11, 11, 4, 75);
  const csr_graph a = gcn_normalized(g);
  const std::int64_t f_in = 3, f_out = 40;
  host_tensor x = random_f64(g.rows, 1, f_in, 76), w = random_f64(f_in, 1, f_out, 77),
              bias = random_f64(1, 1, f_out, 78), up = random_f64(g.rows, 1, f_out, 79),
              out(dtype::f64, g.rows, 1, f_out), plain(dtype::f64, g.rows, 1, f_out);
  EXPECT_TRUE(reference::gcn_fused(a, x.view(), w.view(), bias.view(), false, out.view()).empty());
  gcn_layer::build(g).forward(x.view(), w.view(), plain.view());
  for (std::int64_t i = 0; i < out.numel(); ++i)
    EXPECT_NEAR(out.get(i), plain.get(i) + bias.get(i % f_out), 1e-12);
  const std::vector<std::uint32_t> mask =
      reference::gcn_fused(a, x.view(), w.view(), bias.view(), true, out.view());
  ASSERT_EQ(mask.size(), static_cast<std::size_t>(g.rows * 2));
  std::int64_t positive = 0;
  for (std::int64_t r = 0; r < g.rows; ++r)
    for (std::int64_t f = 0; f < f_out; ++f) {
      const bool bit = (mask[static_cast<std::size_t>(r * 2 + f / 32)] >> (f % 32) & 1u) != 0;
      EXPECT_EQ(bit, out.get(r * f_out + f) > 0);
      EXPECT_GE(out.get(r * f_out + f), 0.0);
      positive += bit;
    }
  EXPECT_GT(positive, 0);
  EXPECT_LT(positive, g.rows * f_out);
  const auto loss = [&] {
    (void)reference::gcn_fused(a, x.view(), w.view(), bias.view(), true, out.view());
    return inner(up, out);
  };
  host_tensor dx(dtype::f64, g.rows, 1, f_in), dw(dtype::f64, f_in, 1, f_out),
      db(dtype::f64, 1, 1, f_out);
  reference::gcn_fused_backward(a, x.view(), w.view(), mask, up.view(), dx.view(), dw.view(),
                                db.view());
  expect_matches_finite_differences(x, loss, dx, "dx");
  expect_matches_finite_differences(w, loss, dw, "dw");
  expect_matches_finite_differences(bias, loss, db, "dbias");
  const std::vector<std::uint32_t> short_mask(3);
  EXPECT_THROW(reference::gcn_fused_backward(a, x.view(), w.view(), short_mask, up.view(),
                                             dx.view(), dw.view(), db.view()),
               invalid_input);
}

// GAT's attention: with x = 1 every non-empty row's output is sum_j p_ij = 1 and an empty row
// gets 0 and lse -inf; keep factors scale each weight; the gradients of x, a_src and a_dst match
// finite differences with a keep mask holding zeros; the CPU plan gives the reference's values.
TEST(ReferenceGradients, GatMatchesFiniteDifferences) {
  const csr_graph a = small_pattern();  // row 2 and column 4 empty
  const std::int64_t heads = 3, width = 5;
  host_tensor x = random_f64(a.cols, heads, width, 81), src = random_f64(a.cols, heads, 1, 82),
              dst = random_f64(a.rows, heads, 1, 83), up = random_f64(a.rows, heads, width, 84),
              keep(dtype::f64, a.nnz(), heads, 1), ones(dtype::f64, a.cols, heads, width),
              out(dtype::f64, a.rows, heads, width), lse(dtype::f64, a.rows, heads, 1);
  for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, i % 3 == 0 ? 0.0 : 1.5);
  ones.fill(1.0);
  reference::gat(a, ones.view(), src.view(), dst.view(), {}, 0.2, out.view(), lse.view());
  for (std::int64_t i = 0; i < a.rows; ++i) {
    const bool empty = a.row_ptr[i] == a.row_ptr[i + 1];
    for (std::int64_t h = 0; h < heads; ++h) {
      EXPECT_NEAR(out.get((i * heads + h) * width), empty ? 0.0 : 1.0, 1e-12);
      EXPECT_EQ(std::isinf(lse.get(i * heads + h)), empty);
    }
  }
  const auto loss = [&] {
    reference::gat(a, x.view(), src.view(), dst.view(), keep.view(), 0.2, out.view(), {});
    return inner(up, out);
  };
  host_tensor dx(dtype::f64, a.cols, heads, width), dsrc(dtype::f64, a.cols, heads, 1),
      ddst(dtype::f64, a.rows, heads, 1);
  reference::gat_backward(a, x.view(), src.view(), dst.view(), keep.view(), 0.2, up.view(),
                          dx.view(), dsrc.view(), ddst.view());
  expect_matches_finite_differences(x, loss, dx, "gat dx");
  expect_matches_finite_differences(src, loss, dsrc, "gat da_src");
  expect_matches_finite_differences(dst, loss, ddst, "gat da_dst");

  // The CPU plan in f32 against the float64 reference.
  const gat_plan plan = gat_plan::build(a);
  host_tensor x32(dtype::f32, a.cols, heads, width), out32(dtype::f32, a.rows, heads, width),
      dx32(dtype::f32, a.cols, heads, width), dsrc32(dtype::f32, a.cols, heads, 1),
      ddst32(dtype::f32, a.rows, heads, 1), lse32(dtype::f32, a.rows, heads, 1);
  for (std::int64_t i = 0; i < x.numel(); ++i) x32.set(i, x.get(i));
  plan.forward({.x = x32.view(),
                .a_src = src.view(),
                .a_dst = dst.view(),
                .keep = keep.view(),
                .out = out32.view(),
                .lse = lse32.view()});
  plan.backward({.x = x32.view(),
                 .a_src = src.view(),
                 .a_dst = dst.view(),
                 .keep = keep.view(),
                 .out = out32.view(),
                 .lse = lse32.view(),
                 .dout = up.view(),
                 .dx = dx32.view(),
                 .da_src = dsrc32.view(),
                 .da_dst = ddst32.view()});
  (void)loss();
  for (const auto& [got, want] : {std::pair{&out32, &out}, std::pair{&dx32, &dx},
                                  std::pair{&dsrc32, &dsrc}, std::pair{&ddst32, &ddst}})
    EXPECT_LE(test::compare(*got, *want).relative(), 1e-6);
  EXPECT_THROW(
      plan.forward(
          {.x = x32.view(), .a_src = dst.view(), .a_dst = dst.view(), .out = out32.view()}),
      invalid_input);  // a_src has the rows' count
}

// The fused CPU backward (through the plan) against the float64 reference: gradients within
// tolerance, bitwise equal across two runs, exact zeros where the pattern has no entry.
void check_fused_backward(const csr_graph& g, std::int64_t heads, std::int64_t d, dtype t,
                          std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(t)) + " heads " + std::to_string(heads) + " d " +
               std::to_string(d) + " n " + std::to_string(g.rows) + " nnz " +
               std::to_string(g.nnz()));
  const auto x = test::random_qkv(g, heads, d, t, seed);
  host_tensor dout(t, g.rows, heads, d);
  dout.fill_uniform(-1.0, 1.0, seed + 7);
  const attention_plan plan =
      attention_plan::build(g, device_kind::cpu, {.algo = algorithm::fused, .gradients = true});
  host_tensor out(dtype::f32, g.rows, heads, d), lse(dtype::f32, g.rows, heads, 1);
  plan.run(x.q.view(), x.k.view(), x.v.view(), out.view(), {.lse = lse.view()});
  host_tensor dq(dtype::f32, g.rows, heads, d), dk(dtype::f32, g.cols, heads, d),
      dv(dtype::f32, g.cols, heads, d);
  const auto backward = [&] {
    plan.backward(x.q.view(), x.k.view(), x.v.view(), out.view(), lse.view(), dout.view(),
                  dq.view(), dk.view(), dv.view());
  };
  backward();
  const host_tensor dq1 = dq, dk1 = dk, dv1 = dv;
  dq.fill(std::nan(""));
  dk.fill(std::nan(""));
  dv.fill(std::nan(""));
  backward();
  EXPECT_EQ(std::memcmp(dq1.data(), dq.data(), dq.size_bytes()), 0) << "dq differs between runs";
  EXPECT_EQ(std::memcmp(dk1.data(), dk.data(), dk.size_bytes()), 0) << "dk differs between runs";
  EXPECT_EQ(std::memcmp(dv1.data(), dv.data(), dv.size_bytes()), 0) << "dv differs between runs";
  host_tensor rq(dtype::f64, g.rows, heads, d), rk(dtype::f64, g.cols, heads, d),
      rv(dtype::f64, g.cols, heads, d), rlse(dtype::f64, g.rows, heads, 1),
      rout(dtype::f64, g.rows, heads, d);
  const double scale = effective_scale({}, d);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), rout.view(), scale, rlse.view());
  reference::attention_backward(g, x.q.view(), x.k.view(), x.v.view(), dout.view(), rq.view(),
                                rk.view(), rv.view(), scale);
  // fp32 arithmetic on the inputs as given (f16 inputs are exact in f32 and f64 alike).
  for (const auto& [got, ref, what] :
       {std::tuple{&dq, &rq, "dq"}, std::tuple{&dk, &rk, "dk"}, std::tuple{&dv, &rv, "dv"}}) {
    const auto e = test::compare(*got, *ref);
    EXPECT_TRUE(e.finite) << what;
    EXPECT_LE(e.relative(), 2e-5) << what << " max abs " << e.max_abs;
  }
  for (std::int64_t i = 0; i < g.rows; ++i) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const double want = rlse.get(i * heads + h), got = lse.get(i * heads + h);
      if (std::isinf(want))
        EXPECT_EQ(got, want);
      else
        EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, std::abs(want)));
    }
  }
  const csr_graph gt = transpose(g);
  for (std::int64_t j = 0; j < g.cols; ++j) {
    if (gt.degree(j) != 0) continue;
    for (std::int64_t x2 = 0; x2 < heads * d; ++x2) {
      ASSERT_EQ(dk.get(j * heads * d + x2), 0.0);
      ASSERT_EQ(dv.get(j * heads * d + x2), 0.0);
    }
  }
}

TEST(FusedCpuBackward, MatchesTheReferenceOnRandomGraphs) {
  check_fused_backward(small_pattern(), 2, 8, dtype::f32, 31);
  check_fused_backward(test::random_pattern(300, 300, 40, 3), 1, 64, dtype::f32, 32);
  check_fused_backward(test::random_pattern(200, 150, 20, 4), 3, 32, dtype::f16, 33);
  check_fused_backward(test::random_pattern(257, 257, 70, 5), 2, 16, dtype::bf16, 34);
}

TEST(FusedCpuBackward, MatchesTheReferenceOnSharedGraphs) {
  const auto paths = test::dataset_graphs();
  if (paths.empty()) GTEST_SKIP() << "../shared/datasets not found: skipping";
  int checked = 0;
  for (const auto& p : paths) {
    const std::string name = p.filename().string();
    if (name.rfind("cora.", 0) != 0 && name.rfind("citeseer.", 0) != 0 &&
        name.rfind("tu_mutag.", 0) != 0)
      continue;
    check_fused_backward(read_graph(p), 2, 16, dtype::f32, 40 + checked);
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(FusedCpuBackward, SaysWhatItNeeds) {
  const csr_graph g = small_pattern();
  const auto x = test::random_qkv(g, 1, 8, dtype::f32, 50);
  host_tensor out(dtype::f32, g.rows, 1, 8), lse(dtype::f32, g.rows, 1, 1),
      dq(dtype::f32, g.rows, 1, 8), dk(dtype::f32, g.cols, 1, 8), dv(dtype::f32, g.cols, 1, 8);
  const attention_plan without = attention_plan::build(g);
  without.run(x.q.view(), x.k.view(), x.v.view(), out.view(), {.lse = lse.view()});
  EXPECT_THROW(without.backward(x.q.view(), x.k.view(), x.v.view(), out.view(), lse.view(),
                                out.view(), dq.view(), dk.view(), dv.view()),
               invalid_input);  // no plan_options::gradients
  const attention_plan with = attention_plan::build(g, device_kind::cpu, {.gradients = true});
  EXPECT_THROW(with.backward(x.q.view(), x.k.view(), x.v.view(), out.view(), {}, out.view(),
                             dq.view(), dk.view(), dv.view()),
               invalid_input);  // no lse
  host_tensor short_dk(dtype::f32, g.cols - 1, 1, 8);
  EXPECT_THROW(with.backward(x.q.view(), x.k.view(), x.v.view(), out.view(), lse.view(), out.view(),
                             dq.view(), short_dk.view(), dv.view()),
               invalid_input);
}

}  // namespace
}  // namespace trisparse
