// GCN and AGNN layers on CUDA (cuBLAS + ME-BCRS kernels) against the float64 CPU layers (label
// gpu; skipped without a device).
#include "device_tensor.hpp"

namespace trisparse {
namespace {

double tolerance(dtype in, dtype out) { return test::gpu_tolerance(in, out, 8); }

// The layer run twice on the GPU (poisoned output): bitwise equal, finite, near the CPU layer.
template <class Run>
void check_runs(const host_tensor& want, dtype in, dtype out_type, Run&& run) {
  test::device_tensor out(host_tensor(out_type, want.rows(), 1, want.dim()));
  host_tensor first;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      out, [&] { run(out.view()); }, first));
  for (std::int64_t i = 0; i < first.numel(); ++i)
    ASSERT_TRUE(std::isfinite(first.get(i))) << "unwritten or non-finite output at " << i;
  const auto e = test::compare(first, want);
  EXPECT_LE(e.relative(), tolerance(in, out_type)) << "max abs " << e.max_abs;
}

void check_gcn(const csr_graph& g, dtype in, dtype out, std::int64_t fi, std::int64_t fo,
               std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(in)) + "->" + std::string(to_string(out)) + " " +
               std::to_string(fi) + "->" + std::to_string(fo) + " nnz " + std::to_string(g.nnz()));
  host_tensor x(in, g.rows, 1, fi), w(in, fi, 1, fo), want(dtype::f64, g.rows, 1, fo);
  x.fill_uniform(-1, 1, seed);
  w.fill_uniform(-0.5, 0.5, seed + 1);
  gcn_layer::build(g).forward(x.view(), w.view(), want.view());
  const gcn_layer layer = gcn_layer::build(g, device_kind::cuda);
  test::device_tensor dx(x), dw(w);
  check_runs(want, in, out, [&](const tensor_view& o) { layer.forward(dx.view(), dw.view(), o); });
}

void check_agnn(const csr_graph& g, dtype in, dtype out, std::int64_t f, double beta,
                std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(in)) + "->" + std::string(to_string(out)) + " f" +
               std::to_string(f) + " nnz " + std::to_string(g.nnz()));
  host_tensor h(in, g.rows, 1, f), want(dtype::f64, g.rows, 1, f);
  h.fill_uniform(-1, 1, seed);
  for (std::int64_t k = 0; k < f && g.rows > 3; ++k) h.set(3 * f + k, 0.0);  // a zero row
  agnn_layer::build(g).forward(h.view(), beta, want.view());
  const agnn_layer layer = agnn_layer::build(g, device_kind::cuda);
  test::device_tensor dh(h);
  check_runs(want, in, out, [&](const tensor_view& o) { layer.forward(dh.view(), beta, o); });
}

// Both product orders and odd widths, one dtype pair each (every pair: tests/generic).
TEST(GpuLayers, GcnBothProductOrdersAndOddWidths) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(2000, 2000, 30, 3);
  check_gcn(g, dtype::f16, dtype::f32, 128, 64, 1);   // x w first
  check_gcn(g, dtype::bf16, dtype::bf16, 32, 96, 2);  // Â x first
  check_gcn(g, dtype::f32, dtype::f32, 5, 3, 3);      // odd widths
}

TEST(GpuLayers, AgnnWidthsAndSigns) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(1500, 1500, 40, 4);
  check_agnn(g, dtype::f16, dtype::f32, 64, 1.0, 5);
  check_agnn(g, dtype::bf16, dtype::bf16, 100, -3.0, 6);
  check_agnn(g, dtype::f32, dtype::f32, 33, 0.5, 7);
}

// The fused GCN layer on the GPU against the float64 CPU plan: out (twice, poisoned, bitwise
// equal, in a workspace poisoned too), the ReLU mask (wherever the output is not within rounding of
// 0) and, in the fused order, the saved P x.
struct fused_case {
  dtype in = dtype::f16, out = dtype::f32, bias = dtype::f32;
  std::int64_t f_in = 32, f_out = 96;
  gcn_order order = gcn_order::automatic;
  bool relu = true, with_bias = true;
};

void check_fused_gcn(const csr_graph& p, const fused_case& c, std::uint64_t seed) {
  const gcn_fused_plan gpu = gcn_fused_plan::build(p, device_kind::cuda);
  const bool fused = gpu.fused(c.f_in, c.f_out, c.in, c.order);
  SCOPED_TRACE(std::string(to_string(c.in)) + "->" + std::string(to_string(c.out)) + " " +
               std::to_string(c.f_in) + "->" + std::to_string(c.f_out) +
               (fused ? " fused" : " unfused") + (c.relu ? " relu" : "") +
               (c.with_bias ? " bias " + std::string(to_string(c.bias)) : "") + " rows " +
               std::to_string(p.rows) + " nnz " + std::to_string(p.nnz()));
  host_tensor x(c.in, p.rows, 1, c.f_in), w(c.in, c.f_in, 1, c.f_out), b(c.bias, 1, 1, c.f_out);
  x.fill_uniform(-1, 1, seed);
  w.fill_uniform(-0.5, 0.5, seed + 1);
  b.fill_uniform(-0.5, 0.5, seed + 2);
  const std::int64_t words = (c.f_out + 31) / 32;
  host_tensor want(dtype::f64, p.rows, 1, c.f_out), ax_want(dtype::f64, p.rows, 1, c.f_in);
  std::vector<std::uint32_t> mask_want(static_cast<std::size_t>(p.rows * words));
  gcn_fused_args ref{.x = x.view(),
                     .w = w.view(),
                     .out = want.view(),
                     .relu = c.relu,
                     .relu_mask = mask_want.data(),
                     .order = c.order};
  if (c.with_bias) ref.bias = b.view();
  if (fused) ref.ax = ax_want.view();
  gcn_fused_plan::build(p).forward(ref);

  test::device_tensor dx(x), dw(w), db(b), out(host_tensor(c.out, p.rows, 1, c.f_out)),
      ax(host_tensor(c.in, p.rows, 1, c.f_in)),
      mask(host_tensor(dtype::f32, std::max<std::int64_t>(p.rows * words, 1), 1, 1)),
      ws(host_tensor(
          dtype::f32,
          static_cast<std::int64_t>(gpu.workspace_bytes(c.f_in, c.f_out, c.in, c.order) / 4 + 64),
          1, 1));
  const tensor_view wsv = ws.view();
  gcn_fused_args args{.x = dx.view(),
                      .w = dw.view(),
                      .out = out.view(),
                      .relu = c.relu,
                      .relu_mask = static_cast<std::uint32_t*>(mask.view().data),
                      .order = c.order};
  if (c.with_bias) args.bias = db.view();
  if (fused) args.ax = ax.view();
  host_tensor got;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      out,
      [&] {
        mask.poison();
        ax.poison();
        ws.poison();
        args.out = out.view();
        gpu.forward(args, {}, {wsv.data, static_cast<std::size_t>(wsv.rows) * 4});
      },
      got));
  for (std::int64_t i = 0; i < got.numel(); ++i)
    ASSERT_TRUE(std::isfinite(got.get(i))) << "unwritten or non-finite output at " << i;
  const auto e = test::compare(got, want);
  const double tol = tolerance(c.in, c.out);
  EXPECT_LE(e.relative(), tol) << "max abs " << e.max_abs;
  const host_tensor m = mask.download();
  const auto* bits = reinterpret_cast<const std::uint32_t*>(m.data());
  std::int64_t wrong = 0;
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t f = 0; f < c.f_out; ++f) {
      const std::size_t word = static_cast<std::size_t>(r * words + f / 32);
      const bool a = (bits[word] >> (f % 32)) & 1u, b_ = (mask_want[word] >> (f % 32)) & 1u;
      // Bits of outputs within rounding of 0 may differ; the pre-ReLU value is not kept, so
      // judge by the reference output where it is positive, else by the mask itself.
      if (a != b_ && std::abs(want.get(r * c.f_out + f)) > 2 * tol * e.max_ref) ++wrong;
    }
    for (std::int64_t f = c.f_out; f < words * 32; ++f)
      ASSERT_EQ((bits[static_cast<std::size_t>(r * words + f / 32)] >> (f % 32)) & 1u, 0u);
  }
  EXPECT_EQ(wrong, 0) << "ReLU mask bits differ from the reference";
  if (fused) {
    const auto ea = test::compare(ax.download(), ax_want);
    EXPECT_TRUE(ea.finite);
    EXPECT_LE(ea.relative(), tolerance(c.in, c.in)) << "P x: max abs " << ea.max_abs;
  }

  // The backward against the float64 plan's, both given the GPU's mask (outputs within rounding
  // of 0 may fall either way; a flipped one moves the gradients by a whole dout value).
  host_tensor up(c.out, p.rows, 1, c.f_out), dx_want(dtype::f64, p.rows, 1, c.f_in),
      dw_want(dtype::f64, c.f_in, 1, c.f_out), db_want(dtype::f64, 1, 1, c.f_out);
  up.fill_uniform(-1, 1, seed + 3);
  std::vector<std::uint32_t> gpu_mask(bits, bits + p.rows * words);
  const std::uint32_t* mask_used = c.relu ? gpu_mask.data() : nullptr;
  gcn_fused_plan::build(p).backward({.dout = up.view(),
                                     .relu_mask = mask_used,
                                     .x = x.view(),
                                     .w = w.view(),
                                     .dx = dx_want.view(),
                                     .dw = dw_want.view(),
                                     .dbias = db_want.view()});
  test::device_tensor dup(up), gdx(host_tensor(c.out, p.rows, 1, c.f_in)),
      gdw(host_tensor(c.out, c.f_in, 1, c.f_out)), gdb(host_tensor(dtype::f32, 1, 1, c.f_out)),
      bws(host_tensor(dtype::f32,
                      static_cast<std::int64_t>(
                          gpu.backward_workspace_bytes(c.f_in, c.f_out, c.in, c.order) / 4 + 64),
                      1, 1));
  // (The device mask and P x are the last forward's.)
  const tensor_view bv = bws.view();
  const gcn_fused_grad_args g{
      .dout = dup.view(),
      .relu_mask = c.relu ? static_cast<std::uint32_t*>(mask.view().data) : nullptr,
      .x = dx.view(),
      .w = dw.view(),
      .ax = ax.view(),
      .dx = gdx.view(),
      .dw = gdw.view(),
      .dbias = gdb.view(),
      .order = c.order};
  host_tensor got_dx, got_dw, got_db;
  const auto backward = [&] {
    gdw.poison();
    gdb.poison();
    bws.poison();
    gpu.backward(g, {}, {bv.data, static_cast<std::size_t>(bv.rows) * 4});
  };
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(gdx, backward, got_dx));
  got_dw = gdw.download();
  got_db = gdb.download();
  const double gtol = 2 * tolerance(c.in, c.out);
  for (const auto& [got_g, want_g, what] :
       {std::tuple{&got_dx, &dx_want, "dx"}, std::tuple{&got_dw, &dw_want, "dw"},
        std::tuple{&got_db, &db_want, "dbias"}}) {
    const auto eg = test::compare(*got_g, *want_g);
    EXPECT_TRUE(eg.finite) << what;
    EXPECT_LE(eg.relative(), gtol) << what << ": max abs " << eg.max_abs;
  }
  // Without dx (x needs no gradient): dw and dbias the same bits, dx left untouched.
  gdx.poison();
  const host_tensor poisoned = gdx.download();
  gcn_fused_grad_args no_dx = g;
  no_dx.dx = {};
  gdw.poison();
  gdb.poison();
  gpu.backward(no_dx, {}, {bv.data, static_cast<std::size_t>(bv.rows) * 4});
  for (const auto& [now, before] :
       {std::pair{gdw.download(), got_dw}, std::pair{gdb.download(), got_db},
        std::pair{gdx.download(), poisoned}})
    EXPECT_EQ(std::memcmp(now.data(), before.data(), now.size_bytes()), 0) << "without dx";
}

// Each order at two width pairs, and odd widths in the fused order, one dtype pair each in turn
// (every pair x order: tests/generic).
TEST(GpuFusedGcn, EveryOrderAndOddWidths) {
  SKIP_WITHOUT_GPU();
  const csr_graph p = gcn_normalized(test::random_pattern(2000, 2000, 30, 11));
  const std::vector<std::pair<dtype, dtype>> pairs{{dtype::f16, dtype::f32},
                                                   {dtype::bf16, dtype::bf16},
                                                   {dtype::f32, dtype::f32},
                                                   {dtype::f16, dtype::f16}};
  std::size_t nth = 0;
  for (const gcn_order order : {gcn_order::automatic, gcn_order::fused, gcn_order::unfused}) {
    const auto [in, out] = pairs[nth++ % pairs.size()];
    check_fused_gcn(p, {.in = in, .out = out, .bias = in, .order = order}, 1);
    const auto [in2, out2] = pairs[nth++ % pairs.size()];
    check_fused_gcn(p, {.in = in2, .out = out2, .f_in = 128, .f_out = 64, .order = order}, 2);
  }
  for (const auto& [fi, fo] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {5, 3}, {33, 70}, {100, 17}, {1, 1}, {16, 300}}) {
    const dtype t = nth++ % 2 ? dtype::f16 : dtype::f32;
    check_fused_gcn(p, {.in = t, .out = t, .f_in = fi, .f_out = fo, .order = gcn_order::fused}, 3);
  }
  check_fused_gcn(p, {.relu = false}, 4);
  check_fused_gcn(p, {.order = gcn_order::unfused, .relu = false, .with_bias = false}, 5);
  check_fused_gcn(p, {.order = gcn_order::fused, .with_bias = false}, 6);
}

TEST(GpuFusedGcn, SkewedWindowsWideFeaturesAndTinyGraphs) {
  SKIP_WITHOUT_GPU();
  // Row 5 holds every column (its window is cut into chunks); column 7 is in every row.
  coo_graph coo;
  const std::int64_t n = 30000;
  coo.rows = coo.cols = n;
  rng r(12);
  for (std::int64_t i = 0; i < n; ++i) {
    if (i == 5) {
      for (std::int64_t j = 0; j < n; ++j) coo.src.push_back(i), coo.dst.push_back(j);
      continue;
    }
    coo.src.push_back(i), coo.dst.push_back(7);
    for (std::uint64_t k = r.below(6); k > 0; --k)
      coo.src.push_back(i), coo.dst.push_back(static_cast<std::int64_t>(r.below(n)));
  }
  const csr_graph hub = gcn_normalized(to_csr(coo));
  for (const dtype t : {dtype::f16, dtype::bf16, dtype::f32})
    check_fused_gcn(
        hub, {.in = t, .out = dtype::f32, .f_in = 40, .f_out = 64, .order = gcn_order::fused}, 13);
  // Cora's width: 16 rows of P x take 47 KB of shared memory (f16) and 92 KB (f32).
  const csr_graph p = gcn_normalized(test::random_pattern(700, 700, 12, 14));
  check_fused_gcn(p, {.in = dtype::f16, .f_in = 1433, .f_out = 16, .order = gcn_order::fused}, 15);
  check_fused_gcn(p, {.in = dtype::f32, .f_in = 1433, .f_out = 16, .order = gcn_order::fused}, 16);
  for (const std::int64_t rows : {1, 17, 65537}) {
    const csr_graph tiny = gcn_normalized(test::random_pattern(rows, rows, 3, 17));
    check_fused_gcn(tiny, {.order = gcn_order::fused}, 18);
    check_fused_gcn(tiny, {.in = dtype::bf16, .f_in = 64, .f_out = 48}, 19);
  }
}

TEST(GpuFusedGcn, RejectsWhatItCannotRun) {
  SKIP_WITHOUT_GPU();
  const csr_graph p = gcn_normalized(test::random_pattern(100, 100, 5, 22));
  const gcn_fused_plan plan = gcn_fused_plan::build(p, device_kind::cuda);
  EXPECT_FALSE(plan.fused(8000, 16, dtype::f32, gcn_order::fused));  // shared memory
  EXPECT_TRUE(plan.fused(8, 16, dtype::f16));
  EXPECT_FALSE(plan.fused(100, 16, dtype::f16));
  test::device_tensor x(host_tensor(dtype::f16, 100, 1, 8)), w(host_tensor(dtype::f32, 8, 1, 4)),
      w16(host_tensor(dtype::f16, 8, 1, 4)), out(host_tensor(dtype::f32, 100, 1, 4)),
      ax(host_tensor(dtype::f16, 100, 1, 8));
  EXPECT_THROW(plan.forward({.x = x.view(), .w = w.view(), .out = out.view()}), invalid_input);
  EXPECT_THROW(plan.forward({.x = x.view(),
                             .w = w16.view(),
                             .out = out.view(),
                             .ax = ax.view(),
                             .order = gcn_order::unfused}),
               invalid_input);  // P x is the fused order's
  csr_graph no_values = test::random_pattern(10, 10, 3, 23);
  EXPECT_THROW((void)gcn_fused_plan::build(no_values, device_kind::cuda), invalid_input);
}

TEST(GpuLayers, SharedDatasets) {
  SKIP_WITHOUT_GPU();
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  for (const auto& path : test::dataset_graphs()) {
    const std::string name = path.filename().string();
    if (name.find("cora") == std::string::npos && name.find("pubmed") == std::string::npos &&
        name.find("github") == std::string::npos)
      continue;
    SCOPED_TRACE(name);
    const csr_graph g = read_graph(path);
    check_gcn(g, dtype::f16, dtype::f32, 64, 16, 7);
    check_agnn(g, dtype::f16, dtype::f32, 32, 1.0, 8);
    const csr_graph p = gcn_normalized(g);  // the fused GCN layer, both orders
    check_fused_gcn(p, {.f_in = 64, .f_out = 128, .order = gcn_order::fused}, 20);
    check_fused_gcn(p, {.in = dtype::bf16, .f_in = 128, .f_out = 16}, 21);
  }
}

TEST(GpuLayers, RejectWhatTheyCannotRun) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(100, 100, 5, 9);
  const gcn_layer gcn = gcn_layer::build(g, device_kind::cuda);
  test::device_tensor x(host_tensor(dtype::f16, 100, 1, 8)), w(host_tensor(dtype::f32, 8, 1, 4)),
      out(host_tensor(dtype::f32, 100, 1, 4)), out_bf(host_tensor(dtype::bf16, 100, 1, 8));
  EXPECT_THROW(gcn.forward(x.view(), w.view(), out.view()), invalid_input);  // mixed dtypes
  const agnn_layer agnn = agnn_layer::build(g, device_kind::cuda);
  EXPECT_THROW(agnn.forward(x.view(), 1.0, out_bf.view()), invalid_input);  // bf16 from f16
  host_tensor h(dtype::f16, 100, 1, 8), o(dtype::f32, 100, 1, 8);
  EXPECT_THROW(agnn.forward(h.view(), 1.0, o.view()), invalid_input);  // host tensors
}

}  // namespace
}  // namespace trisparse
