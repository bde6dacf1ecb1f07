#pragma once
// Host interface of the CUDA fused 3S backend (no CUDA headers: ops/ includes it).
#include <cstdint>
#include <memory>
#include <span>

#include "../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/graph/csr.hpp"
#include "trisparse/ops/attention.hpp"

namespace trisparse::cuda {

/// The device-resident BSB (16x8 TCBs) and the warps' work list of one pattern.
struct fused3s_device_plan;

/// How work is cut (plan_options): windows of more than `split_tcbs` TCBs are cut into chunks;
/// items of at least `team_tcbs` TCBs run on all warps of a thread block (negative: none); 0 =
/// chosen from the TCB total and the SM count.
struct fused3s_limits {
  std::int32_t split_tcbs = 0, team_tcbs = 0;
  /// The largest heads and head dim that the plan's own workspace serves.
  std::int64_t workspace_heads = 8, workspace_dim = 256;
  head_order heads = head_order::automatic;  ///< the order of the (window, head) tasks
};

/// Builds the BSB (16x8) of a checked host pattern on the GPU (after uploading it) and the work
/// list: items in decreasing TCB order, cut and shared as `limits` say; and the map from its
/// slots to the pattern's entries that a score bias needs. Synchronous on `stream`.
/// @throws not_supported without the CUDA backend; cuda_error on a CUDA failure.
/// `row_order` (empty = the rows' own): the row at each window position (order[i]: the row at
/// position i), when the windows group the rows in another order; the kernel reads Q and writes
/// O through it.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<fused3s_device_plan> make_fused3s_plan(
    const csr_graph& pattern, fused3s_limits limits, stream_ref stream,
    std::span<const std::int64_t> row_order))
/// The same from a pattern in device memory, checked on the device first (its runs take no bias:
/// its rows' columns may repeat).
/// @throws invalid_input naming the broken invariant.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<fused3s_device_plan> make_fused3s_plan(const csr_view& pattern,
                                                                            fused3s_limits limits,
                                                                            stream_ref stream))

/// Bytes of workspace a run with `heads` heads of `head_dim` needs.
TRISPARSE_CUDA_ENTRY(std::size_t fused3s_workspace_bytes(const fused3s_device_plan& plan,
                                                         std::int64_t heads, std::int64_t head_dim))

/// out = attention(q, k, v) on `stream`. q, k, v: f16 or bf16, one dtype; out: f32, f16 or bf16;
/// head_dim (= v's dim) 32, 64, 128 or 256; strides multiples of 8 elements, 16-byte aligned data.
/// lse: [rows, H, 1] f32 for the per-row natural log-sum-exp of the scaled scores (-inf for
/// empty rows), or data == nullptr for none. bias: a per-entry score bias, [nnz, H, 1] or
/// [nnz, 1, 1] f32 in the pattern's entry order, added to the scaled scores (data == nullptr:
/// none; only where fused3s_takes_bias).
/// `workspace`: the caller's (cleared on the stream first), or nullptr for the plan's own.
/// Asynchronous: no host synchronisation, allocation or lock.
/// @throws not_supported for dtypes other than f16/bf16; invalid_input for unsupported shapes or
/// alignment, or too small a workspace.
TRISPARSE_CUDA_ENTRY(void run_fused3s(const fused3s_device_plan& plan, const tensor_view& q,
                                      const tensor_view& k, const tensor_view& v,
                                      const tensor_view& out, const tensor_view& lse,
                                      const tensor_view& bias, double scale,
                                      const workspace_view* workspace, stream_ref stream))

/// Whether run_fused3s takes a bias with these operands: a plan from a host pattern; q, k, v, out
/// all f16 or all bf16 of one head dim, 32, 64 or 128; 16-byte rows (else the row-wise kernel
/// takes it).
TRISPARSE_CUDA_ENTRY(bool fused3s_takes_bias(const fused3s_device_plan& plan, const tensor_view& q,
                                             const tensor_view& k, const tensor_view& v,
                                             const tensor_view& out))

/// Device bytes held by the plan (format, work list, partial-state workspace).
TRISPARSE_CUDA_ENTRY(std::int64_t device_bytes(const fused3s_device_plan& plan))

}  // namespace trisparse::cuda
