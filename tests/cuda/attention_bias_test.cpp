// The per-entry score bias on CUDA (label gpu; skipped without a device): the row-wise forward
// (out, lse) and the CUDA-core backward (dq, dk, dv, dbias) against the float64 reference, for
// f32, f16 and bf16 inputs, per-head and shared biases, rows and columns cut into chunks (a hub),
// outputs and workspaces poisoned, bitwise repeatable.
#include <cstring>

#include "bias_problem.hpp"
#include "device_tensor.hpp"

namespace trisparse {
namespace {

using test::expect_close;

struct bias_config {
  dtype type;
  std::int64_t heads, dim;
  bool shared;
};

void check(const csr_graph& g, const bias_config& c, std::uint64_t seed) {
  SCOPED_TRACE(std::string(to_string(c.type)) + " h" + std::to_string(c.heads) + " d" +
               std::to_string(c.dim) + (c.shared ? " shared" : " per head"));
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  const test::biased_problem p =
      test::make_biased_problem(g, c.heads, c.dim, c.type, c.shared, scale, seed);
  const auto plan = attention_plan::build(g, device_kind::cuda, {.gradients = true});
  test::device_tensor q(p.q), k(p.k), v(p.v), bias(p.bias), dout(p.dout);
  test::device_tensor out(host_tensor(dtype::f32, g.rows, c.heads, c.dim)),
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
  const double tol = test::gpu_tolerance(c.type, dtype::f32, 8);
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
  const double gtol = test::gpu_tolerance(c.type, dtype::f32, 16);
  expect_close(first_dbias, p.dbias, gtol, "dbias");
  expect_close(dq.download(), p.dq, gtol, "dq");
  expect_close(dk.download(), p.dk, gtol, "dk");
  expect_close(dv.download(), p.dv, gtol, "dv");
}

TEST(GpuAttentionBias, ForwardAndBackwardMatchTheReference) {
  SKIP_WITHOUT_GPU();
  // Empty rows and columns; row 5 and column 3 of 600 entries each (cut into chunks).
  coo_graph coo = to_coo(test::random_pattern(700, 650, 10, 21));
  for (std::int64_t j = 0; j < 600; ++j) {
    coo.src.push_back(5);
    coo.dst.push_back(j);
    coo.src.push_back(j + 50);
    coo.dst.push_back(3);
  }
  const csr_graph g = to_csr(coo);
  std::uint64_t seed = 30;
  for (const bias_config c :
       {bias_config{dtype::f32, 8, 16, false}, bias_config{dtype::f32, 2, 64, true},
        bias_config{dtype::bf16, 8, 16, false}, bias_config{dtype::f16, 2, 64, false},
        bias_config{dtype::bf16, 4, 128, true}})
    check(g, c, seed++);
}

}  // namespace
}  // namespace trisparse
