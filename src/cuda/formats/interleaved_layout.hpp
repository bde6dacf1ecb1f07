#pragma once
// The row-interleaved BCSR of the blocked-sparse report's pipeline and its work lists, built on
// the host from a block mask (plain data, no CUDA headers; the kernels read these types).
//
// A block row is one query block (of one mask head and sequence) and its kept key blocks. Its
// scores are stored row-interleaved: query row t of the block row holds the scores of all its
// key blocks one after the other (count * G values, "positions"), so a scalar row is contiguous
// and every kernel walks it with coalesced accesses.
#include <cstdint>
#include <vector>

#include "trisparse/formats/block_sparse.hpp"

namespace trisparse::cuda::interleaved {

/// Query rows [row0, row0 + rows) (local to sequence `seq`) attending the `count` key blocks
/// col_idx[first, first + count); position x of a row is key (col_idx[first + x / G] * G + x % G).
/// Query row t's scores start at value0 + t * count * G within its head's score slot.
struct block_row {
  std::int64_t first, value0;
  std::int32_t seq, row0, rows, count, mask_head;
};

/// SDDMM: one warp's rows [t0, t0 + R) x positions [p0, p0 + kSddmmCoords / R) of block row
/// `row`. SpMM: one thread block's rows [t0, t0 + kSpmmThreadRows * RPT) x every position.
struct tile {
  std::int32_t row, t0, p0;
};

/// Softmax: a warp's query rows, from row t of block row `row` up to the next part's start.
struct part {
  std::int32_t row, t;
};

constexpr int kSddmmCoords = 1024;        // coordinates of an SDDMM tile (32 per lane)
constexpr int kSpmmThreadRows = 8;        // a SpMM block's threads: 16 across the columns, 8 down
constexpr std::int64_t kMaxParts = 8192;  // softmax parts (warps) per mask head, at most

/// SDDMM tile rows R: the largest power of two up to min(G, 32) (a tile stays in one block row).
int sddmm_rows_for(std::int64_t block);
/// SpMM rows per thread RPT: 1 up to G = 8, 2 up to 16, else 4 (tiles of 8, 16, 32 rows).
int spmm_rows_per_thread_for(std::int64_t block);

/// A mask laid out for the three kernels. Mask head m's block rows, tiles and parts follow
/// m - 1's; *_first[m] is m's first tile or part ([mask heads + 1] entries).
struct layout {
  int sddmm_rows = 1, spmm_rows_per_thread = 1;
  std::int64_t slot = 0;  // the most scores one mask head holds
  std::vector<block_row> rows;
  std::vector<std::int32_t> col_idx;
  std::vector<tile> sddmm, spmm;
  /// Each mask head's rows split into at most kMaxParts parts of about equal weight (a row's
  /// positions + 64), then one sentinel part past the last block row.
  std::vector<part> parts;
  std::vector<std::int32_t> sddmm_first, spmm_first, softmax_first;
};

/// @throws invalid_input where a count or a sequence exceeds the kernels' 32-bit indices.
layout make_layout(const block_sparse_mask& mask);

}  // namespace trisparse::cuda::interleaved
