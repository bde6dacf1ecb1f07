#pragma once
// TransformerConv's attention with edge features on CUDA (host interface, no CUDA headers: ops/
// includes it). The multigraph is the caller's (multigraph_view); the kernels keep no state.
#include <cstddef>
#include <cstdint>

#include "../../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/workspace.hpp"
#include "trisparse/ops/layer_args.hpp"
#include "tuning.hpp"

namespace trisparse::cuda {

/// edge_attention_plan::forward on CUDA (arguments checked by the caller).
TRISPARSE_CUDA_ENTRY(void edge_attention_forward(const multigraph_view& g,
                                                 const edge_attention_args& args,
                                                 stream_ref stream))

/// edge_attention_plan::backward on CUDA; `workspace`: edges * heads * 2 floats.
TRISPARSE_CUDA_ENTRY(void edge_attention_backward(const multigraph_view& g,
                                                  const edge_attention_grad_args& args,
                                                  const workspace_view& workspace,
                                                  stream_ref stream))

/// edge_attention_plan::gat_forward / gat_backward on CUDA (arguments checked by the caller);
/// the backward's workspace as edge_attention_backward's.
TRISPARSE_CUDA_ENTRY(void edge_gat_forward(const multigraph_view& g, const edge_gat_args& args,
                                           stream_ref stream))
TRISPARSE_CUDA_ENTRY(void edge_gat_backward(const multigraph_view& g,
                                            const edge_gat_grad_args& args,
                                            const workspace_view& workspace, stream_ref stream))

/// edge_attention_plan::neighbor_sum on CUDA (arguments checked by the caller).
TRISPARSE_CUDA_ENTRY(void edge_neighbor_sum(const multigraph_view& g, const tensor_view& x,
                                            const tensor_view& out, bool transposed,
                                            stream_ref stream))

}  // namespace trisparse::cuda
