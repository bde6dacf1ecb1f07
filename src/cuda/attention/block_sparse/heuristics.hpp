#pragma once
// The block-sparse backends' run-time choices (host code; measured on the H200,
// docs/notes/block_sparse.md).
#include <cstdint>

namespace trisparse::cuda::block_sparse {

/// The two-warpgroup kernel (a producer warpgroup and two consumers, one block per SM) from this
/// many 128-key tiles per query tile: against the one-warpgroup kernel (four blocks per SM) it
/// measured level at 12.8 tiles, 1.05-1.19x faster from 25.6 up, 0.78-0.94x at 2.6-10.2, where a
/// block's start, which a second resident block would hide, weighs more (heads 8, D = 64).
inline constexpr double kPingpongFromTiles = 12;

/// Blocks per SM the wgmma backward's dk/dv kernel is compiled for (launch bounds): three hold it
/// to 168 registers without spills (198 at two), and the extra warps per scheduler hide the
/// elementwise step's latency: the backward 10-12 % faster (H200, D = 64, N 32K-128K, G 64-128,
/// p 0.5-0.9; docs/notes/block_sparse_backward.md). With dropout's draws it would spill: two. At
/// D = 128 (two 64 x 128 accumulators) both take two: 246 registers, 255 with dropout.
inline constexpr int kKeyPassBlocks = 3, kKeyPassBlocksDropout = 2, kKeyPassBlocksD128 = 2;

/// The three-kernel pipeline keeps the scores of as many heads at a time as fit this many bytes
/// (at least one head): past it, more heads at once save only launches.
inline constexpr std::int64_t kUnfusedScoreBytes = std::int64_t{8} << 30;

}  // namespace trisparse::cuda::block_sparse
