#pragma once
// Helpers over block-sparse masks that the plans and the CPU oracle share (internal).
#include <cstdint>
#include <utility>

#include "trisparse/formats/block_sparse.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse::detail {

/// Attended (query, key) pairs of one mask: per kept block, its rows' keys up to the causal limit
/// (all mask heads summed).
std::int64_t attended_pairs(const block_sparse_mask& m);

/// The element pattern of mask head h over the whole batch: rows are the packed query rows,
/// columns the packed key rows, sequence b's expansion placed at (cu_seqlens_q[b],
/// cu_seqlens_k[b]).
csr_graph batch_pattern(const block_sparse_mask& m, std::int64_t h);

/// The longest sequence's query and key blocks (QB, KB): the block grid a mask of the batch covers.
std::pair<std::int64_t, std::int64_t> most_blocks(const block_sparse_mask& m);

/// A block mask of lq x lk at block g with no blocks yet (row_ptr holds its first 0).
block_mask empty_block_mask(std::int64_t lq, std::int64_t lk, std::int64_t g);

/// The top-k plan's mask before any selection: every block row holds `slots` ascending values,
/// its first allowed blocks and then, past them (fill_past = true), the sequence's key-block
/// count; with fill_past = false only the allowed ones (a mask check() accepts).
block_sparse_mask topk_rows(const block_sparse_mask& shape, std::int64_t slots, bool fill_past);

}  // namespace trisparse::detail
