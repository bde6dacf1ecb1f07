// The per-entry score bias on CUDA (label gpu; skipped without a device): the forward (out, lse)
// and the backward (dq, dk, dv, dbias) against the float64 reference, for f32, f16 and bf16
// inputs, per-head and shared biases, rows and columns cut into chunks (a hub), outputs and
// workspaces poisoned, bitwise repeatable. The row-wise forward takes f32 inputs, an f32 out and
// head dims the tensor cores do not; 16-bit inputs with out in their dtype take the fused 3S
// kernel (split windows, teams, windows in RCM order), and the backward the tensor-core dq pass
// where its head dims and alignment allow, else the CUDA-core kernels.
#include <cstring>

#include "bias_problem.hpp"
#include "device_tensor.hpp"

namespace trisparse {
namespace {

using test::expect_close;

// t rounded to `to`.
host_tensor cast(const host_tensor& t, dtype to) {
  host_tensor r(to, t.rows(), t.heads(), t.dim());
  for (std::int64_t i = 0; i < t.numel(); ++i) r.set(i, t.get(i));
  return r;
}

struct bias_config {
  dtype type;
  std::int64_t heads, dim;
  bool shared;
  dtype out = dtype::f32;  // out's and dout's dtype
};

void check(const csr_graph& g, const bias_config& c, std::uint64_t seed,
           plan_options options = {.gradients = true}) {
  SCOPED_TRACE(std::string(to_string(c.type)) + " h" + std::to_string(c.heads) + " d" +
               std::to_string(c.dim) + (c.shared ? " shared" : " per head") + " out " +
               std::string(to_string(c.out)));
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  const test::biased_problem p =
      test::make_biased_problem(g, c.heads, c.dim, c.type, c.shared, scale, seed);
  const auto plan = attention_plan::build(g, device_kind::cuda, options);
  test::device_tensor q(p.q), k(p.k), v(p.v), bias(p.bias), dout(cast(p.dout, c.out));
  test::device_tensor out(host_tensor(c.out, g.rows, c.heads, c.dim)),
      lse(host_tensor(dtype::f32, g.rows, c.heads, 1));
  const std::size_t fwd_bytes = plan.workspace_bytes(c.heads, c.dim),
                    bwd_bytes = plan.backward_workspace_bytes(c.heads, c.dim);
  test::device_tensor ws(host_tensor(
      dtype::f32, static_cast<std::int64_t>(std::max(fwd_bytes, bwd_bytes) / 4 + 1), 1, 1));
  host_tensor got_out, got_lse;
  test::run_twice_identically(
      out,
      [&] {
        lse.poison();
        ws.poison();
        plan.run(q.view(), k.view(), v.view(), out.view(),
                 {.scale = scale, .lse = lse.view(), .bias = bias.view()}, {},
                 {ws.view().data, fwd_bytes});
      },
      got_out);
  got_lse = lse.download();
  const double tol = test::gpu_tolerance(c.type, c.out, 8);
  expect_close(got_out, p.out, tol, "out");
  const auto [lse_got, lse_want] = test::finite_lse(got_lse, p.lse);
  expect_close(lse_got, lse_want, 1e-5, "lse");

  test::device_tensor dq(host_tensor(dtype::f32, g.rows, c.heads, c.dim)),
      dk(host_tensor(dtype::f32, g.cols, c.heads, c.dim)),
      dv(host_tensor(dtype::f32, g.cols, c.heads, c.dim)),
      dbias(host_tensor(dtype::f32, g.nnz(), c.heads, 1));
  host_tensor first_dbias;
  test::run_twice_identically(
      dbias,
      [&] {
        for (test::device_tensor* t : {&dq, &dk, &dv, &ws}) t->poison();
        plan.backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), dq.view(),
                      dk.view(), dv.view(),
                      {.scale = scale, .bias = bias.view(), .dbias = dbias.view()}, {},
                      {ws.view().data, bwd_bytes});
      },
      first_dbias);
  const double gtol = test::gpu_tolerance(c.type, c.out, 16);
  expect_close(first_dbias, p.dbias, gtol, "dbias");
  expect_close(dq.download(), p.dq, gtol, "dq");
  expect_close(dk.download(), p.dk, gtol, "dk");
  expect_close(dv.download(), p.dv, gtol, "dv");
}

TEST(GpuAttentionBias, ForwardAndBackwardMatchTheReference) {
  SKIP_WITHOUT_GPU();
  // Empty rows and columns; row 5 and column 3 of 600 entries each (cut into chunks).
  const csr_graph g = test::pattern_with_hubs(700, 650, 10, 600, 21);
  std::uint64_t seed = 30;
  for (const bias_config c :
       {bias_config{dtype::f32, 8, 16, false}, bias_config{dtype::f32, 2, 64, true},
        bias_config{dtype::bf16, 8, 16, false}, bias_config{dtype::f16, 2, 64, false},
        bias_config{dtype::bf16, 4, 128, true}})
    check(g, c, seed++);
}

// 16-bit inputs with out in their dtype: the fused 3S forward takes the bias (head dims 32-128),
// its windows in the pattern's order and cut (split windows, teams) and in RCM order (a banded
// pattern whose rows are shuffled); the tensor-core dq pass takes it in the backward.
TEST(GpuAttentionBias, OnTheTensorCores) {
  SKIP_WITHOUT_GPU();
  const csr_graph hub = test::pattern_with_hubs(700, 650, 10, 600, 22);
  const csr_graph banded = test::shuffled_band(3000, 10, 33);
  ASSERT_NE(attention_plan::build(banded, device_kind::cuda).report().format.find("RCM"),
            std::string::npos);
  std::uint64_t seed = 60;
  for (const bias_config c : {bias_config{dtype::f16, 4, 64, false, dtype::f16},
                              bias_config{dtype::bf16, 2, 128, true, dtype::bf16},
                              bias_config{dtype::bf16, 8, 32, false, dtype::bf16}}) {
    check(hub, c, seed++);
    check(hub, c, seed++, {.split_tcbs = 3, .gradients = true});
    check(hub, c, seed++, {.split_tcbs = 1 << 30, .team_tcbs = 2, .gradients = true});
    check(banded, c, seed++);
  }
}

}  // namespace
}  // namespace trisparse
