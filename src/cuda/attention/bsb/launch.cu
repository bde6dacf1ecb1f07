// The fused 3S backend's one dispatch point: run-time (dtype, head dim, output dtype) become the
// kernel's template arguments here and nowhere else.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/error.cuh"
#include "../../common/layout.hpp"
#include "../../common/work_list.cuh"
#include "../../formats/bsb_build.cuh"
#include "kernel.cuh"
#include "plan.hpp"
#include "schedule.hpp"

namespace trisparse::cuda {

struct fused3s_device_plan {
  int device = 0, sms = 0;
  std::int64_t rows = 0, cols = 0;
  device_buffer<std::int64_t> row_map;         // empty: windows hold rows in the caller's order
  mutable device_buffer<std::uint64_t> queue;  // the kernel's task queue (zero between runs)
  device_buffer<std::int32_t> col_idx;
  device_buffer<std::uint64_t> bitmap;
  device_buffer<fused3s::work_item> items;
  device_buffer<fused3s::split_window> splits;
  std::int32_t num_items = 0, num_splits = 0, num_parts = 0;
  std::int64_t tcbs = 0;
  fused3s::item_list host_items;  // the items' TCB counts (decreasing) and splits, on the host
  std::int32_t team_tcbs = 0;     // fused3s_limits::team_tcbs
  // Team items chosen per (heads, resident blocks, warps per block) launched so far (the model's
  // replay is not redone per call).
  mutable std::mutex teams_mutex;
  mutable std::map<std::tuple<std::int64_t, std::int64_t, int>, std::int32_t> teams;
  // Partial states of split windows, sized for the largest heads x head_dim run so far.
  mutable std::mutex workspace_mutex;
  mutable device_buffer<float> part_o, part_ml;
  mutable device_buffer<std::int32_t> split_count;  // zero between launches
};

namespace {

constexpr int kWarps = 4;
// Resident blocks of kWarps per SM the register budget is held to (65536 / (blocks * 128) regs).
// At D = 128 three blocks (168 registers) spill and measured 1.2-1.6x slower than two (H200,
// docs/notes/fused3s.md); D <= 64 fits four without spilling.
template <int D>
constexpr int kMinBlocks = D <= 64    ? 4
                           : D == 128 ? 2
                                      : 1;

/// How many of the largest items run on teams with `blocks` resident blocks of `warps` warps: as
/// the schedule model chooses (schedule.hpp), or, with a positive team_tcbs, every item of at least
/// that many TCBs.
std::int32_t team_items(const fused3s_device_plan& plan, std::int64_t heads, std::int64_t blocks,
                        int warps) {
  if (plan.team_tcbs < 0 || heads <= 0) return 0;
  if (plan.team_tcbs > 0)
    return static_cast<std::int32_t>(fused3s::at_least(plan.host_items, plan.team_tcbs));
  std::lock_guard<std::mutex> lock(plan.teams_mutex);
  const auto [at, added] = plan.teams.try_emplace({heads, blocks, warps}, 0);
  if (added)
    at->second = static_cast<std::int32_t>(
        fused3s::choose_team_items(plan.host_items, heads, blocks, warps));
  return at->second;
}

template <class T, int D, class O, int kBlocks, int kBlockWarps = kWarps>
void launch_blocks(const fused3s::params& p, const fused3s_device_plan& plan, cudaStream_t s) {
  const auto kernel = fused3s::fused3s_kernel<T, D, O, kBlockWarps, kBlocks>;
  constexpr int kTeamBytes = fused3s::team_words<D>(kBlockWarps) * static_cast<int>(sizeof(float));
  // Persistent warps: no more blocks than fit at once (the occupancy of this instantiation with
  // the teams' shared memory, on the first device it runs on).
  static const int resident = [&] {
    TRISPARSE_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTeamBytes));
    int blocks = 0;
    TRISPARSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel,
                                                                     kBlockWarps * 32, kTeamBytes));
    return std::max(blocks, 1);
  }();
  const int sms = plan.sms;
  fused3s::params q = p;
  q.team_items = team_items(plan, p.heads, std::int64_t{resident} * sms, kBlockWarps);
  const std::int64_t tasks = std::int64_t{p.num_items} * p.heads;
  const std::int64_t team_tasks = std::int64_t{q.team_items} * p.heads;
  if (tasks > 0) {
    // A block per team task, then a warp per other task, if that fits at once; else persistent.
    const std::int64_t one_each = team_tasks + (tasks - team_tasks + kBlockWarps - 1) / kBlockWarps;
    const auto grid =
        static_cast<unsigned>(std::min<std::int64_t>(one_each, std::int64_t{resident} * sms));
    q.use_queue = one_each > grid;
    // Shared memory only with teams: without, the L1 cache keeps all of it for K and V rows.
    const int shared = team_tasks > 0 ? kTeamBytes : 0;
    kernel<<<grid, kBlockWarps * 32, shared, s>>>(q);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
}

// At D = 128, 12 warps per SM (rows not loaded a TCB ahead, to fit 168 registers) where that runs
// every task at once and 8 would not: tasks between the warp slots of two and of three 4-warp
// blocks, all short (at most kShortItem TCBs). Batches of small graphs like tu_enzymes (1,224
// windows of at most 7 TCBs: two rounds of tasks become one) measured 4.5% faster on three 4-warp
// blocks; with more tasks than three blocks' slots they measured 1-3.5% slower, and with longer
// items 3-22% slower. The warps run as six blocks of two, 4% faster on tu_enzymes (H200,
// docs/notes/fused3s.md); likely because 612 blocks of 2 warps spread over 132 SMs more evenly
// than 306 of 4 (8-10 warps per SM instead of 8-12).
constexpr std::int32_t kShortItem = 8;

template <class T, int D, class O>
void launch(const fused3s::params& p, const fused3s_device_plan& plan, cudaStream_t s) {
  if constexpr (D == 128) {
    const std::int64_t tasks = std::int64_t{p.num_items} * p.heads;
    const std::int64_t block_warps = std::int64_t{kWarps} * plan.sms;
    const auto& sizes = plan.host_items.tcbs;
    if (!sizes.empty() && sizes.front() <= kShortItem && tasks > kMinBlocks<D> * block_warps &&
        tasks <= 3 * block_warps) {
      return launch_blocks<T, D, O, 6, 2>(p, plan, s);
    }
  }
  launch_blocks<T, D, O, kMinBlocks<D>>(p, plan, s);
}

template <class T, int D>
void launch_out(dtype out, const fused3s::params& p, const fused3s_device_plan& plan,
                cudaStream_t s) {
  switch (out) {
    case dtype::f32:
      return launch<T, D, float>(p, plan, s);
    case dtype::f16:
      return launch<T, D, __half>(p, plan, s);
    case dtype::bf16:
      return launch<T, D, __nv_bfloat16>(p, plan, s);
    default:
      throw invalid_input("fused 3S writes f32, f16 or bf16 output, not " +
                          std::string(to_string(out)));
  }
}

template <class T>
void launch_dim(std::int64_t d, dtype out, const fused3s::params& p,
                const fused3s_device_plan& plan, cudaStream_t s) {
  switch (d) {
    case 32:
      return launch_out<T, 32>(out, p, plan, s);
    case 64:
      return launch_out<T, 64>(out, p, plan, s);
    case 128:
      return launch_out<T, 128>(out, p, plan, s);
    case 256:
      return launch_out<T, 256>(out, p, plan, s);
    default:
      throw invalid_input("fused 3S supports head_dim 32, 64, 128 or 256, not " +
                          std::to_string(d));
  }
}

std::shared_ptr<fused3s_device_plan> plan_from(device_bsb f, fused3s_limits limits,
                                               cudaStream_t s) {
  auto plan = std::make_shared<fused3s_device_plan>();
  const device_id_and_sms here = current_device();
  plan->device = here.device;
  plan->sms = here.sms;
  const int sms = plan->sms;
  plan->queue = device_buffer<std::uint64_t>(3);
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(plan->queue.data(), 0, plan->queue.bytes(), s));
  plan->rows = f.rows;
  plan->cols = f.cols;
  // The split limit from the schedule model (schedule.hpp), unless the caller fixes it.
  std::vector<std::int32_t> window_tcbs(static_cast<std::size_t>(f.windows));
  TRISPARSE_CUDA_TRY(cudaMemcpyAsync(window_tcbs.data(), f.window_tcbs.data(),
                                     window_tcbs.size() * sizeof(std::int32_t),
                                     cudaMemcpyDeviceToHost, s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  const std::int64_t limit = limits.split_tcbs > 0
                                 ? limits.split_tcbs
                                 : fused3s::choose_split_limit(window_tcbs, sms, kWarps);
  device_work_list list =
      build_work_list(f.window_tcbs.data(), f.tcb_offset.data(), f.windows, limit, s);
  // Which items run on teams depends on the heads and the head dim (the resident blocks), so the
  // launch chooses them from the host copy of the items.
  plan->tcbs = f.tcbs;
  plan->team_tcbs = limits.team_tcbs;
  plan->host_items = fused3s::cut_windows(window_tcbs, limit);
  if (std::ssize(plan->host_items.tcbs) != list.num_items)
    throw std::logic_error("fused 3S: the host copy of the work list has " +
                           std::to_string(plan->host_items.tcbs.size()) + " items, the device's " +
                           std::to_string(list.num_items));
  plan->col_idx = std::move(f.col_idx);
  plan->bitmap = std::move(f.bitmap);
  plan->items = std::move(list.items);
  plan->splits = std::move(list.splits);
  plan->num_items = list.num_items;
  plan->num_splits = list.num_splits;
  plan->num_parts = list.num_parts;
  return plan;
}

}  // namespace

std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_graph& pattern,
                                                       fused3s_limits limits, stream_ref stream,
                                                       const std::vector<std::int64_t>& row_map) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  auto plan = plan_from(build_bsb_device(pattern, s, false), limits, s);
  if (!row_map.empty()) plan->row_map = device_buffer<std::int64_t>(row_map);
  return plan;
}

std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_view& pattern,
                                                       fused3s_limits limits, stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  return plan_from(build_bsb_device(pattern, s, false, false), limits, s);
}

void run_fused3s(const fused3s_device_plan& plan, const tensor_view& q, const tensor_view& k,
                 const tensor_view& v, const tensor_view& out, double scale, stream_ref stream) {
  check_attention_operands(q, k, v, out, "fused 3S");
  expect_current_device(plan.device);
  fused3s::params p{};
  static_cast<attention_io&>(p) = attention_io_of(q, k, v, out);
  p.rows = plan.rows;
  p.row_map = plan.row_map.size() > 0 ? plan.row_map.data() : nullptr;
  p.col_idx = plan.col_idx.data();
  p.bitmap = plan.bitmap.data();
  p.items = plan.items.data();
  p.num_items = plan.num_items;
  p.splits = plan.splits.data();
  p.num_splits = plan.num_splits;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.heads = static_cast<std::int32_t>(q.heads);
  p.queue = plan.queue.data();
  if (plan.num_parts > 0) {
    const std::size_t need = static_cast<std::size_t>(plan.num_parts) * q.heads * 16;
    std::lock_guard<std::mutex> lock(plan.workspace_mutex);
    if (plan.part_o.size() < need * q.dim ||
        plan.split_count.size() < plan.num_splits * static_cast<std::size_t>(q.heads)) {
      // Grows once per larger heads x dim, never per call of the same shape.
      TRISPARSE_CUDA_TRY(cudaDeviceSynchronize());
      plan.part_o = device_buffer<float>(need * q.dim);
      plan.part_ml = device_buffer<float>(need * 2);
      plan.split_count =
          device_buffer<std::int32_t>(static_cast<std::size_t>(plan.num_splits) * q.heads);
      TRISPARSE_CUDA_TRY(cudaMemset(plan.split_count.data(), 0, plan.split_count.bytes()));
    }
    p.part_o = plan.part_o.data();
    p.part_ml = plan.part_ml.data();
    p.split_count = plan.split_count.data();
  }
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (q.type == dtype::f16)
    launch_dim<__half>(q.dim, out.type, p, plan, s);
  else
    launch_dim<__nv_bfloat16>(q.dim, out.type, p, plan, s);
}

std::int64_t device_bytes(const fused3s_device_plan& plan) {
  return static_cast<std::int64_t>(plan.col_idx.bytes() + plan.bitmap.bytes() + plan.items.bytes() +
                                   plan.splits.bytes() + plan.row_map.bytes() + plan.queue.bytes() +
                                   plan.part_o.bytes() + plan.part_ml.bytes() +
                                   plan.split_count.bytes());
}

}  // namespace trisparse::cuda
