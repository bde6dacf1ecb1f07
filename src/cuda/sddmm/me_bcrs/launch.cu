// SDDMM over ME-BCRS: the one dispatch point where (x's dtype, out's dtype, vector rows, d
// register chunks) become the kernel's template arguments.
#include <cmath>
#include <string>
#include <type_traits>

#include "../../common/error.cuh"
#include "../../common/grid.cuh"
#include "../../sparse/device_plan.cuh"
#include "../../sparse/dispatch.cuh"
#include "kernel.cuh"

namespace trisparse::cuda {

namespace {

template <class T, class O, int kHeight, int kChunks>
void launch(const me::sddmm_params& p, cudaStream_t s) {
  const std::int64_t tasks = p.f.num_items * std::int64_t{p.heads};
  if (tasks == 0) return;
  me::sddmm_kernel<T, O, kHeight, kChunks>
      <<<blocks_for(tasks, me::kSddmmWarps), me::kSddmmWarps * 32, 0, s>>>(p);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

template <class T, class O>
void launch_shape(int height, const me::sddmm_params& p, cudaStream_t s) {
  const auto go = [&](auto height_c) {
    constexpr int kHeight = decltype(height_c)::value;
    if (p.d <= 32) return launch<T, O, kHeight, 1>(p, s);
    if (p.d <= 64) return launch<T, O, kHeight, 2>(p, s);
    if (p.d <= 128) return launch<T, O, kHeight, 4>(p, s);
    return launch<T, O, kHeight, 8>(p, s);  // longer d in passes of 256
  };
  if (height == 8)
    go(std::integral_constant<int, 8>{});
  else
    go(std::integral_constant<int, 16>{});
}

}  // namespace

void run_sddmm(const me_device_plan& plan, const tensor_view& x, const tensor_view& y,
               const tensor_view& out, double scale, bool split_f32, stream_ref stream) {
  me::check_device(plan);
  me::check_dense_pair(x, plan.f.rows, "x", y, plan.f.cols, "y", "SDDMM");
  TRISPARSE_EXPECTS_INPUT(
      x.type == y.type && (x.type == dtype::f16 || x.type == dtype::bf16 || x.type == dtype::f32),
      "SDDMM takes x and y in one dtype: f16, bf16 or f32 (tf32); got " + x.describe() + " and " +
          y.describe());
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "the SDDMM scale must be finite");
  me::check_slots(plan, out, "out", x.heads);
  me::sddmm_params p{};
  p.f = plan.ref(plan.sddmm_work);
  p.x = me::in_of(x);
  p.y = me::in_of(y);
  p.out = me::out_of(out);
  p.d = x.dim;
  p.heads = static_cast<std::int32_t>(x.heads);
  p.scale = static_cast<float>(scale);
  p.aligned = me::vector_aligned(x) && me::vector_aligned(y);
  p.split_f32 = split_f32;
  if (x.heads == 0 || plan.f.slots() == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  me::with_element_type(x.type, "SDDMM's x", [&](auto x_t) {
    using T = decltype(x_t);
    me::with_output_type<T>(out.type, "SDDMM's out", [&](auto o_t) {
      launch_shape<T, decltype(o_t)>(plan.f.vector_rows, p, s);
    });
  });
}

}  // namespace trisparse::cuda
