#pragma once
// Host interface of the CUDA ME-BCRS backend: SpMM, SDDMM and row softmax over one pattern's
// device format (no CUDA headers: ops/ includes it). Per-edge values are in the plan's slot
// layout: [slots, heads, 1] views with slot stride 1 (one array per head).
#include <cstdint>
#include <memory>
#include <span>

#include "../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cuda {

struct me_device_plan;

/// How work is cut (sparse_plan_options): windows of more than `split_blocks` 8-vector blocks are
/// cut into shares; SpMM items of at least `team_blocks` blocks run on a team of warps (negative:
/// none); 0 = chosen from the block total and the SM count.
struct me_work_limits {
  std::int32_t split_blocks = 0, team_blocks = 0;
  /// The largest heads and feature width that the plan's own workspace serves.
  std::int64_t workspace_heads = 8, workspace_dim = 256;
};

/// Builds the ME-BCRS (vector_rows 8 or 16) of a checked host pattern on the GPU and its work
/// lists, with rows grouped into windows in `order` (order[i] = the pattern row at window row i;
/// empty = as given). Synchronous on `stream`.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<me_device_plan> make_me_plan(
    const csr_graph& pattern, int vector_rows, me_work_limits limits, stream_ref stream,
    std::span<const std::int64_t> order = {}))
/// The same from a pattern in device memory (values: device [nnz] or nullptr for 1s), checked on
/// the device first. @throws invalid_input naming the broken invariant.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<me_device_plan> make_me_plan(
    const csr_view& pattern, const float* values, int vector_rows, me_work_limits limits,
    stream_ref stream))

struct me_plan_info {
  std::int64_t windows = 0, vectors = 0, slots = 0;
  std::int64_t format_bytes = 0;   // row_ptr, col_idx, values (the paper's ME-BCRS)
  std::int64_t sr_bcrs_bytes = 0;  // the same pattern padded to whole blocks (SR-BCRS)
  std::int64_t device_bytes = 0;   // everything the plan holds
};
TRISPARSE_CUDA_ENTRY(me_plan_info info(const me_device_plan& plan))

/// Bytes of workspace that a run of SpMM, SDDMM or softmax with `heads` heads of width `dim`
/// needs (one size serves all three). In the run functions below, `workspace` is the caller's
/// (its counters cleared on the stream first) or nullptr for the plan's own; they never
/// synchronise, allocate or lock.
TRISPARSE_CUDA_ENTRY(std::size_t me_workspace_bytes(const me_device_plan& plan, std::int64_t heads,
                                                    std::int64_t dim))

/// c[rows, H, n] = A b[cols, H, n]. values: slot layout in b's dtype, or data == nullptr for the
/// pattern's own. b: f16, bf16 (MMA m16n8k8) or f32 (tf32); c: f32 or b's dtype. Asynchronous.
TRISPARSE_CUDA_ENTRY(void run_spmm(const me_device_plan& plan, const tensor_view& values,
                                   const tensor_view& b, const tensor_view& c,
                                   const workspace_view* workspace, stream_ref stream))
/// out[slots, H, 1] = scale * A ⊙ (x y^T), 0 in slots without an entry. x: [rows, H, d],
/// y: [cols, H, d], one dtype (f16, bf16 or f32 as tf32, or with split_f32 as three tf32
/// products); out: f32 or x's dtype.
TRISPARSE_CUDA_ENTRY(void run_sddmm(const me_device_plan& plan, const tensor_view& x,
                                    const tensor_view& y, const tensor_view& out, double scale,
                                    bool split_f32, stream_ref stream))
/// Row softmax of slot values (f32, f16 or bf16 in and out; in place allowed).
TRISPARSE_CUDA_ENTRY(void run_softmax(const me_device_plan& plan, const tensor_view& in,
                                      const tensor_view& out, const workspace_view* workspace,
                                      stream_ref stream))
/// Per-edge values between CSR entry order ([nnz, H, 1], any strides) and slot layout (same
/// dtype). to_slots zeroes slots without an entry.
TRISPARSE_CUDA_ENTRY(void entries_to_slots(const me_device_plan& plan, const tensor_view& entries,
                                           const tensor_view& slots, stream_ref stream))
TRISPARSE_CUDA_ENTRY(void slots_to_entries(const me_device_plan& plan, const tensor_view& slots,
                                           const tensor_view& entries, stream_ref stream))

}  // namespace trisparse::cuda
