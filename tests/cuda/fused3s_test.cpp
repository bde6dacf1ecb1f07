// The CUDA attention algorithms -- the fused 3S kernel and the unfused SDDMM -> softmax -> SpMM
// pipeline -- against the float64 reference (label gpu; skipped without a device).
#include <cstdlib>
#include <limits>

#include "device_tensor.hpp"

namespace trisparse {
namespace {

struct config {
  dtype in, out;
  std::int64_t dim, heads;
};

std::string name(const config& c) {
  return std::string(to_string(c.in)) + "->" + std::string(to_string(c.out)) + " d" +
         std::to_string(c.dim) + " h" + std::to_string(c.heads);
}

// Tolerance: P is rounded to the input type before P·V, the output to its type; a few of each.
double tolerance(const config& c) { return test::gpu_tolerance(c.in, c.out, 4); }

// Runs the kernel twice on fresh signed inputs (or the given transform of them) and checks: every
// output finite, both runs bitwise equal, sampled rows within tolerance of float64.
void check(const attention_plan& plan, const csr_graph& g, const config& c, std::uint64_t seed,
           double lo = -1.0, double hi = 1.0, std::optional<double> scale = std::nullopt,
           std::int64_t sample = 512, bool zero_q = false) {
  SCOPED_TRACE(name(c) + " n " + std::to_string(g.rows) + " nnz " + std::to_string(g.nnz()));
  auto x = test::random_qkv(g, c.heads, c.dim, c.in, seed, lo, hi);
  if (zero_q) x.q.fill(0.0);
  test::device_tensor q(x.q), k(x.k), v(x.v), out(host_tensor(c.out, g.rows, c.heads, c.dim));
  host_tensor first;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      out, [&] { plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = scale}); }, first));
  std::int64_t not_finite = 0;
#pragma omp parallel for reduction(+ : not_finite)
  for (std::int64_t i = 0; i < first.numel(); ++i) not_finite += !std::isfinite(first.get(i));
  ASSERT_EQ(not_finite, 0) << "unwritten or non-finite outputs";
  std::vector<std::int64_t> rows;
  rng r(seed);
  if (g.rows <= sample) {
    for (std::int64_t i = 0; i < g.rows; ++i) rows.push_back(i);
  } else {
    for (std::int64_t i = 0; i < sample; ++i)
      rows.push_back(static_cast<std::int64_t>(r.below(g.rows)));
    rows.push_back(g.rows - 1);  // the last, possibly partial, row window
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }
  const csr_graph sub = select_rows(g, rows);
  host_tensor qs(c.in, sub.rows, c.heads, c.dim), ref(dtype::f64, sub.rows, c.heads, c.dim),
      got(c.out, sub.rows, c.heads, c.dim);
  const std::int64_t w = c.heads * c.dim;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    for (std::int64_t e = 0; e < w; ++e) {
      qs.set(static_cast<std::int64_t>(i) * w + e, x.q.get(rows[i] * w + e));
      got.set(static_cast<std::int64_t>(i) * w + e, first.get(rows[i] * w + e));
    }
  }
  reference::attention(sub, qs.view(), x.k.view(), x.v.view(), ref.view(),
                       effective_scale({.scale = scale}, c.dim));
  const auto e = test::compare(got, ref);
  EXPECT_LE(e.relative(), tolerance(c)) << "max abs " << e.max_abs;
  for (std::size_t i = 0; i < rows.size(); ++i) {  // empty rows: exactly zero
    if (g.degree(rows[i]) != 0) continue;
    for (std::int64_t e2 = 0; e2 < w; ++e2)
      ASSERT_EQ(got.get(static_cast<std::int64_t>(i) * w + e2), 0.0);
  }
}

// The configurations every pattern here runs: 16-bit inputs written in f32, in their own dtype
// and (fused) in the other 16-bit type, at three head dims. Every dtype pair x head dim on small
// patterns is in tests/generic; here the patterns vary. The unfused pipeline also takes f32
// inputs and any head dim.
std::vector<config> configs_for(algorithm algo, std::int64_t heads = 1) {
  const bool unfused = algo == algorithm::unfused;
  std::vector<config> out{{dtype::f16, dtype::f32, 128, heads},
                          {dtype::bf16, dtype::bf16, 64, heads}};
  if (unfused) {
    out.push_back({dtype::f32, dtype::f32, 5, heads});
    out.push_back({dtype::f16, dtype::f32, 48, heads});
  } else {
    out.push_back({dtype::f16, dtype::bf16, 32, heads});
  }
  return out;
}

std::string algo_name(const ::testing::TestParamInfo<algorithm>& info) {
  return std::string(to_string(info.param));
}

// The tests every CUDA attention algorithm must pass.
class GpuAttention : public ::testing::TestWithParam<algorithm> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible: skipping";
  }
  attention_plan plan(const csr_graph& g, plan_options o = {}) const {
    o.algo = GetParam();
    return attention_plan::build(g, device_kind::cuda, o);
  }
  void check_graph(const csr_graph& g, const config& c, std::uint64_t seed, double lo = -1.0,
                   double hi = 1.0, std::optional<double> scale = std::nullopt,
                   std::int64_t sample = 512, bool zero_q = false) const {
    const attention_plan p = plan(g);
    ASSERT_EQ(p.report().algo, GetParam());
    check(p, g, c, seed, lo, hi, scale, sample, zero_q);
  }
  std::vector<config> all_configs(std::int64_t heads = 1) const {
    return configs_for(GetParam(), heads);
  }
};

INSTANTIATE_TEST_SUITE_P(Cuda, GpuAttention,
                         ::testing::Values(algorithm::fused, algorithm::unfused), algo_name);

TEST_P(GpuAttention, EveryTypeAndHeadDimOnRandomGraphs) {
  std::uint64_t seed = 1;
  for (const auto& c : all_configs()) {
    for (const std::int64_t n : {1, 17, 1000}) {
      ++seed;
      check_graph(test::random_pattern(n, n, 40, seed), c, seed);
    }
  }
}

TEST_P(GpuAttention, MultiHeadAndRectangular) {
  for (const auto& c : all_configs(8)) check_graph(test::random_pattern(300, 1700, 60, 3), c, 7);
}

TEST_P(GpuAttention, AdversarialPatterns) {
  // Each graph under every configuration, its plan built once.
  const auto every_config = [&](const csr_graph& g, std::uint64_t seed) {
    const attention_plan p = plan(g);
    ASSERT_EQ(p.report().algo, GetParam());
    for (const auto& c : all_configs()) check(p, g, c, seed);
  };
  // Rows with more than 32 neighbours in a graph with N > 1024 (Fused3S's preprocessing bug).
  every_config(test::random_pattern(3000, 3000, 300, 5), 5);
  // Many empty rows, and N = 65537 (no read past the end of Q, K or V).
  every_config(test::random_pattern(65537, 65537, 2, 6), 6);
  // One row with 10^5 nonzeros: its window is split across warps and merged.
  coo_graph heavy{.rows = 2000, .cols = 120000, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t j = 0; j < 100000; ++j) {
    heavy.src.push_back(1001);
    heavy.dst.push_back(j);
  }
  for (std::int64_t i = 0; i < 2000; i += 7) {
    heavy.src.push_back(i);
    heavy.dst.push_back(i * 13);
  }
  every_config(to_csr(heavy), 8);
  // A batch of 1024 small graphs.
  every_config(generate_batch({.graphs = 1024, .min_nodes = 10, .max_nodes = 60, .seed = 9}).graph,
               9);
  // Power-law skew (windows of very different TCB counts).
  every_config(generate_rmat({.scale = 16, .edge_factor = 16, .seed = 10}), 10);
}

TEST_P(GpuAttention, ScoreEdgeCases) {
  const csr_graph g = test::random_pattern(2000, 2000, 50, 11);
  const attention_plan p = plan(g);
  ASSERT_EQ(p.report().algo, GetParam());
  for (const auto& c : all_configs(2)) {
    check(p, g, c, 12, -1.0, 1.0, 1.0, 512, true);  // q = 0: every score exactly 0, still an edge
    check(p, g, c, 13, 0.5, 1.0, -1.0);  // every score negative (a running max starting at 0 fails)
    // Scores near 1e4 (D * 12^2 with the scale 64 / D): no overflow.
    check(p, g, c, 14, 11.0, 13.0, 64.0 / static_cast<double>(c.dim));
  }
}

TEST_P(GpuAttention, EverySharedDataset) {
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  const auto configs = all_configs();
  std::size_t nth = 0;  // one configuration per graph, in turn
  for (const auto& path : test::dataset_graphs()) {
    SCOPED_TRACE(path.filename().string());
    const csr_graph g = read_graph(path);
    const attention_plan p = plan(g);
    check(p, g, configs[nth++ % configs.size()], 21, -1.0, 1.0, std::nullopt, 256);
  }
}

TEST(GpuFused3s, RowOrdersGiveTheSameAttention) {
  SKIP_WITHOUT_GPU();
  const config c{dtype::f16, dtype::f32, 64, 2};
  for (const csr_graph& g : {test::random_pattern(3000, 3000, 40, 41),
                             generate_rmat({.scale = 12, .edge_factor = 8, .seed = 42})}) {
    for (const row_order o : {row_order::original, row_order::rcm, row_order::automatic}) {
      const attention_plan plan = attention_plan::build(g, device_kind::cuda, {.order = o});
      EXPECT_EQ(
          plan.report().format.find("RCM") != std::string::npos,
          o == row_order::rcm ||
              (o == row_order::automatic &&
               100 * count_tcbs(select_rows(g, reverse_cuthill_mckee(g))) <= 65 * count_tcbs(g)));
      check(plan, g, c, 43);
    }
  }
}

TEST(GpuFused3s, WorkCutsGiveTheSameAttention) {
  SKIP_WITHOUT_GPU();
  // (split, team): the plan's rules; one warp per item; every item on a team, uncut; 5-TCB
  // shares on teams (members of 1-2 TCBs, some of none: empty states combined); 7-TCB shares on
  // teams and shorter items on single warps in one launch.
  const csr_graph skewed = generate_rmat({.scale = 13, .edge_factor = 12, .seed = 51});
  coo_graph heavy{.rows = 40, .cols = 5000, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t j = 0; j < 5000; j += 3) {  // one long window, rows 16-31 empty
    heavy.src.push_back(j % 16);
    heavy.dst.push_back(j);
  }
  heavy.src.push_back(39);
  heavy.dst.push_back(7);
  for (const csr_graph& g : {skewed, to_csr(heavy)}) {
    for (const auto& [split, team] : std::vector<std::pair<std::int32_t, std::int32_t>>{
             {0, 0}, {0, -1}, {100000, 1}, {5, 1}, {7, 7}}) {
      SCOPED_TRACE("split " + std::to_string(split) + " team " + std::to_string(team));
      const attention_plan plan = attention_plan::build(
          g, device_kind::cuda,
          {.split_tcbs = split, .team_tcbs = team, .order = row_order::original});
      for (const auto& c :
           {config{dtype::f16, dtype::f32, 128, 1}, config{dtype::bf16, dtype::bf16, 64, 3},
            config{dtype::f16, dtype::f16, 256, 1}, config{dtype::f16, dtype::f32, 32, 2}})
        check(plan, g, c, 52);
    }
  }
}

// A device array for CSR views (freed on scope exit).
TEST_P(GpuAttention, PlanFromDeviceCsrWithUnsortedAndRepeatedColumns) {
  for (const std::int64_t n : {1, 17, 3000}) {
    const csr_graph g = test::random_pattern(n, n + 5, 60, static_cast<std::uint64_t>(n));
    // The same pattern with each row reversed and every third entry repeated.
    std::vector<std::int64_t> row_ptr{0};
    std::vector<std::int32_t> cols;
    for (std::int64_t r = 0; r < g.rows; ++r) {
      for (std::int64_t e = g.row_ptr[r + 1] - 1; e >= g.row_ptr[r]; --e) {
        cols.push_back(g.col_idx[e]);
        if (e % 3 == 0) cols.push_back(g.col_idx[e]);
      }
      row_ptr.push_back(static_cast<std::int64_t>(cols.size()));
    }
    const test::device_array<std::int64_t> d_ptr(row_ptr);
    const test::device_array<std::int32_t> d_cols(cols);
    const csr_view view{.rows = g.rows,
                        .cols = g.cols,
                        .nnz = static_cast<std::int64_t>(cols.size()),
                        .row_ptr = d_ptr.p,
                        .col_idx = d_cols.p};
    const attention_plan p = attention_plan::build(view, {.algo = GetParam()});
    EXPECT_EQ(p.report().where, device_kind::cuda);
    EXPECT_EQ(p.report().algo, GetParam());
    for (const auto& c :
         {config{dtype::f16, dtype::f32, 64, 2}, config{dtype::bf16, dtype::bf16, 128, 1}})
      check(p, g, c, 31);
    // Host memory views give the same plan on the CPU.
    const csr_view host{.rows = g.rows,
                        .cols = g.cols,
                        .nnz = view.nnz,
                        .row_ptr = row_ptr.data(),
                        .col_idx = cols.data(),
                        .where = device_kind::cpu};
    EXPECT_EQ(attention_plan::build(host).report().nnz, g.nnz());
  }
}

TEST_P(GpuAttention, PlanFromDeviceCsrRejectsBrokenViews) {
  const test::device_array<std::int64_t> decreasing({0, 3, 2, 4});
  const test::device_array<std::int64_t> short_end({0, 1, 2, 3});
  const test::device_array<std::int64_t> good({0, 1, 2, 4});
  const test::device_array<std::int32_t> cols({0, 1, 2, 3});
  const test::device_array<std::int32_t> outside({0, 1, 2, 9});
  const auto build = [&](const std::int64_t* p, const std::int32_t* c) {
    return attention_plan::build(
        csr_view{.rows = 3, .cols = 4, .nnz = 4, .row_ptr = p, .col_idx = c}, {.algo = GetParam()});
  };
  EXPECT_THROW(build(decreasing.p, cols.p), invalid_input);
  EXPECT_THROW(build(short_end.p, cols.p), invalid_input);
  EXPECT_THROW(build(good.p, outside.p), invalid_input);
  EXPECT_NO_THROW(build(good.p, cols.p));
}

TEST(GpuUnfused, RowOrdersAndWhatItRejects) {
  SKIP_WITHOUT_GPU();
  const config c{dtype::f16, dtype::f32, 64, 2};
  // Values on the pattern must not change the attention (the pattern is binary).
  csr_graph g = generate_rmat({.scale = 12, .edge_factor = 8, .seed = 42});
  g.values.assign(g.col_idx.size(), 3.5f);
  for (const row_order o : {row_order::original, row_order::rcm, row_order::clustered}) {
    const attention_plan plan =
        attention_plan::build(g, device_kind::cuda, {.algo = algorithm::unfused, .order = o});
    EXPECT_EQ(plan.report().format.find(std::string(to_string(o))) != std::string::npos,
              o != row_order::original)
        << plan.report().format;
    check(plan, g, c, 44);
  }
  // out must be f32 or v's dtype; a fused plan cannot run unfused.
  const attention_plan plan =
      attention_plan::build(g, device_kind::cuda, {.algo = algorithm::unfused});
  auto x = test::random_qkv(g, 1, 32, dtype::f16, 1);
  test::device_tensor q(x.q), k(x.k), v(x.v), out(host_tensor(dtype::bf16, g.rows, 1, 32));
  EXPECT_THROW(plan.run(q.view(), k.view(), v.view(), out.view()), invalid_input);
  test::device_tensor out32(host_tensor(dtype::f32, g.rows, 1, 32));
  EXPECT_THROW(attention_plan::build(g, device_kind::cuda)
                   .run(q.view(), k.view(), v.view(), out32.view(), {.algo = algorithm::unfused}),
               invalid_input);
}

TEST(GpuFused3s, RejectsWhatItCannotRun) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(64, 64, 4, 1);
  const attention_plan plan = attention_plan::build(g, device_kind::cuda);
  auto x = test::random_qkv(g, 1, 48, dtype::f16, 1);  // head_dim 48
  test::device_tensor q(x.q), k(x.k), v(x.v), out(host_tensor(dtype::f32, 64, 1, 48));
  EXPECT_THROW(plan.run(q.view(), k.view(), v.view(), out.view()), invalid_input);
  auto y = test::random_qkv(g, 1, 64, dtype::f32, 1);  // fp32 inputs
  test::device_tensor q2(y.q), k2(y.k), v2(y.v), out2(host_tensor(dtype::f32, 64, 1, 64));
  EXPECT_THROW(plan.run(q2.view(), k2.view(), v2.view(), out2.view()), invalid_input);
  EXPECT_THROW(plan.run(y.q.view(), k2.view(), v2.view(), out2.view()),
               invalid_input);  // q on the host
}

}  // namespace
}  // namespace trisparse
