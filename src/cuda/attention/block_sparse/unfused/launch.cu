// The blocked-sparse report's pipeline on CUDA: the device plan (the layout of
// formats/interleaved_layout.hpp, uploaded) and the one dispatch point where (input dtype, output
// dtype, tile rows) become the three kernels' template arguments.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../../../../common/workspace_layout.hpp"
#include "../../../common/buffer.cuh"
#include "../../../common/current_device.cuh"
#include "../../../common/dispatch.cuh"
#include "../../../common/error.cuh"
#include "../../../common/grid.cuh"
#include "../../../common/layout.hpp"
#include "../heuristics.hpp"
#include "plan.hpp"
#include "sddmm.cuh"
#include "softmax.cuh"
#include "spmm.cuh"

namespace trisparse::cuda {

namespace il = interleaved;

struct unfused_device_plan {
  int device = 0, sms = 0;
  std::int64_t block = 0, mask_heads = 1, slot = 0;
  bool causal = false;
  int sddmm_rows = 1, spmm_rows_per_thread = 1;
  // Items per mask head, on the host for launch sizes: [mask head] -> first item (+ the end).
  std::vector<std::int32_t> sddmm_first_h, spmm_first_h, softmax_first_h;
  device_buffer<std::int64_t> cu_q, cu_k;
  device_buffer<il::block_row> rows;
  device_buffer<std::int32_t> col_idx, sddmm_first, spmm_first, softmax_first;
  device_buffer<il::tile> sddmm_tiles, spmm_tiles;
  device_buffer<il::part> parts;
  // The plan's own workspace, for runs not given one (sized at build).
  mutable device_buffer<std::byte> own;  // scratch: written by const runs
};

namespace {

using block_sparse::kUnfusedScoreBytes;

// A run's workspace: the SDDMM's tile counter, then the scores of `group` heads.
struct unfused_workspace {
  detail::workspace_layout layout;
  std::size_t counter = 0, scores = 0;
};

unfused_workspace workspace_of(const unfused_device_plan& plan, std::int64_t group) {
  unfused_workspace w;
  w.counter = w.layout.add(sizeof(unsigned long long));
  w.scores = w.layout.add(static_cast<std::size_t>(group * plan.slot) * sizeof(float));
  return w;
}

std::int64_t slot_bytes(const unfused_device_plan& plan) {
  return std::max<std::int64_t>(plan.slot, 1) * 4;
}

template <class T>
void launch_sddmm(const unfused_device_plan& plan, const il::params& p, il::work w,
                  unsigned long long* counter, std::int64_t items, cudaStream_t s) {
  with_value<1, 2, 4, 8, 16, 32>(plan.sddmm_rows, "the SDDMM's tile rows", [&]<int R>() {
    constexpr auto kernel = il::sddmm_kernel<T, R>;
    static const bool configured = [] {
      TRISPARSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              il::sddmm_shared_bytes(R, 256)));
      return true;
    }();
    (void)configured;
    const int bytes = il::sddmm_shared_bytes(R, p.dim);
    int per_sm = 0;
    TRISPARSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, kernel, il::kSddmmWarps * 32, static_cast<std::size_t>(bytes)));
    const std::int64_t grid =
        std::clamp<std::int64_t>((items + il::kSddmmWarps - 1) / il::kSddmmWarps, 1,
                                 std::int64_t{plan.sms} * std::max(per_sm, 1));
    TRISPARSE_CUDA_TRY(cudaMemsetAsync(counter, 0, sizeof(unsigned long long), s));
    kernel<<<static_cast<unsigned>(grid), il::kSddmmWarps * 32, bytes, s>>>(p, w, counter);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  });
}

template <class T, class O>
void launch_spmm(const unfused_device_plan& plan, const il::params& p, il::work w,
                 std::int64_t items, cudaStream_t s) {
  with_value<1, 2, 4>(plan.spmm_rows_per_thread, "the SpMM's rows per thread", [&]<int RPT>() {
    const dim3 grid(static_cast<unsigned>(items),
                    static_cast<unsigned>((p.dim + il::kSpmmCols - 1) / il::kSpmmCols));
    il::spmm_kernel<T, O, RPT><<<grid, il::kSpmmThreads, 0, s>>>(p, w);
    TRISPARSE_CUDA_CHECK_LAUNCH();
  });
}

// The launch's items: a shared mask's once per head, else those of heads [h0, h0 + heads).
std::int64_t launch_items(const std::vector<std::int32_t>& first, std::int64_t mask_heads,
                          std::int64_t h0, std::int64_t heads) {
  if (mask_heads == 1) return heads * first[1];
  return first[static_cast<std::size_t>(h0 + heads)] - first[static_cast<std::size_t>(h0)];
}

// Events around the three kernels of each head group; their times summed.
class stage_timer {
 public:
  explicit stage_timer(bool on) {
    if (!on) return;
    for (cudaEvent_t& e : events_) TRISPARSE_CUDA_TRY(cudaEventCreate(&e));
  }
  ~stage_timer() {
    for (cudaEvent_t e : events_)
      if (e != nullptr) cudaEventDestroy(e);
  }
  stage_timer(const stage_timer&) = delete;
  stage_timer& operator=(const stage_timer&) = delete;
  void mark(int i, cudaStream_t s) {
    if (events_[0] != nullptr) TRISPARSE_CUDA_TRY(cudaEventRecord(events_[i], s));
  }
  // After the group's last mark: waits for it and adds the three intervals.
  void add_to(std::array<double, 3>& ms) {
    if (events_[0] == nullptr) return;
    TRISPARSE_CUDA_TRY(cudaEventSynchronize(events_[3]));
    for (int i = 0; i < 3; ++i) {
      float x = 0;
      TRISPARSE_CUDA_TRY(cudaEventElapsedTime(&x, events_[i], events_[i + 1]));
      ms[static_cast<std::size_t>(i)] += x;
    }
  }

 private:
  std::array<cudaEvent_t, 4> events_{};
};

}  // namespace

std::shared_ptr<unfused_device_plan> make_unfused_plan(const block_sparse_mask& mask,
                                                       std::int64_t workspace_heads,
                                                       stream_ref /*stream*/) {
  auto plan = std::make_shared<unfused_device_plan>();
  const auto dev = current_device();
  plan->device = dev.device;
  plan->sms = dev.sms;
  plan->block = mask.block;
  plan->mask_heads = mask.heads;
  plan->causal = mask.causal;
  il::layout l = il::make_layout(mask);
  plan->sddmm_rows = l.sddmm_rows;
  plan->spmm_rows_per_thread = l.spmm_rows_per_thread;
  plan->slot = l.slot;
  plan->sddmm_first_h = std::move(l.sddmm_first);
  plan->spmm_first_h = std::move(l.spmm_first);
  plan->softmax_first_h = std::move(l.softmax_first);
  plan->cu_q = device_buffer<std::int64_t>(mask.cu_seqlens_q);
  plan->cu_k = device_buffer<std::int64_t>(mask.cu_seqlens_k);
  plan->rows = device_buffer<il::block_row>(l.rows);
  plan->col_idx = device_buffer<std::int32_t>(l.col_idx);
  plan->sddmm_first = device_buffer<std::int32_t>(plan->sddmm_first_h);
  plan->spmm_first = device_buffer<std::int32_t>(plan->spmm_first_h);
  plan->softmax_first = device_buffer<std::int32_t>(plan->softmax_first_h);
  plan->sddmm_tiles = device_buffer<il::tile>(l.sddmm);
  plan->spmm_tiles = device_buffer<il::tile>(l.spmm);
  plan->parts = device_buffer<il::part>(l.parts);
  plan->own = device_buffer<std::byte>(unfused_workspace_bytes(*plan, workspace_heads));
  return plan;
}

std::size_t unfused_workspace_bytes(const unfused_device_plan& plan, std::int64_t heads) {
  const std::int64_t group = std::clamp<std::int64_t>(kUnfusedScoreBytes / slot_bytes(plan), 1,
                                                      std::max<std::int64_t>(heads, 1));
  return workspace_of(plan, group).layout.bytes();
}

void run_unfused(const unfused_device_plan& plan, const tensor_view& q, const tensor_view& k,
                 const tensor_view& v, const tensor_view& out, double scale,
                 const workspace_view* workspace, stream_ref stream,
                 std::array<double, 3>* stage_ms) {
  const char* what = "the block-sparse SDDMM -> softmax -> SpMM pipeline";
  check_attention_operands(q, k, v, out, what);
  if (q.dim % 8 != 0 || q.dim > 256) {
    throw invalid_input(std::string(what) +
                        " takes head dims that are multiples of 8 up to 256, not " +
                        std::to_string(q.dim));
  }
  expect_current_device(plan.device);
  if (stage_ms != nullptr) *stage_ms = {0, 0, 0};
  const std::int64_t heads = q.heads;
  if (heads == 0 || q.rows == 0) return;
  // As many heads at a time as the workspace holds scores for.
  const workspace_view ws =
      workspace != nullptr ? *workspace : workspace_view{plan.own.data(), plan.own.bytes()};
  const unfused_workspace one = workspace_of(plan, 1);
  one.layout.check(ws, what);
  const std::int64_t group = std::clamp<std::int64_t>(
      static_cast<std::int64_t>((ws.bytes - one.scores) /
                                static_cast<std::size_t>(slot_bytes(plan))),
      1, heads);
  const unfused_workspace w = workspace_of(plan, group);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  il::params p{};
  static_cast<ragged_attention_io&>(p) =
      ragged_io_of(q, k, v, out, plan.cu_q.data(), plan.cu_k.data());
  p.rows = plan.rows.data();
  p.col_idx = plan.col_idx.data();
  p.scores = detail::workspace_layout::at<float>(ws, w.scores);
  p.slot = plan.slot;
  p.mask_heads = static_cast<std::int32_t>(plan.mask_heads);
  p.block = static_cast<std::int32_t>(plan.block);
  p.dim = static_cast<std::int32_t>(q.dim);
  p.causal = plan.causal;
  p.scale_log2 = scale_log2(scale);
  const il::work sddmm{plan.sddmm_tiles.data(), plan.sddmm_first.data()},
      softmax{plan.parts.data(), plan.softmax_first.data()},
      spmm{plan.spmm_tiles.data(), plan.spmm_first.data()};
  with_half_type(q.type, what, [&]<class T>() {
    with_type<float, __half, __nv_bfloat16>(out.type, what, [&]<class O>() {
      for (std::int64_t h0 = 0; h0 < heads; h0 += group) {
        const std::int64_t n = std::min(group, heads - h0);
        p.h0 = static_cast<std::int32_t>(h0);
        p.heads = static_cast<std::int32_t>(n);
        stage_timer timer(stage_ms != nullptr);
        timer.mark(0, s);
        const std::int64_t tiles = launch_items(plan.sddmm_first_h, plan.mask_heads, h0, n);
        if (tiles > 0)
          launch_sddmm<T>(plan, p, sddmm,
                          detail::workspace_layout::at<unsigned long long>(ws, w.counter), tiles,
                          s);
        timer.mark(1, s);
        const std::int64_t parts = launch_items(plan.softmax_first_h, plan.mask_heads, h0, n);
        if (parts > 0) {
          il::softmax_kernel<<<blocks_for(parts * 32, il::kSoftmaxWarps * 32),
                               il::kSoftmaxWarps * 32, 0, s>>>(p, softmax);
          TRISPARSE_CUDA_CHECK_LAUNCH();
        }
        timer.mark(2, s);
        const std::int64_t out_tiles = launch_items(plan.spmm_first_h, plan.mask_heads, h0, n);
        if (out_tiles > 0) launch_spmm<T, O>(plan, p, spmm, out_tiles, s);
        timer.mark(3, s);
        if (stage_ms != nullptr) timer.add_to(*stage_ms);
      }
    });
  });
}

std::int64_t device_bytes(const unfused_device_plan& plan) {
  return static_cast<std::int64_t>(
      plan.cu_q.bytes() + plan.cu_k.bytes() + plan.rows.bytes() + plan.col_idx.bytes() +
      plan.sddmm_first.bytes() + plan.spmm_first.bytes() + plan.softmax_first.bytes() +
      plan.sddmm_tiles.bytes() + plan.spmm_tiles.bytes() + plan.parts.bytes() + plan.own.bytes());
}

std::int64_t score_bytes_per_head(const unfused_device_plan& plan) { return plan.slot * 4; }

}  // namespace trisparse::cuda
