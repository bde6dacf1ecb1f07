#pragma once
/// @file A block-sparse attention pattern that is made, learned, kept and shown: per head, the
/// kept G x G blocks of an N_q x N_k score matrix over a node (or token) order, with that order
/// and a record of how the pattern was made (the learned-pattern plan's pattern object).
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/graph/generate.hpp"

namespace trisparse {

/// Per head h, heads[h] lists the kept blocks of each block row (ascending, unique), over
/// ceil(rows / block) x ceil(cols / block) blocks. `order` (empty: the identity) is the node order
/// the blocks refer to: position i holds node order[i] (a permutation of 0 .. rows - 1, square
/// patterns only), so that a graph's communities can sit in contiguous blocks. `made_by` says how
/// the pattern was made (an initialiser and its settings, a learning run).
struct block_pattern {
  std::int64_t block = 64;
  std::int64_t rows = 0, cols = 0;  ///< N_q and N_k in elements
  std::vector<csr_graph> heads;     ///< [H] block rows x key blocks
  std::vector<std::int64_t> order;  ///< empty, or a permutation of rows positions
  std::string made_by;

  std::int64_t block_rows() const { return (rows + block - 1) / block; }
  std::int64_t block_cols() const { return (cols + block - 1) / block; }
  std::int64_t num_heads() const { return static_cast<std::int64_t>(heads.size()); }
  /// @throws invalid_input naming the broken invariant: block outside [1, 2^20], sizes outside
  /// [0, 2^40], no head, a head of the wrong shape or with unsorted or repeated blocks, an order
  /// that is not a permutation of the rows (or given for a pattern that is not square).
  void check() const;
  /// The mask of one sequence of rows x cols with one mask per head (or shared by all where
  /// there is one head), for block_sparse_attention_plan; `causal` as block_sparse_mask's.
  block_sparse_mask to_mask(bool causal = false) const;
};

/// What a pattern keeps, per head and across heads.
struct block_pattern_stats {
  std::vector<double> density;          ///< [H] kept blocks / all blocks
  std::vector<double> row_min_density;  ///< [H] the emptiest block row's density
  std::vector<double> row_max_density;  ///< [H] the fullest block row's
  /// [H] mean |r - c| / (block rows) over kept blocks (r, c): 0 on the diagonal; lower is more
  /// local (a random pattern gives about 1/3).
  std::vector<double> mean_distance;
  /// Mean over head pairs of |A ∩ B| / |A ∪ B| of their kept blocks (1 with one head).
  double head_overlap = 1.0;
};
block_pattern_stats stats(const block_pattern& pattern);

/// An 8-bit grayscale picture, rows top to bottom.
struct gray_image {
  std::int64_t width = 0, height = 0;
  std::vector<std::uint8_t> pixels;  ///< [height * width]
};

/// The pattern as a picture: one panel per head, `columns` panels a row, 4 white pixels apart;
/// each pixel the share of kept blocks in its cell (0 black: all kept, 255 white: none), cells
/// of several blocks a side where a head has more than `max_side` block rows or columns (so that
/// 10^4 x 10^4 blocks stay readable), small patterns scaled up to at least 256 pixels a side.
/// Encoders (PNG) are the callers'. @throws invalid_input for max_side or columns < 1.
gray_image render(const block_pattern& pattern, std::int64_t max_side = 1024,
                  std::int64_t columns = 4);

/// A pattern from masks (one per head, each rows x cols at one block size) as given.
/// @throws invalid_input if the masks disagree in shape or block, or there are none.
block_pattern make_block_pattern(std::vector<block_mask> masks, std::string made_by);

/// A pattern of `heads` heads from a sparse transformer's layout (block_layout_options: random,
/// window, strided, global, BigBird; per head draws where options.heads > 1) over n x n.
block_pattern layout_block_pattern(const block_layout_options& options, std::int64_t n,
                                   std::int64_t heads);

/// A graph's structure as a pattern (the learned-pattern plan's initialiser from the graph): the
/// nodes in community order (community_order: label propagation, then reverse Cuthill-McKee
/// within and across communities; kept as the pattern's order) and the blocks of the reordered
/// pattern that hold an edge, plus the diagonal blocks (every node attends itself); the same
/// blocks for each of `heads` heads. @throws invalid_input unless g is square and block, heads
/// >= 1.
block_pattern community_block_pattern(const csr_graph& g, std::int64_t block, std::int64_t heads,
                                      std::uint64_t seed = 1);

/// The union of patterns of one shape, block and order: head h keeps what head h of any of them
/// keeps (a pattern of one head serves every head). @throws invalid_input on a mismatch.
block_pattern union_of(const std::vector<block_pattern>& patterns);

/// Writes the pattern to a file: a versioned little-endian binary (magic "TSBPATT", version,
/// sizes, order, made_by, per head its block row offsets and key blocks) ending in a 64-bit
/// FNV-1a checksum of everything before it. @throws invalid_input (the path in what()) if the
/// file cannot be written or the pattern is broken.
void save_block_pattern(const block_pattern& pattern, const std::filesystem::path& path);

/// Parses a pattern file's bytes (as load_block_pattern, `name` in its messages).
block_pattern parse_block_pattern(std::span<const char> bytes, const std::string& name);

/// Reads what save_block_pattern wrote; the result is checked. @throws invalid_input whose
/// what() starts with the path and names the problem: a missing or unreadable file, another
/// magic (not a pattern file), a version this build does not read, a truncated file, a checksum
/// that does not match, or a broken pattern.
block_pattern load_block_pattern(const std::filesystem::path& path);

}  // namespace trisparse
