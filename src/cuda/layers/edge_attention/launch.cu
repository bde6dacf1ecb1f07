// TransformerConv's and GAT's attention over a multigraph on CUDA: the dispatch and launches of
// kernel.cuh (the design is there).
#include <algorithm>
#include <string>

#include "../../common/current_device.cuh"
#include "../../common/dispatch.cuh"
#include "../../common/error.cuh"
#include "../../common/grid.cuh"
#include "kernel.cuh"
#include "plan.hpp"
#include "trisparse/core/error.hpp"

namespace trisparse::cuda {
namespace {

using namespace edge_attention_kernels;

mat in_of(const tensor_view& t) { return {t.data, t.row_stride, t.head_stride}; }
out_mat out_of(const tensor_view& t) { return {t.data, t.row_stride, t.head_stride}; }

template <class T, int NC, class F>
void with_features(int nf, F&& f) {
  switch (nf) {
    case 0:
      f.template operator()<NC, 0>();
      break;
    case 1:
      f.template operator()<NC, 1>();
      break;
    case 2:
      f.template operator()<NC, 2>();
      break;
    case 4:
      f.template operator()<NC, 4>();
      break;
    case 8:
      f.template operator()<NC, 8>();
      break;
    default:
      throw invalid_input("edge_attention: " + std::to_string(nf) +
                          " features a lane (F / group width) is not 1, 2, 4 or 8; pad F with "
                          "edge_attention_plan::feature_width");
  }
}

// Calls f.template operator()<T, NC, NF, LT>() for q's dtype, C and F; LT: the group's lanes as a
// compile-time constant for heads of 16 channels (four lanes: the layers' 8 x 16), else 0.
template <class F>
void dispatch(dtype type, std::int64_t C, std::int64_t features, F&& f) {
  const int lanes = edge_attention_group(C);
  TRISPARSE_EXPECTS_INPUT(lanes > 0,
                          "edge_attention takes heads of 4 * 2^k <= 128 or 256 "
                          "channels, not " +
                              std::to_string(C));
  TRISPARSE_EXPECTS_INPUT(features % lanes == 0,
                          "edge_attention: F = " + std::to_string(features) +
                              " is not a multiple of the group width " + std::to_string(lanes) +
                              " (pad it to edge_attention_plan::feature_width)");
  const int nf = static_cast<int>(features / lanes);
  with_element_type(type, "edge_attention", [&]<class T>() {
    if (C == 16)
      with_features<T, 4>(nf, [&]<int NC, int NF>() { f.template operator()<T, NC, NF, 4>(); });
    else if (C / lanes == 4)
      with_features<T, 4>(nf, [&]<int NC, int NF>() { f.template operator()<T, NC, NF, 0>(); });
    else
      with_features<T, 8>(nf, [&]<int NC, int NF>() { f.template operator()<T, NC, NF, 0>(); });
  });
}

params params_of(const multigraph_view& g, const tensor_view& q, double scale) {
  params p;
  p.g = g;
  p.heads = static_cast<int>(q.heads);
  p.lanes = edge_attention_group(q.dim);
  const int groups = 32 / p.lanes;
  while (p.warp_heads * 2 <= std::min(p.heads, groups)) p.warp_heads *= 2;
  p.edge_groups = groups / p.warp_heads;
  p.line_warps = (p.heads + p.warp_heads - 1) / p.warp_heads;
  p.scale = static_cast<float>(scale);
  return p;
}

// Attention dropout's draws made in the kernels, where asked.
void set_dropout(params& p, const attention_dropout& d) {
  if (d.p <= 0) return;
  p.dropout_state = d.state;
  p.drop_below = philox::drop_below(d.p);
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - d.p));
}

// TransformerConv's operands (q, k, v, r, a) and the dropout factors, for forward and backward.
template <class Args>
params attention_params(const multigraph_view& g, const Args& a) {
  params p = params_of(g, a.q, a.scale);
  p.q = in_of(a.q);
  p.k = in_of(a.k);
  p.v = in_of(a.v);
  p.r = in_of(a.r);
  p.a = in_of(a.a);
  p.keep = in_of(a.keep);
  set_dropout(p, a.dropout);
  return p;
}

// GAT's operands (x, a_src, a_dst, a_edge, the slope) and the dropout factors.
template <class Args>
params gat_params(const multigraph_view& g, const Args& a) {
  params p = params_of(g, a.x, 1.0);
  p.v = in_of(a.x);
  p.a_src = in_of(a.a_src);
  p.a_dst = in_of(a.a_dst);
  p.a_edge = in_of(a.a_edge);
  p.slope = static_cast<float>(a.negative_slope);
  p.keep = in_of(a.keep);
  set_dropout(p, a.dropout);
  return p;
}

// Calls f.template operator()<DRAWN>() with DRAWN: the kernels draw attention dropout (their own
// instantiations: those without draws keep their registers).
template <class F>
void with_draws(const params& p, F&& f) {
  if (p.dropout_state != nullptr)
    f.template operator()<true>();
  else
    f.template operator()<false>();
}

// A line kernel over the light lines (a warp a line), then over the listed heavy ones (a thread
// block per (line, head), staging its warps' states in shared memory).
template <class K>
void over_lines(K kernel, const params& p, std::int64_t lines, std::int64_t heavy, cudaStream_t s) {
  kernel<<<blocks_for(lines * p.line_warps, kWarps), kWarps * 32, 0, s>>>(p, false);
  TRISPARSE_CUDA_CHECK_LAUNCH();
  if (heavy == 0) return;
  kernel<<<blocks_for(heavy * p.heads, 1), kWarps * 32, kHeavyStageBytes, s>>>(p, true);
  TRISPARSE_CUDA_CHECK_LAUNCH();
}

// The backward's passes (G: GAT's) over the workspace's weights and score gradients: a row pass,
// a column pass and, with features, the feature pass. `x`: the operand that sets dtype and C.
template <bool G>
void backward_passes(params& p, const multigraph_view& g, const tensor_view& x,
                     std::int64_t features, const workspace_view& workspace, stream_ref stream) {
  p.prob = workspace.data;
  p.dscore = static_cast<char*>(workspace.data) +
             g.edges * p.heads * (p.ws_16 ? 2 : static_cast<std::int64_t>(sizeof(float)));
  const auto s = static_cast<cudaStream_t>(stream.handle);
  dispatch(x.type, x.dim, features, [&]<class T, int NC, int NF, int LT>() {
    if constexpr (!G || NF == 0) {  // (GAT has no feature columns: features = 0)
      with_draws(p, [&]<bool DRAWN>() {
        over_lines(row_kernel<T, NC, NF, G, LT, DRAWN>, p, g.rows, g.heavy_row_count, s);
      });
      over_lines(column_kernel<T, NC, G>, p, g.cols, g.heavy_col_count, s);
    }
    if constexpr (!G && NF > 0) {
      const int f = static_cast<int>(features);
      const auto blocks = blocks_for(g.edges * f, 256);
      if constexpr (sizeof(T) == 2) {
        if (p.ws_16) {
          feature_kernel<T, __nv_bfloat16><<<blocks, 256, 0, s>>>(p, f);
          TRISPARSE_CUDA_CHECK_LAUNCH();
          return;
        }
      }
      feature_kernel<T, float><<<blocks, 256, 0, s>>>(p, f);
      TRISPARSE_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace

void edge_attention_forward(const multigraph_view& g, const edge_attention_args& a,
                            stream_ref stream) {
  expect_current_device(g.device_id);
  params p = attention_params(g, a);
  p.out = out_of(a.out);
  p.out_edge = out_of(a.out_edge);
  p.edge_in_t = a.out_edge.type != dtype::f32;
  p.lse = out_of(a.lse);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t features = a.r.data != nullptr ? a.r.dim : 0;
  dispatch(a.q.type, a.q.dim, features, [&]<class T, int NC, int NF, int LT>() {
    with_draws(p, [&]<bool DRAWN>() {
      over_lines(forward_kernel<T, NC, NF, false, LT, DRAWN>, p, g.rows, g.heavy_row_count, s);
    });
  });
}

void edge_attention_backward(const multigraph_view& g, const edge_attention_grad_args& a,
                             const workspace_view& workspace, stream_ref stream) {
  expect_current_device(g.device_id);
  params p = attention_params(g, a);
  p.out_in = in_of(a.out);
  p.out_edge_in = in_of(a.out_edge);
  p.edge_in_t = a.out_edge.type != dtype::f32;
  p.lse_in = in_of(a.lse);
  p.dout = in_of(a.dout);
  p.dout_edge = in_of(a.dout_edge);
  p.dq = out_of(a.dq);
  p.dk = out_of(a.dk);
  p.dv = out_of(a.dv);
  p.grads_in_t = a.dq.type != dtype::f32;
  p.ws_16 = p.grads_in_t;  // (16-bit dq: a 16-bit q; backward_workspace_bytes(heads, dq's dtype))
  p.dr = out_of(a.dr);
  p.da = out_of(a.da);
  backward_passes<false>(p, g, a.q, a.r.data != nullptr ? a.r.dim : 0, workspace, stream);
}

void edge_gat_forward(const multigraph_view& g, const edge_gat_args& a, stream_ref stream) {
  expect_current_device(g.device_id);
  params p = gat_params(g, a);
  p.out = out_of(a.out);
  p.lse = out_of(a.lse);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  dispatch(a.x.type, a.x.dim, 0, [&]<class T, int NC, int NF, int LT>() {
    with_draws(p, [&]<bool DRAWN>() {
      over_lines(forward_kernel<T, NC, 0, true, LT, DRAWN>, p, g.rows, g.heavy_row_count, s);
    });
  });
}

void edge_gat_backward(const multigraph_view& g, const edge_gat_grad_args& a,
                       const workspace_view& workspace, stream_ref stream) {
  expect_current_device(g.device_id);
  params p = gat_params(g, a);
  p.out_in = in_of(a.out);
  p.lse_in = in_of(a.lse);
  p.dout = in_of(a.dout);
  p.dv = out_of(a.dx);
  p.grads_in_t = a.dx.type != dtype::f32;
  p.da_src = out_of(a.da_src);
  p.da_dst = out_of(a.da_dst);
  p.da_edge = out_of(a.da_edge);
  backward_passes<true>(p, g, a.x, 0, workspace, stream);
}

void edge_neighbor_sum(const multigraph_view& g, const tensor_view& x, const tensor_view& out,
                       bool transposed, stream_ref stream) {
  expect_current_device(g.device_id);
  params p = params_of(g, x, 1.0);
  p.v = in_of(x);
  p.dq = out_of(out);
  p.grads_in_t = out.type != dtype::f32;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  dispatch(x.type, x.dim, 0, [&]<class T, int NC, int NF, int LT>() {
    if (transposed)
      over_lines(sum_kernel<T, NC, true>, p, g.cols, g.heavy_col_count, s);
    else
      over_lines(sum_kernel<T, NC, false>, p, g.rows, g.heavy_row_count, s);
  });
}

}  // namespace trisparse::cuda
