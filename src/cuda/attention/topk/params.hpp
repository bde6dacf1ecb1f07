#pragma once
// Host <-> kernel parameters of the top-k selection (plain data) and the pooled means' format.
#include <cstdint>

namespace trisparse::cuda::topk {

// The rows a block of the pooling averages: [row0, row0 + rows) of Q or K.
struct pool_block {
  std::int64_t row0;
  std::int32_t rows;
};

// What a selection block needs of its group of query blocks, in one 32-byte load: the pooled
// index of the sequence's first query and key block, the group's first query block in the
// sequence, and the sequence's query and key lengths.
struct alignas(32) select_group {
  std::int32_t q_base, k_base, first, lq, lk;
};

// The pooled means of a (block, head) are a row of pooled_dim(dim) dims (those past dim: zero),
// each mean x = m 2^e for one e per row, chosen so that the largest |x| gives |m| in [2^21, 2^22)
// (m an integer: 22 significant bits, as a float32 mean has 24), written as three signed 8-bit
// digits m = 2^16 d2 + 2^8 d1 + d0 (d1, d0 in [-128, 127], d2 in [-64, 64]). So the scores are
// integer products on the tensor cores (m16n8k32 s8, exact); the six digit products of weight
// 2^16 and above give each score to a relative 2^-22 of sum |q||k|, as three tf32 products did.
// A row in memory: per 32 dims (a k-step of the MMA) 96 bytes, plane d2, then d1, then d0, each
// plane 32 bytes in which lane t of the MMA finds its 8 bytes (dims 4t ... 4t + 3, then 16 + 4t
// ... 16 + 4t + 3: one register of each of its two fragments) at 8t; then the float 2^(e + 8)
// (NaN where a mean is not finite, 0 for a zero row) and padding to 16 bytes.
__host__ __device__ constexpr int pooled_dim(int dim) { return (dim + 31) / 32 * 32; }
__host__ __device__ constexpr int pooled_bytes(int pdim) { return 3 * pdim + 16; }
// Where the 4-byte group of dims d ... d + 3 (d a multiple of 4) of digit plane `plane` lies in
// its row.
__host__ __device__ constexpr int digit_offset(int d, int plane) {
  const int in_step = d % 32;
  return d / 32 * 96 + plane * 32 + in_step % 16 / 4 * 8 + in_step / 16 * 4;
}

struct pool_params {
  const void* q;
  const void* k;
  std::int64_t q_row, q_head, k_row, k_head;
  const pool_block* blocks;  // the grid's, q_blocks query blocks first
  std::uint8_t *pooled_q, *pooled_k;
  std::int32_t q_blocks, blocks_total, heads, dim, pdim;
};

struct select_params {
  const std::uint8_t *pooled_q, *pooled_k;
  const select_group* groups;  // of each selection block, whatever its head
  std::int32_t* col_idx;
  std::int32_t heads, pdim, block, top_k, cap, max_k_blocks, rows;  // pdim: pooled_dim
  std::int32_t block_shift;  // log2(block) where block is a power of two, else -1
  bool causal, keep_diagonal;
};

}  // namespace trisparse::cuda::topk
