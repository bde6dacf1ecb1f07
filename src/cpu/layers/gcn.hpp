#pragma once
// The GCN layer on the CPU, T = float (the GCN plans' engine for f16, bf16 and f32 tensors) or
// double (for float64 ones): OpenMP over rows, every sum in a fixed order, so the results are
// bitwise the same across runs and thread counts.
#include <cstdint>
#include <span>

#include "trisparse/core/tensor.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::cpu {

/// out = act(P x W + b) in the cheaper order (P (x W) where F_out < F_in, else (P x) W); where
/// relu_mask != nullptr, bit f of word i * ceil(F_out / 32) + f / 32 is set where P x W + b > 0;
/// where ax.data != nullptr, ax = P x. Every view holds T. Shapes checked by the caller.
template <class T>
void gcn_forward(const csr_graph& p, const tensor_view& x, const tensor_view& w,
                 const tensor_view& bias, bool relu, const tensor_view& out,
                 std::uint32_t* relu_mask, const tensor_view& ax);

/// Gradients of gcn_forward given dout: dz = dout where the mask passed (all of it without one),
/// dbias = sum_i dz_i (where dbias.data != nullptr), dw = (P x)^T dz, dx = P^T (dz W^T) (where
/// dx.data != nullptr); pt = transpose(p).
template <class T>
void gcn_backward(const csr_graph& p, const csr_graph& pt, const tensor_view& x,
                  const tensor_view& w, std::span<const std::uint32_t> relu_mask,
                  const tensor_view& dout, const tensor_view& dx, const tensor_view& dw,
                  const tensor_view& dbias);

}  // namespace trisparse::cpu
