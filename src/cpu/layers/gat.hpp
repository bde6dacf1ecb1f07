#pragma once
// GAT's attention on the CPU, T = float (the GAT plan's engine for f16, bf16 and f32 tensors) or
// double (for float64 ones): OpenMP over rows (forward; backward's scores and da_dst) and over the
// transpose's columns (dx, da_src), every sum in a fixed order, so the results are bitwise the
// same across runs and thread counts.
#include <cstdint>

#include "../../graph/transposed.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {

/// keep's factors of entry e for head h in row keep_index[e] (row e without an index);
/// keep.data == nullptr: 1.
struct gat_keep {
  const tensor_view& keep;
  const std::int64_t* index = nullptr;
};

/// out[i, h] = sum_e softmax_e(LeakyReLU(a_dst[i, h] + a_src[j, h])) keep[e, h] x[j, h] over row
/// i's entries e = (i, j); lse[i, h] (where lse.data != nullptr): log sum_e exp(LeakyReLU(...)),
/// -inf for an empty row. Every view holds T. Shapes and keep_index checked by the caller.
template <class T>
void gat_forward(const csr_graph& g, const tensor_view& x, const tensor_view& a_src,
                 const tensor_view& a_dst, const gat_keep& keep, T negative_slope,
                 const tensor_view& out, const tensor_view& lse);

/// The gradients of gat_forward given dout and the forward's lse (lse.data == nullptr: recomputed
/// in T): dx, da_src (per source, sums over the transpose's column in row order), da_dst (per
/// target, in entry order).
template <class T>
void gat_backward(const csr_graph& g, const detail::transposed_pattern& t, const tensor_view& x,
                  const tensor_view& a_src, const tensor_view& a_dst, const gat_keep& keep,
                  T negative_slope, const tensor_view& lse, const tensor_view& dout,
                  const tensor_view& dx, const tensor_view& da_src, const tensor_view& da_dst);

}  // namespace trisparse::cpu
