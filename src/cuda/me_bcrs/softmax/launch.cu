// Row softmax over ME-BCRS slot values: the one dispatch point where (in dtype, out dtype,
// vector rows) become the kernel's template arguments.
#include <string>

#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/grid.cuh"
#include "../device_plan.cuh"
#include "kernel.cuh"

namespace trisparse::cuda {

namespace {

template <class In, class Out, int kHeight>
void launch(const me_bcrs::softmax_params& p, bool split, cudaStream_t s) {
  const std::int64_t tasks = p.f.num_items * std::int64_t{p.heads};
  if (tasks == 0) return;
  const unsigned grid = blocks_for(tasks, me_bcrs::kSoftmaxWarps);
  me_bcrs::softmax_kernel<In, Out, kHeight, false><<<grid, me_bcrs::kSoftmaxWarps * 32, 0, s>>>(p);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  if (split) {
    me_bcrs::softmax_kernel<In, Out, kHeight, true><<<grid, me_bcrs::kSoftmaxWarps * 32, 0, s>>>(p);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void run_softmax(const me_device_plan& plan, const tensor_view& in, const tensor_view& out,
                 const workspace_view* workspace, stream_ref stream) {
  me_bcrs::check_device(plan);
  me_bcrs::check_slots(plan, in, "scores", in.heads);
  me_bcrs::check_slots(plan, out, "out", in.heads);
  me_bcrs::softmax_params p{};
  p.f = plan.ref(plan.softmax_work);
  p.in = me_bcrs::in_of(in);
  p.out = me_bcrs::out_of(out);
  p.heads = static_cast<std::int32_t>(in.heads);
  const bool split = plan.softmax_work.num_parts > 0;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (split) {
    const auto [ws, w] = me_bcrs::use_workspace(plan, in.heads, 1, workspace, "softmax", s);
    p.part_stats = detail::workspace_layout::at<float>(ws, w.part_stats);
  }
  if (in.heads == 0 || plan.f.slots() == 0) return;
  with_element_type(in.type, "softmax's scores", [&]<class In>() {
    with_element_type(out.type, "softmax's out", [&]<class Out>() {
      with_value<8, 16>(plan.f.vector_rows, "softmax's vector rows",
                        [&]<int kHeight>() { launch<In, Out, kHeight>(p, split, s); });
    });
  });
}

}  // namespace trisparse::cuda
