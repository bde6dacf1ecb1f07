#pragma once
// Device queries that host code can call whether or not the CUDA backend is built (internal).
#include <string>

namespace trisparse::cuda {

/// Visible CUDA devices (0 without the CUDA backend, a driver or a device).
int device_count();

/// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" or "" if the device cannot be queried.
std::string describe_device(int device);

}  // namespace trisparse::cuda
