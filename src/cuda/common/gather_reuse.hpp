#pragma once
// Host code (no CUDA): the order of the graph kernels' (window, head) tasks. The fused 3S forward
// and the tensor-core backward passes gather, per window of 16 rows, the K and V rows (or Q and
// dO rows) of the window's columns. With a window's heads side by side (the default), the rows
// in flight at a time are every head's; on a graph whose windows share few columns with their
// neighbours (a social network in its own id order) and whose gathered rows outgrow the L2 cache,
// most gathers then come from DRAM. Every window of one head before the next head's keeps one
// head's rows in flight (1/H of the bytes), which the L2 holds, at the cost of the row tensors
// read a head's slice at a time (3-11 % slower where the gathers hit the L2 anyway). The choice
// is the L2 model below, on the pattern's reuse distances (docs/notes/fused3s.md, "Head order").
#include <array>
#include <cstdint>
#include <span>

#include "trisparse/graph/csr.hpp"
#include "trisparse/ops/attention.hpp"

namespace trisparse::cuda {

/// The share of the L2 cache the model lets the gathered rows and the streamed rows use (the
/// rest: the pattern's metadata, the written rows, what other work leaves there).
inline constexpr double kReuseL2Share = 0.5;

/// Heads run one after the other where that saves at least this share of the pass's row loads
/// (gathers plus the rows' own) from DRAM, by the model. H100, 2026-12-07, 8 heads x 64, the 18
/// shared graphs >= 200K nnz, both orders in one call: the forward 1.23 / 1.27 / 1.045 x faster
/// and the backward 1.08 / 1.15 / 1.04 / 1.09 x on the four graphs the model puts at 0.22-0.54
/// (gemsec_deezer_ro / _hu / gemsec_fb_media / musae_github); level or slower (0.74-1.02 x) on
/// the others, which it puts at 0.19 and below (`fused3s_head_order_ab_h100.jsonl`).
inline constexpr double kHeadsOuterSaving = 0.2;

/// How far apart, in windows of 16 rows in the order the tasks take them, two windows are that
/// gather the same column: a histogram by quarter octaves (bin b: distances d with
/// floor(4 log2 d) = b); first gathers are `gathers` less the histogram's sum.
struct gather_reuse {
  static constexpr int kBins = 128;
  std::int64_t rows = 0, cols = 0, windows = 0;
  std::int64_t gathers = 0;  ///< distinct (window, column) pairs: the rows a pass gathers
  std::array<std::int64_t, kBins> by_distance{};
  /// For 16-bit rows of head dim 32, 64, 128 and 256 (the tensor-core kernels' inputs): the fewest
  /// heads whose tasks run head by head under head_order::automatic (0: never), as
  /// settle_head_orders decides them for the plan's device.
  std::array<std::int64_t, 4> min_heads{};
};

/// The reuse distances of a host pattern whose window position i holds row order[i] (empty: the
/// rows' own order). O(nnz + cols) time, O(cols) memory.
gather_reuse gather_reuse_of(const csr_graph& pattern, std::span<const std::int64_t> order);

/// The share of a pass's row loads (its gathers and its rows' own) that running the heads one
/// after the other keeps in an L2 of `l2_bytes`, by the model: a gather hits where the bytes
/// touched since its column's last gather fit kReuseL2Share of the L2. Over d windows a head's
/// tasks touch the gathered rows of cols (1 - e^(-d g / cols)) distinct columns (g gathers a
/// window) and the windows' own 16 rows, two tensors each of head_dim elements; all `heads`
/// heads' tasks touch `heads` times that.
double heads_outer_saving(const gather_reuse& reuse, std::int64_t heads, std::int64_t head_dim,
                          std::int64_t element_bytes, std::int64_t l2_bytes);

/// Fills reuse.min_heads for an L2 of `l2_bytes` (the saving grows with the heads: a search over
/// them per head dim, at plan build, so that runs decide with a comparison).
void settle_head_orders(gather_reuse& reuse, std::int64_t l2_bytes);

/// Whether a pass of 16-bit rows takes its tasks head by head: as `asked`, and for
/// head_order::automatic where it has at least reuse.min_heads heads (a saving of at least
/// kHeadsOuterSaving; never for an unsettled or empty `reuse`: plans from device patterns,
/// batches of small graphs whose gathers stay local).
bool heads_outer(head_order asked, const gather_reuse& reuse, std::int64_t heads,
                 std::int64_t head_dim);

}  // namespace trisparse::cuda
