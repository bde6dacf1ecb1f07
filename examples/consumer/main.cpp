// The smallest program against the installed library: attention over a sliding-window mask.
#include <cstdio>

#include "trisparse/trisparse.hpp"

int main() {
  using namespace trisparse;
  const csr_graph mask = sliding_window_mask(1000, 8);
  host_tensor q(dtype::f32, 1000, 2, 64), k(dtype::f32, 1000, 2, 64), v(dtype::f32, 1000, 2, 64);
  host_tensor out(dtype::f32, 1000, 2, 64), ref(dtype::f64, 1000, 2, 64);
  q.fill_uniform(-1, 1, 1);
  k.fill_uniform(-1, 1, 2);
  v.fill_uniform(-1, 1, 3);
  const attention_plan plan = attention_plan::build(mask);  // formats built once
  plan.run(q.view(), k.view(), v.view(), out.view());       // then run as often as needed
  reference::attention(mask, q.view(), k.view(), v.view(), ref.view(), effective_scale({}, 64));
  double err = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i)
    err = std::max(err, std::abs(out.get(i) - ref.get(i)));
  std::printf("%s: %lld x %lld mask, %lld nonzeros, max abs error vs float64 %.2g\n",
              std::string(to_string(plan.report().algo)).c_str(), static_cast<long long>(mask.rows),
              static_cast<long long>(mask.cols), static_cast<long long>(mask.nnz()), err);
  return err < 1e-5 ? 0 : 1;
}
