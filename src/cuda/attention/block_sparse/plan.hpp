#pragma once
// Host interface of the CUDA fused block-sparse attention backend (no CUDA headers: ops/
// includes it).
#include <cstdint>
#include <memory>
#include <vector>

#include "../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/ops/block_kernel.hpp"

namespace trisparse::cuda {

/// A block mask on the device and its query tiles in launch order.
struct block_sparse_device_plan;

/// Whether the fused kernel takes masks at this block size (a multiple of 16).
TRISPARSE_CUDA_ENTRY(bool block_sparse_supports(std::int64_t block))

/// Uploads a checked mask (block a multiple of 16), chooses the kernel (`kernel`: automatic
/// resolved for the current device) and orders its query tiles by work, most first; with
/// `gradients` also what run_block_sparse_backward needs (the transposed masks, the key tiles).
/// Synchronous on `stream`. @throws not_supported without the CUDA backend, for a block size the
/// kernel has no tile for, or for wgmma where it cannot run.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan(
    const block_sparse_mask& mask, block_kernel kernel, bool gradients, stream_ref stream))

/// As make_block_sparse_plan for a mask held on the device: `layout` gives the lengths, mask heads,
/// block and causality (no masks); the lists are written from `kept` by kernels on `stream`, into
/// memory allocated in `stream`'s order and released there (the stream must outlive the plan):
/// no host synchronisation. Tiles run in the layout's order (the work per tile is unknown on the
/// host); `mean_blocks` (kept key blocks per block row, < 0: unknown) chooses automatic's kernel as
/// a host mask's counts do, and unknown never takes the two-warpgroup wgmma kernel.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<block_sparse_device_plan> make_block_sparse_plan_on_device(
    const block_sparse_mask& layout, const device_block_mask& kept, block_kernel kernel,
    bool gradients, double mean_blocks, stream_ref stream))

/// Rewrites the lists of a plan made by make_block_sparse_plan_on_device from `kept` (the same
/// device, strides and block counts as at build; new contents): the build's kernels on `stream`
/// into the plan's memory, the transposed masks too, no allocation and no host synchronisation,
/// so that it can be captured in a CUDA graph. The kernel choice made at build stays. `due`
/// (null: always): a flag on the device the kernels read first, returning at once where false.
TRISPARSE_CUDA_ENTRY(void refill_block_sparse_plan(block_sparse_device_plan& plan,
                                                   const device_block_mask& kept, stream_ref stream,
                                                   const bool* due))

/// A per-block score bias (attention_options::block_bias: f32 [batch * qb_max, H or 1, KB],
/// checked by the caller; data == nullptr: none) and, for a backward, its gradient (dblock_bias,
/// f32 [batch * qb_max, H, KB]: each kept block's sum of dS, written by the importance's last
/// kernel from signed partial sums; the workspace sized as for importance).
struct block_bias_views {
  tensor_view bias{}, grad{};
  std::int64_t qb_max = 0;
};

/// The kernel the plan runs ("mma.sync" or "wgmma").
TRISPARSE_CUDA_ENTRY(const char* kernel_name(const block_sparse_device_plan& plan))

/// out = attention(q, k, v) under the plan's mask, asynchronous on `stream`. q, k, v all f16 or
/// all bf16, head_dim 64 or 128 (v's dim = q's), out f32, f16 or bf16; 16-byte aligned data and
/// strides that are multiples of 8 elements; where lse.data is set, also the rows' log-sum-exp
/// (f32 [rows, H, 1]). Shapes are checked by the caller. With `dropout` (checked by the caller),
/// the mma.sync kernel draws it (over the backward's query tiles where the plan's are not its).
/// @throws not_supported for dtypes other than f16/bf16; invalid_input for unsupported dims or
/// layouts.
TRISPARSE_CUDA_ENTRY(void run_block_sparse(
    const block_sparse_device_plan& plan, const tensor_view& q, const tensor_view& k,
    const tensor_view& v, const tensor_view& out, const tensor_view& lse, double scale,
    const attention_dropout& dropout, const block_bias_views& bias, stream_ref stream))

/// What a backward also writes, where mass.data or grad.data is set: each kept block's attention
/// mass and |dS| sum (attention_options::block_mass, block_grad; f32, checked by the caller), row
/// seq * qb_max + r for sequence seq's query block r.
struct block_importance_views {
  tensor_view mass{}, grad{};
  std::int64_t qb_max = 0;
  bool wanted() const { return mass.data != nullptr || grad.data != nullptr; }
};

/// Bytes of workspace run_block_sparse_backward needs for `heads` heads (the per-row terms; with
/// `importance`, also the block importance's partial sums).
TRISPARSE_CUDA_ENTRY(std::size_t block_sparse_backward_workspace_bytes(
    const block_sparse_device_plan& plan, std::int64_t heads, bool importance))

/// dq, dk, dv of out = run_block_sparse(q, k, v) given dout, out and the forward's lse (f32
/// [rows, H, 1]): three kernels, asynchronous on `stream`, no atomics (bitwise deterministic).
/// q, k, v, dout as run_block_sparse's inputs (one type), out that type or f32; dq, dk, dv all
/// q's type or all f32. The plan must have been made with gradients. Shapes are checked by the
/// caller. With `importance` wanted, a fourth kernel writes it (the workspace sized for it). With
/// `dropout`, the forward's draws regenerated by the mma.sync kernels.
/// @throws not_supported for dtypes other than f16/bf16; invalid_input for unsupported dims,
/// layouts or a small workspace.
TRISPARSE_CUDA_ENTRY(void run_block_sparse_backward(
    const block_sparse_device_plan& plan, const tensor_view& q, const tensor_view& k,
    const tensor_view& v, const tensor_view& out, const tensor_view& lse, const tensor_view& dout,
    const tensor_view& dq, const tensor_view& dk, const tensor_view& dv, double scale,
    const block_importance_views& importance, const attention_dropout& dropout,
    const block_bias_views& bias, workspace_view workspace, stream_ref stream))

/// Bytes of workspace run_block_sparse_mass needs for `heads` heads (the partial sums).
TRISPARSE_CUDA_ENTRY(std::size_t block_sparse_mass_workspace_bytes(
    const block_sparse_device_plan& plan, std::int64_t heads))

/// Each kept block's attention mass (importance.mass; importance.grad unused) from q, k and the
/// forward's lse (f32 [rows, H, 1]), without a backward: two kernels (mass.cuh, then the
/// backward's finishing one), asynchronous on `stream`, no atomics. The plan must have been made
/// with gradients (the transposed masks). @throws invalid_input for a plan without them, a small
/// workspace, unsupported dims or layouts; not_supported for dtypes other than f16/bf16.
TRISPARSE_CUDA_ENTRY(void run_block_sparse_mass(const block_sparse_device_plan& plan,
                                                const tensor_view& q, const tensor_view& k,
                                                const tensor_view& lse, double scale,
                                                const block_importance_views& importance,
                                                workspace_view workspace, stream_ref stream))

TRISPARSE_CUDA_ENTRY(std::int64_t device_bytes(const block_sparse_device_plan& plan))

/// An attention plan whose blocks the device selects (top-k block routing).
struct topk_device_plan;

/// `skeleton`: the batch's lengths, heads, block and causality, with every block row holding
/// top_k (+ 1 with keep_diagonal) slots (any ascending values; those past a row's allowed blocks
/// equal to its sequence's key-block count). With `gradients`, select_topk also rebuilds the
/// transposed masks that run_block_sparse_backward reads. @throws not_supported as
/// make_block_sparse_plan, or where one sequence has more key blocks than shared memory holds
/// scores for.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<topk_device_plan> make_topk_plan(
    const block_sparse_mask& skeleton, std::int64_t top_k, bool keep_diagonal, std::int64_t dim,
    block_kernel kernel, bool gradients, stream_ref stream))

/// The plan run_block_sparse takes, with the last selected blocks.
TRISPARSE_CUDA_ENTRY(const block_sparse_device_plan& attention_of(const topk_device_plan& plan))

/// Selects the blocks from q and k ([rows, heads, dim], f16 or bf16, on the device), asynchronous
/// on `stream` (two launches). @throws invalid_input for other shapes, dtypes or devices.
TRISPARSE_CUDA_ENTRY(void select_topk(topk_device_plan& plan, const tensor_view& q,
                                      const tensor_view& k, stream_ref stream))

/// The block slots (synchronous on `stream`): mask m's block row r at (rows before m + r) * slots.
TRISPARSE_CUDA_ENTRY(std::vector<std::int32_t> download_blocks(const topk_device_plan& plan,
                                                               stream_ref stream))

}  // namespace trisparse::cuda
