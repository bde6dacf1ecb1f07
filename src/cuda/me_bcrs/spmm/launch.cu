// SpMM over ME-BCRS: the one dispatch point where (b's dtype, c's dtype, vector rows, feature
// tile) become the kernel's template arguments.
#include <string>

#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../device_plan.cuh"
#include "kernel.cuh"

namespace trisparse::cuda {

namespace {

template <class T, class O, int kHeight, int kTiles>
void launch(const me_bcrs::spmm_params& p, cudaStream_t s) {
  const std::int64_t per_item = std::int64_t{p.heads} * p.chunks;
  const std::int64_t tasks = p.f.num_items * per_item, team_tasks = p.f.team_items * per_item;
  if (tasks == 0) return;
  // One thread block per team task, then one warp per task.
  const std::int64_t grid =
      team_tasks + (tasks - team_tasks + me_bcrs::kSpmmWarps - 1) / me_bcrs::kSpmmWarps;
  me_bcrs::spmm_kernel<T, O, kHeight, kTiles>
      <<<static_cast<unsigned>(grid), me_bcrs::kSpmmWarps * 32, 0, s>>>(p);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

template <class T, class O>
void launch_all(int height, me_bcrs::spmm_params p, cudaStream_t s) {
  const auto go = [&](int tiles) {
    with_value<8, 16>(height, "SpMM's vector rows", [&]<int kHeight>() {
      with_value<1, 2, 4, 8>(tiles, "SpMM's feature tiles",
                             [&]<int kTiles>() { launch<T, O, kHeight, kTiles>(p, s); });
    });
  };
  const int tiles = p.n >= 128 ? 8 : p.n >= 64 ? 4 : p.n >= 32 ? 2 : 1;
  const std::int64_t main_chunks = p.n / (16 * tiles);
  const std::int64_t rest = p.n - main_chunks * 16 * tiles;
  if (main_chunks > 0) {
    p.f_begin = 0;
    p.chunks = static_cast<std::int32_t>(main_chunks);
    go(tiles);
  }
  if (rest > 0) {
    p.f_begin = main_chunks * 16 * tiles;
    p.chunks = 1;
    go(rest <= 16 ? 1 : rest <= 32 ? 2 : rest <= 64 ? 4 : 8);
  }
}

}  // namespace

void run_spmm(const me_device_plan& plan, const tensor_view& values, const tensor_view& b,
              const tensor_view& c, const workspace_view* workspace, stream_ref stream) {
  me_bcrs::check_device(plan);
  me_bcrs::check_dense_pair(b, plan.f.cols, "b", c, plan.f.rows, "c", "SpMM");
  if (b.type != dtype::f16 && b.type != dtype::bf16 && b.type != dtype::f32) {
    throw not_supported("SpMM on CUDA takes b as f16, bf16 or f32 (tf32), not " +
                        std::string(to_string(b.type)) + " (float64 runs on the CPU)");
  }
  const auto s = static_cast<cudaStream_t>(stream.handle);
  me_bcrs::spmm_params p{};
  p.f = plan.ref(plan.spmm_work);
  if (values.data != nullptr || values.rows > 0) {
    me_bcrs::check_slots(plan, values, "values", b.heads);
    TRISPARSE_EXPECTS_INPUT(values.type == b.type, "values " + values.describe() +
                                                       " must have b's dtype (" +
                                                       std::string(to_string(b.type)) + ")");
    p.a = me_bcrs::in_of(values);
  } else {  // the pattern's own values, shared by every head
    with_element_type(b.type, "SpMM's b", [&]<class T>() {
      p.a = {me_bcrs::own_values<T>(plan), 1, 0};
    });
  }
  p.b = me_bcrs::in_of(b);
  p.c = me_bcrs::out_of(c);
  p.n = b.dim;
  p.heads = static_cast<std::int32_t>(b.heads);
  p.aligned = me_bcrs::vector_aligned(b) && me_bcrs::vector_aligned(c);
  if (plan.spmm_work.num_parts > 0 && b.dim > 0) {
    const auto [ws, w] = me_bcrs::use_workspace(plan, b.heads, b.dim, workspace, "SpMM", s);
    p.part = detail::workspace_layout::at<float>(ws, w.part);
    p.split_count = detail::workspace_layout::at<std::int32_t>(ws, w.split_count);
  }
  if (b.dim == 0 || b.heads == 0 || plan.f.rows == 0) return;
  with_element_type(b.type, "SpMM's b", [&]<class T>() {
    with_output_type<T>(c.type, "SpMM's c",
                        [&]<class O>() { launch_all<T, O>(plan.f.vector_rows, p, s); });
  });
}

}  // namespace trisparse::cuda
