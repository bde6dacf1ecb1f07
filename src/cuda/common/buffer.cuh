#pragma once
// An owning, move-only device allocation (cudaMalloc / cudaFree).
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
  ~device_buffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  device_buffer(device_buffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
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
};

}  // namespace trisparse::cuda
