#pragma once
// The fused GAT attention on CUDA (host interface, no CUDA headers: ops/ includes it). The
// pattern's CSR and its transpose (each column's rows, and their entries in CSR order) on the
// device.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/graph/csr.hpp"
#include "trisparse/ops/layer_args.hpp"

namespace trisparse::cuda {

struct gat_device;

/// The pattern (checked by the caller) and its transpose, copied in `stream`'s order.
TRISPARSE_CUDA_ENTRY(std::shared_ptr<const gat_device> upload_gat(const csr_graph& pattern,
                                                                  stream_ref stream))

/// Bytes of workspace gat_forward (backward = false) or gat_backward needs: the chunks' partial
/// results; the backward's also per (row, head) <dout, out> and per (entry, head) the score
/// gradient.
TRISPARSE_CUDA_ENTRY(std::size_t gat_workspace_bytes(const gat_device& d, std::int64_t heads,
                                                     std::int64_t width, bool backward))

/// gat_plan::forward on CUDA (arguments checked here).
TRISPARSE_CUDA_ENTRY(void gat_forward(const gat_device& d, const gat_args& args,
                                      const workspace_view& workspace, stream_ref stream))

/// gat_plan::backward on CUDA (arguments checked here).
TRISPARSE_CUDA_ENTRY(void gat_backward(const gat_device& d, const gat_grad_args& args,
                                       const workspace_view& workspace, stream_ref stream))

}  // namespace trisparse::cuda
