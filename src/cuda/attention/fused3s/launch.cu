// The fused 3S backend's one dispatch point: run-time (dtype, head dim, output dtype) become the
// kernel's template arguments here and nowhere else.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../../common/workspace_layout.hpp"
#include "../../common/buffer.cuh"
#include "../../common/current_device.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/gather_reuse.hpp"
#include "../../common/layout.hpp"
#include "../../common/work_list.cuh"
#include "../../formats/bsb_build.cuh"
#include "../../formats/bsb_slots.cuh"
#include "heuristics.hpp"
#include "kernel.cuh"
#include "plan.hpp"
#include "schedule.hpp"

namespace trisparse::cuda {

/// Team items chosen per (heads, resident blocks, warps per block): the schedule model's replay is
/// done once per key. Lock-free: entries are claimed by compare-and-swap on the key, and racing
/// runs compute the same value; a full table computes without keeping.
class team_memo {
 public:
  template <class F>
  std::int32_t get(std::int64_t heads, std::int64_t blocks, int warps, F&& compute) const {
    const std::uint64_t key = (static_cast<std::uint64_t>(heads) << 40) ^
                              (static_cast<std::uint64_t>(blocks) << 8) ^
                              static_cast<std::uint64_t>(warps) ^ 1u;  // never 0
    for (std::size_t i = 0; i < kSlots; ++i) {
      slot& e = slots_[((key * 0x9E3779B97F4A7C15ull >> 58) + i) & (kSlots - 1)];
      std::uint64_t seen = e.key.load(std::memory_order_acquire);
      if (seen == 0 && e.key.compare_exchange_strong(seen, key, std::memory_order_acq_rel)) {
        const std::int32_t v = compute();
        e.value.store(v, std::memory_order_release);
        return v;
      }
      if (seen == key) {
        const std::int32_t v = e.value.load(std::memory_order_acquire);
        return v >= 0 ? v : compute();  // claimed, not yet stored
      }
    }
    return compute();
  }

 private:
  static constexpr std::size_t kSlots = 64;
  struct slot {
    std::atomic<std::uint64_t> key{0};
    std::atomic<std::int32_t> value{-1};
  };
  mutable slot slots_[kSlots];
};

struct fused3s_device_plan {
  int device = 0, sms = 0;
  std::int64_t rows = 0, cols = 0;
  head_order heads = head_order::automatic;  // fused3s_limits::heads
  gather_reuse reuse;  // the windows' reuse distances (plans from host patterns): the task order
  device_buffer<std::int64_t> row_map;  // empty: windows hold rows in the caller's order
  device_buffer<std::int32_t> col_idx;
  device_buffer<std::uint64_t> bitmap;
  device_buffer<fused3s::work_item> items;
  device_buffer<fused3s::split_window> splits;
  // A score bias's maps (bsb_slots.cuh), for plans from host patterns; empty: runs take no bias.
  device_buffer<std::int32_t> first_slot;  // [tcbs]
  device_buffer<std::int32_t> slot_entry;  // [nnz]: the pattern's entry at each slot
  std::int32_t num_items = 0, num_splits = 0, num_parts = 0;
  std::int64_t tcbs = 0;
  fused3s::item_list host_items;  // the items' TCB counts (decreasing) and splits, on the host
  std::int32_t team_tcbs = 0;     // fused3s_limits::team_tcbs
  team_memo teams;
  // The plan's own workspace, for runs not given one: sized at build for the limits' heads and
  // head dim, its counters zeroed then.
  mutable device_buffer<std::byte> own;  // scratch: written by const runs
  std::int64_t own_heads = 0, own_dim = 0;
};

namespace {

// The workspace of one run: the task queue (3 words) and the split windows' arrival counts, which
// the kernel leaves zero, then the split windows' partial states (o, then max and sum).
struct fused3s_workspace {
  detail::workspace_layout layout;
  std::size_t queue = 0, split_count = 0, part_o = 0, part_ml = 0;
};

fused3s_workspace workspace_of(const fused3s_device_plan& plan, std::int64_t heads,
                               std::int64_t dim) {
  fused3s_workspace w;
  const auto parts = static_cast<std::size_t>(plan.num_parts) * heads * 16;
  w.queue = w.layout.add_zeroed(3 * sizeof(std::uint64_t));
  w.split_count =
      w.layout.add_zeroed(static_cast<std::size_t>(plan.num_splits) * heads * sizeof(std::int32_t));
  w.part_o = w.layout.add(parts * dim * sizeof(float));
  w.part_ml = w.layout.add(parts * 2 * sizeof(float));
  return w;
}

}  // namespace

namespace {

using fused3s::kMinBlocks;
using fused3s::kWarps;

/// How many of the largest items run on teams with `blocks` resident blocks of `warps` warps: as
/// the schedule model chooses (schedule.hpp), or, with a positive team_tcbs, every item of at least
/// that many TCBs.
std::int32_t team_items(const fused3s_device_plan& plan, std::int64_t heads, std::int64_t blocks,
                        int warps) {
  if (plan.team_tcbs < 0 || heads <= 0) return 0;
  if (plan.team_tcbs > 0)
    return static_cast<std::int32_t>(fused3s::at_least(plan.host_items, plan.team_tcbs));
  return plan.teams.get(heads, blocks, warps, [&] {
    return static_cast<std::int32_t>(
        fused3s::choose_team_items(plan.host_items, heads, blocks, warps));
  });
}

template <class T, int D, class O, bool kLse, bool kBias, int kBlocks, int kBlockWarps = kWarps>
void launch_blocks(const fused3s::params& p, const fused3s_device_plan& plan, cudaStream_t s) {
  const auto kernel = fused3s::fused3s_kernel<T, D, O, kBlockWarps, kBlocks, kLse, kBias>;
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

template <class T, int D, class O, bool kLse, bool kBias>
void launch(const fused3s::params& p, const fused3s_device_plan& plan, cudaStream_t s) {
  if constexpr (D == 128) {
    const auto& sizes = plan.host_items.tcbs;
    if (!sizes.empty() && fused3s::short_items_on_small_blocks(
                              sizes.front(), std::int64_t{p.num_items} * p.heads, plan.sms)) {
      return launch_blocks<T, D, O, kLse, kBias, fused3s::kShortBlocks, fused3s::kShortBlockWarps>(
          p, plan, s);
    }
  }
  launch_blocks<T, D, O, kLse, kBias, kMinBlocks<D>>(p, plan, s);
}

std::shared_ptr<fused3s_device_plan> plan_from(device_bsb f, fused3s_limits limits,
                                               cudaStream_t s) {
  auto plan = std::make_shared<fused3s_device_plan>();
  const device_id_and_sms here = current_device();
  plan->device = here.device;
  plan->sms = here.sms;
  const int sms = plan->sms;
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
  plan->heads = limits.heads;
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
  plan->own_heads = std::max<std::int64_t>(limits.workspace_heads, 1);
  plan->own_dim = std::max<std::int64_t>(limits.workspace_dim, 1);
  const fused3s_workspace w = workspace_of(*plan, plan->own_heads, plan->own_dim);
  plan->own = device_buffer<std::byte>(w.layout.bytes());
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(plan->own.data(), 0, w.layout.zeroed_bytes(), s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return plan;
}

}  // namespace

std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_graph& pattern,
                                                       fused3s_limits limits, stream_ref stream,
                                                       std::span<const std::int64_t> row_order) {
  TRISPARSE_EXPECTS_INPUT(row_order.empty() || std::cmp_equal(row_order.size(), pattern.rows),
                          "fused 3S: the window order must hold every row of the pattern");
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const device_buffer<std::int64_t> row_ptr(pattern.row_ptr);
  const device_buffer<std::int32_t> col(pattern.col_idx);
  device_bsb b = row_order.empty() ? build_bsb_device(csr_view{.rows = pattern.rows,
                                                               .cols = pattern.cols,
                                                               .nnz = pattern.nnz(),
                                                               .row_ptr = row_ptr.data(),
                                                               .col_idx = col.data()},
                                                      s, true, false)
                                   : build_bsb_device(select_rows(pattern, row_order), s, false);
  device_buffer<std::int64_t> row_map;
  if (!row_order.empty())
    row_map =
        device_buffer<std::int64_t>(std::vector<std::int64_t>(row_order.begin(), row_order.end()));
  // The bias's maps: each slot's entry of the pattern, its window row taken through the order.
  device_buffer<std::int32_t> first = first_slots(b.bitmap.data(), b.tcbs, s);
  device_buffer<std::int32_t> entry(static_cast<std::size_t>(pattern.nnz()));
  if (b.tcbs > 0) {
    slot_entries<<<slot_build_blocks(b.tcbs), kSlotBuildThreads, 0, s>>>(
        b.tcb_offset.data(), b.windows, b.col_idx.data(), b.bitmap.data(), first.data(), b.tcbs,
        row_map.size() > 0 ? row_map.data() : nullptr, row_ptr.data(), col.data(), entry.data());
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  auto plan = plan_from(std::move(b), limits, s);  // synchronises the stream
  plan->row_map = std::move(row_map);
  plan->reuse = gather_reuse_of(pattern, row_order);
  settle_head_orders(plan->reuse, current_l2_bytes());
  plan->first_slot = std::move(first);
  plan->slot_entry = std::move(entry);
  return plan;
}

std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_view& pattern,
                                                       fused3s_limits limits, stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  return plan_from(build_bsb_device(pattern, s, false, false), limits, s);
}

std::size_t fused3s_workspace_bytes(const fused3s_device_plan& plan, std::int64_t heads,
                                    std::int64_t head_dim) {
  return workspace_of(plan, heads, head_dim).layout.bytes();
}

bool fused3s_takes_bias(const fused3s_device_plan& plan, const tensor_view& q, const tensor_view& k,
                        const tensor_view& v, const tensor_view& out) {
  const auto rows16 = [](const tensor_view& t) {
    return t.row_stride % 8 == 0 && t.head_stride % 8 == 0 &&
           reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
  };
  const bool dims = k.dim == q.dim && v.dim == q.dim &&
                    (q.dim == 32 || q.dim == 64 || q.dim == 128) &&
                    head_dim_built(static_cast<int>(q.dim));
  return plan.first_slot.size() > 0 && (q.type == dtype::f16 || q.type == dtype::bf16) &&
         k.type == q.type && v.type == q.type && out.type == q.type && dims && rows16(q) &&
         rows16(k) && rows16(v) && rows16(out);
}

void run_fused3s(const fused3s_device_plan& plan, const tensor_view& q, const tensor_view& k,
                 const tensor_view& v, const tensor_view& out, const tensor_view& lse,
                 const tensor_view& bias, double scale, const workspace_view* workspace,
                 stream_ref stream) {
  check_attention_operands(q, k, v, out, "fused 3S");
  TRISPARSE_EXPECTS_INPUT(
      lse.data == nullptr || lse.type == dtype::f32,
      "fused 3S writes the log-sum-exp as f32, not " + std::string(to_string(lse.type)));
  if (bias.data != nullptr) {
    TRISPARSE_EXPECTS_INPUT(fused3s_takes_bias(plan, q, k, v, out),
                            "fused 3S takes a bias on plans from host patterns, with out in q's "
                            "dtype, head dims 32, 64 or 128 and 16-byte rows");
    TRISPARSE_EXPECTS_INPUT(
        bias.type == dtype::f32 && bias.rows == std::ssize(plan.slot_entry) &&
            (bias.heads == 1 || bias.heads == q.heads),
        "fused 3S takes the bias as f32 [nnz, H or 1, 1], not " + bias.describe());
  }
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
  p.scale_log2 = scale_log2(scale);
  p.heads = static_cast<std::int32_t>(q.heads);
  p.heads_outer = heads_outer(plan.heads, plan.reuse, q.heads, q.dim);
  p.lse = static_cast<float*>(lse.data);
  p.lse_row = lse.row_stride;
  p.lse_head = lse.head_stride;
  p.bias = static_cast<const float*>(bias.data);
  p.bias_row = bias.row_stride;
  p.bias_head = bias.heads == 1 ? 0 : bias.head_stride;
  p.first_slot = plan.first_slot.data();
  p.slot_entry = plan.slot_entry.data();
  const auto s = static_cast<cudaStream_t>(stream.handle);
  // The plan's own workspace keeps the layout it was zeroed in (a smaller run's scratch would
  // otherwise overlap a larger run's counters); the caller's is laid out for this run and cleared.
  const bool own = workspace == nullptr;
  if (own) {
    // Without split windows a run needs only the task queue, whatever its heads and head dim.
    TRISPARSE_EXPECTS_INPUT(
        plan.num_parts == 0 || (q.heads <= plan.own_heads && q.dim <= plan.own_dim),
        "fused 3S: the plan's own workspace serves heads <= " + std::to_string(plan.own_heads) +
            " and head_dim <= " + std::to_string(plan.own_dim) + ", not " +
            std::to_string(q.heads) + " x " + std::to_string(q.dim) +
            ": build it with larger plan_options.workspace_heads / workspace_dim, or pass a "
            "workspace to run()");
  }
  const fused3s_workspace w =
      own ? workspace_of(plan, plan.own_heads, plan.own_dim) : workspace_of(plan, q.heads, q.dim);
  const workspace_view ws = own ? workspace_view{plan.own.data(), plan.own.bytes()} : *workspace;
  if (!own) {
    w.layout.check(ws, "fused 3S");
    TRISPARSE_CUDA_TRY(cudaMemsetAsync(ws.data, 0, w.layout.zeroed_bytes(), s));
  }
  p.queue = detail::workspace_layout::at<std::uint64_t>(ws, w.queue);
  if (plan.num_parts > 0) {
    p.part_o = detail::workspace_layout::at<float>(ws, w.part_o);
    p.part_ml = detail::workspace_layout::at<float>(ws, w.part_ml);
    p.split_count = detail::workspace_layout::at<std::int32_t>(ws, w.split_count);
  }
  with_half_type(q.type, "fused 3S's q", [&]<class T>() {
    with_head_dim<32, 64, 128, 256>(q.dim, "fused 3S's head_dim", [&]<int D>() {
      with_type<float, __half, __nv_bfloat16>(out.type, "fused 3S's out", [&]<class O>() {
        // Biased instantiations: out in T, D <= 128 (fused3s_takes_bias).
        if constexpr (std::is_same_v<O, T> && D <= 128) {
          if (p.bias != nullptr) {
            if (p.lse != nullptr)
              launch<T, D, O, true, true>(p, plan, s);
            else
              launch<T, D, O, false, true>(p, plan, s);
            return;
          }
        }
        if (p.lse != nullptr)
          launch<T, D, O, true, false>(p, plan, s);
        else
          launch<T, D, O, false, false>(p, plan, s);
      });
    });
  });
}

std::int64_t device_bytes(const fused3s_device_plan& plan) {
  return static_cast<std::int64_t>(plan.col_idx.bytes() + plan.bitmap.bytes() + plan.items.bytes() +
                                   plan.splits.bytes() + plan.row_map.bytes() + plan.own.bytes() +
                                   plan.first_slot.bytes() + plan.slot_entry.bytes());
}

}  // namespace trisparse::cuda
