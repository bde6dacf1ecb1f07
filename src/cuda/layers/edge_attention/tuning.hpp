#pragma once
// The multigraph attention kernels' shapes (plain C++, host and device: the ops' checks use the
// group rule too; docs/notes/graph_transformers.md).
#include <cstdint>

namespace trisparse::cuda {

namespace edge_attention_tuning {
/// Warps per thread block of the line kernels.
inline constexpr int kWarps = 8;

/// The forward's and the row pass's blocks an SM (their __launch_bounds__ minimum; 1: none) for
/// lanes of NC channels and NF features (gat: GAT's scores), held where their registers allowed
/// them before the lane pointers and hoisted tests: the line kernels' speed follows their warps
/// an SM (docs/notes/graph_transformers.md).
constexpr int forward_blocks(int nc, int nf, bool gat) {
  if (gat) return nc == 4 ? 6 : 4;
  if (nc == 4) return nf == 0 ? 6 : nf <= 4 ? 4 : 3;
  return nf <= 1 ? 4 : 1;
}
constexpr int row_blocks(int nc, int nf) {
  if (nc == 4) return nf <= 2 ? 4 : 3;
  return nf == 0 ? 4 : 1;
}
}  // namespace edge_attention_tuning

/// The lanes of a group (one edge at a time) for heads of C channels, each lane holding 4 (or, for
/// C = 256, 8) channels; 0 if no kernel takes C.
inline int edge_attention_group(std::int64_t head_dim) {
  for (const std::int64_t per_lane : {4, 8}) {
    const std::int64_t lanes = head_dim % per_lane == 0 ? head_dim / per_lane : 0;
    if (lanes >= 1 && lanes <= 32 && (lanes & (lanes - 1)) == 0) return static_cast<int>(lanes);
  }
  return 0;
}

}  // namespace trisparse::cuda
