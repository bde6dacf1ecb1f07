#pragma once
// Device workspaces that plans and layers keep between runs (internal).
#include <algorithm>
#include <cstdint>

#include "trisparse/core/tensor.hpp"

namespace trisparse::detail {

/// A contiguous [rows, heads, dim] view over `t`, which is regrown (dropping its contents) when it
/// holds fewer than rows * heads * dim elements of `type`. The caller serialises the runs that
/// share `t`.
inline tensor_view workspace(device_tensor& t, dtype type, std::int64_t rows, std::int64_t heads,
                             std::int64_t dim) {
  const std::int64_t n = std::max<std::int64_t>(rows * heads * dim, 1);
  tensor_view v = t.view();
  if (v.data == nullptr || v.type != type || v.rows < n) {
    t = device_tensor(type, n, 1, 1);
    v = t.view();
  }
  return tensor_view::contiguous(v.data, type, rows, heads, dim, device_kind::cuda, v.device_id);
}

/// [slots, heads, 1] in a sparse plan's slot layout (slot stride 1, one array per head).
inline tensor_view slot_workspace(device_tensor& t, dtype type, std::int64_t slots,
                                  std::int64_t heads) {
  tensor_view v = workspace(t, type, std::max<std::int64_t>(slots, 1), heads, 1);
  v.rows = slots;
  v.row_stride = 1;
  v.head_stride = std::max<std::int64_t>(slots, 1);
  return v;
}

}  // namespace trisparse::detail
