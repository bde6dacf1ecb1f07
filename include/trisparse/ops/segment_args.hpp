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

}  // namespace trisparse
