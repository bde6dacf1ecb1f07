#pragma once
// Test helper: a host_tensor mirrored on the device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "support.hpp"

#define SKIP_WITHOUT_GPU() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible: skipping"

namespace trisparse::test {

/// TRISPARSE_GPU_TEST_QUICK=1 (scripts/gpu_dev.sh, compute-sanitizer runs): the suite in one device
/// call, every kernel and dtype still covered, fewer repeats of the larger shapes.
inline bool quick() {
  const char* q = std::getenv("TRISPARSE_GPU_TEST_QUICK");
  return q != nullptr && *q == '1';
}

/// Normwise tolerance of a GPU kernel's result: `units` roundings of the input type (f32 inputs run
/// as tf32: 11 significant bits) plus as many of the output type, plus 1e-5.
inline double gpu_tolerance(dtype in, dtype out, double units) {
  const double u_in = in == dtype::f32 ? std::ldexp(1.0, -11) : unit_roundoff(in);
  return units * (u_in + unit_roundoff(out)) + 1e-5;
}

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

class device_tensor {
 public:
  explicit device_tensor(const host_tensor& h) : h_(h) {
    cuda_check(cudaMalloc(&d_, std::max<std::size_t>(h.size_bytes(), 16)), "cudaMalloc");
    upload();
  }
  ~device_tensor() { cudaFree(d_); }
  device_tensor(const device_tensor&) = delete;
  device_tensor& operator=(const device_tensor&) = delete;
  void upload() {
    cuda_check(cudaMemcpy(d_, h_.data(), h_.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  /// Fills the device copy with 0xFF bytes (NaN in every float type): unwritten outputs show.
  // Waits for the memset: a kernel on a non-blocking stream does not wait for the legacy stream.
  void poison() {
    cuda_check(cudaMemset(d_, 0xFF, h_.size_bytes()), "poison");
    cuda_check(cudaDeviceSynchronize(), "poison");
  }
  host_tensor download() {
    cuda_check(cudaDeviceSynchronize(), "kernel");
    cuda_check(cudaMemcpy(h_.data(), d_, h_.size_bytes(), cudaMemcpyDeviceToHost), "download");
    return h_;
  }
  tensor_view view() {
    tensor_view v = h_.view();
    v.data = d_;
    v.where = device_kind::cuda;
    return v;
  }

 private:
  host_tensor h_;
  void* d_ = nullptr;
};

/// A host vector copied to the device (index arrays of patterns given as views).
template <class T>
struct device_array {
  T* p = nullptr;
  explicit device_array(const std::vector<T>& h) {
    cuda_check(cudaMalloc(&p, std::max<std::size_t>(h.size() * sizeof(T), 16)), "cudaMalloc");
    cuda_check(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  ~device_array() { cudaFree(p); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
};

/// Runs `run` (which writes `out`) twice, poisoning `out` before each, and asserts that both
/// results are bitwise equal (a race or an unwritten element shows); `first` gets the first.
/// Expects got finite and within tol (normwise, relative to want's largest magnitude) of want.
inline void expect_close(const host_tensor& got, const host_tensor& want, double tol,
                         const char* what) {
  const error_report e = compare(got, want);
  EXPECT_TRUE(e.finite) << what << ": NaN or infinity (an unwritten element?)";
  EXPECT_LE(e.max_abs, tol * e.max_ref) << what << ": max abs " << e.max_abs << " of " << e.max_ref;
}

inline void run_twice_identically(device_tensor& out, const std::function<void()>& run,
                                  host_tensor& first) {
  out.poison();
  run();
  first = out.download();
  out.poison();
  run();
  const host_tensor second = out.download();
  ASSERT_EQ(std::memcmp(first.data(), second.data(), first.size_bytes()), 0)
      << "runs differ: a race";
}

}  // namespace trisparse::test
