// The CUDA ME-BCRS kernels (SpMM, SDDMM, row softmax) against the float64 reference (label gpu;
// skipped without a device).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "device_tensor.hpp"

namespace trisparse {
namespace {

// 16-bit inputs: products exact, fp32 accumulation, the pattern's own fp32 values rounded to the
// input type; tf32 rounds both operands to 11 significant bits; the output is rounded to its
// type. A few units of each (normwise).
double tolerance(dtype in, dtype out) { return test::gpu_tolerance(in, out, 8); }

// Rows to check: all of a small pattern, else a sample plus the last (partial window) row.
std::vector<std::int64_t> sample_rows(const csr_graph& g, std::uint64_t seed,
                                      std::int64_t sample = 400) {
  std::vector<std::int64_t> rows;
  if (g.rows <= sample) {
    for (std::int64_t i = 0; i < g.rows; ++i) rows.push_back(i);
    return rows;
  }
  rng r(seed);
  for (std::int64_t i = 0; i < sample; ++i)
    rows.push_back(static_cast<std::int64_t>(r.below(g.rows)));
  rows.push_back(g.rows - 1);
  // The longest row too (split windows).
  std::int64_t longest = 0;
  for (std::int64_t i = 0; i < g.rows; ++i)
    if (g.degree(i) > g.degree(longest)) longest = i;
  rows.push_back(longest);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

// Rows `rows` of a [n, H, D] tensor, as f64.
host_tensor take_rows(const host_tensor& t, const std::vector<std::int64_t>& rows) {
  host_tensor out(dtype::f64, static_cast<std::int64_t>(rows.size()), t.heads(), t.dim());
  const std::int64_t w = t.heads() * t.dim();
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (std::int64_t e = 0; e < w; ++e)
      out.set(static_cast<std::int64_t>(i) * w + e, t.get(rows[i] * w + e));
  return out;
}

// The entries of rows `rows` of per-edge values [nnz, H, 1] (CSR order), as f64.
host_tensor take_entries(const csr_graph& g, const host_tensor& t,
                         const std::vector<std::int64_t>& rows) {
  std::int64_t n = 0;
  for (const auto r : rows) n += g.degree(r);
  host_tensor out(dtype::f64, n, t.heads(), 1);
  std::int64_t i = 0;
  for (const auto r : rows)
    for (std::int64_t e = g.row_ptr[r]; e < g.row_ptr[r + 1]; ++e, ++i)
      for (std::int64_t h = 0; h < t.heads(); ++h)
        out.set(i * t.heads() + h, t.get(e * t.heads() + h));
  return out;
}

// A [slots, H, 1] device array in the slot layout (one array per head).
struct slot_tensor {
  host_tensor host;
  test::device_tensor dev;
  slot_tensor(dtype t, std::int64_t slots, std::int64_t heads)
      : host(t, std::max<std::int64_t>(slots, 1) * heads, 1, 1), dev(host) {}
  tensor_view view(std::int64_t slots, std::int64_t heads) {
    tensor_view v = dev.view();
    v.rows = slots;
    v.heads = heads;
    v.dim = 1;
    v.row_stride = 1;
    v.head_stride = std::max<std::int64_t>(slots, 1);
    return v;
  }
};

struct spmm_case {
  dtype in, out;
  std::int64_t n, heads;
  bool own_values;
};

std::string name(const spmm_case& c) {
  return std::string(to_string(c.in)) + "->" + std::string(to_string(c.out)) + " n" +
         std::to_string(c.n) + " h" + std::to_string(c.heads) +
         (c.own_values ? " own" : " per-head");
}

// c = A b twice (poisoned outputs): finite, bitwise equal, sampled rows within tolerance.
void check_spmm(const sparse_plan& plan, const csr_graph& g, const spmm_case& c,
                std::uint64_t seed) {
  SCOPED_TRACE(name(c) + " rows " + std::to_string(g.rows) + " nnz " + std::to_string(g.nnz()));
  host_tensor b(c.in, g.cols, c.heads, c.n), w(c.in, g.nnz(), c.heads, 1);
  b.fill_uniform(-1.0, 1.0, seed);
  w.fill_uniform(0.25, 1.0, seed + 1);
  test::device_tensor db(b), dw(w), dc(host_tensor(c.out, g.rows, c.heads, c.n));
  slot_tensor slots(c.in, plan.slots(), c.heads);
  tensor_view values{};
  if (!c.own_values) {
    plan.to_slots(dw.view(), slots.view(plan.slots(), c.heads));
    values = slots.view(plan.slots(), c.heads);
  }
  host_tensor first;
  ASSERT_NO_FATAL_FAILURE(test::run_twice_identically(
      dc, [&] { plan.spmm(values, db.view(), dc.view()); }, first));
  for (std::int64_t i = 0; i < first.numel(); ++i)
    ASSERT_TRUE(std::isfinite(first.get(i))) << "unwritten or non-finite output at " << i;
  const auto rows = sample_rows(g, seed);
  const csr_graph sub = select_rows(g, rows);
  host_tensor ref(dtype::f64, sub.rows, c.heads, c.n);
  const host_tensor ws = take_entries(g, w, rows);
  reference::spmm(sub, c.own_values ? tensor_view{} : ws.view(), b.view(), ref.view());
  const auto e = test::compare(take_rows(first, rows), ref);
  EXPECT_LE(e.relative(), tolerance(c.in, c.out)) << "max abs " << e.max_abs;
}

// out = scale A ⊙ (x y^T) and its row softmax, against the reference on sampled rows.
void check_sddmm_softmax(const sparse_plan& plan, const csr_graph& g, dtype in, dtype out,
                         std::int64_t d, std::int64_t heads, std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(in)) + "->" + std::string(to_string(out)) + " d" +
               std::to_string(d) + " h" + std::to_string(heads) + " nnz " +
               std::to_string(g.nnz()));
  host_tensor x(in, g.rows, heads, d), y(in, g.cols, heads, d);
  x.fill_uniform(-1.0, 1.0, seed);
  y.fill_uniform(-1.0, 1.0, seed + 1);
  test::device_tensor dx(x), dy(y);
  slot_tensor s(out, plan.slots(), heads), p(out, plan.slots(), heads);
  test::device_tensor entries(host_tensor(out, g.nnz(), heads, 1));
  const double scale = 0.5;
  s.dev.poison();
  plan.sddmm(dx.view(), dy.view(), s.view(plan.slots(), heads), scale);
  const host_tensor slots_first = s.dev.download();
  for (std::int64_t i = 0; i < plan.slots() * heads; ++i)
    ASSERT_TRUE(std::isfinite(slots_first.get(i))) << "unwritten slot " << i;
  entries.poison();
  plan.to_entries(s.view(plan.slots(), heads), entries.view());
  const host_tensor got_s = entries.download();
  p.dev.poison();
  plan.softmax(s.view(plan.slots(), heads), p.view(plan.slots(), heads));
  const host_tensor slots_p = p.dev.download();
  for (std::int64_t i = 0; i < plan.slots() * heads; ++i)
    ASSERT_TRUE(std::isfinite(slots_p.get(i))) << "unwritten softmax slot " << i;
  plan.to_entries(p.view(plan.slots(), heads), entries.view());
  const host_tensor got_p = entries.download();

  const auto rows = sample_rows(g, seed);
  const csr_graph sub = select_rows(g, rows);
  const host_tensor xs = take_rows(x, rows);
  host_tensor ref_s(dtype::f64, sub.nnz(), heads, 1), ref_p(dtype::f64, sub.nnz(), heads, 1);
  reference::sddmm(sub, xs.view(), y.view(), ref_s.view(), scale);
  const auto es = test::compare(take_entries(g, got_s, rows), ref_s);
  EXPECT_LE(es.relative(), tolerance(in, out)) << "SDDMM max abs " << es.max_abs;
  // Softmax of the kernel's own scores (so SDDMM's rounding does not count twice).
  const host_tensor s_rows = take_entries(g, got_s, rows);
  reference::softmax(sub, s_rows.view(), ref_p.view());
  const auto ep = test::compare(take_entries(g, got_p, rows), ref_p);
  EXPECT_LE(ep.relative(), 4 * unit_roundoff(out) + 1e-6) << "softmax max abs " << ep.max_abs;
}

// Widths (one tile, several, a tail, odd), shared and per-head values, one dtype pair each in
// turn (every pair: tests/generic).
const std::vector<spmm_case>& spmm_cases() {
  static const std::vector<spmm_case> all{
      {dtype::f16, dtype::f32, 8, 1, true},   {dtype::bf16, dtype::f32, 32, 1, false},
      {dtype::f32, dtype::f32, 128, 1, true}, {dtype::f16, dtype::f16, 264, 1, true},
      {dtype::f16, dtype::f32, 64, 2, false}, {dtype::f32, dtype::f32, 5, 1, true},
      {dtype::bf16, dtype::f32, 40, 3, true}};
  return all;
}

TEST(SparseCuda, SpmmEveryWidthAndRowOrderOnRandomPatterns) {
  SKIP_WITHOUT_GPU();
  // Rows grouped as given, clustered (a row map on output) and, on a square pattern, in RCM order.
  const csr_graph rect = test::random_pattern(1003, 777, 40, 11, true);  // K not a multiple of 8
  const csr_graph square = test::random_pattern(1201, 1201, 30, 13, true);
  for (const int vr : {8, 16}) {
    for (const auto& [g, order] :
         {std::pair{&rect, row_order::original}, std::pair{&rect, row_order::clustered},
          std::pair{&square, row_order::rcm}}) {
      SCOPED_TRACE(std::string(to_string(order)) + " rows, vectors " + std::to_string(vr) + "x1");
      const auto plan =
          sparse_plan::build(*g, device_kind::cuda, {.vector_rows = vr, .order = order});
      ASSERT_EQ(plan.report().order, order);
      for (const auto& c : spmm_cases()) check_spmm(plan, *g, c, 7);
    }
  }
}

TEST(SparseCuda, SddmmAndSoftmaxEveryDimAndRowOrder) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(517, 1300, 60, 12, true);
  for (const auto& [vr, order] :
       {std::pair{8, row_order::original}, std::pair{16, row_order::original},
        std::pair{8, row_order::clustered}}) {
    const auto plan = sparse_plan::build(g, device_kind::cuda, {.vector_rows = vr, .order = order});
    // Every dim's chunking, one input dtype each in turn (every pair: tests/generic).
    constexpr dtype kIn[] = {dtype::f16, dtype::bf16, dtype::f32};
    int nth = 0;
    for (const std::int64_t d : {8, 32, 64, 100, 128, 300})
      check_sddmm_softmax(plan, g, kIn[nth++ % 3], dtype::f32, d, 1, 3);
    check_sddmm_softmax(plan, g, dtype::f16, dtype::f16, 64, 2, 4);
    check_sddmm_softmax(plan, g, dtype::bf16, dtype::bf16, 32, 3, 5);
  }
}

// f32 SDDMM: tf32x3 is float32-accurate where plain tf32 is off by its 10-bit rounding.
TEST(SparseCuda, SddmmF32ThreeProductsAreFloatAccurate) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(517, 1300, 60, 13, true);
  for (const std::int64_t d : {8, 64, 300}) {
    SCOPED_TRACE("d" + std::to_string(d));
    host_tensor x(dtype::f32, g.rows, 2, d), y(dtype::f32, g.cols, 2, d);
    x.fill_uniform(-1.0, 1.0, 40 + d);
    y.fill_uniform(-1.0, 1.0, 41 + d);
    test::device_tensor dx(x), dy(y), entries(host_tensor(dtype::f32, g.nnz(), 2, 1));
    const auto rows = sample_rows(g, 42);
    const csr_graph sub = select_rows(g, rows);
    host_tensor ref(dtype::f64, sub.nnz(), 2, 1);
    reference::sddmm(sub, take_rows(x, rows).view(), y.view(), ref.view(), 0.5);
    double error[2] = {};
    for (const f32_math m : {f32_math::tf32, f32_math::tf32x3}) {
      const auto plan = sparse_plan::build(g, device_kind::cuda, {.sddmm_f32 = m});
      slot_tensor s(dtype::f32, plan.slots(), 2);
      s.dev.poison();
      plan.sddmm(dx.view(), dy.view(), s.view(plan.slots(), 2), 0.5);
      entries.poison();
      plan.to_entries(s.view(plan.slots(), 2), entries.view());
      error[m == f32_math::tf32x3] =
          test::compare(take_entries(g, entries.download(), rows), ref).relative();
    }
    // float32 rounding of a d-term dot product of random signs: a few units of 2^-24 sqrt(d).
    EXPECT_LE(error[1], 8 * 0x1p-24 * std::sqrt(static_cast<double>(d))) << "tf32x3";
    EXPECT_GT(error[0], 2e-5) << "plain tf32 should show its rounding";
  }
  EXPECT_THROW(sparse_plan::build(g, device_kind::cuda, {.sddmm_f32 = static_cast<f32_math>(7)}),
               invalid_input);
}

TEST(SparseCuda, SplitWindowsAndAdversarialPatterns) {
  SKIP_WITHOUT_GPU();
  // A dense row, empty rows, a single entry, and every window split into 1-block shares.
  coo_graph coo;
  coo.rows = 2000;
  coo.cols = 5001;
  for (std::int64_t j = 0; j < coo.cols; ++j) {
    coo.src.push_back(3);
    coo.dst.push_back(j);
  }
  coo.src.push_back(1999);
  coo.dst.push_back(5000);
  for (std::int64_t i = 100; i < 900; ++i) {
    for (std::int64_t k = 0; k < 40; ++k) {
      coo.src.push_back(i);
      coo.dst.push_back((i * 37 + k * 101) % coo.cols);
    }
  }
  const csr_graph g = to_csr(coo);
  // (split, team): the plan's rules; 1-block shares; 3-block shares, each on a team of warps (the
  // partial tiles added in shared memory, then merged through memory); teams on every item of a
  // block or more; no teams.
  for (const auto& [split, team] : std::vector<std::pair<std::int32_t, std::int32_t>>{
           {0, 0}, {1, 0}, {3, 1}, {0, 1}, {0, -1}}) {
    for (const int vr : {8, 16}) {
      SCOPED_TRACE("split " + std::to_string(split) + " team " + std::to_string(team));
      const auto plan =
          sparse_plan::build(g, device_kind::cuda,
                             {.vector_rows = vr,
                              .split_blocks = split,
                              .team_blocks = team,
                              .order = split == 3 ? row_order::clustered : row_order::original,
                              .workspace_dim = 264});  // the widest run below
      check_spmm(plan, g, {dtype::f16, dtype::f32, 128, 2, false}, 21);
      check_spmm(plan, g, {dtype::f32, dtype::f32, 264, 1, true}, 22);
      check_spmm(plan, g, {dtype::bf16, dtype::f32, 8, 1, true}, 23);
      check_sddmm_softmax(plan, g, dtype::f16, dtype::f32, 32, 2, 24);
    }
  }
  // Nothing at all: outputs are zeros and nothing reads past the (empty) inputs.
  csr_graph empty;
  empty.rows = 17;
  empty.cols = 9;
  empty.row_ptr.assign(18, 0);
  const auto plan = sparse_plan::build(empty, device_kind::cuda);
  check_spmm(plan, empty, {dtype::f16, dtype::f32, 16, 1, true}, 31);
  check_sddmm_softmax(plan, empty, dtype::f16, dtype::f32, 16, 1, 32);
}

TEST(SparseCuda, EverySharedDataset) {
  SKIP_WITHOUT_GPU();
  const auto graphs = test::dataset_graphs();
  if (graphs.empty()) GTEST_SKIP() << "no shared datasets found: skipping";
  const bool quick = test::quick();
  for (const auto& path : graphs) {
    SCOPED_TRACE(path.filename().string());
    const csr_graph g = read_graph(path);
    const auto plan = sparse_plan::build(g, device_kind::cuda);
    check_spmm(plan, g, {dtype::f16, dtype::f32, 128, 1, true}, 41);
    if (!quick) check_spmm(plan, g, {dtype::f32, dtype::f32, 64, 1, false}, 42);
    check_sddmm_softmax(plan, g, dtype::f16, dtype::f32, 32, 1, 43);
    if (!quick) check_sddmm_softmax(plan, g, dtype::f32, dtype::f32, 64, 1, 44);
  }
}

TEST(SparseCuda, PlanFromDeviceCsrSumsRepeatedEntries) {
  SKIP_WITHOUT_GPU();
  // Row 0: columns 5, 2, 5 (repeated, unsorted) with values 1, 2, 3 -> (0,2)=2, (0,5)=4.
  const std::vector<std::int64_t> row_ptr{0, 3, 3, 4};
  const std::vector<std::int32_t> col_idx{5, 2, 5, 0};
  const std::vector<float> vals{1, 2, 3, 7};
  std::int64_t* d_ptr = nullptr;
  std::int32_t* d_col = nullptr;
  float* d_val = nullptr;
  test::cuda_check(cudaMalloc(&d_ptr, 32), "malloc");
  test::cuda_check(cudaMalloc(&d_col, 16), "malloc");
  test::cuda_check(cudaMalloc(&d_val, 16), "malloc");
  test::cuda_check(cudaMemcpy(d_ptr, row_ptr.data(), 32, cudaMemcpyHostToDevice), "copy");
  test::cuda_check(cudaMemcpy(d_col, col_idx.data(), 16, cudaMemcpyHostToDevice), "copy");
  test::cuda_check(cudaMemcpy(d_val, vals.data(), 16, cudaMemcpyHostToDevice), "copy");
  const auto plan = sparse_plan::build(
      csr_view{.rows = 3, .cols = 6, .nnz = 4, .row_ptr = d_ptr, .col_idx = d_col}, d_val);
  csr_graph merged;
  merged.rows = 3;
  merged.cols = 6;
  merged.row_ptr = {0, 2, 2, 3};
  merged.col_idx = {2, 5, 0};
  merged.values = {2, 4, 7};
  check_spmm(plan, merged, {dtype::f32, dtype::f32, 16, 1, true}, 51);
  // Without values the pattern is binary: a repeated entry is still one entry of value 1.
  const auto binary = sparse_plan::build(
      csr_view{.rows = 3, .cols = 6, .nnz = 4, .row_ptr = d_ptr, .col_idx = d_col});
  merged.values.clear();
  check_spmm(binary, merged, {dtype::f32, dtype::f32, 16, 1, true}, 52);
  EXPECT_THROW(sparse_plan::build(
                   csr_view{.rows = 3, .cols = 5, .nnz = 4, .row_ptr = d_ptr, .col_idx = d_col}),
               invalid_input);  // column 5 out of range
  cudaFree(d_ptr);
  cudaFree(d_col);
  cudaFree(d_val);
}

TEST(SparseCuda, RejectsWrongLayouts) {
  SKIP_WITHOUT_GPU();
  const csr_graph g = test::random_pattern(64, 64, 8, 61);
  const auto plan = sparse_plan::build(g, device_kind::cuda);
  test::device_tensor b(host_tensor(dtype::f16, 64, 1, 32)), c(host_tensor(dtype::f32, 64, 1, 32)),
      wrong(host_tensor(dtype::f32, 63, 1, 32)), f64(host_tensor(dtype::f64, 64, 1, 32));
  EXPECT_THROW(plan.spmm({}, b.view(), wrong.view()), invalid_input);
  EXPECT_THROW(plan.spmm({}, f64.view(), c.view()), not_supported);
  host_tensor rowmajor(dtype::f16, plan.slots(), 2, 1);  // heads inside slots: not the layout
  test::device_tensor rm(rowmajor);
  test::device_tensor b2(host_tensor(dtype::f16, 64, 2, 32)),
      c2(host_tensor(dtype::f32, 64, 2, 32));
  EXPECT_THROW(plan.spmm(rm.view(), b2.view(), c2.view()), invalid_input);
  EXPECT_THROW(plan.sddmm(b.view(), b.view(), c.view()), invalid_input);
}

}  // namespace
}  // namespace trisparse
