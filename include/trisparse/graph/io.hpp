#pragma once
/// @file Readers and writers of graph files. Every reader throws invalid_input whose message
/// starts with "FILE:LINE:" (text formats) or "FILE[array]:" (npy/npz) and names the problem.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trisparse/graph/csr.hpp"

namespace trisparse {

/// File formats the readers understand. `automatic` picks by magic bytes and extension.
enum class file_format : std::uint8_t {
  automatic,
  edge_list,      ///< SNAP-style "src dst [weight]" lines; '#' / '%' comments; ',' or blanks
  matrix_market,  ///< %%MatrixMarket matrix coordinate pattern|real|integer general|symmetric
  npz,            ///< NumPy archive with src_li, dst_li, num_nodes (or edge_index)
  npy,            ///< NumPy edge_index of shape [2, E] (int32 or int64)
  cache,          ///< trisparse binary cache (versioned, CRC-32 checked)
};

/// How to treat a file that says its edges are undirected (edge list header "directed: no").
enum class symmetry : std::uint8_t {
  automatic,  ///< symmetrize exactly when the file says it is undirected
  as_stored,  ///< keep the edges exactly as listed
  symmetrize  ///< always add reverse edges
};

struct read_options {
  file_format format = file_format::automatic;
  symmetry sym = symmetry::automatic;
  self_loops loops = self_loops::keep;
  /// Upper bound on decompressed bytes, on array sizes, and on the CSR a file's declared sizes
  /// imply (bounds memory on hostile input: a few bytes can declare 2^31 nodes).
  std::uint64_t max_bytes = std::uint64_t{1} << 34;
};

/// What a file says about itself, beyond its edges.
struct file_info {
  file_format format = file_format::automatic;
  std::optional<bool> directed;  ///< from an edge-list header or MatrixMarket symmetry
  std::optional<std::int64_t> declared_nodes;
  std::optional<std::int64_t> declared_edges;
  std::string description;  ///< first comment line, if any
};

/// A graph as read, before preprocessing.
struct loaded_graph {
  coo_graph edges;
  file_info info;
};

/// Reads a graph file (plain, .gz or .xz compressed text; npz; npy; cache) without preprocessing.
/// @throws invalid_input "FILE:LINE: problem" on malformed content; error if the file is missing.
loaded_graph read_edges(const std::filesystem::path& path, const read_options& options = {});

/// The same from bytes in memory; `name` is used in messages and, with `automatic`, for the
/// extension.
loaded_graph read_edges_from_memory(std::span<const std::byte> bytes, std::string_view name,
                                    const read_options& options = {});

/// read_edges followed by to_csr with the options' symmetry and self-loop rules
/// (duplicates merged, rows sorted).
csr_graph read_graph(const std::filesystem::path& path, const read_options& options = {});

/// Reads a graph pointer file (G + 1 non-decreasing offsets, one per line, first 0).
/// @throws invalid_input "FILE:LINE: problem".
std::vector<std::int64_t> read_graph_ptr(const std::filesystem::path& path,
                                         std::int64_t num_nodes = -1);

/// Writes "src dst" lines (and a weight column when the graph has values) with a header.
void write_edge_list(const csr_graph& g, const std::filesystem::path& path);
/// Writes MatrixMarket coordinate general (pattern or real).
void write_matrix_market(const csr_graph& g, const std::filesystem::path& path);
/// Writes the binary cache: magic, version, sizes, arrays and a CRC-32 of everything before it.
void write_cache(const csr_graph& g, const std::filesystem::path& path);
/// Reads the binary cache straight into a CSR (checked).
csr_graph read_cache(const std::filesystem::path& path, const read_options& options = {});

/// Writes a C-order .npy array of the given shape from raw little-endian data.
/// descr is a NumPy type string such as "<f4", "<f2", "<i8".
void write_npy(const std::filesystem::path& path, std::string_view descr,
               std::span<const std::int64_t> shape, const void* data, std::size_t bytes);

/// Name of a format ("edge_list", ...), and the format a path's extension or content implies.
std::string_view to_string(file_format f);
file_format parse_file_format(std::string_view name);

}  // namespace trisparse
