#pragma once
// TransformerConv's and GAT's attention over a multigraph on the CPU (edge_attention_plan's CPU
// engine), T = float (for f16, bf16 and f32 tensors) or double (float64 ones): OpenMP over targets
// (forward; the backward's weights and per-target gradients) and over sources (dk and dv, or dx
// and da_src), every sum in a fixed order, so the results are bitwise the same across runs and
// thread counts. Edge position p (the view's order, by target) has source src[p] and input edge
// u = edge[p] (p without edge ids): per-edge inputs (a, a_edge, keep) are rows u, and so are
// their gradients.
#include <cstdint>

#include "trisparse/core/tensor.hpp"
#include "trisparse/ops/layer_args.hpp"

namespace trisparse::cpu {

/// The views of one call, each holding T (r, a, keep, out_edge absent where data == nullptr):
/// q [rows, H, C], k and v [cols, H, C], r [rows, H, F], a [edges, 1, F], keep [edges, H, 1].
struct edge_operands {
  tensor_view q, k, v, r, a, keep;
};

/// out_i = sum_p alpha_p keep_p v_j, out_edge_i = sum_p alpha_p keep_p a_u over target i's edges,
/// alpha the softmax of scale q_i . k_j + r_i . a_u; lse [rows, H, 1] (-inf for an empty row).
template <class T>
void edge_attention_forward(const multigraph_view& g, const edge_operands& x, T scale,
                            const tensor_view& out, const tensor_view& out_edge,
                            const tensor_view& lse);

/// The gradients given dout (and dout_edge) and the forward's lse (lse.data == nullptr:
/// recomputed in T). `scratch`: 2 edges H values of T (each edge's score gradient and weight).
template <class T>
void edge_attention_backward(const multigraph_view& g, const edge_operands& x, T scale,
                             const tensor_view& lse, const tensor_view& dout,
                             const tensor_view& dout_edge, const tensor_view& dq,
                             const tensor_view& dk, const tensor_view& dv, const tensor_view& dr,
                             const tensor_view& da, T* scratch);

/// GAT's views, each holding T: x [cols, H, C], a_src [cols, H, 1], a_dst [rows, H, 1], a_edge
/// and keep [edges, H, 1] (absent where data == nullptr).
struct gat_operands {
  tensor_view x, a_src, a_dst, a_edge, keep;
};

/// out_i = sum_p alpha_p keep_p x_j, alpha the softmax of LeakyReLU(a_dst_i + a_src_j + a_edge_u)
/// over target i's edges; lse as edge_attention_forward's.
template <class T>
void edge_gat_forward(const multigraph_view& g, const gat_operands& x, T negative_slope,
                      const tensor_view& out, const tensor_view& lse);

/// The gradients of edge_gat_forward given dout and its lse (lse.data == nullptr: recomputed in
/// T): dx, da_src by source, da_dst by target, da_edge (with a_edge) by edge. `scratch` as
/// edge_attention_backward's.
template <class T>
void edge_gat_backward(const multigraph_view& g, const gat_operands& x, T negative_slope,
                       const tensor_view& lse, const tensor_view& dout, const tensor_view& dx,
                       const tensor_view& da_src, const tensor_view& da_dst,
                       const tensor_view& da_edge, T* scratch);

}  // namespace trisparse::cpu
