#pragma once
// The CUDA ME-BCRS plan's state (internal to the .cu files of src/cuda/{sparse,spmm,sddmm,
// softmax}).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>
#include <string>

#include "../common/buffer.cuh"
#include "../common/work_item.hpp"
#include "../formats/me_bcrs_build.cuh"
#include "params.hpp"
#include "plan.hpp"

namespace trisparse::cuda {

/// One operation's work list: items (largest first) and the windows split across items.
struct me_work {
  device_buffer<work_item> items;
  device_buffer<split_window> splits;
  std::int32_t num_items = 0, num_splits = 0, num_parts = 0;
  std::int32_t team_items = 0;  // SpMM: the leading items that a team of warps shares
  std::int64_t bytes() const { return static_cast<std::int64_t>(items.bytes() + splits.bytes()); }
};

struct me_device_plan {
  int device = 0, sms = 0;
  device_me_bcrs f;
  // Per operation, as its cost of a split differs: SpMM merges partial rows of C (splits cost),
  // SDDMM's slots are independent (splits are free), softmax merges two numbers per row.
  me_work spmm_work, sddmm_work, softmax_work;
  // Workspaces, grown by the first run that needs more (under the mutex), and the pattern's own
  // values converted to 16-bit types on first use.
  mutable std::mutex mutex;
  mutable device_buffer<float> part;                // SpMM partials of split windows
  mutable device_buffer<std::int32_t> split_count;  // zero between launches
  mutable device_buffer<float> part_stats;          // softmax partial (max, sum)
  mutable device_buffer<__half> values_f16;
  mutable device_buffer<__nv_bfloat16> values_bf16;

  me::format_ref ref(const me_work& w) const {
    return {f.row_ptr.data(),      f.col_idx.data(), f.mask.data(),    f.values.data(),
            f.block_offset.data(), f.rows,           f.row_map.data(), w.items.data(),
            w.num_items,           w.splits.data(),  w.team_items,     f.binary};
  }
};

namespace me {

/// Throws unless the plan's device is current.
void check_device(const me_device_plan& plan);
/// Throws unless t is [slots, heads, 1] with slot stride 1 on CUDA.
void check_slots(const me_device_plan& plan, const tensor_view& t, const char* what,
                 std::int64_t heads);
/// True when data, row and head strides allow 16-byte vector access.
bool vector_aligned(const tensor_view& t);
/// The pattern's own values in T (converted once, kept by the plan).
template <class T>
const T* own_values(const me_device_plan& plan, cudaStream_t stream);

}  // namespace me

}  // namespace trisparse::cuda
