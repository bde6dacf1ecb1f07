// The per-entry score bias (attention_options::bias) on the CPU: the fused engine's forward (out,
// lse) and backward (dq, dk, dv, dbias) against the float64 reference, per-head and shared biases,
// bitwise repeatable; a zero bias changes nothing; bad biases are named.
#include <cstring>

#include "bias_problem.hpp"

namespace trisparse {
namespace {

void expect_close(const host_tensor& got, const host_tensor& want, double tol, const char* what) {
  const test::error_report e = test::compare(got, want);
  EXPECT_TRUE(e.finite) << what;
  EXPECT_LE(e.max_abs, tol * e.max_ref) << what << ": max abs " << e.max_abs << " of " << e.max_ref;
}

TEST(AttentionBias, TheCpuEngineMatchesTheReference) {
  const csr_graph g = test::random_pattern(90, 70, 12, 3);  // empty rows and columns
  const auto plan = attention_plan::build(g, device_kind::cpu, {.gradients = true});
  for (const bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared" : "per head");
    const double scale = 0.3;
    const test::biased_problem p =
        test::make_biased_problem(g, 3, 16, dtype::f32, shared, scale, 9);
    host_tensor out(dtype::f32, g.rows, 3, 16), lse(dtype::f32, g.rows, 3, 1);
    plan.run(p.q.view(), p.k.view(), p.v.view(), out.view(),
             {.scale = scale, .lse = lse.view(), .bias = p.bias.view()});
    expect_close(out, p.out, 1e-5, "out");
    const auto [lse_got, lse_want] = test::finite_lse(lse, p.lse);
    expect_close(lse_got, lse_want, 1e-5, "lse");
    host_tensor dq(dtype::f32, g.rows, 3, 16), dk(dtype::f32, g.cols, 3, 16),
        dv(dtype::f32, g.cols, 3, 16), dbias(dtype::f32, g.nnz(), 3, 1);
    const auto backward = [&] {
      plan.backward(p.q.view(), p.k.view(), p.v.view(), out.view(), lse.view(), p.dout.view(),
                    dq.view(), dk.view(), dv.view(),
                    {.scale = scale, .bias = p.bias.view(), .dbias = dbias.view()});
    };
    backward();
    for (const auto& [got, want, what] :
         {std::tuple{&dq, &p.dq, "dq"}, std::tuple{&dk, &p.dk, "dk"}, std::tuple{&dv, &p.dv, "dv"},
          std::tuple{&dbias, &p.dbias, "dbias"}})
      expect_close(*got, *want, 1e-4, what);
    const host_tensor first = dbias;
    backward();
    EXPECT_EQ(std::memcmp(first.data(), dbias.data(), first.size_bytes()), 0);
  }
}

TEST(AttentionBias, AZeroBiasChangesNothingAndBadBiasesAreNamed) {
  const csr_graph g = test::random_pattern(40, 40, 6, 4);
  const auto plan = attention_plan::build(g);
  const test::qkv x = test::random_qkv(g, 2, 8, dtype::f32, 5);
  host_tensor a(dtype::f32, g.rows, 2, 8), b(dtype::f32, g.rows, 2, 8),
      zero(dtype::f32, g.nnz(), 2, 1);
  plan.run(x.q.view(), x.k.view(), x.v.view(), a.view());
  plan.run(x.q.view(), x.k.view(), x.v.view(), b.view(), {.bias = zero.view()});
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size_bytes()), 0);
  host_tensor wrong_rows(dtype::f32, g.nnz() + 1, 2, 1), wrong_heads(dtype::f32, g.nnz(), 3, 1);
  for (const host_tensor* bad : {&wrong_rows, &wrong_heads}) {
    try {
      plan.run(x.q.view(), x.k.view(), x.v.view(), a.view(), {.bias = bad->view()});
      ADD_FAILURE() << "a bias of the wrong shape was taken";
    } catch (const invalid_input& e) {
      EXPECT_NE(std::string(e.what()).find("bias"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace trisparse
