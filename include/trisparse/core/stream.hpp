#pragma once
/// @file A non-owning reference to a CUDA stream that host code can hold without CUDA headers.

namespace trisparse {

/// Wraps a cudaStream_t (nullptr = the default stream). CPU backends ignore it.
struct stream_ref {
  void* handle = nullptr;
};

}  // namespace trisparse
