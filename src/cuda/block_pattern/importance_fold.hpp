#pragma once
// The CUDA kernels of a pattern learner's tracked step (internal; the public interface and its
// checks: include/trisparse/ops/importance_fold.hpp, src/ops/importance_fold.cpp).
#include <cstdint>
#include <cstring>

#include "../common/entry.hpp"
#include "trisparse/core/stream.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/ops/importance_fold.hpp"

namespace trisparse {

/// The ranking key of prune_block_importance, for the CPU loops and the kernels alike: the
/// unsigned order of the keys is the order of the values, NaN highest, -0 as 0.
TRISPARSE_HOST_DEVICE std::uint64_t prune_rank_key(double x) {
  if (x != x) return ~std::uint64_t{0};
  if (x == 0.0) x = 0.0;
  std::uint64_t bits = 0;
  memcpy(&bits, &x, sizeof bits);
  return (bits >> 63) != 0 ? ~bits : bits | (std::uint64_t{1} << 63);
}

/// The global prune's split on CUDA: a head of more than kPruneOneBlockKeys blocks is ranked in
/// chunks of kPruneChunkKeys blocks, a thread block each, through per-head sums in the workspace:
/// 8 passes' digit counts [heads][8][256], the state before each pass (4 words) [heads][8] and
/// the keys at the threshold a chunk [heads][chunks], all 64-bit.
inline constexpr std::int64_t kPruneChunkKeys = 8192;
inline constexpr std::int64_t kPruneOneBlockKeys = 16384;

/// Chunks a head of the global prune runs in (0: one thread block a head, no workspace).
inline std::int64_t prune_chunks(std::int64_t qb, std::int64_t kb, prune_scope scope) {
  const std::int64_t length = qb * kb;
  if (scope != prune_scope::global || length <= kPruneOneBlockKeys) return 0;
  return (length + kPruneChunkKeys - 1) / kPruneChunkKeys;
}

/// 64-bit words of the global prune's workspace a head.
inline std::int64_t prune_words_per_head(std::int64_t chunks) {
  return chunks == 0 ? 0 : 8 * 256 + 8 * 4 + chunks;
}

}  // namespace trisparse

namespace trisparse::cuda {

/// The pooled block mass of q and k (checked views on one device) into out, the block means in
/// `means` (pooled_block_mass_workspace_bytes); scale > 0.
TRISPARSE_CUDA_ENTRY(void pooled_block_mass(const tensor_view& q, const tensor_view& k,
                                            std::int64_t block, bool causal, double scale,
                                            double* out, double* means, const bool* due,
                                            stream_ref stream))

/// fold_block_importance on the device (checked arguments, at least one block).
TRISPARSE_CUDA_ENTRY(void fold_block_importance(const importance_fold_args& args,
                                                stream_ref stream))

/// advance_learner_schedule on the device (checked arguments).
TRISPARSE_CUDA_ENTRY(void advance_learner_schedule(const learner_schedule_args& args,
                                                   stream_ref stream))

/// prune_block_importance on the device (checked arguments and workspace, at least one block).
TRISPARSE_CUDA_ENTRY(void prune_block_importance(const block_prune_args& args, stream_ref stream))

}  // namespace trisparse::cuda
