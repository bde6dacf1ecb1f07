#pragma once
/// @file Learning a block pattern offline from attention samples (the plan's "learn" and "prune"
/// steps on the CPU): each block's exact attention mass, pruned to a target sparsity per head.
/// Python's trisparse.learn_block_pattern and `trisparse pattern learn` run it.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "trisparse/core/tensor.hpp"
#include "trisparse/formats/block_pattern.hpp"

namespace trisparse {

/// How blocks are chosen from an importance [H][query blocks][key blocks].
struct prune_options {
  /// "row": each block row's highest up to (1 - sparsity) of its key blocks (at least one);
  /// "global": each head's highest up to (1 - sparsity) of its blocks; "threshold": each block
  /// row's fewest blocks whose importance reaches top_p of the row's total (sparsity unused);
  /// "output": chosen for the attention output from the blocks' masses and value sums
  /// (prune_blocks_by_output).
  std::string method = "row";
  double sparsity = 0.9, top_p = 0.9;
  /// Forced blocks, kept beyond the budget: the diagonal, a band of `window` blocks each side,
  /// the first `global_blocks` block rows and key blocks.
  bool keep_diagonal = true;
  std::int64_t window = 0, global_blocks = 0;
  /// @throws invalid_input naming the field that is out of range.
  void check() const;
};

/// Each block's exact attention mass per head: softmax(scale q kᵀ) (causal: keys up to the
/// query's position, aligned at the bottom right) summed over the block and divided by the block
/// row's query rows, so that a block row sums to 1. q: [N_q, H, D], k: [N_k, H, D] on the CPU, any
/// float dtype; scale <= 0: 1/sqrt(D). Scores in float32, sums in float64 (about 1e-6 relative);
/// OpenMP over (head, query block). Returns [H][ceil(N_q / G)][ceil(N_k / G)], flattened.
/// @throws invalid_input for mismatched shapes or block < 1.
std::vector<double> block_attention_mass(const tensor_view& q, const tensor_view& k,
                                         std::int64_t block, bool causal = false,
                                         double scale = 0.0);

/// Each block's attention mass and softmax-weighted value sum per head.
struct block_value_statistics {
  /// mass [H][qb][kb] as block_attention_mass; value [H][qb][kb][dv]: the block's softmax weights
  /// times the keys' values, summed over the block and divided by the block row's query rows (a
  /// block row's value sums add up to its rows' mean attention output).
  std::vector<double> mass, value;
  std::int64_t heads = 0, qb = 0, kb = 0, dv = 0;
};

/// block_attention_mass with each block's value sum, v [N_k, H, Dv] on the CPU (Python's
/// block_value_mass): the weights of a block row's queries summed per key, then into the blocks.
/// @throws invalid_input for mismatched shapes or block < 1.
block_value_statistics block_value_mass(const tensor_view& q, const tensor_view& k,
                                        const tensor_view& v, std::int64_t block,
                                        bool causal = false, double scale = 0.0);

/// The blocks kept for the attention output (1 = kept; Python's prune_blocks_by_output): per
/// block row the keep rules' blocks, then one at a time the block that brings the kept blocks'
/// renormalised output sum(value) / sum(mass) nearest (L2) the row's full output, up to
/// (1 - sparsity) of the key blocks the row sees (causal: the last block row aligned with the
/// last key block; at least one); blocks of no mass never; ties to the lower key block.
/// `mass` [heads][qb][kb] and `value` [heads][qb][kb][dv] as block_value_mass gives them (or
/// their averages; the caller's buffers, not copied).
/// @throws invalid_input for mismatched sizes or bad options.
std::vector<std::uint8_t> prune_blocks_by_output(std::span<const double> mass,
                                                 std::span<const double> value, std::int64_t heads,
                                                 std::int64_t qb, std::int64_t kb, std::int64_t dv,
                                                 const prune_options& options, bool causal = false);

/// The kept blocks (1 = kept) of an importance [heads][qb][kb] (mass, |dS|, pooled scores) by
/// `options`, ties to the lower key block (the Python prune_blocks' rule).
/// @throws invalid_input for a size mismatch or bad options (method "output" among them: it
/// needs the value sums, prune_blocks_by_output).
std::vector<std::uint8_t> prune_blocks(const std::vector<double>& importance, std::int64_t heads,
                                       std::int64_t qb, std::int64_t kb,
                                       const prune_options& options);

/// A pattern learned from attention samples: block_attention_mass of q and k pruned by `options`
/// (per head), rows = N_q, cols = N_k, made_by saying how; method "output": block_value_mass with
/// the values `v` [N_k, H, Dv], pruned by prune_blocks_by_output.
/// @throws invalid_input for method "output" without v, and as the steps do.
block_pattern learn_block_pattern(const tensor_view& q, const tensor_view& k, std::int64_t block,
                                  const prune_options& options, bool causal = false,
                                  const std::optional<tensor_view>& v = std::nullopt);

}  // namespace trisparse
