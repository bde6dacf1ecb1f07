// SDDMM over ME-BCRS: the one dispatch point where (x's dtype, out's dtype, vector rows, d
// register chunks) become the kernel's template arguments.
#include <cmath>
#include <string>
#include <type_traits>

#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/grid.cuh"
#include "../device_plan.cuh"
#include "kernel.cuh"

namespace trisparse::cuda {

namespace {

template <class T, class O, int kHeight, int kChunks>
void launch(const me_bcrs::sddmm_params& p, cudaStream_t s) {
  const std::int64_t tasks = p.f.num_items * std::int64_t{p.heads};
  if (tasks == 0) return;
  me_bcrs::sddmm_kernel<T, O, kHeight, kChunks>
      <<<blocks_for(tasks, me_bcrs::kSddmmWarps), me_bcrs::kSddmmWarps * 32, 0, s>>>(p);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

// Register chunks of 32 dims: the fewest that hold d, longer d in passes of 256.
int sddmm_chunks(std::int64_t d) { return d <= 32 ? 1 : d <= 64 ? 2 : d <= 128 ? 4 : 8; }

}  // namespace

void run_sddmm(const me_device_plan& plan, const tensor_view& x, const tensor_view& y,
               const tensor_view& out, double scale, bool split_f32, stream_ref stream) {
  me_bcrs::check_device(plan);
  me_bcrs::check_dense_pair(x, plan.f.rows, "x", y, plan.f.cols, "y", "SDDMM");
  TRISPARSE_EXPECTS_INPUT(x.type == y.type, "SDDMM takes x and y in one dtype; got " +
                                                x.describe() + " and " + y.describe());
  if (x.type != dtype::f16 && x.type != dtype::bf16 && x.type != dtype::f32) {
    throw not_supported("SDDMM on CUDA takes f16, bf16 or f32 (tf32), not " +
                        std::string(to_string(x.type)) + " (float64 runs on the CPU)");
  }
  TRISPARSE_EXPECTS_INPUT(std::isfinite(scale), "the SDDMM scale must be finite");
  me_bcrs::check_slots(plan, out, "out", x.heads);
  me_bcrs::sddmm_params p{};
  p.f = plan.ref(plan.sddmm_work);
  p.x = me_bcrs::in_of(x);
  p.y = me_bcrs::in_of(y);
  p.out = me_bcrs::out_of(out);
  p.d = x.dim;
  p.heads = static_cast<std::int32_t>(x.heads);
  p.scale = static_cast<float>(scale);
  p.aligned = me_bcrs::vector_aligned(x) && me_bcrs::vector_aligned(y);
  p.split_f32 = split_f32;
  if (x.heads == 0 || plan.f.slots() == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  with_element_type(x.type, "SDDMM's x", [&]<class T>() {
    with_output_type<T>(out.type, "SDDMM's out", [&]<class O>() {
      with_value<8, 16>(plan.f.vector_rows, "SDDMM's vector rows", [&]<int kHeight>() {
        with_value<1, 2, 4, 8>(sddmm_chunks(p.d), "SDDMM's chunks",
                               [&]<int kChunks>() { launch<T, O, kHeight, kChunks>(p, s); });
      });
    });
  });
}

}  // namespace trisparse::cuda
