// Without the CUDA backend there are no devices.
#include "device.hpp"

namespace trisparse::cuda {
int device_count() { return 0; }
std::string describe_device(int) { return ""; }
}  // namespace trisparse::cuda
