#pragma once
// The current CUDA device and its SM count (plans record both when they are built).
#include "error.cuh"

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

}  // namespace trisparse::cuda
