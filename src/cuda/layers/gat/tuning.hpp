#pragma once
// The fused GAT kernels' launch shapes (plain constexpr, host and device; docs/notes/gat.md).
#include <cstdint>

#include "trisparse/ops/layer_args.hpp"

namespace trisparse::cuda::gat {

/// Warps per thread block.
inline constexpr int kWarps = 8;
/// The fewest blocks an SM must hold of the forward and column kernels whose lanes keep one
/// vector of a head (F == V): 4, 32 warps, so at most 64 registers a thread. Their per-entry
/// gathers are bound by latency, and 32 resident warps hide more of it than the 16-24 that 72-106
/// registers allowed: on the H100 the forward 1.3-1.4 x and the column pass 1.3-1.8 x faster
/// (8 x 8 and 1 x 16 heads in f32), though the column pass then spills a few words to L1.
template <int V, int F>
inline constexpr int kMinBlocks = F == V ? 32 / kWarps : 1;
/// Lines (rows, or columns of the transpose) longer than this are cut into chunks of it.
inline constexpr std::int64_t kChunk = gat_chunk_entries;
/// Edges whose loads are issued together, for F floats a lane of a head.
template <int F>
inline constexpr int kUnroll = F <= 4 ? 4 : 2;

}  // namespace trisparse::cuda::gat
