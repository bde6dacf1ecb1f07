#pragma once
// Host interface of the blocked-sparse report's pipeline on CUDA: SDDMM -> row softmax -> SpMM
// over the row-interleaved BCSR (no CUDA headers: ops/ includes it).
#include <array>
#include <cstdint>
#include <memory>

#include "../../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/formats/block_sparse.hpp"

namespace trisparse::cuda {

/// A block mask laid out for the three kernels: block rows, tiles, softmax parts (on the device).
struct unfused_device_plan;

/// Lays out a checked mask (any block size) and uploads it (synchronous), with a workspace of its
/// own for the scores of `workspace_heads` heads (at most 8 GiB).
/// @throws not_supported without the CUDA backend; invalid_input where a count exceeds 2^31 - 1.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<unfused_device_plan> make_unfused_plan(
    const block_sparse_mask& mask, std::int64_t workspace_heads, stream_ref stream))

/// Bytes of workspace that runs all `heads` heads at once (capped at 8 GiB of scores); a run given
/// less, but at least the bytes for one head, takes the heads in groups.
TRISPARSE_CUDA_ENTRY(std::size_t unfused_workspace_bytes(const unfused_device_plan& plan,
                                                         std::int64_t heads))

/// out = attention(q, k, v) under the plan's mask, asynchronous on `stream` (stage_ms == null):
/// the scores of as many heads at a time as the workspace (the caller's, or nullptr for the
/// plan's own) holds. With stage_ms, events around each kernel give their times, summed over the
/// head groups, in milliseconds (SDDMM, softmax, SpMM), and the call synchronises `stream`. q, k,
/// v all f16 or all bf16 with v's dim equal to q's, a multiple of 8 up to 256; out f32, f16 or
/// bf16; 16-byte aligned rows. @throws invalid_input for other dtypes, dims or layouts.
TRISPARSE_CUDA_ENTRY(void run_unfused(const unfused_device_plan& plan, const tensor_view& q,
                                      const tensor_view& k, const tensor_view& v,
                                      const tensor_view& out, double scale,
                                      const workspace_view* workspace, stream_ref stream,
                                      std::array<double, 3>* stage_ms = nullptr))

/// The layout's bytes on the device (its own workspace counted); the scores of one head.
TRISPARSE_CUDA_ENTRY(std::int64_t device_bytes(const unfused_device_plan& plan))
TRISPARSE_CUDA_ENTRY(std::int64_t score_bytes_per_head(const unfused_device_plan& plan))

}  // namespace trisparse::cuda
