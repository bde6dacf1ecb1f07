#pragma once
/// @file Float64 CPU reference implementations: the oracle every backend is tested against.
/// Obviously correct rather than fast. Dense operands are [rows, heads, dim] views on the CPU of
/// any dtype; per-edge operands are [nnz, heads, 1] views in the pattern's CSR entry order.
/// Attention treats the pattern as binary (its values are ignored); SDDMM and SpMM use the
/// pattern's values when it has them (1 otherwise).
#include <cstdint>
#include <span>
#include <vector>

#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/formats/bsb.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::reference {

/// out[e, h] = a_e * scale * <x[row(e), h, :], y[col(e), h, :]>.
/// x: [rows, H, D], y: [cols, H, D], out: [nnz, H, 1].
void sddmm(const csr_graph& pattern, const tensor_view& x, const tensor_view& y,
           const tensor_view& out, double scale = 1.0);

/// Row-wise max-stabilised softmax over each row's entries: out[e, h] = exp(s_e - m) / sum.
/// scores, out: [nnz, H, 1]. Rows without entries have nothing to write.
void softmax(const csr_graph& pattern, const tensor_view& scores, const tensor_view& out);

/// c[i, h, :] = sum_e w[e, h] * b[col(e), h, :]. w: [nnz, H, 1], or a view with data == nullptr
/// for the pattern's own values (1 when binary). b: [cols, H, D], c: [rows, H, D].
void spmm(const csr_graph& pattern, const tensor_view& w, const tensor_view& b,
          const tensor_view& c);

/// O = softmax(scale * Q K^T ⊙ A) V, unfused (SDDMM -> softmax -> SpMM), all in float64.
/// q: [rows, H, D], k: [cols, H, D], v: [cols, H, Dv], out: [rows, H, Dv]. Empty rows give 0.
void attention(const csr_graph& pattern, const tensor_view& q, const tensor_view& k,
               const tensor_view& v, const tensor_view& out, double scale);

/// Block-sparse attention over a ragged batch: for each sequence b and head h, attention() over
/// mask.expand(b, h) on that sequence's rows of head h. q: [cu_seqlens_q.back(), H, D],
/// k: [cu_seqlens_k.back(), H, D], v: [.., H, Dv], out: [cu_seqlens_q.back(), H, Dv]; H equal to
/// mask.heads unless the mask is shared (heads == 1). Rows with no key left give 0.
/// @throws invalid_input on a broken mask or mismatched shapes.
/// block_bias (data == nullptr: none): attention_options::block_bias's per-block score bias,
/// [batch * QB, H or 1, KB], any float dtype.
void block_sparse_attention(const block_sparse_mask& mask, const tensor_view& q,
                            const tensor_view& k, const tensor_view& v, const tensor_view& out,
                            double scale, const tensor_view& block_bias = {});

/// The same function computed the way the fused kernel does: over the BSB's row windows and
/// tensor-core blocks in order, with the bitmap as mask and an online (running max, running sum)
/// softmax, in float64. Checks the format and the blocked algorithm against attention().
void blocked_attention(const bsb& format, const tensor_view& q, const tensor_view& k,
                       const tensor_view& v, const tensor_view& out, double scale);

// --- Gradients (issue 42): float64, obviously correct, checked against finite differences. ---

/// attention() with a per-entry score bias, S_ij = scale <q_i, k_j> + bias[e, h] for entry
/// e = (i, j) (data == nullptr: none), that also writes the per-row log-sum-exp of the scores,
/// lse[i, h] = log sum_j exp(S_ij) over row i's entries (natural log; -inf for an empty row;
/// data == nullptr: not written). lse: [rows, H, 1]; bias: [nnz, H, 1] or [nnz, 1, 1] (shared by
/// the heads) in CSR entry order; any float dtype. A bias of log(m_e) counts entry e m_e times (a
/// repeated edge: each copy a separate term of the softmax).
void attention(const csr_graph& pattern, const tensor_view& q, const tensor_view& k,
               const tensor_view& v, const tensor_view& out, double scale, const tensor_view& lse,
               const tensor_view& bias = {});

/// Gradients of out = attention(q, k, v) given dout = dL/dout: dq [rows, H, D], dk [cols, H, D],
/// dv [cols, H, Dv] (overwritten; rows and columns without entries get 0). ds: [nnz, H, 1] in
/// CSR entry order, the gradient of the scaled score's argument (dL/dS, S = scale <q, k> + bias,
/// so also dL/dbias), or a view with data == nullptr to skip it. bias: as attention()'s.
void attention_backward(const csr_graph& pattern, const tensor_view& q, const tensor_view& k,
                        const tensor_view& v, const tensor_view& dout, const tensor_view& dq,
                        const tensor_view& dk, const tensor_view& dv, double scale,
                        const tensor_view& ds = {}, const tensor_view& bias = {});

/// Gradients of out = block_sparse_attention(mask, q, k, v) given dout, per sequence and head as
/// attention_backward over mask.expand(b, h). Shapes as block_sparse_attention's; block_bias as
/// its; dblock_bias (data == nullptr: not written): each kept block's sum of dS = dL/dS,
/// [batch * QB, H, KB], blocks the mask drops not written.
void block_sparse_attention_backward(const block_sparse_mask& mask, const tensor_view& q,
                                     const tensor_view& k, const tensor_view& v,
                                     const tensor_view& dout, const tensor_view& dq,
                                     const tensor_view& dk, const tensor_view& dv, double scale,
                                     const tensor_view& block_bias = {},
                                     const tensor_view& dblock_bias = {});

/// Each kept block's importance under a block mask, in float64 (what a block-sparse backward
/// writes with attention_options::block_mass / block_grad): per sequence b, head h and kept block
/// (r, c), the softmax weights P summed over the block's (query, key) pairs and divided by the
/// block's query rows (block_mass), and the sum of |dS| over them (block_grad; dS = dL/dS for the
/// scaled score S, given dout). Views [batch * QB, H, KB] (QB, KB: the longest sequence's query
/// and key blocks), row b * QB + r; data == nullptr: not written; blocks the mask drops are not
/// written. Shapes of q, k, v, dout as block_sparse_attention_backward's.
void block_importance(const block_sparse_mask& mask, const tensor_view& q, const tensor_view& k,
                      const tensor_view& v, const tensor_view& dout, double scale,
                      const tensor_view& block_mass, const tensor_view& block_grad);

// --- Multigraphs (edge_attention_plan): edge p of `edges` runs from source edges.dst[p] (a column)
// into target edges.src[p] (a row); repeated pairs are separate edges, each its own term of the
// softmax; row p of a per-edge tensor is edge p's. ---

/// TransformerConv's attention with edge features (edge_attention_args): per head h, the score
/// of edge p = (i <- j) is s_p = scale <q_i, k_j> + <r_i, a_p> (r and a with data == nullptr: no
/// feature term), the softmax runs over target i's edges, out_i = sum_p alpha_p keep_p v_j,
/// out_edge_i = sum_p alpha_p keep_p a_p, lse_i = log sum_p exp(s_p) (-inf without edges). q
/// [rows, H, C], k and v [cols, H, C], r [rows, H, F], a [edges, 1, F], keep [edges, H, 1]
/// (data == nullptr: 1); out_edge and lse with data == nullptr are not written.
void edge_attention(const coo_graph& edges, const tensor_view& q, const tensor_view& k,
                    const tensor_view& v, const tensor_view& r, const tensor_view& a,
                    const tensor_view& keep, double scale, const tensor_view& out,
                    const tensor_view& out_edge, const tensor_view& lse);

/// Gradients of edge_attention's out and out_edge given dout [rows, H, C] and dout_edge [rows,
/// H, F] (data == nullptr: 0): dq, dk, dv, and with features dr [rows, H, F] and da [edges, 1, F]
/// (summed over the heads).
void edge_attention_backward(const coo_graph& edges, const tensor_view& q, const tensor_view& k,
                             const tensor_view& v, const tensor_view& r, const tensor_view& a,
                             const tensor_view& keep, double scale, const tensor_view& dout,
                             const tensor_view& dout_edge, const tensor_view& dq,
                             const tensor_view& dk, const tensor_view& dv, const tensor_view& dr,
                             const tensor_view& da);

/// GAT's attention over a multigraph (edge_gat_args): per head, z_p = a_dst[i] + a_src[j] +
/// a_edge[p] (a_edge with data == nullptr: no edge term), the softmax of LeakyReLU(z) over target
/// i's edges, out_i = sum_p alpha_p keep_p x_j. x [cols, H, C], a_src [cols, H, 1], a_dst [rows,
/// H, 1], a_edge and keep [edges, H, 1]; lse as edge_attention's.
void edge_gat(const coo_graph& edges, const tensor_view& x, const tensor_view& a_src,
              const tensor_view& a_dst, const tensor_view& a_edge, const tensor_view& keep,
              double negative_slope, const tensor_view& out, const tensor_view& lse);

/// Gradients of edge_gat's out given dout: dx [cols, H, C], da_src [cols, H, 1], da_dst [rows, H,
/// 1] and, with a_edge, da_edge [edges, H, 1].
void edge_gat_backward(const coo_graph& edges, const tensor_view& x, const tensor_view& a_src,
                       const tensor_view& a_dst, const tensor_view& a_edge, const tensor_view& keep,
                       double negative_slope, const tensor_view& dout, const tensor_view& dx,
                       const tensor_view& da_src, const tensor_view& da_dst,
                       const tensor_view& da_edge);

/// The fused GCN layer (GraphCUDA's A·X·W with its epilogue): out = relu(Â x w + bias), x
/// [N, 1, F_in], w [F_in, 1, F_out], bias [1, 1, F_out] (data == nullptr: none), out [N, 1, F_out],
/// all in float64. With `relu`, returns the ReLU mask, one bit per output element: bit f % 32 of
/// word i * ceil(F_out / 32) + f / 32 is set where Â x w + bias > 0 (what the backward reads);
/// without, an empty vector and no ReLU.
std::vector<std::uint32_t> gcn_fused(const csr_graph& propagation, const tensor_view& x,
                                     const tensor_view& w, const tensor_view& bias, bool relu,
                                     const tensor_view& out);

/// Gradients of gcn_fused's out given dout [N, 1, F_out] and its ReLU mask (empty: no ReLU):
/// dx, dw as gcn_backward's, dbias [1, 1, F_out] (data == nullptr: not computed).
void gcn_fused_backward(const csr_graph& propagation, const tensor_view& x, const tensor_view& w,
                        std::span<const std::uint32_t> relu_mask, const tensor_view& dout,
                        const tensor_view& dx, const tensor_view& dw, const tensor_view& dbias);

/// GAT's attention (gat_plan): per head h, e = LeakyReLU(a_dst[i, h] + a_src[j, h]) over row i's
/// entries (i, j), p = softmax over the row, out[i, h] = sum_j p_ij keep_ij x[j, h]. x [cols, H,
/// C], a_src [cols, H, 1], a_dst [rows, H, 1], keep [nnz, H, 1] in entry order (data == nullptr:
/// 1), out [rows, H, C], lse [rows, H, 1] (log sum_j exp(e_ij), -inf for an empty row; data ==
/// nullptr: not written).
void gat(const csr_graph& pattern, const tensor_view& x, const tensor_view& a_src,
         const tensor_view& a_dst, const tensor_view& keep, double negative_slope,
         const tensor_view& out, const tensor_view& lse);

/// Gradients of gat()'s out given dout [rows, H, C]: dx [cols, H, C], da_src [cols, H, 1],
/// da_dst [rows, H, 1] (keep gets none).
void gat_backward(const csr_graph& pattern, const tensor_view& x, const tensor_view& a_src,
                  const tensor_view& a_dst, const tensor_view& keep, double negative_slope,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& da_src,
                  const tensor_view& da_dst);

/// Gradients of the GCN layer's out = Â (x w) (Â = gcn_normalized(graph), with its values) given
/// dout [N, 1, F_out]: dx [N, 1, F_in], dw [F_in, 1, F_out] (row-major weights, as forward's).
void gcn_backward(const csr_graph& propagation, const tensor_view& x, const tensor_view& w,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& dw);

/// Gradients of the AGNN layer's out_i = sum_j softmax_j(beta cos(h_i, h_j)) h_j over row i of
/// the (binary) `propagation` pattern (agnn_layer's A + I), given dout [N, 1, F]: dh [N, 1, F]
/// and d beta (returned). Rows of h that are zero have cosine 0 and no gradient through it.
double agnn_backward(const csr_graph& propagation, const tensor_view& h, double beta,
                     const tensor_view& dout, const tensor_view& dh);

/// Gradients of out = sddmm(pattern, x, y, scale) given dout [nnz, H, 1]: dx [rows, H, D],
/// dy [cols, H, D] (the pattern's values weigh the entries, as in sddmm()).
void sddmm_backward(const csr_graph& pattern, const tensor_view& x, const tensor_view& y,
                    const tensor_view& dout, const tensor_view& dx, const tensor_view& dy,
                    double scale = 1.0);

/// Gradient of out = softmax(pattern, scores) given out and dout ([nnz, H, 1]): dscores.
void softmax_backward(const csr_graph& pattern, const tensor_view& out, const tensor_view& dout,
                      const tensor_view& dscores);

/// Gradients of c = spmm(pattern, w, b) given dc [rows, H, D]: dw [nnz, H, 1] (data == nullptr:
/// skipped, as when w is the pattern's own values) and db [cols, H, D].
void spmm_backward(const csr_graph& pattern, const tensor_view& w, const tensor_view& b,
                   const tensor_view& dc, const tensor_view& dw, const tensor_view& db);

}  // namespace trisparse::reference
