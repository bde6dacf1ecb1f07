#pragma once
// Test helper: a biased attention problem (attention_options::bias) with the float64 reference's
// forward (out, lse) and gradients (dq, dk, dv, dbias), for the CPU and GPU tests of every backend.
#include <utility>

#include "support.hpp"

namespace trisparse::test {

struct biased_problem {
  host_tensor q, k, v, bias, dout;
  host_tensor out, lse, dq, dk, dv, dbias;  // the float64 reference's
};

/// q, k, v in `t` over [-1, 1], a bias ([nnz, H, 1], or [nnz, 1, 1] when `shared`) in f32 over
/// [-3, 3] (so that it moves the softmax well past rounding), dout over [-1, 1].
inline biased_problem make_biased_problem(const csr_graph& g, std::int64_t heads, std::int64_t dim,
                                          dtype t, bool shared, double scale, std::uint64_t seed) {
  const qkv x = random_qkv(g, heads, dim, t, seed);
  biased_problem p{x.q,
                   x.k,
                   x.v,
                   host_tensor(dtype::f32, g.nnz(), shared ? 1 : heads, 1),
                   host_tensor(dtype::f32, g.rows, heads, dim),
                   host_tensor(dtype::f64, g.rows, heads, dim),
                   host_tensor(dtype::f64, g.rows, heads, 1),
                   host_tensor(dtype::f64, g.rows, heads, dim),
                   host_tensor(dtype::f64, g.cols, heads, dim),
                   host_tensor(dtype::f64, g.cols, heads, dim),
                   host_tensor(dtype::f64, g.nnz(), heads, 1)};
  p.bias.fill_uniform(-3.0, 3.0, seed + 7);
  p.dout.fill_uniform(-1.0, 1.0, seed + 8);
  reference::attention(g, p.q.view(), p.k.view(), p.v.view(), p.out.view(), scale, p.lse.view(),
                       p.bias.view());
  reference::attention_backward(g, p.q.view(), p.k.view(), p.v.view(), p.dout.view(), p.dq.view(),
                                p.dk.view(), p.dv.view(), scale, p.dbias.view(), p.bias.view());
  return p;
}

/// got and want with the -inf of empty rows set to 0 where both have it (a -inf in one alone
/// stays, and shows as an error); for comparing log-sum-exps.
inline std::pair<host_tensor, host_tensor> finite_lse(host_tensor got, host_tensor want) {
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    if (std::isinf(want.get(i)) && want.get(i) < 0 && got.get(i) == want.get(i)) {
      got.set(i, 0.0);
      want.set(i, 0.0);
    }
  }
  return {std::move(got), std::move(want)};
}

}  // namespace trisparse::test
