#pragma once
// The current CUDA device and its SM count (plans record both when they are built), and its L2
// size (plans built from host patterns settle their task order with it).
#include <cstdint>
#include <string>

#include "error.cuh"
#include "trisparse/core/error.hpp"

namespace trisparse::cuda {

struct device_id_and_sms {
  int device = 0, sms = 0;
};

inline device_id_and_sms current_device() {
  device_id_and_sms d;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&d.device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, d.device));
  return d;
}

// The current device's L2 size; a query of its own, as only plan builds need it (launches call
// current_device() on the run path).
inline std::int64_t current_l2_bytes() {
  int device = 0, l2 = 0;
  TRISPARSE_CUDA_TRY(cudaGetDevice(&device));
  TRISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  return l2;
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
