// Without the CUDA backend there are no devices: device queries answer so and device tensors
// cannot be made. (The backends' entry points need no stand-ins: entry.hpp.)
#include "device.hpp"
#include "trisparse/core/error.hpp"
#include "trisparse/core/tensor.hpp"

namespace trisparse {
device_tensor::device_tensor(dtype, std::int64_t, std::int64_t, std::int64_t) {
  throw not_supported("device_tensor: this build has no CUDA backend");
}
device_tensor::device_tensor(const host_tensor&) {
  throw not_supported("device_tensor: this build has no CUDA backend");
}
device_tensor::~device_tensor() = default;
device_tensor::device_tensor(device_tensor&&) noexcept = default;
device_tensor& device_tensor::operator=(device_tensor&&) noexcept = default;
// Never made (the constructors throw): the view of an empty tensor.
tensor_view device_tensor::view() const {
  return tensor_view::contiguous(data_, type_, rows_, heads_, dim_, device_kind::cuda, device_);
}
host_tensor device_tensor::to_host() const { return {}; }
void device_tensor::fill_bytes(unsigned char) {}
void device_synchronize() {}
}  // namespace trisparse

namespace trisparse::cuda {
int device_count() { return 0; }
std::string describe_device(int) { return ""; }
}  // namespace trisparse::cuda
