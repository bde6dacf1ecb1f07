// GCN and AGNN layers on the CPU against the layers' definitions written out with dense matrices.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>

#include "../../src/cuda/layers/gcn_fused/plan.hpp"
#include "support.hpp"

namespace trisparse {
namespace {

// Runs `run` again on one thread: every output keeps the bits it had (the CPU engines' sums are
// in a fixed order, whatever the thread count).
void expect_same_bits_on_one_thread(const std::function<void()>& run,
                                    std::initializer_list<const host_tensor*> outputs) {
  std::vector<host_tensor> before;
  for (const host_tensor* t : outputs) before.push_back(*t);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  run();
  omp_set_num_threads(threads);
  std::size_t k = 0;
  for (const host_tensor* t : outputs) {
    EXPECT_EQ(std::memcmp(before[k].data(), t->data(), t->size_bytes()), 0) << "output " << k;
    ++k;
  }
}

// Dense A + I of a square pattern (binary).
std::vector<std::vector<double>> dense_with_loops(const csr_graph& g) {
  std::vector<std::vector<double>> a(g.rows, std::vector<double>(g.rows, 0.0));
  for (std::int64_t r = 0; r < g.rows; ++r) {
    a[r][r] = 1;
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e) a[r][g.col_idx[e]] = 1;
  }
  return a;
}

TEST(Layers, GcnNormalisationByHand) {
  // The path 0 - 1 - 2 (both directions): with loops the degrees are 2, 3, 2.
  coo_graph coo{.rows = 3, .cols = 3, .src = {0, 1}, .dst = {1, 2}, .values = {5.0f, 7.0f}};
  const csr_graph g = to_csr(coo, {.symmetrize = true});
  const csr_graph a = gcn_normalized(g);
  ASSERT_EQ(a.row_ptr, (std::vector<std::int64_t>{0, 2, 5, 7}));
  ASSERT_EQ(a.col_idx, (std::vector<std::int32_t>{0, 1, 0, 1, 2, 1, 2}));
  const std::vector<double> want{0.5,     1 / std::sqrt(6.0), 1 / std::sqrt(6.0),
                                 1 / 3.0, 1 / std::sqrt(6.0), 1 / std::sqrt(6.0),
                                 0.5};
  for (std::size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(a.values[e], want[e], 1e-7) << e;
  // Without self loops an isolated node keeps an empty row (and a zero output).
  const csr_graph b = gcn_normalized(g, false);
  EXPECT_EQ(b.nnz(), 4);
  EXPECT_NEAR(b.values[0], 1 / std::sqrt(2.0), 1e-7);  // (0, 1): degrees 1 and 2
  EXPECT_THROW(gcn_normalized(test::random_pattern(4, 5, 2, 1)), invalid_input);
}

TEST(Layers, GcnForwardIsNormalisedAdjacencyTimesXTimesW) {
  const csr_graph g = test::random_pattern(40, 40, 5, 3);  // directed, some rows with loops
  const std::int64_t fi = 7, fo = 5;
  host_tensor x(dtype::f32, g.rows, 1, fi), w(dtype::f32, fi, 1, fo),
      out(dtype::f64, g.rows, 1, fo);
  x.fill_uniform(-1, 1, 1);
  w.fill_uniform(-1, 1, 2);
  const gcn_layer layer = gcn_layer::build(g);
  layer.forward(x.view(), w.view(), out.view());
  const auto a = dense_with_loops(g);
  std::vector<double> deg(g.rows, 0);
  for (std::int64_t i = 0; i < g.rows; ++i)
    for (std::int64_t j = 0; j < g.rows; ++j) deg[i] += a[i][j];
  EXPECT_EQ(layer.nnz(), static_cast<std::int64_t>(std::accumulate(deg.begin(), deg.end(), 0.0)));
  for (std::int64_t i = 0; i < g.rows; ++i) {
    for (std::int64_t o = 0; o < fo; ++o) {
      double want = 0;
      for (std::int64_t j = 0; j < g.rows; ++j) {
        if (a[i][j] == 0) continue;
        double xw = 0;
        for (std::int64_t k = 0; k < fi; ++k) xw += x.get(j * fi + k) * w.get(k * fo + o);
        want += xw / std::sqrt(deg[i] * deg[j]);
      }
      EXPECT_NEAR(out.get(i * fo + o), want, 1e-6) << i << " " << o;  // Â's values are f32
    }
  }
}

TEST(Layers, AgnnForwardIsCosineAttention) {
  const csr_graph g = test::random_pattern(30, 30, 6, 5);
  const std::int64_t f = 9;
  host_tensor h(dtype::f32, g.rows, 1, f), out(dtype::f64, g.rows, 1, f);
  h.fill_uniform(-1, 1, 3);
  for (std::int64_t k = 0; k < f; ++k) h.set(4 * f + k, 0.0);  // a zero row: cosine 0
  const double beta = 1.7;
  const agnn_layer layer = agnn_layer::build(g);
  layer.forward(h.view(), beta, out.view());
  const auto a = dense_with_loops(g);
  const auto norm = [&](std::int64_t i) {
    double s = 0;
    for (std::int64_t k = 0; k < f; ++k) s += h.get(i * f + k) * h.get(i * f + k);
    return std::sqrt(s);
  };
  for (std::int64_t i = 0; i < g.rows; ++i) {
    std::vector<double> weight(g.rows, 0.0);
    double sum = 0;
    for (std::int64_t j = 0; j < g.rows; ++j) {
      if (a[i][j] == 0) continue;
      double dot = 0;
      for (std::int64_t k = 0; k < f; ++k) dot += h.get(i * f + k) * h.get(j * f + k);
      const double n = norm(i) * norm(j);
      weight[j] = std::exp(beta * (n > 0 ? dot / n : 0.0));  // |beta cos| <= 1.7: no overflow
      sum += weight[j];
    }
    for (std::int64_t k = 0; k < f; ++k) {
      double want = 0;
      for (std::int64_t j = 0; j < g.rows; ++j) want += weight[j] / sum * h.get(j * f + k);
      EXPECT_NEAR(out.get(i * f + k), want, 1e-6) << i << " " << k;  // the CPU kernels in fp32
    }
  }
}

// The fused kernel's format (BSB with P's values per TCB, cut windows) holds P exactly: every
// entry back at its bit, repeated entries summed, chunks covering each cut window in order.
TEST(Layers, FusedGcnFormatHoldsTheMatrix) {
  coo_graph coo;
  coo.rows = coo.cols = 3000;
  rng r(31);
  for (std::int64_t j = 0; j < 3000; j += 2) coo.src.push_back(20), coo.dst.push_back(j);
  for (std::int64_t i = 0; i < 3000; ++i) {
    for (std::uint64_t k = r.below(5); k > 0; --k)
      coo.src.push_back(i), coo.dst.push_back(static_cast<std::int64_t>(r.below(3000)));
  }
  coo.src.push_back(9), coo.dst.push_back(4), coo.src.push_back(9), coo.dst.push_back(4);
  for (std::size_t e = 0; e < coo.src.size(); ++e)
    coo.values.push_back(static_cast<float>(0.25 + r.uniform()));
  const csr_graph p = to_csr(coo);
  const cuda::gcn_fused_host h = cuda::make_gcn_fused_host(p);
  const bsb& b = h.format;
  ASSERT_NO_THROW(b.check());
  std::vector<std::map<std::int32_t, double>> want(3000), got(3000);
  for (std::int64_t i = 0; i < p.rows; ++i)
    for (std::int64_t e = p.row_ptr[i]; e < p.row_ptr[i + 1]; ++e)
      want[i][p.col_idx[e]] += p.values[e];
  for (std::int64_t w = 0; w < b.windows(); ++w) {
    for (std::int64_t t = b.tcb_offset[w]; t < b.tcb_offset[w + 1]; ++t) {
      std::int64_t k = h.value_offset[t];
      for (int bit = 0; bit < 128; ++bit) {
        if (!b.test(t, bit / 8, bit % 8)) continue;
        got[w * 16 + bit / 8][b.col_idx[t * 8 + bit % 8]] += h.values[k++];
      }
    }
    // Chunks: the cut window's TCBs in order, kGcnChunkTcbs at a time.
    if (h.split_first[w] >= 0) {
      std::int64_t next = b.tcb_offset[w];
      for (int c = 0; c < h.split_count[w]; ++c) {
        const cuda::gcn_chunk& ch = h.chunks[h.split_first[w] + c];
        EXPECT_EQ(ch.window, w);
        EXPECT_EQ(ch.slot, h.split_first[w] + c);
        EXPECT_EQ(ch.begin, next);
        EXPECT_LE(ch.end - ch.begin, cuda::kGcnChunkTcbs);
        next = ch.end;
      }
      EXPECT_EQ(next, b.tcb_offset[w + 1]);
    } else {
      EXPECT_LE(b.window_tcbs(w), 2 * cuda::kGcnChunkTcbs);
    }
  }
  EXPECT_GE(h.split_first[1], 0) << "row 20's window (1500 columns) is cut";
  for (std::int64_t i = 0; i < p.rows; ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << "row " << i;
    for (const auto& [c, v] : want[i]) EXPECT_NEAR(got[i][c], v, 1e-6) << i << "," << c;
  }
  EXPECT_NEAR(want[9][4], got[9][4], 1e-6);
}

// The CPU plan: P x w + bias (ReLU'd), its mask, and P x, against gcn_layer and the reference.
TEST(Layers, FusedGcnPlanOnTheCpu) {
  const csr_graph g = test::random_pattern(60, 60, 6, 32);
  const csr_graph p = gcn_normalized(g);
  const gcn_fused_plan plan = gcn_fused_plan::build(p);
  host_tensor x(dtype::f32, 60, 1, 5), w(dtype::f32, 5, 1, 40), b(dtype::f32, 1, 1, 40),
      plain(dtype::f64, 60, 1, 40), out(dtype::f64, 60, 1, 40), ax(dtype::f64, 60, 1, 5),
      ax_want(dtype::f64, 60, 1, 5);
  x.fill_uniform(-1, 1, 33);
  w.fill_uniform(-1, 1, 34);
  b.fill_uniform(-1, 1, 35);
  gcn_layer::build(g).forward(x.view(), w.view(), plain.view());
  reference::spmm(p, {}, x.view(), ax_want.view());
  EXPECT_TRUE(plan.fused(5, 40, dtype::f32));
  EXPECT_FALSE(plan.fused(40, 5, dtype::f32));
  // The measured rule: past 8192 rows, only where F_out >= 8 F_in.
  const gcn_fused_plan large =
      gcn_fused_plan::build(gcn_normalized(test::random_pattern(9000, 9000, 2, 36)));
  EXPECT_FALSE(large.fused(64, 64, dtype::f16));
  EXPECT_TRUE(large.fused(16, 128, dtype::f16));
  EXPECT_TRUE(large.fused(64, 64, dtype::f16, gcn_order::fused));
  EXPECT_FALSE(large.fused(16, 128, dtype::f16, gcn_order::unfused));
  EXPECT_EQ(plan.workspace_bytes(5, 40, dtype::f32), 0u);
  for (const bool relu : {true, false}) {
    std::vector<std::uint32_t> mask(60 * 2, 0xDEADBEEFu);
    plan.forward({.x = x.view(),
                  .w = w.view(),
                  .bias = b.view(),
                  .out = out.view(),
                  .relu = relu,
                  .relu_mask = mask.data(),
                  .ax = ax.view()});
    for (std::int64_t i = 0; i < 60; ++i) {
      for (std::int64_t f = 0; f < 40; ++f) {
        const double pre = plain.get(i * 40 + f) + b.get(f);
        EXPECT_NEAR(out.get(i * 40 + f), relu ? std::max(pre, 0.0) : pre, 1e-5);  // fp32
        EXPECT_EQ(((mask[i * 2 + f / 32] >> (f % 32)) & 1u) != 0, pre > 0);
      }
      EXPECT_EQ(mask[i * 2 + 1] >> 8, 0u);
    }
    for (std::int64_t i = 0; i < ax.numel(); ++i) EXPECT_NEAR(ax.get(i), ax_want.get(i), 1e-5);
  }
  EXPECT_THROW(plan.forward({.x = x.view(),
                             .w = w.view(),
                             .out = out.view(),
                             .ax = ax.view(),
                             .order = gcn_order::unfused}),
               invalid_input);
  EXPECT_THROW((void)gcn_fused_plan::build(g), invalid_input);  // no values
  EXPECT_THROW((void)gcn_fused_plan::build(gcn_normalized(test::random_pattern(3, 3, 2, 1)),
                                           device_kind::cpu)
                   .forward({.x = x.view(), .w = w.view(), .out = out.view()}),
               invalid_input);  // 60 rows of x for a 3-row plan

  // The backward: the reference's gradients, through the mask the forward wrote.
  std::vector<std::uint32_t> mask(60 * 2);
  plan.forward({.x = x.view(),
                .w = w.view(),
                .bias = b.view(),
                .out = out.view(),
                .relu_mask = mask.data()});
  host_tensor up(dtype::f64, 60, 1, 40), dx(dtype::f64, 60, 1, 5), dw(dtype::f64, 5, 1, 40),
      db(dtype::f64, 1, 1, 40), dx_ref(dtype::f64, 60, 1, 5), dw_ref(dtype::f64, 5, 1, 40),
      db_ref(dtype::f64, 1, 1, 40);
  up.fill_uniform(-1, 1, 37);
  plan.backward({.dout = up.view(),
                 .relu_mask = mask.data(),
                 .x = x.view(),
                 .w = w.view(),
                 .dx = dx.view(),
                 .dw = dw.view(),
                 .dbias = db.view()});
  reference::gcn_fused_backward(p, x.view(), w.view(), mask, up.view(), dx_ref.view(),
                                dw_ref.view(), db_ref.view());
  for (const auto& [got, want] :
       {std::pair{&dx, &dx_ref}, std::pair{&dw, &dw_ref}, std::pair{&db, &db_ref}}) {
    double scale = 0;
    for (std::int64_t i = 0; i < want->numel(); ++i)
      scale = std::max(scale, std::abs(want->get(i)));
    EXPECT_GT(scale, 0.0);
    for (std::int64_t i = 0; i < want->numel(); ++i)  // the fp32 engine against float64
      EXPECT_NEAR(got->get(i), want->get(i), 1e-5 * scale);
  }
  EXPECT_EQ(plan.backward_workspace_bytes(5, 40, dtype::f32), 0u);
  // Without dx: the same dw.
  host_tensor dw_only(dtype::f64, 5, 1, 40);
  plan.backward({.dout = up.view(),
                 .relu_mask = mask.data(),
                 .x = x.view(),
                 .w = w.view(),
                 .dw = dw_only.view()});
  for (std::int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(dw_only.get(i), dw.get(i));
}

// f32 tensors take the fp32 CPU engine: against the float64 reference on the same f32 inputs in
// both orders (F_out < F_in: P (x W); else (P x) W), with and without bias and ReLU, an empty row
// and a hub; the same bits with one thread as with all.
TEST(Layers, FusedGcnF32EngineMatchesTheReference) {
  coo_graph coo = to_coo(test::random_pattern(300, 300, 5, 61));
  for (std::int64_t j = 0; j < 300; j += 2) {  // row 7 gathers half the graph
    coo.src.push_back(7);
    coo.dst.push_back(j);
  }
  csr_graph g = to_csr(coo);
  const csr_graph p = gcn_normalized(g);
  const gcn_fused_plan plan = gcn_fused_plan::build(p);
  std::uint64_t seed = 62;
  for (const auto& [f_in, f_out] : {std::pair{37, 5}, std::pair{5, 40}, std::pair{16, 16}}) {
    for (const bool relu : {true, false}) {
      SCOPED_TRACE(std::to_string(f_in) + " -> " + std::to_string(f_out) +
                   (relu ? " relu" : " no relu"));
      host_tensor x(dtype::f32, 300, 1, f_in), w(dtype::f32, f_in, 1, f_out),
          b(dtype::f32, 1, 1, f_out), out(dtype::f32, 300, 1, f_out), ax(dtype::f32, 300, 1, f_in),
          want(dtype::f64, 300, 1, f_out), ax_want(dtype::f64, 300, 1, f_in);
      x.fill_uniform(-1, 1, seed++);
      w.fill_uniform(-1, 1, seed++);
      b.fill_uniform(-1, 1, seed++);
      const auto words = static_cast<std::size_t>((f_out + 31) / 32);
      std::vector<std::uint32_t> mask(300 * words, 0xDEADBEEFu);
      const bool with_ax = plan.fused(f_in, f_out, dtype::f32);  // ax: the fused order's
      plan.forward({.x = x.view(),
                    .w = w.view(),
                    .bias = b.view(),
                    .out = out.view(),
                    .relu = relu,
                    .relu_mask = mask.data(),
                    .ax = with_ax ? ax.view() : tensor_view{}});
      const std::vector<std::uint32_t> mask_want =
          reference::gcn_fused(p, x.view(), w.view(), b.view(), true, want.view());
      reference::spmm(p, {}, x.view(), ax_want.view());
      if (!relu) reference::gcn_fused(p, x.view(), w.view(), b.view(), false, want.view());
      EXPECT_LE(test::compare(out, want).relative(), 1e-5);
      if (with_ax) {
        EXPECT_LE(test::compare(ax, ax_want).relative(), 1e-5);
      }
      std::size_t differ = 0;  // bits of values within rounding of 0 may differ
      for (std::size_t i = 0; i < mask.size(); ++i) differ += std::popcount(mask[i] ^ mask_want[i]);
      EXPECT_LE(differ, 2u);

      host_tensor up(dtype::f32, 300, 1, f_out), dx(dtype::f32, 300, 1, f_in),
          dw(dtype::f32, f_in, 1, f_out), db(dtype::f32, 1, 1, f_out),
          dx_ref(dtype::f64, 300, 1, f_in), dw_ref(dtype::f64, f_in, 1, f_out),
          db_ref(dtype::f64, 1, 1, f_out);
      up.fill_uniform(-1, 1, seed++);
      const auto backward = [&] {
        plan.backward({.dout = up.view(),
                       .relu_mask = relu ? mask.data() : nullptr,
                       .x = x.view(),
                       .w = w.view(),
                       .dx = dx.view(),
                       .dw = dw.view(),
                       .dbias = db.view()});
      };
      backward();
      reference::gcn_fused_backward(
          p, x.view(), w.view(),
          relu ? std::span<const std::uint32_t>(mask) : std::span<const std::uint32_t>(), up.view(),
          dx_ref.view(), dw_ref.view(), db_ref.view());
      EXPECT_LE(test::compare(dx, dx_ref).relative(), 1e-5);
      EXPECT_LE(test::compare(dw, dw_ref).relative(), 1e-5);
      EXPECT_LE(test::compare(db, db_ref).relative(), 1e-5);
      expect_same_bits_on_one_thread(backward, {&dx, &dw, &db});
      const host_tensor dw_all = dw, db_all = db;
      // Without dx (x needs no gradient): the same dw and dbias.
      dw.fill_uniform(-1, 1, seed++);
      plan.backward({.dout = up.view(),
                     .relu_mask = relu ? mask.data() : nullptr,
                     .x = x.view(),
                     .w = w.view(),
                     .dw = dw.view(),
                     .dbias = db.view()});
      EXPECT_EQ(std::memcmp(dw_all.data(), dw.data(), dw.size_bytes()), 0);
      EXPECT_EQ(std::memcmp(db_all.data(), db.data(), db.size_bytes()), 0);
    }
  }
}

// f32 tensors take the GAT plan's fp32 CPU engine: forward (out, lse) and backward (dx, da_src,
// da_dst) against the float64 reference on the same f32 inputs, for several head layouts, without
// keep, with keep in entry order and with keep's rows shuffled behind keep_index, on a rectangular
// pattern with a hub row, a hub column, empty rows and columns; the same bits with one thread as
// with all; a keep_index outside keep rejected.
TEST(Layers, GatF32EngineMatchesTheReference) {
  coo_graph coo = to_coo(test::random_pattern(300, 260, 5, 71));
  for (std::int64_t j = 0; j < 260; j += 2) {  // row 7 gathers half the columns
    coo.src.push_back(7);
    coo.dst.push_back(j);
  }
  for (std::int64_t i = 1; i < 300; i += 2) {  // column 3 feeds half the rows
    coo.src.push_back(i);
    coo.dst.push_back(3);
  }
  coo.rows = 310;  // ten empty rows at the end
  const csr_graph g = to_csr(coo);
  const std::int64_t nnz = g.nnz();
  const gat_plan plan = gat_plan::build(g);
  std::vector<std::int64_t> index(static_cast<std::size_t>(nnz));
  for (std::int64_t e = 0; e < nnz; ++e) index[e] = (e * 7919) % nnz;
  ASSERT_EQ(std::gcd(std::int64_t{7919}, nnz), 1);
  std::uint64_t seed = 72;
  for (const auto& [heads, width] : {std::pair{8, 8}, std::pair{1, 16}, std::pair{3, 5}}) {
    for (const int mode : {0, 1, 2}) {  // no keep, keep in entry order, keep through the index
      SCOPED_TRACE(std::to_string(heads) + " x " + std::to_string(width) + " keep mode " +
                   std::to_string(mode));
      host_tensor x(dtype::f32, g.cols, heads, width), src(dtype::f32, g.cols, heads, 1),
          dst(dtype::f32, g.rows, heads, 1), keep(dtype::f32, nnz, heads, 1),
          shuffled(dtype::f32, nnz, heads, 1), up(dtype::f32, g.rows, heads, width);
      x.fill_uniform(-1, 1, seed++);
      src.fill_uniform(-3, 3, seed++);
      dst.fill_uniform(-3, 3, seed++);
      up.fill_uniform(-1, 1, seed++);
      keep.fill_uniform(0, 1, seed++);
      for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, keep.get(i) < 0.4 ? 0.0 : 1.25);
      for (std::int64_t e = 0; e < nnz; ++e)
        for (std::int64_t h = 0; h < heads; ++h)
          shuffled.set(index[e] * heads + h, keep.get(e * heads + h));
      const tensor_view kv = mode == 0 ? tensor_view{} : mode == 1 ? keep.view() : shuffled.view();
      const std::int64_t* ki = mode == 2 ? index.data() : nullptr;
      host_tensor out(dtype::f32, g.rows, heads, width), lse(dtype::f32, g.rows, heads, 1),
          dx(dtype::f32, g.cols, heads, width), dsrc(dtype::f32, g.cols, heads, 1),
          ddst(dtype::f32, g.rows, heads, 1);
      const auto run = [&] {
        plan.forward({.x = x.view(),
                      .a_src = src.view(),
                      .a_dst = dst.view(),
                      .keep = kv,
                      .keep_index = ki,
                      .out = out.view(),
                      .lse = lse.view()});
        plan.backward({.x = x.view(),
                       .a_src = src.view(),
                       .a_dst = dst.view(),
                       .keep = kv,
                       .keep_index = ki,
                       .out = out.view(),
                       .lse = lse.view(),
                       .dout = up.view(),
                       .dx = dx.view(),
                       .da_src = dsrc.view(),
                       .da_dst = ddst.view()});
      };
      run();
      host_tensor out_w(dtype::f64, g.rows, heads, width), lse_w(dtype::f64, g.rows, heads, 1),
          dx_w(dtype::f64, g.cols, heads, width), dsrc_w(dtype::f64, g.cols, heads, 1),
          ddst_w(dtype::f64, g.rows, heads, 1);
      const tensor_view kw = mode == 0 ? tensor_view{} : keep.view();
      reference::gat(g, x.view(), src.view(), dst.view(), kw, 0.2, out_w.view(), lse_w.view());
      reference::gat_backward(g, x.view(), src.view(), dst.view(), kw, 0.2, up.view(), dx_w.view(),
                              dsrc_w.view(), ddst_w.view());
      for (const auto& [got, want] : {std::pair{&out, &out_w}, std::pair{&dx, &dx_w},
                                      std::pair{&dsrc, &dsrc_w}, std::pair{&ddst, &ddst_w}})
        EXPECT_LE(test::compare(*got, *want).relative(), 2e-5);
      for (std::int64_t i = 0; i < lse.numel(); ++i) {
        if (std::isinf(lse_w.get(i))) {
          EXPECT_TRUE(std::isinf(lse.get(i)) && lse.get(i) < 0) << i;
        } else {
          EXPECT_NEAR(lse.get(i), lse_w.get(i), 1e-5 * (1 + std::abs(lse_w.get(i)))) << i;
        }
      }
      expect_same_bits_on_one_thread(run, {&out, &lse, &dx, &dsrc, &ddst});
    }
  }
  host_tensor x(dtype::f32, g.cols, 2, 4), src(dtype::f32, g.cols, 2, 1),
      dst(dtype::f32, g.rows, 2, 1), keep(dtype::f32, nnz, 2, 1), out(dtype::f32, g.rows, 2, 4);
  std::vector<std::int64_t> bad = index;
  bad[5] = nnz;
  EXPECT_THROW(plan.forward({.x = x.view(),
                             .a_src = src.view(),
                             .a_dst = dst.view(),
                             .keep = keep.view(),
                             .keep_index = bad.data(),
                             .out = out.view()}),
               invalid_input);
}

TEST(Layers, RejectWrongShapesAndDevices) {
  const csr_graph g = test::random_pattern(20, 20, 3, 7);
  const gcn_layer gcn = gcn_layer::build(g);
  const agnn_layer agnn = agnn_layer::build(g);
  host_tensor x(dtype::f32, 20, 1, 4), w(dtype::f32, 4, 1, 3), out(dtype::f32, 20, 1, 3),
      wrong_w(dtype::f32, 5, 1, 3), two_heads(dtype::f32, 20, 2, 4);
  EXPECT_NO_THROW(gcn.forward(x.view(), w.view(), out.view()));
  EXPECT_THROW(gcn.forward(x.view(), wrong_w.view(), out.view()), invalid_input);
  EXPECT_THROW(gcn.forward(two_heads.view(), w.view(), out.view()), invalid_input);
  EXPECT_THROW(agnn.forward(x.view(), 1.0, out.view()), invalid_input);  // out dim 3 != 4
  EXPECT_THROW(agnn.forward(x.view(), NAN, x.view()), invalid_input);
  tensor_view on_gpu = x.view();
  on_gpu.where = device_kind::cuda;
  EXPECT_THROW(agnn.forward(on_gpu, 1.0, x.view()), invalid_input);
  EXPECT_THROW(gcn_layer::build(test::random_pattern(3, 4, 2, 1)), invalid_input);
  EXPECT_THROW(agnn_layer::build(test::random_pattern(3, 4, 2, 1)), invalid_input);
}

// The multigraph plan's view rules, checked at build before any array is read (the arrays below
// are never dereferenced): `edge` may be null (positions are the input's edge ids); col_ptr, dst
// and by_source come together, or all null for a forward-only plan (3.2 B entries read in place).
TEST(EdgeAttentionPlan, ForwardOnlyViewsAndTheirRules) {
  const std::int64_t row_ptr[3] = {0, 1, 2}, col_ptr[3] = {0, 1, 2}, by_source[2] = {0, 1};
  const std::int32_t src[2] = {0, 1}, dst[2] = {0, 1};
  multigraph_view g{.rows = 2, .cols = 2, .edges = 2, .row_ptr = row_ptr, .src = src};
  EXPECT_NO_THROW((void)edge_attention_plan::build(g));  // forward only, no edge ids
  g.edges = std::int64_t{3} << 31;                       // entry counts past 2^31
  EXPECT_NO_THROW((void)edge_attention_plan::build(g));
  g.edges = 2;
  g.col_ptr = col_ptr;  // a by-source side without dst and by_source
  try {
    (void)edge_attention_plan::build(g);
    ADD_FAILURE() << "a partial by-source side was accepted";
  } catch (const invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("come together"), std::string::npos) << e.what();
  }
  g.dst = dst;
  g.by_source = by_source;
  EXPECT_NO_THROW((void)edge_attention_plan::build(g));
  g.col_ptr = nullptr;  // dst and by_source without col_ptr
  EXPECT_THROW((void)edge_attention_plan::build(g), invalid_input);
  g = {.rows = 2, .cols = 2, .edges = 2, .row_ptr = row_ptr};  // no src
  EXPECT_THROW((void)edge_attention_plan::build(g), invalid_input);
}

// The per-head products' argument rules: float32 only, the weight's shape from x's, an output
// apart from the inputs; each refusal names what is wrong.
TEST(HeadProduct, RefusesWhatItDoesNotTake) {
  host_tensor x(dtype::f32, 5, 2, 3), w(dtype::f32, 2, 3, 4), out(dtype::f32, 5, 2, 4),
      g(dtype::f32, 5, 2, 4), dw(dtype::f32, 2, 3, 4), x64(dtype::f64, 5, 2, 3);
  x.fill(1.0);
  w.fill(2.0);
  g.fill(1.0);
  const auto refuses = [](const std::function<void()>& f, const char* says) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected a refusal saying '" << says << "'";
    } catch (const invalid_input& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  head_product(x.view(), w.view(), out.view());
  EXPECT_EQ(out.get(0), 6.0);  // 1 x 2 over a = 3
  head_outer(x.view(), g.view(), dw.view());
  EXPECT_EQ(dw.get(0), 5.0);  // 5 rows of 1 x 1
  refuses([&] { head_product(x64.view(), w.view(), out.view()); }, "float32");
  host_tensor w_short(dtype::f32, 2, 2, 4);
  refuses([&] { head_product(x.view(), w_short.view(), out.view()); }, "head_product: w");
  refuses([&] { head_product(x.view(), w.view(), x.view()); }, "head_product: out");
  tensor_view into_w = w.view();  // [2, 3, 4] as a [5, 2, 4] view over w's 24 floats: overlaps w
  into_w.rows = 3;
  into_w.heads = 2;
  into_w.dim = 4;
  into_w.row_stride = 8;
  into_w.head_stride = 4;
  host_tensor x3(dtype::f32, 3, 2, 3);
  refuses([&] { head_product(x3.view(), w.view(), into_w); }, "overlaps an input");
  host_tensor g_short(dtype::f32, 4, 2, 4);
  refuses([&] { head_outer(x.view(), g_short.view(), dw.view()); }, "head_outer: g");
  EXPECT_EQ(head_outer_workspace_bytes(0, 2, 3, 4), 0U);
  EXPECT_EQ(head_outer_workspace_bytes(kHeadOuterChunkRows + 1, 2, 3, 4), 2U * 2 * 3 * 4 * 4);
}

}  // namespace
}  // namespace trisparse
