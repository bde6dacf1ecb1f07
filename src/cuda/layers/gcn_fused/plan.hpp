#pragma once
// The fused GCN layer on CUDA, GraphCUDA's A·X·W (host interface, no CUDA headers: ops/ includes
// it). The format is BSB with values: 16-row windows whose nonzero columns are compacted into
// 16x8 TCBs (bitmaps), Â's values per TCB in bitmap order. Windows with many TCBs are cut into
// chunks whose partial (Â x) rows are added in chunk order (no atomics).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/formats/bsb.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cuda {

/// A share of a cut window: TCBs [begin, end) of `window`, partial rows at `slot`.
struct gcn_chunk {
  std::int32_t window = 0, slot = 0;
  std::int64_t begin = 0, end = 0;
};

/// What the kernels read, built on the host from the propagation matrix (with values).
struct gcn_fused_host {
  bsb format;                              // 16x8 TCBs
  std::vector<std::int64_t> value_offset;  // [tcbs]: the TCB's first value
  std::vector<float> values;               // [nnz]: per TCB, in bitmap (row-major) order
  std::vector<std::int32_t> split_first;   // [windows]: first chunk of a cut window, -1 if whole
  std::vector<std::int32_t> split_count;   // [windows]
  std::vector<gcn_chunk> chunks;           // the cut windows' chunks (slot = index)
};

/// TCBs a chunk of a cut window holds; windows with more than twice this many are cut.
inline constexpr std::int64_t kGcnChunkTcbs = 64;

/// The format of `propagation` (values required) for the fused kernel.
gcn_fused_host make_gcn_fused_host(const csr_graph& propagation);

struct gcn_fused_device;

TRISPARSE_CUDA_ENTRY(std::shared_ptr<const gcn_fused_device> upload_gcn_fused(
    const gcn_fused_host& host, stream_ref stream))

/// Whether the fused kernel's shared memory holds 16 rows of (Â x) for features in_dim wide.
TRISPARSE_CUDA_ENTRY(bool gcn_fused_fits(std::int64_t in_dim, dtype type))

/// Bytes of workspace gcn_fused_forward needs (the cut windows' partial rows, fp32).
TRISPARSE_CUDA_ENTRY(std::size_t gcn_fused_workspace_bytes(const gcn_fused_device& format,
                                                           std::int64_t in_dim))

/// out = Â x w + bias (ReLU'd with `relu`), in one kernel: x [N, 1, F_in], w [F_in, 1, F_out]
/// one dtype, bias [1, 1, F_out] f32 or x's dtype (data == nullptr: none), out f32 or x's dtype;
/// relu_mask (nullptr: not written) [N, ceil(F_out / 32)] words, bit f % 32 of word f / 32 set
/// where the output before ReLU is > 0; ax (data == nullptr: not written) [N, 1, F_in] in x's
/// dtype, the (Â x) the W product used. Asynchronous on `stream`.
TRISPARSE_CUDA_ENTRY(void gcn_fused_forward(const gcn_fused_device& format, const tensor_view& x,
                                            const tensor_view& w, const tensor_view& bias,
                                            bool relu, const tensor_view& out,
                                            std::uint32_t* relu_mask, const tensor_view& ax,
                                            const workspace_view& workspace, stream_ref stream))

/// out = z + bias (ReLU'd with `relu`) with z [N, 1, F] f32, and the ReLU mask as above: the
/// epilogue of the unfused order.
TRISPARSE_CUDA_ENTRY(void bias_relu_mask(const tensor_view& z, const tensor_view& bias, bool relu,
                                         const tensor_view& out, std::uint32_t* relu_mask,
                                         stream_ref stream))

/// Rows of dout a block of relu_grad sums (its share of dbias).
inline constexpr std::int64_t kGradRowsPerBlock = 512;

/// Bytes of workspace relu_grad needs for N rows of F columns (dbias's per-block sums).
inline std::size_t relu_grad_workspace_bytes(std::int64_t rows, std::int64_t dim) {
  return static_cast<std::size_t>((rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock) *
         static_cast<std::size_t>(dim) * 4;
}

/// dz = dout ∘ mask (relu_mask nullptr: dz = dout), dout [N, 1, F] f32 or dz's dtype, and dbias
/// [1, 1, F] (f32 or dz's dtype; data == nullptr: not computed) = the column sums of dz, in a
/// fixed order (per-block sums in `workspace`, then added in block order).
TRISPARSE_CUDA_ENTRY(void relu_grad(const tensor_view& dout, const std::uint32_t* relu_mask,
                                    const tensor_view& dz, const tensor_view& dbias,
                                    const workspace_view& workspace, stream_ref stream))

}  // namespace trisparse::cuda
