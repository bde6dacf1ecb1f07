#pragma once
/// @file Caller-owned scratch memory for a plan's run (CUB's two-phase workspace): ask the plan
/// for `workspace_bytes(...)`, pass at least that many bytes of device memory to `run(...,
/// workspace, stream)`. The plan writes the workspace on the stream and reads it back there; it
/// keeps nothing in it between runs, so runs given different workspaces may overlap on different
/// streams, and a run whose workspace comes from a stream-ordered allocator (PyTorch's caching
/// allocator) can be captured in a CUDA graph.
#include <cstddef>

namespace trisparse {

/// Non-owning device memory: `bytes` bytes at `data` (256-byte aligned; nullptr with 0 bytes
/// where the run needs none).
/// (Two-argument construction only, so that `{stream}` never reads as a workspace.)
struct workspace_view {
  constexpr workspace_view() = default;
  constexpr workspace_view(void* d, std::size_t n) : data(d), bytes(n) {}
  /// No memory: runs given an empty workspace use the plan's own.
  constexpr bool empty() const { return data == nullptr && bytes == 0; }
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// Alignment of every segment that a plan carves out of a workspace.
inline constexpr std::size_t kWorkspaceAlignment = 256;

}  // namespace trisparse
