#include <cstdio>
#include <string>

#include "device.hpp"
#include "error.cuh"
#include "trisparse/core/tensor.hpp"

namespace trisparse {

device_tensor::device_tensor(dtype type, std::int64_t rows, std::int64_t heads, std::int64_t dim)
    : type_(type), rows_(rows), heads_(heads), dim_(dim) {
  TRISPARSE_EXPECTS_INPUT(rows >= 0 && heads >= 1 && dim >= 1,
                          "device_tensor needs rows >= 0, heads >= 1, dim >= 1");
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device_));
  const std::size_t bytes = static_cast<std::size_t>(rows * heads * dim) * size_of(type);
  TRISPARSE_CUDA_TRY(cudaMalloc(&data_, bytes > 0 ? bytes : 16));
}

device_tensor::device_tensor(const host_tensor& host)
    : device_tensor(host.type(), host.rows(), host.heads(), host.dim()) {
  TRISPARSE_CUDA_TRY(cudaMemcpy(data_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice));
}

device_tensor::~device_tensor() {
  if (data_ != nullptr) cudaFree(data_);
}

device_tensor::device_tensor(device_tensor&& o) noexcept
    : type_(o.type_),
      rows_(o.rows_),
      heads_(o.heads_),
      dim_(o.dim_),
      device_(o.device_),
      data_(o.data_) {
  o.data_ = nullptr;
}

device_tensor& device_tensor::operator=(device_tensor&& o) noexcept {
  std::swap(type_, o.type_);
  std::swap(rows_, o.rows_);
  std::swap(heads_, o.heads_);
  std::swap(dim_, o.dim_);
  std::swap(device_, o.device_);
  std::swap(data_, o.data_);
  return *this;
}

tensor_view device_tensor::view() const {
  return tensor_view::contiguous(data_, type_, rows_, heads_, dim_, device_kind::cuda, device_);
}

host_tensor device_tensor::to_host() const {
  host_tensor h(type_, rows_, heads_, dim_);
  TRISPARSE_CUDA_TRY(cudaDeviceSynchronize());
  TRISPARSE_CUDA_TRY(cudaMemcpy(h.data(), data_, h.size_bytes(), cudaMemcpyDeviceToHost));
  return h;
}

void device_tensor::fill_bytes(unsigned char value) {
  const std::size_t bytes = static_cast<std::size_t>(rows_ * heads_ * dim_) * size_of(type_);
  TRISPARSE_CUDA_TRY(cudaMemset(data_, value, bytes));
}

void device_synchronize() { TRISPARSE_CUDA_TRY(cudaDeviceSynchronize()); }

}  // namespace trisparse

namespace trisparse::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky state, report none
    return 0;
  }
  return n;
}

std::string describe_device(int device) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  char mem[32];
  std::snprintf(mem, sizeof mem, "%.1f",
                static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + mem + " GiB)";
}

}  // namespace trisparse::cuda
