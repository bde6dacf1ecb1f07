#pragma once
/// @file Block-sparse attention masks: per sequence of a ragged batch and per head (or shared by
/// all heads), at block granularity G, as sparse transformers define them.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "trisparse/graph/csr.hpp"
#include "trisparse/graph/generate.hpp"

namespace trisparse {

/// The mask of one block-sparse attention call over a batch of sequences packed along the rows
/// (FlashAttention's varlen layout): sequence b owns query rows [cu_seqlens_q[b],
/// cu_seqlens_q[b+1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b+1]). Query block r of
/// sequence b (its rows r·G ... r·G + G - 1, clipped at the sequence's end) attends every element
/// of the key blocks its block_mask lists, and, with `causal`, only keys j with
/// j - len_k <= i - len_q (aligned at the bottom right, as FlashAttention: j <= i when the lengths
/// are equal). A query row with no key left gets a zero output.
struct block_sparse_mask {
  std::int64_t block = 64;
  std::int64_t heads = 1;  ///< 1: one mask shared by every attention head; else one per head
  bool causal = false;
  std::vector<std::int64_t> cu_seqlens_q{0}, cu_seqlens_k{0};  ///< batch + 1 offsets
  /// [batch * heads], sequence-major: masks[b * heads + h] is len_q(b) x len_k(b) at `block`.
  std::vector<block_mask> masks;

  std::int64_t batch() const { return static_cast<std::int64_t>(cu_seqlens_q.size()) - 1; }
  std::int64_t len_q(std::int64_t b) const { return cu_seqlens_q[b + 1] - cu_seqlens_q[b]; }
  std::int64_t len_k(std::int64_t b) const { return cu_seqlens_k[b + 1] - cu_seqlens_k[b]; }
  /// The mask that attention head h (of any number of heads when shared) uses for sequence b.
  const block_mask& at(std::int64_t b, std::int64_t h) const {
    return masks[b * heads + (heads == 1 ? 0 : h)];
  }
  /// The last key query row i of sequence b may attend (-1: none): len_k - 1, or with causal
  /// min(len_k - 1, i + len_k - len_q).
  std::int64_t last_key(std::int64_t b, std::int64_t i) const {
    const std::int64_t lk = len_k(b);
    return causal ? std::min(lk - 1, i + (lk - len_q(b))) : lk - 1;
  }
  /// Kept blocks, and their share of all blocks of all (sequence, mask head) pairs.
  std::int64_t active_blocks() const;
  double density() const;
  /// The element pattern (len_q(b) x len_k(b)) of sequence b, head h, `causal` applied.
  csr_graph expand(std::int64_t b, std::int64_t h) const;
  /// @throws invalid_input naming the broken invariant: offsets not starting at 0 or decreasing,
  /// a mask count other than batch * heads, a mask whose shape or block differs from its
  /// sequence's, or a broken block pattern.
  void check() const;
};

/// A block mask held on a CUDA device, one byte a block (nonzero: kept), as a bool tensor
/// [B or 1, H or 1, query blocks, key blocks] holds it; non-owning. Sequence b, mask head h, block
/// row r, key block c at data[b * seq_stride + h * head_stride + r * row_stride + c]. It covers the
/// longest sequence; sequence b uses its top left ceil(len_q(b) / G) x ceil(len_k(b) / G) blocks.
struct device_block_mask {
  const void* data = nullptr;
  int device_id = 0;
  std::int64_t seq_stride = 0;  ///< 0: one mask for every sequence
  std::int64_t head_stride = 0;
  std::int64_t row_stride = 0;
  std::int64_t rows = 0, cols = 0;  ///< query and key blocks
};

/// Block layouts of sparse transformers, at block level (i = query block, j = key block).
enum class block_layout : std::uint8_t {
  dense,    ///< every block
  random,   ///< each block kept with probability 1 - p, the diagonal always (the report's mask)
  window,   ///< |i - j| <= window
  strided,  ///< j ≡ i (mod stride): every stride-th block back and forth, the diagonal included
  global,   ///< the first `global` query blocks attend everything and the first `global` key
            ///< blocks are attended by everyone; plus the diagonal
  bigbird,  ///< window ∪ global ∪ `random` uniformly drawn blocks per block row
};

struct block_layout_options {
  block_layout layout = block_layout::random;
  std::int64_t block = 64;
  double p = 0.9;           ///< random: fraction of blocks dropped
  std::int64_t window = 1;  ///< window, bigbird
  std::int64_t stride = 8;  ///< strided
  std::int64_t global = 1;  ///< global, bigbird
  std::int64_t random = 2;  ///< bigbird: extra random key blocks per query block row
  bool causal = false;      ///< drop the blocks with no key j <= i, mask elements above it
  std::int64_t heads = 1;   ///< masks per sequence: 1 shared, or one per head (own random draws)
  std::uint64_t seed = 1;
};

/// One mask per (sequence, head) for self-attention over sequences of the given lengths.
/// @throws invalid_input on negative lengths or sizes, p outside [0, 1], stride < 1.
block_sparse_mask make_block_sparse_mask(const block_layout_options& options,
                                         std::span<const std::int64_t> seq_lens);

}  // namespace trisparse
