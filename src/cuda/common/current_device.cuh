#pragma once
// The current CUDA device, its SM count and L2 size (plans record them when they are built).
#include <cstdint>
#include <string>

#include "error.cuh"
#include "trisparse/core/error.hpp"

namespace trisparse::cuda {

struct device_id_and_sms {
  int device = 0, sms = 0;
  std::int64_t l2_bytes = 0;
};

inline device_id_and_sms current_device() {
  device_id_and_sms d;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&d.device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, d.device));
  int l2 = 0;
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, d.device));
  d.l2_bytes = l2;
  return d;
}

/// Throws invalid_input unless `device` (where a plan was built, or where `what` lives) is the
/// current device.
inline void expect_current_device(int device, const char* what = "the plan") {
  int current = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&current));
  if (current != device) {
    throw invalid_input(std::string(what) + " is on device " + std::to_string(device) +
                        " but device " + std::to_string(current) + " is current");
  }
}

}  // namespace trisparse::cuda
