// The CUDA attention backward against the float64 reference gradients (label gpu; skipped without a
// device): dtypes, head dims, rectangular patterns with empty rows and columns, a 10^5-entry row
// and column, scores near 1e4, the shared datasets; bitwise repeatable, also on two streams; in
// given workspaces poisoned before each run.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>

#include "../../src/cuda/common/gather_reuse.hpp"
#include "device_tensor.hpp"

namespace trisparse {
namespace {

struct grad_config {
  dtype in, out, grad;  // q/k/v; out and dout; dq/dk/dv
  std::int64_t dim, dim_v, heads;
};

std::string name(const grad_config& c) {
  return std::string(to_string(c.in)) + "/" + std::string(to_string(c.out)) + "->" +
         std::string(to_string(c.grad)) + " d" + std::to_string(c.dim) + " dv" +
         std::to_string(c.dim_v) + " h" + std::to_string(c.heads);
}

host_tensor converted(const host_tensor& x, dtype t) {
  host_tensor y(t, x.rows(), x.heads(), x.dim());
#pragma omp parallel for
  for (std::int64_t i = 0; i < x.numel(); ++i) y.set(i, x.get(i));
  return y;
}

host_tensor random(dtype t, std::int64_t rows, std::int64_t heads, std::int64_t dim,
                   std::uint64_t seed, double lo, double hi) {
  host_tensor x(t, rows, heads, dim);
  x.fill_uniform(lo, hi, seed);
  return x;
}

struct gradients {
  host_tensor dq, dk, dv;
};

// Inputs, the forward (float64 reference, rounded to the config's types) and the reference
// gradients of one case.
struct problem {
  host_tensor q, k, v, out, lse, dout;
  gradients want;
};

problem make_problem(const csr_graph& g, const grad_config& c, std::uint64_t seed, double lo,
                     double hi, double scale) {
  problem p{random(c.in, g.rows, c.heads, c.dim, seed, lo, hi),
            random(c.in, g.cols, c.heads, c.dim, seed + 1, lo, hi),
            random(c.in, g.cols, c.heads, c.dim_v, seed + 2, -1.0, 1.0),
            {},
            {},
            random(c.out, g.rows, c.heads, c.dim_v, seed + 3, -1.0, 1.0),
            {}};
  host_tensor out64(dtype::f64, g.rows, c.heads, c.dim_v), lse64(dtype::f64, g.rows, c.heads, 1);
  reference::attention(g, p.q.view(), p.k.view(), p.v.view(), out64.view(), scale, lse64.view());
  p.out = converted(out64, c.out);
  p.lse = converted(lse64, dtype::f32);
  p.want = {host_tensor(dtype::f64, g.rows, c.heads, c.dim),
            host_tensor(dtype::f64, g.cols, c.heads, c.dim),
            host_tensor(dtype::f64, g.cols, c.heads, c.dim_v)};
  reference::attention_backward(g, p.q.view(), p.k.view(), p.v.view(), p.dout.view(),
                                p.want.dq.view(), p.want.dk.view(), p.want.dv.view(), scale);
  return p;
}

// Runs the plan's backward twice on poisoned outputs, in a given workspace of the size queried for
// the inputs' dtype, poisoned too (as a caching allocator hands it over: a read of what the run
// did not write shows as NaN), asserts both runs bitwise equal, and returns the first.
gradients run_twice(const attention_plan& plan, const problem& p, const grad_config& c,
                    bool with_lse, double scale) {
  test::device_tensor q(p.q), k(p.k), v(p.v), out(p.out), lse(p.lse), dout(p.dout);
  test::device_tensor dq(host_tensor(c.grad, p.q.rows(), c.heads, c.dim)),
      dk(host_tensor(c.grad, p.k.rows(), c.heads, c.dim)),
      dv(host_tensor(c.grad, p.v.rows(), c.heads, c.dim_v));
  const std::size_t bytes = plan.backward_workspace_bytes(c.heads, std::max(c.dim, c.dim_v), c.in);
  test::device_tensor workspace(
      host_tensor(dtype::f32, static_cast<std::int64_t>(bytes / 4 + 1), 1, 1));
  const tensor_view no_lse{};
  gradients first;
  for (int round = 0; round < 2; ++round) {
    dq.poison();
    dk.poison();
    dv.poison();
    workspace.poison();
    plan.backward(q.view(), k.view(), v.view(), out.view(), with_lse ? lse.view() : no_lse,
                  dout.view(), dq.view(), dk.view(), dv.view(), {.scale = scale}, {},
                  {workspace.view().data, bytes});
    gradients now{dq.download(), dk.download(), dv.download()};
    if (round == 0) {
      first = std::move(now);
      continue;
    }
    for (const auto& [a, b] : {std::pair{&first.dq, &now.dq}, std::pair{&first.dk, &now.dk},
                               std::pair{&first.dv, &now.dv}})
      EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size_bytes()), 0) << "runs differ: a race";
  }
  return first;
}

// A pattern's CSR in device memory, for plans built from a csr_view.
struct device_csr {
  test::device_array<std::int64_t> row_ptr;
  test::device_array<std::int32_t> col_idx;
  std::int64_t rows, cols, nnz;
  explicit device_csr(const csr_graph& g)
      : row_ptr(g.row_ptr), col_idx(g.col_idx), rows(g.rows), cols(g.cols), nnz(g.nnz()) {}
  csr_view view() const {
    return {.rows = rows, .cols = cols, .nnz = nnz, .row_ptr = row_ptr.p, .col_idx = col_idx.p};
  }
};

// from_device: the plan is built from the pattern in device memory (transposed there); order:
// the windows' row order of a plan built from the host pattern.
void check(const csr_graph& g, const grad_config& c, std::uint64_t seed, bool with_lse = true,
           double lo = -1.0, double hi = 1.0, std::optional<double> scale_opt = std::nullopt,
           bool cancels = false, bool from_device = false, row_order order = row_order::automatic) {
  SCOPED_TRACE(name(c) + (with_lse ? " lse" : " no lse") + " rows " + std::to_string(g.rows) +
               " cols " + std::to_string(g.cols) + " nnz " + std::to_string(g.nnz()) +
               (from_device ? " (device-built plan)" : "") + " order " +
               std::string(to_string(order)));
  const double scale = effective_scale({.scale = scale_opt}, c.dim);
  const plan_options options{
      .order = order, .workspace_heads = std::max<std::int64_t>(8, c.heads), .gradients = true};
  const device_csr on_device(from_device ? g : csr_graph{});
  const auto plan = from_device ? attention_plan::build(on_device.view(), options)
                                : attention_plan::build(g, device_kind::cuda, options);
  const problem p = make_problem(g, c, seed, lo, hi, scale);
  const gradients got = run_twice(plan, p, c, with_lse, scale);
  // Roundings: the inputs and out (feeding D) in their types, the gradients in theirs; fp32 sums.
  const dtype coarse = unit_roundoff(c.in) > unit_roundoff(c.out) ? c.in : c.out;
  const double tol = test::gpu_tolerance(coarse, c.grad, 8);
  // Errors relative to each gradient's largest entry; where the exact gradient cancels to ~0
  // (`cancels`: a query with one key has dS = dP - D = 0, so a star's dq and its hub's dk vanish),
  // relative to the step's largest gradient entry, the scale of what is left when dP and D do not
  // cancel exactly (the tensor-core kernels sum dP on mma in another order than D).
  std::vector<test::error_report> errors;
  double largest = 0.0;
  for (const auto& [have, want] : {std::pair{&got.dq, &p.want.dq}, std::pair{&got.dk, &p.want.dk},
                                   std::pair{&got.dv, &p.want.dv}}) {
    errors.push_back(test::compare(*have, *want));
    largest = std::max(largest, errors.back().max_ref);
  }
  for (std::size_t i = 0; i < errors.size(); ++i) {
    const char* what = i == 0 ? "dq" : i == 1 ? "dk" : "dv";
    const auto& e = errors[i];
    EXPECT_TRUE(e.finite) << what << ": NaN or infinity";
    EXPECT_LE(e.max_abs, tol * (cancels ? largest : e.max_ref))
        << what << ": max abs " << e.max_abs << " of " << e.max_ref << " (largest " << largest
        << ")";
  }
  // Rows without entries: dq exactly 0; columns without entries: dk, dv exactly 0.
  const csr_graph t = transpose(g);
  for (const auto& [pattern, grads] :
       {std::pair{&g, std::vector<const host_tensor*>{&got.dq}},
        std::pair{&t, std::vector<const host_tensor*>{&got.dk, &got.dv}}}) {
    for (std::int64_t r = 0; r < pattern->rows; ++r) {
      if (pattern->degree(r) != 0) continue;
      for (const host_tensor* x : grads) {
        const std::int64_t w = x->heads() * x->dim();
        for (std::int64_t e = 0; e < w; ++e) ASSERT_EQ(x->get(r * w + e), 0.0) << "row " << r;
      }
    }
  }
}

TEST(GpuAttentionBackward, EveryDtypeAndHeadDimOnRectangularPatterns) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(300, 257, 40, 11);  // empty rows and columns
  std::uint64_t seed = 100;
  // 16-bit inputs with one head dim of 32, 64 or 128 run the tensor-core kernels (windows of
  // this pattern are cut into chunks), the others the CUDA-core ones.
  for (const grad_config c : {grad_config{dtype::f16, dtype::f16, dtype::f16, 64, 64, 2},
                              grad_config{dtype::f16, dtype::f16, dtype::f32, 32, 32, 3},
                              grad_config{dtype::bf16, dtype::f32, dtype::bf16, 128, 128, 2},
                              grad_config{dtype::bf16, dtype::bf16, dtype::f32, 128, 32, 1},
                              grad_config{dtype::f32, dtype::f32, dtype::f32, 32, 96, 3},
                              grad_config{dtype::f16, dtype::f32, dtype::f32, 256, 256, 1},
                              grad_config{dtype::bf16, dtype::f32, dtype::bf16, 40, 8, 4},
                              // Head groups of the CUDA-core kernels: 8 heads of 16 in one warp
                              // (a Graph Transformer's), 40 heads of 2 in two groups (the last
                              // partial), 5 heads of 24 (8 lanes a head), 8 floats a lane.
                              grad_config{dtype::f32, dtype::f32, dtype::f32, 16, 16, 8},
                              grad_config{dtype::bf16, dtype::bf16, dtype::bf16, 16, 16, 8},
                              grad_config{dtype::f32, dtype::f32, dtype::f32, 2, 2, 40},
                              // 2 heads of 8 in f32: one element a lane, half the warp idle.
                              grad_config{dtype::f32, dtype::f32, dtype::f32, 8, 8, 2},
                              grad_config{dtype::f16, dtype::f16, dtype::f16, 24, 24, 5},
                              grad_config{dtype::f32, dtype::f32, dtype::f32, 256, 200, 2}}) {
    for (const bool with_lse : {true, false}) check(g, c, seed++, with_lse);
  }
}

TEST(GpuAttentionBackward, AdversarialPatterns) {
  SKIP_WITHOUT_GPU();
  const grad_config c{dtype::f16, dtype::f32, dtype::f32, 64, 64, 1};
  // One row with 10^5 entries, one column that 10^5 rows attend.
  {
    coo_graph coo{.rows = 100001, .cols = 100001, .src = {}, .dst = {}, .values = {}};
    for (std::int64_t j = 0; j < 100000; ++j) {
      coo.src.push_back(0);
      coo.dst.push_back(j + 1);
      coo.src.push_back(j + 1);
      coo.dst.push_back(0);
    }
    check(to_csr(coo), c, 1, true, -1.0, 1.0, std::nullopt, true);
  }
  // Scores near +-1e4 (|q|, |k| ~ 30 with scale 1/8 over 64 dims).
  check(test::random_pattern(500, 500, 30, 12), {dtype::f32, dtype::f32, dtype::f32, 64, 64, 1}, 2,
        true, -30.0, 30.0);
  check(test::random_pattern(500, 500, 30, 12), c, 2, true, -30.0, 30.0);
  // N = 1, 17, 65537.
  for (const std::int64_t n : {1, 17, 65537})
    check(test::random_pattern(n, n, 12, 13 + static_cast<std::uint64_t>(n)), c, 3, false, -1.0,
          1.0, std::nullopt, n == 1);
  // A batch of 1024 small graphs (block diagonal).
  {
    coo_graph coo{.rows = 1024 * 12, .cols = 1024 * 12, .src = {}, .dst = {}, .values = {}};
    rng r(14);
    for (std::int64_t b = 0; b < 1024; ++b)
      for (std::int64_t e = 0; e < 40; ++e) {
        coo.src.push_back(b * 12 + static_cast<std::int64_t>(r.below(12)));
        coo.dst.push_back(b * 12 + static_cast<std::int64_t>(r.below(12)));
      }
    check(to_csr(coo), c, 4);
  }
}

// A plan with gradients built from a pattern in device memory (its transpose and BSBs built
// there): rectangular with empty rows and columns, a hub row and column cut into chunks, a
// symmetric batch of graphs; tensor-core and CUDA-core kernels. Broken views are refused.
TEST(GpuAttentionBackward, PlanBuiltFromADevicePattern) {
  SKIP_WITHOUT_GPU();
  coo_graph hub{.rows = 3001, .cols = 2500, .src = {}, .dst = {}, .values = {}};
  rng r(21);
  for (std::int64_t j = 0; j < 2500; ++j) {
    hub.src.push_back(0);
    hub.dst.push_back(j);
    hub.src.push_back(1 + static_cast<std::int64_t>(r.below(3000)));
    hub.dst.push_back(7);
    hub.src.push_back(1 + static_cast<std::int64_t>(r.below(3000)));
    hub.dst.push_back(static_cast<std::int64_t>(r.below(2500)));
  }
  coo_graph batch{.rows = 300 * 23, .cols = 300 * 23, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t b = 0; b < 300; ++b)
    for (std::int64_t i = 0; i < 23; ++i)
      for (std::int64_t j = 0; j < 23; ++j) {
        batch.src.push_back(b * 23 + i);
        batch.dst.push_back(b * 23 + j);
      }
  std::uint64_t seed = 700;
  for (const csr_graph& g : {test::random_pattern(300, 257, 40, 11), to_csr(hub), to_csr(batch)}) {
    for (const grad_config c : {grad_config{dtype::bf16, dtype::bf16, dtype::bf16, 64, 64, 4},
                                grad_config{dtype::f16, dtype::f32, dtype::f32, 32, 32, 1},
                                grad_config{dtype::f32, dtype::f32, dtype::f32, 16, 16, 8}})
      check(g, c, seed++, true, -1.0, 1.0, std::nullopt, false, true);
  }
  // Columns not strictly increasing within a row: refused with gradients (taken without).
  csr_graph unsorted{.rows = 2, .cols = 3, .row_ptr = {0, 2, 3}, .col_idx = {2, 1, 0}};
  EXPECT_THROW(attention_plan::build(device_csr(unsorted).view(), {.gradients = true}),
               invalid_input);
  EXPECT_NO_THROW(attention_plan::build(device_csr(unsorted).view(), {}));
  csr_graph repeated{.rows = 2, .cols = 3, .row_ptr = {0, 2, 3}, .col_idx = {1, 1, 0}};
  EXPECT_THROW(attention_plan::build(device_csr(repeated).view(), {.gradients = true}),
               invalid_input);
}

// A pattern large enough that the tensor-core kernels' chunks hold more than 32 TCBs (300K
// uniform rows of 16 and a hub row of 150K keys: ~600K TCBs, so fine chunks of ~36 at one head
// and coarse ones of ~140 at 4 heads on 132 SMs; tuning.hpp), and its hub window cut at both.
TEST(GpuAttentionBackward, LargePatternsCutIntoLargerChunks) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = generate_sparse_matrix({.rows = 300000,
                                              .avg_row = 16,
                                              .lengths = row_length_law::uniform,
                                              .dense_rows = 1,
                                              .seed = 15});
  check(g, {dtype::f16, dtype::f32, dtype::f32, 32, 32, 1}, 5, true);
  check(g, {dtype::bf16, dtype::bf16, dtype::bf16, 32, 32, 4}, 6, true);
}

// The tensor-core passes' windows in RCM order (the forward's, where it cuts the TCBs): a banded
// graph whose rows are shuffled (RCM restores the band: the automatic rule takes it, for the
// pattern and its transpose, one BSB as the pattern is symmetric), and RCM asked for a
// non-symmetric pattern with empty rows and columns (two BSBs, each ordered, and the map between
// their slots).
TEST(GpuAttentionBackward, WindowsInRcmOrder) {
  SKIP_WITHOUT_GPU();
  const csr_graph banded = test::shuffled_band(4000, 12, 31);
  const auto plan = attention_plan::build(banded, device_kind::cuda, {.gradients = true});
  EXPECT_NE(plan.report().format.find("RCM"), std::string::npos) << plan.report().format;
  std::uint64_t seed = 800;
  for (const grad_config c : {grad_config{dtype::f16, dtype::f16, dtype::f16, 64, 64, 8},
                              grad_config{dtype::bf16, dtype::f32, dtype::f32, 128, 128, 1},
                              grad_config{dtype::bf16, dtype::bf16, dtype::bf16, 32, 32, 4}}) {
    check(banded, c, seed++, true);
    check(test::random_pattern(900, 900, 30, 32), c, seed++, true, -1.0, 1.0, std::nullopt, false,
          false, row_order::rcm);
  }
}

TEST(GpuAttentionBackward, EverySharedDataset) {
  SKIP_WITHOUT_GPU();
  TRISPARSE_SKIP_WITHOUT_DATASETS();
  std::uint64_t seed = 500;
  // TRISPARSE_GPU_TEST_QUICK=1 (the one-call suite, compute-sanitizer): one head of 32, a quarter
  // of the float64 reference's work, still on the tensor-core kernels.
  const grad_config c = test::quick()
                            ? grad_config{dtype::bf16, dtype::bf16, dtype::bf16, 32, 32, 1}
                            : grad_config{dtype::bf16, dtype::bf16, dtype::bf16, 64, 64, 2};
  for (const auto& path : test::dataset_graphs()) {
    SCOPED_TRACE(path.filename().string());
    const csr_graph g = read_graph(path);
    check(g, c, seed++, true);
  }
}

// The fused 3S forward's log-sum-exp output: every work cut (whole windows, split windows merged
// by the last warp, teams of warps), empty rows -inf; and the backward from it agrees with the
// backward that recomputes it.
TEST(GpuAttentionBackward, FusedForwardWritesTheLogSumExp) {
  SKIP_WITHOUT_GPU();
  const grad_config c{dtype::f16, dtype::f32, dtype::f32, 64, 64, 2};
  csr_graph hub = test::random_pattern(3000, 3000, 8, 41);
  {
    coo_graph coo = to_coo(hub);
    for (std::int64_t j = 0; j < 3000; ++j) {  // row 7 attends every key
      coo.src.push_back(7);
      coo.dst.push_back(j);
    }
    hub = to_csr(coo);
  }
  for (const plan_options o :
       {plan_options{.gradients = true}, plan_options{.split_tcbs = 4, .gradients = true},
        plan_options{.split_tcbs = 1 << 30, .team_tcbs = 2, .gradients = true}}) {
    SCOPED_TRACE("split " + std::to_string(o.split_tcbs) + " team " + std::to_string(o.team_tcbs));
    const auto plan = attention_plan::build(hub, device_kind::cuda, o);
    const double scale = effective_scale({}, c.dim);
    const problem p = make_problem(hub, c, 42, -2.0, 2.0, scale);
    test::device_tensor q(p.q), k(p.k), v(p.v), out(p.out),
        lse(host_tensor(dtype::f32, hub.rows, c.heads, 1));
    lse.poison();
    plan.run(q.view(), k.view(), v.view(), out.view(), {.lse = lse.view()});
    const host_tensor got = lse.download();
    double worst = 0;
    for (std::int64_t i = 0; i < got.numel(); ++i) {
      const double want = p.lse.get(i);
      if (std::isinf(want)) {
        ASSERT_TRUE(std::isinf(got.get(i)) && got.get(i) < 0) << "entry " << i;
        continue;
      }
      worst = std::max(worst, std::abs(got.get(i) - want) / (1.0 + std::abs(want)));
    }
    EXPECT_LE(worst, 1e-4);
    const gradients from_lse = run_twice(plan, p, c, true, scale);
    const gradients recomputed = run_twice(plan, p, c, false, scale);
    for (const auto& [a, b] :
         {std::pair{&from_lse.dq, &recomputed.dq}, std::pair{&from_lse.dk, &recomputed.dk},
          std::pair{&from_lse.dv, &recomputed.dv}})
      EXPECT_LE(test::compare(*a, *b).relative(), 1e-4);
  }
}

// f32 inputs run the row-wise f32 forward (out and lse) on a plan with gradients, over a hub row
// and a hub column (both cut into chunks), empty rows and a rectangular pattern with Dv != D, with
// the plan's own workspace and a given one; the backward on the same pattern; a plan without
// gradients says what it needs.
TEST(GpuAttentionBackward, F32ForwardRunsRowWise) {
  SKIP_WITHOUT_GPU();
  const coo_graph random = to_coo(test::random_pattern(2000, 1500, 6, 51));
  coo_graph coo{.rows = 2000, .cols = 1500, .src = {}, .dst = {}, .values = {}};
  for (std::size_t e = 0; e < random.src.size(); ++e) {
    if (random.src[e] >= 1000 && random.src[e] < 1010) continue;  // rows 1000..1009 stay empty
    coo.src.push_back(random.src[e]);
    coo.dst.push_back(random.dst[e]);
  }
  for (std::int64_t j = 0; j < 1500; ++j) {  // row 3 attends every key
    coo.src.push_back(3);
    coo.dst.push_back(j);
  }
  for (std::int64_t i = 0; i < 2000; ++i) {  // every non-empty row attends key 5
    if (i >= 1000 && i < 1010) continue;
    coo.src.push_back(i);
    coo.dst.push_back(5);
  }
  const csr_graph g = to_csr(coo);
  const auto plan = attention_plan::build(g, device_kind::cuda, {.gradients = true});
  std::uint64_t seed = 52;
  for (const grad_config c : {grad_config{dtype::f32, dtype::f32, dtype::f32, 48, 80, 3},
                              grad_config{dtype::f32, dtype::f32, dtype::f32, 16, 16, 8}}) {
    SCOPED_TRACE(name(c));
    const double scale = effective_scale({}, c.dim);
    const problem p = make_problem(g, c, seed++, -3.0, 3.0, scale);
    test::device_tensor q(p.q), k(p.k), v(p.v),
        out(host_tensor(dtype::f32, g.rows, c.heads, c.dim_v)),
        lse(host_tensor(dtype::f32, g.rows, c.heads, 1));
    const std::size_t bytes = plan.workspace_bytes(c.heads, std::max(c.dim, c.dim_v));
    ASSERT_GT(bytes, 0u) << "the hub row is cut: its chunks' partial results need a workspace";
    test::device_tensor given(host_tensor(dtype::f32, static_cast<std::int64_t>(bytes / 4), 1, 1));
    for (const bool own : {true, false}) {
      out.poison();
      lse.poison();
      given.poison();
      plan.run(q.view(), k.view(), v.view(), out.view(), {.lse = lse.view()}, {},
               own ? workspace_view{} : workspace_view{given.view().data, bytes});
      EXPECT_LE(test::compare(out.download(), p.out).relative(),
                test::gpu_tolerance(dtype::f32, dtype::f32, 8));
      const host_tensor got = lse.download();
      for (std::int64_t i = 0; i < got.numel(); ++i) {
        const double want = p.lse.get(i);
        if (std::isinf(want)) {
          ASSERT_TRUE(std::isinf(got.get(i)) && got.get(i) < 0) << "entry " << i;
        } else {
          ASSERT_NEAR(got.get(i), want, 1e-4 * (1.0 + std::abs(want))) << "entry " << i;
        }
      }
    }
    check(g, c, seed++, true, -3.0, 3.0);
    check(g, c, seed++, false);
  }
  const grad_config c{dtype::f32, dtype::f32, dtype::f32, 16, 16, 8};
  const problem p = make_problem(g, c, seed, -1.0, 1.0, effective_scale({}, c.dim));
  test::device_tensor q(p.q), k(p.k), v(p.v),
      out(host_tensor(dtype::f32, g.rows, c.heads, c.dim_v));
  const auto forward_only = attention_plan::build(g, device_kind::cuda);
  EXPECT_THROW(forward_only.run(q.view(), k.view(), v.view(), out.view()), invalid_input);
}

TEST(GpuAttentionBackward, TwoStreamsGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(4000, 4000, 60, 21);
  const grad_config c{dtype::f16, dtype::f16, dtype::f32, 128, 128, 4};
  const double scale = effective_scale({}, c.dim);
  const auto plan = attention_plan::build(g, device_kind::cuda, {.gradients = true});
  const problem p = make_problem(g, c, 22, -1.0, 1.0, scale);
  const gradients want = run_twice(plan, p, c, true, scale);
  test::device_tensor q(p.q), k(p.k), v(p.v), out(p.out), lse(p.lse), dout(p.dout);
  struct lane {
    cudaStream_t s{};
    void* ws = nullptr;
    std::unique_ptr<test::device_tensor> dq, dk, dv;
  };
  lane lanes[2];
  const std::size_t bytes = plan.backward_workspace_bytes(c.heads, std::max(c.dim, c.dim_v), c.in);
  for (auto& l : lanes) {
    test::cuda_check(cudaStreamCreateWithFlags(&l.s, cudaStreamNonBlocking), "stream");
    test::cuda_check(cudaMalloc(&l.ws, bytes), "workspace");
    l.dq = std::make_unique<test::device_tensor>(host_tensor(c.grad, g.rows, c.heads, c.dim));
    l.dk = std::make_unique<test::device_tensor>(host_tensor(c.grad, g.cols, c.heads, c.dim));
    l.dv = std::make_unique<test::device_tensor>(host_tensor(c.grad, g.cols, c.heads, c.dim_v));
  }
  for (int round = 0; round < 4; ++round) {
    for (auto& l : lanes) {
      l.dq->poison();
      l.dk->poison();
      l.dv->poison();
    }
    for (auto& l : lanes)
      plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), l.dq->view(),
                    l.dk->view(), l.dv->view(), {.scale = scale}, {l.s}, {l.ws, bytes});
    for (auto& l : lanes) {
      for (const auto& [got, ref] :
           {std::pair{l.dq->download(), &want.dq}, std::pair{l.dk->download(), &want.dk},
            std::pair{l.dv->download(), &want.dv}})
        ASSERT_EQ(std::memcmp(got.data(), ref->data(), got.size_bytes()), 0) << "round " << round;
    }
  }
  for (auto& l : lanes) {
    cudaFree(l.ws);
    cudaStreamDestroy(l.s);
  }
}

// The (window, head) tasks head by head give the bits that window by window gives: the forward's
// out and lse (split windows merged; teams of warps) and both backward passes. On a graph whose
// gathers scatter (a band with its rows shuffled; 8 heads' K and V rows outgrow the L2) the
// automatic rule takes them head by head, within tolerance of the float64 reference.
TEST(GpuAttentionBackward, HeadOrdersGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::shuffled_band(40000, 4, 61);
  const grad_config c{dtype::f16, dtype::f16, dtype::f16, 64, 64, 8};
  int device = 0, l2 = 0;
  test::cuda_check(cudaGetDevice(&device), "device");
  test::cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "L2 size");
  cuda::gather_reuse reuse = cuda::gather_reuse_of(g, {});
  cuda::settle_head_orders(reuse, l2);
  EXPECT_TRUE(cuda::heads_outer(head_order::automatic, reuse, c.heads, c.dim))
      << "a " << l2 << "-byte L2 holds 8 heads' rows: the test does not reach the by-head order";
  check(g, c, 62, true, -1.0, 1.0, std::nullopt, false, false, row_order::original);
  const double scale = effective_scale({}, c.dim);
  const problem p = make_problem(g, c, 63, -1.0, 1.0, scale);
  struct result {
    host_tensor out, lse;
    gradients grads;
  };
  const auto step = [&](plan_options o) {
    o.order = row_order::original;
    o.gradients = true;
    const auto plan = attention_plan::build(g, device_kind::cuda, o);
    test::device_tensor q(p.q), k(p.k), v(p.v), out(host_tensor(c.out, g.rows, c.heads, c.dim_v)),
        lse(host_tensor(dtype::f32, g.rows, c.heads, 1));
    out.poison();
    lse.poison();
    plan.run(q.view(), k.view(), v.view(), out.view(), {.scale = scale, .lse = lse.view()});
    return result{out.download(), lse.download(), run_twice(plan, p, c, true, scale)};
  };
  for (const auto& [split, team] :
       std::vector<std::pair<std::int32_t, std::int32_t>>{{0, 0}, {4, -1}, {1 << 30, 8}}) {
    SCOPED_TRACE("split " + std::to_string(split) + " team " + std::to_string(team));
    const result a = step({.split_tcbs = split, .team_tcbs = team, .heads = head_order::by_window});
    const result b = step({.split_tcbs = split, .team_tcbs = team, .heads = head_order::by_head});
    for (const auto& [x, y] :
         {std::pair{&a.out, &b.out}, std::pair{&a.lse, &b.lse}, std::pair{&a.grads.dq, &b.grads.dq},
          std::pair{&a.grads.dk, &b.grads.dk}, std::pair{&a.grads.dv, &b.grads.dv}})
      EXPECT_EQ(std::memcmp(x->data(), y->data(), x->size_bytes()), 0);
  }
}

TEST(GpuAttentionBackward, SaysWhatItNeeds) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(64, 64, 8, 31);
  const grad_config c{dtype::f16, dtype::f16, dtype::f16, 64, 64, 1};
  const problem p = make_problem(g, c, 32, -1.0, 1.0, 0.125);
  test::device_tensor q(p.q), k(p.k), v(p.v), out(p.out), dout(p.dout), dq(p.q), dk(p.k), dv(p.v);
  const auto no_grad = attention_plan::build(g, device_kind::cuda);
  EXPECT_THROW(no_grad.backward(q.view(), k.view(), v.view(), out.view(), {}, dout.view(),
                                dq.view(), dk.view(), dv.view()),
               invalid_input);
  const auto plan = attention_plan::build(g, device_kind::cuda, {.gradients = true});
  void* small = nullptr;
  test::cuda_check(cudaMalloc(&small, 256), "workspace");
  EXPECT_THROW(plan.backward(q.view(), k.view(), v.view(), out.view(), {}, dout.view(), dq.view(),
                             dk.view(), dv.view(), {}, {}, {small, 256}),
               invalid_input);
  // f32 never takes the tensor-core kernels: its workspace holds no P and dS (4 B an entry), and
  // an f16 backward refuses it.
  const std::size_t f32_bytes = plan.backward_workspace_bytes(1, 64, dtype::f32);
  EXPECT_GE(plan.backward_workspace_bytes(1, 64, dtype::f16),
            f32_bytes + static_cast<std::size_t>(g.nnz()) * 4);
  EXPECT_EQ(plan.backward_workspace_bytes(1, 64),
            plan.backward_workspace_bytes(1, 64, dtype::bf16));
  test::cuda_check(cudaMalloc(&small, f32_bytes), "workspace");
  EXPECT_THROW(plan.backward(q.view(), k.view(), v.view(), out.view(), {}, dout.view(), dq.view(),
                             dk.view(), dv.view(), {}, {}, {small, f32_bytes}),
               invalid_input);
  cudaFree(small);
  host_tensor wide(dtype::f16, 64, 1, 512);
  test::device_tensor wq(wide), wk(wide), wv(wide), wo(wide), wg(wide), wdq(wide), wdk(wide),
      wdv(wide);
  EXPECT_THROW(plan.backward(wq.view(), wk.view(), wv.view(), wo.view(), {}, wg.view(), wdq.view(),
                             wdk.view(), wdv.view()),
               invalid_input);
}

}  // namespace
}  // namespace trisparse
