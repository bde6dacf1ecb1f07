#pragma once
// Attention within segments on CUDA (host interface, no CUDA headers: ops/ includes it). The
// segment ids are the caller's (segment_view); the kernels keep no state.
#include <cstddef>
#include <cstdint>

#include "../../common/entry.hpp"
#include "trisparse/core/dropout.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/ops/segment_args.hpp"

namespace trisparse::cuda {

/// Bytes of the segments' bounds (two int32 a row) at the workspace's start, 256-byte rounded.
inline std::size_t segment_bounds_bytes(std::int64_t rows) {
  return (static_cast<std::size_t>(rows) * 8 + kWorkspaceAlignment - 1) / kWorkspaceAlignment *
         kWorkspaceAlignment;
}

/// True if the kernels take heads of `head_dim` in this build.
TRISPARSE_CUDA_ENTRY(bool segment_attention_takes(std::int64_t head_dim))

/// segment_attention_plan::run on CUDA (arguments checked by the caller): the bounds into the
/// workspace, then the forward kernel; `bias` the pairs' score bias (data == nullptr: none), per
/// edge where `edges` has lists.
TRISPARSE_CUDA_ENTRY(void segment_attention_forward(
    const segment_view& segments, const segment_edges& edges, const tensor_view& q,
    const tensor_view& k, const tensor_view& v, const tensor_view& out, const tensor_view& lse,
    double scale, const attention_dropout& dropout, const tensor_view& bias,
    workspace_view workspace, stream_ref stream))

/// segment_attention_plan::backward on CUDA: the bounds and the rows' terms (lse in log2 units,
/// <dout, out>) into the workspace, then the dq and the dk/dv kernels; the dq kernel writes the
/// pair bias's gradient into dbias where set.
TRISPARSE_CUDA_ENTRY(void segment_attention_backward(
    const segment_view& segments, const segment_edges& edges, const tensor_view& q,
    const tensor_view& k, const tensor_view& v, const tensor_view& out, const tensor_view& lse,
    const tensor_view& dout, const tensor_view& dq, const tensor_view& dk, const tensor_view& dv,
    double scale, const attention_dropout& dropout, const tensor_view& bias,
    const tensor_view& dbias, workspace_view workspace, stream_ref stream))

}  // namespace trisparse::cuda
