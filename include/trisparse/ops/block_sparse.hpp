#pragma once
/// @file Block-sparse attention: O = softmax(scale · Q Kᵀ ⊙ M) V for a block mask M at granularity
/// G over a ragged batch of sequences (formats/block_sparse.hpp), one mask per head or shared.
#include <array>
#include <memory>
#include <span>

#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/ops/attention.hpp"
#include "trisparse/ops/block_kernel.hpp"

namespace trisparse {

struct block_sparse_plan_options {
  /// On the CPU: reference (float64) or fused (fp32, the CPU engine; automatic). On CUDA: block
  /// (the tensor-core block kernel, G a multiple of 16; automatic there), fused (the mask as an
  /// element pattern through the fused 3S kernel; automatic for other G), or unfused (the
  /// blocked-sparse report's three kernels over a row-interleaved
  /// BCSR, any G: SDDMM writing the scores of the kept blocks, a row softmax, SpMM; a reference
  /// pipeline that keeps every score in memory, up to 8 GiB of them at a time).
  algorithm algo = algorithm::automatic;
  /// algorithm::block only; the report's format names the one chosen.
  block_kernel kernel = block_kernel::automatic;
  /// CUDA: the largest heads and head dim that the plan's own workspace, sized at build, serves
  /// (fused's split windows; unfused's scores, taken in groups of this many heads).
  std::int64_t workspace_heads = 8, workspace_dim = 256;
  /// Prepare backward() (CUDA, algorithm::block): the transposed masks, whose key blocks list
  /// their query blocks so that dk and dv need no atomics, and the plan's own backward workspace
  /// (workspace_heads heads).
  bool gradients = false;
  /// A plan for a mask held on the device: the mean count of kept key blocks per query block row
  /// where the caller knows it (a top-k selection knows its k; a density times the key blocks),
  /// for the kernel choice that host masks make from their counts; < 0: unknown (automatic then
  /// takes the one-warpgroup wgmma kernel).
  double mean_blocks = -1.0;
};

/// A dynamic mask from the inputs (block routing, as in MoBA and NSA's selection branch): per
/// sequence, head and query block r, the `top_k` key blocks c with the highest score
/// <mean of r's Q rows, mean of c's K rows>, among the blocks the row may attend (causal: c <= r
/// in block terms, aligned at the bottom right), plus, with keep_diagonal, the block holding the
/// key aligned with r's last row (r itself when the lengths are equal).
/// Ties go to the lower block index. One mask per head (heads = q.heads).
struct topk_mask_options {
  std::int64_t block = 64;
  std::int64_t top_k = 8;
  bool causal = false;
  bool keep_diagonal = true;
};
/// q: [cu_seqlens_q.back(), H, D], k: [cu_seqlens_k.back(), H, D] on the CPU (any dtype).
/// @throws invalid_input on mismatched shapes or offsets, block < 1 or top_k < 0.
block_sparse_mask topk_block_mask(const tensor_view& q, const tensor_view& k,
                                  std::span<const std::int64_t> cu_seqlens_q,
                                  std::span<const std::int64_t> cu_seqlens_k,
                                  const topk_mask_options& options);

/// Holds one checked mask for one device; run() only computes.
class block_sparse_attention_plan {
 public:
  /// Checks the mask and prepares it (on CUDA: uploads it and orders the query tiles by work, or
  /// builds the element patterns' BSB). @throws invalid_input naming the broken invariant or an
  /// algorithm that does not run on `where`; not_supported without the CUDA backend or for
  /// algorithm::block with a block size that is not a multiple of 16.
  static block_sparse_attention_plan build(block_sparse_mask mask,
                                           device_kind where = device_kind::cpu,
                                           const block_sparse_plan_options& options = {},
                                           stream_ref stream = {});

  /// A plan for a mask held on the device (a FlexAttention BlockMask, a mask computed on the GPU):
  /// `layout` gives the lengths, heads (1 or H), block (a multiple of 16) and causality, with no
  /// masks; `kept` covers the longest sequence. The lists are written by kernels on `stream` into
  /// memory allocated and later released in `stream`'s order (the stream must outlive the plan):
  /// no host synchronisation, so a mask that changes at every step costs no round trip. CUDA and
  /// algorithm::block (automatic) only; run(), backward() (with options.gradients) as for a host
  /// mask (options.workspace_heads = 0: no own backward workspace, every backward passes one). The
  /// mask's contents are not known on the host: report().nnz is -1 and mask() has no masks. @throws
  /// invalid_input for broken offsets, a `kept` that does not cover the sequences, another device
  /// or algorithm; not_supported without the CUDA backend or for a block that is not a multiple
  /// of 16.
  static block_sparse_attention_plan build(block_sparse_mask layout, const device_block_mask& kept,
                                           const block_sparse_plan_options& options = {},
                                           stream_ref stream = {});

  /// A plan built from a mask on the device, its lists rewritten from `kept`: the same device,
  /// strides and block counts as at build, new contents (a pattern pruned again in place). The
  /// build's kernels on `stream`, into the plan's own memory: no allocation, no host
  /// synchronisation, so a training step that changes its mask can be captured in a CUDA graph.
  /// The kernel chosen at build stays. Runs and backwards enqueued before it on `stream` see the
  /// old mask, those after it the new one (a backward must follow its own forward's mask: refill
  /// between a step's backward and the next forward). `due` (one flag on the plan's device, or
  /// null): the kernels rewrite the lists only where it is true (a captured step that refills
  /// at a cadence). @throws invalid_input for a plan built from a host mask or a `kept` of
  /// another layout.
  void refill(const device_block_mask& kept, stream_ref stream = {},
              const bool* due = nullptr) const;

  /// out = attention(q, k, v) under the mask (CUDA: asynchronous on `stream`; q, k, v f16 or bf16,
  /// D 64 or 128 for algorithm::block; options.lse, [rows, H, 1], f32 with algorithm::block on
  /// CUDA, f32 or f64 with the CPU engine). q: [cu_seqlens_q.back(), H, D],
  /// k: [cu_seqlens_k.back(), H, D], v: [cu_seqlens_k.back(), H, Dv], out: [cu_seqlens_q.back(),
  /// H, Dv], on the plan's device; H = the mask's heads unless the mask is shared. Query rows with
  /// no key left give zeros. @throws invalid_input naming the argument that is wrong.
  /// `workspace`: as attention_plan::run's (workspace_bytes(q.heads, q.dim) bytes; unfused
  /// takes less, down to one head's scores, and runs the heads in groups); empty: the plan's own.
  void run(const tensor_view& q, const tensor_view& k, const tensor_view& v, const tensor_view& out,
           const attention_options& options = {}, stream_ref stream = {},
           workspace_view workspace = {}) const;
  /// Bytes of workspace that a run with `heads` heads of `head_dim` needs (0: none).
  std::size_t workspace_bytes(std::int64_t heads, std::int64_t head_dim) const;

  /// Gradients of out = run(q, k, v) given dout: dq, dk, dv shaped as q, k, v, overwritten (rows
  /// and columns no pair reaches get exact zeros), bitwise deterministic. `out` and `lse` are
  /// what run() wrote for these q, k, v (lse through attention_options::lse). CPU: reference
  /// (out and lse unused), the float64 reference gradients; fused (the default), the CPU engine's
  /// fp32 (float64 for float64 q) backward per sequence from the given out and lse, or with both
  /// empty from its forward recomputed (OpenMP, deterministic). CUDA
  /// (algorithm::block, a plan built with gradients): FlashAttention-2's backward over the mask
  /// and its transpose on tensor cores, q, k, v, dout f16 or bf16, D 64 or 128, dq/dk/dv in q's
  /// dtype or f32, asynchronous on `stream`; `workspace`: backward_workspace_bytes() bytes, or
  /// empty for the plan's own. With options.block_mass or block_grad, also each kept block's
  /// importance (attention_options); on CUDA the workspace must then be given,
  /// backward_workspace_bytes(heads, true) bytes. @throws invalid_input naming a wrong argument;
  /// not_supported for the fused and unfused CUDA algorithms.
  void backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                const tensor_view& out, const tensor_view& lse, const tensor_view& dout,
                const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                const attention_options& options = {}, stream_ref stream = {},
                workspace_view workspace = {}) const;
  /// Bytes of workspace that a CUDA backward with `heads` heads needs (0 on the CPU); with
  /// `importance`, one that also writes attention_options::block_mass, block_grad or dblock_bias.
  std::size_t backward_workspace_bytes(std::int64_t heads, bool importance = false) const;

  /// Each kept block's attention mass without a backward (inference, or a frozen model whose
  /// pattern is still measured): options.block_mass as backward() writes it (block_grad must be
  /// empty: |dS| needs a backward), from q, k and the lse that run() wrote for them. CUDA
  /// (algorithm::block, a plan built with gradients): the key tiles walk their kept blocks as the
  /// dk/dv kernel does with only P = exp(scale q·k - lse) left (about a forward's time: as many
  /// exponentials), asynchronous on `stream`, the same bits on every run; `workspace`:
  /// block_mass_workspace_bytes(heads) bytes. CPU: the float64 block masses of the CPU engine's
  /// importance (lse unused). @throws invalid_input naming a wrong argument; not_supported for
  /// the fused and unfused CUDA algorithms.
  void block_mass(const tensor_view& q, const tensor_view& k, const tensor_view& lse,
                  const attention_options& options, stream_ref stream = {},
                  workspace_view workspace = {}) const;
  /// Bytes of workspace that block_mass with `heads` heads needs (0 on the CPU).
  std::size_t block_mass_workspace_bytes(std::int64_t heads) const;

  /// unfused plans: run() with events around the pipeline's kernels; returns their times in
  /// milliseconds (SDDMM, softmax, SpMM; summed over the groups of heads whose scores the
  /// workspace holds at a time). Synchronises `stream`. @throws invalid_input for other plans or
  /// as run().
  std::array<double, 3> run_timing_stages(const tensor_view& q, const tensor_view& k,
                                          const tensor_view& v, const tensor_view& out,
                                          const attention_options& options = {},
                                          stream_ref stream = {}) const;

  /// rows/cols = total query/key rows; nnz = attended (query, key) pairs of one head (all mask
  /// heads summed when the mask is per head).
  const plan_report& report() const;
  const block_sparse_mask& mask() const;

 private:
  struct state;
  std::shared_ptr<const state> state_;
};

/// Block-sparse attention under top-k masks (topk_block_mask's definition) that the GPU selects
/// from the inputs on every call: built once for the batch's lengths, heads and options (block a
/// multiple of 16), select() recomputes the mask on the device from q and k (two launches, no host
/// synchronisation), run() attends under the last selected mask.
class topk_block_sparse_plan {
 public:
  /// @throws invalid_input for broken offsets, heads or head_dim < 1, top_k < 0; not_supported
  /// without the CUDA backend, for a block that is not a multiple of 16, or for a sequence with
  /// more key blocks than the device's shared memory holds scores for.
  static topk_block_sparse_plan build(std::span<const std::int64_t> cu_seqlens_q,
                                      std::span<const std::int64_t> cu_seqlens_k,
                                      std::int64_t heads, std::int64_t head_dim,
                                      const topk_mask_options& options,
                                      const block_sparse_plan_options& plan_options = {},
                                      stream_ref stream = {});

  /// Selects the mask from q: [cu_seqlens_q.back(), heads, head_dim] and k (f16 or bf16, on the
  /// plan's device); asynchronous on `stream`. @throws invalid_input for other shapes or dtypes.
  void select(const tensor_view& q, const tensor_view& k, stream_ref stream = {});

  /// out = attention(q, k, v) under the last selected mask, as block_sparse_attention_plan::run
  /// (options.lse too). @throws invalid_input before the first select().
  void run(const tensor_view& q, const tensor_view& k, const tensor_view& v, const tensor_view& out,
           const attention_options& options = {}, stream_ref stream = {}) const;

  /// Gradients under the last selected mask, as block_sparse_attention_plan::backward on CUDA
  /// (build with plan_options.gradients: select() then also rebuilds the transposed masks on the
  /// device, in stream order). `workspace`: backward_workspace_bytes(q.heads) bytes.
  /// @throws invalid_input before the first select(), for a plan built without gradients, or
  /// naming a wrong argument.
  void backward(const tensor_view& q, const tensor_view& k, const tensor_view& v,
                const tensor_view& out, const tensor_view& lse, const tensor_view& dout,
                const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
                workspace_view workspace, const attention_options& options = {},
                stream_ref stream = {}) const;
  std::size_t backward_workspace_bytes(std::int64_t heads, bool importance = false) const;
  /// Each kept block's attention mass under the last selected mask, without a backward, as
  /// block_sparse_attention_plan::block_mass on CUDA (build with plan_options.gradients).
  void block_mass(const tensor_view& q, const tensor_view& k, const tensor_view& lse,
                  workspace_view workspace, const attention_options& options,
                  stream_ref stream = {}) const;
  std::size_t block_mass_workspace_bytes(std::int64_t heads) const;

  /// The last selected mask, downloaded (synchronous on `stream`). @throws invalid_input before
  /// the first select().
  block_sparse_mask mask(stream_ref stream = {}) const;
  const plan_report& report() const;

 private:
  struct state;
  std::shared_ptr<state> state_;
};

}  // namespace trisparse
