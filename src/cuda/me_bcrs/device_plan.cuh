#pragma once
// The CUDA ME-BCRS plan's state (internal to the .cu files of src/cuda/{sparse,spmm,sddmm,
// softmax}).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <utility>

#include "../../common/workspace_layout.hpp"
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
  // The pattern's own values in the 16-bit types (converted at build).
  device_buffer<__half> values_f16;
  device_buffer<__nv_bfloat16> values_bf16;
  // The plan's own workspace, for runs not given one: sized at build for the limits' heads and
  // feature width, its counters zeroed then.
  mutable device_buffer<std::byte> own;  // scratch: written by const runs
  std::int64_t own_heads = 0, own_dim = 0;

  me_bcrs::format_ref ref(const me_work& w) const {
    return {f.row_ptr.data(),      f.col_idx.data(), f.mask.data(),    f.values.data(),
            f.block_offset.data(), f.rows,           f.row_map.data(), w.items.data(),
            w.num_items,           w.splits.data(),  w.team_items,     f.binary};
  }
};

namespace me_bcrs {

/// The workspace of one run of any of the three operations: SpMM's split-window arrival counts
/// (zero between launches), its partial tiles, and the softmax's partial (max, sum) pairs.
struct workspace {
  detail::workspace_layout layout;
  std::size_t split_count = 0, part = 0, part_stats = 0;
};
workspace workspace_of(const me_device_plan& plan, std::int64_t heads, std::int64_t dim);
/// The workspace a run with `heads` x `dim` uses and its layout: the caller's, laid out for the
/// run and its counters cleared on `s`; or the plan's own, in the layout it was zeroed in (a
/// smaller run's scratch would otherwise overlap a larger run's counters).
/// @throws invalid_input if it is too small, naming `what`.
std::pair<workspace_view, workspace> use_workspace(const me_device_plan& plan, std::int64_t heads,
                                                   std::int64_t dim, const workspace_view* given,
                                                   const char* what, cudaStream_t s);

/// Throws unless the plan's device is current.
void check_device(const me_device_plan& plan);
/// Throws unless t is [slots, heads, 1] with slot stride 1 on CUDA.
void check_slots(const me_device_plan& plan, const tensor_view& t, const char* what,
                 std::int64_t heads);
/// Checks the two dense operands of an operation: `a` [a_rows, H, d], `b` [b_rows, H, d] with a's
/// H and d, both on the GPU. @throws invalid_input naming the operand.
void check_dense_pair(const tensor_view& a, std::int64_t a_rows, const char* a_name,
                      const tensor_view& b, std::int64_t b_rows, const char* b_name,
                      const char* op);
/// True when data, row and head strides allow 16-byte vector access.
bool vector_aligned(const tensor_view& t);
/// A view's pointer and strides as the kernels read them.
inline in_ref in_of(const tensor_view& t) { return {t.data, t.row_stride, t.head_stride}; }
inline out_ref out_of(const tensor_view& t) { return {t.data, t.row_stride, t.head_stride}; }
/// The pattern's own values in T.
template <class T>
const T* own_values(const me_device_plan& plan);

}  // namespace me_bcrs

}  // namespace trisparse::cuda
