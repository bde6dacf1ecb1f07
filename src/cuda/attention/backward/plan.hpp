#pragma once
// Host interface of the CUDA attention backward (no CUDA headers: ops/ includes it).
//
// FlashAttention-2's backward on the pattern, in passes that each own their outputs, so the
// gradients are bitwise deterministic with no floating-point atomics: the per-row terms
// D = <dout, out> (and the log-sum-exp, recomputed when the forward's is not given); a pass over
// the pattern that writes dq; a pass over the transposed pattern that writes dk and dv. Work too
// long for one warp is cut into chunks whose partial sums a reduction adds in a fixed order.
// P = exp(S - lse) is recomputed from the forward's lse. Two kernel families: tensor-core
// (mma.sync over the BSB windows of the pattern and of its transpose, both built at plan build,
// with the map between their entries) for f16/bf16 inputs of one head dim in {32, 64, 128} with
// 16-byte aligned rows, whose dq pass stores P and dS per entry in the workspace for the dk/dv
// pass; CUDA-core (a warp per row chunk and head group) for the rest (f32, other or unequal head
// dims, unaligned views).
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

/// The pattern and its transpose in device memory (CSR, 64-bit offsets, 32-bit columns).
struct attention_backward_device_plan;

/// A per-entry score bias (attention_options::bias: [nnz, H, 1] or [nnz, 1, 1] f32, in the
/// pattern's entry order) and its gradient (dbias: [nnz, H, 1] f32); data == nullptr: none.
struct score_bias {
  tensor_view bias{}, dbias{};
};

/// Uploads a checked host pattern and its transpose (with the entry of the pattern each of its
/// entries is, which a biased column pass reads), and builds both BSBs, their windows taking the
/// rows in `row_order` and the transpose's in `column_order` (order[i]: the row at position i;
/// empty: the rows' own order). Synchronous on `stream`.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<attention_backward_device_plan> make_attention_backward_plan(
    const csr_graph& pattern, const csr_graph& transposed,
    std::span<const std::int64_t> transposed_entry, stream_ref stream,
    std::span<const std::int64_t> row_order = {}, std::span<const std::int64_t> column_order = {},
    head_order heads = head_order::automatic))

/// The same from a pattern in device memory (its columns strictly increasing within each row):
/// checked, transposed (a stable sort of the entries by column) and blocked on the device; only
/// the row and window offsets come to the host, to cut the work. Synchronous on `stream`.
/// @throws invalid_input naming the broken invariant.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<attention_backward_device_plan> make_attention_backward_plan(
    const csr_view& pattern, stream_ref stream))

/// Bytes of workspace a backward of q's dtype `type` with `heads` heads of up to `head_dim`
/// elements (q's and v's) needs: the per-row terms, the partial rows of cut rows, and for 16-bit
/// inputs the tensor-core kernels' rounded dout, P and dS (4 bytes an entry and head) (f16 covers
/// every dtype), 256-byte aligned.
TRISPARSE_CUDA_ENTRY(std::size_t attention_backward_workspace_bytes(
    const attention_backward_device_plan& plan, std::int64_t heads, std::int64_t head_dim,
    dtype type))

/// dq, dk, dv of out = attention(q, k, v) given dout, on `stream`. q, k, v: f16, bf16 or f32, one
/// dtype, head dims up to 256; out and dout: f32 or q's dtype, one dtype; dq, dk, dv: f32 or q's
/// dtype, one dtype. lse: [rows, H, 1] f32 from the forward, or data == nullptr to recompute it.
/// A bias and dbias enter the dq pass (the tensor-core or the CUDA-core row pass writes dbias,
/// each entry once); the dk/dv pass reads P and dS as it stored them, or the bias itself.
/// Asynchronous: no host synchronisation, allocation or lock.
/// @throws not_supported for dtypes other than f16/bf16; invalid_input for unsupported dims or
/// too small a workspace.
TRISPARSE_CUDA_ENTRY(void run_attention_backward(
    const attention_backward_device_plan& plan, const tensor_view& q, const tensor_view& k,
    const tensor_view& v, const tensor_view& out, const tensor_view& lse, const tensor_view& dout,
    const tensor_view& dq, const tensor_view& dk, const tensor_view& dv, const score_bias& bias,
    double scale, const workspace_view& workspace, stream_ref stream))

/// Bytes of workspace run_attention_rowwise needs for `heads` heads of up to `head_dim` elements:
/// the partial results of rows cut into chunks (0 where no row is cut).
TRISPARSE_CUDA_ENTRY(std::size_t attention_rowwise_workspace_bytes(
    const attention_backward_device_plan& plan, std::int64_t heads, std::int64_t head_dim))

/// out = attention(q, k, v) over the plan's pattern by online softmax, a warp per (row chunk,
/// head group) (the f32 forward: the fused 3S kernel takes f16 and bf16), and the log-sum-exp
/// (f32) where lse.data != nullptr; bias: score_bias::bias (data == nullptr: none). q, k, v: f16,
/// bf16 or f32, one dtype, head dims up to 256; out: f32 or q's dtype. Asynchronous on `stream`:
/// no host synchronisation, allocation or lock.
/// @throws not_supported for dtypes other than f16/bf16; invalid_input for unsupported dims or
/// too small a workspace.
TRISPARSE_CUDA_ENTRY(void run_attention_rowwise(
    const attention_backward_device_plan& plan, const tensor_view& q, const tensor_view& k,
    const tensor_view& v, const tensor_view& out, const tensor_view& lse, const tensor_view& bias,
    double scale, const workspace_view& workspace, stream_ref stream))

/// Device bytes held by the plan.
TRISPARSE_CUDA_ENTRY(std::int64_t device_bytes(const attention_backward_device_plan& plan))

}  // namespace trisparse::cuda
