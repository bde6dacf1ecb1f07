#pragma once
// Which order the GCN layer takes on CUDA when the caller leaves it to the plan (plain C++: the
// op's dispatch reads it; measured on an H100, docs/notes/fused_gcn.md).
#include <cstdint>

namespace trisparse::cuda::gcn_fused_heuristics {

/// Graphs of at most this many rows are small: the one fused kernel beats the unfused order's
/// three launches (launch-bound) unless P x is much the wider product.
inline constexpr std::int64_t kSmallRows = 8192;
/// Small graphs: fused while F_in <= kSmallWidthRatio F_out.
inline constexpr std::int64_t kSmallWidthRatio = 4;
/// Large graphs: the fused kernel's (P x) pass gathers F_in-wide rows less efficiently than the
/// SpMM does F_out-wide ones; it wins where F_out >= kWideOutput F_in.
inline constexpr std::int64_t kWideOutput = 8;

/// True where the fused order should run (given that it fits).
inline bool prefer_fused(std::int64_t rows, std::int64_t in_dim, std::int64_t out_dim) {
  const bool small = rows <= kSmallRows && in_dim <= kSmallWidthRatio * out_dim;
  return small || out_dim >= kWideOutput * in_dim;
}

}  // namespace trisparse::cuda::gcn_fused_heuristics
