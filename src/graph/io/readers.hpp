#pragma once
// The individual readers behind read_edges (internal).
#include <span>
#include <string>
#include <vector>

#include "source.hpp"
#include "trisparse/graph/io.hpp"

namespace trisparse::io {

loaded_graph read_edge_list(byte_source& src, const std::string& name);
loaded_graph read_matrix_market(byte_source& src, const std::string& name);
std::vector<std::int64_t> read_graph_ptr(byte_source& src, const std::string& name,
                                         std::int64_t num_nodes);
/// Binary formats parse a whole buffer.
loaded_graph read_npy_edge_index(std::span<const std::byte> bytes, const std::string& name);
loaded_graph read_npz(std::span<const std::byte> bytes, const std::string& name,
                      std::uint64_t max_bytes);
csr_graph read_cache_bytes(std::span<const std::byte> bytes, const std::string& name);

}  // namespace trisparse::io
