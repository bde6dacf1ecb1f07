#pragma once
// An owning, move-only device allocation: cudaMalloc / cudaFree, or stream-ordered
// (cudaMallocAsync / cudaFreeAsync on the stream it was made on, which must outlive it).
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "error.cuh"

namespace trisparse::cuda {

template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : n_(n) {
    if (n > 0) TRISPARSE_CUDA_TRY(cudaMalloc(&p_, n * sizeof(T)));
  }
  /// Copies a host vector to a new device buffer (synchronous).
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) {
    if (n_ > 0)
      TRISPARSE_CUDA_TRY(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  /// Stream-ordered: n elements allocated on `stream` (no host synchronisation), released there.
  device_buffer(std::size_t n, cudaStream_t stream) : n_(n), stream_(stream), ordered_(true) {
    if (n > 0) TRISPARSE_CUDA_TRY(cudaMallocAsync(&p_, n * sizeof(T), stream));
  }
  /// Stream-ordered copy of a host vector: the host data is staged before this returns, the copy
  /// runs in `stream`'s order (no host synchronisation).
  device_buffer(const std::vector<T>& host, cudaStream_t stream)
      : device_buffer(host.size(), stream) {
    if (n_ > 0) {
      TRISPARSE_CUDA_TRY(
          cudaMemcpyAsync(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice, stream));
    }
  }
  ~device_buffer() {
    if (p_ == nullptr) return;
    if (ordered_)
      cudaFreeAsync(p_, stream_);
    else
      cudaFree(p_);
  }
  device_buffer(device_buffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)),
        n_(std::exchange(o.n_, 0)),
        stream_(o.stream_),
        ordered_(o.ordered_) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(stream_, o.stream_);
    std::swap(ordered_, o.ordered_);
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
  cudaStream_t stream_ = nullptr;
  bool ordered_ = false;
};

}  // namespace trisparse::cuda
