#pragma once
/// @file Row orders that densify tensor-core blocks: rows that share columns placed in the same
/// 16-row window give fewer, fuller BSB blocks.
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse {

/// The order in which a plan groups rows into windows (outputs always come back in the caller's
/// order). What `automatic` picks depends on the plan (see its options).
enum class row_order : std::uint8_t {
  automatic,  ///< the plan's rule (an order that pays on the measured hardware, else original)
  original,   ///< as given
  rcm,        ///< reverse Cuthill-McKee (square patterns)
  clustered,  ///< greedy windows of rows that share columns (cluster_rows), seeded in RCM order
};
std::string_view to_string(row_order o);
/// "automatic" (or "auto"), "original", "rcm", "clustered". @throws invalid_input otherwise.
row_order parse_row_order(std::string_view name);

/// Reverse Cuthill-McKee order of a square pattern's symmetrised graph: order[i] is the original
/// row placed at position i. Each component is searched breadth-first from an unvisited node of
/// least degree, neighbours by increasing degree (ties by id); the whole order is reversed.
/// Deterministic. @throws invalid_input if the pattern is not square.
std::vector<std::int64_t> reverse_cuthill_mckee(const csr_graph& pattern);

/// An order that keeps a square pattern's communities contiguous, each banded: label
/// propagation over the symmetrised graph (nodes visited in a seeded random order each round,
/// each taking the label most of its neighbours hold, keeping its own among the most frequent,
/// else the smallest; up to `rounds` rounds or until no label changes), then the communities in
/// the order their first node appears in reverse Cuthill-McKee order, each community's nodes in
/// that order. order[i] is the original row placed at position i. Linear time a round, no
/// package, deterministic for a seed. @throws invalid_input if the pattern is not square.
std::vector<std::int64_t> community_order(const csr_graph& pattern, std::uint64_t seed = 1,
                                          int rounds = 20);

}  // namespace trisparse

namespace trisparse {

/// Rows grouped greedily into windows of `window_rows` that share columns, so that a window's
/// distinct columns (ME-BCRS vectors, BSB blocks) are few: each window starts at the next unused
/// row in `seeds` order (all rows in order when empty) and adds, one at a time, the unused row
/// sharing the most columns with the rows already in it (ties: the first seen). Columns with more
/// than `max_column_rows` rows are not used to score (they would make the search quadratic and
/// say little). order[i] is the original row placed at position i; a permutation of all rows.
/// Deterministic. @throws invalid_input if seeds is not empty and not a permutation of the rows.
std::vector<std::int64_t> cluster_rows(const csr_graph& pattern, int window_rows,
                                       std::span<const std::int64_t> seeds = {},
                                       std::int64_t max_column_rows = 512);

/// Number of distinct (window, column) pairs when rows are grouped in windows of `window_rows`
/// in the given order (empty: the pattern's own): the ME-BCRS vector count.
std::int64_t count_window_columns(const csr_graph& pattern, int window_rows,
                                  std::span<const std::int64_t> order = {});

}  // namespace trisparse
