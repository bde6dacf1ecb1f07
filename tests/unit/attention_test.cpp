// Every CPU attention path against the float64 reference, typed over the input dtype.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "support.hpp"

namespace trisparse {
namespace {

// The fused fp32 engine against the float64 reference on the same (rounded) inputs: fp32 compute
// error only, plus the output's rounding. Every dtype pair and head dim is in tests/generic; here
// the pattern's sizes and degrees vary.
void expect_fused_matches_reference(const csr_graph& g, std::int64_t heads, std::int64_t dim,
                                    dtype in, dtype out_t, std::uint64_t seed) {
  const auto x = test::random_qkv(g, heads, dim, in, seed);
  host_tensor ref(dtype::f64, g.rows, heads, dim), out(out_t, g.rows, heads, dim);
  out.fill(std::numeric_limits<double>::quiet_NaN());  // poison
  const double s = effective_scale({}, dim);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), ref.view(), s);
  cpu::fused_attention(g, x.q.view(), x.k.view(), x.v.view(), out.view(), static_cast<float>(s));
  const auto e = test::compare(out, ref);
  EXPECT_TRUE(e.finite);
  EXPECT_LE(e.relative(), 1e-5 + 2 * unit_roundoff(out_t)) << "abs " << e.max_abs;
}

TEST(Attention, FusedMatchesReferenceOnManySizesAndDegrees) {
  std::uint64_t seed = 100;
  for (const std::int64_t n : {1, 17, 100, 1000}) {
    for (const std::int64_t deg : {0, 1, 5, 70}) {
      SCOPED_TRACE("n " + std::to_string(n) + " max degree " + std::to_string(deg));
      ++seed;
      expect_fused_matches_reference(test::random_pattern(n, n, deg, seed), 1, 32,
                                     seed % 2 ? dtype::bf16 : dtype::f32, dtype::f32, seed);
    }
  }
  // Multi-head and rectangular.
  expect_fused_matches_reference(test::random_pattern(123, 457, 40, 7), 4, 64, dtype::f16,
                                 dtype::f16, 9);
}

TEST(Attention, CudaHeadDimsNameThisBuildsKernels) {
  const std::vector<std::int64_t> dims = cuda_head_dims();
  EXPECT_FALSE(dims.empty());
  EXPECT_TRUE(std::is_sorted(dims.begin(), dims.end()));
  for (const std::int64_t d : dims) EXPECT_TRUE(d == 32 || d == 64 || d == 128 || d == 256) << d;
}

TEST(Attention, Fused3sReferenceOverBsbEqualsTheUnfusedReference) {
  for (const int c : {8, 16}) {
    const csr_graph g = generate_rmat({.scale = 10, .edge_factor = 6, .seed = 4});
    const auto x = test::random_qkv(g, 2, 16, dtype::f32, 3);
    host_tensor a(dtype::f64, g.rows, 2, 16), b(dtype::f64, g.rows, 2, 16);
    reference::attention(g, x.q.view(), x.k.view(), x.v.view(), a.view(), 0.25);
    reference::blocked_attention(build_bsb(g, c), x.q.view(), x.k.view(), x.v.view(), b.view(),
                                 0.25);
    EXPECT_LE(test::compare(b, a).relative(), 1e-13);
  }
}

TEST(Attention, StridedViewsAreHonoured) {
  const csr_graph g = test::random_pattern(50, 60, 8, 2);
  const auto x = test::random_qkv(g, 2, 16, dtype::f32, 5);
  // q with padded rows: [50, 2, 16] inside a [50, 40] buffer.
  std::vector<float> padded(50 * 40, std::nanf(""));
  for (std::int64_t r = 0; r < 50; ++r) {
    for (std::int64_t i = 0; i < 32; ++i)
      padded[r * 40 + i] = static_cast<float>(x.q.get(r * 32 + i));
  }
  tensor_view q = tensor_view::contiguous(padded.data(), dtype::f32, 50, 2, 16);
  q.row_stride = 40;
  host_tensor ref(dtype::f64, 50, 2, 16), out(dtype::f32, 50, 2, 16);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), ref.view(), 0.5);
  cpu::fused_attention(g, q, x.k.view(), x.v.view(), out.view(), 0.5f);
  EXPECT_LE(test::compare(out, ref).relative(), 1e-5);
}

TEST(Attention, EmptyRowsGiveZerosNeverNan) {
  csr_graph g = test::random_pattern(64, 64, 3, 8);
  g = preprocess(g, {});
  const auto x = test::random_qkv(g, 1, 8, dtype::f32, 1);
  host_tensor out(dtype::f32, 64, 1, 8);
  out.fill(std::nan(""));
  cpu::fused_attention(g, x.q.view(), x.k.view(), x.v.view(), out.view(), 1.0f);
  for (std::int64_t r = 0; r < 64; ++r) {
    if (g.degree(r) != 0) continue;
    for (std::int64_t d = 0; d < 8; ++d) EXPECT_EQ(out.get(r * 8 + d), 0.0);
  }
  EXPECT_TRUE(test::compare(out, out).finite);
}

TEST(Attention, HugeScoresDoNotOverflow) {
  // Scores near 1e4: exp without max-subtraction would overflow.
  const csr_graph g = test::random_pattern(200, 200, 30, 9);
  auto x = test::random_qkv(g, 1, 16, dtype::f32, 2, 0.0, 1.0);
  for (std::int64_t i = 0; i < x.q.numel(); ++i) x.q.set(i, 25.0 + x.q.get(i));
  for (std::int64_t i = 0; i < x.k.numel(); ++i) x.k.set(i, 25.0 + x.k.get(i));
  host_tensor ref(dtype::f64, 200, 1, 16), out(dtype::f32, 200, 1, 16);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), ref.view(), 1.0);
  cpu::fused_attention(g, x.q.view(), x.k.view(), x.v.view(), out.view(), 1.0f);
  const auto e = test::compare(out, ref);
  EXPECT_TRUE(e.finite);
  // Scores ~1e4 carry fp32 rounding of ~1e4 * 2^-24 * sqrt(16) in the exponent.
  EXPECT_LE(e.relative(), 1e-2);
}

TEST(Attention, PlanRunsEveryCpuAlgorithmAndChecksArguments) {
  const csr_graph g = test::random_pattern(90, 90, 12, 4, true);  // values are ignored
  const auto x = test::random_qkv(g, 2, 32, dtype::f16, 6);
  host_tensor ref(dtype::f64, 90, 2, 32);
  reference::attention(g, x.q.view(), x.k.view(), x.v.view(), ref.view(), 1 / std::sqrt(32.0));
  for (const auto algo : {algorithm::blocked_reference, algorithm::fused}) {
    const attention_plan plan = attention_plan::build(g, device_kind::cpu, {.algo = algo});
    EXPECT_EQ(plan.report().algo, algo);
    host_tensor out(dtype::f32, 90, 2, 32);
    plan.run(x.q.view(), x.k.view(), x.v.view(), out.view());
    EXPECT_LE(test::compare(out, ref).relative(), 1e-5) << to_string(algo);
  }
  const attention_plan plan = attention_plan::build(g);
  EXPECT_EQ(plan.report().algo, algorithm::fused);
  host_tensor bad(dtype::f32, 91, 2, 32);
  EXPECT_THROW(plan.run(x.q.view(), x.k.view(), x.v.view(), bad.view()), invalid_input);
  tensor_view on_gpu = x.k.view();
  on_gpu.where = device_kind::cuda;
  host_tensor out(dtype::f32, 90, 2, 32);
  EXPECT_THROW(plan.run(x.q.view(), on_gpu, x.v.view(), out.view()), invalid_input);
  EXPECT_THROW(plan.run(x.q.view(), x.k.view(), x.v.view(), out.view(),
                        {.algo = algorithm::blocked_reference}),
               invalid_input);
  EXPECT_THROW(plan.run(x.q.view(), x.k.view(), x.v.view(), out.view(), {.scale = std::nan("")}),
               invalid_input);
  // Attention dropout is drawn by the segment kernels only: a graph plan names that.
  const std::uint64_t state[2] = {1, 2};
  EXPECT_THROW(plan.run(x.q.view(), x.k.view(), x.v.view(), out.view(), {.dropout = {0.1, state}}),
               not_supported);
  EXPECT_NO_THROW(
      plan.run(x.q.view(), x.k.view(), x.v.view(), out.view(), {.dropout = {0.0, state}}));
  // Methods the CPU has none of: unfused and block run on CUDA only.
  EXPECT_THROW(attention_plan::build(g, device_kind::cpu, {.algo = algorithm::unfused}),
               invalid_input);
  EXPECT_THROW(attention_plan::build(g, device_kind::cpu, {.algo = algorithm::block}),
               invalid_input);
  EXPECT_EQ(parse_algorithm("fused"), algorithm::fused);
  EXPECT_THROW(parse_algorithm("cpu_fused"), invalid_input);
  EXPECT_THROW(parse_algorithm("reference"), invalid_input);  // the oracle: trisparse::reference
  EXPECT_TRUE(runs_on(algorithm::fused, device_kind::cpu));
  EXPECT_TRUE(runs_on(algorithm::fused, device_kind::cuda));
  EXPECT_FALSE(runs_on(algorithm::blocked_reference, device_kind::cuda));
  EXPECT_EQ(backend_name(algorithm::fused, device_kind::cuda), "cuda_fused3s");
  EXPECT_EQ(backend_name(algorithm::fused, device_kind::cpu), "cpu_fused");
  EXPECT_EQ(backend_name(algorithm::unfused, device_kind::cuda), "cuda_me_bcrs");
  EXPECT_EQ(backend_name(algorithm::fused, device_kind::cpu, true), "cpu_block");
  EXPECT_EQ(backend_name(algorithm::unfused, device_kind::cuda, true), "cuda_block_unfused");
}

// CUDA plans over graph patterns index entries in 32 bits: a pattern past 2^31 - 1 entries is
// refused before anything is read or built, with the limit and the count named (the views'
// arrays are never touched, so none is allocated here).
TEST(Attention, CudaPlansNameTheEntryLimit) {
  const std::int64_t too_many = std::int64_t{1} << 31;
  const std::int64_t row_ptr[2] = {0, too_many};
  const std::int32_t col = 0;
  const csr_view huge{.rows = 1, .cols = 1, .nnz = too_many, .row_ptr = row_ptr, .col_idx = &col};
  const auto expect_named = [](const auto& build, const char* plan) {
    try {
      build();
      ADD_FAILURE() << plan << " took a pattern of 2^31 entries";
    } catch (const invalid_input& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(plan), std::string::npos) << what;
      EXPECT_NE(what.find("2^31 - 1"), std::string::npos) << what;
      EXPECT_NE(what.find("2147483648"), std::string::npos) << what;
    }
  };
  expect_named([&] { (void)attention_plan::build(huge, {.gradients = true}); }, "attention_plan");
  expect_named([&] { (void)sparse_plan::build(huge, nullptr); }, "sparse_plan");
}

TEST(Attention, ReferenceSddmmSoftmaxSpmmAgreeWithHandComputation) {
  // Row 0 attends to columns 0 and 1 with scores 1 and 3 (scale 1): weights 1/(1+e^2), e^2/(1+e^2).
  csr_graph g{.rows = 2, .cols = 2, .row_ptr = {0, 2, 2}, .col_idx = {0, 1}, .values = {}};
  host_tensor q(dtype::f64, 2, 1, 1), k(dtype::f64, 2, 1, 1), v(dtype::f64, 2, 1, 1),
      out(dtype::f64, 2, 1, 1);
  q.set(0, 1.0);
  k.set(0, 1.0);
  k.set(1, 3.0);
  v.set(0, 10.0);
  v.set(1, 20.0);
  reference::attention(g, q.view(), k.view(), v.view(), out.view(), 1.0);
  const double w1 = std::exp(2.0) / (1 + std::exp(2.0));
  EXPECT_NEAR(out.get(0), 10 * (1 - w1) + 20 * w1, 1e-12);
  EXPECT_EQ(out.get(1), 0.0);
}

}  // namespace
}  // namespace trisparse
