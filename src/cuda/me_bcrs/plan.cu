// The CUDA ME-BCRS plan: build, checks shared by the three operations, layout conversions.
#include <algorithm>
#include <string>

#include "../common/current_device.cuh"
#include "../common/error.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "../common/work_list.cuh"
#include "device_plan.cuh"
#include "heuristics.hpp"

namespace trisparse::cuda {

namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void convert(const float* in, T* out, std::int64_t n) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n) out[i] = frags::from_float<T>(in[i]);
}

std::shared_ptr<me_device_plan> plan_from(device_me_bcrs f, me_work_limits limits, cudaStream_t s) {
  auto plan = std::make_shared<me_device_plan>();
  const device_id_and_sms here = current_device();
  plan->device = here.device;
  plan->sms = here.sms;
  std::int64_t blocks = 0;
  if (f.windows > 0) {
    TRISPARSE_CUDA_TRY(cudaMemcpyAsync(&blocks, f.block_offset.data() + f.windows,
                                       sizeof(std::int64_t), cudaMemcpyDeviceToHost, s));
    TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  }
  TRISPARSE_EXPECTS_INPUT(blocks < (std::int64_t{1} << 31),
                          "the pattern has more than 2^31 blocks of 8 vectors");
  // Split limits and teams per operation (heuristics.hpp).
  const std::int64_t mean = me_bcrs::mean_blocks_per_slot(blocks, plan->sms);
  const auto list = [&](std::int64_t rule, me_work& w, std::int64_t team = 0) {
    device_work_list l =
        build_work_list(f.window_blocks.data(), f.block_offset.data(), f.windows,
                        limits.split_blocks > 0 ? limits.split_blocks : rule, s, team);
    w.items = std::move(l.items);
    w.splits = std::move(l.splits);
    w.num_items = l.num_items;
    w.num_splits = l.num_splits;
    w.num_parts = l.num_parts;
    w.team_items = l.num_large;
  };
  const std::int64_t team =
      limits.team_blocks != 0 ? limits.team_blocks : me_bcrs::spmm_team_blocks(mean);
  list(me_bcrs::spmm_split_blocks(mean, team > 0), plan->spmm_work,
       std::max<std::int64_t>(team, 0));
  list(me_bcrs::sddmm_split_blocks(mean), plan->sddmm_work);
  list(me_bcrs::softmax_split_blocks(mean), plan->softmax_work);
  plan->f = std::move(f);
  const std::int64_t n = plan->f.slots();
  if (n > 0) {
    plan->values_f16 = device_buffer<__half>(static_cast<std::size_t>(n));
    plan->values_bf16 = device_buffer<__nv_bfloat16>(static_cast<std::size_t>(n));
    convert<<<blocks_for(n, kThreads), kThreads, 0, s>>>(plan->f.values.data(),
                                                         plan->values_f16.data(), n);
    TRISPARSE_CUDA_CHECK_LAUNCH();
    convert<<<blocks_for(n, kThreads), kThreads, 0, s>>>(plan->f.values.data(),
                                                         plan->values_bf16.data(), n);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  }
  plan->own_heads = std::max<std::int64_t>(limits.workspace_heads, 1);
  plan->own_dim = std::max<std::int64_t>(limits.workspace_dim, 1);
  const me_bcrs::workspace w = me_bcrs::workspace_of(*plan, plan->own_heads, plan->own_dim);
  plan->own = device_buffer<std::byte>(w.layout.bytes());
  TRISPARSE_CUDA_TRY(cudaMemsetAsync(plan->own.data(), 0, w.layout.zeroed_bytes(), s));
  TRISPARSE_CUDA_TRY(cudaStreamSynchronize(s));
  return plan;
}

// Raw copies between layouts (elements of `Bits` bytes; dtypes are checked equal on the host).
template <class Bits>
__global__ void zero_slots(Bits* slots, std::int64_t n, std::int64_t heads, std::int64_t head) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < n * heads) slots[i / n * head + i % n] = Bits{0};
}

template <class Bits, bool kToSlots>
__global__ void move_entries(const std::int64_t* entry_slot, std::int64_t nnz, std::int64_t heads,
                             Bits* slots, std::int64_t slot_head, Bits* entries,
                             std::int64_t entry_row, std::int64_t entry_head) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= nnz * heads) return;
  const std::int64_t e = i / heads, h = i % heads;
  Bits& s = slots[h * slot_head + entry_slot[e]];
  Bits& x = entries[e * entry_row + h * entry_head];
  if constexpr (kToSlots)
    s = x;
  else
    x = s;
}

template <bool kToSlots>
void move(const me_device_plan& plan, const tensor_view& entries, const tensor_view& slots,
          stream_ref stream) {
  me_bcrs::check_device(plan);
  check_view(entries, "entries", plan.f.nnz, -1, 1);
  TRISPARSE_EXPECTS_INPUT(entries.where == device_kind::cuda, "entries must be on the GPU");
  me_bcrs::check_slots(plan, slots, "slots", entries.heads);
  if (entries.type != slots.type) {
    throw invalid_input("entries " + entries.describe() + " and slots " + slots.describe() +
                        " need one dtype");
  }
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t heads = entries.heads, n = plan.f.slots(), nnz = plan.f.nnz;
  const auto run = [&](auto bits) {
    using B = decltype(bits);
    if (kToSlots) {
      zero_slots<<<blocks_for(n * heads, kThreads), kThreads, 0, s>>>(static_cast<B*>(slots.data),
                                                                      n, heads, slots.head_stride);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
    move_entries<B, kToSlots><<<blocks_for(nnz * heads, kThreads), kThreads, 0, s>>>(
        plan.f.entry_slot.data(), nnz, heads, static_cast<B*>(slots.data), slots.head_stride,
        static_cast<B*>(entries.data), entries.row_stride, entries.head_stride);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  };
  switch (size_of(entries.type)) {
    case 2:
      return run(std::uint16_t{});
    case 4:
      return run(std::uint32_t{});
    default:
      return run(std::uint64_t{});
  }
}

}  // namespace

std::shared_ptr<me_device_plan> make_me_plan(const csr_graph& pattern, int vector_rows,
                                             me_work_limits limits, stream_ref stream,
                                             std::span<const std::int64_t> order) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  return plan_from(build_me_bcrs_device(pattern, vector_rows, s, order), limits, s);
}

std::shared_ptr<me_device_plan> make_me_plan(const csr_view& pattern, const float* values,
                                             int vector_rows, me_work_limits limits,
                                             stream_ref stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  return plan_from(build_me_bcrs_device(pattern, values, vector_rows, s, false), limits, s);
}

std::size_t me_workspace_bytes(const me_device_plan& plan, std::int64_t heads, std::int64_t dim) {
  return me_bcrs::workspace_of(plan, heads, dim).layout.bytes();
}

me_plan_info info(const me_device_plan& plan) {
  me_plan_info i;
  i.windows = plan.f.windows;
  i.vectors = plan.f.vectors;
  i.slots = plan.f.slots();
  // The paper's three arrays (the per-vector entry mask, which keeps explicit zeros apart from
  // absent entries, is counted in device_bytes).
  i.format_bytes = static_cast<std::int64_t>(plan.f.row_ptr.bytes() + plan.f.col_idx.bytes() +
                                             plan.f.values.bytes());
  std::int64_t blocks = 0;
  if (plan.f.windows > 0) {
    TRISPARSE_CUDA_TRY(cudaMemcpy(&blocks, plan.f.block_offset.data() + plan.f.windows,
                                  sizeof(std::int64_t), cudaMemcpyDeviceToHost));
  }
  // SR-BCRS: every window padded to whole blocks, a second offset array, 32-bit values.
  i.sr_bcrs_bytes =
      16 * (plan.f.windows + 1) + 4 * blocks * 8 + 4 * blocks * 8 * plan.f.vector_rows;
  i.device_bytes = i.format_bytes +
                   static_cast<std::int64_t>(plan.f.mask.bytes() + plan.f.entry_slot.bytes() +
                                             plan.f.window_blocks.bytes() +
                                             plan.f.block_offset.bytes() + plan.f.row_map.bytes() +
                                             plan.spmm_work.bytes() + plan.sddmm_work.bytes() +
                                             plan.softmax_work.bytes() + plan.own.bytes() +
                                             plan.values_f16.bytes() + plan.values_bf16.bytes());
  return i;
}

void entries_to_slots(const me_device_plan& plan, const tensor_view& entries,
                      const tensor_view& slots, stream_ref stream) {
  move<true>(plan, entries, slots, stream);
}
void slots_to_entries(const me_device_plan& plan, const tensor_view& slots,
                      const tensor_view& entries, stream_ref stream) {
  move<false>(plan, entries, slots, stream);
}

namespace me_bcrs {

void check_device(const me_device_plan& plan) { expect_current_device(plan.device); }

void check_slots(const me_device_plan& plan, const tensor_view& t, const char* what,
                 std::int64_t heads) {
  TRISPARSE_EXPECTS_INPUT(t.where == device_kind::cuda,
                          std::string(what) + " " + t.describe() + " must be on the GPU");
  TRISPARSE_EXPECTS_INPUT(
      t.rows == plan.f.slots() && t.heads == heads && t.dim == 1 &&
          (t.rows <= 1 || t.row_stride == 1) && (heads <= 1 || t.head_stride >= t.rows) &&
          (t.data != nullptr || t.rows == 0),
      std::string(what) + " " + t.describe() + " must be [" + std::to_string(plan.f.slots()) +
          ", " + std::to_string(heads) +
          ", 1] in the plan's slot layout: slot stride 1, heads at least slots apart");
  TRISPARSE_EXPECTS_INPUT(
      reinterpret_cast<std::uintptr_t>(t.data) % 8 == 0 && (heads <= 1 || t.head_stride % 2 == 0),
      std::string(what) + " " + t.describe() + " must be 8-byte aligned with an even head stride");
}

void check_dense_pair(const tensor_view& a, std::int64_t a_rows, const char* a_name,
                      const tensor_view& b, std::int64_t b_rows, const char* b_name,
                      const char* op) {
  check_view(a, a_name, a_rows, -1, -1);
  check_view(b, b_name, b_rows, a.heads, a.dim);
  TRISPARSE_EXPECTS_INPUT(a.where == device_kind::cuda && b.where == device_kind::cuda,
                          std::string(op) + " needs " + a_name + " and " + b_name + " on the GPU");
}

bool vector_aligned(const tensor_view& t) {
  const auto bytes = static_cast<std::int64_t>(size_of(t.type));
  return reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0 && t.row_stride * bytes % 16 == 0 &&
         t.head_stride * bytes % 16 == 0;
}

template <class T>
const T* own_values(const me_device_plan& plan) {
  if constexpr (sizeof(T) == 4)
    return plan.f.values.data();
  else if constexpr (std::is_same_v<T, __half>)
    return plan.values_f16.data();
  else
    return plan.values_bf16.data();
}

template const float* own_values<float>(const me_device_plan&);
template const __half* own_values<__half>(const me_device_plan&);
template const __nv_bfloat16* own_values<__nv_bfloat16>(const me_device_plan&);

workspace workspace_of(const me_device_plan& plan, std::int64_t heads, std::int64_t dim) {
  workspace w;
  const auto h = static_cast<std::size_t>(heads);
  const std::size_t chunks = static_cast<std::size_t>(dim + 15) / 16;  // an upper bound
  const me_work& spmm = plan.spmm_work;
  const me_work& softmax = plan.softmax_work;
  w.split_count = w.layout.add_zeroed(
      spmm.num_parts > 0 ? static_cast<std::size_t>(spmm.num_splits) * h * chunks * 4 : 0);
  w.part = w.layout.add(static_cast<std::size_t>(spmm.num_parts) * h * plan.f.vector_rows * dim *
                        sizeof(float));
  w.part_stats = w.layout.add(static_cast<std::size_t>(softmax.num_parts) * h * plan.f.vector_rows *
                              2 * sizeof(float));
  return w;
}

std::pair<workspace_view, workspace> use_workspace(const me_device_plan& plan, std::int64_t heads,
                                                   std::int64_t dim, const workspace_view* given,
                                                   const char* what, cudaStream_t s) {
  if (given != nullptr) {
    workspace w = workspace_of(plan, heads, dim);
    w.layout.check(*given, what);
    if (w.layout.zeroed_bytes() > 0)
      TRISPARSE_CUDA_TRY(cudaMemsetAsync(given->data, 0, w.layout.zeroed_bytes(), s));
    return {*given, std::move(w)};
  }
  TRISPARSE_EXPECTS_INPUT(
      heads <= plan.own_heads && dim <= plan.own_dim,
      std::string(what) + ": the plan's own workspace serves heads <= " +
          std::to_string(plan.own_heads) + " and width <= " + std::to_string(plan.own_dim) +
          ", not " + std::to_string(heads) + " x " + std::to_string(dim) +
          ": build it with larger workspace_heads / workspace_dim, or pass a workspace");
  return {workspace_view{plan.own.data(), plan.own.bytes()},
          workspace_of(plan, plan.own_heads, plan.own_dim)};
}

}  // namespace me_bcrs

}  // namespace trisparse::cuda
