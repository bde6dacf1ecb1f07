#pragma once
// The fused GCN kernel's shapes (plain constexpr, host and device; docs/notes/fused_gcn.md).

namespace trisparse::cuda::gcn_fused_tuning {

inline constexpr int kWarps = 8;
inline constexpr int kTiles = 4;           // n-tiles of a warp's slice
inline constexpr int kSlice = 8 * kTiles;  // features (phase 1) or output columns (phase 2) a slice
inline constexpr int kMaxSmem = 227 * 1024;

}  // namespace trisparse::cuda::gcn_fused_tuning
