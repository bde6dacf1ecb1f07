// The fused GAT attention on CUDA against the float64 reference: forward (out, lse) and backward
// (dx, da_src, da_dst) for every dtype, head layouts from 1 x 1 to 1 x 512, keep factors (attention
// dropout), and adversarial patterns (empty rows and columns, a row and a column holding every
// entry); each result twice bitwise equal. Label gpu; skipped without a device.
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "device_tensor.hpp"

namespace trisparse {
namespace {

struct gat_case {
  dtype in = dtype::f16, out = dtype::f32;
  std::int64_t heads = 8, width = 8;
  bool keep = false;
  bool keep_index = false;  // keep's rows in a shuffled order, with keep_index
  double slope = 0.2;
};

void check_gat(const csr_graph& g, const gat_case& c, std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(c.in)) + "->" + std::string(to_string(c.out)) + " " +
               std::to_string(c.heads) + "x" + std::to_string(c.width) + (c.keep ? " keep" : "") +
               (c.keep_index ? " index" : "") + " rows " + std::to_string(g.rows) + " cols " +
               std::to_string(g.cols) + " nnz " + std::to_string(g.nnz()));
  const std::int64_t H = c.heads, C = c.width;
  host_tensor x(c.in, g.cols, H, C), src(dtype::f32, g.cols, H, 1), dst(dtype::f32, g.rows, H, 1),
      keep(dtype::f32, std::max<std::int64_t>(g.nnz(), 1), H, 1), up(c.out, g.rows, H, C);
  x.fill_uniform(-1, 1, seed);
  src.fill_uniform(-3, 3, seed + 1);
  dst.fill_uniform(-3, 3, seed + 2);
  up.fill_uniform(-1, 1, seed + 3);
  rng r(seed + 4);
  for (std::int64_t i = 0; i < keep.numel(); ++i) keep.set(i, r.below(5) == 0 ? 0.0 : 1.25);
  tensor_view kv = c.keep ? keep.view() : tensor_view{};
  if (c.keep) kv.rows = g.nnz();
  host_tensor out_want(dtype::f64, g.rows, H, C), lse_want(dtype::f64, g.rows, H, 1),
      dx_want(dtype::f64, g.cols, H, C), dsrc_want(dtype::f64, g.cols, H, 1),
      ddst_want(dtype::f64, g.rows, H, 1);
  reference::gat(g, x.view(), src.view(), dst.view(), kv, c.slope, out_want.view(),
                 lse_want.view());
  reference::gat_backward(g, x.view(), src.view(), dst.view(), kv, c.slope, up.view(),
                          dx_want.view(), dsrc_want.view(), ddst_want.view());

  // keep's rows shuffled: entry e's factors in row index[e] (int64, uploaded as 8-byte words).
  const std::int64_t rows_k = keep.rows();
  std::vector<std::int64_t> index(static_cast<std::size_t>(rows_k));
  for (std::int64_t e = 0; e < rows_k; ++e)
    index[e] = std::gcd(std::int64_t{7919}, rows_k) == 1 ? (e * 7919) % rows_k : rows_k - 1 - e;
  host_tensor shuffled(dtype::f32, rows_k, H, 1), index_words(dtype::f64, rows_k, 1, 1);
  for (std::int64_t e = 0; e < rows_k; ++e)
    for (std::int64_t h = 0; h < H; ++h) shuffled.set(index[e] * H + h, keep.get(e * H + h));
  std::memcpy(index_words.data(), index.data(), index.size() * 8);
  test::device_tensor gindex(index_words);
  const gat_plan plan = gat_plan::build(g, device_kind::cuda);
  test::device_tensor gx(x), gsrc(src), gdst(dst), gkeep(c.keep_index ? shuffled : keep),
      out(host_tensor(c.out, g.rows, H, C)), lse(host_tensor(dtype::f32, g.rows, H, 1)),
      fws(host_tensor(dtype::f32,
                      static_cast<std::int64_t>(plan.forward_workspace_bytes(H, C) / 4 + 64), 1,
                      1));
  const tensor_view fwsv = fws.view();
  tensor_view gkv = c.keep ? gkeep.view() : tensor_view{};
  if (c.keep) gkv.rows = g.nnz();
  const auto* keep_index =
      c.keep_index ? static_cast<const std::int64_t*>(gindex.view().data) : nullptr;
  const gat_args args{.x = gx.view(),
                      .a_src = gsrc.view(),
                      .a_dst = gdst.view(),
                      .keep = gkv,
                      .keep_index = keep_index,
                      .out = out.view(),
                      .lse = lse.view(),
                      .negative_slope = c.slope};
  host_tensor got;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      out,
      [&] {
        lse.poison();
        fws.poison();
        plan.forward(args, {}, {fwsv.data, static_cast<std::size_t>(fwsv.rows) * 4});
      },
      got));
  const double tol = test::gpu_tolerance(c.in, c.out, 8);
  const auto e = test::compare(got, out_want);
  EXPECT_TRUE(e.finite) << "unwritten or non-finite output";
  EXPECT_LE(e.relative(), tol) << "out: max abs " << e.max_abs;
  const host_tensor lse_got = lse.download();
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < lse_got.numel(); ++i) {
    const double a = lse_got.get(i), b = lse_want.get(i);
    if (std::isinf(b) ? a != b : !(std::abs(a - b) <= 1e-5 * (1 + std::abs(b)))) ++wrong;
  }
  EXPECT_EQ(wrong, 0) << "lse differs from the reference";

  test::device_tensor dout(up), dx(host_tensor(c.out, g.cols, H, C)),
      dsrc(host_tensor(dtype::f32, g.cols, H, 1)), ddst(host_tensor(dtype::f32, g.rows, H, 1)),
      ws(host_tensor(dtype::f32,
                     static_cast<std::int64_t>(plan.backward_workspace_bytes(H, C) / 4 + 64), 1,
                     1));
  const tensor_view wsv = ws.view();
  const gat_grad_args grad{.x = gx.view(),
                           .a_src = gsrc.view(),
                           .a_dst = gdst.view(),
                           .keep = gkv,
                           .keep_index = keep_index,
                           .out = out.view(),
                           .lse = lse.view(),
                           .dout = dout.view(),
                           .dx = dx.view(),
                           .da_src = dsrc.view(),
                           .da_dst = ddst.view(),
                           .negative_slope = c.slope};
  host_tensor got_dx;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      dx,
      [&] {
        dsrc.poison();
        ddst.poison();
        ws.poison();
        plan.backward(grad, {}, {wsv.data, static_cast<std::size_t>(wsv.rows) * 4});
      },
      got_dx));
  // out (rounded to its dtype) enters the backward through D = <dout, out>.
  const double gtol = 2 * tol + 4 * unit_roundoff(c.out);
  for (const auto& [got_g, want_g, what] :
       {std::tuple{got_dx, &dx_want, "dx"}, std::tuple{dsrc.download(), &dsrc_want, "da_src"},
        std::tuple{ddst.download(), &ddst_want, "da_dst"}}) {
    const auto eg = test::compare(got_g, *want_g);
    EXPECT_TRUE(eg.finite) << what << ": unwritten or non-finite";
    EXPECT_LE(eg.relative(), gtol) << what << ": max abs " << eg.max_abs;
  }
}

// Every head layout the kernels split differently, one dtype pair each in turn (every pair:
// tests/generic).
TEST(GpuGat, EveryHeadLayout) {
  SKIP_WITHOUT_GPU();
  // Rectangular, with empty rows (degree 0 is drawn) and unused columns.
  const csr_graph g = test::random_pattern(3000, 2500, 20, 61);
  const std::vector<std::pair<dtype, dtype>> pairs{{dtype::f16, dtype::f32},
                                                   {dtype::f16, dtype::f16},
                                                   {dtype::bf16, dtype::bf16},
                                                   {dtype::f32, dtype::f32}};
  std::uint64_t seed = 100;
  for (const auto& [heads, width] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {8, 8}, {1, 64}, {4, 16}, {3, 5}, {2, 100}, {1, 512}, {16, 1}, {6, 24}, {1, 3}}) {
    const auto [in, out] = pairs[seed % pairs.size()];
    check_gat(g,
              {.in = in, .out = out, .heads = heads, .width = width, .keep = (seed / 4) % 2 == 0},
              seed);
    ++seed;
  }
  check_gat(g, {.in = dtype::f32, .heads = 2, .width = 32, .keep = true, .slope = 0.01}, 7);
  check_gat(g, {.heads = 8, .width = 8, .keep = true, .keep_index = true}, 9);
  check_gat(g, {.heads = 40, .width = 2, .slope = 0.5}, 8);  // many head groups
}

TEST(GpuGat, HubsEmptyPatternsAndTinyGraphs) {
  SKIP_WITHOUT_GPU();
  // Row 5 holds every column and column 7 is in every row: both are cut into chunks (forward and
  // backward), merged in order.
  coo_graph coo;
  const std::int64_t n = 20000;
  coo.rows = coo.cols = n;
  rng r(62);
  for (std::int64_t i = 0; i < n; ++i) {
    if (i == 5) {
      for (std::int64_t j = 0; j < n; ++j) coo.src.push_back(i), coo.dst.push_back(j);
      continue;
    }
    coo.src.push_back(i), coo.dst.push_back(7);
    for (std::uint64_t k = r.below(4); k > 0; --k)
      coo.src.push_back(i), coo.dst.push_back(static_cast<std::int64_t>(r.below(n)));
  }
  const csr_graph hub = to_csr(coo);
  check_gat(hub, {.in = dtype::f16, .heads = 8, .width = 8, .keep = true, .keep_index = true}, 63);
  check_gat(hub, {.in = dtype::f32, .out = dtype::f32, .heads = 1, .width = 128}, 64);
  for (const std::int64_t rows : {1, 2, 33}) {
    check_gat(test::random_pattern(rows, rows, 3, 65), {}, 66);
    check_gat(test::random_pattern(rows, 7, 3, 67), {.in = dtype::bf16, .out = dtype::bf16}, 68);
  }
  check_gat(test::random_pattern(50, 40, 0, 69), {}, 70);  // no entries at all
}

TEST(GpuGat, RejectsWhatItCannotRun) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(100, 80, 5, 71);
  const gat_plan plan = gat_plan::build(g, device_kind::cuda);
  test::device_tensor x(host_tensor(dtype::f16, 80, 2, 8)),
      wide(host_tensor(dtype::f16, 80, 1, 513)), src(host_tensor(dtype::f32, 80, 2, 1)),
      src16(host_tensor(dtype::f16, 80, 2, 1)), dst(host_tensor(dtype::f32, 100, 2, 1)),
      out(host_tensor(dtype::f32, 100, 2, 8)), out_wide(host_tensor(dtype::f32, 100, 1, 513)),
      src1(host_tensor(dtype::f32, 80, 1, 1)), dst1(host_tensor(dtype::f32, 100, 1, 1));
  EXPECT_NO_THROW(
      plan.forward({.x = x.view(), .a_src = src.view(), .a_dst = dst.view(), .out = out.view()}));
  EXPECT_THROW(
      plan.forward({.x = x.view(), .a_src = src16.view(), .a_dst = dst.view(), .out = out.view()}),
      invalid_input);  // the scores' terms are f32
  EXPECT_THROW(
      plan.forward(
          {.x = wide.view(), .a_src = src1.view(), .a_dst = dst1.view(), .out = out_wide.view()}),
      invalid_input);  // wider than 512
  EXPECT_THROW(
      plan.forward({.x = x.view(), .a_src = dst.view(), .a_dst = dst.view(), .out = out.view()}),
      invalid_input);  // a_src has the rows' count
  host_tensor host_x(dtype::f16, 80, 2, 8);
  EXPECT_THROW(
      plan.forward(
          {.x = host_x.view(), .a_src = src.view(), .a_dst = dst.view(), .out = out.view()}),
      invalid_input);  // on the CPU
  device_synchronize();
}

TEST(GpuGat, SharedDatasets) {
  SKIP_WITHOUT_GPU();
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  for (const auto& path : test::dataset_graphs()) {
    const std::string name = path.filename().string();
    if (name.find("cora") == std::string::npos && name.find("github") == std::string::npos)
      continue;
    SCOPED_TRACE(name);
    const csr_graph g = read_graph(path);
    check_gat(g, {.heads = 8, .width = 8, .keep = true}, 72);
    check_gat(g, {.in = dtype::bf16, .out = dtype::bf16, .heads = 1, .width = 64}, 73);
  }
}

}  // namespace
}  // namespace trisparse
