#pragma once
/// @file The segments of segment_attention_plan (trisparse/ops/segment_attention.hpp): a plain
/// view, no plan, so that the backends' private headers take it without the plan's declarations.
#include <cstdint>

namespace trisparse {

/// The segment id of each of `rows` rows, on the device, sorted ascending (ids need not be
/// consecutive: an id missing is an empty segment). Rows and ids are 32-bit or 64-bit integers;
/// rows below 2^31.
struct segment_view {
  std::int64_t rows = 0;
  const void* ids = nullptr;  ///< [rows]
  bool ids_64 = true;         ///< int64 ids (PyG's `batch`), else int32
  int device_id = 0;
};

/// Edges between the rows of segment_view (GPS's local edges, a molecule's bonds), for a score bias
/// per edge: S_ij += bias[e, h] summed over the edges e from key row j to query row i (copies of a
/// pair add). The same E edges in two orders, int32 arrays on the device that the caller keeps
/// alive (trisparse.segment_attention makes them from an edge_index with two sorts):
/// - by query: query_ptr [rows + 1] (offsets), query_key [E] each query row's key rows ascending,
///   query_edge [E] the edge (its index into the bias) of each;
/// - by key: key_ptr [rows + 1], key_query [E] each key row's query rows ascending, key_edge [E].
/// An edge between rows of different segments joins no pair: it adds no score and takes no
/// gradient. query_ptr == nullptr: no edges.
struct segment_edges {
  std::int64_t edges = 0;
  const std::int32_t* query_ptr = nullptr;
  const std::int32_t* query_key = nullptr;
  const std::int32_t* query_edge = nullptr;
  const std::int32_t* key_ptr = nullptr;
  const std::int32_t* key_query = nullptr;
  const std::int32_t* key_edge = nullptr;
};

/// The lists packed in one int32 array in the order above (query_ptr [rows + 1], query_key,
/// query_edge [E], key_ptr [rows + 1], key_query, key_edge [E]: 2 (rows + 1) + 4 E values, as
/// trisparse.segment_attention makes them).
inline segment_edges packed_segment_edges(const std::int32_t* lists, std::int64_t rows,
                                          std::int64_t edges) {
  const std::int32_t* by_key = lists + rows + 1 + 2 * edges;
  return {edges,
          lists,
          lists + rows + 1,
          lists + rows + 1 + edges,
          by_key,
          by_key + rows + 1,
          by_key + rows + 1 + edges};
}

}  // namespace trisparse
