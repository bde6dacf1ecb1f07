#pragma once
/// @file Row orders that densify tensor-core blocks: rows that share columns placed in the same
/// 16-row window give fewer, fuller BSB blocks.
#include <cstdint>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse {

/// Reverse Cuthill-McKee order of a square pattern's symmetrised graph: order[i] is the original
/// row placed at position i. Each component is searched breadth-first from an unvisited node of
/// least degree, neighbours by increasing degree (ties by id); the whole order is reversed.
/// Deterministic. @throws invalid_input if the pattern is not square.
std::vector<std::int64_t> reverse_cuthill_mckee(const csr_graph& pattern);

}  // namespace trisparse
