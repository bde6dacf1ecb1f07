#pragma once
// The CPU's SpMM, SDDMM and sparse row softmax over a CSR pattern (sparse_plan on the CPU and the
// AGNN layer): OpenMP over rows, float64 arithmetic for float64 inputs and float32 for the others
// (read through copies where not f32), outputs written in their own dtype. Arguments checked by the
// callers; the float64 oracle (reference::spmm, sddmm, softmax) is what the tests hold them to.
#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {

/// c[r, h, :] = sum over entries e of row r of w_e b[col_e, h, :], w_e = w[e, h] where w.data is
/// set, else the pattern's value (1 without values). Rows with no entry get zeros.
void spmm(const csr_graph& a, const tensor_view& w, const tensor_view& b, const tensor_view& c);

/// out[e, h] = scale * value_e * <x[row_e, h, :], y[col_e, h, :]> (value_e = 1 without values).
void sddmm(const csr_graph& a, const tensor_view& x, const tensor_view& y, const tensor_view& out,
           double scale);

/// out[e, h] = the softmax of scores[., h] over row_e's entries.
void softmax(const csr_graph& a, const tensor_view& scores, const tensor_view& out);

}  // namespace trisparse::cpu
