#pragma once
// The top-k selection's tile shapes and the shared memory they take (constexpr; H200-tuned:
// docs/notes/topk.md).
#include "params.hpp"

namespace trisparse::cuda::topk {

constexpr int kPoolThreads = 256;
constexpr int kPoolLoads = 16;  // 16-byte loads a thread keeps in flight

// Floats of shared memory a pooling warp uses: its row groups' sums (groups x dim <= 256), then
// the means in place (pdim).
__host__ __device__ constexpr int pool_warp_floats(int pdim) { return pdim > 256 ? pdim : 256; }

constexpr int kChunk = 64;     // key blocks whose means a block stages at a time
constexpr int kStages = 4;     // chunks in the staging ring: three in flight while one is scored
constexpr int kTileRows = 16;  // the MMA's rows: query blocks per row tile
constexpr int kMaxRows = 32;   // query blocks per selection block, at most: two row tiles
constexpr int kTileWarps = 8;  // warps per row tile: one 8-key column of a chunk each

// Threads of a selection block of `rows` query blocks: kTileWarps warps per row tile.
__host__ __device__ constexpr int select_threads(int rows) {
  return (rows + kTileRows - 1) / kTileRows * kTileWarps * 32;
}

// Bytes from one staged key row to the next in shared memory: pooled_bytes rounded up to an odd
// multiple of 32, so that the fragments' 8-byte reads of a half warp (rows g ... g + 3 at 8t)
// fall in distinct banks.
__host__ __device__ constexpr int key_stride(int pdim) {
  const int units = (pooled_bytes(pdim) + 31) / 32;
  return 32 * (units % 2 == 1 ? units : units + 1);
}

// Shared bytes: kStages chunks of key rows (key_stride apart), then the scores of `rows` query
// blocks (score_floats each).
__host__ __device__ constexpr int select_bytes(int rows, int pdim, int score_floats) {
  return kStages * kChunk * key_stride(pdim) + 4 * rows * score_floats;
}

// Shared floats for one query block's scores: the 32 R keys the lanes load with R held in
// registers, or max_k_blocks, rounded up to 8 modulo 32: 16-byte aligned rows, and the scoring's
// 8-byte stores of rows g = 0 ... 7 (columns 2 t, 2 t + 1) fall in distinct banks of two
// wavefronts.
__host__ __device__ constexpr int score_floats(int held, int max_k_blocks) {
  const int n = held > 0 ? 32 * held : max_k_blocks;
  return (n + 23) / 32 * 32 + 8;
}

// Shared bytes a selection block smaller than kMaxRows takes when launched as a dependent: more
// than half an SM's (`limit`), so that each takes an SM of its own as the pooling leaves it,
// instead of two sharing the first SMs the pooling leaves while other SMs stay empty.
constexpr int dependent_select_shared(int limit) { return limit / 2 + 1024; }

}  // namespace trisparse::cuda::topk
