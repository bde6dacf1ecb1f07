#pragma once
// Segments of a workspace (internal): the sizes a run needs, added in order and aligned, then
// carved from one allocation. Segments added with `add_zeroed` come first: a run on a fresh
// workspace clears [0, zeroed_bytes()) with one stream-ordered memset; the kernels leave them
// zero again, so a plan's own workspace is cleared once, when it is built.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "trisparse/core/error.hpp"
#include "trisparse/core/tensor.hpp"
#include "trisparse/core/workspace.hpp"

namespace trisparse::detail {

class workspace_layout {
 public:
  /// Reserves `bytes` (possibly 0) and returns the segment's offset.
  std::size_t add(std::size_t bytes) {
    const std::size_t at = bytes_;
    bytes_ += round_up(bytes);
    return at;
  }
  /// As add(), for counters that must be zero when a kernel starts. Only before any add().
  std::size_t add_zeroed(std::size_t bytes) {
    if (bytes_ != zeroed_) throw std::logic_error("workspace_layout: zeroed segments come first");
    const std::size_t at = add(bytes);
    zeroed_ = bytes_;
    return at;
  }
  std::size_t bytes() const { return bytes_; }
  std::size_t zeroed_bytes() const { return zeroed_; }

  /// The segment at `offset` of `ws`, typed; `ws` must hold bytes() bytes (checked by `check`).
  template <class T>
  static T* at(const workspace_view& ws, std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<std::byte*>(ws.data) + offset);
  }

  /// Throws invalid_input unless `ws` is large enough and aligned, naming what runs it.
  void check(const workspace_view& ws, const char* what) const {
    TRISPARSE_EXPECTS_INPUT(ws.bytes >= bytes_ && (bytes_ == 0 || ws.data != nullptr),
                            std::string(what) + ": the workspace holds " +
                                std::to_string(ws.bytes) + " bytes, this run needs " +
                                std::to_string(bytes_) + " (ask workspace_bytes())");
    TRISPARSE_EXPECTS_INPUT(reinterpret_cast<std::uintptr_t>(ws.data) % kWorkspaceAlignment == 0,
                            std::string(what) + ": the workspace must be " +
                                std::to_string(kWorkspaceAlignment) + "-byte aligned");
  }

 private:
  static std::size_t round_up(std::size_t b) {
    return (b + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  }
  std::size_t bytes_ = 0, zeroed_ = 0;
};

/// A contiguous CUDA [rows, heads, dim] view of the workspace segment at `offset`.
inline tensor_view segment_view(const workspace_view& ws, std::size_t offset, dtype type,
                                std::int64_t rows, std::int64_t heads, std::int64_t dim,
                                int device) {
  return tensor_view::contiguous(workspace_layout::at<void>(ws, offset), type, rows, heads, dim,
                                 device_kind::cuda, device);
}

/// The same as [slots, heads, 1] in a sparse plan's slot layout (slot stride 1, heads apart).
inline tensor_view slot_view(const workspace_view& ws, std::size_t offset, dtype type,
                             std::int64_t slots, std::int64_t heads, int device) {
  tensor_view v = segment_view(ws, offset, type, slots, heads, 1, device);
  v.row_stride = 1;
  v.head_stride = slots > 1 ? slots : 1;
  return v;
}

}  // namespace trisparse::detail
